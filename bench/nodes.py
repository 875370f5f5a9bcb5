"""
train.py on several nodes, simulated on this machine: one torchrun agent per node, each started
from a working directory of its own (a node's own disk for relative paths, with the repository's
config/, assets/ and prompts/ linked in, as a checkout on every node), joined by c10d rendezvous.
Every agent is the command docs/multinode.md gives a user of N real nodes (there the rendezvous
endpoint is the first node's host):
    torchrun --nnodes=N --nproc_per_node=P --rdzv_backend=c10d --rdzv_endpoint=localhost:PORT train.py ...

    python -m bench.nodes                      # the slow checks -> results/nodes.{md,json} (~15 min on 2 busy cores)
    python -m bench.nodes --parts=sbatch,stop  # some again, the others' last results kept
    python -m bench.nodes --parts=none         # the report from nodes.json

The checks (tests/test_nodes.py runs the fast slice: HSDP 2x2 with sp 2, a node-local out_dir, a
killed rank): 2 nodes x 2 ranks, HSDP 2x2 without sp, against one process (weights, every logged
figure); its checkpoint resumed on flat FSDP over 4 ranks of one node and in one process, against
the uninterrupted run; a rank stopped (SIGSTOP: stuck inside a collective) and one killed, how long
until every process has ended; a node-local out_dir, how long until every process has stopped;
train.sbatch under a stand-in for srun (SLURM's srun: one agent a node, --kill-on-bad-exit) to the
end, stopped as SLURM's --signal stops it (SIGTERM to every agent: a checkpoint of the last finished
iteration), and with a rank stuck.
"""
import json
import math
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time

from infra.configurator import configure

# ----------------------------------------------------------------------------- settings
out = 'results'                 # nodes.md and nodes.json go here
work = '/tmp/bench_nodes'       # the simulated nodes' working directories and out_dirs
parts = ''                      # run only these checks (a comma list of CHECKS' names; the others keep their
                                # last results in nodes.json); '' for all
config = configure(globals(), sys.argv[1:] if __name__ == '__main__' else [])  # imported (tests): the defaults
# -----------------------------------------------------------------------------
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECKOUT = ('assets', 'config', 'prompts')  # linked into every node's working directory


