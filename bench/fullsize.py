"""
HunyuanVideo 1.5 (8.3B) at full size without a GPU: per-GPU memory by category and FLOPs of one
training micro-step and one rollout forward, measured by torch on fake tensors (real shapes and
dtypes, no storage): the runs, the report (results/fullsize.{md,json}) and section 9 of results/README.md.

    python -m bench.fullsize                           # the estimate -> results/fullsize.{md,json}, results/README.md block
    python -m bench.fullsize --only=train & python -m bench.fullsize --only=rollout,lora; \
        python -m bench.fullsize --reuse=True          # the same in two parallel parts, then assembled
    python -m bench.fullsize --only=wan,wansp --reuse=True  # the Wan 2.1 rows alone (the others read back),
    python -m bench.fullsize --only=a14b --reuse=True  # Wan 2.2 A14B's rows alone (about 20 min),
    python -m bench.fullsize --reuse=True              # then the report and results/README.md block from every kept run
    python -m bench.fullsize --report_only=True        # fullsize.md and the results/README.md block from fullsize.json

Its pieces, whose settings this command line sets too:
- bench/fullsize_measure.py: measure(), one micro-step or rollout forward on fake tensors; how it
  measures, and where it knowingly differs from a GPU run;
- bench/fullsize_wan.py: Wan 2.1 T2V 1.3B and 14B at their own clip size, 81x480x832, their own
  section of fullsize.md and rows of the results/README.md block;
- bench/fullsize_wan22.py: Wan 2.2 T2V-A14B's two experts on 8 GPUs, measured shallow and carried to
  40 layers an expert, its own section and rows.
The ready check for the day GPUs are at hand is its own script: python -m bench.fullsize_gpu.

Runs: full fine-tune (FSDP2 over `gpus` ranks) and rollout at each of `sizes`, LoRA on one GPU at the
first of `lora_sizes` that fits, sequence parallel at `sp_sizes` x `sp_clips`, Wan 2.1's, and the
full fine-tune with diffusers' own attention processor (diffusers_*, the comparison; --processor=diffusers
measures every run with it). Each full-size run takes 1.5-20 min on 2 busy shared cores (the trackers'
per-op bookkeeping), about 45 min in all; the parts can run in parallel (above).
"""
import json
import os
import sys
import time

import torch

from bench import common as C
from bench import fullsize_measure as FM
from bench import fullsize_wan as FW
from bench import fullsize_wan22 as FW22
from bench.common import table
from bench.fullsize_measure import GiB, build, categories, load_config, measure, video_tokens
from infra.configurator import configure, list_of

# ----------------------------------------------------------------------------- settings
report_only = False            # rewrite fullsize.md from fullsize.json (no measuring)
only = ''                       # measure only these runs (comma list of train, rollout, lora; '' = all)
reuse = False                   # take runs already measured from out_dir/fullsize_runs/ (parallel parts)
out_dir = 'results'             # the estimate writes fullsize.md and fullsize.json here
sp_sizes = (1, 2, 4)            # sequence parallel degrees measured (sp.py, train.py's sp_size), full FT on `gpus` GPUs
sp_clips = ((81, 480, 848), (121, 720, 1280))  # frames x H x W of the sp runs: 480p, and 720p's 121 frames
lora_sizes = ((81, 352, 624), (61, 352, 624), (41, 352, 624), (81, 288, 512))  # tried in order until one fits
gpu_gb = 80.0                   # memory of one GPU (H100 80 GB; an H200 has 141)
tflops = 400.0                  # assumed sustained bf16 TFLOP/s per GPU, for time on paper (~40% of H100 dense peak)
videoalign_params = 2.2e9       # Qwen2-VL-2B + reward head (reward.py), resident in bf16
metrics_params = 1.414e9        # CLIP-L (428M) + PickScore (CLIP-H, 986M): bf16, resident during evaluation only
# the measured model, ranks, clips, text and attention (bench/fullsize_measure.py) and the Wan rows'
# (bench/fullsize_wan.py): settings of this command line too, handed back to their modules below
from bench.fullsize_measure import (clips, gpus, lora_rank, model_config, num_frames, num_steps,  # noqa: E402,F401
                                    processor, rollout_batch, seed, sizes, text_tokens)
from bench.fullsize_wan import wan_clip, wan_clips_1gpu, wan_models, wan_sp  # noqa: E402,F401
from bench.fullsize_wan22 import (a14b_clips, a14b_config, a14b_depths, a14b_rollout_batch,  # noqa: E402,F401
                                  a14b_sp, a14b_steps)
