"""
A rehearsal of the real path at real width, on a CPU: random weights in the released layouts, every
part at its released width and minimal depth, run through the unchanged entry points.

    python -m bench.rehearsal                      # both rehearsals, one after the other (~60 + ~20 min)
    python -m bench.rehearsal --only=hunyuan       # HunyuanVideo 1.5 alone -> results/rehearsal.md
    python -m bench.rehearsal --only=wan           # Wan 2.1 1.3B alone -> results/rehearsal_wan.md
    python -m bench.rehearsal --build_only         # just the models (printed: their directories)
    python -m bench.rehearsal --blocks=2           # two transformer blocks instead of one

The models (tests/tiny_*.py with the released sizes, built once into cache_dir, ~6 GB on disk):
- Wan 2.1 T2V 1.3B (wan.py): the transformer of assets/wan21_t2v_1.3b_transformer.json (width 1536 =
  12 heads x 128, 8960 FFN, text width 4096) with `blocks` of its 30 blocks; the VAE at the released
  config (AutoencoderKLWan's defaults: 16 latent channels, 96..384 channels, 2 res blocks a stage);
  UMT5-XXL at 4096 wide (64 heads x 64, 10240 gated-gelu FFN, 32 relative-position buckets) with the
  real vocabulary of 256384 and 1 of its 24 layers. Text encoder and VAE saved in bf16, the
  transformer in fp32. Its tokenizer is tests/tiny_wan.py's word-level T5 one (<pad> 0, </s> 1, <unk> 2,
  the released ids); the prompts below come near the pipeline's cap of 512 tokens
  (results/rehearsal_wan.json 'text_tokens').
- HunyuanVideo 1.5 480p: the transformer of assets/hunyuanvideo15_480p_t2v_transformer.json (hidden
  2048 = 16 heads x 128, rope axes (16, 56, 56), 2 refiner layers, the 2048-wide ByT5 projection) with
  `blocks` of its 54 blocks; the VAE at its released widths (32 latent channels, 16x spatial, 4x
  temporal, 128..1024 channels) with 1 layer per block instead of 2; the Qwen2.5-VL-7B text model at
  3584 wide (28 heads, 4 KV heads, 18944 MLP) with the real vocabulary of 152064 and 3 layers (the
  pipeline reads hidden_states[-3], so 3 is the fewest where a layer's output is used); ByT5 at 1472
  (6 heads x 64, 3584 MLP) with 1 layer. Text encoders saved in bf16, the transformer in fp32.
- VideoAlign: Qwen2-VL-2B at 1536 (12 heads, 2 KV heads, 8960 MLP, vocabulary 151936 in the config,
  151660 in the model) with 1 LLM layer, its vision tower at 1280 (16 heads) with 1 layer, LoRA r64
  alpha 128 unmerged, in bf16: the released layout of tests/tiny_videoalign.py.
- CLIP-L (text 768, vision 1024, patch 14, projection 768) and PickScore (CLIP-H: text 1024, vision
  1280, projection 1024), vocabulary 49408, 1 layer per tower.
Tokenizers are built offline (no hub access): the test tokenizers' byte-level BPE, padded with
unreachable '<unused_i>' entries so that every special token sits at its released id (Qwen2.5
<|endoftext|> 151643 .. 151664; Qwen2-VL's 14 specials from 151643, the reward tokens at 151657-151659;
CLIP's <|startoftext|> 49406, <|endoftext|> 49407). The BPE merges are few, so a prompt is mostly byte
tokens: the prompts are sized so that the Qwen tokens come near the pipeline's cap of 1000 (947 valid
tokens; results/rehearsal.json 'text_tokens') and the quoted text fills ByT5's 256. The VideoAlign instruction tokenises to fewer tokens than with
Qwen's real BPE, so the reward tokens' positions differ from the released ones (their order does not).

The run, through the entry points a user runs (peak resident memory of the whole process tree and wall time
per phase, in results/rehearsal.md and .json):
Each family's rehearsal (the same reward models and phases; its own report):
1. build: the models above (cached; 0 s on a rerun)
2. train, 2 ranks: `torchrun --nproc_per_node=2 train.py` on them, 9 frames at 64x112 (latents
   32 x 3 x 4 x 7), 2 sampler steps, 1 prompt x G 2 per iteration, 2 iterations, evaluation at the start and
   end with CLIPScore and PickScore, a checkpoint per iteration; SIGTERM to the workers once the first
   checkpoint is published (as SLURM signals every task): they checkpoint and exit 0.
3. resume, 1 rank: `python train.py --init_from=resume --max_iters=3` from that checkpoint (another world
   size), one more iteration, evaluation, export.
4. sample: `python sample.py` from the export (a diffusers directory whose transformer/ is the export),
   with VideoAlign, CLIPScore and PickScore in its table.
Not in the test suite (minutes, ~10 GB); tests/test_rehearsal.py runs a fast slice (the size dicts
at tiny width through the same build functions).
"""
import json
import os
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'tests'))
import torch  # noqa: E402

