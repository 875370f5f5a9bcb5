"""
Section 2 of bench/toy.py, Fig. 4: the measured ||d logp_t / d theta|| per step on the toy base
model against the proxy N_t of equalizer.py, for every sampler kind (and sage at the paper's
schedule): log-log slope, correlation, and the spread of the per-step norms without and with S_t.
Writes section 2 of results/README.md and fig4_gradnorm.png.

    python -m bench.toy --sections=2            # this section (its cells cached in results/cells)
"""
import os

import torch

from bench.common import cell, table
from bench.toy_common import KINDS, MD, PAPER_SHIFT, PAPER_STEPS, R, TOY, f4, plt, policy
import equalizer
from models import policy as M
from models import toy
import sde

# ----------------------------------------------------------------------------- settings
# set from bench.toy's command line (it imports them and hands the values back: bench/common.py's share)
from bench.toy_common import eta, out  # shared by several sections: bench.toy sets these copies too
grad_clips = 4                  # clips whose per-step gradient norms are averaged (section 2)
# -----------------------------------------------------------------------------


def grad_norms(kind, n_steps, shift_):
    """||d logp_t / d theta|| per step (mean over clips) on the base model, and N_t, S_t."""
    net = policy()
    params = [p for p in net.parameters() if p.requires_grad]
    sig = sde.sigmas(n_steps, shift_)
    prompts = [p for p in toy.all_prompts() if toy.is_eval_prompt(p)][:grad_clips]
    cache = M.encode_prompts(toy.DIR, prompts + [''])
    text, neg = M.batch_text(cache, prompts, 'cpu'), M.batch_text(cache, [''] * len(prompts), 'cpu')
    gens = M.generators([1000 + i for i in range(len(prompts))])
    _, rec = M.sample(net, M.noise(M.latent_shape(toy.DIR, 0, 0, 0), gens, 'cpu'), sig, text, TOY['cfg'], neg,
                      kind, eta, gens, keep=M.RECORDS)
    norms = []
    for t in range(n_steps):
        if rec['stds'][0, t] == 0:  # an ODE step has no log-prob
            norms.append(0.0)
            continue
        g = []
        for b in range(len(prompts)):
            one = lambda tx: [u[b:b + 1] for u in tx]
            x, x_next = rec['xs'][b:b + 1, t], rec['xs'][b:b + 1, t + 1]
            v = M.velocity(net, x, sig[t].expand(1), one(text), TOY['cfg'], one(neg))
            logp = sde.step(x, v, sig[t].item(), sig[t + 1].item(), kind, eta, x_next=x_next).logp  # (1,)
            grads = [q for q in torch.autograd.grad(logp.sum(), params, allow_unused=True) if q is not None]
            g.append(torch.sqrt(sum(q.double().square().sum() for q in grads)).item())
        norms.append(sum(g) / len(g))
    N, S = equalizer.proxy(kind, sig, eta), equalizer.scales(kind, sig, eta)
    return dict(norm=norms, N=N.tolist(), S=S.tolist())


def fit_stats(d):
    g, N, S = [torch.tensor(d[k], dtype=torch.float64) for k in ('norm', 'N', 'S')]
    keep = (g > 0) & (N > 0)
    lg, lN = g[keep].log(), N[keep].log()
    slope = ((lN - lN.mean()) * (lg - lg.mean())).sum() / (lN - lN.mean()).square().sum()
    pearson = lambda a, b: torch.corrcoef(torch.stack([a, b]))[0, 1].item()
    ge = g[keep] * S[keep]
    return dict(slope=slope.item(), r_log=pearson(lN, lg), r=pearson(N[keep], g[keep]),
                ratio=(g[keep].max() / g[keep].min()).item(), ratio_eq=(ge.max() / ge.min()).item())


def section2():
    runs = {}
    for kind in KINDS:
        runs[kind] = cell(f's2_{kind}_toy_c{grad_clips}', lambda: grad_norms(kind, TOY['num_steps'], TOY['shift']))
    runs['sage@paper'] = cell(f's2_sage_paper_c{grad_clips}', lambda: grad_norms('sage', PAPER_STEPS, PAPER_SHIFT))
    stats = {k: fit_stats(v) for k, v in runs.items()}
    R['2'] = dict(runs=runs, stats=stats)
    md = ['## 2. Fig. 4: measured gradient norm vs the proxy N_t',
          f'||d logp_t / d theta|| per step on the base model (autograd through model.velocity and '
          f'sde.step(x_next=...), mean over {grad_clips} clips of one SDE rollout each, eta {eta}); N_t from '
          'equalizer.proxy. slope = least-squares slope of log||g|| on log N_t; r = Pearson correlation '
          '(of logs, and raw); max/min = ratio of the largest to the smallest per-step norm over the trained '
          'steps, without and with the equalizer scale S_t. Schedules: the toy one '
          f'({TOY["num_steps"]} steps, shift {TOY["shift"]}) and, for sage, the paper\'s (20, shift 5).', '']
    md += [table(['kind', 'log-log slope', 'r (log)', 'r (raw)', 'max/min without S_t', 'max/min with S_t'],
                 [[k, f'{s["slope"]:.3f}', f'{s["r_log"]:.3f}', f'{s["r"]:.3f}', f'{s["ratio"]:.1f}',
                   f'{s["ratio_eq"]:.2f}'] for k, s in stats.items()]), '']
    d = runs['sage']
    md += ['sage, toy schedule, per step:', '',
           table(['step', '||g||', 'N_t', '||g|| / N_t', 'S_t', 'S_t ||g||'],
                 [[i, f4(g), f4(n), f4(g / n) if n else '-', f4(s), f4(s * g)]
                  for i, (g, n, s) in enumerate(zip(d['norm'], d['N'], d['S']))]), '']
    MD.extend(md)
    if plt:
        fig, ax = plt.subplots(figsize=(5, 4))
        for k, v in runs.items():
            pts = [(n, g) for n, g in zip(v['N'], v['norm']) if n > 0 and g > 0]
            ax.loglog(*zip(*pts), marker='o', linestyle='-', label=k)
        ax.set(xlabel='proxy N_t = |lambda_t| / std_t', ylabel='||d logp_t / d theta||', title='Fig. 4 (toy)')
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(out, 'fig4_gradnorm.png'), dpi=110)
        plt.close(fig)
