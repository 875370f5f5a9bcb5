"""
Preemption under torchrun --nproc_per_node=2 (preemption.py, train.py's boundaries), with an
iteration long enough (>= 60 s on 2 CPU cores) that finishing it would outlast the launchers' 30 s
between SIGTERM and SIGKILL:
- SIGTERM mid-update of a fresh run: both ranks exit 0 within 20 s, having published the checkpoint
  of the last finished iteration (0: the base weights, no optimizer state yet; the lambda_KL
  controller, which kl_update='backward' moves during the update, as it was at the iteration's start);
- SIGTERM mid-rollout of the resumed run: exit 0 within 20 s, that checkpoint left as it was (not
  rewritten);
- the run resumed to the end equals an uninterrupted run bitwise: weights, optimizer state,
  controller, logged figures;
- a SIGTERM that finds a peer dead (torchrun stopping the survivors to restart the group) exits at
  once without a checkpoint, one line, no traceback.
Each rank's exit status is read through a small wrapper between torchrun and train.py (torchrun's
own status is non-zero after a SIGTERM whatever its workers did).
Without the fix (the iteration finishes first) torchrun SIGKILLs both ranks 30 s after the SIGTERM.
Cost: four torchrun launches, two of them a whole iteration: 5.9 min of CPU (user + sys, both ranks,
every launch), so ~3 min on 2 free cores; measured 11.6 min wall on a shared 2-core machine at load
~10 (one iteration 324 s there). It scales with STEPS: the suite runs STEPS = 60 (~1.2 min, a ~22 s iteration: the exits take 2-4 s, so
what they show does not depend on the iteration's length); PREEMPT_STEPS=170 python -m pytest
tests/test_preemption.py runs the >= 60 s iteration of the issue (run by hand on 2 idle cores: a 76 s
iteration, out in 1.1 s mid-update and 0.5 s mid-rollout; 324 s under load: 3.7 s and 2.3 s).
"""
import os
import signal
import subprocess
import sys
import time

import torch

from test_train import ROOT, metrics, run, weights

import checkpoint

STEPS = int(os.environ.get('PREEMPT_STEPS', 60))  # sampler steps, every one trained: one iteration of 4 clips a rank (one batched forward
             # per rollout step, one clip per update micro-step) costs ~0.35 s of CPU a step and rank,
             # so ~60 s on 2 unloaded cores at 170; each boundary (a forward, a micro-step) is < 0.5 s
ARGS = ['train.py', 'config/toy.py', '--prompts_per_iter=4', '--group_size=2', '--rollout_batch=4', '--train_batch=1',
        '--timestep_fraction=1.0', f'--num_steps={STEPS}', '--diag_every=0', '--eval_every=0', '--eval_samples=1',
        '--eval_videos=0', '--kl_update=backward', '--max_iters=1', '--export_dtype=']
WRAP = '''import os, signal, subprocess, sys
p = subprocess.Popen([sys.executable] + sys.argv[1:])
signal.signal(signal.SIGTERM, lambda s, f: None)  # torchrun signals the process group: train.py has it too
rc = p.wait()
with open(os.path.join(os.environ['RC_DIR'], 'rc' + os.environ['RANK']), 'w') as f:
    f.write(str(rc))
sys.exit(rc)
'''


