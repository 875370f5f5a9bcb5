"""
The one prepared command for a lent GPU machine: the stand-in measurement (bench/fullsize_gpu.py),
the blocks' attention timed per processor and backend (bench/attention.py --gpu), then the program
itself, train.py and sample.py, as a user runs them on one GPU.

    python -m bench.gpu_check                     # on one GPU, ~10 minutes at most -> results/gpu_check.{md,json}
    python -m bench.gpu_check --device=cpu        # the same phases on a CPU (the rehearsal's 1-block models)
    python -m bench.gpu_check --device=cpu --tiny # the same with the tests' tiny models: a few minutes

Models: the real weights when weights/ has them (the download commands of train.py's settings:
HunyuanVideo-1.5-480p_t2v, VideoReward, Qwen2-VL-2B-Instruct, clip-vit-large-patch14, PickScore_v1),
otherwise bench/rehearsal.py's random models at real width built here (cached in cache_dir), with
`blocks` transformer blocks: 54 (the real depth) on a GPU, whose 8.3B parameters fit one GPU with
LoRA (config/lora_1gpu.py, the one-GPU setting), 1 on a CPU.
Phases, each a subprocess (its own CUDA peak: torch.cuda.max_memory_allocated at its exit, and the
peak resident memory of its process tree; wall time):
1. fullsize: `python -m bench.fullsize_gpu` (on a CPU: with --tiny), the stand-in forward + step
   attention: `python -m bench.attention --gpu` (on a CPU: with --tiny), one block's forward +
   backward per processor and backend -> results/attention_gpu.md (alone: that command)
2. build: the rehearsal's models (skipped with real weights; cached)
3. train: `python train.py config/lora_1gpu.py` on them: 1 iteration of 2 sampler steps, a tiny
   video, evaluation at the start and end with CLIPScore and PickScore, a checkpoint, no export
4. resume: the same command with --init_from=resume: reads the checkpoint, nothing left to train, exports
5. sample: `python sample.py` from the export (with VideoAlign, CLIPScore, PickScore in its table)
Then |ratio - 1| of the first update against the 1e-4 clip (max and clipped fraction, from
metrics.jsonl): with one optimizer step per rollout batch theta == theta_old, so any |ratio - 1| is the
numerical gap between the rollout's forward and the update's (bf16, batch size, checkpointing); above
1e-4 the clip would zero the policy gradient of those steps.
Its results are written by a GPU run (none in results/ yet); tests/test_fullsize.py runs its CPU path.
"""
import json
import os
import sys

from infra.configurator import configure

# ----------------------------------------------------------------------------- settings
device = 'cuda'                 # 'cuda' (one GPU) or 'cpu' (the check of this script)
weights_dir = 'weights'         # real weights, if present, in the layout train.py's defaults name
blocks = None                   # blocks of the random transformer (None: 54 on cuda, 1 on cpu)
num_frames = 9                  # the video of the check: 9 frames at 64x112 -> latents 32 x 3 x 4 x 7
height = 64
width = 112
num_steps = 2                   # sampler steps (both trained)
fullsize = True                 # run bench.fullsize_gpu first (the stand-in measurement)
time_attention = True           # run bench.attention --gpu (the blocks' attention timed per backend)
cache_dir = '/tmp/sage-rehearsal/models'  # the random models (bench/rehearsal.py builds them)
work_dir = '/tmp/sage-gpu-check'  # train.py's out_dir and sample.py's output (wiped at the start)
out = 'results/gpu_check'       # writes out.md and out.json
phase_timeout = 300             # seconds: a GPU phase that runs longer is killed (10 minutes in all)
tiny = False                    # --tiny: tests/tiny_*.py's models instead (a check of this script on a CPU)
config = configure(globals(), [a + '=True' if a == '--tiny' else a for a in sys.argv[1:]])
# -----------------------------------------------------------------------------

# runs a script as `python script args` would, then prints its process's CUDA peak (0 on a CPU)
PEAK = ("import atexit, runpy, sys, torch\n"
        "atexit.register(lambda: print('PEAK_CUDA_BYTES', torch.cuda.max_memory_allocated() "
        "if torch.cuda.is_available() else 0, flush=True))\n"
        "sys.argv = sys.argv[1:]\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n")


def cuda_peak(log):
    with open(log) as f:
        hits = [l.split()[1] for l in f if l.startswith('PEAK_CUDA_BYTES')]
    return round(int(hits[-1]) / 2 ** 30, 2) if hits else None


