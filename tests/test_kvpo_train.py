"""
kvpo/train.py, run as a user runs it (processes, torchrun), on a streaming toy model made here (the toy_ar
training script for 2 steps: random-ish weights, the family's layout). python -m pytest tests/test_kvpo_train.py
- a run (in this process) writes its iterations, held-out evaluations (at 0 and the end) and a checkpoint;
  each prompt's fork is an eligible one; the first iteration's ratio is 1 (the rollout is the policy's
  own), the clip inert;
- (slow tier, ~2 min on a loaded 2-core machine) a run stopped at iteration 2 and resumed to 3 equals a run
  of 3 straight (weights, EMA and old policy bitwise; every logged figure but the timings);
- 2 gloo ranks (one prompt each) equal one process with both prompts (slow tier);
- (slow tier) a SIGTERM during iteration 2's first rollout (a real os.kill of the process, from a hook in
  kvpo.rollout) stops the run at the next prompt's boundary with exit 0 and the checkpoint of iteration 1,
  no row of iteration 2 logged; the same command then resumes and equals a run of 2 straight (weights,
  EMA and old policy bitwise; every logged figure but the timings).
"""
import math
import os

import pytest
import torch

from test_train import metrics, run, weights

# kvpo.train with kvpo.rollout wrapped: the $KVPO_TERM_AT-th call (1-based, over the run) first SIGTERMs
# this process, as a scheduler does; the run goes on to its next preemption boundary
TRIGGER = '''
import os, runpy, signal, sys
sys.path.insert(0, os.getcwd())
from kvpo import kvpo
inner, calls = kvpo.rollout, []
def rollout(*a, **kw):
    calls.append(1)
    if len(calls) == int(os.environ['KVPO_TERM_AT']):
        os.kill(os.getpid(), signal.SIGTERM)
    return inner(*a, **kw)
kvpo.rollout = rollout
sys.argv = ['kvpo.train'] + sys.argv[1:]
runpy.run_module('kvpo.train', run_name='__main__')
'''

ARGS = ['-m', 'kvpo.train', 'kvpo/config/toy.py', '--prompts_per_iter=2', '--group=3', '--eval_samples=1',
        '--save_every=0', '--learning_rate=1e-3']
TIMES = ('t_rollout', 't_update')


@pytest.fixture(scope='module')
def model(tmp_path_factory):
    from streaming import toy_ar
    d = str(tmp_path_factory.mktemp('kvpo_model') / 'toy_ar')
    toy_ar.train(steps=2, out=d)
    with open(os.path.join(d, 'eval_prompts.txt')) as f:  # two held-out prompts: an evaluation in seconds
        lines = f.read().splitlines()[:2]
    with open(os.path.join(d, 'eval_prompts.txt'), 'w') as f:
        f.write('\n'.join(lines) + '\n')
    return d


def test_one_run_in_this_process(model, tmp_path, monkeypatch):
    import runpy
    import sys
    out = str(tmp_path / 'run')
    monkeypatch.setattr(sys, 'argv', ['kvpo.train'] + args(model, out, 2, eval_every=2)[2:])
    runpy.run_module('kvpo.train', run_name='__main__')
    rows = metrics(out)
    assert [r['iter'] for r in rows] == [0, 1, 2, 2] and 'eval_composite' in rows[0] and 'loss' in rows[1]
    it = [r for r in rows if 'loss' in r]
    assert it[0]['ratio_max'] == pytest.approx(1.0, abs=1e-5) and it[0]['clip_frac'] == 0  # rollout = policy
    assert all(r['fork'] in (4, 5, 6, 7) and math.isfinite(r['loss']) and r['grad_norm'] > 0 for r in it)
    assert os.path.exists(os.path.join(out, 'latest'))


def args(model, out, iters, eval_every=0):
    return ARGS + [f'--model={model}', f'--train_prompts={model}/train_prompts.txt',
                   f'--eval_prompts={model}/eval_prompts.txt', f'--out_dir={out}', f'--max_iters={iters}',
                   f'--eval_every={eval_every}']


