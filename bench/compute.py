"""
Alignment per unit of compute: which savings keep the quality, on equal compute, with paired seeds.

    python -m bench.compute                      # every cell: 6 settings x 5 seeds, each to the default's compute
                                                 # (~5 CPU-hours: 30 runs of ~10.5 min on one core; all cached)
    python -m bench.compute --budget_min=100     # start no new run after 100 min; rerun to go on (cells are cached)
    python -m bench.compute --workers=2 --worker=1   # with --worker=0 beside it: 2 processes on 2 cores
    python -m bench.compute --run=False          # only the report, from the cached cells
    python -m bench.compute --quick              # a smoke test of the whole bench (tiny runs, 2 seeds; ~2 min),
                                                 # into the temp folder: the committed results stay as they are

Writes results/compute.md and .json, results/compute.png and section 7 of results/README.md (its
bench.compute block: the GPU-budget sentence, the verdicts and the GPU-hours table).

What it compares (config/toy.py, 16 prompts x G=4, sage + equalizer + dual KL): the paper's setting,
every stochastic step of every clip trained (`timestep_fraction=1.0`; the "default" below), against
`timestep_fraction` 0.5 and 0.25, `sde_window` 2 and 4 (sde.window: ODE rollouts but for a random
window, only its steps trained) and 5 rollout steps instead of 10 (held-out evaluation still at 10).
On the toy's 10 steps timestep_fraction 0.25 trains round(2.5) = 2 steps a clip (Python rounds half to
even), as many as sde_window 2: the two differ in which steps (any 2, or 2 neighbours with ODE around).
Compute is train.py's own count of transformer passes (metrics.jsonl passes_*), rollout + anchor +
update, in forward-equivalents: a forward+backward counts as its full-size FLOPs over a forward's
(4.3x, bench/fullsize.gpu_hours; evaluation and diagnostics apart, and diagnostics off here). Every
setting runs to the default's compute (more iterations when cheaper), with `evals` held-out
evaluations spread evenly over it. Runs that share a seed share prompts, noises and eval noises.

Per setting and seed: the curve of held-out composite (trailing mean of `smooth` evaluations, linear
between them) against passes; the target is the default's final composite (that mean at its end);
passes to reach = where the curve first reaches it (a run that never does counts its whole budget,
a lower bound, flagged); ratio = setting / default, its 95% interval the t interval of the mean log
ratio over seeds; composite at equal passes = the curve at the default's final passes, paired
difference with its 95% t interval (bench/verdicts.py's machinery).
Verdict: "reaches the default's quality with <= 0.5x the passes" if the ratio's interval lies below
0.5 and every seed got there; "worse" if the composite at equal passes is below the default's (its
interval below 0) or the ratio's interval lies above 1; "reaches it with < 1x the passes" if the
ratio's interval lies below 1 (a word the issue did not list: between the two); else "cannot be told".

The user's table: each setting at full size (HunyuanVideo 1.5, 32 clips an iteration, 20 steps, CFG 6)
with the same *fraction* of steps as on the toy (10 steps there: sde_window 2 of 10 -> 4 of 20, 5
rollout steps -> 10), its passes per iteration, and GPU-hours from bench/fullsize.gpu_hours (FLOPs per
pass measured at 352x624, an assumed sustained TFLOP/s): per iteration, and for the released 10,000
iterations on 8 GPUs. An estimate on paper, never timed on a GPU.
"""
import functools
import json
import math
import os
import sys
import tempfile

import torch

import sde
from models import toy
from bench import common as C
from bench.common import table
from bench.fullsize import gpu_hours, tflops as TFLOPS
from infra.configurator import configure, number

_argv, sys.argv = sys.argv, sys.argv[:1]  # bench.verdicts reads the command line when imported: not ours
from bench.verdicts import fmt, paired, t975  # noqa: E402  the paired-seed statistics
sys.argv = _argv

