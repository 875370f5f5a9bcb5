"""
The blocks' attention at HunyuanVideo 1.5's real sizes (attention.py): what leaving the masked tokens
out saves in FLOPs, and on a GPU, one block's forward + backward timed for each processor (diffusers'
own, masked keys, valid tokens) on each dispatcher backend the GPU has, with the kernel that ran.

    python -m bench.attention                   # FLOPs per pass, with and without the dropped tokens
                                                # -> results/attention_flops.md (a CPU, ~1 min)
    python -m bench.attention --gpu             # one GPU: the timing -> results/attention_gpu.{md,json}
    python -m bench.attention --gpu --tiny --device=cpu   # the same at tiny size on a CPU (tests)

bench/gpu_check.py's attention phase times the same processor on every backend at the two sizes.

FLOPs: one real-width block (16 heads x 128, bf16) runs on fake tensors under bench.fullsize_measure's
FlopCount (torch's per-op formulas) with MaskedKeysAttention and with ValidTokensAttention, for a CFG
pair (a prompt and the negative prompt, padded to the longer as model.batch_text pads them), at
81x352x624 (18,018 video tokens) and 81x480x848 (33,390); x 54 blocks is the blocks' cost of a pass
(one clip, one CFG branch; the token refiner, embedders and output layer are the same either way).
The valid lengths are given to the processor (fake tensors have no values to read).

GPU timing: random weights at real width, the same CFG pair; per processor x backend: milliseconds
of forward + backward (mean of `reps` after a warm-up), the CUDA peak above the inputs, the largest
difference of any video or valid text output from diffusers' processor on 'native' (relative to its
largest output), and the attention kernels the profiler saw. torch, CUDA, cuDNN and GPU are printed
and written. Backends whose package this machine lacks are listed as such; hub backends (a download)
are not tried; _native_math and flex above 8k tokens are skipped: both materialise (B, heads, S, S)
scores (diffusers calls flex without torch.compile), ~145 GB at 480p.
Tested by: python -m pytest tests/test_bench_attention.py
"""
import json
import os
import re
import sys
import time

import torch
import torch.nn.functional as F

from bench.common import table
from infra.configurator import configure

# ----------------------------------------------------------------------------- settings
gpu = False                     # --gpu: time the processors on a device instead of counting FLOPs
tiny = False                    # --tiny: bench.fullsize_gpu's tiny transformer, 9x64x96 (a check of this script)
device = 'cuda'                 # device of the timing
video_sizes = ((81, 352, 624), (81, 480, 848))  # frames x H x W: the paper's rollout size, the model's 480p
prompt = (256, 32)              # valid Qwen and ByT5 tokens of the prompt (ByT5: quoted text)
negative = (8, 0)               # of the negative prompt (an empty prompt: a few tokens, no quoted text)
text_cases = ((256, 32), (128, 0), (1000, 256))  # FLOP table: prompts (Qwen, ByT5), each with `negative`
reps = 3                        # timed repetitions per processor and backend
budget = 240                    # seconds: no new case starts after this (the GPU's window is short)
out = 'results/attention'       # writes out_flops.md, out_gpu.md and out_gpu.json
config = configure(globals(), [a + '=True' if a in ('--gpu', '--tiny') else a for a in sys.argv[1:]]
                   if __name__ == '__main__' else [])
# -----------------------------------------------------------------------------
TRIED = ('native', '_native_flash', '_native_cudnn', '_native_efficient', '_native_math', 'flex', 'flash',
         'flash_varlen', '_flash_3', '_flash_varlen_3', 'sage', 'sage_varlen', 'xformers')  # no download needed
DENSE_LIMIT = 8192  # tokens above which _native_math and flex are not tried (S x S scores)