def preempt(args, out, after, tmp, delay):
    """Start args under torchrun (each rank through WRAP), SIGTERM once `after` appears in the log
    (plus delay s); returns (seconds from SIGTERM to the end, each rank's exit status, log)."""
    rc_dir = os.path.join(tmp, 'rc')
    os.makedirs(rc_dir, exist_ok=True)
    for f in os.listdir(rc_dir):
        os.remove(os.path.join(rc_dir, f))
    with open(os.path.join(tmp, 'wrap.py'), 'w') as f:
        f.write(WRAP)
    log = os.path.join(tmp, 'log.txt')
    env = dict(os.environ, OMP_NUM_THREADS='1', TOKENIZERS_PARALLELISM='false', RC_DIR=rc_dir)
    with open(log, 'w') as f:
        p = subprocess.Popen([sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2',
                              os.path.join(tmp, 'wrap.py')] + args + [f'--out_dir={out}'],
                             cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    t0 = time.time()
    while after not in open(log).read():
        assert p.poll() is None and time.time() - t0 < 600, open(log).read()[-3000:]
        time.sleep(0.1)
    time.sleep(delay)
    assert p.poll() is None
    p.send_signal(signal.SIGTERM)  # torchrun forwards it to its workers
    t1 = time.time()
    p.wait(timeout=120)
    took = time.time() - t1
    rcs = {f: open(os.path.join(rc_dir, f)).read() for f in sorted(os.listdir(rc_dir))}
    return took, rcs, open(log).read()


def files_of(path):
    return {f: (os.path.getsize(os.path.join(path, f)), os.path.getmtime(os.path.join(path, f))) for f in os.listdir(path)}


def test_sigterm_mid_update_and_mid_rollout_resume_bitwise(tmp_path):
    tmp = str(tmp_path)
    with open(os.path.join(tmp, 'eval.txt'), 'w') as f:  # one held-out prompt per rank: a cheap evaluation
        f.writelines(open(os.path.join(ROOT, 'assets/toy/eval_prompts.txt')).readlines()[:2])
    args = ARGS + [f'--eval_prompts={tmp}/eval.txt']
    ref, out = os.path.join(tmp, 'ref'), os.path.join(tmp, 'run')
    # the uninterrupted run: one iteration of >= 60 s
    run(args + [f'--out_dir={ref}'], torchrun=True, timeout=1800)
    row = [r for r in metrics(ref) if 'reward' in r][0]
    iteration = row['t_rollout'] + row['t_update']  # >= 60 s here; not asserted: a faster machine is no failure
    print(f'one iteration: {iteration:.0f} s (rollout {row["t_rollout"]:.0f} s)')
    # 1. SIGTERM mid-update of a fresh run: the checkpoint of iteration 0, exit 0 within 20 s
    took, rcs, log = preempt(args, out, 'update:', tmp, delay=2)  # tqdm's bar
    assert rcs == {'rc0': '0', 'rc1': '0'} and took < min(20, iteration / 3), (took, rcs, log[-3000:])
    print(f'SIGTERM mid-update: out in {took:.1f} s')
    assert 'rank 0: SIGTERM' in log and 'rank 1: SIGTERM' in log and 'preempted' in log
    assert 'update:' in log.split('rank 0: SIGTERM')[0]  # it was in the update, several micro-steps in
    ckpt = os.path.join(out, 'ckpt_000000')
    assert sorted(d for d in os.listdir(out) if d.startswith('ckpt_')) == ['ckpt_000000']
    loop = checkpoint.read_loop(ckpt)
    assert checkpoint.damage(ckpt) is None and loop['iter_num'] == 0 and loop['opt_steps'] == 0
    assert loop['optimizer_state'] is False and loop['controller']['updates'] == 0  # restored: the update had moved it
    before = files_of(ckpt)
    # 2. SIGTERM mid-rollout of the resumed run: exit 0 within 20 s, the checkpoint left as it was
    took, rcs, log = preempt(args + ['--init_from=resume'], out, 'rollout:', tmp, delay=1)
    assert rcs == {'rc0': '0', 'rc1': '0'} and took < min(20, iteration / 3), (took, rcs, log[-3000:])
    print(f'SIGTERM mid-rollout: out in {took:.1f} s')
    assert 'resumed from' in log and 'preempted' in log and 'update:' not in log
    assert files_of(ckpt) == before and sorted(d for d in os.listdir(out) if d.startswith('ckpt_')) == ['ckpt_000000']
    # 3. resumed to the end: bitwise the uninterrupted run
    run(args + [f'--out_dir={out}', '--init_from=resume'], torchrun=True, timeout=1800)
    wa, wb = weights(ref), weights(out)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    oa, ob = (checkpoint.read_tensors(os.path.join(d, 'ckpt_000001'), 'optim') for d in (ref, out))
    assert oa and oa.keys() == ob.keys() and all(torch.equal(oa[k], ob[k]) for k in oa)
    la, lb = (checkpoint.read_loop(os.path.join(d, 'ckpt_000001')) for d in (ref, out))
    assert la['controller'] == lb['controller'] and la['controller']['updates'] > 0
    ra, rb = ([{k: v for k, v in r.items() if not k.startswith(('t_', 'peak_mem'))} for r in metrics(d)] for d in (ref, out))
    assert ra == rb, (ra, rb)


def test_a_stop_with_a_peer_gone_exits_without_a_checkpoint():
    """Rank 1 dies; rank 0 gets SIGTERM (torchrun stopping the survivors): the stop's first collective
    fails, and rank 0 exits at once with 128 + 15 and one line. Without that it would raise through
    the dead peer with a traceback (gloo) or wait for it (NCCL) instead of dying promptly."""
    import socket
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        port = s.getsockname()[1]
    code = ('import datetime, os, signal, sys, time; sys.path.insert(0, {root!r})\n'
            'import torch.distributed as dist; from preemption import Preemption\n'
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
    code = ('import os, signal, sys, time; sys.path.insert(0, {root!r}); from preemption import Preemption\n'
            'p = Preemption(); os.kill(os.getpid(), signal.{first}); time.sleep(0.5)\n'
            'assert p.flag and p.requested(); print("asked", flush=True)\n'
            'os.kill(os.getpid(), signal.SIGTERM); time.sleep(5); print("still here")')
    for first, rc in (('SIGTERM', 128 + signal.SIGTERM), ('SIGINT', 128 + signal.SIGINT)):
        r = subprocess.run([sys.executable, '-c', code.format(root=ROOT, first=first)], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == rc, (first, r.returncode, r.stdout, r.stderr[-2000:])
        assert ('asked' in r.stdout) == (first == 'SIGTERM') and 'still here' not in r.stdout

