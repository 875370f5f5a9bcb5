"""
Routed branches vs noise branches on the AR toy: what a KVPO group looks like beside a GRPO group. From the
same prefix (the same fork, the same KV state) K branches either route their attention (kvpo.router, the
anchor's noise), or keep the window and draw fresh initial noise from the fork on (ODE), or keep the window
and the anchor's initial noise and take the SDE (kvpo/sde_ar.py: SAGE, eta 0.5, every step; the exploration
of kvpo/grpo_ar.py). Per held-out prompt x seed, paired: the branches' distance to the toy's data manifold,
the spread of their composite reward within the group, their mean |r_g - r_anchor|, and their RMS pixel
distance to the anchor's frames from the fork on.

    python -m bench.kvpo_branches [--model=assets/toy_ar] [--seeds=2]   # writes results/kvpo_branches.md/.json

Tested by: running it (the toy's numbers are in results/kvpo_branches.md).
"""
import math
import os

import torch

import reward
import sde
from bench.common import write_report
from infra.configurator import configure
from kvpo import kvpo, sde_ar
from models import family
import streaming

model = 'assets/toy_ar'
seeds = 2                       # samples per held-out prompt
group = 6                       # K, kvpo/config/toy.py's
m_nearest, perturb_blocks, frames, keep = 1, 2, 9, 9
sampler, eta = 'sage', 0.5      # the SDE branches' (kvpo/config/grpo_toy.py's)
OUT = 'results/kvpo_branches'


def groups(fam, net, encode, prompt, seed, shape):
    """The fork and {kind: clips (K + 1, C, F, h, w)} of the routed, noise and SDE branches, the anchor last."""
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
        steps = sde.stochastic_steps(sampler, torch.tensor(sde_ar.schedule(net.layout)), eta)  # every step
        x1 = kvpo.noise_at(seed, range(fork, frames), 0, shape)  # the anchor's initial noise
        sdes = []
        for k in range(group):
            cache.restore(state)
            gen = torch.Generator().manual_seed(seed * 1000 + 500 + k)  # the branch's SDE noise
            tail, _ = sde_ar.generate(net, x1, ctx, steps, sampler, eta, [gen], cache)
            sdes.append(torch.cat([routed[-1:, :, :fork], tail], 2))
    return fork, dict(routed=routed, noise=torch.cat(noisy + [routed[-1:]]), sde=torch.cat(sdes + [routed[-1:]]))


def main():
    torch.set_num_threads(1)
    fam = family(model)
    net = fam.load_transformer(model)
    encode, decode = fam.text_encoder(model, 'cpu'), fam.load_decoder(model, 'cpu')
    C, _, h, w = fam.latent_shape(model, 9, 0, 0)
    prompts = [p for p in open(os.path.join(model, 'eval_prompts.txt')).read().splitlines() if p.strip()]
    rows = {'routed': [], 'noise': [], 'sde': []}
    for i, p in enumerate(prompts):
        for s in range(seeds):
            fork, kinds = groups(fam, net, encode, p, 1000 * i + s, (C, h, w))
            for name, clips in kinds.items():
                f = decode(clips)
                r = reward.combine(fam.reward(f, [p] * len(f)), (0.5, 0.5, 1.0))
                dist = (f[:-1, fork:] - f[-1:, fork:]).square().flatten(1).mean(1).sqrt()  # (K,) RMS to the anchor
                rows[name].append(dict(manifold=fam.manifold_distance(f[:-1]).mean().item(),
                                       spread=r[:-1].std().item(), gap=(r[:-1] - r[-1]).abs().mean().item(),
                                       dist=dist.mean().item()))
    out = {}
    for k in ('manifold', 'spread', 'gap', 'dist'):
        out[k] = {name: sum(a[k] for a in v) / len(v) for name, v in rows.items()}
        for other in ('noise', 'sde'):
            d = torch.tensor([a[k] - b[k] for a, b in zip(rows['routed'], rows[other])], dtype=torch.float64)
            out[k][f'routed-{other}'] = dict(diff=d.mean().item(), se=(d.std() / math.sqrt(len(d))).item())
    md = ['## KVPO branches on the AR toy: routed attention vs fresh noise', '',
          f'Written by `python -m bench.kvpo_branches` ({model}, {len(prompts)} held-out prompts x {seeds} seeds, '
          f'K = {group}, m = {m_nearest}, P = {perturb_blocks}; the same fork and prefix for all three, paired; '
          f'SDE: {sampler}, eta {eta}, every step, the anchor\'s initial noise; a mean over the groups, and the '
          'paired difference\'s mean and standard error).', '',
          '| per group | routed | fresh noise (ODE) | SDE (GRPO\'s) | routed - noise (SE) | routed - SDE (SE) |',
          '|---|---|---|---|---|---|']
    names = dict(manifold='branches\' manifold distance', spread='composite std within the group',
                 gap='mean abs(r_g - r_anchor)', dist='RMS pixel distance to the anchor (from the fork)')
    md += [f'| {names[k]} | {v["routed"]:.4f} | {v["noise"]:.4f} | {v["sde"]:.4f} | '
           + ' | '.join(f'{v[d]["diff"]:+.4f} ({v[d]["se"]:.4f})' for d in ('routed-noise', 'routed-sde')) + ' |'
           for k, v in out.items()]
    write_report(OUT, out, md)


if __name__ == '__main__':
    configure(globals())
    main()
