"""
The dual trust region where it acts (docs/method.md section 5): Fig. 8's KL strategies (dual, moving, step-wise,
none) at the paper's lambda_KL and at two held strengths, decided by paired seeds on the toy.

    python -m bench.trust_region                        # every cell (~35 new runs of ~7 min on one idle core)
    python -m bench.trust_region --workers=2 --worker=1 # with --worker=0 beside it: 2 processes on 2 cores, each
                                                        # taking the next run the other has not claimed
    python -m bench.trust_region --run=False            # only the report, from the cells cached

The cells are bench.paper's (8 prompts x G=4, 60 iterations, an evaluation every 5; the same names and cache, so
its dual, moving and none cells at the paper's lambda are reused): `train.py config/toy.py` with lambda_KL either
the paper's schedule (1e-7 warming to 1e-5, the controller on) or held at a strength (kl_init = kl_min = kl_max,
no warm-up). 'none' has no KL term, so one 'none' cell serves every strength.

Two pairs are one run by construction at the defaults (one optimizer step per rollout batch, the exact velocity
KL): the old mean is this forward's own, detached, so the velocity term and its gradient are exactly 0, 'moving' is
'dual' and 'stepwise' is 'none', bitwise. So the strategies trained are dual and none (with moving at the paper's
lambda, bench.paper's cached cells, as the check: the report gives the largest difference of every pair cached);
the velocity term acts with the released one-sample estimate (kl_estimator 'sample': its gradient at theta_old is
the score at x_next, not 0), so 'dual + sample' against moving and 'stepwise + sample' against none are its cells,
queued after.

Why 0.1 and 1: at the paper's lambda the KL term's gradient is ~1e-6 of the policy term's and every strategy gives
the same run (results/paper.md, section 3). bench/toy.py section 3 (d) found the first strengths where the term is
measurable: at kl_max 0.1 and 1 (reached only ~15% of the way by the 100-step warm-up in its 15 iterations) the
4-pass ratio was ~1e-2 and ~4e-2. Held at 0.1 and 1 the region acts from the first step; the report gives each
cell's measured ratio.

Writes results/trust_region.md and .json: dual against none at each strength (bench.verdicts' paired protocol:
positive = the first is better), each strength's dual against the paper's, the identity of the pairs above, the
velocity term's cells where run, the alarm of every run; 'none' at lower learning rates with AdamW and Muon (the\ntrust region or a smaller step?) and the KL/policy ratio the optimizer sees (GradientSplit, ratio_every).
"""
import os
import sys

from bench import common as C
from bench.common import table
from infra.configurator import configure

_argv, sys.argv = sys.argv, sys.argv[:1]  # bench.verdicts and bench.paper read the command line when imported
from bench import paper as P  # noqa: E402  its cells, names, cache and statistics
from bench import verdicts as V  # noqa: E402
sys.argv = _argv

# ----------------------------------------------------------------------------- settings
out = 'results'          # cells/ (committed, bench.paper's), trust_region.md/.json
seeds = 5                # seeds 0..seeds-1 of every cell
strengths = '0.1,1.0'    # lambda_KL held at each (besides the paper's schedule)
worker = 0               # worker 0 also trains the ratio runs; every worker takes the next unclaimed run (claim)
workers = 1              # 2 cores -> 2 processes, each 1 thread (each claims its runs)
run = True               # False: only the report
threads = 1              # torch threads of every train.py
budget_min = 0.0         # start no new training run after this many minutes (0: no limit)
config = configure(globals(), sys.argv[1:])
# -----------------------------------------------------------------------------
STRATEGIES = ('dual', 'none', 'moving', 'dual + sample', 'stepwise + sample')  # trained (moving: at the paper's only)
SAME = {'moving': 'dual', 'stepwise': 'none'}  # one run by construction at the defaults (the docstring)
LAMS = [float(x) for x in strengths.split(',') if x.strip()]
PAPER = 'paper'  # the strength label of the paper's schedule
C.setup(out, threads, budget_min)


# the learning rates of 'none' (issue 67: the trust region or a smaller step?), each optimizer's toy default
# down to about a fifth of it, and dual held at 0.1 with each optimizer at its default
LRS = dict(adamw=(1e-4, 5e-5, 3e-5, 2e-5), muon=(3e-4, 1.5e-4, 1e-4, 6e-5))
DEFAULT_LR = dict(adamw=1e-4, muon=3e-4)  # config/toy.py's AdamW; Muon's best in results/README.md (f)
# the KL/policy ratio the optimizer sees (GradientSplit, every step) where the region acts: dual held at 0.1, and
# the ratio target's calibration (tests/test_kl_ratio.py's slow test): 20 iterations of bench.paper's cells
RATIO_RUNS = {'dual @ 0.1 (adamw 1e-4)': dict(kl_strategy='dual', kl_init=0.1, kl_min=0.1, kl_max=0.1, kl_warmup=0),
              'dual @ 0.1 (muon 3e-4)': dict(kl_strategy='dual', kl_init=0.1, kl_min=0.1, kl_max=0.1, kl_warmup=0,
                                             optimizer='muon', learning_rate=3e-4)}
