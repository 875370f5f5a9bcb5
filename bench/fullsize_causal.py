"""
The streaming Wan 2.1 1.3B (streaming/wan_causal.py) at full size, per GPU: the caches a KVPO rollout holds
(8 branches and the unrouted anchor of one prompt, one prompt a GPU: docs/kvpo.md section 1), measured by torch
on fake tensors (real shapes and dtypes, no storage), at 81x480x832 (21 latent frames, the short setting)
and at the long released setting (147 latent frames: chunks of 21 then +18, 585 video frames).

    python -m bench.fullsize_causal          # writes results/fullsize_causal.md and .json (minutes on a busy CPU)
    python -m bench.fullsize_causal report   # the report again from the .json's measurement

How: the causal transformer is built from the released config (assets/wan21_t2v_1.3b_transformer.json) in
bf16 as fake tensors; streaming.generate runs the clip's first 21 latent frames block by block (5 forwards
a block: 4 steps and the timestep-0 write), with the cache of streaming/__init__.py; the bytes of the cache
(keys and values of every layer, 1,560 tokens a frame, and the text's cross-attention keys and values) are
read off its tensors, the activations of one block forward with a full window by MemTracker. The rows
then count frames: a rolling cache holds sink + window - block = 9 frames whatever the clip's length; a
router (KVPO's Causal History Routing) also keeps the older frames it chooses from, the pool [sink, fork),
shared by the branches (read, never written), while each branch writes its own rolling cache from the fork on.
Counted: the generator in bf16 (inference: rollouts need no fp32 master) and, for training, LoRA r256
on every Linear of the blocks (LongLive's and KVPO's targets) in fp32 with AdamW; the per-step noisy
inputs of every block (the TVE replay's) in fp32. Not counted: the VAE and the reward model, the replay's
backward (the next issue's), CUDA context and fragmentation.
"""
import json
import os

import torch

import streaming
from streaming import wan_causal

# ----------------------------------------------------------------------------- settings
CONFIG = 'assets/wan21_t2v_1.3b_transformer.json'  # the released 1.3B config
HEIGHT, WIDTH = 480, 832        # the released clip size (latents 60 x 104, 1,560 tokens a frame)
SHORT = 21                      # latent frames of the short setting (81 video frames)
LONG = 147                      # latent frames of the long released setting (21 + 7 x 18)
BRANCHES = 8                    # K = G routed branches, plus one unrouted anchor
LORA_RANK = 256                 # KVPO's and LongLive's LoRA rank
GPU_GB = (80, 141)              # H100 / H200 memory
OUT = 'results/fullsize_causal'
GiB = 2 ** 30


def build():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with open(CONFIG) as f:
        cfg = {k: v for k, v in json.load(f).items() if not k.startswith('_')}
    with torch.device('meta'):
        net = wan_causal.CausalWanTransformer3DModel.from_config(cfg).to(torch.bfloat16)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        net.to_empty(device='cpu')
        net.rope = type(net.rope)(net.config.attention_head_dim, net.config.patch_size, net.config.rope_max_seq_len)
    return streaming.install(net, streaming.LAYOUT), mode


def measure():
    from torch.distributed._tools.mem_tracker import MemTracker
    net, mode = build()
    P = sum(p.numel() for p in net.parameters())
    lora = sum(LORA_RANK * (m.in_features + m.out_features) for m in net.blocks.modules() if isinstance(m, torch.nn.Linear))
    h, w = HEIGHT // 8, WIDTH // 8
    T = h // 2 * (w // 2)  # tokens a latent frame
    with mode, torch.no_grad(), torch.autocast('cpu', torch.bfloat16):  # CPU autocast standing in for CUDA's
        noise = torch.randn(1, 16, SHORT, h, w)
        text = torch.randn(1, 512, 4096, dtype=torch.bfloat16)
        cache = streaming.KVCache(net.layout, keep=SHORT)  # everything kept: bytes a frame, below
        streaming.generate(net, noise[:, :, :SHORT - 3], text, cache=cache)
        per_frame = sum(t.numel() * t.element_size() for d in (cache.k, cache.v) for t in d.values()) / len(cache.frames)
        text_bytes = sum(t.numel() * t.element_size() for kv in cache.text.values() for t in kv)
        rolling = streaming.KVCache(net.layout)
        streaming.generate(net, noise[:, :, :SHORT - 3], text, cache=rolling)
        tracker = MemTracker()
        tracker.track_external(net)
        with tracker:  # one block forward with a full window: its transient activations
            streaming.forward_block(net, noise[:, :, SHORT - 3:], torch.ones(1), text, rolling, SHORT - 3)
        snap = tracker.get_tracker_snapshot('peak')
        peak = sum(v for c in snap.values() for k, v in c.items() if 'ACT' in str(k) or 'TEMP' in str(k))
    return dict(P=P, lora=lora, tokens_per_frame=T, cache_frame=per_frame, text_cache=text_bytes,
                rolling_frames=len(rolling.frames), activations=peak)


