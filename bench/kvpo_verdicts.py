"""
KVPO decided on the distilled streaming toy (streaming/toy_sf.py: the released 4-step sampler): against GRPO with
a SAGE SDE on the same model and against the untrained model, paired by seed, at the toy's learning rate and at
the released one. First the control every verdict rests on: each method's real advantages against the same run
with each group's advantages permuted at random (`--adv_shuffle=True`: the same advantage values, gate and
statistics, no assignment of reward to clips). A method whose real advantages do not raise its own training reward
above its shuffled control's is not learning from the reward at that batch, and its held-out verdict says nothing
about the method.

Every run: `python -m kvpo.train kvpo/config/toy.py kvpo/config/toy_sf.py` or `python -m kvpo.grpo_ar
kvpo/config/grpo_toy.py kvpo/config/grpo_toy_sf.py`
with `--seed=s` (the same prompts an iteration, initial noises and held-out items in every run of a seed), 4
prompts x K = G = 6 an iteration, 30 iterations, EMA 0.9, held-out every 10 (16 prompts x 1 seed, the EMA
weights, the model's own 4-step sampler). Per cell and seed: the training reward (the rollouts' mean composite,
the last `tail` iterations: the same prompts and noises in a pair, so paired iteration by iteration), KVPO's
anchor (the unrouted policy's own sample), the held-out composite, VQ, MQ, TA, manifold distance and entropy at
the end, the alarm. The untrained model is the evaluation at iteration 0 (identical in every run of a seed).
Then issue 58's suspects for KVPO lowering the toy, each removed in a KVPO run at the toy's lr 1e-4 (SUSPECTS),
against KVPO and its shuffled control (bench/kvpo_signal.py measures the same suspects without training).

    python -m bench.kvpo_verdicts                       # every run, one process (~2 h on one thread)
    python -m bench.kvpo_verdicts --workers=2 --worker=0   # with --worker=1 beside it: 2 cores
    python -m bench.kvpo_verdicts --run=False           # only the report: results/kvpo_verdicts.md/.json
    python -m bench.kvpo_verdicts --model=assets/toy_sf/ode_init --lrs="('1e-4',)"   # its stage 1: ..._ode_init.md
    python -m bench.kvpo_verdicts --prompts_per_iter=16 --methods="('KVPO',)" --seeds=3 --lrs="('1e-4',)"  # ..._b16.md

Runs live in results/runs/kvpo_verdicts_sf/ (not committed); a run whose final evaluation is there is not rerun.
The AR toy's verdicts of the previous round are in git history (results/kvpo_verdicts.md before this file).
Tested by: running it (the numbers are in results/kvpo_verdicts.md); the control's switch by
tests/test_kvpo_controls.py.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import time

from bench.common import put_block, table, write_report
from infra.configurator import configure

_argv, sys.argv = sys.argv, sys.argv[:1]  # bench.verdicts reads the command line when imported: not ours
from bench.verdicts import fmt, paired, verdict  # noqa: E402  the paired-seed statistics
sys.argv = _argv

seeds = 5                       # seeds 0..seeds-1 of every cell
iters = 30                      # iterations of every run
eval_every = 10                 # held-out evaluations
tail = 10                       # the training reward of a run's end: its last `tail` iterations
prompts_per_iter = 4            # the batch: prompts an iteration (x K = G = 6 clips)
lrs = ('1e-4', '1e-5')          # the toy's learning rate, then the released one
model = ''                      # '' the configs' (assets/toy_sf); another: its runs and report tagged by its folder
world = 'sf'                    # 'sf': the distilled toy | 'story': the story toy (kvpo/config/toy_story.py), its
                                # held-out the stories (eval_story_*), runs and report tagged _story
methods = ('KVPO', 'GRPO-SDE')  # the methods run (the three-way verdicts need both)
workers, worker = 1, 0          # run every workers-th run from the worker-th (one process a core)
run = True                      # False: only the report
RUNS, OUT = 'results/runs/kvpo_verdicts_sf', 'results/kvpo_verdicts'
WORLDS = dict(sf=('toy_sf.py', 'grpo_toy_sf.py', 'assets/toy_sf', 'the distilled streaming toy'),
              story=('toy_story.py', 'grpo_toy_story.py', 'assets/toy_story', 'the story toy'))


def methods_of(w):
    kv, grpo = WORLDS[w][:2]
    return {'KVPO': ['-m', 'kvpo.train', 'kvpo/config/toy.py', f'kvpo/config/{kv}'],
            'GRPO-SDE': ['-m', 'kvpo.grpo_ar', 'kvpo/config/grpo_toy.py', f'kvpo/config/{grpo}']}


METHODS = methods_of('sf')
SUSPECTS = {  # issue 58's suspects for KVPO lowering the toy, each removed in a KVPO run at the toy's lr
    'forks 6-7 only (pool >= 4: no identical branches)': ['--fork_min=6'],
    'no second normalisation (A, not A / std(A))': ['--fuse_std=False'],
    'velocity-space TVE (weight 1 / 2 sigma^2)': ['--score_form=velocity']}
suspects = True                 # run and report them (after the main cells; at SUSPECT_LR, batch 4, the configs' model)
SUSPECT_LR = '1e-4'                # the toy's lr: where KVPO moves
METRICS = dict(composite=1, VQ=1, MQ=1, TA=1, manifold=-1, entropy=1)  # +1: higher is better, -1: lower


def cell(m, lr, shuffled):
    return f'{m} lr {lr}' + (', shuffled' if shuffled else '')


def model_tag():
    return ('_' + os.path.basename(model.rstrip('/')) if model else '') + ('' if world == 'sf' else f'_{world}')


def held_out(r, k):
    """Held-out metric k of a metrics row: the story world's stories (eval_story_k) where logged, else eval_k."""
    return r.get(f'eval_story_{k}', r[f'eval_{k}']) if world == 'story' else r[f'eval_{k}']


