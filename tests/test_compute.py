"""
Counting the work and the SDE window (issue 24). python -m pytest tests/test_compute.py
- sde.window: w consecutive stochastic steps, every start equally likely, a function of its seed;
  equalizer.scales over a subset against SPEC section 3's formulas written out here;
- model.sample with a window: steps outside it are Euler steps with no log-probability;
- train.py (subprocesses): a window covering every step is bitwise today's run (weights, metrics);
  with a window, only its steps are trained and step t's loss is scaled by S_t of that very step,
  the median over the window (recorded at loss.grpo_loss, computed here from SPEC's formulas);
  the logged transformer passes equal a hand count from the settings, across a resume, and on 2
  ranks under torchrun (gloo), where both ranks train the same window.
Cost: about 2 minutes on 2 busy cores (six short train.py runs, one under torchrun).
"""
import json
import math
import os

import pytest
import torch

import equalizer
import sde
from test_train import ROOT, SMALL, metrics, run, weights

ETA, SHIFT, N = 0.5, 3.0, 4  # the toy's sage, and SMALL's 4 steps


def hand_S(sig, steps, eta=ETA):
    """SPEC 3 for sage, in float64 from the formulas: N_t = |dt - Sigma (1 - s)/(2 s)| / sqrt(Sigma),
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
    import model
    import toy  # noqa: F401  plugs the toy world into model.py
    from prompt_cache import PromptCache, build
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        build(d, 'assets/toy', {'a red circle moving left'}, 'cpu')
        text = model.batch_text(PromptCache(d), ['a red circle moving left'] * 2, 'cpu')
    policy = model.load_policy(os.path.join(ROOT, 'assets/toy'), 'cpu', fsdp=False, checkpointing=False)
    sig = sde.sigmas(6, SHIFT)
    x1 = model.noise(toy.LATENT_SHAPE, model.generators([1, 2]), 'cpu')
    _, full = model.sample(policy, x1, sig, text, 1.0, text, 'sage', ETA, model.generators([3, 4]), keep=True)
    _, same = model.sample(policy, x1, sig, text, 1.0, text, 'sage', ETA, model.generators([3, 4]), keep=True,
                           window=range(6))
    assert all(torch.equal(full[k], same[k]) for k in full)  # a window of every step: today's sampler, bitwise
    _, rec = model.sample(policy, x1, sig, text, 1.0, text, 'sage', ETA, model.generators([3, 4]), keep=True, window=[2, 3])
    for t in range(6):
        x, nxt, mean, s = rec['xs'][:, t], rec['xs'][:, t + 1], rec['means'][:, t], sig[t].expand(2)
        if t in (2, 3):
            assert (rec['stds'][:, t] > 0).all() and (rec['logps'][:, t] != 0).all() and not torch.equal(nxt, mean)
        else:  # the Euler step x + dt v, no noise and no log-prob
            euler = x + (sig[t + 1].double() - sig[t].double()).float() * model.velocity(policy, x, s, text)
            assert (rec['stds'][:, t] == 0).all() and (rec['logps'][:, t] == 0).all() and torch.equal(nxt, mean)
            assert torch.allclose(nxt, euler, rtol=0, atol=1e-6)


# train.py with model.sample and loss.grpo_loss wrapped: per rank, each rollout's window, stds and
# log-probs, and each loss call's std and S_t scale, written to $RECORD_<rank>.json at exit
RECORDER = '''
import atexit, json, os, runpy, sys, torch
sys.path.insert(0, os.getcwd())  # run as a file (torchrun takes no -c): the repository root
import loss, model
log = dict(rollouts=[], losses=[])
sample, grpo_loss = model.sample, loss.grpo_loss
def sampled(*args, keep=False, window=None, **kw):
    x, rec = sample(*args, keep=keep, window=window, **kw)
    if keep:
        log['rollouts'].append(dict(window=list(window), stds=rec['stds'].tolist(), logps=rec['logps'].tolist()))
    return x, rec
def recorded(*args, **kw):
    scale = torch.as_tensor(kw['scale']).expand_as(args[6])  # (n,) S_t of each clip's step; std args[6] (n,)
    log['losses'].append(dict(std=args[6].tolist(), scale=scale.tolist(), rollout=len(log['rollouts']) - 1))
    return grpo_loss(*args, **kw)
model.sample, loss.grpo_loss = sampled, recorded
atexit.register(lambda: json.dump(log, open(os.environ['RECORD'] + '_' + os.environ.get('RANK', '0') + '.json', 'w')))
sys.argv = sys.argv[1:]
runpy.run_path('train.py', run_name='__main__')
'''


def hand_count(iters, evals, world=1, P=2, G=2, steps=N, n_train=2, cfg=1.0, diag=True, n_eval=16):
    """Transformer passes (clips x CFG branches) by kind after `iters` iterations and `evals` held-out
    evaluations, counted by hand from the settings (dual KL: one anchor forward per trained step)."""
    b = 2 if cfg != 1.0 else 1
    per_diag = 4 * world * b if diag else 0  # first, last, and the middle step twice (policy, KL): 1 clip a rank
    return dict(rollout=iters * P * G * steps * b, anchor=iters * P * G * n_train * b, update=iters * P * G * n_train * b,
                diag_anchor=iters * per_diag, diag=iters * per_diag, eval=evals * n_eval * steps * b)


def logged(out):
    return [{k[7:]: v for k, v in r.items() if k.startswith('passes_')} for r in metrics(out) if 'reward' in r]


def test_full_window_is_bitwise_today(tmp_path):
    a, b = str(tmp_path / 'a'), str(tmp_path / 'b')
    run(SMALL + [f'--out_dir={a}', '--max_iters=2'])
    run(SMALL + [f'--out_dir={b}', '--max_iters=2', f'--sde_window={N}'])
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    drop = lambda r: {k: v for k, v in r.items() if not k.startswith(('t_', 'peak_mem'))}  # wall time, memory
    ra, rb = [drop(r) for r in metrics(a)], [drop(r) for r in metrics(b)]
    assert ra == rb and len(ra) == 4  # iteration 0's evaluation, 2 iterations, the last evaluation
    # the toy's timestep_fraction 0.5 of 4 steps: 2 trained a clip; evaluations at iterations 0 and 2 (logged after)
    assert logged(a) == [hand_count(1, 1), hand_count(2, 1)]


def check_window(rec, w, world=1):
    """Every rollout's window is w consecutive steps; ODE steps outside carry no log-prob; only window
    steps are trained, each scaled by its own S_t over the window (SPEC 3, by hand); ranks agree."""
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


def test_window_trains_only_its_steps_with_their_own_scales_and_counts_survive_resume(tmp_path):
    out, rec, runner = str(tmp_path / 'win'), str(tmp_path / 'rec'), tmp_path / 'recorder.py'
    runner.write_text(RECORDER)
    args = [str(runner)] + SMALL + [f'--out_dir={out}', '--sde_window=2', '--timestep_fraction=1.0', '--cfg=2.0']
    run(args + ['--max_iters=2'], env={'RECORD': rec + 'a'})  # saves at iteration 2
    run(args + ['--max_iters=3', '--init_from=resume'], env={'RECORD': rec + 'b'})
    windows = check_window(rec + 'a', 2) + check_window(rec + 'b', 2)
    assert len(windows) == 3 and len(set(map(tuple, windows))) > 1  # the window moves between iterations
    # counts by hand: 2 trained steps a clip, 2 CFG branches; evaluations at iteration 0 and at the end
    # of the first run (2) are in the resumed run's iteration 3, the one at its end (3) comes after
    kw = dict(n_train=2, cfg=2.0)
    assert logged(out) == [hand_count(1, 1, **kw), hand_count(2, 1, **kw), hand_count(3, 2, **kw)]


def test_window_on_two_ranks(tmp_path):
    out, rec, runner = str(tmp_path / 'fsdp'), str(tmp_path / 'rec'), tmp_path / 'recorder.py'
    runner.write_text(RECORDER)
    run([str(runner)] + SMALL + [f'--out_dir={out}', '--max_iters=2', '--sde_window=3', '--timestep_fraction=1.0'],
        torchrun=True, env={'RECORD': rec})
    check_window(rec, 3, world=2)
    assert logged(out) == [hand_count(k, 1, world=2, n_train=3) for k in (1, 2)]  # summed over both ranks
