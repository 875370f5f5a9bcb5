"""
What signal each streaming method's group carries on the distilled toy, before any update: the untrained
assets/toy_sf, the settings of kvpo/config/toy_sf.py and kvpo/config/grpo_toy_sf.py, the same prompts (each
method its own noise draws, seeded by the video). It measures the three suspects of issue 58 for KVPO lowering the toy, where no training run
can separate them:
 - routing that gives identical branches at small pools: distinct routings among the K branches (the pool is
   the frames between the sink and the fork's nearest, 2 to 5 on a 9-frame clip, n_random = 2 of them);
 - the double normalisation of near-tied advantages: the spread of the branches' composites (their std and
   the largest |r_g - r_anchor|) against GRPO-SDE's group (its SAGE noise), and how the fused advantage
   (A / std(A), clamped at 2.5) turns it into unit-sized advantages: distinct values, the share at the clamp;
 - the TVE weight: the spread of the branches' scores s_g (1 / (2 max(sigma, 1)^2) x the x0 energy) and the
   softmax's entropy against log K (a near-uniform policy: a tiny log-prob gradient a branch).

    python -m bench.kvpo_signal [--videos=48]     # results/kvpo_signal.md/.json (~3 min, one thread)
    python -m bench.kvpo_signal --model=assets/toy_sf/ode_init --out=results/kvpo_signal_ode_init

Tested by: running it (the numbers are in results/kvpo_signal.md); the pieces by tests/test_kvpo*.py.
"""
import math
import statistics as st

import torch

import reward
from bench.common import table, write_report
from infra.configurator import configure
from infra.prompt_cache import read_prompts
from kvpo import kvpo, sde_ar
from models import family
from models.policy import generators, noise, seed_of
from models.videoalign import load_reward

videos = 48                     # prompts x seeds (the train prompts, one seeded plan and noise each)
model = 'assets/toy_sf'         # the distilled toy (assets/toy_sf/ode_init: its stage 1 alone)
out = 'results/kvpo_signal'


def settings(*paths):
    """The settings the config files set, later files over earlier (as infra/configurator.py applies them)."""
    cfg = {}
    for p in paths:
        exec(open(p).read(), {}, cfg)
    return cfg