def rows(m):
    """GiB per GPU of one prompt's rollout: the anchor and BRANCHES branches, at each setting."""
    L = streaming.LAYOUT
    out = {}
    for name, frames in (('short', SHORT), ('long', LONG)):
        fork = SHORT - L['block'] if name == 'short' else SHORT + 18 - L['block']  # the latest fork: the last block of
        pool = fork - 4 - L['sink']  # the first chunk(s); the router's older frames [sink, fork - m), m = 4, at most
        n = BRANCHES + 1
        latents = n * frames * 16 * (HEIGHT // 8) * (WIDTH // 8) * 4 * len(L['timesteps'])  # x_t of every step, fp32
        r = {'generator (bf16)': 2 * m['P'],
             f'rolling caches ({n} x {m["rolling_frames"]} frames)': n * m['rolling_frames'] * m['cache_frame'],
             f'text caches ({n})': n * m['text_cache'],
             'routing pool (older frames, shared; at most)': pool * m['cache_frame'],
             f'noisy inputs of every step ({n} clips, fp32)': latents,
             'activations of one block forward': m['activations']}
        r['rollout total'] = sum(r.values())
        r[f'+ LoRA r{LORA_RANK} adapters fp32 + AdamW'] = 16 * m['lora']
        r['+ the whole history kept once, shared, beyond the pool (upper bound)'] = \
            (frames - L['block'] - pool) * m['cache_frame']  # every frame before the last block
        out[name] = r
    return out


def report(m, r):
    g = lambda b: f'{b / GiB:.2f}'
    L = streaming.LAYOUT
    md = ['## Streaming Wan 2.1 1.3B at full size: a KVPO rollout per GPU', '',
          'Written by `python -m bench.fullsize_causal` (fake tensors, torch: bench/fullsize_causal.py says how). '
          f'Generator {m["P"] / 1e9:.3f} B parameters; blocks of {L["block"]} latent frames, sink {L["sink"]}, window '
          f'{L["window"]} frames with the sink and the block, {len(L["timesteps"])} steps; {m["tokens_per_frame"]:,} tokens '
          f'a latent frame at {HEIGHT}x{WIDTH}. One cached frame (keys and values of all 30 layers, bf16): '
          f'{m["cache_frame"] / 2 ** 20:.0f} MiB; the text (512 tokens, every layer): {m["text_cache"] / 2 ** 20:.0f} MiB; '
          f'a rolling cache holds {m["rolling_frames"]} frames whatever the clip length. One prompt a GPU: '
          f'{BRANCHES} routed branches and the unrouted anchor, each with its own rolling cache; the routing pool '
          '(the older frames the branches choose from) is shared and read only.', '',
          f'| GiB per GPU | short: {SHORT} latent frames (81x{HEIGHT}x{WIDTH}) | long: {LONG} latent frames ({(LONG - 1) * 4 + 1}x{HEIGHT}x{WIDTH}) |',
          '|---|---|---|']
    for k in r['short']:
        bold = k == 'rollout total'
        a, b = (f'**{g(r[s][k])}**' if bold else g(r[s][k]) for s in ('short', 'long'))
        md.append(f'| {"**" + k + "**" if bold else k} | {a} | {b} |')
    for s in ('short', 'long'):
        t = r[s]['rollout total'] + r[s][f'+ LoRA r{LORA_RANK} adapters fp32 + AdamW']
        md.append('')
        md.append(f'{s}: rollout and LoRA training state {g(t)} GiB, '
                  + ', '.join(f'fits {gb} GB: {"yes" if t / GiB <= gb else "no"}' for gb in GPU_GB) + '.')
    md += ['', 'The rolling caches dominate (about 8x the bf16 weights): nine caches of nine frames. The window '
           'bounds them, not the clip, so the long setting costs more only by its per-step inputs (the TVE replay '
           'keeps every block\'s noisy inputs), a larger routing pool and, were the whole history kept, its frames. '
           'Halving the branches a GPU holds (4 + the anchor a GPU, two GPUs a prompt) halves the first row. Not measured: the replay\'s backward through the cache '
           '(the next issue\'s KVPO), the VAE decode of 585 frames, the reward model, CUDA context.', '']
    return md


if __name__ == '__main__':
    import sys
    m = json.load(open(OUT + '.json'))['measured'] if sys.argv[1:] == ['report'] else measure()
    r = rows(m)
    os.makedirs('results', exist_ok=True)
    with open(OUT + '.json', 'w') as f:
        json.dump(dict(measured=m, rows=r), f, indent=1)
    with open(OUT + '.md', 'w') as f:
        f.write('\n'.join(report(m, r)))
    print('\n'.join(report(m, r)))
