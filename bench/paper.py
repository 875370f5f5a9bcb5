"""
The paper's experiments as the paper ran them, on the toy world: each baseline of Table 2 trained by its
own recipe, the lambda_KL schedules of Fig. 7, the trust regions of Fig. 8 at the paper's settings, and
the component-level advantages (docs/method.md 4.3) against GRPO. Every cell is compared with the
reference (sage + equalizer + dual KL at the defaults) by bench.verdicts' paired-seed protocol: runs that
share a seed share prompts and noises, and each row is the per-seed difference, its mean and 95% t
interval over the seeds, positive = the reference is better.

    python -m bench.paper                          # every cell: 24 new configs x 5 seeds x 60 iterations (~12 CPU-hours)
    python -m bench.paper --budget_min=100         # start no new run after 100 min; rerun to go on (cells are cached)
    python -m bench.paper --workers=2 --worker=1   # with --worker=0 beside it: 2 processes on 2 cores
    python -m bench.paper --groups=advB,t2B        # only these groups' cells, in this order
    python -m bench.paper --run=False              # only the report, from the cells cached
    python -m bench.paper --quick                  # smoke test: 4 cells x 2 seeds x 2 iterations, into /tmp/paper_quick

Writes results/paper.md and .json, results/paper_<group>.png (the paired difference over iterations) and
paper_curves.png (every cell's mean curve), and section 8 of results/README.md (its bench.paper block, which
bench/toy.py keeps when it rewrites that file); --quick and any other --out write only their out dir.

The cells (config/toy.py otherwise; 8 prompts x G=4, 60 iterations, an evaluation every 5: bench.verdicts'
settings and its cell names, so the 5 cached reference cells of Setting B are reused, not retrained):
 1. Table 2, under Setting B (reward_weights (0.5, 0.5, 1.0), the default) and Setting A ((1, 1, 1),
    config/setting_a.py): dance, flow and cps by their recipes (config/dance.py, flow.py, cps.py: the
    baseline's sampler at eta 0.5, no equalizer, no KL), each also with config/fixed_kl.py (the position
    KL to the initial model at a constant lambda 0.04): 6 cells a setting, against the reference of the
    same setting (Setting A's reference is a cell of its own).
 2. Fig. 7, lambda_KL schedules (docs/method.md 5.5): fixed 1e-5 (kl_init = kl_min = kl_max = 1e-5,
    kl_warmup 0) and two-stage 1e-7 -> 1e-6 (kl_max 1e-6) against two-stage 1e-7 -> 1e-5 (the default:
    the reference itself).
 3. Fig. 8 at the paper's settings (one optimizer step an iteration, kl_max 1e-5): dual, moving and no
    KL, each with kl_estimator 'exact' and 'sample'. The estimator is read only where the velocity term
    is on (dual, stepwise: train.py's kl_vel_weight), so moving-exact and moving-sample are bitwise the
    same run by construction, and so are none-exact and none-sample: one cell each, 'moving' and 'none'.
    dual-exact is the reference; dual-sample is its own cell. dual-exact and moving are *not* merged: at
    theta == theta_old the exact velocity KL is 0 only up to the rounding of the recomputed forward, and
    it enters the lambda controller, so they are equal in expectation, not bitwise by construction.
 4. Advantage: 'taros' and 'per_component' against 'grpo' (the reference), under Setting B and under
    Setting A; also the number of held-out evaluations until the reward-hacking alarm trips (docs 11.1).
    The cached reference cells of Setting B were trained before the alarm existed: each is trained again
    (the cell rerun_<name>) for its alarm, and the report says how far the rerun's evaluations are from the
    cached ones (the current code reproducing the reference).
 5. The released loop's choices that this project does not default to (docs/method.md 6.1): its fixed
    initial noises per prompt (prompt_noise 'fixed') and its lower median (median 'lower'), against the
    defaults.
25 cells in all, 24 of them new: 125 runs of ~6 min on one core (~12 CPU-hours; ~8 h on 2 workers).

Order of the runs: the groups in the order of --groups (the advantage at Setting B first, then Table 2 at
B, the advantage at A, Table 2 at A, Fig. 8, Fig. 7, the released choices), each seed-major within its group, so a budget cut
leaves the most important comparisons complete and every cell of a group at the same seed count.
--workers/--worker split that list (cached runs included, so a rerun with the same split goes on where it
stopped).

Reported for every comparison (bench.verdicts' METRICS and late(): the mean of a run's evaluations at
iterations 40..60): composite, VQ and manifold distance, CLIPScore and PickScore where both cells have
them ('-': the toy has none), and for Fig. 8 also exploration (the within-group reward std). Verdicts:
holds (the interval above 0), fails (below), cannot be told (spans 0), too few seeds yet (1 paired seed),
not run (none).

Where this differs from the issue, and why:
- the alarm is read from a cell's evals where bench.common.train kept train.py's unprefixed 'alarm' and
  'watch_flagged' keys of the evaluation rows; where it kept only the eval_* keys (as it did when the
  reference cells were trained), from a side cell alarm_<name> that this script writes from the run's
  metrics.jsonl right after training it; a cell with neither says 'not recorded'.
- the cell name is bench.verdicts.name() of the overrides with a tuple written 1.0,1.0,1.0 (no spaces or
  brackets in file names); no cell of bench.verdicts has a tuple, so its names are unchanged.
- on the toy 60 iterations are 60 optimizer steps, fewer than kl_warmup's 100: the two-stage schedules of
  Fig. 7 are still warming up at the end (lambda_KL ~6e-6 and ~6e-7), and at kl_max 1e-5 the KL barely
  acts (bench/toy.py section 3 (b), (d)); the comparisons run as the paper set them all the same.
- Setting A's composite is VQ + MQ + TA, Setting B's 0.5 VQ + 0.5 MQ + TA: compare within a setting only.
"""
import json
import os
import sys
import tempfile

