"""
Why GRPO with an SDE lowers its own training reward on the AR toy (results/kvpo_verdicts_ar.md): a bug in the
AR path, or drift (AdamW's normalised step on a tiny, noisy gradient: 4 prompts x 6 clips an iteration)?
Each question is a pair of kvpo/grpo_ar.py runs with the same seed (the same prompts, initial noises, SDE
noises and held-out items), the real advantages against each group's advantages permuted at random
(`--adv_shuffle=True`: the same update size and statistics, no assignment of reward to clips):

 1. learnability: the reward is the frames' mean pixel value (`--ta_brightness=True`: the easiest, one
    direction shared by every clip), or one component, TA (`--reward_weights=(0.0, 0.0, 1.0)`, the toy's
    colour, shape and direction match): does the training reward rise, and beyond drift?
 2. the toy's composite at lr 1e-4 (kvpo/config/grpo_toy.py) and at lr 1e-5: does the signal beat drift?

Per run: the training rollouts' composite (the run's own reward weights), the means of the first and the
last `tail` iterations (iteration 1's rollout precedes any update: equal in a pair); the held-out composite
(the EMA weights, the run's weights) at iteration 0 and the last. Per pair: the per-seed differences real -
shuffled, their mean and 95% t interval (bench/verdicts.py's paired), of the last iterations' training
reward (paired iteration by iteration: the same prompts and noises) and of the final held-out composite.

    python -m bench.kvpo_diagnosis [--budget_min=28]   # writes results/kvpo_diagnosis.md/.json (~45 min, 1 thread)
    python -m bench.kvpo_diagnosis --run=False        # only the report, from the runs

Runs live in results/runs/kvpo_diagnosis/ (not committed); the real-advantage runs of the toy's composite
are the AR toy's verdict runs (results/runs/kvpo_verdicts/, bench/kvpo_verdicts.py's before it moved to the
distilled toy; the same command), reused when there.
Tested by: running it (the numbers are in results/kvpo_diagnosis.md); the control's switch by
tests/test_kvpo_sde.py.
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

seeds = 3                       # seeds 0..seeds-1 of each cell (the easy reward: easy_seeds)
easy_seeds = 2                  # seeds of the learnability pair
easy_iters = 15                 # iterations of the learnability runs
big_seeds = 1                   # seeds of the learnability pair at 16 prompts an iteration (4x the clips, 4x the time)
big_iters = 10                  # its iterations
iters = 30                      # iterations of the composite's runs (bench/kvpo_verdicts.py's)
tail = 5                        # the training reward of a run's end: the mean of its last `tail` iterations
budget_min = 0.0                # start no new run after this many minutes (0: no limit)
run = True                      # False: only the report
RUNS, VERDICT_RUNS, OUT = 'results/runs/kvpo_diagnosis', 'results/runs/kvpo_verdicts', 'results/kvpo_diagnosis'
TA = '--reward_weights=(0.0, 0.0, 1.0)'
SHUFFLE = '--adv_shuffle=True'
BRIGHT = '--ta_brightness=True'
CELLS = {  # name: (folder of its runs, kvpo.grpo_ar arguments beyond the config's, iterations and seeds)
    'brightness': (RUNS, [TA, BRIGHT], 'easy'),
    'brightness, shuffled': (RUNS, [TA, BRIGHT, SHUFFLE], 'easy'),
    'brightness, 16 prompts': (RUNS, [TA, BRIGHT, '--prompts_per_iter=16'], 'big'),
    'brightness, 16 prompts, shuffled': (RUNS, [TA, BRIGHT, '--prompts_per_iter=16', SHUFFLE], 'big'),
    'TA only': (RUNS, [TA], 'easy'),
    'TA only, shuffled': (RUNS, [TA, SHUFFLE], 'easy'),
    'GRPO-SDE': (VERDICT_RUNS, [], 'main'),  # bench/kvpo_verdicts.py's runs
    'GRPO-SDE, shuffled': (RUNS, [SHUFFLE], 'main'),
    'GRPO-SDE lr 1e-5': (VERDICT_RUNS, ['--learning_rate=1e-5'], 'main'),
    'GRPO-SDE lr 1e-5, shuffled': (RUNS, ['--learning_rate=1e-5', SHUFFLE], 'main'),
}
PAIRS = [('brightness, 16 prompts', 'brightness, 16 prompts, shuffled'), ('brightness', 'brightness, shuffled'),
         ('TA only', 'TA only, shuffled'), ('GRPO-SDE', 'GRPO-SDE, shuffled'),
         ('GRPO-SDE lr 1e-5', 'GRPO-SDE lr 1e-5, shuffled')]


def sizes(cell):
    """(iterations, seeds) of a cell."""
    return dict(easy=(easy_iters, easy_seeds), big=(big_iters, big_seeds), main=(iters, seeds))[CELLS[cell][2]]


def folder(cell, s):
    return os.path.join(CELLS[cell][0], f'{cell}_s{s}')


def rows_of(cell, s):
    path = os.path.join(folder(cell, s), 'metrics.jsonl')
    return [json.loads(line) for line in open(path)] if os.path.exists(path) else []


AR = ['--model=assets/toy_ar', '--train_steps=4']  # the AR toy these runs were of (python -m streaming.toy_ar builds
                                                 # it; kvpo/config/grpo_toy.py now runs the story toy's student)


def done(cell, s):
    return any(r['iter'] == sizes(cell)[0] and 'eval_composite' in r for r in rows_of(cell, s))


def train(cell, s):
    n = sizes(cell)[0]
    d = folder(cell, s)
    shutil.rmtree(d, ignore_errors=True)
    t0 = time.time()
    p = subprocess.run([sys.executable, '-m', 'kvpo.grpo_ar', 'kvpo/config/grpo_toy.py'] + AR + CELLS[cell][1] + [
        f'--seed={s}', f'--out_dir={d}', f'--max_iters={n}', f'--eval_every={n}', '--save_every=0'],
        capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS='1'))  # one thread
    with open(os.path.join(d, 'log.txt'), 'w') as f:
        f.write(p.stdout[-20000:] + p.stderr[-20000:])
    if p.returncode:
        raise RuntimeError(f'{cell} s{s} failed:\n{p.stderr[-3000:]}')
    shutil.rmtree(os.path.join(d, 'ckpt'), ignore_errors=True)
    print(f'{cell} s{s}: {time.time() - t0:.0f}s', flush=True)


def summary(cell, s):
    """A run's training rewards (the first and the last `tail` iterations' means, every iteration), its
    rollouts' VQ (the first, the last), the KL of its mean to the initial model's (the last), held-out composite and
    manifold distance and luma (iteration 0, the last), mean gradient norm and seconds an iteration."""
    rs = rows_of(cell, s)
    its, ev = [r for r in rs if 'loss' in r], {r['iter']: r for r in rs if 'eval_composite' in r}
    return dict(train=[r['reward'] for r in its], train_first=sum(r['reward'] for r in its[:tail]) / tail,
                train_last=sum(r['reward'] for r in its[-tail:]) / tail,
                eval_first=ev[0]['eval_composite'], eval_last=ev[sizes(cell)[0]]['eval_composite'],
                eval_manifold=ev[sizes(cell)[0]]['eval_manifold'],
                luma=(ev[0]['eval_brightness'], ev[sizes(cell)[0]]['eval_brightness']),
                vq_first=sum(r['VQ'] for r in its[:tail]) / tail,  # the rollouts' quality on the data manifold
                vq_last=sum(r['VQ'] for r in its[-tail:]) / tail,
                kl_last=sum(r['kl'] for r in its[-tail:]) / tail,  # how far the policy's mean moved from the init's
                grad_norm=sum(r['grad_norm'] for r in its) / len(its),
                sec=sum(r['t_rollout'] + r['t_update'] for r in its) / len(its))


def report():
    runs = {c: {s: summary(c, s) for s in range(sizes(c)[1]) if done(c, s)} for c in CELLS}
    res = dict(config=dict(seeds=seeds, easy_seeds=easy_seeds, easy_iters=easy_iters, iters=iters, tail=tail),
               runs=runs, paired={})
    for a, b in PAIRS:  # positive: the real advantages did better than the shuffled ones
        ss = sorted(set(runs[a]) & set(runs[b]))
        same_start = all(runs[a][s]['train'][0] == runs[b][s]['train'][0] for s in ss)  # one model, one rollout
        res['paired'][f'{a} vs {b}'] = dict(
            same_start=same_start,
            train=paired([runs[a][s]['train_last'] for s in ss], [runs[b][s]['train_last'] for s in ss]),
            kl=paired([runs[a][s]['kl_last'] for s in ss], [runs[b][s]['kl_last'] for s in ss]),
            eval=paired([runs[a][s]['eval_last'] for s in ss], [runs[b][s]['eval_last'] for s in ss]))
    for c, v in runs.items():  # each cell against its own start: does the training reward rise?
        ss = sorted(v)
        res['paired'][f'{c} vs its start'] = dict(
            train=paired([v[s]['train_last'] for s in ss], [v[s]['train_first'] for s in ss]),
            eval=paired([v[s]['eval_last'] for s in ss], [v[s]['eval_first'] for s in ss]))
    P = res['paired']
    md = ['## Why GRPO-SDE lowers its own reward on the AR toy: real vs shuffled advantages, paired seeds', '',
          f'Written by `python -m bench.kvpo_diagnosis` (one CPU thread). Every run is `python -m kvpo.grpo_ar '
          'kvpo/config/grpo_toy.py --seed=s` (4 prompts x G = 6 an iteration, 4 of 8 SAGE steps trained, AdamW, '
          'lr 1e-4 unless named, warm-up 5, clip 1, EMA 0.9); "shuffled" adds `--adv_shuffle=True`: each group\'s '
          'advantages permuted at random, the same update size and statistics, no assignment of reward to clips. '
          f'"TA only" trains and evaluates the toy\'s text-alignment component alone (`--reward_weights=(0.0, 0.0, '
          f'1.0)`), "brightness" the frames\' mean pixel value (`--ta_brightness=True` besides: the easiest reward, '
          f'one direction shared by every clip; a machinery check), {easy_iters} iterations, {easy_seeds} seeds '
          f'each, and at 16 prompts an iteration (96 clips, the bidirectional toy\'s 64 and more; {big_iters} '
          f'iterations, {big_seeds} seed{"s" * (big_seeds > 1)}); the others the composite (0.5 VQ + 0.5 MQ + TA, '
          f'{iters} iterations; the real-advantage runs are bench/kvpo_verdicts.py\'s). Training reward: the '
          f'rollouts\' mean composite (of the run\'s weights) over the first and the last {tail} iterations (the '
          f'first iteration\'s rollout precedes any update); held-out: the EMA weights on 16 held-out prompts, the '
          f'run\'s weights (for "brightness" that is TA; its own reward is the luma column\'s kin, the frames\' mean '
          f'pixel); KL to init: the logged position KL of the policy\'s mean to the initial model\'s (how far '
          f'the steps moved it); "training VQ": the rollouts\' on-manifold quality.', '',
          '**Per run**:', '',
          table(['cell', 'seed', 'training reward (first -> last)', 'training VQ (first -> last)', 'KL to init (last)',
                 'held-out (it 0 -> last)', 'held-out luma (it 0 -> last)', 'held-out manifold (last)',
                 'mean grad norm', 's/iter'],
                [[c, s, f'{r["train_first"]:.3f} -> {r["train_last"]:.3f}',
                  f'{r["vq_first"]:.3f} -> {r["vq_last"]:.3f}',
                  f'{r["kl_last"]:.4f}', f'{r["eval_first"]:.3f} -> {r["eval_last"]:.3f}',
                  f'{r["luma"][0]:.3f} -> {r["luma"][1]:.3f}', f'{r["eval_manifold"]:.3f}',
                  f'{r["grad_norm"]:.4f}', f'{r["sec"]:.1f}']
                 for c, v in runs.items() for s, r in v.items()]), '',
          f'**Each cell against its own start** (the last {tail} iterations - the first {tail}, per seed; mean [95% t '
          'interval]; the prompts differ between iterations: noisy):', '',
          table(['cell', 'seeds', 'Δ training reward', 'Δ held-out'],
                [[c, P[f'{c} vs its start']['train']['n'],
                  f'{fmt(P[f"{c} vs its start"]["train"])} {verdict(P[f"{c} vs its start"]["train"])}',
                  f'{fmt(P[f"{c} vs its start"]["eval"])} {verdict(P[f"{c} vs its start"]["eval"])}']
                 for c in CELLS if runs[c]]), '',
          '**Real vs shuffled advantages** (per seed real - shuffled, positive = the reward\'s signal helped; '
          'mean [95% t interval]; the pair\'s iteration-1 rollouts identical: the same model and noises):', '',
          table(['real', 'shuffled', 'seeds', 'iteration 1 identical', 'Δ training reward (last iterations)',
                 'Δ held-out (last)', 'Δ KL to init (last)', 'Δ training reward per seed'],
                [[a, b, P[f'{a} vs {b}']['train']['n'], P[f'{a} vs {b}']['same_start'],
                  f'{fmt(P[f"{a} vs {b}"]["train"])} {verdict(P[f"{a} vs {b}"]["train"])}',
                  f'{fmt(P[f"{a} vs {b}"]["eval"])} {verdict(P[f"{a} vs {b}"]["eval"])}',
                  fmt(P[f'{a} vs {b}']['kl'], 4), ', '.join(f'{d:+.4f}' for d in P[f'{a} vs {b}']['train']['diffs'])]
                 for a, b in PAIRS if P[f'{a} vs {b}']['train']['n']]), '']
    res['verdicts'] = {p: {k: verdict(v[k]) for k in ('train', 'eval')} for p, v in P.items()}
    line = lambda p, k: f'{verdict(P[p][k])} ({fmt(P[p][k])}, {P[p][k]["n"]} seeds)'  # noqa: E731
    md += ['Verdict. Each cell\'s training reward rose (last iterations above the first): ' + '; '.join(
        f'{c}: **{line(f"{c} vs its start", "train")}**' for c in CELLS if runs[c]) + '. The real advantages '
        'beat the shuffled ones (training reward of the last iterations; held-out at the last): ' + '; '.join(
        f'{a}: **{line(f"{a} vs {b}", "train")}**, held-out **{line(f"{a} vs {b}", "eval")}**'
        for a, b in PAIRS if P[f'{a} vs {b}']['train']['n']) + '.', '']
    res['verdict'] = md[-2]
    res['steps'] = {p: fmt(v['kl'], 4) for p, v in P.items() if 'kl' in v}  # real - shuffled KL: the step's size
    write_report(OUT, res, md)


if __name__ == '__main__':
    configure(globals())
    os.makedirs(RUNS, exist_ok=True)
    t_start = time.time()
    if run:
        for pair in PAIRS:  # pair by pair, seed-major: a stop leaves both cells of a pair at the same seeds
            for s in range(sizes(pair[0])[1]):
                for cell in pair:
                    if not done(cell, s) and not (budget_min and time.time() - t_start > 60 * budget_min):
                        train(cell, s)
    report()