def shapes(Fr, H, W, small=False):
    """(heads, head dim, video tokens, rope axes) of the block at a clip size."""
    from bench import fullsize_measure as bf
    from bench.fullsize_gpu import TINY
    cfg = TINY if small else bf.load_config()
    return (cfg['num_attention_heads'], cfg['attention_head_dim'], bf.video_tokens(Fr, H, W),
            tuple(cfg.get('rope_axes_dim', (16, 56, 56))), (((Fr - 1) // 4 + 1), H // 16, W // 16))


def make_block(heads, d, dev, dtype):
    """A HunyuanVideo 1.5 transformer block, random weights ('meta': shapes only)."""
    from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15TransformerBlock
    with torch.device(dev):
        return HunyuanVideo15TransformerBlock(heads, d, mlp_ratio=4.0, qk_norm='rms_norm').to(dtype)


def block_inputs(heads, d, V, grid, axes, lengths, T, dev, dtype, grad):
    """A CFG pair's inputs to a block: video (B, V, D), text (B, T, D) with lengths[b] valid tokens
    first (diffusers' order), the timestep embedding, the (B, T) text mask and the rope tables."""
    from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15RotaryPosEmbed
    D, B = heads * d, len(lengths)
    rope = HunyuanVideo15RotaryPosEmbed(1, 1, axes, 256.0)(torch.empty(1, 1, *grid, device=dev))  # (V, d) each
    x = torch.randn(B, V, D, device=dev, dtype=dtype, requires_grad=grad)
    txt = torch.randn(B, T, D, device=dev, dtype=dtype, requires_grad=grad)
    temb = torch.randn(B, D, device=dev, dtype=dtype)
    mask = torch.arange(T, device=dev)[None] < torch.tensor(lengths, device=dev)[:, None]  # (B, T)
    return x, txt, temb, mask, rope


# ----------------------------------------------------------------------------- FLOPs

def block_flops(Fr, H, W, text, neg, kind, small=False):
    """FLOPs of one block's forward and forward + backward for the CFG pair (text, neg), each
    (Qwen, ByT5) valid tokens, with the blocks' attention `kind`, on fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from bench import fullsize_measure as bf
    from models.hunyuan15 import IMAGE_TOKENS, set_attention
    from types import SimpleNamespace
    heads, d, V, axes, grid = shapes(Fr, H, W, small)
    n = [sum(text), sum(neg)]  # valid text tokens of each branch (the image token is masked)
    T = max(text[0], neg[0]) + max(text[1], neg[1], 1) + IMAGE_TOKENS  # batch_text pads each encoder's part
    res = {}
    blk = make_block(heads, d, 'meta', torch.bfloat16)
    with FakeTensorMode(allow_non_fake_inputs=True):
        blk.to_empty(device='cpu')  # fake storage
        args = block_inputs(heads, d, V, grid, axes, n, T, 'cpu', torch.bfloat16, True)
        set_attention(SimpleNamespace(transformer_blocks=[blk]), kind)
        args[3].valid_lengths = n  # what ValidTokensAttention reads from the mask on real tensors
        fc = bf.FlopCount()
        with fc, bf.attention('gpu'):  # SDPA as a GPU runs it (a CPU's fake kernel is not counted)
            a, b = blk(*args)
            res['forward'], res['attn_forward'] = fc.total, fc.attn
            (a.float().sum() + b.float().sum()).backward()
        res['forward+backward'], res['attn_forward+backward'] = fc.total, fc.attn
    return dict(res, V=V, T=T, valid=n)


def flops_report():
    from bench import fullsize_measure as bf
    cfg = bf.load_config()
    L, hd = cfg['num_layers'], cfg['num_attention_heads'] * cfg['attention_head_dim']
    rows, raw = [], []
    for Fr, H, W in video_sizes:
        for text in text_cases:
            m, v = (block_flops(Fr, H, W, text, negative, k) for k in ('masked_keys', 'valid_tokens'))
            # a FlexAttention block mask at its best (valid x valid): whole 128 x 128 tiles, closed form
            tiles = sum((-(-(m['V'] + n) // 128) * 128) ** 2 for n in m['valid'])
            flex = m['forward'] - m['attn_forward'] + 4 * hd * tiles
            raw.append(dict(size=(Fr, H, W), text=text, negative=negative, masked_keys=m, valid_tokens=v, flex=flex))
            per = lambda f: f'{L * f / 2 / 1e12:.1f}'  # a pass: one clip, one CFG branch, TFLOP
            rows.append([f'{Fr}x{H}x{W}', f'{text[0]} + {text[1]}', f'{m["V"] + m["T"]:,}',
                         f'{2 * m["T"] - sum(m["valid"])}', per(m['forward']), per(v['forward']), per(flex),
                         f'{100 * (1 - v["forward"] / m["forward"]):.2f}%',
                         f'{100 * (1 - v["attn_forward"] / m["attn_forward"]):.2f}%',
                         per(m['forward+backward']), per(v['forward+backward'])])
    md = ['# Attention without masks: FLOPs per pass with and without the dropped tokens', '',
          f'Written by `python -m bench.attention` (bench/attention.py; torch {torch.__version__}): one HunyuanVideo 1.5 '
          f'block at real width on fake tensors, FLOPs by torch\'s per-op formulas, x {L} blocks, per pass (one clip, one '
          f'CFG branch). A CFG pair: the prompt (Qwen + ByT5 valid tokens below) and a negative prompt of '
          f'{negative[0]} + {negative[1]}, padded to the longer as model.batch_text pads them, plus t2v\'s masked image token. '
          'masked keys: every sample attends over all S tokens, padding masked (1 backend call a block); valid tokens '
          '(train.py\'s default, attention.attend): each over its own valid tokens, no mask, 2 calls a block (one per '
          'branch); packing both into one variable-length call costs the same FLOPs; a FlexAttention block mask (1 call) '
          'computes whole 128 x 128 tiles, at best those of each sample\'s valid x valid tokens (closed form). '
          'The token refiner, embedders and output layer cost the same either way and are left out.', '',
          table(['clip', 'prompt tokens', 'S a sample', 'masked tokens in the pair', 'fwd TFLOP, masked keys',
                 'valid tokens (split = packed)', 'flex block mask', 'saved by valid tokens', 'of attention',
                 'fwd+bwd TFLOP, masked keys', 'fwd+bwd, valid tokens'], rows), '',
          'Dropping the padding saves FLOPs in proportion to it: little against 18-35k video tokens. What the mask '
          'costs beyond FLOPs is the kernel: with any mask torch\'s SDPA never runs flash (docs/method.md section '
          '12.3); `python -m bench.attention --gpu` times that on a GPU (results/attention_gpu.md).']
    os.makedirs(os.path.dirname(out) or '.', exist_ok=True)
    with open(out + '_flops.md', 'w') as f:
        f.write('\n'.join(md) + '\n')
    print('\n'.join(md))
    return raw


# ----------------------------------------------------------------------------- GPU timing

def versions(dev):
    import diffusers
    v = dict(torch=torch.__version__, diffusers=diffusers.__version__, cuda=torch.version.cuda,
             cudnn=torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
             device=torch.cuda.get_device_name(dev) if dev.startswith('cuda') else 'cpu')
    for pkg in ('flash_attn', 'flash_attn_interface', 'sageattention', 'xformers'):
        try:
            v[pkg] = getattr(__import__(pkg), '__version__', 'present')
        except ImportError:
            pass
    return v


def kernels(fn, cuda):
    """The attention kernels one call of fn runs (profiler names, largest device time first)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    pat = re.compile(r'flash|fmha|cudnn|attention|attn|sdpa|flex|sage|cutlass', re.I)
    ev = [(e.device_time_total if cuda else e.cpu_time_total, e.key) for e in prof.key_averages() if pat.search(e.key)]
    if not cuda:  # CPU: the aten ops themselves
        ev = [(t, k) for t, k in ev if k.startswith('aten::_scaled_dot_product') or 'flex' in k]
    return [k[:70] for _, k in sorted(ev, reverse=True)[:2]]


def time_all():
    """Every processor x backend this device runs, at each size: a list of result dicts."""
    from types import SimpleNamespace
    from models.attention import check
    from models.hunyuan15 import IMAGE_TOKENS, set_attention
    cuda, t_start = device.startswith('cuda'), time.time()
    dtype = torch.bfloat16 if cuda else torch.float32
    avail = {}
    for b in TRIED:  # installed packages only; SystemExit carries the reason
        try:
            set_attention(SimpleNamespace(transformer_blocks=[]), 'valid_tokens', b)
            avail[b] = None
        except SystemExit as e:
            avail[b] = str(e.code)
    rows = []
    for Fr, H, W in ((9, 64, 96),) if tiny else video_sizes:
        heads, d, V, axes, grid = shapes(Fr, H, W, tiny)
        pair = ((8, 4), (3, 0)) if tiny else (prompt, negative)
        n = [sum(p) for p in pair]
        T = max(pair[0][0], pair[1][0]) + max(pair[0][1], pair[1][1], 1) + IMAGE_TOKENS
        torch.manual_seed(0)
        blk = make_block(heads, d, device, dtype)
        args = block_inputs(heads, d, V, grid, axes, n, T, device, dtype, True)
        valid = args[3]                                                  # (B, T) the valid text tokens
        ref = None
        for kind in ('diffusers', 'masked_keys', 'valid_tokens'):
            for b in TRIED:
                r = dict(size=f'{Fr}x{H}x{W}', tokens=V + T, processor=kind, backend=b)
                rows.append(r)
                if avail[b] is not None or check(kind, b):
                    r['skipped'] = 'not installed' if avail[b] is not None else 'takes no mask'
                    continue
                if b in ('_native_math', 'flex') and V + T > DENSE_LIMIT:
                    r['skipped'] = 'materialises S x S scores'
                    continue
                if time.time() - t_start > budget:
                    r['skipped'] = 'time budget spent'
                    continue
                set_attention(SimpleNamespace(transformer_blocks=[blk]), kind, b)

                def call(grad=True):
                    with torch.set_grad_enabled(grad):
                        a, c = blk(*args)
                        if grad:
                            (a.float().square().mean() + c[valid].float().square().mean()).backward()
                    return a.detach(), c.detach()
                try:
                    a, c = call()  # warm-up (kernel selection, allocator), its outputs compared
                    if ref is None:
                        ref = (a, c[valid])  # diffusers' processor on native: the reference
                    scale = max(ref[0].abs().max(), ref[1].abs().max()).float()
                    r['max_rel_diff'] = float(max((a - ref[0]).abs().max(), (c[valid] - ref[1]).abs().max()) / scale)
                    if cuda:
                        torch.cuda.synchronize()
                        torch.cuda.reset_peak_memory_stats()
                        base = torch.cuda.memory_allocated()
                    t = time.time()
                    for _ in range(reps):
                        call()
                    if cuda:
                        torch.cuda.synchronize()
                    r['ms'] = 1000 * (time.time() - t) / reps
                    r['peak_gib'] = (torch.cuda.max_memory_allocated() - base) / 2 ** 30 if cuda else None
                    r['kernels'] = kernels(call, cuda)
                except Exception as e:  # a backend that fails on this device or these shapes: recorded
                    r['error'] = f'{type(e).__name__}: {str(e).splitlines()[0][:120]}'
                    if cuda:
                        torch.cuda.empty_cache()
                blk.zero_grad(set_to_none=True)
                for t_ in args[:2]:
                    t_.grad = None
                print(json.dumps(r), flush=True)
        del blk, args, ref
        if cuda:
            torch.cuda.empty_cache()
    return rows, avail


def gpu_report(rows, avail, info):
    ran = [r for r in rows if 'ms' in r or 'error' in r]
    cell = lambda r: (f'{r["ms"]:.1f}' if 'ms' in r else r['error'])
    md = ['# Attention on a GPU: one block\'s forward + backward per processor and backend', '',
          f'Written by `python -m bench.attention --gpu` (bench/attention.py) on {info["device"]}: torch {info["torch"]}, '
          f'CUDA {info["cuda"]}, cuDNN {info["cudnn"]}, diffusers {info["diffusers"]}'
          + ''.join(f', {k} {v}' for k, v in info.items() if k not in ('torch', 'cuda', 'cudnn', 'diffusers', 'device'))
          + '. One HunyuanVideo 1.5 block at real width (16 heads x 128), bf16, random weights; a CFG pair: a prompt of '
          f'{prompt[0]} + {prompt[1]} valid tokens and a negative of {negative[0]} + {negative[1]}, padded as model.batch_text '
          f'pads them, plus the masked image token. ms: mean of {reps} forward + backward; peak: CUDA memory above the '
          "inputs; diff: the largest difference of a video or valid text output from diffusers' processor on native, "
          'relative to its largest output (bf16 rounding is ~1e-2).', '',
          table(['clip', 'tokens', 'processor', 'backend', 'fwd+bwd ms', 'peak GiB', 'diff', 'attention kernels'],
                [[r['size'], f'{r["tokens"]:,}', r['processor'], r['backend'], cell(r),
                  f'{r["peak_gib"]:.1f}' if r.get('peak_gib') is not None else '',
                  f'{r["max_rel_diff"]:.1e}' if 'max_rel_diff' in r else '', '; '.join(r.get('kernels', []))]
                 for r in ran]), '']
    absent = sorted(b for b, why in avail.items() if why)
    skipped = sorted({(r['processor'], r['backend'], r['skipped']) for r in rows if r.get('skipped') not in
                      (None, 'not installed')})
    md += [f'Not installed here: {", ".join(absent) or "none"}. Skipped: '
           + ('; '.join(f'{p} on {b} ({why})' for p, b, why in skipped) or 'none') + '.']
    return '\n'.join(md)


def gpu_main():
    info = versions(device)
    print(json.dumps(info), flush=True)
    rows, avail = time_all()
    md = gpu_report(rows, avail, info)
    print(md)
    if device.startswith('cuda') and not tiny:  # the table is a GPU's measurement: only then written
        os.makedirs(os.path.dirname(out) or '.', exist_ok=True)
        with open(out + '_gpu.md', 'w') as f:
            f.write(md + '\n')
        with open(out + '_gpu.json', 'w') as f:
            json.dump(dict(info=info, config=config, rows=rows, unavailable=avail), f, indent=1)
        print(f'wrote {out}_gpu.md and {out}_gpu.json')
    print('ATTENTION_JSON ' + json.dumps(dict(info=info, rows=rows)))
    return rows


if __name__ == '__main__':
    gpu_main() if gpu else flops_report()