RATIO_COMMON = dict(max_iters=30, prompts_per_iter=8, eval_every=0, save_every=0, export_dtype='', diag_every=0,
                    ratio_every=1, seed=0)


def ratio_cell(label):
    return 'tr_ratio_' + '_'.join(f'{k}-{v}' for k, v in sorted(RATIO_RUNS[label].items())) + '_p8_it30_s0'


# item 2's other cells: dual with lambda_KL held by the batch ratio's target (trust_region.py RatioHold, the
# ratio GradientSplit measures every step) with each optimizer at its default, and lambda 1 run to 120 iterations
RATIO_TARGET = 1.0      # the KL term's summed gradient as large as the policy term's (at 0.1: AdamW 1.16, Muon 0.64)
LONG_ITERS = 120


def extra_cells():
    """{label: overrides}: dual at the ratio target with each optimizer; dual @ 1 to LONG_ITERS iterations."""
    c = {}
    for opt in LRS:
        ov = dict(V.REF, kl_strategy='dual', kl_ratio_target=RATIO_TARGET, **held(0.1))  # from 0.1, then held
        if opt != 'adamw':
            ov.update(optimizer=opt, learning_rate=DEFAULT_LR[opt])
        c[f'dual @ ratio {RATIO_TARGET:g}, {opt} {lr_name(DEFAULT_LR[opt])}'] = ov
    c[f'dual @ 1, {LONG_ITERS} iterations'] = dict(V.REF, kl_strategy='dual', max_iters=LONG_ITERS, **held(1.0))
    return c


def ratio_cells():
    """The extra cells held by the ratio target (one an optimizer)."""
    return {k: ov for k, ov in extra_cells().items() if k.startswith('dual @ ratio')}


def lr_name(x):
    m, e = f'{x:e}'.split('e')
    return f'{float(m):g}e{int(e)}'  # 1e-4, 1.5e-4, 6e-5


def lr_cells():
    """{label: overrides} of the learning-rate question: 'none' at each optimizer's rates, dual held at 0.1 at
    each optimizer's default (AdamW 1e-4's 'none' and dual are the cells above: the same names)."""
    c = {}
    for opt, lrs in LRS.items():
        for lr in lrs:
            ov = dict(V.REF, kl_strategy='none')
            if (opt, lr) != ('adamw', 1e-4):
                ov.update(optimizer=opt, learning_rate=lr)
            c[f'none, {opt} {lr_name(lr)}'] = ov
        ov = dict(V.REF, **held(0.1))
        if opt != 'adamw':
            ov.update(optimizer=opt, learning_rate=DEFAULT_LR[opt])
        c[f'dual @ 0.1, {opt} {lr_name(DEFAULT_LR[opt])}'] = ov
    return c


def held(lam):
    return dict(kl_init=lam, kl_min=lam, kl_max=lam, kl_warmup=0)


def cells():
    """{(strategy, strength): train.py overrides}; strength PAPER or a float; 'none' once, as (none, PAPER)."""
    c = {('none', PAPER): dict(V.REF, kl_strategy='none'), ('moving', PAPER): dict(V.REF, kl_strategy='moving')}
    for lam in [PAPER] + LAMS:
        lam_ov = {} if lam == PAPER else held(lam)
        c[('dual', lam)] = dict(V.REF, kl_strategy='dual', **lam_ov)  # at PAPER: bench.verdicts' reference cell
        if lam != PAPER:
            c[('dual + sample', lam)] = dict(V.REF, kl_strategy='dual', kl_estimator='sample', **lam_ov)
            c[('stepwise + sample', lam)] = dict(V.REF, kl_strategy='stepwise', kl_estimator='sample', **lam_ov)
    return c


def label(key):
    st, lam = key
    return st if st == 'none' else f'{st} @ {"paper" if lam == PAPER else f"{lam:g}"}'


def todo(cs):
    """[(key, seed)]: dual at the first strength with 'none', seed-major; then the next strength's dual; then the
    velocity term's cells; then moving (the check that it is dual): a budget cut leaves the most informative
    comparison complete first."""
    order = [(k, s) for s in range(seeds) for k in (('none', PAPER), ('dual', LAMS[0]))]
    order += [(('dual', lam), s) for lam in LAMS[1:] for s in range(seeds)]
    order += [((st, lam), s) for lam in LAMS for s in range(seeds) for st in ('dual + sample', 'stepwise + sample')]
    return order + [(('moving', PAPER), s) for s in range(seeds)]  # last: dual's run by construction (the check)