from bench import common as C
from bench.common import table
from infra.configurator import configure, list_of, number
from models import toy

_argv, sys.argv = sys.argv, sys.argv[:1]  # bench.verdicts reads the command line when imported: not ours
from bench import verdicts as V  # noqa: E402  the paired-seed protocol, its reference and its cell names
sys.argv = _argv

# ----------------------------------------------------------------------------- settings
out = 'results'         # cells/ (committed), runs/ (not), paper.md/.json
seeds = 5               # seeds 0..seeds-1 of every cell
iters = 60              # max_iters of a run (bench.verdicts': its reference cells are reused)
prompts = 8             # prompts_per_iter (x G=4: 32 clips an iteration), as bench.verdicts
eval_every = 5          # held-out evaluation every k iterations, as bench.verdicts
late_iters = 20         # a run's composite, VQ, manifold = the mean of its evaluations at iterations >= iters - 20
groups = 'advB,t2B,advA,t2A,fig8,fig7,released'  # the groups whose cells run, in this order (the report shows all)
budget_min = 0.0        # start no new training run after this many minutes (0: no limit)
worker = 0              # this process runs runs worker, worker + workers, ... of the ordered list
workers = 1             # 2 cores -> 2 processes (--worker=0 and --worker=1 --workers=2), each 1 thread
run = True              # False: only the report, from the cells already cached
threads = 1             # torch threads of every train.py
quick = False           # smoke test: 4 cells x 2 seeds x 2 iterations of 2 prompts, 4 eval prompts, into /tmp/paper_quick
GROUPS = ('advB', 't2B', 'advA', 't2A', 'fig8', 'fig7', 'released')
config = configure(globals(), [a + '=True' if a == '--quick' else
                               f"--groups={a.split('=', 1)[1]!r}" if a.startswith('--groups=') else a
                               for a in sys.argv[1:]],
                   rules=dict(groups=list_of(*GROUPS), prompts=number(1), late_iters=number(0)))
if worker >= workers:
    raise SystemExit(f'config error: worker must be below workers ({workers}), got {worker}')
# -----------------------------------------------------------------------------
EXTRA = {}  # more train.py overrides of every run (--quick: a smaller evaluation); not in the cell names
QUICK = ('sage (B)', 'taros (B)', 'sage (A)', 'flow + fixed KL (A)')  # --quick trains these only
if quick:  # tiny, never over the committed results
    out = os.path.join(tempfile.gettempdir(), 'paper_quick') if out == 'results' else out
    seeds, iters, prompts, eval_every, late_iters = 2, 2, 2, 1, 1
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(toy.DIR, 'eval_prompts.txt')) as f, open(os.path.join(out, 'eval4.txt'), 'w') as g:
        g.write(''.join(f.readlines()[:4]))
    EXTRA.update(eval_samples=1, eval_prompts=os.path.join(out, 'eval4.txt'), export_dtype='')
    config.update(out=out, seeds=seeds, iters=iters, prompts=prompts, eval_every=eval_every, late_iters=late_iters)