from infra.configurator import configure, one_of  # noqa: E402

# ----------------------------------------------------------------------------- settings
cache_dir = '/tmp/sage-rehearsal/models'  # the built models (outside git; reused by later runs)
work_dir = '/tmp/sage-rehearsal/run'      # train.py's out_dir, sample.py's output (wiped at the start)
out = 'results/rehearsal'       # writes out.md and out.json (Wan: out_wan.md, out_wan.json)
only = ''                       # 'hunyuan' or 'wan': that rehearsal alone; '': both, one after the other
blocks = 1                      # transformer blocks (54 released)
num_frames = 9                  # 9 frames -> 3 latent frames
height = 64                     # -> 4 latent rows
width = 112                     # -> 7 latent columns
num_steps = 2                   # sampler steps (both trained: the SDE's last step is stochastic too)
threads = 1                     # torch threads per process (2 ranks on 2 cores)
build_only = False              # build the models and stop
report_only = False             # rewrite out.md from out.json (no running)
config = configure(globals(), [a + '=True' if a in ('--build_only', '--report_only') else a for a in sys.argv[1:]]
                   if __name__ == '__main__' else [], rules=dict(only=one_of('', 'hunyuan', 'wan')))
# -----------------------------------------------------------------------------

# tests/tiny_*.py size dicts at the released widths
with open('assets/hunyuanvideo15_480p_t2v_transformer.json') as f:
    _T = {k: v for k, v in json.load(f).items() if not k.startswith('_') and k not in (
        'in_channels', 'out_channels', 'text_embed_dim', 'text_embed_2_dim')}  # derived from the parts below
HUNYUAN = dict(
    vocab_size=152064,  # Qwen2.5-VL-7B's embedding rows (151665 tokens + padding)
    text=dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=3, num_attention_heads=28,
              num_key_value_heads=4, mrope_section=[16, 24, 24],  # head_dim 128: 64 frequencies over (t, h, w)
              rms_norm_eps=1e-6),
    byt5=dict(d_model=1472, d_kv=64, d_ff=3584, num_layers=1, num_heads=6),  # google/byt5-small's widths
    vae=dict(latent_channels=32, block_out_channels=(128, 256, 512, 1024, 1024), layers_per_block=1),
    transformer=dict(_T, num_layers=blocks),
    dtype=torch.bfloat16,  # the text encoders and VAE (the trainer loads the pipeline in bf16)
    transformer_dtype=torch.float32,
)
with open('assets/wan21_t2v_1.3b_transformer.json') as f:
    _W = {k: v for k, v in json.load(f).items() if not k.startswith('_') and k not in (
        'in_channels', 'out_channels', 'text_dim')}  # derived from the parts below
