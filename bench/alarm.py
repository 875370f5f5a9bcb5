"""
The reward-hacking alarm (models/evaluate.py Alarm, docs/method.md section 9) replayed on recorded toy runs:
bench.trust_region's cells 'none' and 'dual' with lambda_KL held at 0.1 and at 1 (8 prompts x G=4, 60
iterations, AdamW at 1e-4, an evaluation every 5, seeds 0..4), and four later cells of the same bench
(CELLS). Each run's evaluations are its logged means; the alarm compares them with the base model's
held-out items (iteration 0, the same for a seed's runs) and with the data's watchers (the clean renders of
the held-out items, models/evaluate.py HeldOut.reference).

    python -m bench.alarm                   # each run's verdict, from tests/data/alarm_replay.json
    python -m bench.alarm --extract=True    # rewrite that file from results/cells (~3 min: 5 short runs)

The cells keep each evaluation's means, not its items, and the alarm's noise is the spread of the base
model's items: --extract reruns each seed's iteration 0 (train.py to iteration 1; the checkpoint holds the
base model's items) and checks their means against the recorded ones (to 1e-5: float rounding since). The
colour entropy is left out: the cells recorded it at 4 levels a channel, whose bin edge sat on the toy's grey
background (models/evaluate.py LEVELS). Tested by: python -m pytest tests/test_alarm.py (the replayed verdicts)
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile

from bench import common as C
from infra.configurator import configure
from infra.finite import FiniteFrames
from infra.prompt_cache import read_prompts
from models import toy
from models.evaluate import NOT_WATCHED, Alarm, HeldOut, means
from reward import SETTING_B

# ----------------------------------------------------------------------------- settings
fixture = 'tests/data/alarm_replay.json'  # the runs' recorded means, the base model's items, the data's watchers
extract = False          # True: rewrite the fixture from results/cells (and 5 one-iteration runs)
z = 2.0                  # the alarm's standard errors (train.py alarm_z)
config = configure(globals(), sys.argv[1:]) if __name__ == '__main__' else {}  # not pytest's command line
# -----------------------------------------------------------------------------
SEEDS = range(5)
REF = 'prompts_per_iter-8_sampler-sage_it60_e5'  # bench.paper's reference cells (bench.trust_region's names)
HELD = 'kl_init-{0}_kl_max-{0}_kl_min-{0}_kl_strategy-dual_kl_warmup-0'  # lambda_KL held at {0}
CELLS = {'none': f'v_equalizer-True_kl_strategy-none_{REF}', 'dual @ 0.1': f'v_equalizer-True_{HELD.format(0.1)}_{REF}',
         'dual @ 1': f'v_equalizer-True_{HELD.format(1.0)}_{REF}',
         # recorded with the entropy at 5 levels: two that improve (VQ up, the manifold distance down in every
         # seed) and two whose VQ ends below the base model's in some seeds
         'dual @ ratio 1': 'v_equalizer-True_kl_init-0.1_kl_max-0.1_kl_min-0.1_kl_ratio_target-1.0_'
                           f'kl_strategy-dual_kl_warmup-0_{REF}',
         'dual + sample @ 0.1': f'v_equalizer-True_kl_estimator-sample_{HELD.format(0.1)}_{REF}',
         'stepwise + sample @ 1': 'v_equalizer-True_kl_estimator-sample_'
                                  f'{HELD.format(1.0).replace("dual", "stepwise")}_{REF}',
         'none, muon 3e-4': f'v_equalizer-True_kl_strategy-none_learning_rate-0.0003_optimizer-muon_{REF}'}
FOUR_LEVELS = ('none', 'dual @ 0.1', 'dual @ 1')  # recorded before the entropy's 5 levels: LEFT_OUT of these
LEFT_OUT = ('entropy',)  # recorded at another LEVELS (the docstring)
SHOWN = ('composite', 'VQ', 'manifold', 'saturation', 'brightness', 'edges')  # the noise printed of each seed


def replay(base, rows, data, z=z):
    """[(iteration, fields, line)] of the alarm at each recorded evaluation after the base model's."""
    alarm = Alarm(z)
    alarm(0, base, data)
    return [(r['iter'], *alarm.look(r['iter'], r, data)) for r in rows if r['iter'] > 0]


def verdict(replayed):
    """'trips at <iteration> (<watchers>)[; then <watcher> (<its first iteration>), ...]' or 'silent'."""
    first = {}
    for it, fields, _ in replayed:
        for k in fields['alarm']:
            first.setdefault(k, it)
    if not first:
        return 'silent'
    at = min(first.values())
    later = ', '.join(f'{k} ({i})' for k, i in first.items() if i > at)
    return f"trips at {at} ({', '.join(k for k, i in first.items() if i == at)})" + (f'; then {later}' if later else '')