def train_all(cs):
    common = dict(max_iters=P.iters, prompts_per_iter=P.prompts, eval_every=P.eval_every, save_every=0, eval_videos=0)
    # the learning-rate question first (issue 67's verdict), Muon's cells before AdamW's, seed-major: a budget cut
    # leaves every rate with the same seeds; then the strengths' and the velocity term's cells
    lr = sorted(lr_cells().values(), key=lambda ov: ov.get('optimizer', 'adamw') != 'muon')
    ratio_t = list(ratio_cells().values())
    long = [ov for k, ov in extra_cells().items() if k not in ratio_cells()]
    sample = [(cs[('dual + sample', LAMS[0])], s) for s in range(seeds)]  # the velocity term, where it acts
    jobs = ([(ov, s) for s in range(seeds) for ov in lr] + [(ov, s) for s in range(seeds) for ov in ratio_t] +
            sample + [(ov, s) for s in range(seeds) for ov in long] + [(cs[key], s) for key, s in todo(cs)])
    for ov, s in jobs:  # in this order; a worker takes the next run no other has claimed
        if C.over_budget():
            print(f'over the time budget of {budget_min} min: no new runs', flush=True)
            break
        if C.cached(P.name(ov, s)) is None and (workers == 1 or claim(P.name(ov, s))):
            C.train(P.name(ov, s), dict(common, **ov, seed=s))


def claim(name):
    """True if this process may train run `name`: it created the claim (OUT/runs/claims/name, the claimant's
    pid), or took it over from a claimant that is gone."""
    d = os.path.join(out, 'runs', 'claims')
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, name)
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)  # atomic: one creator
            os.write(fd, str(os.getpid()).encode())
            os.close(fd)
            return True
        except FileExistsError:
            try:
                os.kill(int(open(path).read() or 0), 0)  # raises if the claimant is gone
                return False
            except (ProcessLookupError, ValueError):
                os.remove(path)  # a dead claimant's: take it over
    return False


# ----------------------------------------------------------------------------- the report
METRICS = ('composite', 'VQ', 'MQ', 'TA', 'manifold')  # held-out, the mean of a run's late evaluations
SIGN = dict(composite=1, VQ=1, MQ=1, TA=1, manifold=-1)  # +1: higher is better


def late(run, m):
    return V.late(run, m)


def compare(runs, a, b, m):
    """a's paired advantage over b on m (positive = a is better) over the seeds both have."""
    ss = [s for s in range(seeds) if runs[a][s] and runs[b][s]]
    return V.paired([SIGN[m] * late(runs[a][s], m) for s in ss], [SIGN[m] * late(runs[b][s], m) for s in ss])


def ratio_of(run):
    """The mean KL/policy gradient ratio of a run: bench.toy's 4-pass one (diag_every, one clip's parameter
    gradients) and the cheap one at the transition means logged every iteration (kl_ratio_est), where logged."""
    mean = lambda xs: sum(xs) / len(xs) if xs else None
    return (mean([i['kl_grad_ratio'] for i in run['iters'] if 'kl_grad_ratio' in i]),
            mean([i['kl_ratio_est'] for i in run['iters'] if 'kl_ratio_est' in i]))


def alarm(nm, run):
    return P.alarm_of(nm, run)