if __name__ == '__main__' and '--gpu' in sys.argv[1:]:
    raise SystemExit('the GPU check is its own script: python -m bench.fullsize_gpu')
# imported (bench/compute.py, tests), the settings keep their defaults
config = configure(globals(), sys.argv[1:] if __name__ == '__main__' else [],
                   rules=dict(only=list_of('train', 'rollout', 'lora', 'diffusers', 'sp', 'wan', 'wansp', 'a14b'),
                              **FM.RULES, **FW.RULES, **FW22.RULES))
C.share(config, FM, FW, FW22)  # the measurement and the Wan rows run with this command line's values
# -----------------------------------------------------------------------------


# ----------------------------------------------------------------------------- the estimate

def formula(P, P_blk, P_txt, L, h, V, T):
    """bench/toy.py section 5's former formulas (bytes per GPU of 8; F: FLOPs of one CFG branch of one
    clip), for the comparison; P_txt: a block's text-stream parameters."""
    S, P_img = V + T, P_blk - P_txt
    return dict(params=4 * P / 8, grads=4 * P / 8, optimizer=8 * P / 8, anchor=4 * P / 8, gathered=2 * 2 * P_blk,
                activations=2 * 2 * S * h * L + 2 * 2 * S * h * 16 + 2 * S * S,
                F=2 * L * (P_img * V + P_txt * T) + 2 * (P - L * P_blk) * V + 4 * L * S * S * h)


def estimate():
    from diffusers import AutoencoderKLHunyuanVideo15
    cfg, t0 = load_config(), time.time()
    with torch.device('meta'):  # the class defaults are the published VAE
        vae_P = sum(p.numel() for p in AutoencoderKLHunyuanVideo15().parameters())
    extras = {'VAE (bf16)': 2 * vae_P, 'VideoAlign (bf16)': 2 * videoalign_params}
    os.makedirs(os.path.join(out_dir, 'fullsize_runs'), exist_ok=True)

    def run(key, *args, model_cfg=None, **kw):  # one measurement, kept in fullsize_runs/ (--reuse: read back)
        path = os.path.join(out_dir, 'fullsize_runs', key + '.json')
        if reuse and os.path.exists(path):
            with open(path) as f:
                return json.load(f)
        if only and key.split('_')[0].rstrip('0123456789') not in only.split(','):  # sp2_... is part 'sp'
            return None
        r = measure(model_cfg or cfg, *args, **kw)
        with open(path, 'w') as f:
            json.dump(r, f, indent=1, default=str)
        print(f'[{time.time() - t0:5.0f}s] {key}: peak {r["peak"]["Total"] / GiB:.1f} GiB', flush=True)
        return r
    sfx = '' if processor == 'masked_keys' else '_' + processor
    runs = [run(f'{what}_{H}x{W}{sfx}', what, num_frames, H, W) for H, W in sizes for what in ('train', 'rollout')]
    for Fr, H, W in lora_sizes:  # config/lora_1gpu.py: 2 prompts x G 4 = 8 clips, rollout_batch 1
        r = run(f'lora_train_{Fr}x{H}x{W}{sfx}', 'train', Fr, H, W, world=0, lora=lora_rank, n_store=8, rollout_n=1)
        runs.append(r)
        if r is None or (r['peak']['Total'] + sum(extras.values())) / GiB <= gpu_gb:
            runs.append(run(f'lora_rollout_{Fr}x{H}x{W}{sfx}', 'rollout', Fr, H, W, world=0, lora=lora_rank, n_store=8,
                            rollout_n=1))
            break
    runs = [r for r in runs if r is not None]
    # the same full fine-tune runs with diffusers' own attention processor: what masked keys replace
    reference = [] if sfx else [run(f'diffusers_{what}_{H}x{W}', what, num_frames, H, W, proc='diffusers')
                                for H, W in sizes for what in ('train', 'rollout')]
    reference = [r for r in reference if r is not None]
    seq = []  # sequence parallel: the same full fine-tune with a clip's tokens split over sp ranks
    for Fr, H, W in sp_clips:
        V = video_tokens(Fr, H, W)
        for n in sp_sizes:
            for what in ('train', 'rollout'):
                if V % n or cfg['num_attention_heads'] % n:  # hunyuan15.pad_for_sp's check: no run, the reason instead
                    seq.append(dict(what=what, frames=Fr, height=H, width=W, world=gpus, sp=n, tokens=V, skipped=
                                    f'{V:,} video tokens do not split over {n} ranks'))
                    continue
                same = n == 1 and Fr == num_frames and (H, W) in sizes and not sfx  # measured above already
                r = run(f'{what}_{H}x{W}' if same else f'sp{n}_{what}_{Fr}x{H}x{W}{sfx}', what, Fr, H, W, sp=n)
                if r is not None:
                    seq.append(dict(r, sp=n))  # (runs measured before sp was recorded are sp 1)
    wan_rows = FW.wan_runs(run)  # Wan 2.1 1.3B and 14B (bench/fullsize_wan.py)
    a14b_check, a14b = FW22.validation_runs(run), FW22.a14b_runs(run)  # Wan 2.2 A14B (bench/fullsize_wan22.py)
    for r in wan_rows:
        r['categories'] = categories(r)
    blk = build(cfg, checkpointing=False).transformer_blocks[0]
    P_blk = sum(p.numel() for p in blk.parameters())
    P_txt = sum(p.numel() for n, p in blk.named_parameters() if 'context' in n or 'add_' in n)
    for r in runs + reference + [r for r in seq if 'skipped' not in r]:
        r['categories'] = categories(r)
        r['formula'] = formula(r['P'], P_blk, P_txt, cfg['num_layers'], cfg['num_attention_heads'] *
                               cfg['attention_head_dim'], r['tokens'], r['text'])
    out = dict(config=config, extras=extras, eval_extras={'CLIP-L + PickScore (bf16)': 2 * metrics_params},
               runs=runs, reference=reference, sp=seq, wan=wan_rows, wan_extras=FW.wan_extras(videoalign_params),
               a14b=a14b, a14b_check=a14b_check,
               seconds=time.time() - t0, torch=torch.__version__)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, 'fullsize.json'), 'w') as f:
        json.dump(out, f, indent=1, default=str)
    md = report(out)  # before the file is opened: a failing report leaves the old one whole
    with open(os.path.join(out_dir, 'fullsize.md'), 'w') as f:
        f.write(md + '\n')
    if not only:
        update_readme(out)
    print(f'wrote {out_dir}/fullsize.md and fullsize.json in {time.time() - t0:.0f}s')


