"""
Preemption under torchrun --nproc_per_node=2 (preemption.py, train.py's boundaries). The SIGTERM is sent
at a chosen moment by a hook inside train.py (TRIGGER below: a real os.kill of the process), to ONE rank
only, as a node of a multi-node job is signalled alone; every rank must stop at the same boundary (one
all-reduce of the flag per boundary: a vote that needs every rank signalled fails here). One run of 2
iterations, 2 optimizer steps each, kl_update='backward' (the controller moves in the update), cut 4 times:
1. mid-update of a fresh run (rank 1, after the update's first backward, before its first optimizer step):
   both ranks exit 0 within 20 s with the checkpoint of iteration 0 (the base weights, no optimizer state,
   the controller as it was at the iteration's start); no row of iteration 1 logged;
2. mid-rollout of the resumed run (rank 0, at the rollout's second step): exit 0 within 20 s, that
   checkpoint not rewritten (every file's bytes and mtime as they were);
3. after the iteration's first optimizer step (rank 1): the weights have moved, so the iteration finishes
   (its second optimizer step) and then its checkpoint is written: iteration 1, 2 optimizer steps;
4. during the last evaluation (rank 1, its first sampling step): exit 0 within 20 s, the checkpoint of
   iteration 2 owes the evaluation, which the resumed run does first and logs once;
then the run resumed to the end equals an uninterrupted run bitwise: weights, optimizer state, controller,
every logged figure; and a SIGTERM that finds a peer dead (torchrun stopping the survivors to restart
the group) exits at once without a checkpoint, one line, no traceback. Each rank's exit status is read through a small wrapper between torchrun and train.py.
The moments are hooks, not timings, so the iteration can be short: STEPS sampler steps (a 1-2 s iteration
on 2 cores). PREEMPT_STEPS=170 python -m pytest tests/test_preemption.py runs a >= 60 s iteration (longer
than the launchers' 30 s between SIGTERM and SIGKILL, docs/method.md section 12.1): the exits stay ~1 s.
Cost: 6 torchrun launches, 132 s of CPU in all (measured on a loaded 2-core machine; mostly the
imports of their 3 processes each).
"""
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from test_train import ROOT, metrics, run, weights

from infra import checkpoint

STEPS = int(os.environ.get('PREEMPT_STEPS', 4))  # sampler steps, every one trained
ARGS = ['--prompts_per_iter=4', '--group_size=2', '--rollout_batch=4', '--train_batch=1', '--timestep_fraction=1.0',
        f'--num_steps={STEPS}', '--diag_every=0', '--eval_every=0', '--eval_samples=1', '--eval_videos=0',
        '--kl_update=backward', '--kl_ratio_target=0', '--updates_per_iter=2', '--max_iters=2', '--save_every=0', '--export_dtype=']
WRAP = '''import os, signal, subprocess, sys
p = subprocess.Popen([sys.executable] + sys.argv[1:])
signal.signal(signal.SIGTERM, lambda s, f: None)  # torchrun signals the process group: train.py has it too
rc = p.wait()
with open(os.path.join(os.environ['RC_DIR'], 'rc' + os.environ['RANK']), 'w') as f:
    f.write(str(rc))
sys.exit(rc)
'''
# train.py with a hook that SIGTERMs this process on rank $PREEMPT_RANK at the first $PREEMPT_AT of the run:
# 'rollout' (the rollout's second step), 'update' (right after the update's first backward),
# 'stepped' (right after the first optimizer step), 'eval' (an evaluation's first sampling step)
TRIGGER = '''
import os, runpy, signal, sys, time
sys.path.insert(0, os.getcwd())  # run as a file (torchrun takes no -c): the repository root
import sde
from extras import diagnostics
from infra import preemption
from models import evaluate, policy as model
at, fired = os.environ['PREEMPT_AT'], []
def term():
    if not fired:
        fired.append(1)
        print(f'TRIGGER {at} {time.time():.3f}', flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
def at_step(n, boundary):  # the sampler's boundary callback, with the signal before its n-th call
    calls = []
    def b():
        calls.append(1)
        if len(calls) == n:
            term()
        boundary()
    return b
if os.environ['RANK'] == os.environ['PREEMPT_RANK']:
    if at == 'rollout':
        inner = sde.rollout
        sde.rollout = lambda *a, keep=(), boundary=None, **kw: inner(
            *a, keep=keep, boundary=at_step(2, boundary) if keep else boundary, **kw)
    if at == 'eval':
        inner_eval = evaluate.sample
        evaluate.sample = lambda *a, boundary=None, **kw: inner_eval(*a, boundary=at_step(1, boundary), **kw)
    if at == 'update':  # right after the update's first backward
        add = diagnostics.UpdateStats.add
        def added(self, *a):
            term()
            return add(self, *a)
        diagnostics.UpdateStats.add = added
    if at == 'stepped':
        stepped = preemption.Preemption.stepped
        def after_step(self):
            stepped(self)
            term()
        preemption.Preemption.stepped = after_step
sys.argv = sys.argv[1:]
runpy.run_path('train.py', run_name='__main__')
'''