WAN = dict(  # tests/tiny_wan.py's size dict at Wan 2.1 1.3B's released widths
    vocab_size=256384,  # UMT5-XXL's embedding rows
    text=dict(d_model=4096, d_kv=64, d_ff=10240, num_layers=1, num_heads=64, relative_attention_num_buckets=32,
              relative_attention_max_distance=128),  # google/umt5-xxl's widths, 1 of its 24 layers
    vae={},  # AutoencoderKLWan's class defaults: Wan 2.1's released VAE
    transformer=dict(_W, num_layers=blocks),
    expand_timesteps=False,
    dtype=torch.bfloat16,  # the text encoder and VAE as saved (the trainer loads the VAE in fp32)
    transformer_dtype=torch.float32,
)
VIDEOALIGN = dict(
    real_ids=True, extra_vocab=151936 - 151657,  # Qwen2-VL-2B-Instruct's config vocab_size - len(tokenizer)
    text=dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=1, num_attention_heads=12,
              num_key_value_heads=2, mrope_section=[16, 24, 24]),
    vision=dict(depth=1, embed_dim=1280, mlp_ratio=4, num_heads=16),
    lora_r=64, lora_alpha=128,  # the released peft_lora_config
)
CLIP = {  # openai/clip-vit-large-patch14 and yuvalkirstain/PickScore_v1 (CLIP-H/14)
    'clip': dict(vocab_size=49408, text=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=1,
                                             num_attention_heads=12),
                 vision=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=1, num_attention_heads=16),
                 projection_dim=768, patch_size=14),
    'pickscore': dict(vocab_size=49408, text=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=1,
                                                  num_attention_heads=16),
                      vision=dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=1,
                                  num_attention_heads=16),
                      projection_dim=1024, patch_size=14),
}
# a prompt of 947 Qwen tokens (the pipeline's cap: 1000) whose quoted text fills ByT5's 256
GLYPH = 'SAGE GRPO rehearsal at real width ' * 8  # 272 bytes inside the quotes -> 256 ByT5 tokens (truncated)
LONG = ('a red fox runs through deep snow in a pine forest at dawn, the camera follows it low to the ground, '
        'soft golden light, falling snow, breath visible in the cold air; ') * 7
PROMPTS = {'train': [f'{LONG} a sign reads "{GLYPH}" number {i}' for i in range(2)],
           'eval': [f'{LONG} a banner says "{GLYPH}" scene {i}' for i in range(2)]}  # 2: one per rank


def dirs(root=cache_dir, n_blocks=None):
    """Where each model is built: {'hunyuan', 'wan', 'videoalign', 'qwen', 'clip', 'pickscore'}."""
    n_blocks = blocks if n_blocks is None else n_blocks
    return dict(hunyuan=os.path.join(root, f'HunyuanVideo-1.5-480p_t2v-{n_blocks}blocks'),
                wan=os.path.join(root, f'Wan2.1-T2V-1.3B-{n_blocks}blocks'),
                videoalign=os.path.join(root, 'videoalign', 'VideoReward'),
                qwen=os.path.join(root, 'videoalign', 'Qwen2-VL-tiny'),
                clip=os.path.join(root, 'clip', 'clip-vit-large-patch14'),
                pickscore=os.path.join(root, 'clip', 'PickScore_v1'))


def build(root=cache_dir, n_blocks=None, sizes=None, wan_sizes=None, which=('hunyuan', 'wan')):
    """Build whatever is missing under root (each part published by rename or a marker); returns dirs().
    sizes: (hunyuan, videoalign, clip) size dicts and wan_sizes Wan's, the released widths by default
    (the test passes TINY); which: the video models to build (the reward models always)."""
    from tiny_clip import make_tiny_clip
    from tiny_hunyuan import make_tiny_hunyuan
    from tiny_videoalign import make_tiny_videoalign
    from tiny_wan import make_tiny_wan
    n_blocks = blocks if n_blocks is None else n_blocks
    # deep transformers are saved in bf16 (54 blocks: 16.6 GB to write instead of 33 GB; train.py loads fp32)
    hv, va, cl = sizes or (dict(HUNYUAN, transformer=dict(_T, num_layers=n_blocks),
                                transformer_dtype=torch.bfloat16 if n_blocks > 8 else torch.float32), VIDEOALIGN, CLIP)
    d = dirs(root, n_blocks)
    if 'hunyuan' in which:
        make_tiny_hunyuan(d['hunyuan'], hv)  # reuses a finished build
    if 'wan' in which:
        make_tiny_wan(d['wan'], wan_sizes or dict(WAN, transformer=dict(_W, num_layers=n_blocks)))
    for name, make in (('videoalign', lambda: make_tiny_videoalign(os.path.join(root, 'videoalign'), va)),
                       ('clip', lambda: [make_tiny_clip(os.path.join(root, 'clip'), k, cl[k]) for k in CLIP])):
        done = os.path.join(root, name, '.done')
        if not os.path.isfile(done):
            make()
            open(done, 'w').close()  # written last: an interrupted build is redone
    return d


