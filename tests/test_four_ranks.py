"""
train.py on 4 FSDP2 ranks (torchrun, gloo) with a weight of fewer rows than ranks, against one process:
the toy's cond_type_embed is (3, 96), as HunyuanVideo 1.5's nn.Embedding(3, 2048) is on 8 ranks, so FSDP2's
Shard(0) leaves the last rank an empty shard. Through it run Muon's step (full_tensor of the momentum,
Newton-Schulz on every rank, distribute_tensor back to 1, 1, 1 and 0 rows), a checkpoint (DCP: every rank
writes its shards, the empty one included) and a resume on 4 ranks; the weights after 2 iterations equal
those of one process run straight through (2 ranks, never an empty shard: tests/test_train_ranks.py).

    python -m pytest -m slow tests/test_four_ranks.py      # ~3 min on 2 cores
"""
import math
import os
import subprocess
import sys

import pytest
import torch

from test_train import ROOT, limit, metrics, run_here, weights

ARGS = ['train.py', 'config/toy.py', '--prompts_per_iter=4', '--group_size=2', '--num_steps=4', '--rollout_batch=2',
        '--train_batch=2', '--eval_every=0', '--eval_videos=0', '--export_dtype=', '--save_every=1',
        '--optimizer=muon', '--learning_rate=1e-5']
SMALL = 'cond_type_embed.weight'  # (3, 96): rank 3 of 4 holds none of its rows


def torchrun(args, n=4):
    env = dict(os.environ, OMP_NUM_THREADS='1', TOKENIZERS_PARALLELISM='false')
    p = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--standalone', f'--nproc_per_node={n}']
                       + args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit(600))
    assert p.returncode == 0, f'{args} failed:\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}'
    return p


@pytest.mark.slow  # two 4-rank launches on 2 cores
def test_four_ranks_with_an_empty_shard_equal_one_process(tmp_path, monkeypatch):
    from models import family
    start = family('assets/toy').load_transformer('assets/toy').state_dict()[SMALL]
    assert start.shape[0] < 4
    one, four = str(tmp_path / 'one'), str(tmp_path / 'four')
    run_here(monkeypatch, ARGS + ['--max_iters=2', f'--out_dir={one}'])
    torchrun(ARGS + ['--max_iters=1', f'--out_dir={four}'])
    ckpt = open(os.path.join(four, 'latest')).read().strip()
    assert sum(f.endswith('.distcp') for f in os.listdir(os.path.join(four, ckpt))) == 4  # a shard file a rank
    torchrun(ARGS + ['--max_iters=2', '--init_from=resume', f'--out_dir={four}'])
    assert [r['iter'] for r in metrics(four) if 'reward' in r] == [1, 2]  # the resume trained the second
    wa, wb = weights(one), weights(four)
    assert wa.keys() == wb.keys() and SMALL in wa
    # Muon moved the 3-row matrix, and the same way on 4 ranks as in one process (bf16 Newton-Schulz:
    # gradients summed in another order round apart, ~1e-6 of the weights an iteration at lr 1e-5)
    moved = (wa[SMALL] - start).norm()
    assert moved > 0 and (wa[SMALL] - wb[SMALL]).norm() <= 1e-2 * moved, ((wa[SMALL] - wb[SMALL]).norm(), moved)
    diff = math.sqrt(sum(((wa[k] - wb[k]) ** 2).sum().item() for k in wa))
    norm = math.sqrt(sum((wa[k] ** 2).sum().item() for k in wa))
    assert diff <= 1e-6 * norm, diff / norm
    ra, rb = ([r for r in metrics(o) if 'reward' in r] for o in (one, four))
    for a, b in zip(ra, rb):  # the rollouts saw the same policy: the same rewards
        assert a['reward'] == pytest.approx(b['reward'], rel=1e-4, abs=1e-6), (a['iter'], a['reward'], b['reward'])
    assert torch.isfinite(wb[SMALL]).all()