def report(cs):
    # bench.paper's rerun_ of a cell is the same run trained again by the current code (its dual @ paper cells were
    # first trained when the update still took the old log-prob from the rollout): the current code's run first
    runs = {k: [C.cached('rerun_' + P.name(ov, s)) or C.cached(P.name(ov, s)) for s in range(seeds)]
            for k, ov in cs.items()}
    strengths = [PAPER] + LAMS
    fmt = lambda x, p=3: '-' if x is None else (f'{x:.1e}' if p == 'e' else f'{x:.{p}f}')
    mean = lambda xs: sum(xs) / len(xs) if xs else None
    base = [r['evals'][0] for rs in runs.values() for r in rs if r]  # iteration 0: the base model
    base_vals = {m: mean([e[m] for e in base]) for m in METRICS}
    res = dict(config=config, base=base_vals, cells={}, verdicts={}, fig8={}, recipe={})
    md = ['# The dual trust region where it acts (`python -m bench.trust_region`)', '',
          f'`train.py config/toy.py`, {P.prompts} prompts x G=4 an iteration, {P.iters} iterations, seeds 0..{seeds - 1} '
          f'(bench.paper\'s cells: runs that share a seed share prompts and noises); held-out ODE evaluation every '
          f'{P.eval_every} iterations, a run\'s value the mean of its evaluations at iterations {P.iters - P.late_iters}..{P.iters}. '
          'lambda_KL: the paper\'s schedule (1e-7 warming to 1e-5, its controller) or held at a strength. '
          f'The base model (iteration 0): composite {base_vals["composite"]:.3f}, VQ {base_vals["VQ"]:.3f}, '
          f'manifold distance {base_vals["manifold"]:.4f}.', '']
    rows = []
    for k, rs in runs.items():
        ok = [r for r in rs if r]
        vals = {m: mean([late(r, m) for r in ok]) for m in METRICS}
        diag, est = (mean([x for x in xs if x is not None]) for xs in zip(*[ratio_of(r) for r in ok])) if ok else (None, None)
        al = [alarm(P.name(cs[k], s), r) if r else None for s, r in enumerate(rs)]
        tripped = [a for a in al if isinstance(a, dict)]
        recorded = [a for a in al if a is not None and a != 'not recorded']
        train = {t: mean([mean([i[t] for i in r['iters'][-10:]]) if t == 'reward' else mean([i[t] for i in r['iters']])
                          for r in ok]) for t in ('reward', 'group_std', 'kl_pos')}  # the training run's own
        res['cells'][label(k)] = dict(overrides=cs[k], n=len(ok), kl_grad_ratio=diag, kl_ratio_est=est,
                                      alarm=al, train=train, **vals)
        rows.append([label(k), len(ok) or 'not run'] + [fmt(vals[m], 4 if m == 'manifold' else 3) for m in METRICS] +
                    [fmt(train['reward']), fmt(train['group_std']), fmt(train['kl_pos'], 'e'),
                     fmt(diag, 'e'), f'{len(tripped)}/{len(recorded)}' if recorded else '-',
                     '; '.join(f's{s}: {P.alarm_text(a)}' for s, a in enumerate(al) if isinstance(a, dict)) or '-'])
    md += ['**Every cell** (mean over its seeds; held-out: composite to manifold; training: the reward of the last 10 '
           'iterations, the within-group reward std and the position KL over the run; KL/policy: the 4-pass gradient ratio '
           'of one clip, every 3rd iteration; alarm: runs whose reward-hacking alarm tripped / runs with it recorded):', '',
           table(['cell', 'seeds', 'composite', 'VQ', 'MQ', 'TA', 'manifold', 'train reward', 'group std', 'KL pos',
                  'KL/policy', 'alarm', 'where it tripped'], rows), '']
    md += identity(runs, res)
    for lam in strengths:
        pairs = [(('dual', lam), ('none', PAPER))]  # Fig. 8 at the defaults: dual (= moving) vs none (= stepwise)
        if lam != PAPER:  # the velocity term, acting under the released estimator
            pairs += [(('dual + sample', lam), ('dual', lam)), (('stepwise + sample', lam), ('none', PAPER))]
        rows, found = [], {}
        for a, b in pairs:
            cis = {m: compare(runs, a, b, m) for m in METRICS}
            found[(a, b)] = cis
            rows.append([label(a), label(b), cis['composite']['n']] + [P.shown(cis[m], m) for m in METRICS])
        res['verdicts'][str(lam)] = {f'{label(a)} vs {label(b)}': {m: dict(ci, verdict=V.verdict(ci)) for m, ci in v.items()}
                                     for (a, b), v in found.items()}
        ci = found[pairs[0]]['composite']
        decided = {'holds': 'dual beats none', 'fails': 'none beats dual'}.get(V.verdict(ci), V.verdict(ci))
        res['fig8'][str(lam)] = V.verdict(ci)
        name = 'the paper\'s schedule' if lam == PAPER else f'lambda_KL held at {lam:g}'
        md += [f'## {name}', '', 'Each row: the first cell\'s paired advantage over the second (positive = the first is better: '
               'higher composite, VQ, MQ, TA; lower manifold distance), mean and 95% t interval over the seeds.', '',
               table(['cell', 'vs', 'seeds'] + [f'Δ {m} [95%]' for m in METRICS], rows), '',
               f'**Fig. 8\'s claim** (dual beats moving and no KL, held-out composite) at {name}: against moving the same '
               f'run (above); against none **{decided}** ({V.fmt(ci)}, {ci["n"]} paired seeds).', '']
    # the recipe: a strength that beats the paper's lambda with VQ and the manifold at least the base's
    md += ['## Against the paper\'s lambda (the recipe)', '',
           'Each strength\'s dual cell against dual at the paper\'s schedule (positive = the strength is better); '
           'and whether it ends with VQ and manifold distance at least as good as the base model\'s.', '']
    rows = []
    for lam in LAMS:
        a, b = ('dual', lam), ('dual', PAPER)
        cis = {m: compare(runs, a, b, m) for m in METRICS}
        cell = res['cells'][label(a)]
        keeps = cell['n'] and cell['VQ'] >= base_vals['VQ'] and cell['manifold'] <= base_vals['manifold']
        res['recipe'][str(lam)] = dict(vs_paper={m: dict(ci, verdict=V.verdict(ci)) for m, ci in cis.items()},
                                       keeps_base_quality=bool(keeps))
        rows.append([label(a), cis['composite']['n']] + [P.shown(cis[m], m) for m in METRICS] +
                    ['yes' if keeps else 'no' if cell['n'] else '-'])
    md += [table(['cell', 'seeds'] + [f'Δ {m} vs dual @ paper' for m in METRICS] + ['VQ, manifold >= base'], rows), '']
    md += watchers(res, runs)
    md += lr_section(res)
    md += long_section(res)
    md += ratio_section(res)
    return res, md