def tree_rss(p):
    """(resident bytes of a process and all its descendants, of the largest one of them)."""
    import psutil
    try:
        procs = [p] + p.children(recursive=True)
    except psutil.NoSuchProcess:
        return 0, 0
    rss = []
    for q in procs:
        try:
            rss.append(q.memory_info().rss)
        except psutil.NoSuchProcess:
            pass
    return sum(rss), max(rss, default=0)


def run_phase(name, cmd, log_dir, env=None, on_poll=None, timeout=None):
    """Run cmd (a list) as a subprocess, polling its process tree's resident memory every 0.2 s.
    on_poll(proc) is called at every poll (e.g. to send a signal). Returns a dict: name, rc, seconds,
    peak_rss_gb (the whole tree, e.g. torchrun + its 2 workers; pages shared between processes, such as
    memory-mapped weights, count once per process), peak_proc_gb (the largest single process), log (path)."""
    import psutil
    os.makedirs(log_dir, exist_ok=True)
    log = os.path.join(log_dir, f'{name}.log')
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), **(env or {}))
    print(f'[{name}] {" ".join(cmd)}', flush=True)
    t0, peak, peak_proc = time.time(), 0, 0
    with open(log, 'w') as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
        ps = psutil.Process(proc.pid)
        while proc.poll() is None:
            total, largest = tree_rss(ps)
            peak, peak_proc = max(peak, total), max(peak_proc, largest)
            if on_poll:
                on_poll(proc)
            if timeout and time.time() - t0 > timeout:
                proc.kill()
            time.sleep(0.2)
    res = dict(name=name, rc=proc.returncode, seconds=round(time.time() - t0, 1), peak_rss_gb=round(peak / 2 ** 30, 2),
               peak_proc_gb=round(peak_proc / 2 ** 30, 2), log=log)
    print(f'[{name}] rc {res["rc"]}, {res["seconds"]} s, peak RSS {res["peak_rss_gb"]} GB (largest process '
          f'{res["peak_proc_gb"]} GB; log: {log})', flush=True)
    if res['rc'] != 0:
        with open(log) as f:
            print(f.read()[-4000:], flush=True)
    return res


def sigterm_after_first_checkpoint(run_dir, state):
    """on_poll for the 2-rank run: SIGTERM every worker (torchrun's children) once ckpt_000001 is published."""
    import psutil

    def poll(proc):
        if state.get('sent') or not os.path.isdir(os.path.join(run_dir, 'ckpt_000001')):
            return
        workers = psutil.Process(proc.pid).children(recursive=True)
        for w in workers:
            if any(a == 'train.py' for a in w.cmdline()):
                os.kill(w.pid, signal.SIGTERM)
        state['sent'], state['t'] = len(workers), time.time()
        print(f'SIGTERM to {len(workers)} workers after the first checkpoint', flush=True)
    return poll


def aligned_dir(model_root, export, dest):
    """A diffusers pipeline directory whose transformer/ is the export (symlinks, nothing copied)."""
    os.makedirs(dest, exist_ok=True)
    for f in os.listdir(model_root):
        link = os.path.join(dest, f)
        if not os.path.lexists(link):
            os.symlink(os.path.abspath(export if f == 'transformer' else os.path.join(model_root, f)), link)
    return dest


def metrics_rows(run_dir):
    with open(os.path.join(run_dir, 'metrics.jsonl')) as f:
        return [json.loads(l) for l in f]