# ----------------------------------------------------------------------------- settings
out = 'results'         # cells/ (committed), runs/ (not), compute.md/.json/.png
seeds = 5               # seeds 0..seeds-1 of every cell (seed-major)
iters = 40              # iterations of the default (config/toy.py's max_iters); the others run to its passes
prompts = 16            # prompts_per_iter (x G=4: 64 clips an iteration, config/toy.py)
evals = 8               # held-out evaluations of every run, spread evenly over its iterations (and iteration 0)
smooth = 3              # the curve: trailing mean of this many evaluations (the final composite: its last value)
max_iters_factor = 4.0  # a setting runs at most this many times the default's iterations
full_iters = 10000      # the released run's iterations, for the user's table
full_gpus = 8
budget_min = 0.0        # start no new training run after this many minutes (0: no limit)
worker = 0              # this process runs runs worker, worker + workers, ... of the seed-major list
workers = 1
run = True              # False: only the report, from the cells already cached
threads = 1             # torch threads of every train.py
quick = False           # a smoke test: tiny runs, 2 seeds, into the temp folder
config = configure(globals(), [a + '=True' if a == '--quick' else a for a in sys.argv[1:]]
                   if __name__ == '__main__' else [], rules=dict(prompts=number(1)))
if worker >= workers:
    raise SystemExit(f'config error: worker must be below workers ({workers}), got {worker}')
# -----------------------------------------------------------------------------
FULL = dict(num_steps=20, cfg=6.0, shift=5.0, eta=0.5, sampler='sage', group_size=4, prompts_per_iter=8)  # train.py's
_toy = {}
with open('config/toy.py') as _f:
    exec(_f.read(), {}, _toy)  # the toy's settings (a config file: plain assignments)
TOY = dict(FULL, **{k: v for k, v in _toy.items() if k in FULL})
EXTRA = {}  # more train.py overrides of every run (--quick: tiny ones)
if quick:
    out = os.path.join(tempfile.gettempdir(), 'bench_compute_quick') if out == 'results' else out
    seeds, iters, prompts, evals, smooth, max_iters_factor = 2, 2, 2, 2, 1, 2.0
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(toy.DIR, 'eval_prompts.txt')) as f, open(os.path.join(out, 'eval4.txt'), 'w') as g:
        g.write(''.join(f.readlines()[:4]))  # 4 held-out prompts, not 16
    EXTRA = dict(group_size=2, rollout_batch=4, train_batch=4, eval_samples=1, eval_prompts=os.path.join(out, 'eval4.txt'))
    TOY['group_size'] = 2
C.setup(out, threads, budget_min)
EVAL = f'{4 if quick else 16} prompts x {EXTRA.get("eval_samples", 2)} seeds'  # config/toy.py: 16 x 2

# label: (toy overrides, full-size overrides: the same fraction of the 20 steps)
SETTINGS = {
    'default (every step)': (dict(timestep_fraction=1.0), dict(timestep_fraction=1.0)),
    'timestep_fraction 0.5': (dict(timestep_fraction=0.5), dict(timestep_fraction=0.5)),
    'timestep_fraction 0.25': (dict(timestep_fraction=0.25), dict(timestep_fraction=0.25)),
    'sde_window 2': (dict(timestep_fraction=1.0, sde_window=2), dict(timestep_fraction=1.0, sde_window=4)),
    'sde_window 4': (dict(timestep_fraction=1.0, sde_window=4), dict(timestep_fraction=1.0, sde_window=8)),
    '5 rollout steps': (dict(timestep_fraction=1.0, num_steps=5, eval_steps=10),
                        dict(timestep_fraction=1.0, num_steps=10, eval_steps=20)),
}
DEFAULT = 'default (every step)'
TRAINING = ('rollout', 'anchor', 'update')  # the passes that train; evaluation and diagnostics apart


def passes_per_iter(s, clips):
    """Transformer passes of one iteration by kind (clips x CFG branches; dual KL: an anchor forward
    per trained step), from the settings as train.py derives them. tests/test_compute.py checks it
    against train.py's own count."""
    sig = sde.sigmas(s['num_steps'], s['shift'])
    stochastic = sum(sde.variance(s['sampler'], sig[i].item(), sig[i + 1].item(), s['eta']) > 0 for i in range(s['num_steps']))
    n_train = max(1, round(s.get('timestep_fraction', 1.0) * min(s.get('sde_window', 0) or s['num_steps'], stochastic)))
    b = 2 if s['cfg'] != 1.0 else 1
    return dict(rollout=clips * s['num_steps'] * b, anchor=clips * n_train * b, update=clips * n_train * b), n_train