def free_port():
    """A port free now, below the kernel's ephemeral range: a port the kernel hands out (bind to 0) can be
    handed again, between this check and the agent's bind, to any outgoing connection of the machine (gloo
    opens many: a test beside this one), and the rendezvous then fails to start."""
    try:
        low = int(open('/proc/sys/net/ipv4/ip_local_port_range').read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default
    rng = random.Random(os.getpid() ^ time.time_ns())
    for _ in range(200):
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(('localhost', port))
                return port
            except OSError:
                continue
    with socket.socket() as s:  # every try taken: the kernel's choice
        s.bind(('localhost', 0))
        return s.getsockname()[1]


def node_dirs(base, nodes):
    """base/node0, base/node1, ...: each a node's working directory, the checkout linked in."""
    dirs = []
    for k in range(nodes):
        d = os.path.join(base, f'node{k}')
        os.makedirs(d, exist_ok=True)
        for name in CHECKOUT:
            if not os.path.exists(os.path.join(d, name)):
                os.symlink(os.path.join(ROOT, name), os.path.join(d, name))
        dirs.append(d)
    return dirs


class Job:
    """N torchrun agents started at once as the nodes of one job (train.py or any script)."""

    def __init__(self, args, dirs, nproc=2, env=None, launcher=()):
        self.dirs, self.t0, port = dirs, time.time(), free_port()
        env = dict(os.environ, OMP_NUM_THREADS='1', TOKENIZERS_PARALLELISM='false', **(env or {}))
        script = [os.path.join(ROOT, args[0])] + list(args[1:]) if args[0].endswith('.py') else list(args)
        self.procs = []
        for k, d in enumerate(dirs):
            cmd = [sys.executable, '-m', 'torch.distributed.run', f'--nnodes={len(dirs)}', f'--nproc_per_node={nproc}',
                   '--rdzv_backend=c10d', f'--rdzv_endpoint=localhost:{port}', *launcher] + script
            log = open(os.path.join(d, 'agent.log'), 'w')
            self.procs.append(subprocess.Popen(cmd, cwd=d, env=env, stdout=log, stderr=subprocess.STDOUT))
        self.ended, self.seen = [None] * len(dirs), set()  # seen: worker pids, ended at kill() whatever happened

    def wait(self, timeout=300):
        """Every agent's exit status (seconds since the start in self.ended); kills all on timeout."""
        for k, p in enumerate(self.procs):
            try:
                p.wait(timeout=max(1, timeout - (time.time() - self.t0)))
            except subprocess.TimeoutExpired:
                self.kill()
                raise AssertionError(f'the job did not end within {timeout} s:\n' + self.logs())
            self.ended[k] = self.ended[k] or time.time() - self.t0
        return [p.returncode for p in self.procs]

    def poll_ended(self):
        for k, p in enumerate(self.procs):
            if p.poll() is not None and self.ended[k] is None:
                self.ended[k] = time.time() - self.t0

    def kill(self):
        """Every process of the job, agents and the workers seen (torchrun starts them in sessions of
        their own, so a process group does not reach them)."""
        for q in {q for p in self.procs if p.poll() is None for q in _tree(p.pid)} | self.seen:
            try:
                os.kill(q, signal.SIGKILL)
            except OSError:
                pass
        for p in self.procs:
            p.wait()

    def log(self, k):
        return open(os.path.join(self.dirs[k], 'agent.log')).read()

    def logs(self):
        return '\n'.join(f'--- node {k}\n' + self.log(k)[-4000:] for k in range(len(self.dirs)))

    def workers(self):
        """{global rank: pid} of the running workers (from each worker's environment)."""
        out = {}
        for p in self.procs:
            for pid in _children(p.pid):
                try:
                    env = open(f'/proc/{pid}/environ', 'rb').read().split(b'\0')
                except OSError:
                    continue
                rank = [e[5:] for e in env if e.startswith(b'RANK=')]
                if rank:
                    out[int(rank[0])] = pid
        self.seen |= set(out.values())
        return out


def _children(pid):
    try:
        with open(f'/proc/{pid}/task/{pid}/children') as f:
            return [int(c) for c in f.read().split()]
    except OSError:
        return []


def _tree(pid):
    return [pid] + [q for c in _children(pid) for q in _tree(c)]


def _alive(pid):
    try:  # neither gone nor a zombie waiting for its parent
        return open(f'/proc/{pid}/stat').read().split()[2] != 'Z'
    except OSError:
        return False


def run(args, dirs, nproc=2, env=None, timeout=300, launcher=()):
    """One job to its end: (exit statuses per agent, the Job)."""
    job = Job(args, dirs, nproc, env, launcher)
    return job.wait(timeout), job


# ----------------------------------------------------------------------------- the checks
TOY = ['train.py', 'config/toy.py', '--prompts_per_iter=4', '--group_size=2', '--num_steps=4', '--rollout_batch=4',
       '--train_batch=2', '--eval_every=0', '--eval_samples=1', '--eval_videos=0', '--export_dtype=', '--diag_every=3']
SKIP = ('t_rollout', 't_reward', 't_update', 'peak_mem_gb', 'peak_mem_gb_ranks', 'passes_diag', 'passes_diag_anchor',
        'passes_eval')  # timings, memory, and work that grows with the ranks (tests/test_train_ranks.py)


def one_process(args, timeout=900):
    env = dict(os.environ, OMP_NUM_THREADS='1', TOKENIZERS_PARALLELISM='false')
    p = subprocess.run([sys.executable] + args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if p.returncode:
        raise RuntimeError(f'{args} failed:\n{p.stderr[-3000:]}')
    return p


def standalone(args, nproc, timeout=900):
    env = dict(os.environ, OMP_NUM_THREADS='1', TOKENIZERS_PARALLELISM='false')
    cmd = [sys.executable, '-m', 'torch.distributed.run', '--standalone', f'--nproc_per_node={nproc}'] + args
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if p.returncode:
        raise RuntimeError(f'{cmd} failed:\n{p.stderr[-3000:]}')
    return p


def weights(ckpt):
    from infra import checkpoint
    return checkpoint.read_tensors(ckpt)


def rel(a, b):
    """|a - b| / |a| over all weights."""
    d = math.sqrt(sum(((a[k] - b[k]).double() ** 2).sum().item() for k in a))
    return d / math.sqrt(sum((a[k].double() ** 2).sum().item() for k in a))


def rows(d):
    return [json.loads(l) for l in open(os.path.join(d, 'metrics.jsonl'))]


def worst_figure(ra, rb, tiny=1e-4):
    """The largest relative difference of a logged figure (timings and memory aside) and its name, and
    the largest absolute one of the figures below `tiny` (kl_vel, ratio_max: float noise at theta_old)."""
    rel_, abs_ = (0.0, ''), (0.0, '')
    assert [sorted(r) for r in ra] == [sorted(r) for r in rb], 'the runs logged different rows'
    for a, b in zip(ra, rb):
        for k in set(a) - set(SKIP):
            if abs(a[k]) >= tiny:
                rel_ = max(rel_, (abs(a[k] - b[k]) / abs(a[k]), k))
            else:
                abs_ = max(abs_, (abs(a[k] - b[k]), k))
    return rel_, abs_


def hsdp_and_resume():
    """HSDP 2x2 (no sp) vs one process; its iteration-2 checkpoint resumed on flat 4 ranks and in one process."""
    base = os.path.join(work, 'hsdp')
    shutil.rmtree(base, ignore_errors=True)
    args = TOY + ['--max_iters=3', '--save_every=1', '--keep_checkpoints=3']
    one, two = os.path.join(base, 'one'), os.path.join(base, 'two')
    t0 = time.time()
    one_process(args + [f'--out_dir={one}'])
    t1 = time.time()
    status, job = run(args + [f'--out_dir={two}'], node_dirs(base, 2), nproc=2, timeout=1200)
    t2 = time.time()
    if status != [0, 0]:
        raise RuntimeError('HSDP run failed:\n' + job.logs())
    res = dict(layout=next(l for l in job.logs().splitlines() if l.startswith('layout:')),
               hsdp_vs_one=rel(weights(f'{one}/ckpt_000003'), weights(f'{two}/ckpt_000003')),
               figure=worst_figure(rows(one), rows(two)), seconds_one=t1 - t0, seconds_hsdp=t2 - t1,
               shards=sorted(json.load(open(f'{two}/ckpt_000003/loop.json'))['files']))
    for name, launch in (('flat4', lambda a: standalone(a, 4)), ('one', one_process)):
        d = os.path.join(base, f'resumed_{name}')  # HSDP's iteration 2, resumed to 3
        os.makedirs(d)
        shutil.copytree(f'{two}/ckpt_000002', f'{d}/ckpt_000002')
        shutil.copy(f'{two}/metrics.jsonl', d)
        with open(f'{d}/latest', 'w') as f:
            f.write('ckpt_000002')
        t = time.time()
        p = launch(args + [f'--out_dir={d}', '--init_from=resume'])
        res[f'resume_{name}'] = dict(seconds=time.time() - t, resumed='resumed from' in p.stdout,
                                     vs_hsdp=rel(weights(f'{two}/ckpt_000003'), weights(f'{d}/ckpt_000003')),
                                     vs_one=rel(weights(f'{one}/ckpt_000003'), weights(f'{d}/ckpt_000003')),
                                     layout=next((l for l in p.stdout.splitlines() if l.startswith('layout:')), ''))
    return res


def failure(kind, nproc):
    """2 nodes x nproc ranks: 'stop' (SIGSTOP) or 'kill' (SIGKILL) the last rank once training runs;
    seconds until each agent has ended, and the first line of a rank whose collective failed.
    dist_timeout 0.1 min (6 s)."""
    base = os.path.join(work, kind)
    shutil.rmtree(base, ignore_errors=True)
    shared = os.path.join(base, 'shared')
    job = Job(TOY + ['--max_iters=50', '--save_every=0', f'--out_dir={shared}', '--dist_timeout=0.1'],
              node_dirs(base, 2), nproc=nproc)
    try:
        t0 = time.time()
        while 'reward' not in (open(f'{shared}/metrics.jsonl').read() if os.path.exists(f'{shared}/metrics.jsonl') else ''):
            if time.time() - t0 > 600 or any(p.poll() is not None for p in job.procs):
                raise RuntimeError('the job did not start training:\n' + job.logs())
            time.sleep(0.2)
        hit = time.time()
        os.kill(job.workers()[2 * nproc - 1], signal.SIGSTOP if kind == 'stop' else signal.SIGKILL)
        status = job.wait(timeout=hit - job.t0 + 300)
    finally:
        job.kill()
    line = _failed_line(job.logs())
    return dict(status=status, ended_after=[e - (hit - job.t0) for e in job.ended], line=line)


def _failed_line(text):
    """The first line of a rank whose collective failed (parallel.py's), without a progress bar before it."""
    import re
    m = re.search(r'rank \d+ \([^)]*\): a collective failed: [^\n]*', text)
    return m.group(0) if m else ''


def node_local():
    base = os.path.join(work, 'local')
    shutil.rmtree(base, ignore_errors=True)
    status, job = run(TOY + ['--out_dir=out'], node_dirs(base, 2), nproc=2, timeout=600)
    line = next((l for l in job.logs().splitlines() if 'must be on a filesystem all nodes share' in l), '')
    lines = sum(l == line for l in job.logs().splitlines())
    trained = any(os.path.exists(os.path.join(d, 'out', 'metrics.jsonl')) for d in job.dirs)
    return dict(status=status, ended=job.ended, line=line, processes_with_the_line=lines, trained=trained)


SRUN = '''#!/usr/bin/env python3
# A stand-in for SLURM's srun on one machine: the command once per simulated node (SLURM_JOB_NUM_NODES),
# each in its own working directory ($NODE_DIRS, colon-separated); with --kill-on-bad-exit=1 a task
# that exits non-zero ends every other task with all its processes (as slurmstepd does). It returns
# once every process of every task is gone. Other options are ignored.
import os, subprocess, sys, time
args = sys.argv[1:]
kill = '--kill-on-bad-exit=1' in args
while args and args[0].startswith('--'):
    args = args[1:]

def alive(q):  # neither gone nor a zombie
    try:
        return open(f'/proc/{q}/stat').read().split()[2] != 'Z'
    except OSError:
        return False

def tree(pid):  # pid and all its descendants
    try:
        kids = open(f'/proc/{pid}/task/{pid}/children').read().split()
    except OSError:
        kids = []
    return [pid] + [q for k in kids for q in tree(int(k))]

dirs = os.environ['NODE_DIRS'].split(':')
procs = [subprocess.Popen(args, cwd=d, env=dict(os.environ, SLURM_NODEID=str(k), SLURM_PROCID=str(k)))
         for k, d in enumerate(dirs)]
everyone = set()
while any(p.poll() is None for p in procs) or any(alive(q) for q in everyone):
    everyone = {q for q in everyone | {q for p in procs if p.poll() is None for q in tree(p.pid)} if alive(q)}
    if kill and any(p.poll() not in (None, 0) for p in procs):
        for q in everyone:
            try:
                os.kill(q, 9)
            except OSError:
                pass
    time.sleep(0.2)
sys.exit(max(abs(p.returncode) for p in procs))
'''


def _env_rank(pid):
    try:
        env = open(f'/proc/{pid}/environ', 'rb').read().split(b'\0')
    except OSError:
        return None
    return next((int(e[5:]) for e in env if e.startswith(b'RANK=')), None)


def sbatch(mode):
    """train.sbatch with srun and scontrol stood in for, 2 nodes x 2 ranks: 'end' runs to the end; 'term'
    sends SIGTERM to every agent once training runs, as SLURM's --signal does; 'stuck' stops rank 3
    (SIGSTOP) once training runs, dist_timeout 0.1 min."""
    base = os.path.join(work, f'sbatch_{mode}')
    shutil.rmtree(base, ignore_errors=True)
    dirs, bin_ = node_dirs(base, 2), os.path.join(base, 'bin')
    os.makedirs(bin_)
    with open(os.path.join(bin_, 'srun'), 'w') as f:
        f.write(SRUN)
    with open(os.path.join(bin_, 'scontrol'), 'w') as f:
        f.write('#!/bin/sh\necho localhost\n')  # scontrol show hostnames: the first node
    for n in ('srun', 'scontrol'):
        os.chmod(os.path.join(bin_, n), 0o755)
    shared = os.path.join(base, 'shared')
    env = dict(os.environ, PATH=bin_ + ':' + os.environ['PATH'], NODE_DIRS=':'.join(dirs), SLURM_JOB_NUM_NODES='2',
               SLURM_JOB_NODELIST='localhost', SLURM_JOB_ID='bench', SLURM_SUBMIT_DIR=ROOT, PYTHON=sys.executable,
               NPROC='2', OUT_DIR=shared, PORT=str(free_port()), OMP_NUM_THREADS='1', TOKENIZERS_PARALLELISM='false')
    args = TOY[1:] + ['--device=cpu', '--save_every=1', '--max_iters=' + ('2' if mode == 'end' else '50')] + \
        ['--dist_timeout=0.1'] * (mode == 'stuck')
    t0, hit, seen = time.time(), None, set()
    with open(os.path.join(base, 'sbatch.log'), 'w') as log:
        p = subprocess.Popen(['bash', os.path.join(ROOT, 'train.sbatch')] + args, cwd=base, env=env, stdout=log,
                             stderr=subprocess.STDOUT)
        try:
            if mode != 'end':
                metrics = f'{shared}/metrics.jsonl'
                while 'reward' not in (open(metrics).read() if os.path.exists(metrics) else ''):
                    if time.time() - t0 > 900 or p.poll() is not None:
                        raise RuntimeError('train.sbatch did not start training:\n' + open(log.name).read()[-3000:])
                    time.sleep(0.2)
                hit, seen = time.time(), set(_tree(p.pid))
                agents = [a for srun in _children(p.pid) for a in _children(srun)]  # bash -> srun -> the agents
                for pid in agents if mode == 'term' else []:
                    os.kill(pid, signal.SIGTERM)
                for pid in [w for a in agents for w in _children(a) if _env_rank(w) == 3] if mode == 'stuck' else []:
                    os.kill(pid, signal.SIGSTOP)
            rc = p.wait(timeout=900)
        finally:
            left = [q for q in seen | set(_tree(p.pid)) if _alive(q) and q != p.pid]
            for q in left + [p.pid] * (p.poll() is None):
                try:
                    os.kill(q, signal.SIGKILL)
                except OSError:
                    pass
    text = open(os.path.join(base, 'sbatch.log')).read()
    latest = open(f'{shared}/latest').read().strip() if os.path.exists(f'{shared}/latest') else None
    line = _failed_line(text)
    return dict(rc=rc, seconds=time.time() - t0, latest=latest, preempted='preempted:' in text, line=line, left=len(left),
                ended_after=time.time() - hit if hit else None, tmp_left=[
                    os.path.join(r, f) for d in dirs + [shared] for r, ds, fs in os.walk(d) for f in ds + fs
                    if f.endswith('.tmp')], log_tail=text[-1500:] if rc and mode == 'end' else '')


CHECKS = dict(node_local=node_local, kill=lambda: failure('kill', 1), stop=lambda: failure('stop', 2), hsdp=hsdp_and_resume,
              sbatch=lambda: sbatch('end'), sbatch_term=lambda: sbatch('term'), sbatch_stuck=lambda: sbatch('stuck'))


def main():
    res, t0 = {}, time.time()
    if parts and os.path.exists(os.path.join(out, 'nodes.json')):
        with open(os.path.join(out, 'nodes.json')) as f:
            res = json.load(f)
    for name, fn in CHECKS.items():
        if parts and name not in parts.split(','):
            continue
        t = time.time()
        try:
            res[name] = fn()
        except Exception as e:  # a failed check is reported, and the others still run
            res[name] = dict(error=f'{type(e).__name__}: {str(e)[-2000:]}')
        res[name]['wall'] = time.time() - t
        print(f'[{time.time() - t0:5.0f}s] {name}: ' + json.dumps(res[name], default=str)[:400], flush=True)
    import torch
    res['torch'], res['seconds'] = torch.__version__, sum(v['wall'] for v in res.values() if isinstance(v, dict))
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, 'nodes.json'), 'w') as f:
        json.dump(res, f, indent=1, default=str)
    with open(os.path.join(out, 'nodes.md'), 'w') as f:
        f.write(report(res) + '\n')