def main():
    import shutil

    from bench import rehearsal as R
    py, cuda = sys.executable, device != 'cpu'
    n_blocks = blocks or (54 if cuda else 1)
    shutil.rmtree(work_dir, ignore_errors=True)
    os.makedirs(work_dir)
    w = lambda *p: os.path.join(weights_dir, *p)
    real = all(os.path.isdir(p) for p in (w('HunyuanVideo-1.5-480p_t2v', 'transformer'), w('VideoReward'),
                                           w('Qwen2-VL-2B-Instruct'), w('clip-vit-large-patch14'), w('PickScore_v1')))
    res = dict(device=device, real_weights=real, blocks=None if real else n_blocks, phases=[], config=config)
    if cuda:
        import torch
        res['gpu'] = torch.cuda.get_device_name(0)

    def phase(name, cmd, script=False):
        cmd = [py, '-c', PEAK] + cmd if script else cmd
        r = R.run_phase(name, cmd, os.path.join(work_dir, 'logs'), timeout=phase_timeout if cuda else None)
        r.update(cmd=R.short(([py] + cmd[3:]) if script else cmd), cuda_peak_gb=cuda_peak(r['log']))
        res['phases'].append(r)
        print(f'[{name}] peak CUDA memory allocated: {r["cuda_peak_gb"]} GiB', flush=True)
        if r['rc'] != 0:
            res['failed'] = name
            write(res)
            raise SystemExit(f'{name} failed (exit {r["rc"]}): {r["log"]}')

    if fullsize and not tiny:
        phase('fullsize', [py, '-m', 'bench.fullsize_gpu', f'--device={device}'] + ([] if cuda else ['--tiny']))
    if time_attention and not tiny:
        phase('attention', [py, '-m', 'bench.attention', '--gpu', f'--device={device}'] + ([] if cuda else ['--tiny']))
    if real:
        d = dict(hunyuan=w('HunyuanVideo-1.5-480p_t2v'), videoalign=w('VideoReward'), qwen=w('Qwen2-VL-2B-Instruct'),
                 clip=w('clip-vit-large-patch14'), pickscore=w('PickScore_v1'))
    elif tiny:  # the size dicts of the tests, through the rehearsal's build (seconds)
        import tiny_clip
        import tiny_hunyuan
        import tiny_videoalign
        d = R.build(os.path.join(work_dir, 'tiny'), 2, (tiny_hunyuan.TINY, tiny_videoalign.TINY,
                                                          {k: tiny_clip.TINY for k in R.CLIP}))
        res['blocks'] = 'tiny'
    else:
        phase('build', [py, '-m', 'bench.rehearsal', '--build_only', f'--blocks={n_blocks}', f'--cache_dir={cache_dir}'])
        d = R.dirs(cache_dir, n_blocks)
    prompts = os.path.join(work_dir, 'prompts.txt')
    with open(prompts, 'w') as f:
        f.write('\n'.join(R.PROMPTS['eval']) + '\n')  # 1000 Qwen + 256 ByT5 tokens each
    run_dir = os.path.join(work_dir, 'out')
    common = ['config/lora_1gpu.py', f'--model={d["hunyuan"]}', f'--videoalign_dir={d["videoalign"]}',
              f'--qwen_dir={d["qwen"]}', '--eval_metrics=clipscore,pickscore', f'--clip_dir={d["clip"]}',
              f'--pickscore_dir={d["pickscore"]}', f'--train_prompts={prompts}', f'--eval_prompts={prompts}',
              f'--out_dir={run_dir}', f'--device={device}', f'--num_frames={num_frames}', f'--height={height}',
              f'--width={width}', '--fps=8', f'--num_steps={num_steps}', '--prompts_per_iter=1', '--group_size=2',
              '--eval_every=0', '--save_every=1', '--diag_every=0', '--eval_videos=1', '--max_iters=1']
    phase('train', ['train.py'] + common + ['--export_dtype='], script=True)
    phase('resume', ['train.py'] + common + ['--init_from=resume'], script=True)
    aligned = R.aligned_dir(d['hunyuan'], os.path.join(run_dir, 'export'), os.path.join(work_dir, 'aligned'))
    sample_dir = os.path.join(work_dir, 'samples')
    phase('sample', ['sample.py', f'--model={aligned}', '--checkpoint=', f'--prompts={prompts}', '--num_prompts=2',
                     f'--num_steps={num_steps}', f'--num_frames={num_frames}', f'--height={height}', f'--width={width}',
                     '--fps=8', f'--device={device}', f'--out_dir={sample_dir}', f'--videoalign_dir={d["videoalign"]}',
                     f'--qwen_dir={d["qwen"]}', '--eval_metrics=clipscore,pickscore', f'--clip_dir={d["clip"]}',
                     f'--pickscore_dir={d["pickscore"]}'], script=True)
    (row,) = [r for r in R.metrics_rows(run_dir) if 'reward' in r]
    res['first_update'] = dict(ratio_max=row.get('ratio_max'), clipfrac=row['clipfrac'], clip_range=1e-4,
                               train_peak_mem_gb=row['peak_mem_gb'], t_rollout=row['t_rollout'],
                               t_reward=row['t_reward'], t_update=row['t_update'])
    print(f"first update: max |ratio - 1| = {row.get('ratio_max')} against the clip 1e-4; clipped fraction "
          f"{row['clipfrac']}", flush=True)
    with open(os.path.join(sample_dir, 'metrics.json')) as f:
        res['sample_metrics'] = json.load(f)
    write(res)


def write(res):
    models = 'Real weights' if res['real_weights'] else "The tests' tiny random models" if res['blocks'] == 'tiny' \
        else f'Random models at real width, {res["blocks"]} block(s)'
    md = ['# GPU check: the program itself on one device', '',
          f'Written by `python -m bench.gpu_check --device={res["device"]}{" --tiny" if res["blocks"] == "tiny" else ""}` '
          '(bench/gpu_check.py). '
          f'{models}{", " + res["gpu"] if res.get("gpu") else ""}.', '',
          '| phase | command | exit | wall s | peak CUDA GiB | peak RSS GB (tree) | largest process GB |', '|---|---|---|---|---|---|---|']
    for p in res['phases']:
        md.append(f'| {p["name"]} | `{p["cmd"]}` | {p["rc"]} | {p["seconds"]} | {p["cuda_peak_gb"]} | {p["peak_rss_gb"]} | {p["peak_proc_gb"]} |')
    if 'first_update' in res:
        md += ['', 'First update: ' + ', '.join(f'{k} {v}' for k, v in res['first_update'].items()), '']
    if res.get('failed'):
        md += ['', f'**Failed at {res["failed"]}**: see its log.', '']
    with open(out + '.md', 'w') as f:
        f.write('\n'.join(md) + '\n')
    with open(out + '.json', 'w') as f:
        json.dump(res, f, indent=1)
    print(f'wrote {out}.md and {out}.json')


if __name__ == '__main__':
    main()
