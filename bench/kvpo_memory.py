"""
KVPO (kvpo/train.py) on LongLive (Wan 2.1 1.3B, kvpo/config/longlive.py) per GPU, one prompt a GPU: the
bytes of what kvpo/train.py holds, from sizes measured on fake tensors (real shapes and dtypes, no storage).

    python -m bench.kvpo_memory            # measures one grad replay forward (~2 min), writes results/kvpo_memory.md/.json
    python -m bench.kvpo_memory report     # the report again from the .json

How: a cached frame's bytes, the text cache's, the parameters and the LoRA size are
bench/fullsize_causal.py's measurement (results/fullsize_causal.json); measured here: the activations one
replay forward with gradient keeps for its backward (a 3-frame block over a full window of 9 cached frames,
MemTracker, CPU autocast standing in for CUDA's). The rows count what kvpo/train.py allocates: the policy
(bf16 base, LoRA r256 fp32 with gradients and AdamW), three deep copies (old policy, initial policy, EMA),
the KV state at the fork and one branch's own cache at a time (branches run one after another, each from
the saved state), the clips and trajectories, and the replay with activation checkpointing (one
forward's activations live at a time) or without (one branch's P x grad_steps forwards). Not counted: the
VAE decode, the reward model, CUDA context and fragmentation.
"""
import json
import os
import sys

import torch

from bench.fullsize_causal import HEIGHT, WIDTH, build
from bench.fullsize_causal import OUT as MEASURED
import streaming

K, P, GRAD_STEPS, CACHE, FRAMES, LORA = 8, 5, 2, 33, 147, 256  # kvpo/config/longlive.py's
OUT = 'results/kvpo_memory'
GiB = 2 ** 30


def measure():
    from torch.distributed._tools.mem_tracker import MemTracker
    net, mode = build()
    h, w = HEIGHT // 8, WIDTH // 8
    T, H, D = h // 2 * (w // 2), net.config.num_attention_heads, net.config.attention_head_dim
    with mode, torch.autocast('cpu', torch.bfloat16):
        cache = streaming.KVCache(net.layout, keep=CACHE)
        for layer in range(len(net.blocks)):  # 9 cached frames: the full window of a block at frame 9
            kv = [torch.randn(1, 9 * T, H, D, dtype=torch.bfloat16) for _ in range(2)]
            cache.write(layer, list(range(9)), *kv)
        text = torch.randn(1, 512, 4096, dtype=torch.bfloat16)
        tracker = MemTracker()
        tracker.track_external(net)
        with tracker:  # what a grad forward keeps for its backward
            streaming.forward_block(net, torch.randn(1, 16, 3, h, w), torch.ones(1), text, cache, 9)
        snap = tracker.get_tracker_snapshot('current')
        act = sum(v for c in snap.values() for k, v in c.items() if 'ACT' in str(k) or 'TEMP' in str(k))
    return dict(grad_forward_activations=act)


def rows(m):
    f = m['cache_frame']
    latent = 16 * (HEIGHT // 8) * (WIDTH // 8) * 4  # a latent frame, fp32
    base, lora = 2 * m['P'], 4 * m['lora']
    r = {'policy: base bf16 + LoRA fp32': base + lora,
         'LoRA gradients + AdamW state': 3 * lora,
         'old, initial and EMA policies (deep copies)': 3 * (base + lora),
         f'KV state at the fork (<= {CACHE} frames) and text': CACHE * f + m['text_cache'],
         f'one branch\'s own cache (<= {CACHE} frames)': CACHE * f,
         f'clips ({K} + anchor, {FRAMES} latent frames, fp32)': (K + 1) * FRAMES * latent,
         f'trajectories (x_t and x0, {K} x {P} blocks x 4 steps, fp32)': 2 * K * P * 4 * 3 * latent,
         'replay: one grad forward\'s activations (checkpointed: one live)': m['grad_forward_activations']}
    r['total, activation checkpointing on'] = sum(r.values())
    r[f'replay without checkpointing: one branch ({P} x {GRAD_STEPS} grad forwards)'] = \
        P * GRAD_STEPS * m['grad_forward_activations']
    r[f'replay without checkpointing: all {K} branches at once (released chunk size 0)'] = \
        K * P * GRAD_STEPS * m['grad_forward_activations']
    return r


def report(m, r):
    g = lambda b: f'{b / GiB:.2f}'
    md = ['## KVPO on LongLive 1.3B per GPU (kvpo/train.py, kvpo/config/longlive.py)', '',
          'Written by `python -m bench.kvpo_memory` (fake tensors; bench/kvpo_memory.py says how). One prompt a '
          f'GPU, {K} branches and the anchor, {FRAMES} latent frames at {HEIGHT}x{WIDTH}, P = {P} routed blocks, '
          f'gradient through {GRAD_STEPS} of 4 steps, LoRA r{LORA}. A cached frame {m["cache_frame"] / 2 ** 20:.0f} MiB; '
          f'one replay forward with gradient keeps {g(m["grad_forward_activations"])} GiB for its backward.', '',
          '| GiB per GPU | |', '|---|---|']
    md += [f'| {"**" + k + "**" if k.startswith("total") else k} | {g(v)} |' for k, v in r.items()]
    t = r['total, activation checkpointing on']
    md += ['', f'With activation checkpointing and one branch\'s backward at a time (the defaults): {g(t)} GiB, '
           f'fits 80 GB: {"yes" if t / GiB <= 80 else "no"}, 141 GB: {"yes" if t / GiB <= 141 else "no"}. Without '
           'checkpointing a single branch\'s replay graph alone exceeds a GPU: kvpo/train.py\'s '
           'activation_checkpointing and branch_backward are what make the released setting fit. The three deep '
           'copies hold the frozen base three more times; sharing it (LoRA weights swapped in, as the released '
           'code offloads its copies to the CPU) would save 3 x 2.64 GiB. Not counted: VAE, reward model, CUDA context.', '']
    return md


if __name__ == '__main__':
    measured = json.load(open(MEASURED + '.json'))['measured']
    mine = json.load(open(OUT + '.json'))['measured'] if sys.argv[1:] == ['report'] else measure()
    m = {**measured, **mine}
    r = rows(m)
    with open(OUT + '.json', 'w') as f:
        json.dump(dict(measured=mine, rows=r), f, indent=1)
    with open(OUT + '.md', 'w') as f:
        f.write('\n'.join(report(m, r)))
    print('\n'.join(report(m, r)))