WATCHED = ('saturation', 'brightness', 'edges', 'flicker')  # frame watchers (the cells' entropy: 4 levels, now 5)


def watchers(res, runs):
    """The alarm's frame watchers at a run's last evaluation against the base model's and the clean renders'
    (the data): a watcher the alarm names may be moving toward the data (the base is off it) or past it."""
    import torch
    from models import evaluate, toy
    prompts = [p for p in toy.all_prompts() if toy.is_eval_prompt(p) for _ in range(toy.EVAL_SEEDS)]
    clean = evaluate.frame_stats(torch.stack([toy.render(p, i) for i, p in enumerate(prompts)]))
    data = {k: clean[k].mean().item() for k in WATCHED}
    rows, out = [['clean renders (the data)'] + [f'{data[k]:.4f}' for k in WATCHED]], dict(data=data)
    base = [r['evals'][0] for rs in runs.values() for r in rs if r]
    out['base'] = {k: sum(e[k] for e in base) / len(base) for k in WATCHED}
    rows.append(['the base model (iteration 0)'] + [f'{out["base"][k]:.4f}' for k in WATCHED])
    for k, rs in runs.items():
        ok = [r for r in rs if r]
        if ok and k[0] in ('dual', 'none'):
            out[label(k)] = {m: sum(r['evals'][-1][m] for r in ok) / len(ok) for m in WATCHED}
            rows.append([f'{label(k)}, iteration {P.iters} ({len(ok)} seeds)'] + [f'{out[label(k)][m]:.4f}' for m in WATCHED])
    res['watchers'] = out
    return ['## What the alarm watches, against the data', '',
            'The alarm compares each evaluation with the base model\'s; the base model is not the data. The watchers '
            'at the last evaluation (mean over seeds), beside the base model\'s and the clean renders\' of the same '
            'held-out prompts:', '', table(['', *WATCHED], rows), '']


def identity(runs, res):
    """The pairs that are one run by construction (SAME): the largest difference of any logged training figure
    and held-out metric over every seed where both cells are cached."""
    lines = []
    for (a, lam) in [k for k in runs if k[0] in SAME]:
        b = (SAME[a], lam)
        if b not in runs:
            continue
        both = [(x, y) for x, y in zip(runs[(a, lam)], runs[b]) if x and y]
        # a pair whose first rollout (iteration 0, before any step) differs was trained by different code
        drift = [s for s, (x, y) in enumerate(zip(runs[(a, lam)], runs[b]))
                 if x and y and x['iters'][0]['reward'] != y['iters'][0]['reward']]
        both = [(x, y) for x, y in both if x['iters'][0]['reward'] == y['iters'][0]['reward']]
        if drift:
            lines.append(f'- {label((a, lam))} vs {label(b)}: seeds {", ".join(map(str, drift))} left out: their '
                         'first rollouts differ already (iteration 0: nothing of the strategy acts before the first '
                         'step), so the two were trained by different versions of the code or machine.')
        if not both:
            continue
        keys = ('reward', 'VQ', 'MQ', 'TA', 'loss', 'kl_pos', 'kl_vel', 'grad_norm')
        d = max(max(abs(i[k] - j[k]) for i, j in zip(x['iters'], y['iters']) for k in keys if k in i and k in j)
                for x, y in both)
        e = max(max(abs(i[m] - j[m]) for i, j in zip(x['evals'], y['evals']) for m in METRICS) for x, y in both)
        res.setdefault('identity', {})[f'{label((a, lam))} vs {label(b)}'] = dict(seeds=len(both), iters=d, evals=e)
        lines.append(f'- {label((a, lam))} vs {label(b)}: {len(both)} seeds, largest difference of a logged training '
                     f'figure {d:.1e}, of a held-out metric {e:.1e}.')
    return ['## The pairs that are one run', '', 'At one optimizer step per rollout batch with the exact velocity KL, '
            'the velocity term and its gradient are exactly 0 (the old mean is the forward\'s own, detached): moving is '
            'dual\'s run and step-wise none\'s. Where both cells are cached:', ''] + (lines or ['- none cached yet']) + ['']