def tag():
    """The report's suffix: the model's folder where not the configs', the batch where not 4, the methods where not
    both (the README's block and the suspects belong to the untagged report alone)."""
    return (model_tag() + (f'_b{prompts_per_iter}' if prompts_per_iter != 4 else '')
            + ('' if tuple(methods) == tuple(METHODS) else '_' + '_'.join(methods)))


def name(c, s):
    return f'{re.sub(r"[^A-Za-z0-9.-]+", "_", c).strip("_")}_b{prompts_per_iter}{model_tag()}_s{s}'


def rows_of(c, s):
    path = os.path.join(RUNS, name(c, s), 'metrics.jsonl')
    return [json.loads(line) for line in open(path)] if os.path.exists(path) else []


def done(c, s):
    return any(r['iter'] == iters and 'eval_composite' in r for r in rows_of(c, s))


def train(m, lr, shuffled, s, extra=(), c=None):
    c = c or cell(m, lr, shuffled)
    if done(c, s):
        return
    d = os.path.join(RUNS, name(c, s))
    shutil.rmtree(d, ignore_errors=True)
    t0 = time.time()
    p = subprocess.run([sys.executable] + METHODS[m] + [
        f'--seed={s}', f'--out_dir={d}', f'--max_iters={iters}', f'--eval_every={eval_every}', '--save_every=0',
        f'--learning_rate={lr}', f'--prompts_per_iter={prompts_per_iter}', f'--adv_shuffle={shuffled}']
        + ([f'--model={model}'] if model else []) + list(extra),
        capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS='1'))
    with open(os.path.join(d, 'log.txt'), 'w') as f:
        f.write(p.stdout[-20000:] + p.stderr[-20000:])
    if p.returncode:
        raise RuntimeError(f'{c} seed {s} failed:\n{p.stderr[-3000:]}')
    shutil.rmtree(os.path.join(d, 'ckpt'), ignore_errors=True)
    print(f'{c} seed {s}: {time.time() - t0:.0f}s', flush=True)


def summary(c, s):
    """A finished run's held-out evaluations {iter: {metric: value}}, its training rewards an iteration (and KVPO's
    anchor's), the alarm and its seconds an iteration."""
    rs = rows_of(c, s)
    its = [r for r in rs if 'loss' in r]
    return dict(evals={r['iter']: {k: held_out(r, k) for k in METRICS} for r in rs if 'eval_composite' in r},
                reward=[r['reward'] for r in its], anchor=[r['anchor_local'] for r in its if 'anchor_local' in r],
                alarm=sorted({k for r in rs for k in r.get('alarm', [])}),
                sec=sum(r['t_rollout'] + r['t_update'] for r in its) / len(its))