C.setup(out, threads, budget_min)
C.share(dict(seeds=seeds, iters=iters, prompts=prompts, eval_every=eval_every, late_iters=late_iters), V)

REF = V.REF                                              # sage + equalizer + dual KL at the defaults
SETTING_A = dict(reward_weights=(1.0, 1.0, 1.0))         # config/setting_a.py (Setting B: the default)
RECIPES = {k: dict(sampler=k, equalizer=False, kl_strategy='none') for k in ('dance', 'flow', 'cps')}  # config/<k>.py
FIXED_KL = dict(kl_strategy='fixed', kl_init=0.04, kl_min=0.04, kl_max=0.04, kl_warmup=0)  # config/fixed_kl.py
VISUAL = {'CLIPScore': 'clipscore', 'PickScore': 'pickscore'}  # evaluation keys of extras/metrics.py (the toy: none)
BASE = ('composite', 'VQ', 'manifold') + tuple(VISUAL)


def cells():
    """{label: train.py overrides}: a label names its setting where a cell runs under both."""
    c = {}
    for st, extra in (('B', {}), ('A', SETTING_A)):
        c[f'sage ({st})'] = dict(REF, **extra)  # B: bench.verdicts' reference cell itself
        for a in ('taros', 'per_component'):
            c[f'{a} ({st})'] = dict(REF, **extra, advantage=a)
        for k, r in RECIPES.items():
            c[f'{k} ({st})'] = dict(r, **extra)
            c[f'{k} + fixed KL ({st})'] = dict(r, **FIXED_KL, **extra)
    c['lambda fixed 1e-5'] = dict(REF, kl_init=1e-5, kl_min=1e-5, kl_max=1e-5, kl_warmup=0)
    c['lambda 1e-7 -> 1e-6'] = dict(REF, kl_max=1e-6)
    c['dual + sample KL'] = dict(REF, kl_estimator='sample')
    c['moving'] = dict(REF, kl_strategy='moving')  # either estimator: the velocity term is off
    c['none'] = dict(REF, kl_strategy='none')      # either estimator: no KL term at all
    c['prompt_noise fixed'] = dict(REF, prompt_noise='fixed')  # the released seeding (docs/method.md 6.1)
    c['median lower'] = dict(REF, median='lower')              # the released equalizer median
    return c


def comparisons():
    """[(key, number, title, claim, [(reference, other)], metrics)] in the report's order; the claim is
    'the reference is better'; a pair in NO_CLAIM is measured, not a claim of the paper."""
    t2 = lambda st: [(f'sage ({st})', f'{k}{kl} ({st})') for k in RECIPES for kl in ('', ' + fixed KL')]
    adv = lambda st: [(f'sage ({st})', f'{a} ({st})') for a in ('taros', 'per_component')]
    return [
        ('t2B', '1', 'Table 2, Setting B (reward weights 0.5, 0.5, 1)',
         'sage + equalizer + dual KL beats each baseline as its paper trains it', t2('B'), BASE),
        ('t2A', '1', 'Table 2, Setting A (reward weights 1, 1, 1)',
         'sage + equalizer + dual KL beats each baseline as its paper trains it', t2('A'), BASE),
        ('fig7', '2', 'Fig. 7, lambda_KL schedule (reference: two-stage 1e-7 -> 1e-5, the default)',
         'the two-stage 1e-7 -> 1e-5 schedule beats fixed 1e-5 and two-stage 1e-7 -> 1e-6',
         [('sage (B)', 'lambda fixed 1e-5'), ('sage (B)', 'lambda 1e-7 -> 1e-6')], BASE),
        ('fig8', '3', 'Fig. 8 at the paper\'s settings (1 optimizer step an iteration, kl_max 1e-5; sage (B) = dual + exact KL)',
         'dual beats moving and no KL, with either velocity-KL estimator',
         [('sage (B)', 'moving'), ('sage (B)', 'none'), ('dual + sample KL', 'moving'), ('dual + sample KL', 'none'),
          ('sage (B)', 'dual + sample KL')], BASE + ('explore',)),
        ('advB', '4', 'Advantage, Setting B (reference: grpo)',
         'GRPO\'s advantage (the paper\'s) beats taros and per_component (fails: the alternative is better)', adv('B'), BASE),
        ('advA', '4', 'Advantage, Setting A (reference: grpo)',
         'GRPO\'s advantage (the paper\'s) beats taros and per_component (fails: the alternative is better)', adv('A'), BASE),
        ('released', '5', 'The released loop\'s seeding and median (reference: this project\'s defaults)',
         'fresh initial noise every iteration beats the released fixed noises per prompt, and numpy\'s median '
         'the released lower one (fails: the released choice is better)',
         [('sage (B)', 'prompt_noise fixed'), ('sage (B)', 'median lower')], BASE + ('explore',)),
    ]