def ratio_section(res):
    """The KL/policy ratio the optimizer sees (GradientSplit: the norms of the step's summed KL-term and
    policy-term gradients, every step) in short runs where the region acts, and how well kl_ratio_target held."""
    rows, out = [], {}
    for label in RATIO_RUNS:
        run = C.cached(ratio_cell(label))
        if run is None:
            rows.append([label, 'not run', '-', '-', '-'])
            continue
        r = [i['kl_ratio'] for i in run['iters'] if 'kl_ratio' in i]
        lam = [i['lambda_kl'] for i in run['iters']]
        out[label] = dict(mean=sum(r) / len(r), last_period=sum(r[-10:]) / len(r[-10:]), lambda_last=lam[-1],
                          first_period=sum(r[:10]) / len(r[:10]))
        rows.append([label, f'{out[label]["first_period"]:.3f}', f'{out[label]["last_period"]:.3f}',
                     f'{out[label]["mean"]:.3f}', f'{lam[-1]:.3g}'])
    res['ratio'] = out
    return ['## The ratio the optimizer sees', '',
            f'`train.py config/toy.py` {RATIO_COMMON["max_iters"]} iterations of {RATIO_COMMON["prompts_per_iter"]} '
            'prompts, `ratio_every=1`: the KL term\'s summed gradient over the policy term\'s, in parameter space after '
            'the ranks\' reduction (extras/diagnostics.py GradientSplit; tests/test_kl_ratio.py checks it against the '
            'brute-force summed gradients). Mean over the first and the last anchor period (10 steps) and the run; '
            'lambda_KL at the end:', '',
            table(['run', 'ratio, iterations 1-10', 'ratio, last 10', 'ratio, mean', 'lambda_KL at the end'], rows), '']


def lr_section(res):
    """Does dual beat the best 'none' at any learning rate, with VQ and the manifold distance held?"""
    ratio_t = ratio_cells()
    cs = lr_cells() | ratio_t
    runs = {k: [C.cached(P.name(ov, s)) for s in range(seeds)] for k, ov in cs.items()}
    mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
    rows, cells = [], {}
    for k, rs in runs.items():
        ok = [r for r in rs if r]
        cells[k] = dict(n=len(ok), **{m: mean([late(r, m) for r in ok]) for m in METRICS})
        cis = {m: V.paired([late(r, m) for r in ok], [0.0] * len(ok)) for m in METRICS}  # the mean's 95% t interval
        cells[k]['ci'] = {m: [c['lo'], c['hi']] for m, c in cis.items()}
        if k in ratio_t and ok:  # the batch ratio it held (GradientSplit every step) and lambda_KL at the end
            cells[k]['kl_ratio'] = mean([mean([i['kl_ratio'] for i in r['iters'][-10:]]) for r in ok])
            cells[k]['lambda_end'] = mean([r['iters'][-1]['lambda_kl'] for r in ok])
        rows.append([k, len(ok) or 'not run'] + [('-' if cells[k][m] is None else
                                                  f'{cells[k][m]:.{4 if m == "manifold" else 3}f}' +
                                                  (f' ±{(cis[m]["hi"] - cis[m]["lo"]) / 2:.{4 if m == "manifold" else 3}f}'
                                                   if len(ok) > 1 else '')) for m in METRICS])
    md = ['## The trust region or a smaller step', '',
          '\'none\' at each optimizer\'s learning rates (its toy default down to about a fifth) beside dual with lambda_KL '
          'held at 0.1 at the default; bench.paper\'s cells, 60 iterations of 8 prompts x G=4, a run\'s value the mean of '
          'its evaluations at iterations 40..60; a cell: the mean over its seeds ± the 95% t interval\'s half-width:', '',
          table(['cell', 'seeds'] + list(METRICS), rows), '']
    verdicts = {}
    for opt in LRS:
        dual = f'dual @ 0.1, {opt} {lr_name(DEFAULT_LR[opt])}'
        nones = [k for k in cs if k.startswith(f'none, {opt} ') and cells[k]['n'] >= 2]
        if not nones or cells[dual]['n'] < 2:
            md += [f'**{opt}**: not enough runs yet (dual {cells[dual]["n"]} seeds, none at ' +
                   ', '.join(f'{k.split()[-1]}: {cells[k]["n"]}' for k in cs if k.startswith(f'none, {opt} ')) + ').', '']
            continue
        enough = min(3, max(cells[k]['n'] for k in nones))  # the best: the highest composite of 3 seeds or more
        best = max([k for k in nones if cells[k]['n'] >= enough], key=lambda k: cells[k]['composite'])
        rows = []
        tgt = next(k for k in ratio_t if k.split(', ')[1].startswith(opt))
        # dual against each 'none'; the ratio target against the best 'none' and against 0.1 (where run)
        for a, b in [(dual, k) for k in nones] + [(tgt, best), (tgt, dual)]:
            cis = {m: compare(runs, a, b, m) for m in METRICS}
            if a == tgt and cis['composite']['n'] < 2:
                continue
            verdicts[f'{a} vs {b}'] = {m: dict(ci, verdict=V.verdict(ci)) for m, ci in cis.items()}
            rows.append([a, b + (' (the best none)' if b == best else ''), cis['composite']['n']] +
                        [P.shown(cis[m], m) for m in METRICS])
        v = verdicts[f'{dual} vs {best}']
        wins = v['composite']['verdict'] == 'holds'
        held_q = all(v[m]['verdict'] != 'fails' for m in ('VQ', 'manifold'))
        res.setdefault('lr_verdict', {})[opt] = dict(dual=dual, best_none=best, composite=v['composite'],
                                                      VQ=v['VQ'], manifold=v['manifold'], dual_wins=bool(wins and held_q))
        md += [f'**{opt}**: dual against each \'none\' (positive = dual is better), paired seeds:', '',
               table(['cell', 'vs', 'seeds'] + [f'Δ {m} [95%]' for m in METRICS], rows), '',
               f'Against the best \'none\' ({best}, mean composite {cells[best]["composite"]:.3f}): dual '
               + ('**beats it**' if wins else '**does not beat it**') + f' ({V.fmt(v["composite"])}, '
               f'{v["composite"]["n"]} seeds), VQ {V.fmt(v["VQ"])}, manifold {V.fmt(v["manifold"], 4)} '
               + ('(both held).' if held_q else '(not both held).'), '']
    held = [f'{k}: batch ratio {c["kl_ratio"]:.2f} over the last 10 iterations, lambda_KL {c["lambda_end"]:.3g} at the end '
            f'({c["n"]} seeds)' for k, c in cells.items() if 'kl_ratio' in c]
    if held:
        md += [f'The ratio target (`kl_ratio_target={RATIO_TARGET:g}`, lambda_KL from 0.1, then target / the mean '
               'measured ratio at lambda 1 over an anchor period): ' + '; '.join(held) + '.', '']
    res['lr_cells'], res['lr_verdicts'] = cells, verdicts
    return md