def mean(xs):
    return sum(xs) / len(xs) if xs else float('nan')


def report():
    runs = {cell(m, lr, sh): {s: summary(cell(m, lr, sh), s) for s in range(seeds) if done(cell(m, lr, sh), s)}
            for lr in lrs for m in methods for sh in (False, True)}
    res = dict(config=dict(seeds=seeds, iters=iters, eval_every=eval_every, tail=tail,
                           prompts_per_iter=prompts_per_iter, lrs=lrs), control={}, held_out={}, runs={})
    kv, grpo, default, title = WORLDS[world]
    md = [f'## KVPO decided on {title}: the shuffled control first, then the verdicts', '',
          'Written by `python -m bench.kvpo_verdicts' + (f' --world={world}`' if world != 'sf' else '`') +
          f' ({iters} iterations a run, one CPU thread a run): '
          f'`python -m kvpo.train kvpo/config/toy.py kvpo/config/{kv}` and `python -m kvpo.grpo_ar '
          f'kvpo/config/grpo_toy.py kvpo/config/{grpo}` '
          f'with `--seed=s`, {prompts_per_iter} prompts x K = G = 6 an iteration, on `{model or default}` (the released '
          '4-step sampler; KVPO routes, GRPO-SDE injects SAGE noise in its 4 steps and trains 2), EMA 0.9, '
          + ('held-out: the 16 held-out captions\' stories x 1 seed (eval_story_*: the whole video against its story, '
             'the training\'s reward; the colour entropy of the 16 held-out 9-frame clips), ' if world == 'story'
             else 'held-out: 16 prompts x 1 seed, ') +
          'the EMA weights, the model\'s own sampler. "shuffled": '
          '`--adv_shuffle=True`, each group\'s advantages permuted at random (the same advantage values and gate, '
          'no assignment of reward to clips).', '',
          f'### 1. The control: real advantages vs shuffled, paired by seed (training reward: the rollouts\' mean '
          f'composite over the last {tail} iterations, the same prompts and noises in a pair)', '']
    rows = []
    for lr in lrs:
        for m in methods:
            real, shuf = runs[cell(m, lr, False)], runs[cell(m, lr, True)]
            ss = sorted(set(real) & set(shuf))
            if not ss:
                continue
            ci = {k: paired([mean(real[s][k][-tail:]) for s in ss], [mean(shuf[s][k][-tail:]) for s in ss])
                  for k in ('reward', 'anchor') if all(real[s][k] for s in ss)}
            ci['held-out'] = paired([real[s]['evals'][iters]['composite'] for s in ss],
                                    [shuf[s]['evals'][iters]['composite'] for s in ss])
            res['control'][f'{m} lr {lr}'] = ci
            first = [mean([mean(r[s]['reward'][:tail]) for s in ss]) for r in (real, shuf)]
            rows.append([m, lr, len(ss), f'{first[0]:.3f} / {first[1]:.3f}', f'{mean([mean(real[s]["reward"][-tail:]) for s in ss]):.3f}',
                         f'{mean([mean(shuf[s]["reward"][-tail:]) for s in ss]):.3f}',
                         f'{fmt(ci["reward"])} **{verdict(ci["reward"])}**',
                         f'{fmt(ci["anchor"])} {verdict(ci["anchor"])}' if 'anchor' in ci else '-',
                         f'{fmt(ci["held-out"])} {verdict(ci["held-out"])}'])
    md += [table(['method', 'lr', 'seeds', f'training reward, first {tail} (real / shuffled)', f'last {tail}, real',
                  f'last {tail}, shuffled', 'Δ real - shuffled', 'Δ anchor (KVPO: the unrouted sample)',
                  'Δ held-out composite'], rows), '']
    learns = {k: verdict(v['reward']) == 'holds' for k, v in res['control'].items()}
    md += ['A method learns from the reward at this batch where Δ real - shuffled holds: ' + '; '.join(
        f'{k}: **{"learns" if v else "does not beat its control"}**' for k, v in learns.items()) + '.', '']
    md += ['### 2. The verdicts: KVPO vs GRPO-SDE vs the untrained model (held-out, the final EMA weights)', '',
           'Paired differences a - b per seed, signed so that **positive = a is better** (higher composite, VQ, MQ, '
           'TA, colour entropy; lower manifold distance); mean [95% t interval]; holds if above 0, fails if below:', '']
    prs = []
    for lr in lrs:
        ev = {m: {s: r['evals'][iters] for s, r in runs[cell(m, lr, False)].items()} for m in methods}
        ev['untrained'] = {s: r['evals'][0] for m in methods for s, r in runs[cell(m, lr, False)].items()}
        for a, b in (('KVPO', 'untrained'), ('GRPO-SDE', 'untrained'), ('KVPO', 'GRPO-SDE')):
            ss = sorted(set(ev.get(a, {})) & set(ev.get(b, {})))
            if not ss:
                continue
            ci = {k: paired([sg * ev[a][s][k] for s in ss], [sg * ev[b][s][k] for s in ss]) for k, sg in METRICS.items()}
            res['held_out'][f'{a} vs {b}, lr {lr}'] = ci
            prs.append([lr, a, b, len(ss)] + [f'{fmt(ci[k], 4 if k == "manifold" else 3)} {verdict(ci[k])}'
                                              for k in METRICS])
        res['held_out'][f'cells, lr {lr}'] = {c: {k: mean([e[k] for e in v.values()]) for k in METRICS}
                                              for c, v in ev.items()}
    md += [table(['lr', 'a', 'b', 'seeds'] + [f'Δ {k}' for k in METRICS], prs), '',
           '**Per cell** (mean over its seeds; held-out at the end):', '',
           table(['lr', 'cell'] + list(METRICS), [[lr, c] + [f'{v[k]:.4f}' for k in METRICS]
                                                  for lr in lrs for c, v in res['held_out'][f'cells, lr {lr}'].items()]),
           '', '**Per run** (held-out composite at iteration 0 -> the last; training reward first -> last '
           f'{tail} iterations; the alarm; seconds an iteration):', '',
           table(['cell', 'seed', 'held-out', 'training reward', 'alarm', 's/iter'],
                 [[c, s, f'{r["evals"][0]["composite"]:.4f} -> {r["evals"][iters]["composite"]:.4f}',
                   f'{mean(r["reward"][:tail]):.3f} -> {mean(r["reward"][-tail:]):.3f}',
                   ', '.join(r['alarm']) or 'silent', f'{r["sec"]:.1f}'] for c, v in runs.items() for s, r in v.items()]),
           '']
    if suspects and not tag():
        md += suspect_section(runs, res)
    res['runs'] = {c: {s: {k: r[k] for k in ('reward', 'anchor', 'alarm', 'sec')} | {'evals': r['evals']}
                       for s, r in v.items()} for c, v in runs.items()}
    res['learns'] = learns
    write_report(OUT + tag(), res, md)
    return res


