"""
Section 1 of bench/toy.py, the samplers without training: per-step std of every kind in three
treatments of the s = 1 singularity (pure arithmetic from sde.variance), and SDE rollouts vs ODE
samples of the same prompts and initial noise on the toy base model, at eta 0.5 and at matched
exploration (a bisection on eta per kind). Writes section 1 of results/README.md and samplers.png.

    python -m bench.toy --sections=1            # this section (its cells cached in results/cells)
"""
import math
import os

import torch

from bench.common import cell, table
from bench.toy_common import KINDS, MD, PAPER_SHIFT, PAPER_STEPS, R, TOY, f4, plt, policy
from models import policy as M
from models import toy
import sde

# ----------------------------------------------------------------------------- settings
# set from bench.toy's command line (it imports them and hands the values back: bench/common.py's share)
from bench.toy_common import eta, out  # shared by several sections: bench.toy sets these copies too
group = 4                       # G of the exploration measurement (section 1)
bench_prompts = 16              # prompts of the section-1 rollouts (the toy's held-out prompts)
search_iters = 6                # bisection steps of the matched-exploration eta search
# -----------------------------------------------------------------------------


def variance_regime(kind, s, s_next, eta, regime, s1):
    """Sigma of one step under a treatment of the 1/(1-s) singularity at s = 1 (Fig. 9):
    'subst' FlowGRPO's: 1 - s replaced by 1 - s_1 where s = 1 (for sage: the rate u/(1-u) is
            u/max(1-u, 1-s_1), integrated exactly); 'clamp': 1 - s >= 3e-3 (flow: s/max(1-s, 3e-3) d);
    'default' each kind's own (flow = subst, sage = clamp). dance and cps have no singularity."""
    if regime == 'default' or kind in ('dance', 'cps'):
        return sde.variance(kind, s, s_next, eta)
    if kind == 'flow':
        if regime == 'subst':
            return sde.variance('flow', s, s_next, eta)
        return eta**2 * s / max(1 - s, 3e-3) * (s - s_next)
    if regime == 'clamp':
        return sde.variance('sage', s, s_next, eta)
    # sage, subst: int_{s'}^{s} u / max(1 - u, 1 - s1) du, split at s1 (exact on both pieces)
    lo, hi = s_next, min(s, s1)
    part = (-(hi - lo) + math.log((1 - lo) / (1 - hi))) if hi > lo else 0.0
    if s > s1:
        part += (s**2 - max(s_next, s1)**2) / 2 / (1 - s1)
    return eta**2 * part


def std_tables():
    res = {}
    for name, (n, k) in (('paper', (PAPER_STEPS, PAPER_SHIFT)), ('toy', (TOY['num_steps'], TOY['shift']))):
        sig = sde.sigmas(n, k).double().tolist()
        res[name] = {regime: {kind: [math.sqrt(max(0.0, variance_regime(kind, sig[i], sig[i + 1], eta, regime, sig[1])))
                                     for i in range(n)] for kind in KINDS} for regime in ('subst', 'clamp', 'default')}
        res[name]['sigmas'] = sig
    return res


def rollouts(kind, eta_, prompts, shared=False, seed=0):
    """G rollouts per prompt of the base model (toy steps/shift/cfg). shared=False: every clip its
    own initial noise (a GRPO group, as train.py draws it); shared=True: the G clips of a prompt
    start from the same noise and differ only in the SDE's noise, so their spread is the sampler's
    own exploration (exactly 0 for the ODE). kind 'ode': the ODE sample of the same initial noise."""
    net, G = policy(), group
    clips = [(j, g) for j in range(len(prompts)) for g in range(G)]  # group j = rows j*G .. j*G+G-1
    sig = sde.sigmas(TOY['num_steps'], TOY['shift'])
    cache = M.encode_prompts(toy.DIR, prompts + [''])
    shape = M.latent_shape(toy.DIR, 0, 0, 0)
    frames = []
    for c in range(0, len(clips), 32):
        part = clips[c:c + 32]
        init = M.generators([seed * 10**6 + j * 100 + (0 if shared else g) for j, g in part])
        gens = M.generators([seed * 10**6 + j * 100 + g + 50 for j, g in part])  # the SDE's noise streams
        text = M.batch_text(cache, [prompts[j] for j, _ in part], 'cpu')
        neg = M.batch_text(cache, [''] * len(part), 'cpu')
        x, _ = M.sample(net, M.noise(shape, init, 'cpu'), sig, text, TOY['cfg'], neg, kind, eta_, gens)
        frames.append(toy.decode(x))
    frames = torch.cat(frames)
    r = toy.reward(frames, [prompts[j] for j, _ in clips])
    comp = 0.5 * r['VQ'] + 0.5 * r['MQ'] + r['TA']  # Setting B
    spread = comp.view(len(prompts), G).std(1, unbiased=False).mean()  # population std within a group
    return dict(manifold=toy.manifold_distance(frames), VQ=r['VQ'], MQ=r['MQ'], TA=r['TA'], composite=comp,
                **{'sde_std' if shared else 'group_std': spread})