ALIAS = {'sage (B)': 'dual + exact KL'}  # the reference's name where a comparison has two (Fig. 8)
NO_CLAIM = {('sage (B)', 'dual + sample KL')}  # what the released estimator changes: measured, not a claim


def name(ov, s):
    """bench.verdicts' cell name, a tuple written 1.0,1.0,1.0 (no spaces or brackets in a file name)."""
    return V.name({k: ','.join(map(str, v)) if isinstance(v, tuple) else v for k, v in ov.items()}, s)


def todo(cs):
    """[(label, seed, rerun)] of the groups in --groups order, seed-major within a group, each run once.
    rerun: in the advantage groups, a cached cell trained before the alarm existed is trained again as the
    cell rerun_<name>, for its alarm, and to show that the current code reproduces it (the report)."""
    want = {k: [l for p in pairs for l in p] for k, _, _, _, pairs, _ in comparisons()}
    seen, res = set(), []
    for g in [g.strip() for g in groups.split(',') if g.strip()]:
        labels = list(dict.fromkeys(l for l in want[g] if not quick or l in QUICK))
        for s in range(seeds):
            for label in labels:
                if name(cs[label], s) not in seen:
                    seen.add(name(cs[label], s))
                    res.append((label, s, False))
        for s in range(seeds) if g.startswith('adv') else ():
            for label in labels:
                run, nm = C.cached(name(cs[label], s)), name(cs[label], s)
                if run and not all('alarm' in e for e in run['evals']) and not C.cached('alarm_' + nm) \
                        and 'rerun_' + nm not in seen:
                    seen.add('rerun_' + nm)
                    res.append((label, s, True))
    return res


def train_all(cs):
    common = dict(max_iters=iters, prompts_per_iter=prompts, eval_every=eval_every, save_every=0, eval_videos=0, **EXTRA)
    for label, s, rerun in todo(cs)[worker::workers]:  # a cached run is skipped: rerun with the same split to go on
        if C.over_budget():
            print(f'over the time budget of {budget_min} min: no new runs', flush=True)
            break
        nm = name(cs[label], s)
        if C.train(('rerun_' if rerun else '') + nm, dict(common, **cs[label], seed=s)) is not None and not rerun:
            keep_alarm(nm)


def keep_alarm(nm):
    """The alarm's rows of a run just trained (common.train keeps eval_* keys only): a side cell from its
    metrics.jsonl, while the run dir is still there."""
    def read():
        path = os.path.join(out, 'runs', nm, 'metrics.jsonl')
        if not os.path.exists(path):
            return None
        rows = [r for r in map(json.loads, open(path)) if 'eval_composite' in r]
        if not rows or not all('alarm' in r for r in rows):
            return None
        return dict(evals=[dict(iter=r['iter'], alarm=r['alarm'], watch_flagged=r.get('watch_flagged', []))
                           for r in rows])
    run = C.cached(nm)
    if run and not all('alarm' in e for e in run['evals']):
        C.cell('alarm_' + nm, read)


def alarm_of(nm, run):
    """'not recorded' | 'never' | {evals: held-out evaluations after the base until it tripped, iter, watchers}."""
    rows = run['evals'] if all('alarm' in e for e in run['evals']) else \
        (C.cached('alarm_' + nm) or C.cached('rerun_' + nm) or {}).get('evals')
    if not rows:
        return 'not recorded'
    k = next((i for i, e in enumerate(rows) if e['alarm']), None)  # rows[0]: iteration 0, the base model
    return 'never' if k is None else dict(evals=k, iter=rows[k]['iter'], watchers=rows[k]['alarm'])