def suspect_section(runs, res):
    """Section 3: each suspect removed, against KVPO (the same seeds) and against KVPO's shuffled control."""
    lr, rows = SUSPECT_LR, []
    if lr not in lrs:
        return []
    real, shuf = runs[cell('KVPO', lr, False)], runs[cell('KVPO', lr, True)]
    for c in SUSPECTS:
        ran = {s: summary(c, s) for s in range(seeds) if done(c, s)}
        runs[c] = ran
        for base, b in (('KVPO', real), ('KVPO, shuffled', shuf)):
            ss = sorted(set(ran) & set(b))
            if not ss:
                continue
            tr = paired([mean(ran[s]['reward'][-tail:]) for s in ss], [mean(b[s]['reward'][-tail:]) for s in ss])
            ho = paired([ran[s]['evals'][iters]['composite'] for s in ss], [b[s]['evals'][iters]['composite'] for s in ss])
            res['suspects'] = res.get('suspects', {}) | {f'{c} vs {base}': dict(reward=tr, held_out=ho)}
            rows.append([c, base, len(ss), f'{mean([ran[s]["evals"][iters]["composite"] for s in ss]):.4f}',
                         f'{fmt(tr)} {verdict(tr)}', f'{fmt(ho)} {verdict(ho)}'])
    if not rows:
        return []
    return [f'### 3. KVPO with each suspect removed (lr {lr}, the same seeds)', '',
            'Issue 58\'s suspects for KVPO lowering the toy, each a KVPO run with it removed (not released settings): '
            + '; '.join(f'"{c}": `{" ".join(a)}`' for c, a in SUSPECTS.items()) + '. Against KVPO and against KVPO\'s '
            'shuffled control: if a suspect were the cause, its run would beat both.', '',
            table(['suspect removed', 'against', 'seeds', 'held-out composite', f'Δ training reward (last {tail})',
                   'Δ held-out composite'], rows), '']