@functools.lru_cache(maxsize=None)
def weight(kind):
    """A pass of `kind` in forward-equivalents: its full-size FLOPs over a rollout forward's (4.3 with a backward)."""
    return gpu_hours({kind: 1}) / gpu_hours(dict(rollout=1))


def forward_equiv(passes):
    """The training passes (evaluation and diagnostics apart) in forward-equivalents."""
    return sum(n * weight(k) for k, n in passes.items() if k in TRAINING)


def plan():
    """{label: (overrides of the run, iterations, eval_every)}: every setting to the default's compute."""
    cost = {k: forward_equiv(passes_per_iter(dict(TOY, **ov), prompts * TOY['group_size'])[0])
            for k, (ov, _) in SETTINGS.items()}
    res = {}
    for k, (ov, _) in SETTINGS.items():
        n = min(math.ceil(iters * cost[DEFAULT] / cost[k] - 1e-9), int(max_iters_factor * iters))
        every = max(1, round(n / evals))
        res[k] = (dict(ov, **EXTRA, prompts_per_iter=prompts, max_iters=n, eval_every=every, save_every=0,
                       eval_videos=0, diag_every=0), n, every)
    return res


def name(ov, s):
    key = '_'.join(f'{k}-{os.path.basename(str(v))}' for k, v in sorted(ov.items())
                   if k not in ('save_every', 'eval_videos', 'diag_every'))
    return f'c_{key}_s{s}'


def train_all(p):
    todo = [(s, ov) for s in range(seeds) for ov, _, _ in p.values()]  # seed-major
    for s, ov in todo[worker::workers]:
        C.train(name(ov, s), dict(ov, seed=s))


# ----------------------------------------------------------------------------- curves and statistics
def curve(r):
    """[(forward-equivalent training passes, smoothed held-out composite)] of a cached run: each
    evaluation at the passes logged in its iteration's row (iteration 0: none yet)."""
    done = {row['iter']: forward_equiv({k: row[f'passes_{k}'] for k in TRAINING}) for row in r['iters']}
    pts = [(done.get(e['iter'], 0.0), e['composite']) for e in r['evals']]
    return [(x, sum(c for _, c in pts[max(0, i - smooth + 1):i + 1]) / len(pts[max(0, i - smooth + 1):i + 1]))
            for i, (x, _) in enumerate(pts)]