FWD_BWD = ('update', 'diag')  # the kinds of train.py's pass count (model.PASS_KINDS) with a backward


def flops_per_pass(size=(352, 624), path=os.path.join('results', 'fullsize.json')):
    """FLOPs of one transformer pass at full size (one clip, one CFG branch, 81 frames at `size`),
    measured by this bench (full fine-tune, 8 GPUs): a forward as in rollouts and evaluation, the
    anchor's forward, and a forward + backward of the update (its block recompute included)."""
    with open(path) as f:
        out = json.load(f)
    run = lambda what: next(r for r in out['runs'] if r['world'] and r['what'] == what and
                            (r['height'], r['width']) == tuple(size))
    tr, ro = run('train')['phases'], run('rollout')['phases']
    n = 2 * out['config']['rollout_batch']  # clips x CFG branches of the measured rollout forward
    return dict(forward=ro['rollout forward']['flops'] / n, anchor=tr['anchor forward']['flops'] / 2,  # 1 clip, 2 branches
                train=(tr['policy forward']['flops'] + tr['backward']['flops']) / 2)


def gpu_hours(passes, size=(352, 624), tflops=tflops, path=os.path.join('results', 'fullsize.json')):
    """GPU-hours at full size of transformer passes counted by kind ({kind: passes}, train.py's
    passes_* in metrics.jsonl, or bench/compute.py's count of a setting): each pass costs what
    flops_per_pass measured, at `tflops` sustained TFLOP/s per GPU (an assumption, not a measurement)."""
    f = flops_per_pass(size, path)
    cost = lambda k: f['train'] if k in FWD_BWD else f['anchor'] if 'anchor' in k else f['forward']
    return sum(n * cost(k) for k, n in passes.items()) / (tflops * 1e12) / 3600


def twin(out, r):
    """r's run with diffusers' own attention processor (out['reference']), or None."""
    return next((q for q in out.get('reference', []) if (q['what'], q['world'], q['lora'], q['frames'], q['height'],
                                                          q['width']) == (r['what'], r['world'], r['lora'], r['frames'],
                                                                          r['height'], r['width'])), None)


