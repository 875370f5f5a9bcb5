"""
Decisive toy verdicts: the five comparisons the paper's claims rest on, trained long enough (60
iterations) on enough seeds (5) to tell, and reported as *paired* differences. Runs that share a
seed share the prompt order, the initial noises and the eval noises, so the per-seed difference of
two cells is far less noisy than either cell. Its 95% interval is the t interval over the seeds:
mean(d) +- t_{0.975, n-1} * sd(d) / sqrt(n).

    python -m bench.verdicts                    # every cell: 13 configs x 5 seeds x 60 iterations (~8 CPU-hours)
    python -m bench.verdicts --budget_min=100   # start no new run after 100 min; rerun to go on (cells are cached)
    python -m bench.verdicts --workers=2 --worker=1   # with --worker=0 beside it: 2 processes on 2 cores
    python -m bench.verdicts --run=False        # only the report: tables, plots and claims from the cached cells

Writes results/verdicts.md and .json, results/verdict_<k>.png and the verdicts section of
results/README.md (between its bench.verdicts markers: the claims, one row each, then the details).

The comparisons (reference: sage + equalizer + dual KL; config/toy.py otherwise, 8 prompts x G=4):
 1. sampler (the paper's Table 2): sage vs flow, dance, cps at eta 0.5; and vs flow and cps at the
    eta that bench/toy.py section 1 matched to sage's exploration (SDE std of clips sharing the noise).
 2. equalizer (Fig. 3): on vs off, for sage and for flow.
 3. trust region (Fig. 8): dual vs moving vs none at kl_max 1, where the KL acts (bench part (d)),
    on composite, VQ, manifold distance and exploration (the within-group reward std).
 4. more samples: flow G=8 vs sage G=4 at equal rollouts, and sage G=8.
 5. speed: iterations for the held-out composite to reach 0.65 and 0.70, and whether it stays there.

Where this differs from the issue, and why:
- comparison 3 takes 2 optimizer steps per iteration (`updates_per_iter=2`): with one, the policy
  equals theta_old at its only step, the velocity KL is 0 and dual is moving bitwise (part (b)).
- at equal rollouts the G=8 cells see 4 prompts x 8 clips an iteration (32 clips, as the reference),
  so every iteration costs the same and every paired difference is at equal rollouts.
- dance at matched exploration is not trained: no eta reaches sage's SDE std (the closest, eta 4.5,
  is 55% short and its samples are broken: section 1). A kind is trained matched only within 10%.
- an unreached threshold counts as iters + eval_every (65), a bound that understates the difference.
"""
import json
import math
import functools
import os

import torch

from bench import common as C
from bench.common import table
from infra.configurator import configure

# ----------------------------------------------------------------------------- settings
out = 'results'         # cells/ (committed), runs/ (not), verdicts.md/.json, verdict_*.png
seeds = 5               # seeds 0..seeds-1 of every cell (seed-major: a budget cut leaves every cell equal)
iters = 60              # max_iters of a run
prompts = 8             # prompts_per_iter (x G=4: 32 clips an iteration)
eval_every = 5          # held-out evaluation every k iterations (16 prompts x 2 seeds, ODE): the curves
tr_kl_max = 1.0         # comparison 3's kl_max (the clip of lambda_KL): the KL acts there (bench part (d))
tr_updates = 2          # comparison 3's optimizer steps per iteration: with 1 the velocity KL is 0
match_tol = 0.1         # train a kind at matched exploration only if its SDE std is within 10% of sage's
budget_min = 0.0        # start no new training run after this many minutes (0: no limit)
worker = 0              # this process runs runs worker, worker + workers, ... of the seed-major list:
workers = 1             # 2 cores -> 2 processes (--worker=0 and --worker=1 --workers=2), each 1 thread
run = True              # False: only the report, from the cells already cached
threads = 1             # torch threads of every train.py (2 processes x 1 thread on 2 cores)
thresholds = (0.65, 0.70)  # comparison 5: held-out composite to reach
late_iters = 20         # a run's composite, VQ, manifold = the mean of its evaluations at iterations >= iters - 20
config = configure(globals(), rules=dict(  # the G=8 cells draw prompts // 2 prompts of 8 clips
    prompts=((lambda v: v >= 2 and v % 2 == 0), 'an even count >= 2 (the G=8 cells draw half as many)')))
