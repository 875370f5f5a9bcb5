"""
Counting the work and the SDE window. python -m pytest tests/test_compute.py
- sde.window: w consecutive stochastic steps, every start equally likely, a function of its seed;
  equalizer.scales over a subset against docs/method.md section 3's formulas written out here;
- model.sample with a window: steps outside it are Euler steps with no log-probability;
- train.py (as a user runs it): a window covering every step is bitwise the run without one (weights, metrics);
  with a window, only its steps are trained and step t's loss is scaled by S_t of that very step,
  the median over the window (recorded at train.py's loss pieces, computed here from the formulas);
  a windowed run resumed equals the uninterrupted one bitwise (weights, optimizer state, figures);
  the logged transformer passes equal a hand count from the settings, across a resume, and on 2
  ranks under torchrun (gloo), where both ranks train the same window; bench/compute.py's formula
  for the passes of a setting equals that count; its verdicts on fabricated curves with known answers.
Cost: six short train.py runs: three in this process (test_train.run_here), two processes with a
recorder, one under torchrun.
"""
import json
import math
import os

import pytest
import torch

import equalizer
import sde
from test_train import ROOT, SMALL, metrics, run, run_here, weights

ETA, SHIFT, N = 0.5, 3.0, 4  # the toy's sage, and SMALL's 4 steps