def readme_summary(out):
    """results/README.md's table: per model and clip size, the per-GPU peak of an iteration (the larger of the
    training micro-step and the rollout forward, VAE and VideoAlign resident) of each setup measured,
    HunyuanVideo with masked-key attention (train.py's valid_tokens computes at most that); every run,
    phase and category are in results/fullsize.md."""
    peaks = {}  # (model, clip) -> {setup: GiB}

    def add(model, setup, r, extras):
        d = peaks.setdefault((model, f'{r["frames"]}x{r["height"]}x{r["width"]}'), {})
        d[setup] = max(d.get(setup, 0.0), (r['categories']['total'] + extras) / GiB)
    hv, extras = 'HunyuanVideo 1.5 (8.3B)', sum(out['extras'].values())
    full = lambda r: f'full FT, {r["world"]} GPUs' if r['world'] else f'LoRA r{r["lora"]}, 1 GPU'  # noqa: E731
    for r in out['runs']:
        if r.get('attention') == out['config'].get('processor', 'masked_keys'):
            add(hv, full(r), r, extras)
    for r in out.get('sp', []):
        if 'skipped' not in r:
            add(hv, full(r) + (f', sp {r["sp"]}' if r['sp'] > 1 else ''), r, extras)
    for r in out.get('wan', []):
        add(r['model'].replace('Wan 2.1 1.3B', 'Wan 2.1 (1.3B)').replace('Wan 2.1 14B', 'Wan 2.1 (14B)'),
            r['setup'], r, sum(out['wan_extras'].values()))
    gb = out['config'].get('gpu_gb', gpu_gb)
    rows = [[m, clip, '; '.join(f'{s} **{v:.1f}**' if v <= gb else f'{s} {v:.1f} (over {gb:.0f} GB)'
                                for s, v in d.items())] for (m, clip), d in peaks.items()]
    rows += FW22.readme_rows(out, gb)  # Wan 2.2 A14B: per clip, the setups that fit
    return table(['model', 'frames x H x W', f'peak GiB per GPU of an iteration (**bold**: fits {gb:.0f} GB)'], rows)


def update_readme(out, path=os.path.join(out_dir, 'README.md')):
    """Section 9 of results/README.md: the peaks of every model and clip size (bench/toy.py keeps it)."""
    C.put_block(path, 'bench.fullsize', [
        '## 9. Every model at full size: peak memory per GPU (`python -m bench.fullsize`)', '',
        'By torch on fake tensors (FSDP2 over a fake 8-rank group; [fullsize.md](fullsize.md)):', '',
        readme_summary(out)])


# results/fullsize.md's last section: what the fake-tensor accounting cannot see (prose, no figure measured here)
LEFT_OUT = """### What these figures leave out, and what train.py does about it

The accounting above is of tensors (fake tensors under FSDPMemTracker / MemTracker): what the CUDA caching allocator holds beyond them is not in it. Left out, each a reason for the GPU's own numbers (`bench/fullsize.py --gpu`, and train.py's log) to come out higher:
- **Allocator fragmentation and caching**: freed blocks the allocator keeps (reserved, not allocated), in sizes that the next phase cannot reuse: the rollout's batched forwards, the update's backward and the evaluation free and allocate different shapes. An out-of-memory error comes when *reserved* memory reaches the GPU's size. train.py runs the allocator with expandable segments (infra/parallel.py sets `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` before CUDA starts, unless the user set an allocator config) and logs both peaks of every iteration, each started again at the iteration's start: `peak_mem_gb` (allocated, what these tables estimate) and `peak_mem_reserved_gb` (what the allocator held); their difference is what this section cannot compute.
- **The CUDA context and kernels' workspaces**: the context of each process (typically some hundreds of MB), cuBLAS and cuDNN workspaces, and NCCL's communicator buffers, one set per process group (the world, and with HSDP or sequence parallel the shard, replicate and sp groups).
- **The reward phase's activations**: the VAE's tiled decode and VideoAlign's forward on the 2 fps frames (their weights are counted), and CLIP-L / PickScore's forwards at evaluation (held in bf16 on the GPU, as the evaluation row counts them: extras/metrics.py's move).
- **The resident VAE row counts the whole VAE class**, encoder included; train.py decodes only and drops the encoder at load (models/hunyuan15.py and models/wan.py's load_decoder): HunyuanVideo 1.5's encoder is 389 M of its 1,261 M parameters, so the resident VAE is 1.6 GiB in bf16, not 2.3 (Wan 2.1's: 54 M of 127 M, 0.2 GiB of 0.5 in fp32).
- **The anchor's swap**: "a second sharded copy of the weights" (above) is how Anchor.applied kept the policy's weights while the anchor's ran; it now swaps them through one buffer the size of the largest local weight (trust_region.py), so that copy, 3.9 GiB a GPU at 8.3B, is neither allocated nor freed per micro-batch; the anchor forward's peak above is an upper bound by that much until `python -m bench.fullsize` measures it again."""