def long_section(res):
    """lambda 1 run to LONG_ITERS iterations: does it keep climbing past 60, and past dual @ 0.1?"""
    key = f'dual @ 1, {LONG_ITERS} iterations'
    long = [C.cached(P.name(extra_cells()[key], s)) for s in range(seeds)]
    others = {k: [C.cached(P.name(ov, s)) for s in range(seeds)] for k, ov in
              (('dual @ 0.1', cells()[('dual', 0.1)]), ('none', cells()[('none', PAPER)]))}
    win = lambda r, a, b, m: SIGN[m] * sum(e[m] for e in r['evals'] if a <= e['iter'] <= b) / \
        sum(1 for e in r['evals'] if a <= e['iter'] <= b)  # noqa: E731  the mean of m over evaluations a..b
    md = ['## lambda_KL 1 to 120 iterations', '']
    ok = [s for s in range(seeds) if long[s]]
    if len(ok) < 2:
        return md + [f'Not run yet ({len(ok)} of {seeds} seeds).', '']
    rows, out = [], {}
    late_w, early_w = (LONG_ITERS - P.late_iters, LONG_ITERS), (P.iters - P.late_iters, P.iters)
    for name, a_runs, a_w, b_runs, b_w in (
            (f'dual @ 1, iterations {late_w[0]}..{late_w[1]} vs its own {early_w[0]}..{early_w[1]}', long, late_w, long, early_w),
            (f'dual @ 1, iterations {late_w[0]}..{late_w[1]} vs dual @ 0.1 at {early_w[0]}..{early_w[1]}', long, late_w,
             others['dual @ 0.1'], early_w),
            (f'dual @ 1, iterations {late_w[0]}..{late_w[1]} vs none at {early_w[0]}..{early_w[1]}', long, late_w,
             others['none'], early_w)):
        ss = [s for s in range(seeds) if a_runs[s] and b_runs[s]]
        cis = {m: V.paired([win(a_runs[s], *a_w, m) for s in ss], [win(b_runs[s], *b_w, m) for s in ss])
               for m in ('composite', 'VQ', 'manifold')}
        out[name] = {m: dict(ci, verdict=V.verdict(ci)) for m, ci in cis.items()}
        rows.append([name, cis['composite']['n']] + [P.shown(ci, m) for m, ci in cis.items()])
    curve = [sum(e['composite'] for r in (long[s] for s in ok) for e in r['evals'] if e['iter'] == it) / len(ok)
             for it in range(0, LONG_ITERS + 1, 20)]
    res['long'] = dict(pairs=out, curve=dict(zip(range(0, LONG_ITERS + 1, 20), curve)))
    return md + [f'`dual` with lambda_KL held at 1, {LONG_ITERS} iterations (otherwise bench.paper\'s cells). Its mean '
                 'held-out composite over the seeds at iterations ' +
                 ', '.join(f'{it}: {c:.3f}' for it, c in res['long']['curve'].items()) + '. Paired (positive = the first '
                 'is better; lower manifold distance), the mean of the evaluations in each window:', '',
                 table(['comparison', 'seeds', 'Δ composite [95%]', 'Δ VQ [95%]', 'Δ manifold [95%]'], rows), '']


