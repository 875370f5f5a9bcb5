"""
train.py on two nodes, simulated: two torchrun agents on this machine joined by c10d rendezvous, each
started from a working directory of its own, so that a relative path is a node's own disk
(bench/nodes.py launches them; its bench runs the slow cases: HSDP without sp and resumed on flat
4 ranks, a rank stuck in a collective, the SLURM script).
- HSDP 2x2 with sp 2 (each node's 2 ranks shard the weights and share a clip's tokens, the nodes
  replicate) against one process: weights within 3e-6, every logged figure equal; its checkpoints
  list every rank's shard and load in one process; one rank's shard removed: named damaged, the
  previous checkpoint used; nothing `.tmp` is left on either node (a save cut short: by the next);
- a node-local out_dir: every process stops within seconds with the one line, nothing trained;
- a rank killed mid-run: every process ends within seconds, rank 0 with one line in torch's words;
  the groups torch creates for the HSDP and sp meshes wait dist_timeout, not torch's 30 minutes.
Cost: 3 launches of 2 agents and a one-process run (in this process, test_train.run_here).
"""
import json
import math
import os
import re
import shutil
import signal
import time

import pytest
import torch

from bench.nodes import Job, node_dirs, run as run_nodes
from test_train import ROOT, metrics, run_here, weights

from infra import checkpoint

SMALL = ['--prompts_per_iter=2', '--group_size=2', '--num_steps=4', '--rollout_batch=4', '--train_batch=2',
         '--eval_every=0', '--eval_samples=1', '--eval_videos=0', '--export_dtype=']
SKIP = ('t_rollout', 't_reward', 't_update', 'peak_mem_gb', 'peak_mem_gb_ranks', 'peak_mem_reserved_gb',  # time, memory
        'passes_diag', 'passes_diag_anchor', 'passes_eval')  # grow with the ranks (test_train_ranks.py)


def one_eval_prompt(tmp_path):
    evals = tmp_path / 'eval.txt'  # one held-out prompt: the evaluations at start and end stay cheap
    evals.write_text(open(os.path.join(ROOT, 'assets/toy/eval_prompts.txt')).readline())
    return [f'--eval_prompts={evals}']


def toy2(tmp_path):
    """The toy world with a 2-head transformer (random weights; the toy's 3 heads do not split in 2)."""
    from diffusers import HunyuanVideo15Transformer3DModel
    from models import toy
    torch.manual_seed(0)
    HunyuanVideo15Transformer3DModel(**{**toy.CONFIG, 'num_attention_heads': 2}).save_pretrained(
        tmp_path / 'toy2' / 'transformer')
    for name in ('model_index.json', 'text_embeddings.safetensors'):
        shutil.copy(os.path.join(ROOT, 'assets/toy', name), tmp_path / 'toy2' / name)
    return [f'--model={tmp_path / "toy2"}'] + one_eval_prompt(tmp_path)


def tmp_files(*dirs):
    return [os.path.join(r, f) for d in dirs for r, ds, fs in os.walk(d) for f in ds + fs if f.endswith('.tmp')]