def preempt(tmp, out, rank, at, resume=True):
    """Run ARGS under torchrun, each rank through WRAP and TRIGGER, with the SIGTERM at `at` on `rank`;
    returns (seconds from the SIGTERM to the end, each rank's exit status, log)."""
    rc_dir = os.path.join(tmp, 'rc')
    os.makedirs(rc_dir, exist_ok=True)
    for f in os.listdir(rc_dir):
        os.remove(os.path.join(rc_dir, f))
    for name, text in (('wrap.py', WRAP), ('trigger.py', TRIGGER)):
        with open(os.path.join(tmp, name), 'w') as f:
            f.write(text)
    log = os.path.join(tmp, 'log.txt')
    env = dict(os.environ, OMP_NUM_THREADS='1', TOKENIZERS_PARALLELISM='false', RC_DIR=rc_dir, PREEMPT_AT=at,
               PREEMPT_RANK=str(rank))
    args = [os.path.join(tmp, 'trigger.py'), 'train.py', 'config/toy.py'] + ARGS + [f'--out_dir={out}'] + \
        [f'--eval_prompts={tmp}/eval.txt'] + (['--init_from=resume'] if resume else [])
    with open(log, 'w') as f:
        subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2',
                        os.path.join(tmp, 'wrap.py')] + args, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                       timeout=900)
    end = time.time()
    text = open(log).read()
    sent = [float(t) for t in re.findall(r'TRIGGER \w+ ([0-9.]+)', text)]  # (after a progress bar, maybe)
    assert len(sent) == 1, text[-3000:]  # signalled once, on one rank
    assert f'rank {rank}: SIGTERM' in text and f'rank {1 - rank}: SIGTERM' not in text, text[-3000:]
    rcs = {f: open(os.path.join(rc_dir, f)).read() for f in sorted(os.listdir(rc_dir))}
    assert rcs == {'rc0': '0', 'rc1': '0'}, (rcs, text[-3000:])
    return end - sent[0], text


def ckpts(out):
    return sorted(d for d in os.listdir(out) if d.startswith('ckpt_'))


def files_of(path):
    """Every file's bytes and mtime: a rewrite with the same sizes (or the same bytes) shows."""
    return {f: (open(os.path.join(path, f), 'rb').read(), os.stat(os.path.join(path, f)).st_mtime_ns)
            for f in os.listdir(path)}


def trained(out):
    return [r['iter'] for r in metrics(out) if 'reward' in r]