def alarm_text(a):
    return a if isinstance(a, str) else f'{a["evals"]} (iteration {a["iter"]}: {", ".join(a["watchers"])})'


# ----------------------------------------------------------------------------- statistics
def value(run, metric):
    """A run's value of metric (None: it does not have that metric)."""
    if metric in VISUAL:
        xs = [e.get(VISUAL[metric]) for e in run['evals'] if e['iter'] >= iters - late_iters]
        return sum(xs) / len(xs) if xs and None not in xs else None
    return V.METRICS[metric][0](run)


def compare(runs, a, b, metric):
    """The reference a's paired advantage over b (positive = a is better) over the seeds both have;
    None for a metric that a run lacks (CLIPScore, PickScore on the toy)."""
    sign = 1 if metric in VISUAL else V.METRICS[metric][1]
    ss = [s for s in range(seeds) if runs[a][s] and runs[b][s]]
    vals = [(value(runs[a][s], metric), value(runs[b][s], metric)) for s in ss]
    if (metric in VISUAL and not ss) or any(x is None or y is None for x, y in vals):
        return None
    return V.paired([sign * x for x, _ in vals], [sign * y for _, y in vals])


def shown(ci, metric):
    if ci is None:
        return '-'
    return V.verdict(ci) if ci['n'] < 2 else f'{V.fmt(ci, 4 if metric == "manifold" else 3)} {V.verdict(ci)}'