@pytest.mark.slow  # .ci/run's slow tier: the README's command stays under 10 minutes
def test_hsdp_2x2_sp2_equals_one_process_and_checkpoints_hold_every_shard(tmp_path, monkeypatch):
    args = ['train.py', 'config/toy.py'] + SMALL + toy2(tmp_path) + [
        '--max_iters=3', '--save_every=1', '--diag_every=3', '--optimizer=muon', '--learning_rate=1e-5']
    one, two = str(tmp_path / 'one'), str(tmp_path / 'two')
    run_here(monkeypatch, args + [f'--out_dir={one}'])
    dirs = node_dirs(tmp_path, 2)
    status, job = run_nodes(args + [f'--out_dir={two}', '--sp_size=2'], dirs, nproc=2)
    assert status == [0, 0], job.logs()
    # HSDP: each node's 2 ranks hold half of each weight (shard_size 0: a node), the nodes replicate
    assert 'layout: 4 ranks; weights sharded over 2 and replicated 2x (HSDP); sp 2' in job.logs()
    wa, wb = weights(one), weights(two)
    assert wa.keys() == wb.keys()
    diff = math.sqrt(sum(((wa[k] - wb[k]) ** 2).sum().item() for k in wa))
    diff /= math.sqrt(sum((wa[k] ** 2).sum().item() for k in wa))
    assert diff <= 3e-6, diff  # 1.7e-6 measured: the held ratio's lambda_KL rounds apart (test_train_ranks.py)
    print(f'HSDP 2x2 + sp 2 vs one process: weights {diff:.1e} apart (relative)')
    ra, rb = metrics(one), metrics(two)
    assert [sorted(r) for r in ra] == [sorted(r) for r in rb] and any('gnorm_first' in r for r in ra)
    for a, b in zip(ra, rb):  # Muon's bf16 Newton-Schulz: figures that measure the move within 1e-3
        for k in set(a) - set(SKIP):
            noise = k in ('ratio_max', 'logp_drift_mean', 'logp_drift_max')  # float noise at theta_old
            assert a[k] == pytest.approx(b[k], rel=1e-3, abs=1e-6 if noise else 1e-10), (a['iter'], k)
    # every rank's shard is listed with its size and crc32; nothing temporary is left on any node
    newest = os.path.join(two, 'ckpt_000003')
    files = checkpoint.read_loop(newest)['files']
    assert sorted(files) == ['.metadata'] + [f'__{r}_0.distcp' for r in range(4)]
    assert all(os.path.getsize(os.path.join(newest, f)) == size for f, (size, _) in files.items())
    assert tmp_files(two, *dirs) == []
    # it loads in one process (DCP reshards 2x2 -> 1): the weights and the optimizer state
    from models import toy  # noqa: F401
    from models.policy import load_policy
    from infra.optimizer import build
    from infra.anchor import Anchor
    policy = load_policy(str(tmp_path / 'toy2'), 'cpu')
    opts, anchor = build(policy, 'muon', 1e-5, 0.01), Anchor(policy, 'dual', every=10)
    assert checkpoint.load(newest, policy, opts, anchor)['iter_num'] == 3
    assert all(torch.equal(p.detach(), wb[n]) for n, p in policy.named_parameters() if n in wb)
    assert all('momentum_buffer' in opts[0].state[p] for p in opts[0].param_groups[0]['params'])
    # rank 3's shard gone: the checkpoint is named damaged, the previous one is used
    os.remove(os.path.join(newest, '__3_0.distcp'))
    said = []
    assert checkpoint.candidates(two, log=said.append, collective=False)[0].endswith('ckpt_000002')
    assert said == [f'warning: checkpoint {newest} is damaged (__3_0.distcp is missing): skipped'], said
    # a loop.json that does not list a shard .metadata points into (written by a listing): damaged
    loop = checkpoint.read_loop(os.path.join(two, 'ckpt_000002'))
    del loop['files']['__1_0.distcp']
    with open(os.path.join(two, 'ckpt_000002', 'loop.json'), 'w') as f:
        json.dump(loop, f)
    assert checkpoint.damage(os.path.join(two, 'ckpt_000002')) == '__1_0.distcp is not listed in loop.json'
    # a save cut short (a rank died mid-save) left a temporary directory: the next save removes it
    os.makedirs(os.path.join(two, 'ckpt_000004.tmp'))
    checkpoint.save(os.path.join(two, 'ckpt_000005'), policy, opts, anchor.state_dict(), dict(iter_num=5))
    assert tmp_files(two) == [] and checkpoint.damage(os.path.join(two, 'ckpt_000005')) is None


def test_node_local_out_dir_stops_every_process_with_one_line(tmp_path):
    dirs = node_dirs(tmp_path, 2)
    status, job = run_nodes(['train.py', 'config/toy.py', '--out_dir=out'] + SMALL, dirs, nproc=1, timeout=120)
    assert status == [1, 1], job.logs()
    line = "out_dir 'out' must be on a filesystem all nodes share: rank 1"
    for k in range(2):  # each node: its rank's one line (no traceback), and nothing trained or written
        assert line in job.log(k) and 'train.py", line' not in job.log(k)  # no traceback of train.py's
        assert not os.path.exists(os.path.join(dirs[k], 'out')) or os.listdir(os.path.join(dirs[k], 'out')) == []
    print(f'ended {job.ended} s after the start')  # the start itself (imports, rendezvous) is most of it


def test_a_killed_rank_ends_every_process_within_seconds(tmp_path):
    """Rank 1 killed while training: rank 0's next collective fails at once; both agents end."""
    out = str(tmp_path / 'shared')
    job = Job(['train.py', 'config/toy.py', f'--out_dir={out}', '--max_iters=50', '--save_every=0'] + SMALL
              + one_eval_prompt(tmp_path), node_dirs(tmp_path, 2), nproc=1)
    try:
        t0 = time.time()
        while not os.path.exists(os.path.join(out, 'metrics.jsonl')) or 'reward' not in open(
                os.path.join(out, 'metrics.jsonl')).read():  # training: both ranks in the loop
            assert time.time() - t0 < 240 and all(p.poll() is None for p in job.procs), job.logs()
            time.sleep(0.2)
        killed = time.time()
        os.kill(job.workers()[1], signal.SIGKILL)
        status = job.wait(timeout=time.time() - job.t0 + 60)
        after = [e - (killed - job.t0) for e in job.ended]
    finally:
        job.kill()
    assert status == [1, 1] and max(after) < 20, (after, job.logs())
    # rank 0's one line: its next collective failed, or, when its agent stopped it first (the other
    # agent closed the rendezvous), its SIGTERM found the peer gone (preemption.py)
    # (the whole logs: job.logs() keeps each one's tail, which an agent's C++ stack trace can fill)
    assert re.search(r'rank 0 \([^)]*\): a collective failed: |rank 0: SIGTERM, but the stop failed',
                     job.log(0) + job.log(1)), job.logs()
    print(f'every agent ended {after} s after the kill')