@pytest.mark.slow  # ~100 s alone, the suite's longest: .ci/run's slow tier keeps the README command < 10 min
def test_sigterm_on_one_rank_at_every_kind_of_boundary_resume_bitwise(tmp_path):
    tmp = str(tmp_path)
    with open(os.path.join(tmp, 'eval.txt'), 'w') as f:  # one held-out prompt per rank: a cheap evaluation
        f.writelines(open(os.path.join(ROOT, 'assets/toy/eval_prompts.txt')).readlines()[:2])
    ref, out = os.path.join(tmp, 'ref'), os.path.join(tmp, 'run')
    run(['train.py', 'config/toy.py'] + ARGS + [f'--out_dir={ref}', f'--eval_prompts={tmp}/eval.txt'], torchrun=True,
        timeout=1800)  # the uninterrupted run
    # 1. mid-update of a fresh run: the checkpoint of iteration 0, its controller as before the update
    took, log = preempt(tmp, out, 1, 'update', resume=False)
    assert took < 20 and 'preempted' in log, (took, log[-3000:])
    print(f'SIGTERM on rank 1 mid-update: out in {took:.1f} s')
    assert ckpts(out) == ['ckpt_000000'] and trained(out) == []  # iteration 1 was cut, not finished
    ckpt = os.path.join(out, 'ckpt_000000')
    loop = checkpoint.read_loop(ckpt)
    assert checkpoint.damage(ckpt) is None and loop['iter_num'] == 0 and loop['opt_steps'] == 0
    assert loop['optimizer_state'] is False and loop['controller']['updates'] == 0  # restored: the update had moved it
    before = files_of(ckpt)
    # 2. mid-rollout of the resumed run: nothing has moved since that checkpoint, it is not rewritten
    took, log = preempt(tmp, out, 0, 'rollout')
    assert took < 20 and 'resumed from' in log and 'preempted' in log and 'update:' not in log, (took, log[-3000:])
    print(f'SIGTERM on rank 0 mid-rollout: out in {took:.1f} s')
    assert files_of(ckpt) == before and ckpts(out) == ['ckpt_000000'] and trained(out) == []
    # 3. after the first of the iteration's 2 optimizer steps: the iteration ends, then its checkpoint
    _, log = preempt(tmp, out, 1, 'stepped')
    assert 'preempted: checkpoint of iteration 1 written' in log, log[-3000:]
    loop = checkpoint.read_loop(os.path.join(out, 'ckpt_000001'))
    assert loop['iter_num'] == 1 and loop['opt_steps'] == 2 and not loop['eval_owed'] and trained(out) == [1]
    # 4. during the last evaluation: its checkpoint owes the evaluation
    took, log = preempt(tmp, out, 1, 'eval')
    assert took < 20 and 'preempted' in log, (took, log[-3000:])
    print(f'SIGTERM on rank 1 mid-evaluation: out in {took:.1f} s')
    loop = checkpoint.read_loop(os.path.join(out, 'ckpt_000002'))
    assert loop['iter_num'] == 2 and loop['opt_steps'] == 4 and loop['eval_owed'] and trained(out) == [1, 2]
    assert not any('eval_composite' in r and r['iter'] == 2 for r in metrics(out))
    # resumed to the end (the owed evaluation): bitwise the uninterrupted run
    run(['train.py', 'config/toy.py'] + ARGS + [f'--out_dir={out}', f'--eval_prompts={tmp}/eval.txt',
                                                '--init_from=resume'], torchrun=True, timeout=1800)
    wa, wb = weights(ref), weights(out)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    oa, ob = (checkpoint.read_tensors(os.path.join(d, 'ckpt_000002'), 'optim') for d in (ref, out))
    # (the resumed run also holds a zero state for the weights that never get a gradient: checkpoint.py)
    assert oa and set(oa) <= set(ob) and all(torch.equal(oa[k], ob[k]) for k in oa)
    la, lb = (checkpoint.read_loop(os.path.join(d, 'ckpt_000002')) for d in (ref, out))
    assert la['controller'] == lb['controller'] and la['controller']['updates'] > 0
    ra, rb = ([{k: v for k, v in r.items() if not k.startswith(('t_', 'peak_mem'))} for r in metrics(d)] for d in (ref, out))
    assert ra == rb and len(ra) == 4, (ra, rb)  # evaluation 0, iterations 1 and 2, evaluation 2


def test_a_stop_with_a_peer_gone_exits_without_a_checkpoint():
    """Rank 1 dies; rank 0 gets SIGTERM (torchrun stopping the survivors): the stop's first collective
    fails, and rank 0 exits at once with 128 + 15 and one line. Without that it would raise through
    the dead peer with a traceback (gloo) or wait for it (NCCL) instead of dying promptly."""
    import socket
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        port = s.getsockname()[1]
    code = ('import datetime, os, signal, sys, time; sys.path.insert(0, {root!r})\n'
            'import torch.distributed as dist; from infra.preemption import Preemption\n'
            'rank = int(sys.argv[1])\n'
            'dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=rank, world_size=2,\n'
            '                        timeout=datetime.timedelta(seconds=60))\n'
            'p = Preemption(rank); p.begin(lambda: print("saved", flush=True))\n'
            'if rank == 1: os._exit(0)\n'
            'time.sleep(1); os.kill(os.getpid(), signal.SIGTERM); time.sleep(0.2)\n'
            'p.point(); print("still here")').format(root=ROOT, port=port)
    ps = [subprocess.Popen([sys.executable, '-c', code, str(r)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True) for r in (0, 1)]
    out, err = ps[0].communicate(timeout=120)
    ps[1].wait(timeout=60)
    assert ps[0].returncode == 128 + signal.SIGTERM and 'rank 0: SIGTERM, but the stop failed' in out, (out, err)
    assert 'saved' not in out and 'still here' not in out and 'Traceback' not in err, (out, err)


def test_second_sigterm_or_sigint_exits_at_once(tmp_path):
    """The first SIGTERM only asks for a stop at the next boundary; a second, or a SIGINT, ends the
    process at once with 128 + the signal (no cleanup that could touch a checkpoint)."""
    code = ('import os, signal, sys, time; sys.path.insert(0, {root!r}); from infra.preemption import Preemption\n'
            'p = Preemption(); os.kill(os.getpid(), signal.{first}); time.sleep(0.5)\n'
            'assert p.flag and p.requested(); print("asked", flush=True)\n'
            'os.kill(os.getpid(), signal.SIGTERM); time.sleep(5); print("still here")')
    for first, rc in (('SIGTERM', 128 + signal.SIGTERM), ('SIGINT', 128 + signal.SIGINT)):
        r = subprocess.run([sys.executable, '-c', code.format(root=ROOT, first=first)], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == rc, (first, r.returncode, r.stdout, r.stderr[-2000:])
        assert ('asked' in r.stdout) == (first == 'SIGTERM') and 'still here' not in r.stdout
