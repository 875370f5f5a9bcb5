"""
Routed branches vs noise branches on the AR toy: what a KVPO group looks like. From the same prefix (the
same fork, the same KV state) K branches either route their attention (kvpo.router, the same noise) or keep
the window and draw fresh noise from the fork on (what an SDE-style exploration would vary). Per held-out
prompt x seed, paired: the branches' distance to the toy's data manifold, the spread of their composite
reward within the group, and their mean |r_g - r_anchor|.

    python -m bench.kvpo_branches [--model=assets/toy_ar] [--seeds=2]   # writes results/kvpo_branches.md/.json

Tested by: running it (the toy's numbers are in results/kvpo_branches.md).
"""
import json
import math
import os

import torch

import reward
from infra.configurator import configure
from kvpo import kvpo
from models import family, streaming

model = 'assets/toy_ar'
seeds = 2                       # samples per held-out prompt
group = 6                       # K, kvpo/config/toy.py's
m_nearest, perturb_blocks, frames, keep = 1, 2, 9, 9
OUT = 'results/kvpo_branches'


def groups(fam, net, encode, prompt, seed, shape):
    """(routed clips (K + 1, ...), noise clips (K + 1, ...)), the anchor last in both."""
    ctx = fam.context(encode([prompt]))
    plan = kvpo.plan(frames, net.layout, group, m_nearest, perturb_blocks, keep, seed, frames, frames, 1)
    routed, _, state = kvpo.rollout(net, ctx, frames, shape, plan, seed, m_nearest, perturb_blocks, keep)
    cache, fork = streaming.KVCache(net.layout, keep=keep), plan['fork']
    noisy = []
    with torch.no_grad():
        for k in range(group):
            cache.restore(state)
            tail = [kvpo.denoise_block(net, ctx, cache, b, seed * 1000 + 1 + k, shape) for b in range(fork, frames)]
            noisy.append(torch.cat([routed[-1:, :, :fork]] + tail, 2))
    return routed, torch.cat(noisy + [routed[-1:]])


def main():
    torch.set_num_threads(1)
    fam = family(model)
    net = fam.load_transformer(model)
    encode, decode = fam.text_encoder(model, 'cpu'), fam.load_decoder(model, 'cpu')
    C, _, h, w = fam.latent_shape(model, 9, 0, 0)
    prompts = [p for p in open(os.path.join(model, 'eval_prompts.txt')).read().splitlines() if p.strip()]
    rows = {'routed': [], 'noise': []}
    for i, p in enumerate(prompts):
        for s in range(seeds):
            for name, clips in zip(rows, groups(fam, net, encode, p, 1000 * i + s, (C, h, w))):
                f = decode(clips)
                r = reward.combine(fam.reward(f, [p] * len(f)), (0.5, 0.5, 1.0))
                rows[name].append(dict(manifold=fam.manifold_distance(f[:-1]).mean().item(),
                                       spread=r[:-1].std().item(), gap=(r[:-1] - r[-1]).abs().mean().item()))
    out = {}
    for k in ('manifold', 'spread', 'gap'):
        d = torch.tensor([a[k] - b[k] for a, b in zip(rows['routed'], rows['noise'])], dtype=torch.float64)
        out[k] = dict(routed=sum(a[k] for a in rows['routed']) / len(d), noise=sum(b[k] for b in rows['noise']) / len(d),
                      diff=d.mean().item(), se=(d.std() / math.sqrt(len(d))).item())
    md = ['## KVPO branches on the AR toy: routed attention vs fresh noise', '',
          f'Written by `python -m bench.kvpo_branches` ({model}, {len(prompts)} held-out prompts x {seeds} seeds, '
          f'K = {group}, m = {m_nearest}, P = {perturb_blocks}; the same fork and prefix for both, paired).', '',
          '| per group | routed | fresh noise | routed - noise (SE) |', '|---|---|---|---|']
    names = dict(manifold='branches\' manifold distance', spread='composite std within the group',
                 gap='mean abs(r_g - r_anchor)')
    md += [f'| {names[k]} | {v["routed"]:.4f} | {v["noise"]:.4f} | {v["diff"]:+.4f} ({v["se"]:.4f}) |' for k, v in out.items()]
    with open(OUT + '.json', 'w') as f:
        json.dump(out, f, indent=1)
    with open(OUT + '.md', 'w') as f:
        f.write('\n'.join(md) + '\n')
    print('\n'.join(md))


if __name__ == '__main__':
    configure(globals())
    main()