def report(res):
    f = lambda x: f'{x:.1f}'
    md = ['## train.py on simulated nodes (bench/nodes.py)', '',
          f'Written by `python -m bench.nodes` (torch {res["torch"]}, {res["seconds"] / 60:.0f} min on 2 shared CPU cores): '
          'one torchrun agent per node on this machine, each from its own working directory, c10d rendezvous, gloo; '
          'the toy world at 4 prompts x 2 rollouts, 4 steps. The fast slice of these is tests/test_nodes.py.', '']
    h, r = res.get('hsdp', {}), []
    if 'error' not in h:
        (rd, rk), (ad, ak) = h['figure']
        r += [f'- HSDP 2x2 (`{h["layout"]}`) vs one process after 3 iterations: weights {h["hsdp_vs_one"]:.1e} apart '
              f'(relative); every logged figure within {rd:.1e} relative (the largest: {rk}), those below 1e-4 within '
              f'{ad:.1e} ({ak}); the checkpoint lists {", ".join(h["shards"])} ({f(h["seconds_hsdp"])} s; one '
              f'process {f(h["seconds_one"])} s).']
        for name, what in (('flat4', 'flat FSDP over 4 ranks of one node'), ('one', 'one process')):
            x = h[f'resume_{name}']
            r.append(f'- its iteration-2 checkpoint resumed on {what} to iteration 3: weights {x["vs_hsdp"]:.1e} '
                     f'from the HSDP run\'s, {x["vs_one"]:.1e} from the one-process run\'s ({f(x["seconds"])} s).')
    else:
        r.append(f'- HSDP: failed: {h["error"][:300]}')
    for name, what in (('kill', '2 nodes x 1 rank, rank 1 killed (SIGKILL)'),
                       ('stop', '2 nodes x 2 ranks, rank 3 stopped (SIGSTOP), stuck in a collective')):
        x = res.get(name, {})
        r.append(f'- {what} while training, dist_timeout 0.1 min (6 s): ' + (
            f'every agent ended {" / ".join(f(e) for e in x["ended_after"])} s later (exit {x["status"]}); '
            f'`{x["line"].strip()}`' + (
                '. The stopped rank\'s agent ends it once its other rank has timed out, after torchrun\'s '
                'shutdown timeout (30 s; a stopped process ignores the SIGTERM before it). A stuck rank alone on its '
                'node (--nproc_per_node=1) is ended only if its agent learns of the failure: srun '
                '--kill-on-bad-exit does that at once (below); plain torchrun only when the agent that holds the '
                'rendezvous is gone' if name == 'stop' else '') if 'error' not in x else f'failed: {x["error"][:300]}'))
    x = res.get('node_local', {})
    r.append('- 2 nodes x 2 ranks, node-local out_dir (`--out_dir=out`, relative): ' + (
        f'every agent ended {" / ".join(f(e) for e in x["ended"])} s after the start, start-up included (exit '
        f'{x["status"]}), {x["processes_with_the_line"]} processes printed `{x["line"].strip()}`; trained: '
        f'{x["trained"]}.' if 'error' not in x else f'failed: {x["error"][:300]}'))
    x = res.get('sbatch', {})
    r.append('- train.sbatch, 2 nodes x 2 ranks under a stand-in srun, to its end (2 iterations): ' + (
        f'exit {x["rc"]}, `latest` {x["latest"]}, `.tmp` left: {len(x["tmp_left"])} ({f(x["seconds"])} s).'
        if 'error' not in x else f'failed: {x["error"][:300]}'))
    x = res.get('sbatch_term', {})
    r.append('- the same, SIGTERM to both agents while training (SLURM\'s --signal): ' + (
        f'stopped {f(x["ended_after"])} s after the signal, preempted: {x["preempted"]} (the last finished iteration '
        f'saved: `latest` {x["latest"]}), `.tmp` left: {len(x["tmp_left"])}; exit {x["rc"]} (torchrun re-raises the '
        'signal, docs/method.md section 12.1; srun ends the other node then).' if 'error' not in x else
        f'failed: {x["error"][:300]}'))
    x = res.get('sbatch_stuck', {})
    r.append('- the same, rank 3 stopped (SIGSTOP) while training, dist_timeout 0.1 min: ' + (
        f'every process ended {f(x["ended_after"])} s after the stop (srun --kill-on-bad-exit ended node 1 once node '
        f'0\'s agent failed; processes left: {x["left"]}), exit {x["rc"]}; `{x["line"].strip()}`; a save cut short left '
        f'{len(x["tmp_left"])} `.tmp` directory, which the next save removes' if 'error' not in x else
        f'failed: {x["error"][:300]}'))
    return '\n'.join(md + r)


if __name__ == '__main__':
    main()