MESH = """
import torch
import torch.distributed as dist
from infra import parallel
parallel.init('cpu', 0.1)
seen = [(name, m[name].get_group()._get_backend(torch.device('cpu')).options._timeout.total_seconds())
        for m in (parallel.fsdp_mesh(2, 1, 'cpu'), parallel.mesh('cpu', (2, 1, 1), ('dp', 'ring', 'ulysses')))
        for name in m.mesh_dim_names]
import sys
# one write a rank (print writes each piece apart on an unbuffered stdout: the ranks' lines mixed)
sys.stdout.write(' '.join(['groups'] + [f'{n}={t}' for n, t in seen]) + '\\n')
sys.stdout.flush()
dist.destroy_process_group()
"""


def test_mesh_groups_wait_dist_timeout_not_torchs_default(tmp_path):
    """The groups of the HSDP mesh and of the sp mesh time out after dist_timeout (6 s here): torch gives
    a mesh's groups the backend's default (30 minutes for gloo), so a rank stuck in a shard group
    held every node for half an hour (bench/nodes.py's stuck rank, 2 nodes x 2 ranks)."""
    import subprocess
    import sys
    (tmp_path / 'mesh.py').write_text(MESH)
    env = dict(os.environ, OMP_NUM_THREADS='1', PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2',
                        str(tmp_path / 'mesh.py')], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    seen = [kv.split('=') for l in p.stdout.splitlines() if l.startswith('groups ') for kv in l.split()[1:]]
    assert sorted(n for n, _ in seen) == sorted(['replicate', 'shard', 'dp', 'ring', 'ulysses'] * 2), p.stdout
    assert all(float(t) == 6.0 for _, t in seen), p.stdout


# ----------------------------------------------------------------------------- the layout, in this process

def test_hsdp_mesh_is_replicate_outer_shard_inner():
    """fsdp_mesh on 8 ranks with shard_size 2: a (replicate 4, shard 2) mesh whose shard groups are
    consecutive ranks (one node's), the replicas the same slot on every node; one shard group of the
    whole world is no mesh at all (plain FSDP on the default group). A fake process group: no peers."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from infra import parallel
    dist.init_process_group('fake', rank=0, world_size=8, store=FakeStore())
    try:
        m = parallel.fsdp_mesh(8, 2, 'cpu')
        assert m.mesh_dim_names == ('replicate', 'shard') and (m['replicate'].size(), m['shard'].size()) == (4, 2)
        assert m.mesh.tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]
        assert parallel.fsdp_mesh(8, 8, 'cpu') is None
    finally:
        dist.destroy_process_group()


def test_check_layout_shard_size_0_is_one_node_and_refusals(monkeypatch):
    """check_layout: shard_size 0 is one node's ranks (LOCAL_WORLD_SIZE), the world where a node holds
    more ranks than the world; a shard_size that does not divide the world, an sp group wider than a
    node, and clips that do not divide over the data-parallel ranks stop with one line each."""
    from infra import parallel
    monkeypatch.setenv('LOCAL_WORLD_SIZE', '4')
    assert parallel.check_layout(16, 0, 1, 16) == 4  # 4 nodes of 4: shards of 4, replicated 4x
    assert parallel.check_layout(16, 8, 2, 8) == 8  # given: kept
    assert parallel.describe(16, 4, 2) == 'layout: 16 ranks; weights sharded over 4 and replicated 4x (HSDP); sp 2'
    monkeypatch.setenv('LOCAL_WORLD_SIZE', '8')
    assert parallel.check_layout(2, 0, 1, 2) == 2
    for args, line in [((16, 3, 1, 16), 'shard_size 3 must divide the world size 16'),
                       ((16, 0, 16, 16), 'sp_size 16 must divide the 8 ranks of a node'),
                       ((16, 0, 3, 16), 'sp_size 3 must divide the 8 ranks of a node'),
                       ((16, 0, 2, 12), 'prompts_per_iter * group_size = 12 must be divisible by the world size 16 / sp_size 2')]:
        with pytest.raises(SystemExit) as e:
            parallel.check_layout(*args)
        assert str(e.value).startswith(line) and '\n' not in str(e.value), (args, str(e.value))
    assert parallel.check_layout(16, 0, 2, 8) == 8  # 8 clips over 16 / 2 data-parallel ranks


def as_rank_1(monkeypatch, zero):
    """torch.distributed as rank 1 of 2 sees it: `zero` is rank 0's broadcast box, rank 0 saw its own file."""
    import torch.distributed as dist
    monkeypatch.setattr(dist, 'is_initialized', lambda: True)
    monkeypatch.setattr(dist, 'get_rank', lambda group=None: 1)
    monkeypatch.setattr(dist, 'get_world_size', lambda group=None: 2)
    monkeypatch.setattr(dist, 'broadcast_object_list', lambda box, src=0, group=None: box.__setitem__(slice(None), zero))
    monkeypatch.setattr(dist, 'all_gather_object', lambda out, obj, group=None: out.__setitem__(slice(None), [(True, 'node0'), obj]))