# ----------------------------------------------------------------------------- the report
def report(cs):
    runs = {label: [C.cached(name(ov, s)) for s in range(seeds)] for label, ov in cs.items()}
    have = {k: sum(r is not None for r in v) for k, v in runs.items()}
    mean = lambda xs: sum(xs) / len(xs) if xs else None
    res = dict(config=config, cells={}, comparisons={}, alarms={}, claims=[], short=[])
    md = ['## The paper\'s experiments as the paper ran them (`python -m bench.paper`)', '',
          f'{iters} iterations of `train.py config/toy.py` ({prompts} prompts x G=4 an iteration), seeds 0..{seeds - 1}; '
          f'held-out ODE evaluation every {eval_every} iterations; a run\'s value of a metric is the mean of its '
          f'evaluations at iterations {iters - late_iters}..{iters}. Each row: the **per-seed difference** to its '
          'reference cell (runs sharing a seed share prompts and noises), mean and 95% t interval over the seeds, '
          'signed so that **positive = the reference is better** (higher composite, VQ, CLIPScore, PickScore, '
          'exploration; lower manifold distance): the claim holds if the interval is above 0, fails if below, cannot '
          'be told if it spans 0. CLIPScore and PickScore: `-` where a cell has none (the toy: eval_metrics \'\'). '
          'Setting A\'s composite is VQ + MQ + TA, Setting B\'s 0.5 VQ + 0.5 MQ + TA: compare within a setting.', '']
    rows = []
    for label, rs in runs.items():
        rs = [r for r in rs if r]
        vals = {m: mean([v for v in (value(r, m) if m in VISUAL or m in V.METRICS else V.late(r, m) for r in rs)
                         if v is not None]) for m in ('composite', 'VQ', 'MQ', 'TA', 'manifold', 'explore') + tuple(VISUAL)}
        res['cells'][label] = dict(overrides=cs[label], names=[name(cs[label], s) for s in range(seeds)], n=len(rs),
                                   **(vals if rs else {}))
        rows.append([label, len(rs) or 'not run'] + [('-' if vals[m] is None else f'{vals[m]:.{4 if m == "manifold" else 3}f}')
                                                     for m in ('composite', 'VQ', 'MQ', 'TA', 'manifold', 'explore') + tuple(VISUAL)])
    md += [f'**Every cell** (mean over its seeds; explore = the mean within-group reward std over the run):', '',
           table(['cell', 'seeds', 'composite', 'VQ', 'MQ', 'TA', 'manifold', 'explore'] + list(VISUAL), rows), '']
    for key, num, title, claim, pairs, metrics in comparisons():
        rows, found = [], {}
        for a, b in pairs:
            cis = {m: compare(runs, a, b, m) for m in metrics}
            found[(a, b)] = cis
            rows.append([a, b + (' (measured, no claim)' if (a, b) in NO_CLAIM else ''), cis['composite']['n']] +
                        [shown(cis[m], m) for m in metrics])
        res['comparisons'][key] = {f'{a} vs {b}': {m: ci and dict(ci, verdict=V.verdict(ci)) for m, ci in v.items()}
                                   for (a, b), v in found.items()}
        one_ref = len({a for a, _ in pairs}) == 1  # else each other cell is named with its reference
        claimed = [(b if one_ref else f'{b} vs {ALIAS.get(a, a)}', V.verdict(v['composite']), v['composite'])
                   for (a, b), v in found.items() if (a, b) not in NO_CLAIM]
        sentence = (f'**{num}. {title}**, *{claim}* (held-out composite): '
                    f'{V.grouped([(b, w, V.fmt(ci)) for b, w, ci in claimed])}.')
        res['claims'].append(sentence)
        res['short'].append(V.short_row(f'{num}. {claim.split(" (fails")[0]} ({title.split(" (")[0]})', claimed))
        md += [f'### {num}. {title}', '', f'*{claim}*', '',
               table(['reference', 'vs', 'seeds'] + [f'Δ {m} [95%]' for m in metrics], rows), '', sentence, '']
        if key.startswith('adv'):  # the alarm: held-out evaluations (after the base's) until it trips
            rows = []
            for label in dict.fromkeys(l for p in pairs for l in p):
                per = [alarm_of(name(cs[label], s), r) if r else None for s, r in enumerate(runs[label])]
                res['alarms'][label] = per
                ran = [a for a in per if a is not None]
                tripped = [a for a in ran if isinstance(a, dict)]
                recorded = [a for a in ran if a != 'not recorded']
                rows.append([label, len(ran) or 'not run',
                             f'{len(tripped)}/{len(recorded)}' if recorded else ('not recorded' if ran else 'not run'),
                             '; '.join(f's{s}: {alarm_text(a)}' for s, a in enumerate(per) if a is not None) or '-'])
            md += [f'Evaluations until the reward-hacking alarm trips (the first held-out evaluation after the base '
                   f'model\'s whose `alarm` is not empty; one every {eval_every} iterations; never: not within the run; '
                   'not recorded: a cell trained before the alarm existed):', '',
                   table(['cell', 'seeds', 'tripped', 'evaluations until it trips, per seed'], rows), '']
            md += reproduced(runs, cs, pairs)
    plots(runs)
    md += ['Plots: `paper_<group>.png` (the paired difference in held-out composite over iterations, mean and 95% band, '
           'one curve a comparison) and `paper_curves.png` (the mean held-out composite of every cell).', '']
    return res, md, have


def reproduced(runs, cs, pairs):
    """A line on the cells trained again for their alarm (todo()'s rerun_): how far the current code's
    evaluations are from the cached ones (0: the same run, bitwise in its logged figures)."""
    diffs = []
    for label in dict.fromkeys(l for p in pairs for l in p):
        for s, r in enumerate(runs[label]):
            again = r and C.cached('rerun_' + name(cs[label], s))
            if again:
                diffs.append(max(abs(a[k] - b[k]) for a, b in zip(r['evals'], again['evals'])
                                 for k in ('composite', 'VQ', 'MQ', 'TA', 'manifold')))
    if not diffs:
        return []
    return [f'Trained again for the alarm (cells cached before it existed): {len(diffs)} runs; the largest difference '
            f'of any held-out composite, VQ, MQ, TA or manifold distance from the cached run: {max(diffs):.1e}.', '']