def summarise(m, ode=None):
    out_ = {k: float(v.float().mean()) for k, v in m.items()}
    if ode is not None:  # paired with the ODE sample of the same initial noise
        out_['d_manifold'] = float((m['manifold'] - ode['manifold']).mean())
    return out_


def section1():
    std = cell('s1_std', std_tables)
    prompts = [p for p in toy.all_prompts() if toy.is_eval_prompt(p)][:bench_prompts]

    def at_default():
        ode, ode_sh = rollouts('ode', 0.0, prompts), rollouts('ode', 0.0, prompts, shared=True)
        res = {'ode': dict(summarise(ode), sde_std=0.0)}
        for kind in KINDS:
            res[kind] = summarise(rollouts(kind, eta, prompts), ode)
            res[kind + '_shared'] = summarise(rollouts(kind, eta, prompts, shared=True), ode_sh)
            res[kind]['sde_std'] = res[kind + '_shared']['sde_std']
        return res
    base = cell(f's1_rollouts_p{len(prompts)}', at_default)
    ode_run = rollouts('ode', 0.0, prompts, shared=True)  # cheap; the pairing baseline of the searches
    target = base['sage']['sde_std']

    def matched(kind):
        def run():
            lo, hi = {'cps': (0.01, 1.0), 'dance': (0.1, 16.0)}.get(kind, (0.02, 4.0))
            tried = []
            for _ in range(search_iters):  # bisection in log eta; the SDE's spread grows with eta
                mid = math.sqrt(lo * hi)
                m = summarise(rollouts(kind, mid, prompts, shared=True), ode_run)
                tried.append(dict(eta=mid, **m))
                lo, hi = (mid, hi) if m['sde_std'] < target else (lo, mid)
            best = min(tried, key=lambda t: abs(t['sde_std'] - target))
            return dict(target=target, best=best, tried=tried)
        return cell(f's1_matched_{kind}_p{len(prompts)}_i{search_iters}', run)
    match = {kind: matched(kind) for kind in ('flow', 'dance', 'cps')}
    R['1'] = dict(std=std, rollouts=base, matched=match)

    steps = [0, 1, 5, 10, 15, 19]
    md = ['## 1. Samplers without training',
          f'Per-step std sqrt(Sigma) at eta {eta}, the paper\'s schedule (20 steps, shift 5), steps {steps}. '
          'Treatments of the 1/(1-s) singularity at s = 1 (Fig. 9): **subst** = FlowGRPO\'s (1-s at s=1 '
          'replaced by 1-s_1; for sage the rate u/(1-u) becomes u/max(1-u, 1-s_1), integrated exactly), '
          '**clamp** = 1-s >= 3e-3 (flow: s/max(1-s, 3e-3)·d), **default** = each kind\'s own (flow = subst, '
          'sage = clamp). dance and cps have no singularity: one row each.', '']
    rows = []
    for kind in KINDS:
        for regime in (('subst', 'clamp', 'default') if kind in ('sage', 'flow') else ('default',)):
            rows.append([kind, regime] + [f'{std["paper"][regime][kind][i]:.4f}' for i in steps])
    md += [table(['kind', 'treatment'] + [f'step {i}' for i in steps], rows), '']
    nt = TOY['num_steps']
    md += [f'The toy schedule ({nt} steps, shift {TOY["shift"]}), default treatment:', '',
           table(['kind'] + [f'{i}' for i in range(nt)],
                 [[k] + [f'{v:.3f}' for v in std['toy']['default'][k]] for k in KINDS]), '']
    md += [f'Rollouts of the toy base model ({len(prompts)} held-out prompts x G={group}, {nt} steps, shift '
           f'{TOY["shift"]}, cfg {TOY["cfg"]}), every SDE clip paired with the ODE sample of the same prompt and '
           'initial noise. manifold = RMS pixel distance to the nearest clean render (lower is better); '
           'Δmanifold = SDE - ODE, paired; group std = within-group std of 0.5VQ+0.5MQ+1.0TA over G clips '
           'with different initial noise (a GRPO group, exploration as train.py logs it); SDE std = the same '
           'over G clips sharing the initial noise (the sampler\'s own exploration; 0 for the ODE).', '']
    hdr = ['sampler', 'eta', 'manifold', 'Δmanifold', 'VQ', 'MQ', 'TA', 'composite', 'group std', 'SDE std']
    rw = lambda k, e, m: [k, e, f4(m['manifold']), f4(m.get('d_manifold', 0.0)), f4(m['VQ']), f4(m['MQ']),
                          f4(m['TA']), f4(m['composite']), f4(m['group_std']) if 'group_std' in m else '-',
                          f4(m['sde_std'])]
    md += [table(hdr, [rw('ode', 0, base['ode'])] + [rw(k, eta, base[k]) for k in KINDS]), '']
    md += [f'**Matched exploration**: the group std of distinct initial noises is dominated by that noise (the ODE '
           f'has one too), so eta is matched on the SDE std: for each kind, bisection ({search_iters} steps, log '
           f'eta) to sage\'s SDE std at eta {eta} ({f4(target)}); the closest point found (rollouts with shared '
           'initial noise, Δmanifold paired with their ODE samples):', '']
    md += [table(hdr, [rw('sage', eta, base['sage_shared'])] +
                 [rw(k, f'{v["best"]["eta"]:.3f}', v['best']) for k, v in match.items()]), '']
    verdict = []
    for k, v in match.items():
        dm, ds = v['best']['manifold'] - base['sage_shared']['manifold'], v['best']['sde_std'] - target
        verdict.append(f'{k}: manifold {"+" if dm >= 0 else ""}{dm:.4f} vs sage (SDE std off by {ds:+.4f})')
    md += ['Manifold distance minus sage\'s at matched exploration: ' + '; '.join(verdict) + '.', '']
    peak = {k: max(v['tried'], key=lambda t: t['sde_std']) for k, v in match.items()}
    md += ['The bisection assumes the SDE std grows with eta; it does not everywhere: past some eta the samples '
           'break (manifold distance jumps) and the reward spread of broken clips shrinks again. Largest SDE std '
           'seen per kind: ' + '; '.join(f'{k} {f4(t["sde_std"])} at eta {t["eta"]:.3f} (manifold {f4(t["manifold"])})'
                                        for k, t in peak.items()) + '. All points tried are in bench.json and '
           'samplers.png.', '']
    MD.extend(md)
    if plt:
        fig, ax = plt.subplots(1, 2, figsize=(10, 3.5))
        for kind in KINDS:
            ax[0].plot(std['paper']['default'][kind], marker='.', label=kind)
        ax[0].set(title=f'per-step std, 20 steps, shift 5, eta {eta}', xlabel='step', ylabel='std')
        ax[0].legend()
        for k, v in match.items():
            t = sorted(v['tried'], key=lambda t: t['sde_std'])
            ax[1].plot([x['sde_std'] for x in t], [x['manifold'] for x in t], marker='o', label=k)
        ax[1].scatter([target], [base['sage_shared']['manifold']], color='k', zorder=5, label=f'sage eta {eta}')
        ax[1].set(title='manifold distance vs exploration (toy)', xlabel='SDE std (reward spread, shared initial noise)',
                  ylabel='manifold distance')
        ax[1].legend()
        fig.tight_layout()
        fig.savefig(os.path.join(out, 'samplers.png'), dpi=110)
        plt.close(fig)
