"""
The trust region's win at a second toy scale (issue 67, item 3): the setting that carried it at the toy's width,
dual with lambda_KL held by the batch ratio's target, rerun against 'none' on a base model twice as wide
(models/toy.py WIDE: 6 heads of 32, 3.5M trained parameters against 0.9M), pretrained by the same recipe.

    python -m models.toy wide                                 # its base model, once (~40 min on a core; not committed)
    python -m bench.trust_region_wide --workers=2 --worker=0  # with --worker=1 beside it: 2 processes on 2 cores
    python -m bench.trust_region_wide --run=False             # only the report, from the cells cached

The cells are bench.trust_region's (bench.paper's: 8 prompts x G=4, 60 iterations, an evaluation every 5, paired
seeds) with --model=assets/toy_wide: dual at `kl_ratio_target=1` (lambda_KL from 0.1, GradientSplit every step)
at AdamW 1e-4, the toy's default; 'none' at 5e-5 (the best 'none' at the toy's width) and at 2.5e-5 (a wider
model may want a smaller step: the rate halves with the width under muP's rule for AdamW). Each cell of the
toy's width is shown beside its wide twin. Writes results/trust_region_wide.md and .json.
"""
import os
import sys

from bench import common as C
from bench.common import table
from infra.configurator import configure
from models import toy

_argv, sys.argv = sys.argv, sys.argv[:1]  # the benches below read the command line when imported
from bench import paper as P  # noqa: E402  its cells' names and statistics
from bench import trust_region as T  # noqa: E402  its cells, comparison and claims
from bench import verdicts as V  # noqa: E402
sys.argv = _argv

# ----------------------------------------------------------------------------- settings
out = 'results'          # cells/ (committed), trust_region_wide.md/.json
seeds = 5                # seeds 0..seeds-1 of every cell
none_lrs = '5e-5,2.5e-5'  # AdamW learning rates of 'none'
worker = 0               # every worker takes the next run no other has claimed (bench.trust_region's claims)
workers = 1              # 2 cores -> 2 processes, each 1 thread
run = True               # False: only the report
threads = 1              # torch threads of every train.py
budget_min = 0.0         # start no new training run after this many minutes (0: no limit)
config = configure(globals(), sys.argv[1:])
# -----------------------------------------------------------------------------
PREFIX = 'wide_'              # a wide cell's name: this + the toy-width twin's
C.setup(out, threads, budget_min)
T.seeds, T.out = seeds, out
LRS = [float(x) for x in none_lrs.split(',') if x.strip()]


def cells():
    """{label: overrides} (without the model): the ratio target's dual first, then 'none' at each rate."""
    c = {f'dual @ ratio {T.RATIO_TARGET:g}, adamw 1e-4': T.ratio_cells()[f'dual @ ratio {T.RATIO_TARGET:g}, adamw 1e-4']}
    for lr in LRS:
        c[f'none, adamw {T.lr_name(lr)}'] = dict(V.REF, kl_strategy='none', optimizer='adamw', learning_rate=lr)
    return c


def train_all(cs):
    """The ratio target's dual and the first 'none' seed-major (the verdict, complete first), then the others."""
    common = dict(max_iters=P.iters, prompts_per_iter=P.prompts, eval_every=P.eval_every, save_every=0, eval_videos=0)
    first, rest = list(cs.values())[:2], list(cs.values())[2:]
    jobs = [(ov, s) for s in range(seeds) for ov in first] + [(ov, s) for ov in rest for s in range(seeds)]
    for ov, s in jobs:
        nm = PREFIX + P.name(ov, s)
        if C.over_budget():
            print(f'over the time budget of {budget_min} min: no new runs', flush=True)
            break
        if C.cached(nm) is None and (workers == 1 or T.claim(nm)):
            C.train(nm, dict(common, **ov, model=toy.WIDE_DIR, seed=s))


def summary(runs, k):
    """A cell's mean over its seeds of every metric, with the 95% t half-width; the ratio it held; alarms."""
    ok = [r for r in runs[k] if r]
    mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
    c = dict(n=len(ok))
    for m in T.METRICS:
        ci = V.paired([T.late(r, m) for r in ok], [0.0] * len(ok))
        c[m], c[m + '_half'] = mean([T.late(r, m) for r in ok]), (ci['hi'] - ci['lo']) / 2 if len(ok) > 1 else None
    if ok and 'kl_ratio' in ok[0]['iters'][-1]:
        c['kl_ratio'] = mean([mean([i['kl_ratio'] for i in r['iters'][-10:]]) for r in ok])
        c['lambda_end'] = mean([r['iters'][-1]['lambda_kl'] for r in ok])
    al = [P.alarm_of('', r) for r in ok]
    c['alarm'] = f'{sum(isinstance(a, dict) for a in al)}/{sum(a != "not recorded" for a in al)}'
    return c