def report(out):
    """results/fullsize.md: what the README and bench/toy.py's section 5 quote, and what it leaves out."""
    runs, extras, c = out['runs'], out['extras'], out['config']
    name = lambda r: (f'{"full FT, " + str(r["world"]) + " GPUs" if r["world"] else "LoRA r" + str(r["lora"]) + ", 1 GPU"}: '
                      f'{r["what"]} {r["frames"]}x{r["height"]}x{r["width"]}'
                      + ('' if r.get('attention') == c.get('processor', 'masked_keys') else
                         f" ({r.get('attention', 'diffusers')}' attention)"))
    g = lambda b: f'{b / GiB:.1f}'
    P = runs[0]['P']
    md = ['## HunyuanVideo 1.5 at full size: per-GPU memory and FLOPs, measured by torch', '',
          f'Written by `python -m bench.fullsize` (torch {out["torch"]}, {sum(r["seconds"] for r in runs) / 60:.0f} min '
          'of measuring on 2 shared CPU cores); raw numbers: '
          f'fullsize.json. Transformer: {P / 1e9:.3f} B parameters (`{c["model_config"]}`, the diffusers class defaults). '
          'Each run executes one training micro-step as train.py does (anchor forward without grad, policy forward with '
          'both CFG branches, backward with per-block checkpointing, clip + AdamW) or one rollout forward '
          f'({c["rollout_batch"]} clips x 2 CFG branches for FSDP, 1 clip for LoRA), on fake tensors, with FSDP2 applied by '
          'model.shard over a fake process group, bf16 compute; memory by FSDPMemTracker / MemTracker, FLOPs by '
          "FlopCounterMode's formulas. The blocks' attention: hunyuan15.MaskedKeysAttention "
          f'(`attention = \'{c.get("processor", "masked_keys")}\'`; train.py\'s default, valid_tokens, attends over the '
          'valid tokens alone, at most these FLOPs: results/attention_flops.md), padded text and image tokens masked as keys only, '
          'a (B, S) key mask that SDPA takes as a broadcast bias; it runs as on a GPU (the memory-efficient kernel, '
          'the mask as a padded bf16 bias; cuDNN allocates the same). What train.py keeps '
          '(as train.py does): AdamW state and accumulated gradients exist during the training step; the gradients '
          'are freed right after the optimizer step, so no rollout or evaluation holds them; one copy of the stored '
          'rollout. '
          f'Text {sum(c["text_tokens"])} + 1 tokens (upper bound). Not included: CUDA context, allocator fragmentation, '
          'NCCL buffers, VAE/VideoAlign activations (their weights are: the VAE counted from its class, VideoAlign '
          f'taken as {c["videoalign_params"] / 1e9:.1f} B parameters). The method is checked against a real CPU run of '
          'a small config (tests/test_fullsize.py: peak resident memory within 25%). No GPU has confirmed these '
          'numbers yet: `bench/fullsize.py --gpu` prints the measured values beside them.', '',
          '### Peak memory per GPU (GiB), by category, at the peak of each run', '']
    cats = list(runs[0]['categories'])
    rows = [[k] + [g(r['categories'][k]) for r in runs] for k in cats]
    rows.append(['peak phase'] + [r['peak_phase'] for r in runs])
    for k, v in extras.items():
        rows.append([f'+ resident {k}'] + [g(v)] * len(runs))
    rows.append(['**total with resident extras**'] + [f'**{g(r["categories"]["total"] + sum(extras.values()))}**' for r in runs])
    ev = out.get('eval_extras', {})
    for k, v in ev.items():  # evaluation: ODE rollouts of the same batch, the visual metrics loaded for it
        rows.append([f'+ during evaluation only: {k}'] + [g(v) if r['what'] == 'rollout' else '' for r in runs])
    if ev:
        rows.append(['**evaluation peak**'] + [f'**{g(r["categories"]["total"] + sum(extras.values()) + sum(ev.values()))}**'
                                               if r['what'] == 'rollout' else '' for r in runs])
    md += [table(['GiB'] + [name(r) for r in runs], rows), '']
    frames = lambda r: (c['clips'] // max(r['world'], 1) if r['world'] else 8) * r['frames'] * 3 * r['height'] * r['width'] * 4
    md += ['Also kept by train.py, outside these peaks: the decoded frames of the rank\'s clips (float32, '
           + ', '.join(f'{g(frames(r))} GiB at {r["height"]}x{r["width"]}' for r in runs if r['world'] and r['what'] == 'rollout')
           + '), alive from the decode through reward scoring and freed before the update, so in neither '
           'the rollout forward nor the training step; the reward phase (VAE decode, VideoAlign forward: activations '
           'not measured) holds them. The evaluation peak above is a bound: the last rollout stays stored through it.', '']
    ref = [(r, twin(out, r)) for r in runs if twin(out, r)]
    if ref:
        md += ["### Attention: diffusers' processor against masked keys (full fine-tune, 8 GPUs)", '',
               "diffusers 0.42's HunyuanVideo15AttnProcessor2_0 builds a (B, 1, S, S) boolean mask per block (key mask "
               'AND query mask, S = video + text + image tokens) that SDPA turns into a bf16 bias; hunyuan15.MaskedKeysAttention '
               'gives SDPA the (B, S) key mask alone (a padded query row is never read: the token is masked as a key in '
               'every later block and dropped at the end; tests/test_attention.py: every valid token and the velocity '
               "equal diffusers' to float32 rounding). Same runs, same accounting, only the processor differs.", '']
        rows = []
        for r, q in ref:
            tot = lambda x: x['categories']['total']
            fl = [k for k in r['phases'] if r['phases'][k].get('attn_flops') is not None]
            af, ff = sum(r['phases'][k]['attn_flops'] for k in fl), sum(r['phases'][k]['flops'] for k in fl)
            rows.append([name(r), g(tot(q)), g(tot(r)), g(tot(q) + sum(extras.values())), g(tot(r) + sum(extras.values())),
                         q['peak_phase'], f'{100 * af / ff:.0f}%' if ff else ''])
        md += [table(['run', 'peak, diffusers', 'peak, masked keys', '+ VAE, VideoAlign, diffusers',
                      '+ VAE, VideoAlign, masked keys', 'peak phase (diffusers)', 'attention share of FLOPs'], rows), '',
               'Which kernel SDPA takes on a GPU (torch\'s dispatch rules, aten/src/ATen/native/transformers/cuda/'
               'sdp_utils.cpp; bf16, head dim 128, no dropout): flash never takes a mask, so neither path gets it. '
               "With diffusers' mask: cuDNN where torch prefers it (sm90/sm100 with cuDNN > 9.15; it accepts a (B, 1, S, S) "
               'mask), else the memory-efficient kernel; either reads a materialised (B, S, S) bf16 bias (plus the two '
               '(B, S, S) boolean masks diffusers builds). With masked keys: the same two kernels with a (B, 1, 1, S) '
               'bias, broadcast over heads and query rows: O(B S) memory. A batch without any padding could take flash, '
               'but t2v always has its masked image token.',
               '', "train.py's default attention, valid_tokens (attention.py), takes no mask at all: each sample "
               'attends over its own valid tokens, one backend call per run of equal lengths, so SDPA may run flash; '
               'its FLOPs against masked keys: results/attention_flops.md; its time on a GPU, per processor and backend: '
               '`python -m bench.attention --gpu` (results/attention_gpu.md).', '']
    if out.get('sp'):
        md += sp_report(out, g)
    if out.get('wan'):
        md += FW.wan_report(out, g)
    if out.get('a14b'):
        md += FW22.a14b_report(out, g)
    md += ['### Against bench/toy.py section 5\'s formulas (full fine-tune, 8 GPUs, training micro-step)', '']
    for r in [r for r in runs if r['world'] and r['what'] == 'train']:
        m, f = r['categories'], r['formula']
        rows = [['params fp32', g(m['params (fp32 master)']), g(f['params'])],
                ['grads fp32', g(m['grads (fp32)']), g(f['grads'])],
                ['AdamW', g(m['optimizer (AdamW)']), g(f['optimizer'])],
                ['anchor fp32', g(m['anchor (fp32)']), g(f['anchor'])],
                ['gathered bf16 blocks (+ all-gather / reduce-scatter buffers)',
                 g(m['gathered params (bf16)'] + m['reduce-scatter buffers']), g(f['gathered'])],
                ['activations + backward temporaries', g(m['activations'] + m['backward temporaries']), g(f['activations'])],
                ['total (without the stored rollout and extras)', g(m['total'] - m['stored rollout (fp32)']),
                 g(sum(v for k, v in f.items() if k != 'F'))]]
        md += [f'{name(r)} (peak in the {r["peak_phase"]}):', '', table(['GiB per GPU', 'measured', 'formula'], rows), '']
    md += ['### FLOPs (TFLOP per micro-step or forward, per GPU)', '']
    rows = []
    for r in runs:
        ph, F = r['phases'], r['formula']['F']
        if r['what'] == 'train':
            rows.append([name(r), f'{ph["anchor forward"]["flops"] / 1e12:.0f}', f'{ph["policy forward"]["flops"] / 1e12:.0f}',
                         f'{ph["backward"]["flops"] / 1e12:.0f}', f'{2 * F / 1e12:.0f} / {6 * F / 1e12:.0f}'])
        else:
            n = 2 * (c['rollout_batch'] if r['world'] else 1)
            rows.append([name(r), '', f'{ph["rollout forward"]["flops"] / 1e12:.0f}', '', f'{n * F / 1e12:.0f}'])
    md += [table(['run', 'anchor fwd', 'forward', 'backward (+ recompute)', 'formula fwd / bwd'], rows), '']
    md += [f'### One iteration on paper ({c["clips"]} clips, {c["num_steps"]} steps all trained, at an assumed '
           f'{c["tflops"]:.0f} TFLOP/s sustained per GPU)', '']
    rows = []
    for H, W in c['sizes']:
        tr = next((r for r in runs if r['world'] and r['what'] == 'train' and (r['height'], r['width']) == (H, W)), None)
        ro = next((r for r in runs if r['world'] and r['what'] == 'rollout' and (r['height'], r['width']) == (H, W)), None)
        if not (tr and ro):
            continue
        per_rank = c['clips'] // tr['world']
        f_roll = per_rank / c['rollout_batch'] * c['num_steps'] * ro['phases']['rollout forward']['flops']
        f_upd = per_rank * c['num_steps'] * sum(tr['phases'][k]['flops'] for k in ('anchor forward', 'policy forward', 'backward'))
        rows.append([f'{H}x{W}', f'{f_roll / 1e15:.0f}', f'{f_upd / 1e15:.0f}', f'{f_upd / f_roll:.1f}',
                     f'{(f_roll + f_upd) / (c["tflops"] * 1e12) / 3600:.2f}'])
    md += [table(['size', 'rollout PFLOP/GPU', 'update PFLOP/GPU', 'update/rollout', 'hours/iteration'], rows), '']
    md += ['### What the measurement corrects in the formulas', '']
    tr = next((r for r in runs if r['world'] and r['what'] == 'train'), None)
    if tr:
        m, f, ph = tr['categories'], tr['formula'], tr['phases']
        md += [f'- FLOPs: one CFG branch of one clip is {ph["policy forward"]["flops"] / 2e12:.0f} TFLOP measured, '
               f'{f["F"] / 1e12:.0f} by the formula, which multiplied every block parameter by the tokens; the '
               'adaLN modulation linears (6h x h per stream, a third of a block) act on the timestep embedding '
               'only. The backward with its recompute is '
               f'{ph["backward"]["flops"] / ph["policy forward"]["flops"]:.2f}x the forward (formula: 3x).',
               '- Sharded state (params, grads, AdamW, anchor): ' + '/'.join(g(m[k]) for k in (
                   'params (fp32 master)', 'grads (fp32)', 'optimizer (AdamW)', 'anchor (fp32)')) + ' GiB, formula '
               + '/'.join(g(f[k]) for k in ('params', 'grads', 'optimizer', 'anchor')) + ' (4/4/8/4 bytes a parameter / 8).',
               f'- Communication buffers: FSDP2 also holds the fp32 reduce-scatter input of a block and the '
               f'all-gather buffer: {g(m["gathered params (bf16)"] + m["reduce-scatter buffers"])} GiB, not '
               f'{g(f["gathered"])}.',
               f'- Activations: {g(m["activations"] + m["backward temporaries"])} GiB at the backward peak, not '
               f'{g(f["activations"])}; the anchor forward adds a second sharded copy of the weights for the '
               f'swap (Anchor.applied saves the policy\'s): peak {g(ph["anchor forward"]["peak"]["Total"])} GiB there.']
    ro = [r for r in runs if r['world'] and r['what'] == 'rollout']
    if ro:
        tr = {(r['height'], r['width']): r['peak']['Total'] for r in runs if r['world'] and r['what'] == 'train'}
        md += ['- The rollout forward, absent from the formulas: '
               + ', '.join(f'{g(r["peak"]["Total"])} GiB at {r["height"]}x{r["width"]} (training step: '
                           f'{g(tr.get((r["height"], r["width"]), 0))})' for r in ro)
               + f' ({c["rollout_batch"]} clips x 2 branches in one batch, gradients freed), with masked-key '
               "attention; with diffusers' (B, 1, S, S) mask it was the peak of an iteration (table above)."]
    for r in [r for r in runs if r['lora'] and r['what'] == 'train']:
        tot = (r['peak']['Total'] + sum(extras.values())) / GiB
        md += [f'- LoRA r{r["lora"]} on one GPU, {r["frames"]}x{r["height"]}x{r["width"]}: {tot:.1f} GiB with the VAE and '
               f'VideoAlign resident: {"fits" if tot <= c["gpu_gb"] else "does not fit"} in {c["gpu_gb"]:.0f} GB '
               f'(the frozen base stays fp32, {g(r["categories"]["params (fp32 master)"])} GiB, as load_policy keeps it).']
    return '\n'.join(md + ['', LEFT_OUT])


def sp_report(out, g):
    """results/fullsize.md's sequence-parallel section."""
    seq, extras, c = out['sp'], sum(out['extras'].values()), out['config']
    md = ['### Sequence parallel: per-GPU peaks at sp 1 / 2 / 4 (full fine-tune, 8 GPUs)', '',
          f'The same micro-step and rollout forward with `sp_size` n as train.py runs it (sp.enable: diffusers\' '
          'context parallelism, Ulysses all-to-all over the fake process group, FSDP2 still over all 8 ranks): each '
          f'rank runs the blocks on 1/n of a clip\'s video and text tokens, and holds its sp group\'s {c["clips"]} x n / 8 '
          f'clips\' stored rollout (an sp group shares its clips). Rollout forwards batch {c["rollout_batch"]} clips x 2 CFG '
          'branches. FLOPs are per rank (an sp group does a clip\'s work once, split n ways), train: one micro-step '
          '(anchor forward, policy forward, backward with its recompute).', '']
    rows = []
    for r in seq:
        clip = f'{r["frames"]}x{r["height"]}x{r["width"]}'
        if 'skipped' in r:  # one row for the pair
            rows += [[clip, r['sp'], 'train, rollout', '', '', '', '', r['skipped']]] * (r['what'] == 'train')
            continue
        fl = sum(v['flops'] for v in r['phases'].values())
        rows.append([clip, r['sp'], r['what'], f'{r["tokens"] // r["sp"]:,}', g(r['categories']['total']),
                     g(r['categories']['total'] + extras), f'{fl / 1e12:.0f}',
                     f'peak in the {r["peak_phase"]}; stored rollout {g(r["categories"]["stored rollout (fp32)"])}'])
    md += [table(['clip', 'sp', 'run', 'video tokens a rank', 'peak GiB/GPU', '+ VAE, VideoAlign', 'TFLOP a rank', ''],
                 rows), '']
    over = [r for r in seq if 'skipped' not in r and (r['categories']['total'] + extras) / GiB > c['gpu_gb']]
    md += [f'Above {c["gpu_gb"]:.0f} GB (an H100): ' + (', '.join(f'{r["what"]} {r["frames"]}x{r["height"]}x{r["width"]} '
                                                               f'at sp {r["sp"]}' for r in over) or 'none') + '. '
           'An sp degree must divide the 16 heads and the clip\'s video tokens (hunyuan15.pad_for_sp pads the text, not the '
           'video): 81 frames at 480x848 are 21 x 30 x 53 = 33,390 tokens, which split over 2 but not over 4, and '
           "diffusers' uneven Ulysses split has no backward pass, so it cannot train.", '']
    tr = {(r['frames'], r['height'], r['width'], r['sp']): r for r in seq if r['what'] == 'train' and 'skipped' not in r}
    pairs = [(a, b) for k, a in tr.items() for k2, b in tr.items() if k[:3] == k2[:3] and k[3] == 1 and k2[3] > 1]
    if pairs:
        ratio = lambda a, b, ph: b['phases'][ph]['flops'] * b['sp'] / a['phases'][ph]['flops']
        md += ['What sequence parallel costs in FLOPs: a rollout or policy forward at sp n is 1/n of sp 1\'s per rank, '
               'but the backward is ' + ', '.join(f'{ratio(a, b, "backward"):.2f}x ({b["frames"]}x{b["height"]}x{b["width"]}, '
                                                  f'sp {b["sp"]})' for a, b in pairs) + ' of 1/n '
               '(n x its FLOPs over sp 1\'s): diffusers\' NATIVE attention backend, which the masked-key processor '
               'dispatches to, runs Ulysses through an autograd function that saves only q, k, v and recomputes the '
               'attention forward in its backward (_native_attention_backward_op), one more attention forward per '
               "block on top of the checkpointing recompute. train.py's default attention, valid_tokens, does the "
               'all-to-all itself around the backend\'s own differentiable kernel: no recompute (attention.py).', '']
    return md


if __name__ == '__main__':
    if report_only:
        with open(os.path.join(out_dir, 'fullsize.json')) as f:
            out = json.load(f)
        with open(os.path.join(out_dir, 'fullsize.md'), 'w') as f:
            f.write(report(out) + '\n')
        update_readme(out)
    else:
        estimate()