def base_items(overrides):
    """The base model's held-out items of a run with these train.py overrides: its iteration 0, rerun."""
    run = tempfile.mkdtemp(prefix='alarm_base_')
    try:
        cmd = C.train_cmd(run, dict(overrides, max_iters=1, export_dtype=''))
        subprocess.run(cmd, check=True, capture_output=True, env=dict(os.environ, OMP_NUM_THREADS='1'))
        return json.load(open(os.path.join(run, 'ckpt_000001', 'loop.json')))['alarm']['base']
    finally:
        shutil.rmtree(run, ignore_errors=True)


def data_watchers():
    """The data's watchers of the toy's held-out items: HeldOut.reference at config/toy.py's settings."""
    prompts, _ = read_prompts('assets/toy/eval_prompts.txt')
    unused = dict.fromkeys(('seed', 'sigmas', 'cfg', 'shape', 'text_for', 'batch', 'decode', 'move_visual', 'out_dir',
                            'passes', 'preemption'))  # the sampling's: reference() only renders and scores
    held = HeldOut(prompts, 2, **unused, reward_fn=FiniteFrames(toy.reward), reward_weights=SETTING_B,
                   manifold_distance=toy.manifold_distance, visual={}, fps=toy.FPS, videos=0, dp_rank=0, dp_world=1,
                   leads=True, device='cpu')
    return held.reference(toy)


def write_fixture():
    """The fixture: per seed the base model's items, per run and seed its evaluations (columns), the data."""
    g = lambda v: float(f'{v:.9g}')  # noqa: E731  a float32, exactly and short
    cells = {run: [json.load(open(f'results/cells/{name}_s{s}.json')) for s in SEEDS] for run, name in CELLS.items()}
    out = dict(about="bench/alarm.py --extract: the base model's held-out items of each seed, rerun; each run's "
                     "recorded evaluation means (results/cells); the data's watchers", z=z, base={}, runs={})
    kept = lambda run, keys: [k for k in keys if not (run in FOUR_LEVELS and k in LEFT_OUT)]  # noqa: E731
    for s in SEEDS:
        items = base_items(cells['none'][s]['overrides'])
        got = means(items)
        for run in cells:  # iteration 0 of every run of a seed is the same base model's evaluation
            recorded = cells[run][s]['evals'][0]
            off = {k: (got[k], recorded[k]) for k in kept(run, got) if abs(got[k] - recorded[k]) > 1e-5}
            assert not off, f"seed {s}: the base model's items do not give {run}'s recorded means: {off}"
        out['base'][s] = {k: [g(r[k]) for r in items] for k in items[0]}
    for run, per_seed in cells.items():
        out['runs'][run] = {s: dict(iter=[e['iter'] for e in c['evals']],
                                    **{k: [g(e[k]) for e in c['evals']] for k in kept(run, out['base'][s])},
                                    recorded_alarm=[e.get('alarm', []) for e in c['evals']])  # the rule it ran with
                            for s, c in zip(SEEDS, per_seed)}
    out['data'] = {k: g(v) for k, v in data_watchers().items() if k not in NOT_WATCHED}
    with open(fixture, 'w') as f:
        json.dump(out, f, separators=(',', ':'))


def load(path=fixture):
    """{'base': {seed: [item]}, 'runs': {run: {seed: [evaluation]}}, 'recorded': {run: {seed: [the alarm it
    logged at each evaluation]}}, 'data': {watcher: value}}; an item or evaluation is a dict."""
    fx = json.load(open(path))
    rows = lambda cols: [dict(zip(cols, v)) for v in zip(*cols.values())]  # noqa: E731  columns -> rows
    runs = {run: {int(s): rows({k: v for k, v in c.items() if k != 'recorded_alarm'}) for s, c in per.items()}
            for run, per in fx['runs'].items()}
    recorded = {run: {int(s): c['recorded_alarm'] for s, c in per.items()} for run, per in fx['runs'].items()}
    return dict(base={int(s): rows(c) for s, c in fx['base'].items()}, runs=runs, recorded=recorded, data=fx['data'])


if __name__ == '__main__':
    if extract:
        write_fixture()
    fx = load()
    print(f"the data: {', '.join(f'{k} {v:.4f}' for k, v in fx['data'].items())}")
    for s, items in fx['base'].items():  # the alarm's noise: the base model's standard errors
        alarm = Alarm()
        alarm(0, items)
        print(f"the base model, seed {s}: SE {', '.join(f'{k} {alarm.noise(k):.4f}' for k in SHOWN)}")
    for run, per_seed in fx['runs'].items():
        for s, rows in per_seed.items():
            logged = [(r['iter'], dict(alarm=a), None) for r, a in zip(rows, fx['recorded'][run][s])]
            print(f"{run} s{s}: {verdict(replay(fx['base'][s], rows, fx['data']))} "
                  f"(as it ran: {verdict(logged)})")
