"""
train.py on two nodes, simulated: two torchrun agents on this machine joined by c10d rendezvous, each
started from a working directory of its own, so that a relative path is a node's own disk
(bench/nodes.py launches them; its bench runs the slow cases: HSDP without sp and resumed on flat
4 ranks, a rank stuck in a collective, the SLURM script).
- HSDP 2x2 with sp 2 (each node's 2 ranks shard the weights and share a clip's tokens, the nodes
  replicate) against one process: weights within 1e-6, every logged figure equal; its checkpoints
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

import checkpoint

SMALL = ['--prompts_per_iter=2', '--group_size=2', '--num_steps=4', '--rollout_batch=4', '--train_batch=2',
         '--eval_every=0', '--eval_samples=1', '--eval_videos=0', '--export_dtype=']
SKIP = ('t_rollout', 't_reward', 't_update', 'peak_mem_gb', 'peak_mem_gb_ranks',  # timings and memory
        'passes_diag', 'passes_diag_anchor', 'passes_eval')  # grow with the ranks (test_train_ranks.py)


def one_eval_prompt(tmp_path):
    evals = tmp_path / 'eval.txt'  # one held-out prompt: the evaluations at start and end stay cheap
    evals.write_text(open(os.path.join(ROOT, 'assets/toy/eval_prompts.txt')).readline())
    return [f'--eval_prompts={evals}']


def toy2(tmp_path):
    """The toy world with a 2-head transformer (random weights; the toy's 3 heads do not split in 2)."""
    from diffusers import HunyuanVideo15Transformer3DModel
    import toy
    torch.manual_seed(0)
    HunyuanVideo15Transformer3DModel(**{**toy.CONFIG, 'num_attention_heads': 2}).save_pretrained(
        tmp_path / 'toy2' / 'transformer')
    for name in ('model_index.json', 'text_embeddings.safetensors'):
        shutil.copy(os.path.join(ROOT, 'assets/toy', name), tmp_path / 'toy2' / name)
    return [f'--model={tmp_path / "toy2"}'] + one_eval_prompt(tmp_path)


def tmp_files(*dirs):
    return [os.path.join(r, f) for d in dirs for r, ds, fs in os.walk(d) for f in ds + fs if f.endswith('.tmp')]


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
    assert diff <= 1e-6, diff
    print(f'HSDP 2x2 + sp 2 vs one process: weights {diff:.1e} apart (relative)')
    ra, rb = metrics(one), metrics(two)
    assert [sorted(r) for r in ra] == [sorted(r) for r in rb] and any('gnorm_first' in r for r in ra)
    for a, b in zip(ra, rb):  # Muon's bf16 Newton-Schulz: figures that measure the move within 1e-3
        for k in set(a) - set(SKIP):
            assert a[k] == pytest.approx(b[k], rel=1e-3, abs=1e-6 if k == 'ratio_max' else 1e-10), (a['iter'], k)
    # every rank's shard is listed with its size and crc32; nothing temporary is left on any node
    newest = os.path.join(two, 'ckpt_000003')
    files = checkpoint.read_loop(newest)['files']
    assert sorted(files) == ['.metadata'] + [f'__{r}_0.distcp' for r in range(4)]
    assert all(os.path.getsize(os.path.join(newest, f)) == size for f, (size, _) in files.items())
    assert tmp_files(two, *dirs) == []
    # it loads in one process (DCP reshards 2x2 -> 1): the weights and the optimizer state
    import toy  # noqa: F401
    from model import load_policy
    from optimizer import build
    from trust_region import Anchor
    policy = load_policy(str(tmp_path / 'toy2'), 'cpu')
    opts, anchor = build(policy, 'muon', 1e-5, 0.01), Anchor(policy)
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
    assert re.search(r'rank 0 \([^)]*\): a collective failed: |rank 0: SIGTERM, but the stop failed', job.logs()), \
        job.logs()
    print(f'every agent ended {after} s after the kill')


MESH = """
import torch
import torch.distributed as dist
import parallel
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