def readme_lines(res):
    """The README's KVPO paragraph: each method against its shuffled control, then the three-way verdicts, at each
    lr; with the spread of a group's rewards (bench/kvpo_signal.py's results, when there)."""
    def ctl(m, lr):
        ci = res['control'].get(f'{m} lr {lr}', {}).get('reward')
        return f'{m} {verdict(ci) if ci else "not run"} ({fmt(ci) if ci else "-"})'
    def vs(a, b, lr):
        ci = res['held_out'].get(f'{a} vs {b}, lr {lr}', {}).get('composite')
        return f'{a} vs {b} {verdict(ci) if ci else "not run"}' + (f' ({fmt(ci)})' if ci else '')
    parts = [f'at lr {lr}, the real advantages beat the shuffled: {ctl("KVPO", lr)}, {ctl("GRPO-SDE", lr)}; held-out '
             f'composite: {vs("KVPO", "untrained", lr)}, {vs("GRPO-SDE", "untrained", lr)}, {vs("KVPO", "GRPO-SDE", lr)}'
             for lr in lrs]
    sig = ''
    signal = 'results/toy_story_signal_student.json' if world == 'story' else 'results/kvpo_signal.json'
    if os.path.exists(signal):  # the untrained toy's groups (bench/kvpo_signal.py, bench/toy_story.py signal)
        with open(signal) as f:
            g = json.load(f)
        sig = (f' On the untrained toy KVPO\'s routed branches barely differ (composite std within a group: median '
               f'{g["median"]["kvpo_std"]:.1e}, mean {g["mean"]["kvpo_std"]:.1e}; GRPO-SDE\'s {g["median"]["grpo_std"]:.2f}) '
               f'and {g["tied_groups"]:.0%} of its groups get one advantage value for every branch '
               f'([results/kvpo_signal.md](results/kvpo_signal.md), docs/kvpo.md {5 if world == "sf" else 6}).')
    sus = res.get('suspects', {})
    if sus:
        sig += (' Each suspect removed, against KVPO (held-out composite): ' + '; '.join(
            f'{k.split(" (")[0]} {verdict(v["held_out"])} ({fmt(v["held_out"])})' for k, v in sus.items()
            if k.endswith('vs KVPO')) + '.')
    title, flag = WORLDS[world][3], '' if world == 'sf' else f' --world={world}'
    n = ', '.join(f'{res["control"].get(f"KVPO lr {lr}", {}).get("reward", {}).get("n", 0)} at lr {lr}' for lr in lrs)
    return [f'- *KVPO decided on {title}* (`python -m bench.kvpo_verdicts{flag}`, paired seeds: {n}; '
            f'{iters} iterations of {prompts_per_iter} prompts x 6): ' + '; '.join(parts) + '.' + sig
            + f' [results/kvpo_verdicts{tag()}.md](results/kvpo_verdicts{tag()}.md).']


if __name__ == '__main__':
    configure(globals())
    METHODS = methods_of(world)
    os.makedirs(RUNS, exist_ok=True)
    if run:  # the toy's lr first, seed-major: a stop leaves every cell at the same seeds
        order = [(m, lr, sh, s) for lr in lrs for s in range(seeds) for m in methods for sh in (False, True)]
        for i, job in enumerate(order):
            if i % workers == worker:
                train(*job)
        jobs = [(c, a, s) for s in range(seeds) for c, a in SUSPECTS.items()] if suspects and not tag() else []
        for i, (c, a, s) in enumerate(jobs):
            if i % workers == worker:
                train('KVPO', SUSPECT_LR, False, s, a, c)
    res = report()
    if tag() in ('', '_story') and worker == 0:  # the README links sections 13 and 15
        put_block('results/README.md', 'bench.kvpo_verdicts' + ('' if world == 'sf' else f' --world={world}'),
                  [f'## {"15" if tag() else "13"}. KVPO decided on {WORLDS[world][3]} (`python -m bench.kvpo_verdicts'
                   + ('`)' if world == 'sf' else f' --world={world}`)'), ''] + readme_lines(res))