def plots(runs):
    """paper_<group>.png: per comparison group, the paired Δ composite over iterations (bench.verdicts'
    curve_of); paper_curves.png: the mean held-out composite of every cell, one panel a group."""
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
    except ImportError:  # the tables are written all the same
        return
    comps = comparisons()
    for key, num, title, claim, pairs, metrics in comps:
        fig, ax = plt.subplots(figsize=(6, 3.6))
        for a, b in pairs:
            cv = V.curve_of(runs, a, b)  # None: fewer than 2 paired seeds
            if cv:
                x, cis = cv
                ax.plot(x, [c['mean'] for c in cis], marker='.', label=f'{ALIAS.get(a, a) if len(pairs) > 2 else a} - {b}')
                ax.fill_between(x, [c['lo'] for c in cis], [c['hi'] for c in cis], alpha=0.12)
        ax.axhline(0, color='k', lw=0.8)
        ax.set(xlabel='iteration', ylabel='Δ held-out composite (> 0: reference better)')
        if ax.lines[:-1]:
            ax.legend(fontsize=6)
        ax.set_title(f'{num}. {title}', fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(out, f'paper_{key}.png'), dpi=100)
        plt.close(fig)
    fig, axs = plt.subplots(2, (len(comps) + 1) // 2, figsize=(4 * ((len(comps) + 1) // 2), 6.4))
    for ax, (key, num, title, claim, pairs, metrics) in zip(axs.flatten(), comps):
        for label in dict.fromkeys(l for p in pairs for l in p):
            rs = [r for r in runs[label] if r]
            if rs:
                its = [e['iter'] for e in rs[0]['evals']]
                ax.plot(its, [sum(r['evals'][i]['composite'] for r in rs) / len(rs) for i in range(len(its))],
                        marker='.', ms=3, label=f'{label} ({len(rs)})', lw=2 if label == pairs[0][0] else 1)
        ax.set_title(f'{num}. {title.split(" (")[0]}', fontsize=8)
        ax.set(xlabel='iteration')
        if ax.lines:
            ax.legend(fontsize=5)
    fig.tight_layout()
    fig.savefig(os.path.join(out, 'paper_curves.png'), dpi=100)
    plt.close(fig)


def readme_lines(res, note):
    """Section 8 of results/README.md: a table of the same shape as bench.verdicts' (a row a comparison, the cells
    the claim holds, fails and cannot be told against), then the alarm; the intervals and every cell: paper.md."""
    alarms = []
    for label, per in res['alarms'].items():
        rec = [a for a in per if a is not None and a != 'not recorded']
        if rec:
            alarms.append(f'{label} {sum(isinstance(a, dict) for a in rec)}/{len(rec)}')
    rows = [r for r in res['short'] if any(x not in ('-', '') and '(not run)' not in x for x in r[1:])]
    head = (f'{iters} iterations x {seeds} seeds a cell, each paired with sage + equalizer + dual KL at its setting (in '
            'brackets: the mean difference in held-out composite, positive = the reference is better); every cell, '
            'interval, metric and alarm: [paper.md](paper.md).')
    alarm = (f' Runs whose reward-hacking alarm tripped within {iters} iterations: {", ".join(alarms)}.' if alarms else '')
    if not rows:
        return note + [head + ' No comparison has finished yet: `python -m bench.paper` runs them (cached, resumable).']
    return note + [table(['claim (the paper\'s experiment)', 'holds vs', 'fails vs', 'cannot be told vs'], rows), '',
                   head + alarm]


if __name__ == '__main__':
    cs = cells()
    n_new = sum(C.cached(name(ov, s)) is None for ov in cs.values() for s in range(seeds))
    print(f'bench.paper: {len(cs)} cells x {seeds} seeds x {iters} iterations ({n_new} runs not cached); out={out}', flush=True)
    if run:
        train_all(cs)
    res, md, have = report(cs)
    missing = sum(seeds - n for n in have.values())
    note = [] if not missing else [f'**Incomplete**: {missing} of {seeds * len(cs)} runs are not cached yet; '
                                   'rerun `python -m bench.paper` to go on.', '']
    with open(os.path.join(out, 'paper.json'), 'w') as f:
        json.dump(dict(res, have=have), f, indent=1)
    with open(os.path.join(out, 'paper.md'), 'w') as f:
        f.write('\n'.join(md[:2] + note + md[2:]) + '\n')
    if not quick and out == 'results':  # section 8 of results/README.md (bench/toy.py keeps it)
        C.put_block(os.path.join(out, 'README.md'), 'bench.paper', [
            "## 8. The paper's experiments as the paper ran them (`python -m bench.paper`)", ''] + readme_lines(res, note))
        print('results/README.md: bench.paper block written', flush=True)
    print('\n'.join(res['claims']))
    print(f'wrote {out}/paper.md, {out}/paper.json', flush=True)
