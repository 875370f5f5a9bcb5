"""optimizer.py: the released Muon + AdamW split, correct under FSDP2.

- the same two optimizer steps on 2 FSDP2 ranks (torchrun, gloo) and in one process give the same
  weights to float tolerance, for 'muon' and 'adamw' (tests/fsdp_muon_worker.py);
- the check has teeth: torch.optim.Muon as it ships (Newton-Schulz through DTensor's op dispatch on
  the sharded momentum) fails it;
- the split: 2-D matrices to Muon with the released lr rule, everything else to AdamW.

    python -m pytest tests/test_optimizer.py
"""
import math
import os
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the worker with torch's own Muon swapped in for optimizer.Muon
PLAIN = ("import runpy, sys, torch; sys.path.insert(0, {root!r}); import optimizer; optimizer.Muon = torch.optim.Muon; "
         "sys.argv = ['w', 'muon']; runpy.run_path({worker!r}, run_name='__main__')")


def torchrun(args):
    env = dict(os.environ, OMP_NUM_THREADS='1')
    return subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2'] + args,
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_fsdp_two_ranks_equal_one_process():
    for kind in ('muon', 'adamw'):
        p = torchrun(['tests/fsdp_muon_worker.py', kind])
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
        print(p.stdout.strip())


def test_shardwise_newton_schulz_would_fail(tmp_path):
    script = tmp_path / 'plain_muon_worker.py'
    script.write_text(PLAIN.format(root=ROOT, worker=os.path.join(ROOT, 'tests', 'fsdp_muon_worker.py')))
    p = torchrun([str(script)])
    assert p.returncode != 0 and 'AssertionError' in p.stderr, p.stderr[-2000:]


def test_split_and_lr_rule():
    import torch.nn as nn
    from optimizer import ADJUST_LR, build
    from torch.optim._muon import _adjust_lr
    net = nn.Sequential(nn.Conv3d(2, 4, 2), nn.Flatten(), nn.Linear(4, 8), nn.LayerNorm(8), nn.Embedding(3, 8))
    muon, adamw = build(net, 'muon', 1e-5, 0.01)
    names = {id(p): n for n, p in net.named_parameters()}
    assert sorted(names[id(p)] for p in muon.param_groups[0]['params']) == ['2.weight', '4.weight']
    assert sorted(names[id(p)] for p in adamw.param_groups[0]['params']) == ['0.bias', '0.weight', '2.bias', '3.bias', '3.weight']
    assert adamw.param_groups[0]['betas'] == (0.95, 0.95)
    # the released adjust_lr_for_muon: lr * 0.2 * sqrt(max(A, B))
    assert math.isclose(_adjust_lr(1e-5, ADJUST_LR, torch.Size([3072, 12288])), 1e-5 * 0.2 * math.sqrt(12288))
    (only,) = build(net, 'adamw', 1e-5, 0.01)
    assert isinstance(only, torch.optim.AdamW) and len(only.param_groups[0]['params']) == 7