@torch.no_grad()
def main():
    torch.set_num_threads(1)
    kv = dict(local_weight=1.0, global_weight=0.5, adv_clamp=2.5) | settings('kvpo/config/toy.py', 'kvpo/config/toy_sf.py') \
        | dict(model=model)  # kvpo/train.py's fuse defaults, the configs, the model measured
    gr = settings('kvpo/config/grpo_toy.py', 'kvpo/config/grpo_toy_sf.py')
    fam = family(kv['model'])
    net = fam.load_transformer(kv['model']).eval()
    encode, decode = fam.text_encoder(kv['model'], 'cpu'), fam.load_decoder(kv['model'], 'cpu')
    reward_fn, _ = load_reward('world', None, None, 'cpu', family=fam)
    C, _, h, w = fam.latent_shape(kv['model'], fam.DEFAULTS['num_frames'], fam.DEFAULTS['height'], fam.DEFAULTS['width'])
    prompts, K, F = read_prompts(kv['train_prompts'])[0], kv['group'], kv['frames']
    weights = dict(zip(reward.DIMS, kv['reward_weights']))
    rows = []
    for v in range(videos):
        p, s = prompts[v % len(prompts)], seed_of(0, 'signal', v) % 2 ** 31
        ctx = fam.context(encode([p]))
        plan = kvpo.plan(F, net.layout, K, kv['m_nearest'], kv['perturb_blocks'], kv['cache_frames'], s,
                         kv['chunk_first'], kv['chunk_then'], kv['within_chunks'])
        clips, traj, state = kvpo.rollout(net, ctx, F, (C, h, w), plan, s, kv['m_nearest'], kv['perturb_blocks'],
                                          kv['cache_frames'])
        sc = {k: x.float() for k, x in reward_fn(decode(clips), [p] * (K + 1), kv['fps']).items() if k in reward.DIMS}
        r = reward.combine(sc, kv['reward_weights'])  # (K + 1,) the anchor last
        a = kvpo.component_advantage({c: x[:-1] for c, x in sc.items()}, {c: x[-1] for c, x in sc.items()}, weights)
        adv = kvpo.fuse(a, a, kv['local_weight'], kv['global_weight'], kv['adv_clamp'])  # local = global: one chunk
        score = kvpo.scores(net, ctx, state, plan['fork'], traj, kv['cache_frames'], 0, 'x0')  # (K,)
        logp = torch.log_softmax(score, 0)
        # GRPO-SDE's group on the same prompt: one shared initial noise, SAGE at every step (grpo_ar's rollout)
        x1 = noise((C, F, h, w), generators([seed_of(s, 'noise')] * gr['group']), 'cpu')
        g_clips, _ = sde_ar.generate(net, x1, fam.context(encode([p] * gr['group'])),
                                     range(len(net.layout['timesteps'])), 'sage', 0.5,
                                     generators([seed_of(s, 'sde', g) for g in range(gr['group'])]))
        g_r = reward.combine({k: x.float() for k, x in reward_fn(decode(g_clips), [p] * gr['group'], kv['fps']).items()
                              if k in reward.DIMS}, kv['reward_weights'])
        rows.append(dict(fork=plan['fork'], pool=len(kvpo.pool(plan['fork'], net.layout, kv['m_nearest'],
                                                                kv['perturb_blocks'], kv['cache_frames'])),
                         distinct_routes=len({tuple(o) for o in plan['older']}),
                         kvpo_std=r[:-1].std(unbiased=False).item(), kvpo_gap=(r[:-1] - r[-1]).abs().max().item(),
                         distinct_adv=len({round(x, 6) for x in adv.tolist()}),
                         clamped=(adv.abs() >= kv['adv_clamp'] - 1e-6).float().mean().item(),
                         score_std=score.std(unbiased=False).item(),
                         entropy_frac=(-(logp.exp() * logp).sum() / math.log(K)).item(),
                         grpo_std=g_r.std(unbiased=False).item(), composite=r[-1].item()))
        print(v, rows[-1], flush=True)
    med = lambda k: st.median(r[k] for r in rows)  # noqa: E731
    mean = lambda k: st.mean(r[k] for r in rows)  # noqa: E731
    keys = ['pool', 'distinct_routes', 'kvpo_std', 'kvpo_gap', 'grpo_std', 'distinct_adv', 'clamped', 'score_std',
            'entropy_frac']
    res = dict(videos=videos, rows=rows, median={k: med(k) for k in keys}, mean={k: mean(k) for k in keys},
               tied_groups=sum(r['distinct_adv'] == 1 for r in rows) / len(rows),
               kvpo_below_1e3=sum(r['kvpo_std'] < 1e-3 for r in rows) / len(rows))
    by_fork = {f: [r for r in rows if r['fork'] == f] for f in sorted({r['fork'] for r in rows})}
    md = ['## What a group carries on the distilled toy, before any update (KVPO vs GRPO-SDE)', '',
          f'Written by `python -m bench.kvpo_signal --model={model}`: the untrained `{model}`, {videos} train prompts with a '
          'seeded plan and noise each; KVPO as kvpo/config/toy_sf.py routes it (K = 6, m = 1, P = 2, '
          'n_random = 2), GRPO-SDE as kvpo/config/grpo_toy_sf.py samples it (G = 6, one initial noise, SAGE eta '
          '0.5 at the 4 steps). Composite = 0.5 VQ + 0.5 MQ + TA. "std": over the group, population.', '',
          table(['', 'median', 'mean'], [[k, f'{res["median"][k]:.4g}', f'{res["mean"][k]:.4g}'] for k in keys]), '',
          f'Groups whose K fused advantages are all one value (no ranking to learn): {res["tied_groups"]:.0%}; '
          f'KVPO groups with a composite std under 1e-3: {res["kvpo_below_1e3"]:.0%}.', '',
          '**By fork** (the pool grows with the fork):', '',
          table(['fork', 'videos', 'pool', 'distinct routes', 'KVPO std', 'GRPO-SDE std', 'distinct advantages',
                 'at the clamp'],
                [[f, len(v), v[0]['pool'], f'{st.mean(r["distinct_routes"] for r in v):.1f}',
                  f'{st.median(r["kvpo_std"] for r in v):.2g}', f'{st.median(r["grpo_std"] for r in v):.2g}',
                  f'{st.mean(r["distinct_adv"] for r in v):.1f}', f'{st.mean(r["clamped"] for r in v):.0%}']
                 for f, v in by_fork.items()]), '']
    write_report(out, res, md)


if __name__ == '__main__':
    configure(globals())
    main()