@pytest.mark.slow
def test_resume_equals_a_straight_run(model, tmp_path):
    straight, cut = str(tmp_path / 'straight'), str(tmp_path / 'cut')
    run(args(model, straight, 3, eval_every=3))
    run(args(model, cut, 2, eval_every=3))
    run(args(model, cut, 3, eval_every=3))
    rows = [r for r in metrics(straight) if 'loss' in r]
    assert [r['iter'] for r in rows] == [1, 2, 3]
    assert [r['iter'] for r in metrics(straight) if 'eval_composite' in r] == [0, 3]
    assert rows[0]['ratio_max'] == pytest.approx(1.0, abs=1e-5) and rows[0]['clip_frac'] == 0
    assert all(r['fork'] in (4, 5, 6, 7) and math.isfinite(r['loss']) for r in rows)
    a, b = weights(straight), weights(cut)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    from infra import checkpoint
    latest = lambda out: os.path.join(out, open(os.path.join(out, 'latest')).read().strip())
    ea, eb = checkpoint.read_tensors(latest(straight), 'anchor'), checkpoint.read_tensors(latest(cut), 'anchor')
    assert {k.split('.')[0] for k in ea} == {'ema', 'old'} and all(torch.equal(ea[k], eb[k]) for k in ea)
    strip = lambda rs: [{k: v for k, v in r.items() if k not in TIMES} for r in rs]  # iterations and evaluations
    assert strip(metrics(straight)) == strip(metrics(cut))


@pytest.mark.slow
def test_two_ranks_equal_one_process(model, tmp_path):
    one, two = str(tmp_path / 'one'), str(tmp_path / 'two')
    run(args(model, one, 2, eval_every=2))
    run(args(model, two, 2, eval_every=2), torchrun=True)
    a, b = weights(one), weights(two)
    # float noise of the sums' order (a gradient near 0 that AdamW normalises): ~5e-7; a step is lr = 1e-3
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5
    ra, rb = metrics(one), metrics(two)
    assert len(ra) == len(rb) == 4  # eval 0, iterations 1 and 2, eval 2
    for x, y in zip(ra, rb):
        for k, v in x.items():  # an evaluation samples from weights ~5e-7 apart: scores 1e-5 apart
            if k not in TIMES and isinstance(v, float):
                assert y[k] == pytest.approx(v, rel=1e-5, abs=1e-4 if k.startswith('eval_') else 1e-7), k


@pytest.mark.slow
def test_sigterm_mid_iteration_saves_the_last_finished_one_and_resumes_bitwise(model, tmp_path):
    straight, cut = str(tmp_path / 'straight'), str(tmp_path / 'cut')
    run(args(model, straight, 2, eval_every=2))
    # 2 prompts an iteration: call 3 is iteration 2's first rollout; the stop comes before the second
    p = run(['-c', TRIGGER] + args(model, cut, 2, eval_every=2)[2:], env=dict(KVPO_TERM_AT='3'))
    assert 'preempted:' in p.stdout and 'ckpt_000001' in p.stdout, p.stdout[-2000:]
    assert open(os.path.join(cut, 'latest')).read().strip() == 'ckpt_000001'
    assert [r['iter'] for r in metrics(cut)] == [0, 1]  # the base model's evaluation, iteration 1
    run(args(model, cut, 2, eval_every=2))  # the same command continues
    a, b = weights(straight), weights(cut)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    from infra import checkpoint
    latest = lambda out: os.path.join(out, open(os.path.join(out, 'latest')).read().strip())
    ea, eb = checkpoint.read_tensors(latest(straight), 'anchor'), checkpoint.read_tensors(latest(cut), 'anchor')
    assert all(torch.equal(ea[k], eb[k]) for k in ea)
    strip = lambda rs: [{k: v for k, v in r.items() if k not in TIMES} for r in rs]
    assert strip(metrics(straight)) == strip(metrics(cut))