def readme_lines(res):
    """The README's line: the verdict of the trust region against a smaller step, and what the paper's lambda does."""
    paper = res['verdicts'][str(PAPER)]
    ci_paper = next(iter(paper.values()))['composite']
    parts = []
    for opt, v in res.get('lr_verdict', {}).items():
        word = 'beats' if v['dual_wins'] else 'does not beat'
        seeds = ', '.join(f'{lr_name(lr)} ({res["lr_cells"][f"none, {opt} {lr_name(lr)}"]["n"]})'
                          for lr in LRS[opt])
        parts.append(f'with {opt}, dual held at 0.1 {word} the best \'none\' over learning rates (seeds) {seeds} '
                     f'({v["best_none"].split(", ")[1]}: Δ composite '
                     f'{V.fmt(v["composite"])} over {v["composite"]["n"]} seeds, VQ {V.fmt(v["VQ"])}, manifold '
                     f'distance lower by {V.fmt(v["manifold"], 4)})')
    parts += [f'{opt}: not run yet' for opt in LRS if opt not in res.get('lr_verdict', {})]
    tv = res.get('lr_verdicts', {})
    held = [(k, v) for k, v in tv.items() if k.startswith('dual @ ratio') and ' vs none' in k]
    if held:  # the ratio target against each optimizer's best 'none'
        parts.append('held at the batch ratio ' + f'{RATIO_TARGET:g} instead: ' + '; '.join(
            f'{k.split(" vs ")[0].split(", ")[1]} Δ composite {V.fmt(v["composite"])} ({v["composite"]["verdict"]}), '
            f'VQ {V.fmt(v["VQ"])}, manifold {V.fmt(v["manifold"], 4)}' for k, v in held))
    ratio = res.get('ratio', {})
    r = '; '.join(f'{k} {v["mean"]:.2f}' for k, v in ratio.items() if k.startswith('dual'))
    return [f'- *The trust region or a smaller step* (`python -m bench.trust_region`, paired seeds, 60 iterations of 8 '
            f'prompts): {"; ".join(parts) or "not run yet"}. At the paper\'s lambda_KL it does not act (Δ composite '
            f'{V.fmt(ci_paper)} against none). The KL/policy ratio the optimizer sees at 0.1 (summed gradients, '
            f'GradientSplit): {r or "not measured yet"}. [results/trust_region.md](results/trust_region.md), '
            'docs/method.md 5.6.']


if __name__ == '__main__':
    cs = cells()
    n_new = sum(C.cached(P.name(ov, s)) is None for ov in cs.values() for s in range(seeds))
    print(f'bench.trust_region: {len(cs)} cells x {seeds} seeds ({n_new} runs not cached); out={out}', flush=True)
    if run:
        if worker == 0:
            for lab, ov in RATIO_RUNS.items():
                C.train(ratio_cell(lab), dict(RATIO_COMMON, **ov))
        train_all(cs)
    res, md = report(cs)
    missing = sum(r is None for ov in cs.values() for r in [C.cached(P.name(ov, s)) for s in range(seeds)])
    if missing:
        md[2:2] = [f'**Incomplete**: {missing} of {seeds * len(cs)} runs are not cached yet; rerun '
                   '`python -m bench.trust_region` to go on.', '']
    C.write_report(os.path.join(out, 'trust_region'), res, md)
    if out == 'results':
        C.put_block('README.md', 'bench.trust_region', readme_lines(res))
        C.put_block(os.path.join(out, 'README.md'), 'bench.trust_region',  # the figures the README quotes, kept here too
                    ['## 12. The trust region where it acts (`python -m bench.trust_region`)', ''] + readme_lines(res))