def checks(fam, d, run_dir, sample_dir, logs):
    """What only the real widths show, read back from what the runs wrote (fam: 'hunyuan' or 'wan')."""
    from infra import prompt_cache
    from models.policy import latent_shape
    out = {}
    cache = prompt_cache.PromptCache(os.path.join(run_dir, 'prompt_cache'))
    text = cache[PROMPTS['train'][0]]  # (embeds, mask) pairs: Qwen and ByT5, or UMT5
    out['text_tokens'] = [int(e.shape[0]) for e in text[::2]]  # valid tokens of a long prompt, each encoder
    out['text_widths'] = [int(e.shape[1]) for e in text[::2]]
    out['latent_shape'] = list(latent_shape(d[fam], num_frames, height, width))
    with open(os.path.join(run_dir, 'export', 'config.json')) as f:
        cfg = json.load(f)
    out['export'] = dict(cls=cfg['_class_name'], blocks=cfg['num_layers'], heads=cfg['num_attention_heads'],
                         head_dim=cfg['attention_head_dim'],
                         **({'rope_axes_dim': cfg['rope_axes_dim']} if fam == 'hunyuan' else {'ffn_dim': cfg['ffn_dim']}))
    rows = metrics_rows(run_dir)
    out['iterations'] = [r['iter'] for r in rows if 'reward' in r]
    out['evals'] = [{k: round(v, 4) for k, v in r.items()} for r in rows if 'eval_composite' in r]
    out['ratio_max'] = [r.get('ratio_max') for r in rows if 'reward' in r]
    out['clipfrac'] = [r.get('clipfrac') for r in rows if 'reward' in r]
    out['nan_rewards'] = [r.get('nan_rewards') for r in rows if 'reward' in r]
    out['iteration_seconds_rollout_reward_update'] = [[round(r[k], 1) for k in ('t_rollout', 't_reward', 't_update')]
                                                      for r in rows if 'reward' in r]
    out['peak_mem_gb_ranks'] = [[round(x, 2) for x in r['peak_mem_gb_ranks']] for r in rows if 'reward' in r]
    # a failing VideoAlign scores NaN with a warning instead of raising
    out['videoalign_warnings'] = sum(open(os.path.join(logs, f)).read().count('VideoAlign:') for f in os.listdir(logs))
    with open(os.path.join(sample_dir, 'metrics.json')) as f:
        out['sample_metrics'] = json.load(f)
    return out


def report(res, dest=out):
    md = [f'# Rehearsal of the real path at real width (CPU): {res.get("model", "HunyuanVideo 1.5 480p")}', '',
          'Written by `python -m bench.rehearsal` (bench/rehearsal.py: the models, what is real and what is not). '
          f'{res["blocks"]} transformer block(s), {num_frames} frames at {height}x{width}, {num_steps} sampler steps, '
          f'{res["threads"]} torch thread(s) per process on {os.cpu_count()} cores. Peak RSS: the whole process tree '
          '(torchrun and both workers together), polled every 0.2 s.', '',
          '| phase | command | exit | wall s | peak RSS GB (tree) | largest process GB |', '|---|---|---|---|---|---|']
    for p in res['phases']:
        md.append(f'| {p["name"]} | `{p["cmd"]}` | {p["rc"]} | {p["seconds"]} | {p["peak_rss_gb"]} | {p.get("peak_proc_gb", "")} |')
    ranks = res.get('checks', {}).get('peak_mem_gb_ranks', [])  # one entry a rank, per logged iteration
    where = '; '.join(f'iteration {i + 1} on {len(r)} rank{"s" * (len(r) > 1)}' for i, r in enumerate(ranks))
    md += ['', f'SIGTERM went to {res.get("sigterm_workers", 0)} workers once ckpt_000001 was published '
           f'(they stop at the next forward and keep the last finished iteration); {where or "no iteration logged"}.', '',
           '## Read back from what the runs wrote', '', '```',
           '\n'.join(f'{k}: {json.dumps(v)}' for k, v in res.get('checks', {}).items()), '```', '']
    if res.get('failed'):
        md += [f'**Failed at {res["failed"]}**: see its log.', '']
    with open(dest + '.md', 'w') as f:
        f.write('\n'.join(md))
    with open(dest + '.json', 'w') as f:
        json.dump(res, f, indent=1)
    print(f'wrote {dest}.md and {dest}.json')


def short(cmd):  # the command as a user types it (paths of this machine shortened)
    return ' '.join(a if len(a) < 60 else a[:25] + '...' + a[-25:] for a in cmd).replace(sys.executable, 'python')