def test_check_shared_reads_rank_0s_file_by_its_bytes(tmp_path, monkeypatch):
    """check_shared on rank 1: passes where rank 1 reads the very bytes rank 0 wrote (their sha256), stops
    with one line naming rank 1 where the file is absent (a node's own disk) or holds other bytes (a
    stale copy of the same name)."""
    import hashlib
    import socket
    from infra import parallel
    monkeypatch.setattr(parallel, 'SEEN_WAIT', 0.3)
    shared, own, stale = tmp_path / 'shared', tmp_path / 'own', tmp_path / 'stale'
    for d in (shared, own, stale):
        d.mkdir()
    token = '.shared-0123456789abcdef'
    (shared / token).write_text(token)
    (stale / token).write_text('.shared-fedcba9876543210')  # same length, other bytes
    as_rank_1(monkeypatch, [token, hashlib.sha256(token.encode()).hexdigest(), None])
    parallel.check_shared(str(shared), 'out_dir', master=False)
    for d in (own, stale):
        with pytest.raises(SystemExit) as e:
            parallel.check_shared(str(d), 'out_dir', master=False)
        assert str(e.value) == (f"out_dir {str(d)!r} must be on a filesystem all nodes share: rank 1 "
                                f"({socket.gethostname()}) does not see the file rank 0 wrote in it ({token})")
    as_rank_1(monkeypatch, [token, None, "out_dir '/x' is not writable: denied"])  # rank 0's own failure
    with pytest.raises(SystemExit, match="^out_dir '/x' is not writable: denied$"):
        parallel.check_shared(str(shared), 'out_dir', master=False)


def test_solo_others_wait_on_the_store_for_solo_timeout(monkeypatch):
    """parallel.solo on rank 1: it waits on the store's key (not running fn) until rank 0 sets it and
    returns None; rank 0's line stops it; with nothing set it stops after solo_timeout (0.6 s here),
    not the store's own 30 s. On rank 0 fn runs and its result or its SystemExit line is set."""
    import threading
    from datetime import timedelta
    import torch.distributed as dist
    from infra import parallel
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=30))
    rank = [1]
    monkeypatch.setattr(dist, 'is_initialized', lambda: True)
    monkeypatch.setattr(dist, 'get_rank', lambda group=None: rank[0])
    monkeypatch.setattr(dist.distributed_c10d, '_get_default_store', lambda: store)

    def never():
        raise AssertionError('fn ran on rank 1')
    threading.Timer(0.5, lambda: store.set('solo/cache', '')).start()
    t0 = time.time()
    assert parallel.solo(never, 'cache', 1.0) is None and time.time() - t0 >= 0.45  # it waited for rank 0
    store.set('solo/export', 'rank 0 failed in export: OSError: disk full')
    with pytest.raises(SystemExit, match='^rank 0 failed in export: OSError: disk full$'):
        parallel.solo(never, 'export', 1.0)
    t0 = time.time()
    with pytest.raises(SystemExit, match=r'^rank 1: rank 0 did not finish late within solo_timeout \(0.01 min\)'):
        parallel.solo(never, 'late', 0.01)
    assert 0.5 <= time.time() - t0 < 10  # solo_timeout's 0.6 s: neither seconds nor the store's 30 s
    rank[0] = 0
    assert parallel.solo(lambda: 'built', 'built', 1.0) == 'built' and store.get('solo/built') == b''

    def stops():
        raise SystemExit('no space for the prompt cache')
    with pytest.raises(SystemExit):
        parallel.solo(stops, 'stops', 1.0)
    assert store.get('solo/stops') == b'no space for the prompt cache'