def hand_S(sig, steps, eta=ETA):
    """docs/method.md section 3 for sage, in float64 from the formulas: N_t = |dt - Sigma (1 - s)/(2 s)| / sqrt(Sigma),
    S_t = median over `steps` (numpy's: the mean of the middle two) / N_t; also std_t = sqrt(Sigma)."""
    n, std = {}, {}
    for t in steps:
        s, s1 = sig[t].item(), sig[t + 1].item()
        var = eta ** 2 * (-(s - s1) + math.log((1 - s1) / (1 - min(s, 1 - 3e-3))))
        n[t], std[t] = abs((s1 - s) - 0.5 * var * (1 - s) / s) / var ** 0.5, var ** 0.5
    v = sorted(n.values())
    med = v[len(v) // 2] if len(v) % 2 else (v[len(v) // 2 - 1] + v[len(v) // 2]) / 2
    return {t: med / n[t] for t in steps}, std


def test_window_schedule():
    steps = list(range(10))
    assert sde.window(steps, 0, 1) == steps and sde.window(steps, 10, 1) == steps and sde.window(steps, 12, 1) == steps
    starts = []
    for seed in range(2000):
        w = sde.window(steps, 4, seed)
        assert w == list(range(w[0], w[0] + 4)) and 0 <= w[0] <= 6  # consecutive, inside the schedule
        assert w == sde.window(steps, 4, seed)  # a function of the seed: resumable
        starts.append(w[0])
    counts = torch.bincount(torch.tensor(starts), minlength=7).double()
    chi2 = ((counts - 2000 / 7) ** 2 / (2000 / 7)).sum().item()
    assert chi2 < 22.5, counts  # uniform over the 7 starts (p = 0.001 at 6 degrees of freedom)
    assert sde.window([2, 3, 4, 5], 2, 0)[0] in (2, 3, 4)  # entries of the list, not indices


def test_scales_over_the_trained_steps():
    sig = sde.sigmas(20, 5.0)
    assert torch.equal(equalizer.scales('sage', sig, 0.5, steps=range(20)), equalizer.scales('sage', sig, 0.5))
    for steps in ([3, 4, 5, 6], [10, 11], [7, 8, 9]):
        S = equalizer.scales('sage', sig, 0.5, steps=steps)
        want, _ = hand_S(sig, steps)
        assert all(abs(S[t].item() - want[t]) < 1e-5 * want[t] for t in steps), (S, want)
        assert all(S[t] == 1.0 for t in range(20) if t not in steps)  # not trained
    lower = equalizer.scales('sage', sig, 0.5, 'lower', steps=[10, 11])  # torch.median: the lower of two
    assert lower[10].item() == pytest.approx(1.0, rel=1e-6) and lower[11] < 1


def test_sample_window_outside_is_ode_without_logp():
    from models import policy as model
    from models import toy  # noqa: F401  plugs the toy world into model.py
    from infra.prompt_cache import PromptCache, build
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        build(d, 'assets/toy', {'a red circle moving left'}, model.encode_prompts, 'cpu')
        text = model.batch_text(PromptCache(d), ['a red circle moving left'] * 2, 'cpu')
    policy = model.load_policy(os.path.join(ROOT, 'assets/toy'), 'cpu', fsdp=False, checkpointing=False)
    sig = sde.sigmas(6, SHIFT)
    x1 = model.noise(toy.LATENT_SHAPE, model.generators([1, 2]), 'cpu')
    _, full = model.sample(policy, x1, sig, text, 1.0, text, 'sage', ETA, model.generators([3, 4]), keep=model.RECORDS)
    _, same = model.sample(policy, x1, sig, text, 1.0, text, 'sage', ETA, model.generators([3, 4]), keep=model.RECORDS,
                           window=range(6))
    assert all(torch.equal(full[k], same[k]) for k in full)  # a window of every step: the sampler without one, bitwise
    _, rec = model.sample(policy, x1, sig, text, 1.0, text, 'sage', ETA, model.generators([3, 4]), keep=model.RECORDS, window=[2, 3])
    for t in range(6):
        x, nxt, mean, s = rec['xs'][:, t], rec['xs'][:, t + 1], rec['means'][:, t], sig[t].expand(2)
        if t in (2, 3):
            assert (rec['stds'][:, t] > 0).all() and (rec['logps'][:, t] != 0).all() and not torch.equal(nxt, mean)
        else:  # the Euler step x + dt v, no noise and no log-prob
            euler = x + (sig[t + 1].double() - sig[t].double()).float() * model.velocity(policy, x, s, text)
            assert (rec['stds'][:, t] == 0).all() and (rec['logps'][:, t] == 0).all() and torch.equal(nxt, mean)
            assert torch.allclose(nxt, euler, rtol=0, atol=1e-6)


# train.py with sde.rollout, sde.step and the loss pieces wrapped: per rank, each rollout's window, stds
# and log-probs, and each trained step's std (sde.step with grad) and the S_t scale applied to its
# clipped term (per_clip / clipped: the KL term adds lambda_KL * KL, ~1e-7 of it here), written to
# $RECORD_<rank>.json at exit
RECORDER = '''
import atexit, json, os, runpy, sys, torch
sys.path.insert(0, os.getcwd())  # run as a file (torchrun takes no -c): the repository root
import sde
from extras import diagnostics
from models import policy
log = dict(rollouts=[], losses=[])
sample, step, add = sde.rollout, sde.step, diagnostics.UpdateStats.add
seen = {}
def sampled(*args, keep=(), steps=None, **kw):  # the rollout keeps no stds at the defaults: asked for here
    x, rec = sample(*args, keep=tuple(keep) + ('stds',) * ('stds' not in keep) if keep else keep, steps=steps, **kw)
    if keep:
        log['rollouts'].append(dict(window=list(steps), stds=rec['stds'].tolist(), logps=rec['logps'].tolist()))
        if 'stds' not in keep:
            del rec['stds']  # train.py gets what it asked for
    return x, rec
def stepped(*args, **kw):
    out = step(*args, **kw)
    if torch.is_grad_enabled() and kw.get('x_next') is not None:  # a trained step (the anchor's has no grad)
        seen['std'] = out.std
    return out
def added(self, loss, terms, *rest):  # the scale on the policy term: its PPO clipped term, written out here
    r, a = terms['ratio'], terms['adv']
    clipped = torch.maximum(-a * r, -a * r.clamp(1 - 1e-4, 1 + 1e-4))
    keep = clipped != 0  # a zero advantage carries no scale
    log['losses'].append(dict(std=seen['std'][keep].tolist(), scale=(terms['policy'] / clipped)[keep].tolist(),
                              rollout=len(log['rollouts']) - 1))
    return add(self, loss, terms, *rest)
sde.rollout, sde.step, diagnostics.UpdateStats.add = sampled, stepped, added
atexit.register(lambda: json.dump(log, open(os.environ['RECORD'] + '_' + os.environ.get('RANK', '0') + '.json', 'w')))
sys.argv = sys.argv[1:]
runpy.run_path('train.py', run_name='__main__')
'''


def hand_count(iters, evals, world=1, P=2, G=2, steps=N, n_train=2, cfg=1.0, diag=True, n_eval=16, updates=1):
    """Transformer passes (clips x CFG branches) by kind after `iters` iterations and `evals` held-out
    evaluations, counted by hand from the settings (dual KL: one anchor forward per trained step)."""
    b = 2 if cfg != 1.0 else 1
    per_diag = 4 * world * b if diag else 0  # first, last, and the middle step twice (policy, KL): 1 clip a rank
    old = iters * P * G * n_train * b if updates > 1 else 0  # the old log-probs recomputed in the update's shape
    return dict(rollout=iters * P * G * steps * b, old=old, anchor=iters * P * G * n_train * b, update=iters * P * G * n_train * b,
                diag_anchor=iters * per_diag, diag=iters * per_diag, eval=evals * n_eval * steps * b)


def logged(out):
    return [{k[7:]: v for k, v in r.items() if k.startswith('passes_')} for r in metrics(out) if 'reward' in r]


def check_formula(rows, settings):
    """bench/compute.py's passes per iteration (the user's full-size table comes from it) == train.py's count."""
    p, _ = load_bench().passes_per_iter(dict(dict(num_steps=N, shift=SHIFT, eta=ETA, sampler='sage', cfg=1.0), **settings), 4)
    for before, after in zip([dict.fromkeys(p, 0)] + rows, rows):
        assert {k: after[k] - before[k] for k in p} == p


def load_bench():
    """bench/compute.py's functions, without running its main (settings at their defaults)."""
    from test_verdicts import load
    return load('compute')


def test_full_window_is_bitwise_no_window(tmp_path, monkeypatch):
    a, b = str(tmp_path / 'a'), str(tmp_path / 'b')
    run_here(monkeypatch, SMALL + [f'--out_dir={a}', '--max_iters=2'])
    run_here(monkeypatch, SMALL + [f'--out_dir={b}', '--max_iters=2', f'--sde_window={N}'])
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    drop = lambda r: {k: v for k, v in r.items() if not k.startswith(('t_', 'peak_mem'))}  # wall time, memory
    ra, rb = [drop(r) for r in metrics(a)], [drop(r) for r in metrics(b)]
    assert ra == rb and len(ra) == 4  # iteration 0's evaluation, 2 iterations, the last evaluation
    # the toy's timestep_fraction 0.5 of 4 steps: 2 trained a clip; evaluations at iterations 0 and 2 (logged after)
    assert logged(a) == [hand_count(1, 1), hand_count(2, 1)]
    check_formula(logged(a), dict(timestep_fraction=0.5))


def check_window(rec, w, world=1):
    """Every rollout's window is w consecutive steps; ODE steps outside carry no log-prob; only window
    steps are trained, each scaled by its own S_t over the window (docs/method.md 3, by hand); ranks agree."""
    logs = [json.load(open(f'{rec}_{r}.json')) for r in range(world)]
    sig = sde.sigmas(N, SHIFT)
    windows = [ro['window'] for ro in logs[0]['rollouts']]
    for log in logs[1:]:
        assert [ro['window'] for ro in log['rollouts']] == windows  # one window for every clip on every rank
    trained = set()
    for log in logs:
        for ro in log['rollouts']:
            win = ro['window']
            assert len(win) == w and win == list(range(win[0], win[0] + w))
            stds, logps = torch.tensor(ro['stds']), torch.tensor(ro['logps'])  # (B, N)
            for t in range(N):
                inside = t in win
                assert ((stds[:, t] > 0) == inside).all() and ((logps[:, t] != 0) == inside).all(), (t, win)
        for call in log['losses']:
            win = log['rollouts'][call['rollout']]['window']
            S, std = hand_S(sig, win)
            for sd, sc in zip(call['std'], call['scale']):
                t = min(win, key=lambda u: abs(std[u] - sd))  # the step this loss term belongs to
                assert sd > 0 and abs(std[t] - sd) < 1e-5 * std[t], (sd, std)  # a window step, never an ODE one
                assert abs(sc - S[t]) < 1e-5 * S[t], (t, sc, S)  # scaled by S_t of that very step
                trained.add((call['rollout'], t))
    assert len({t for _, t in trained}) > 1  # several different steps were trained (and checked)
    return windows


def test_window_trains_only_its_steps_with_their_own_scales_and_counts_survive_resume(tmp_path, monkeypatch):
    out, rec, runner = str(tmp_path / 'win'), str(tmp_path / 'rec'), tmp_path / 'recorder.py'
    runner.write_text(RECORDER)
    window = ['--sde_window=2', '--timestep_fraction=1.0', '--cfg=2.0']
    args = [str(runner)] + SMALL + window + [f'--out_dir={out}']
    run(args + ['--max_iters=2'], env={'RECORD': rec + 'a'})  # saves at iteration 2
    run(args + ['--max_iters=3', '--init_from=resume'], env={'RECORD': rec + 'b'})
    windows = check_window(rec + 'a', 2) + check_window(rec + 'b', 2)
    assert len(windows) == 3 and len(set(map(tuple, windows))) > 1  # the window moves between iterations
    # the same 3 iterations uninterrupted: bitwise the resumed run (weights, optimizer state, every logged
    # figure of the training rows but the evaluation count: the first run also evaluated at its end)
    ref = str(tmp_path / 'ref')
    run_here(monkeypatch, SMALL + window + [f'--out_dir={ref}', '--max_iters=3'])
    wa, wb = weights(ref), weights(out)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    from infra import checkpoint
    oa, ob = (checkpoint.read_tensors(os.path.join(d, 'ckpt_000003'), 'optim') for d in (ref, out))
    # (the resumed run also holds a zero state for the weights that never get a gradient: checkpoint.py)
    assert oa and set(oa) <= set(ob) and all(torch.equal(oa[k], ob[k]) for k in oa)
    drop = lambda r: {k: v for k, v in r.items() if not k.startswith(('t_', 'peak_mem', 'passes_eval'))}  # noqa: E731
    ra, rb = ([drop(r) for r in metrics(d) if 'reward' in r] for d in (ref, out))
    assert ra == rb and len(ra) == 3
    # counts by hand: 2 trained steps a clip, 2 CFG branches; evaluations at iteration 0 and at the end
    # of the first run (2) are in the resumed run's iteration 3, the one at its end (3) comes after
    kw = dict(n_train=2, cfg=2.0)
    assert logged(out) == [hand_count(1, 1, **kw), hand_count(2, 1, **kw), hand_count(3, 2, **kw)]
    check_formula(logged(out), dict(sde_window=2, cfg=2.0))


@pytest.mark.slow  # .ci/run's slow tier: the README's command stays under 10 minutes
def test_window_on_two_ranks(tmp_path):
    out, rec, runner = str(tmp_path / 'fsdp'), str(tmp_path / 'rec'), tmp_path / 'recorder.py'
    runner.write_text(RECORDER)
    run([str(runner)] + SMALL + [f'--out_dir={out}', '--max_iters=2', '--sde_window=3', '--timestep_fraction=1.0'],
        torchrun=True, env={'RECORD': rec})
    check_window(rec, 3, world=2)
    assert logged(out) == [hand_count(k, 1, world=2, n_train=3) for k in (1, 2)]  # summed over both ranks


def fake(bc, label, s, fn, iters=40, every=5, per_iter=1000):
    """A cached cell of setting `label`, seed s: held-out composite fn(passes) every `every` iterations,
    per_iter forward-equivalent training passes an iteration (all of them rollout forwards)."""
    ov = bc.plan()[label][0]
    rows = [dict(iter=k, reward=0.5, **{f'passes_{x}': (per_iter * k if x == 'rollout' else 0) for x in bc.TRAINING})
            for k in range(1, iters + 1)]
    evals = [dict(iter=i, composite=fn(per_iter * i)) for i in range(0, iters + 1, every)]
    cell = dict(overrides=ov, iters=rows, evals=evals, before=evals[0], final=evals[-1], model_hash=bc.C.MODEL_HASH)
    with open(os.path.join(bc.C.OUT, 'cells', bc.name(ov, s) + '.json'), 'w') as f:
        json.dump(cell, f)


def test_bench_verdicts_of_fabricated_curves(tmp_path):
    bc = load_bench()
    bc.C.setup(str(tmp_path), 1, 0.0)
    P, spread = 40000.0, [0.0, 0.1, -0.05, 0.03, -0.08]  # the default's passes; seeds differ far more than settings
    g = torch.Generator().manual_seed(0)
    for s in range(5):
        base = 0.5 + spread[s]
        fake(bc, bc.DEFAULT, s, lambda x: base + 0.2 * x / P)
        fake(bc, 'timestep_fraction 0.5', s, lambda x: base + 0.2 * min(1.0, 4 * x / P))  # 4x as fast, then flat
        fake(bc, 'timestep_fraction 0.25', s, lambda x: base + 0.1 * x / P)  # half as fast: never gets there
        noise = 0.03 * torch.randn(1, generator=g).item()
        fake(bc, 'sde_window 2', s, lambda x: base + 0.2 * x / P + noise * x / P)  # as good, give or take
    runs = {k: [bc.C.cached(bc.name(bc.plan()[k][0], s)) for s in range(5)] for k in bc.SETTINGS}
    res = bc.compare(runs)
    # by hand: the default's target is the mean of its last 3 evaluations, 0.5 + 0.2 (30 + 35 + 40) / 120 = 0.675;
    # the fast curve's trailing means at 15k and 20k passes are 0.5 + 0.2 (1/2 + 1 + 1) / 3 and 0.7: it crosses
    # 0.675 at 15000 + 5000 (0.675 - 0.6667) / (0.7 - 0.6667) = 16250; the default itself only at its end, 40000
    fast = res['timestep_fraction 0.5']
    assert fast['ratio']['mean'] == pytest.approx(16250 / 40000, rel=1e-6) and fast['reached'] == 5
    assert fast['verdict'] == "reaches the default's quality with <= 0.5x the passes"
    assert fast['diff']['mean'] == pytest.approx(0.7 - 0.675, abs=1e-9)  # at equal passes: flat at 0.7
    slow = res['timestep_fraction 0.25']
    assert slow['verdict'] == 'worse' and slow['reached'] == 0 and slow['ratio']['mean'] == pytest.approx(1.0)
    assert res['sde_window 2']['verdict'] == 'cannot be told'
    assert res['sde_window 4']['verdict'] == 'not run'
    # the report: files, the README blocks, the user's table (the default at full size: bench/fullsize.md's 0.19 h)
    import subprocess, sys
    p = subprocess.run([sys.executable, '-m', 'bench.compute', '--run=False', f'--out={tmp_path}'], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    md = (tmp_path / 'README.md').read_text()
    assert '<!-- bench.compute:begin' in md and '**Incomplete**: 10 of 30 runs' in md
    assert "| default (every step) | timestep_fraction=1.0 | 20/20 | 1280/1280/1280 | 1.51 | 0.189 |" in md
    full = json.loads((tmp_path / 'compute.json').read_text())['full']
    assert full['sde_window 2']['passes'] == dict(rollout=32 * 20 * 2, anchor=32 * 4 * 2, update=32 * 4 * 2)
