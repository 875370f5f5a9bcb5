"""
KVPO against GRPO with an SDE on the same AR model (the baseline KVPO's abstract sets itself against) and
against the untrained model, paired by seed, on the AR toy. For each seed s both loops run `iters`
iterations with seed s: kvpo/train.py kvpo/config/toy.py and kvpo/grpo_ar.py kvpo/config/grpo_toy.py (the
same prompts an iteration, lr, EMA, warm-up, clip and held-out items); the untrained model is their
common evaluation at iteration 0. Per seed: the held-out composite, VQ, MQ, TA, manifold distance and
colour entropy of the final evaluation (the EMA weights); the paired differences' mean and 95% t interval
over the seeds (bench/verdicts.py's paired); whether models/evaluate.py's alarm fired in the run. And an
experiment on why KVPO degrades the toy: KVPO whose replay sees each branch's own routing (replay_routed).

    python -m bench.kvpo_verdicts [--seeds=3] [--iters=30]   # writes results/kvpo_verdicts.md/.json (~40 min)
    python -m bench.kvpo_verdicts --run=False                # only the report, from results/runs/kvpo_verdicts

Runs live in results/runs/kvpo_verdicts/ (not committed); a run whose final evaluation is there is not rerun.
Tested by: running it (the toy's numbers are in results/kvpo_verdicts.md).
"""
import json
import os
import shutil
import subprocess
import sys
import time

from bench.common import table, write_report
from infra.configurator import configure

_argv, sys.argv = sys.argv, sys.argv[:1]  # bench.verdicts reads the command line when imported: not ours
from bench.verdicts import fmt, paired, verdict  # noqa: E402  the paired-seed statistics
sys.argv = _argv

seeds = 3                       # seeds 0..seeds-1, each a KVPO and a GRPO-SDE run
iters = 30                      # iterations of every run (kvpo/config/toy.py's)
eval_every = 10                 # held-out evaluations (16 prompts x 1 seed, the EMA weights)
run = True                      # False: only the report
RUNS, OUT = 'results/runs/kvpo_verdicts', 'results/kvpo_verdicts'
METHODS = {'KVPO': ['-m', 'kvpo.train', 'kvpo/config/toy.py'],
           'GRPO-SDE': ['-m', 'kvpo.grpo_ar', 'kvpo/config/grpo_toy.py'],
           # an experiment, not released: TVE replays each branch under its own routing (kvpo/train.py)
           'KVPO routed replay': ['-m', 'kvpo.train', 'kvpo/config/toy.py', '--replay_routed=True'],
           'GRPO-SDE lr 1e-5': ['-m', 'kvpo.grpo_ar', 'kvpo/config/grpo_toy.py', '--learning_rate=1e-5'],
           'KVPO lr 1e-5': ['-m', 'kvpo.train', 'kvpo/config/toy.py', '--learning_rate=1e-5']}
MAIN = ('KVPO', 'GRPO-SDE')     # seed-major first; then each experiment over its seeds
PAIRS = [('KVPO', 'untrained'), ('GRPO-SDE', 'untrained'), ('KVPO', 'GRPO-SDE'),
         ('KVPO routed replay', 'KVPO'), ('GRPO-SDE lr 1e-5', 'untrained'), ('KVPO lr 1e-5', 'untrained'),
         ('KVPO lr 1e-5', 'GRPO-SDE lr 1e-5')]
METRICS = dict(composite=1, VQ=1, MQ=1, TA=1, manifold=-1, entropy=1)  # +1: higher is better, -1: lower


def rows_of(name):
    path = os.path.join(RUNS, name, 'metrics.jsonl')
    return [json.loads(line) for line in open(path)] if os.path.exists(path) else []


def done(name):
    return any(r['iter'] == iters and 'eval_composite' in r for r in rows_of(name))


def train(method, s):
    name = f'{method}_s{s}'
    if done(name):
        return
    d = os.path.join(RUNS, name)
    shutil.rmtree(d, ignore_errors=True)
    t0 = time.time()
    p = subprocess.run([sys.executable] + METHODS[method] + [
        f'--seed={s}', f'--out_dir={d}', f'--max_iters={iters}', f'--eval_every={eval_every}', '--save_every=0'],
        capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS='1'))
    with open(os.path.join(d, 'log.txt'), 'w') as f:
        f.write(p.stdout[-20000:] + p.stderr[-20000:])
    if p.returncode:
        raise RuntimeError(f'{name} failed:\n{p.stderr[-3000:]}')
    shutil.rmtree(os.path.join(d, 'ckpt'), ignore_errors=True)
    print(f'{name}: {time.time() - t0:.0f}s', flush=True)


def summary(name):
    """The run's held-out evaluations {iter: {metric: value}}, whether the alarm fired, its seconds an iteration
    and its training rewards (mean of the first and last 10 iterations)."""
    rs = rows_of(name)
    evals = {r['iter']: {k: r[f'eval_{k}'] for k in METRICS} for r in rs if 'eval_composite' in r}
    its = [r for r in rs if 'loss' in r]
    return dict(evals=evals, alarm=sorted({k for r in rs for k in r.get('alarm', [])}),
                flagged=sorted({k for r in rs for k in r.get('watch_flagged', [])}),
                sec=sum(r['t_rollout'] + r['t_update'] for r in its) / len(its),
                train_first=sum(r['reward'] for r in its[:10]) / 10, train_last=sum(r['reward'] for r in its[-10:]) / 10)