def at(cv, x):
    """The curve at passes x (linear between evaluations; its last value beyond)."""
    for (x0, y0), (x1, y1) in zip(cv, cv[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / max(x1 - x0, 1e-12)
    return cv[-1][1]


def reach(cv, target):
    """(passes where the curve first reaches target, reached?), searched from the first evaluation after
    training began (the base model reaching it says nothing); never: its last passes, False."""
    for (x0, y0), (x1, y1) in zip(cv, cv[1:]):
        if y1 >= target:
            return (x0 + (x1 - x0) * (target - y0) / (y1 - y0) if y0 < target else x1), True
    return cv[-1][0], False


def ratio_ci(rs):
    """Geometric mean ratio and its 95% interval: the t interval of the mean log ratio, exponentiated."""
    if len(rs) < 2:
        return dict(n=len(rs), mean=float('nan'), lo=float('nan'), hi=float('nan'), ratios=rs)
    logs = torch.tensor([math.log(r) for r in rs], dtype=torch.float64)
    m, h = logs.mean().item(), t975(len(rs) - 1) * logs.std().item() / math.sqrt(len(rs))
    return dict(n=len(rs), mean=math.exp(m), lo=math.exp(m - h), hi=math.exp(m + h), ratios=rs)


def verdict(ratio, diff, all_reached):
    if ratio['n'] < 2:
        return 'too few seeds yet' if ratio['n'] else 'not run'
    if diff['hi'] < 0 or ratio['lo'] > 1:
        return 'worse'
    if ratio['hi'] <= 0.5 and all_reached:
        return "reaches the default's quality with <= 0.5x the passes"
    if ratio['hi'] < 1 and all_reached:
        return 'reaches it with < 1x the passes'
    return 'cannot be told'


def compare(runs):
    """Per setting: ratio of passes to reach the default's final composite, composite at equal passes."""
    res = {}
    for k in SETTINGS:
        ss = [s for s in range(seeds) if runs[DEFAULT][s] and runs[k][s]]
        rs, got, mine, ref, reached = [], [], [], [], []
        for s in ss:
            cd, ck = curve(runs[DEFAULT][s]), curve(runs[k][s])
            target, budget = cd[-1][1], cd[-1][0]
            (xd, _), (xk, ok) = reach(cd, target), reach(ck, target)
            rs.append(xk / xd)
            reached.append(ok)
            mine.append(at(ck, budget))
            ref.append(target)
        diff = paired(mine, ref)
        ratio = ratio_ci(rs)
        res[k] = dict(seeds=ss, ratio=ratio, diff=diff, reached=sum(reached),
                      verdict=verdict(ratio, diff, all(reached)) if k != DEFAULT else 'the reference')
    return res


# ----------------------------------------------------------------------------- the report
def user_table(cmp):
    """Full-size passes and GPU-hours per setting, beside the toy verdict."""
    rows, res = [], {}
    for k, (_, full) in SETTINGS.items():
        s = dict(FULL, **full)
        p, n_train = passes_per_iter(s, FULL['prompts_per_iter'] * FULL['group_size'])
        h = gpu_hours(p)
        res[k] = dict(full_settings=full, passes=p, n_train=n_train, gpu_hours_iter=h,
                      gpu_hours_run=h * full_iters, days_run=h * full_iters / full_gpus / 24)
        c = cmp.get(k, {})
        toy = c.get('verdict', '') + (f' ({fmt(c["ratio"], 2)[1:].replace("+", "")}x)' if k != DEFAULT and c and
                                      c['ratio']['n'] > 1 else '')
        rows.append([k, ', '.join(f'{a}={b}' for a, b in full.items()), f'{n_train}/{s["num_steps"]}',
                     '/'.join(str(p[x]) for x in TRAINING), f'{h:.2f}', f'{h / full_gpus:.3f}',
                     f'{h * full_iters:,.0f}', f'{h * full_iters / full_gpus / 24:.1f}', toy])
    return table(['setting', 'full-size settings', 'trained steps', 'passes/iter (rollout/anchor/update)',
                  'GPU-h/iter', 'h/iter on 8 GPUs', f'GPU-h for {full_iters:,} iters', 'days on 8 GPUs',
                  'toy verdict (passes ratio [95%])'], rows), res


def plots(runs, cmp):
    if not any(r for rs in runs.values() for r in rs):  # nothing cached yet: no empty figure
        return
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axs = plt.subplots(1, 2, figsize=(11, 3.8))
    for i, k in enumerate(SETTINGS):
        color = plt.cm.tab10(i)  # a setting has one colour in both panels
        rs = [r for r in runs[k] if r]
        if not rs:
            continue
        cvs = [curve(r) for r in rs]
        xs = sorted({x for cv in cvs for x, _ in cv})
        axs[0].plot(xs, [sum(at(cv, x) for cv in cvs) / len(cvs) for x in xs], marker='.', label=f'{k} ({len(rs)})',
                    lw=2 if k == DEFAULT else 1, color=color)
        ss = cmp[k]['seeds']
        if k != DEFAULT and len(ss) > 1:
            budget = min(curve(runs[DEFAULT][s])[-1][0] for s in ss)
            grid = [budget * i / 20 for i in range(1, 21)]
            cis = [paired([at(curve(runs[k][s]), x) for s in ss], [at(curve(runs[DEFAULT][s]), x) for s in ss]) for x in grid]
            axs[1].plot(grid, [c['mean'] for c in cis], label=k, color=color)
            axs[1].fill_between(grid, [c['lo'] for c in cis], [c['hi'] for c in cis], alpha=0.15, color=color)
    axs[0].set(xlabel='training passes (forward-equivalents)', ylabel='held-out composite (mean over seeds)',
               title=f'smoothed over {smooth} evaluations')
    axs[1].axhline(0, color='k', lw=0.8)
    axs[1].set(xlabel='training passes (forward-equivalents)', title='Δ composite vs the default at equal passes [95%]')
    for ax in axs:
        if ax.lines:
            ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(os.path.join(out, 'compute.png'), dpi=100)
    plt.close(fig)


def report(p):
    runs = {k: [C.cached(name(ov, s)) for s in range(seeds)] for k, (ov, _, _) in p.items()}
    have = {k: sum(r is not None for r in v) for k, v in runs.items()}
    cmp = compare(runs)
    user, full = user_table(cmp)
    rows = []
    for k, (ov, n, every) in p.items():
        c = cmp[k]
        n_train = passes_per_iter(dict(TOY, **ov), prompts * TOY['group_size'])[1]
        rows.append([k, have[k], f'{n_train}/{ov.get("num_steps", TOY["num_steps"])}', n, every, '' if k == DEFAULT else f'{fmt(c["ratio"], 2)[1:].replace("+", "")}'
                     f' ({c["reached"]}/{len(c["seeds"])} reached)', '' if k == DEFAULT else fmt(c['diff']), c['verdict']])
    md = ['## 7. Alignment per unit of compute (`python -m bench.compute`)', '',
          f'config/toy.py ({prompts} prompts x G={TOY["group_size"]}), seeds 0..{seeds - 1}; the default trains every '
          f'step (the paper\'s setting, {iters} iterations); every other setting runs to the same compute in training '
          'passes (train.py\'s count, forward-equivalents: a forward+backward weighs 4.3 forwards, its full-size FLOP '
          f'ratio), with {evals} held-out evaluations ({EVAL}, ODE, 10 steps) spread over it. Curve = '
          f'trailing mean of {smooth} evaluations. Ratio = passes to reach the default\'s final composite, setting / '
          'default, per seed (a run that never reaches it counts its whole budget: a lower bound), geometric mean and '
          '95% t interval of the log ratio; Δ composite = setting - default at the default\'s final passes, paired, '
          '95% t interval. Cells: results/cells/c_*.json.', '',
          table(['setting', 'seeds', 'trained steps', 'iterations', 'eval every', 'passes ratio [95%]', 'Δ composite at equal passes [95%]',
                 'verdict'], rows), '',
          'Curves: `compute.png` (left: mean held-out composite against passes; right: paired difference to the default '
          'at equal passes, 95% band).', '',
          f'**At full size** (bench/fullsize.gpu_hours: FLOPs per pass measured at 352x624, an assumed '
          f'{TFLOPS:.0f} TFLOP/s sustained per GPU; 32 clips an iteration, 20 steps, CFG 6; diagnostics '
          'and evaluation apart; an estimate, never timed on a GPU):', '', user, '']
    return dict(config=config, plan={k: dict(overrides=ov, iters=n, eval_every=e) for k, (ov, n, e) in p.items()},
                compare=cmp, full=full, have=have), md, runs, cmp, user


if __name__ == '__main__':
    p = plan()
    print(f'bench.compute: {len(p)} settings x {seeds} seeds; iterations ' +
          ', '.join(f'{k} {n}' for k, (_, n, _) in p.items()) + f'; out={out}', flush=True)
    if run:
        train_all(p)
    res, md, runs, cmp, user = report(p)
    missing = sum(seeds - n for n in res['have'].values())
    note = [] if not missing else [f'**Incomplete**: {missing} of {seeds * len(p)} runs are not cached yet; rerun '
                                   '`python -m bench.compute` to go on.', '']
    md = md[:2] + note + md[2:]
    with open(os.path.join(out, 'compute.json'), 'w') as f:
        json.dump(res, f, indent=1)
    with open(os.path.join(out, 'compute.md'), 'w') as f:
        f.write('\n'.join(md) + '\n')
    plots(runs, cmp)
    # results/README.md section 7: the GPU-budget sentence first, then the table and its runs
    budget = (f'**How to spend a GPU budget** ([compute.md](compute.md)): train.py logs its transformer passes by kind '
              f'(`passes_*`) and `bench/fullsize.gpu_hours` prices them at full size ({full_iters:,} iterations, '
              f'{full_gpus} GPUs at an assumed {TFLOPS:.0f} TFLOP/s); the toy\'s verdict at equal passes against every '
              'step trained in brackets: ' + '; '.join(
                  f'{k} {f["days_run"]:.1f} days ({cmp.get(k, {}).get("verdict", "")})' for k, f in res['full'].items())
              + '.')
    C.put_block(os.path.join(out, 'README.md'), 'bench.compute', md[:2] + [budget, ''] + md[2:])
    for k, c in cmp.items():
        print(f'{k}: {c["verdict"]}')
    print(f'wrote {out}/compute.md, compute.json, compute.png, README.md section 7')