REHEARSALS = {'hunyuan': ('HunyuanVideo 1.5 480p', ''), 'wan': ('Wan 2.1 T2V 1.3B', '_wan')}  # model, suffix


def main(fam):
    """One family's rehearsal: its phases run, its report written to out + suffix (.md, .json)."""
    import shutil
    model_name, sfx = REHEARSALS[fam]
    work = work_dir + ('-' + fam if sfx else '')  # the HunyuanVideo one keeps its place
    os.makedirs(os.path.dirname(out) or '.', exist_ok=True)
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    py = sys.executable
    res = dict(model=model_name, blocks=blocks, threads=threads, phases=[], config=config)

    def phase(name, cmd, **kw):
        r = run_phase(name, cmd, os.path.join(work, 'logs'), **kw)
        res['phases'].append(dict(r, cmd=short(cmd)))
        if r['rc'] != 0:
            res['failed'] = name
            report(res, out + sfx)
            raise SystemExit(f'{name} failed (exit {r["rc"]}): {r["log"]}')
        return r

    phase('build', [py, '-m', 'bench.rehearsal', '--build_only', f'--only={fam}', f'--blocks={blocks}',
                    f'--cache_dir={cache_dir}'])
    d = dirs()
    for k, ps in PROMPTS.items():
        with open(os.path.join(work, f'{k}.txt'), 'w') as f:
            f.write('\n'.join(ps) + '\n')
    run_dir = os.path.join(work, 'out')
    common = [f'--model={d[fam]}', f'--videoalign_dir={d["videoalign"]}', f'--qwen_dir={d["qwen"]}',
              '--eval_metrics=clipscore,pickscore', f'--clip_dir={d["clip"]}', f'--pickscore_dir={d["pickscore"]}',
              f'--train_prompts={work}/train.txt', f'--eval_prompts={work}/eval.txt', f'--out_dir={run_dir}',
              '--device=cpu', f'--num_frames={num_frames}', f'--height={height}', f'--width={width}', '--fps=8',
              f'--num_steps={num_steps}', '--prompts_per_iter=1', '--group_size=2', '--rollout_batch=1',
              '--train_batch=1', '--eval_every=0', '--save_every=1', '--diag_every=0', '--eval_videos=1',
              '--timestep_fraction=0.5']  # one of the 2 steps trained per clip: an iteration is ~10 forwards
    state = {}
    phase('train_2ranks', [py, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2', 'train.py']
          + common + ['--max_iters=2'], on_poll=sigterm_after_first_checkpoint(run_dir, state))
    res['sigterm_workers'] = state.get('sent', 0)
    phase('resume_1rank', [py, 'train.py'] + common + ['--init_from=resume', '--max_iters=3'])
    sample_dir = os.path.join(work, 'samples')
    aligned = aligned_dir(d[fam], os.path.join(run_dir, 'export'), os.path.join(work, 'aligned'))
    phase('sample', [py, 'sample.py', f'--model={aligned}', "--checkpoint=", f'--prompts={work}/eval.txt',
                     '--num_prompts=2', f'--num_steps={num_steps}', f'--num_frames={num_frames}', f'--height={height}',
                     f'--width={width}', '--fps=8', '--device=cpu', f'--out_dir={sample_dir}',
                     f'--videoalign_dir={d["videoalign"]}', f'--qwen_dir={d["qwen"]}',
                     '--eval_metrics=clipscore,pickscore', f'--clip_dir={d["clip"]}',
                     f'--pickscore_dir={d["pickscore"]}'])
    res['checks'] = checks(fam, d, run_dir, sample_dir, os.path.join(work, 'logs'))
    report(res, out + sfx)


if __name__ == '__main__':
    torch.set_num_threads(threads)
    which = [only] if only else list(REHEARSALS)
    if build_only:
        print(json.dumps(build(which=which), indent=1))
    elif report_only:
        for fam in which:
            with open(out + REHEARSALS[fam][1] + '.json') as f:
                report(json.load(f), out + REHEARSALS[fam][1])
    else:
        for fam in which:
            main(fam)