def report(cs):
    wide = {k: [C.cached(PREFIX + P.name(ov, s)) for s in range(seeds)] for k, ov in cs.items()}
    narrow = {k: [C.cached(P.name(ov, s)) for s in range(seeds)] for k, ov in cs.items()}
    res = dict(config=config, cells={}, verdicts={})
    f = lambda x, m: '-' if x is None else f'{x:.{4 if m == "manifold" else 3}f}'  # noqa: E731
    rows = []
    for width, runs in (('toy (96 wide)', narrow), ('wide (192)', wide)):
        base = [r['evals'][0] for rs in runs.values() for r in rs if r]
        if base:
            rows.append([width, 'the base model (iteration 0)', '-'] +
                        [f(sum(e[m] for e in base) / len(base), m) for m in T.METRICS] + ['-', '-'])
        for k in cs:
            c = summary(runs, k)
            res['cells'][f'{width}: {k}'] = c
            rows.append([width, k, c['n'] or 'not run'] +
                        [f(c[m], m) + ('' if c[m + '_half'] is None else f' ±{f(c[m + "_half"], m)}') for m in T.METRICS] +
                        [f'{c["kl_ratio"]:.2f} / {c["lambda_end"]:.3g}' if 'kl_ratio' in c else '-', c['alarm']])
    md = ['# The trust region at twice the width (`python -m bench.trust_region_wide`)', '',
          f'bench.trust_region\'s cells ({P.prompts} prompts x G=4 an iteration, {P.iters} iterations, seeds 0..{seeds - 1}, '
          f'a run\'s value the mean of its held-out evaluations at iterations {P.iters - P.late_iters}..{P.iters}) on '
          f'the toy\'s base model and on one twice as wide (`python -m models.toy wide`, the same pretraining). A cell: '
          'the mean over its seeds ± the 95% t interval\'s half-width; ratio: the batch KL/policy ratio over the last '
          '10 iterations / lambda_KL at the end; alarm: runs where it tripped / runs.', '',
          table(['model', 'cell', 'seeds'] + list(T.METRICS) + ['ratio / lambda', 'alarm'], rows), '']
    dual = next(iter(cs))
    nones = [k for k in cs if k != dual and sum(r is not None for r in wide[k]) >= 2]
    rows = []
    for b in nones:
        cis = {m: T.compare(wide, dual, b, m) for m in T.METRICS}
        res['verdicts'][f'{dual} vs {b}'] = {m: dict(ci, verdict=V.verdict(ci)) for m, ci in cis.items()}
        rows.append([dual, b, cis['composite']['n']] + [P.shown(cis[m], m) for m in T.METRICS])
    if not nones or sum(r is not None for r in wide[dual]) < 2:
        res['sentence'] = 'not enough runs yet'
        return res, md + ['**At twice the width**: not enough runs yet.', '']
    n = lambda k: res['cells'][f'wide (192): {k}']['n']  # noqa: E731
    enough = min(3, max(n(k) for k in nones))  # the best: the highest composite of 3 seeds or more (as bench.trust_region)
    best = max([k for k in nones if n(k) >= enough], key=lambda k: res['cells'][f'wide (192): {k}']['composite'])
    v = res['verdicts'][f'{dual} vs {best}']
    wins = v['composite']['verdict'] == 'holds'
    held = all(v[m]['verdict'] != 'fails' for m in ('VQ', 'manifold'))
    res['sentence'] = (f'at twice the width, dual held at the batch ratio {T.RATIO_TARGET:g} '
                       + ('beats' if wins and held else 'does not beat') + f' the best \'none\' (AdamW at {best.split()[-1]}; '
                       f'\'none\' at ' + ', '.join(f'{k.split()[-1]} ({res["cells"][f"wide (192): {k}"]["n"]} seeds)' for k in nones)
                       + f'): Δ composite {V.fmt(v["composite"])} over '
                       f'{v["composite"]["n"]} paired seeds, VQ {V.fmt(v["VQ"])}, manifold distance lower by '
                       f'{V.fmt(v["manifold"], 4)}')
    res['dual_wins'] = bool(wins and held)
    md += ['**At twice the width**, dual against each \'none\' (positive = dual is better; lower manifold distance), '
           'paired seeds:', '', table(['cell', 'vs', 'seeds'] + [f'Δ {m} [95%]' for m in T.METRICS], rows), '',
           f'**Verdict**: {res["sentence"]}.', '']
    return res, md


if __name__ == '__main__':
    cs = cells()
    if run:
        if not os.path.isdir(os.path.join(toy.WIDE_DIR, 'transformer')):
            raise SystemExit(f'{toy.WIDE_DIR} is not built: {toy.BUILT_DIRS[toy.WIDE_DIR]} (~40 min on one core)')
        train_all(cs)
    res, md = report(cs)
    C.write_report(os.path.join(out, 'trust_region_wide'), res, md)
    if out == 'results' and res['sentence'] != 'not enough runs yet':
        line = (f'- *The trust region at twice the width* (`python -m bench.trust_region_wide`): {res["sentence"]}. '
                '[results/trust_region_wide.md](results/trust_region_wide.md), docs/method.md 5.6.')
        C.put_block('README.md', 'bench.trust_region_wide', [line])
        C.put_block(os.path.join(out, 'README.md'), 'bench.trust_region_wide',  # the README's figure, kept here too
                    ['## 16. The trust region at twice the width (`python -m bench.trust_region_wide`)', '', line])