def report():
    runs = {m: {s: summary(f'{m}_s{s}') for s in range(seeds) if done(f'{m}_s{s}')} for m in METHODS}
    evals = {m: {s: r['evals'][iters] for s, r in v.items()} for m, v in runs.items()}
    cells = {'untrained': {s: r['evals'][0] for v in runs.values() for s, r in v.items()}, **evals}
    same = all(abs(runs['KVPO'][s]['evals'][0]['composite'] - r['evals'][0]['composite']) < 1e-6
               for v in runs.values() for s, r in v.items() if s in runs['KVPO'])  # one model, the same items
    res = dict(config=dict(seeds=seeds, iters=iters, eval_every=eval_every), per_seed=cells, paired={},
               runs={m: {s: {k: r[k] for k in ('alarm', 'flagged', 'sec', 'train_first', 'train_last')}
                         for s, r in v.items()} for m, v in runs.items()})
    for a, b in PAIRS:  # over the seeds both have, signed so that positive = a is better
        ss = sorted(set(cells[a]) & set(cells[b]))
        res['paired'][f'{a} vs {b}'] = {k: paired([sg * cells[a][s][k] for s in ss], [sg * cells[b][s][k] for s in ss])
                                        for k, sg in METRICS.items()}
    mean = lambda c, k: sum(e[k] for e in cells[c].values()) / max(1, len(cells[c]))  # noqa: E731
    verdicts = {p: verdict(v['composite']) for p, v in res['paired'].items()}
    md = ['## KVPO vs GRPO with an SDE vs the untrained model, paired seeds (AR toy)', '',
          f'Written by `python -m bench.kvpo_verdicts` ({iters} iterations a run, one CPU thread): '
          '`python -m kvpo.train kvpo/config/toy.py` and `python -m kvpo.grpo_ar kvpo/config/grpo_toy.py` with '
          '`--seed=s`: the same model, prompts an iteration (4), group (K = G = 6), lr 1e-4, warm-up, gradient clip, '
          'EMA 0.9 and held-out items (16 prompts x 1 seed, block by block, the EMA weights). The untrained model is '
          f'their evaluation at iteration 0 ({"identical in every run of a seed" if same else "NOT identical"}); '
          f'the others their evaluation at iteration {iters}. Experiments, not released settings: "KVPO routed '
          'replay" (`--replay_routed=True`: TVE replays each branch under its own routing) and both methods at the '
          'released lr 1e-5.', '',
          '**Per cell** (mean over its seeds):', '',
          table(['cell', 'seeds'] + list(METRICS), [[c, len(v)] + [f'{mean(c, k):.4f}' for k in METRICS]
                                                      for c, v in cells.items() if v]), '',
          '**Paired differences** (per seed, a - b, signed so that **positive = a is better**: higher composite, VQ, '
          'MQ, TA, colour entropy; lower manifold distance); mean [95% t interval]; a claim holds if the interval is '
          'above 0, fails if below, cannot be told if it spans 0:', '',
          table(['a', 'b', 'seeds'] + [f'Δ {k}' for k in METRICS],
                [[a, b, res['paired'][f'{a} vs {b}']['composite']['n']]
                 + [f'{fmt(res["paired"][f"{a} vs {b}"][k], 4 if k == "manifold" else 3)} '
                    f'{verdict(res["paired"][f"{a} vs {b}"][k])}' for k in METRICS] for a, b in PAIRS
                 if res['paired'][f'{a} vs {b}']['composite']['n']]), '',
          '**Per run** (held-out composite at iteration 0 -> the last; the alarm; seconds an iteration; the training '
          'rollouts\' mean composite, iterations 1-10 -> the last 10):', '',
          table(['run', 'seed', 'composite', 'alarm', 's/iter', 'training reward'],
                [[m, s, f'{cells["untrained"][s]["composite"]:.4f} -> {evals[m][s]["composite"]:.4f}',
                  ', '.join(r['alarm']) or 'silent', f'{r["sec"]:.1f}', f'{r["train_first"]:.3f} -> {r["train_last"]:.3f}']
                 for m, v in runs.items() for s, r in v.items()]), '']
    k_vs_g = res['paired']['KVPO vs GRPO-SDE']['composite']
    md += [f'Verdict (held-out composite): KVPO beats GRPO-SDE: **{verdicts["KVPO vs GRPO-SDE"]}** ({fmt(k_vs_g)}); '
           f'KVPO beats the untrained model: **{verdicts["KVPO vs untrained"]}**; GRPO-SDE beats the untrained model: '
           f'**{verdicts["GRPO-SDE vs untrained"]}**. Experiments: ' + '; '.join(
               f'{p}: **{v}**' for p, v in verdicts.items() if p.split(' vs ')[0] not in MAIN and v != 'not run') + '.', '']
    res['verdict'] = md[-2]
    write_report(OUT, res, md)


if __name__ == '__main__':
    configure(globals())
    os.makedirs(RUNS, exist_ok=True)
    if run:
        for s in range(seeds):  # seed-major: a stop leaves both methods at the same seeds
            for m in MAIN:
                train(m, s)
        for m in METHODS:  # the experiments, one after another (a report counts the seeds each pair has)
            for s in range(seeds):
                train(m, s)
    report()