if worker >= workers:
    raise SystemExit(f'config error: worker must be below workers ({workers}), got {worker}')
# -----------------------------------------------------------------------------
C.setup(out, threads, budget_min)
REF = dict(sampler='sage', equalizer=True, kl_strategy='dual')
TR = dict(kl_max=tr_kl_max, updates_per_iter=tr_updates)
DUAL, MOVING, NONE = (f'{k} (kl_max {tr_kl_max:g}, {tr_updates} updates)' for k in ('dual', 'moving', 'none'))
MATCH_CELL = 's1_matched_{}_p16_i6'  # written by `python -m bench.toy --sections=1` (16 prompts, 6 bisection steps)


def matched():
    """{kind: (eta, sde_std, target)} of bench/toy.py section 1's matched-exploration search."""
    res = {}
    for kind in ('flow', 'dance', 'cps'):
        m = C.cached(MATCH_CELL.format(kind))
        if m is None:
            raise SystemExit(f'{MATCH_CELL.format(kind)} is not cached in {out}/cells: run `python -m bench.toy --sections=1`')
        res[kind] = (m['best']['eta'], m['best']['sde_std'], m['target'])
    return res


def cells():
    """{label: train.py overrides}, the reference first."""
    c = {'sage': REF, **{k: dict(REF, sampler=k) for k in ('flow', 'dance', 'cps')}}
    for k, (e, sd, target) in matched().items():
        if abs(sd - target) <= match_tol * target:
            c[f'{k} matched'] = dict(REF, sampler=k, eta=round(e, 4))
    c.update({'sage eq=off': dict(REF, equalizer=False), 'flow eq=off': dict(REF, sampler='flow', equalizer=False),
              DUAL: dict(REF, **TR), MOVING: dict(REF, **TR, kl_strategy='moving'), NONE: dict(REF, **TR, kl_strategy='none'),
              'flow G=8': dict(REF, sampler='flow', group_size=8, prompts_per_iter=prompts // 2),
              'sage G=8': dict(REF, group_size=8, prompts_per_iter=prompts // 2)})
    return c


def name(ov, s):
    key = '_'.join(f'{k}-{v}' for k, v in sorted(dict(dict(prompts_per_iter=prompts), **ov).items()))
    return f'v_{key}_it{iters}_e{eval_every}_s{s}'


def train_all(cs):
    common = dict(max_iters=iters, prompts_per_iter=prompts, eval_every=eval_every, save_every=0, eval_videos=0)
    todo = [(s, ov) for s in range(seeds) for ov in cs.values()]  # seed-major
    for s, ov in todo[worker::workers]:  # a cached run is skipped: rerun with the same split to go on
        C.train(name(ov, s), dict(common, **ov, seed=s))


# ----------------------------------------------------------------------------- statistics
@functools.lru_cache(maxsize=None)
def t975(df):
    """The 0.975 quantile of Student's t with df degrees of freedom: bisection on its CDF, the
    density integrated by Simpson's rule (no scipy needed; tests check it against printed tables)."""
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)
    pdf = lambda x: c * (1 + x * x / df) ** (-(df + 1) / 2)

    def cdf_above_half(x, n=2000):  # P(0 < T < x)
        h = x / n
        return h / 3 * (pdf(0) + pdf(x) + sum((4 if i % 2 else 2) * pdf(i * h) for i in range(1, n)))
    lo, hi = 0.0, 100.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf_above_half(mid) < 0.475 else (lo, mid)
    return (lo + hi) / 2


def paired(a, b):
    """Per-seed differences a - b -> mean, 95% t interval (lo, hi), n."""
    d = torch.tensor(a, dtype=torch.float64) - torch.tensor(b, dtype=torch.float64)
    n, m = len(d), d.mean().item() if len(d) else float('nan')
    h = t975(n - 1) * d.std().item() / math.sqrt(n) if n > 1 else float('nan')
    return dict(n=n, mean=m, lo=m - h, hi=m + h, diffs=d.tolist())


def verdict(ci):
    """The claim 'the reference is better' (ci of the reference's advantage, positive = better)."""
    if ci['n'] < 2:
        return 'too few seeds yet' if ci['n'] else 'not run'
    if ci['lo'] == ci['hi'] == 0:  # every paired difference is exactly 0 (e.g. the same evaluation reached)
        return 'tied on every seed'
    return 'holds' if ci['lo'] > 0 else 'fails' if ci['hi'] < 0 else 'cannot be told'


def num(x, p=3):
    """x signed at p decimals; a nonzero x that would print as 0 there in 2 significant digits (+2.1e-04)."""
    return f'{x:+.1e}' if x and abs(x) < 0.5 * 10 ** -p else f'{x:+.{p}f}'


def fmt(ci, p=3):
    if ci['n'] < 2:
        return '-'
    if max(abs(ci['lo']), abs(ci['hi'])) >= 0.5 * 10 ** -p:  # the interval reads at p decimals
        return f'{ci["mean"]:+.{p}f} [{ci["lo"]:+.{p}f}, {ci["hi"]:+.{p}f}]'
    return f'{num(ci["mean"], p)} [{num(ci["lo"], p)}, {num(ci["hi"], p)}]'  # all of it under the last decimal


def first_reach(run, thr):
    """The first evaluated iteration whose held-out composite is >= thr (censored: iters + eval_every)."""
    return next((e['iter'] for e in run['evals'] if e['composite'] >= thr), iters + eval_every)


def stays(run, thr):
    """Fraction of the evaluations after the first reaching thr that are still >= thr (None: never reached)."""
    it = first_reach(run, thr)
    later = [e['composite'] >= thr for e in run['evals'] if e['iter'] > it]
    return (sum(later) / len(later) if later else 1.0) if it <= iters else None


def late(run, key):
    """The mean of `key` over the evaluations of the last `late_iters` iterations (40, 45, .., 60): where
    a run ends, less noisy than its one last evaluation (the policy still moves between evaluations)."""
    xs = [e[key] for e in run['evals'] if e['iter'] >= iters - late_iters]
    return sum(xs) / len(xs)


METRICS = {  # name: (value of a run, +1 if higher is better, -1 if lower is)
    'composite': (lambda r: late(r, 'composite'), 1), 'VQ': (lambda r: late(r, 'VQ'), 1),
    'manifold': (lambda r: late(r, 'manifold'), -1),
    'explore': (lambda r: sum(i['group_std'] for i in r['iters']) / len(r['iters']), 1)}


def advantage(runs, ref, other, metric):
    """The reference's paired advantage over `other` on `metric` (positive = the reference is better),
    over the seeds both have."""
    get, sign = METRICS[metric]
    ss = [s for s in range(seeds) if runs[ref][s] and runs[other][s]]
    return paired([sign * get(runs[ref][s]) for s in ss], [sign * get(runs[other][s]) for s in ss])


def curve_of(runs, ref, other, metric='composite'):
    """Eval iterations and the reference's paired advantage on `metric` at each (None: < 2 seeds)."""
    sign = METRICS[metric][1]
    ss = [s for s in range(seeds) if runs[ref][s] and runs[other][s]]
    if len(ss) < 2:
        return None
    by = lambda r: {e['iter']: sign * e[metric] for e in r['evals']}
    its = sorted(set.intersection(*[set(by(runs[c][s])) for c in (ref, other) for s in ss]))
    return its, [paired([by(runs[ref][s])[i] for s in ss], [by(runs[other][s])[i] for s in ss]) for i in its]


# ----------------------------------------------------------------------------- the report
COMPARISONS = [  # (k, title, claim, [(reference, other)], metrics); the claim is 'the reference is better'
    (1, 'Sampler (Table 2)', 'sage beats the other samplers', [('sage', o) for o in
     ('flow', 'dance', 'cps', 'flow matched', 'dance matched', 'cps matched')], ('composite', 'manifold')),
    (2, 'Equalizer (Fig. 3)', 'the equalizer helps', [('sage', 'sage eq=off'), ('flow', 'flow eq=off')], ('composite', 'manifold')),
    (3, f'Trust region at kl_max {tr_kl_max:g}, {tr_updates} optimizer steps an iteration (Fig. 8)',
     'dual keeps exploration and quality better than moving or no KL',
     [(DUAL, MOVING), (DUAL, NONE)], ('composite', 'VQ', 'manifold', 'explore')),
    (4, 'More samples at equal rollouts (32 clips an iteration)', 'sage with G=4 beats flow with G=8',
     [('sage', 'flow G=8'), ('sage', 'sage G=8')], ('composite', 'manifold')),
]
NO_CLAIM = {('sage', 'sage G=8')}  # what more samples give sage itself: measured, not a claim of the paper


def grouped(items):
    """[(other, verdict, interval)] -> 'holds vs a (..) and b (..); cannot be told vs c (..)'."""
    order = ('holds', 'fails', 'cannot be told', 'tied on every seed', 'too few seeds yet', 'not run')
    return '; '.join(f'{w} vs ' + ' and '.join(f'{b} ({c})' if c != '-' else b for b, v, c in items if v == w)
                     for w in order if any(v == w for _, v, _ in items))


def short_row(head, items):
    """[(other, verdict, ci)] -> one row of the README's table: the claim, then the cells it holds, fails
    and cannot be told against (each with the mean paired difference when decided)."""
    cols = {'holds': [], 'fails': [], 'open': []}
    for b, v, ci in items:
        b = b.split(' (')[0]  # 'none (kl_max 1, 2 updates)' -> 'none': the claim names the setting
        if v in ('holds', 'fails'):
            cols[v].append(f'{b} ({ci["mean"]:+.1f})' if abs(ci['mean']) >= 1 else f'{b} ({num(ci["mean"])})')
        else:
            cols['open'].append(b + ('' if v == 'cannot be told' else f' ({v})'))
    return [head] + [', '.join(c) or '-' for c in cols.values()]


def report(cs):
    runs = {label: [C.cached(name(ov, s)) for s in range(seeds)] for label, ov in cs.items()}
    have = {k: sum(r is not None for r in v) for k, v in runs.items()}
    mean = lambda xs: sum(xs) / len(xs) if xs else float('nan')
    res = dict(config=config, cells={}, comparisons={}, claims=[], short=[])  # short: the README's table
    md = ['## 6. Decisive verdicts: paired seeds (`python -m bench.verdicts`)', '',
          f'{iters} iterations of `train.py config/toy.py` ({prompts} prompts x G=4 = {4 * prompts} clips an iteration '
          f'unless stated), seeds 0..{seeds - 1}; held-out ODE evaluation (16 prompts x 2 seeds) every {eval_every} '
          f'iterations; a run\'s composite, VQ and manifold distance are the mean of its evaluations at iterations '
          f'{iters - late_iters}..{iters} (where it ends; one evaluation is noisier). Runs sharing a seed share prompts and noises, so each row is the **per-seed difference** to '
          'its reference cell: mean and 95% t interval over the seeds, signed so that **positive = the reference is '
          'better** (higher composite, VQ and exploration; lower manifold distance). The claim holds if the interval '
          'is above 0, fails if it is below, and cannot be told at this budget if it spans 0.', '']
    # every cell
    rows = []
    for label, rs in runs.items():
        rs = [r for r in rs if r]
        if not rs:
            rows.append([label, 0] + [''] * 7)
            continue
        f = lambda m: mean([METRICS[m][0](r) if m in METRICS else late(r, m) for r in rs])
        reach = {t: [first_reach(r, t) for r in rs] for t in thresholds}
        res['cells'][label] = dict(overrides=cs[label], n=len(rs), **{m: f(m) for m in ('composite', 'VQ', 'MQ', 'TA', 'manifold', 'explore')},
                                   before=mean([r['before']['composite'] for r in rs]), reach=reach)
        rows.append([label, len(rs), f'{res["cells"][label]["before"]:.3f}'] +
                    [f'{f(m):.3f}' for m in ('composite', 'VQ', 'MQ', 'TA', 'manifold', 'explore')])
    md += [f'**Every cell** (mean over seeds of the iterations {iters - late_iters}..{iters}; before = iteration 0; explore = '
           'mean within-group reward std over the run):',
           '', table(['cell', 'seeds', 'before', 'composite', 'VQ', 'MQ', 'TA', 'manifold', 'explore'], rows), '']
    m = matched()
    md += ['Matched exploration (bench/toy.py section 1): ' + '; '.join(
        f'{k} eta {e:.3f} (SDE std {sd:.3f} vs sage {t:.3f}{"" if abs(sd - t) <= match_tol * t else ": more than 10% off, not trained"})'
        for k, (e, sd, t) in m.items()) + '.', '']
    for k, title, claim, pairs, metrics in COMPARISONS:
        pairs = [(a, b) for a, b in pairs if b in cs]
        rows, found = [], {}
        for a, b in pairs:
            cis = {mt: advantage(runs, a, b, mt) for mt in metrics}
            found[(a, b)] = cis
            rows.append([a, b, cis['composite']['n']] + [f'{fmt(cis[mt], 4 if mt == "manifold" else 3)}'
                                                        + ('' if (a, b) in NO_CLAIM else f' {verdict(cis[mt])}')
                                                        for mt in metrics])
        res['comparisons'][k] = {f'{a} vs {b}': v for (a, b), v in found.items()}
        claims = [(b, verdict(v['composite']), fmt(v['composite'])) for (a, b), v in found.items() if (a, b) not in NO_CLAIM]
        res['short'].append(short_row(f'{k}. {claim} ({title.split(" (")[-1]}',  # the paper's table or figure
                                      [(b, verdict(v['composite']), v['composite'])
                                       for (a, b), v in found.items() if (a, b) not in NO_CLAIM]))
        sentence = f'**{k}. {title}**, *{claim}* (held-out composite): {grouped(claims)}.'
        extra = [f'{b} vs {a}: {fmt(v["composite"])} for {a} (no claim: what more samples give sage)'
                 for (a, b), v in found.items() if (a, b) in NO_CLAIM and v['composite']['n'] > 1]
        if k == 3:  # the claim is about exploration and quality too
            sentence += ' On the other metrics: ' + '; '.join(
                f'{mt} {verdict(v[mt])} vs {b} ({fmt(v[mt], 4 if mt == "manifold" else 3)})'
                for (a, b), v in found.items() for mt in metrics[1:]) + '.'
        res['claims'].append(sentence + (' ' + '; '.join(extra) + '.' if extra else ''))
        md += [f'### {k}. {title}', '', table(['reference', 'vs', 'seeds'] + [f'Δ {mt} [95%]' for mt in metrics], rows),
               '', res['claims'][-1], '']
    # 5: speed to a threshold, and staying there; each cell against its own comparison's reference
    ref_of = {b: a for _, _, _, pairs, _ in COMPARISONS for a, b in pairs if (a, b) not in NO_CLAIM}
    rows, parts = [], []
    for label in cs:
        rs = [r for r in runs[label] if r]
        if not rs:
            continue
        ref = ref_of.get(label)
        row = [label, len(rs), ref or '']
        for t in thresholds:
            reach = [first_reach(r, t) for r in rs]
            st = [x for x in (stays(r, t) for r in rs) if x is not None]
            n_reach = sum(x <= iters for x in reach)
            row += [f'{n_reach}/{len(rs)}', f'{sorted(reach)[len(reach) // 2] if n_reach > len(rs) // 2 else f">{iters}"}',
                    f'{mean(st):.0%}' if st else '-']
            if ref:
                ss = [s for s in range(seeds) if runs[ref][s] and runs[label][s]]
                ci = paired([first_reach(runs[label][s], t) for s in ss], [first_reach(runs[ref][s], t) for s in ss])
                res['comparisons'].setdefault(5, {})[f'{label} to {t}'] = ci
                parts.append((t, label, verdict(ci), fmt(ci, 1), ci))
                row += [fmt(ci, 1) + f' {verdict(ci)}']
            else:
                row += ['']
        rows.append(row)
    md += ['### 5. Speed to a threshold', '', f'Iterations until the held-out composite first reaches each threshold '
           f'(evaluated every {eval_every}; not reached counts as {iters + eval_every}); stays = fraction of the later '
           'evaluations still at or above it; Δ = iterations of the cell minus those of its reference (positive = the '
           'reference is faster).', '',
           table(['cell', 'seeds', 'reference'] + [h for t in thresholds for h in (f'reached {t}', 'median iters', 'stays',
                                                                                  f'Δ iters to {t} [95%]')], rows), '']
    for t in thresholds:
        res['claims'].append(f'**5. Speed to {t}**, *the reference gets there sooner* (paired iterations): ' +
                             grouped([p[1:4] for p in parts if p[0] == t]) + '.')
        res['short'].append(short_row(f'5. the reference reaches {t} sooner (iterations)',
                                      [(p[1], p[2], p[4]) for p in parts if p[0] == t]))
        md += [res['claims'][-1], '']
    plots(runs, cs)
    md += ['Plots: `verdict_1.png` .. `verdict_5.png` (paired-difference curves over iterations with their 95% bands; '
           '5: the mean held-out composite of every cell).', '']
    return res, md, have


def plots(runs, cs):
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
    except ImportError:  # the tables are written all the same
        return
    for k, title, claim, pairs, metrics in COMPARISONS:
        shown = ('composite', 'manifold') if k != 3 else ('composite', 'VQ', 'manifold', 'explore')[:3]
        fig, axs = plt.subplots(1, len(shown), figsize=(4.2 * len(shown), 3.4))
        for ax, mt in zip(axs, shown):
            for a, b in pairs:
                cv = curve_of(runs, a, b, mt) if b in cs else None
                if cv:
                    x, cis = cv
                    ax.plot(x, [c['mean'] for c in cis], marker='.', label=f'{a} - {b}')
                    ax.fill_between(x, [c['lo'] for c in cis], [c['hi'] for c in cis], alpha=0.15)
            ax.axhline(0, color='k', lw=0.8)
            ax.set(xlabel='iteration', title=f'Δ {mt} (> 0: the reference is {"nearer" if mt == "manifold" else "better"})')
            if ax.lines[:-1]:  # some pair has 2 seeds
                ax.legend(fontsize=6)
        fig.suptitle(f'{k}. {title}', fontsize=9)
        fig.tight_layout()
        fig.savefig(os.path.join(out, f'verdict_{k}.png'), dpi=100)
        plt.close(fig)
    groups = [[c for c in cs if c in ('sage', 'flow', 'dance', 'cps') or 'matched' in c or 'eq=off' in c],
              [c for c in cs if c in ('sage', DUAL, MOVING, NONE) or 'G=8' in c]]
    fig, axs = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
    for ax, group in zip(axs, groups):
        for label in group:
            rs = [r for r in runs[label] if r]
            if rs:
                its = [e['iter'] for e in rs[0]['evals']]
                ax.plot(its, [sum(r['evals'][i]['composite'] for r in rs) / len(rs) for i in range(len(its))],
                        marker='.', label=f'{label} ({len(rs)})', lw=2 if label == 'sage' else 1)
        for t in thresholds:
            ax.axhline(t, color='grey', ls=':', lw=0.8)
        ax.set(xlabel='iteration', ylabel='held-out composite (mean over seeds)')
        ax.legend(fontsize=6)
    fig.suptitle('5. held-out composite over training', fontsize=9)
    fig.tight_layout()
    fig.savefig(os.path.join(out, 'verdict_5.png'), dpi=100)
    plt.close(fig)


if __name__ == '__main__':
    cs = cells()
    print(f'bench.verdicts: {len(cs)} cells x {seeds} seeds x {iters} iterations; out={out}', flush=True)
    if run:
        train_all(cs)
    res, md, have = report(cs)
    missing = sum(seeds - n for n in have.values())
    note = [] if not missing else [f'**Incomplete**: {missing} of {seeds * len(cs)} runs are not cached yet; '
                                   'rerun `python -m bench.verdicts` to go on.', '']
    with open(os.path.join(out, 'verdicts.json'), 'w') as f:
        json.dump(dict(res, have=have), f, indent=1)
    with open(os.path.join(out, 'verdicts.md'), 'w') as f:
        f.write('\n'.join(md[:1] + [''] + note + md[2:]) + '\n')
    # results/README.md section 6: the claims, one row each, then the intervals, every cell and the curves
    cols = [i for i in range(4) if any(r[i] != '-' for r in res['short'])]  # no 'fails vs' column if none fails
    claims = [table([['claim', 'holds vs', 'fails vs', 'cannot be told vs'][i] for i in cols],
                    [[r[i] for i in cols] for r in res['short']]), '',
              f'Reference: sage + equalizer + dual KL, each of {seeds} seeds paired with the same seed of the other '
              'cell; a claim holds if the 95% interval of the per-seed difference is above 0, fails if below (in '
              'brackets: the mean difference, positive = the reference is better: held-out composite over iterations '
              f'{iters - late_iters}..{iters}; for 5, iterations to the threshold); 3 at kl_max {tr_kl_max:g} and '
              f'{tr_updates} optimizer steps an iteration. The intervals, every cell and the curves: below.']
    C.put_block(os.path.join(out, 'README.md'), 'bench.verdicts', md[:1] + [''] + note + claims + [''] + md[2:])
    print('\n'.join(res['claims']))
