"""
Worker for tests/test_optimizer.py: two optimizer steps of optimizer.build ('muon' or 'adamw') on a
small model sharded with FSDP2 over 2 CPU ranks (gloo) give the weights of torch's own optimizers
(torch.optim.Muon + AdamW as the released split, or AdamW) on an unsharded copy in one process, at a
weight decay that is neither torch's default (AdamW 0.01, Muon 0.1) nor train.py's: a decay that build
does not pass on fails. Every rank also runs the one-process reference (same seed, the whole batch),
so the comparison needs no file. Exits non-zero on failure; prints the largest difference.

    python -m torch.distributed.run --nproc_per_node=2 tests/fsdp_muon_worker.py muon
"""
import copy
import gc
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
from infra.optimizer import ADAMW_BETAS, ADAMW_EPS, ADJUST_LR, MOMENTUM, build  # noqa: E402

DIM = 16  # rows split 8 + 8 over 2 ranks; the head's 5 rows split 3 + 2 (an uneven shard)
LR = 1e-2  # large enough that two steps move every weight well above float noise
WD = 0.3  # decays the weights by 0.6% in two steps: ~1e-3, vs the 1e-5 tolerance


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))
                                     for _ in range(2)])
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, 5)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(self.norm(x))


def batches(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, DIM, generator=g), torch.randn(8, 5, generator=g)  # the global batch


def torch_optimizers(model, kind):
    """torch's own optimizers with every hyperparameter written out: the one-process reference."""
    if kind == 'adamw':
        return [torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)]
    matrices = [p for p in model.parameters() if p.ndim == 2]
    return [torch.optim.Muon(matrices, lr=LR, weight_decay=WD, momentum=MOMENTUM, nesterov=True, adjust_lr_fn=ADJUST_LR),
            torch.optim.AdamW([p for p in model.parameters() if p.ndim != 2], lr=LR, betas=ADAMW_BETAS, eps=ADAMW_EPS,
                              weight_decay=WD)]


def run(kind, rank, world):
    """Two steps on both models; returns (largest |fsdp - one process|, smallest largest-move of a tensor)."""
    torch.manual_seed(0)
    ref = Net()
    model = copy.deepcopy(ref)
    for block in model.blocks:
        fully_shard(block, mesh=init_device_mesh('cpu', (world,)))
    fully_shard(model, mesh=init_device_mesh('cpu', (world,)))
    opt_ref, opt = torch_optimizers(ref, kind), build(model, kind, LR, WD)
    assert len(opt) == (2 if kind == 'muon' else 1)
    start = {n: p.detach().clone() for n, p in ref.named_parameters()}
    for step in range(2):
        x, y = batches(step)
        n = len(x) // world
        for m, opts, xs, ys in ((ref, opt_ref, x, y), (model, opt, x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n])):
            m.zero_grad(set_to_none=True)
            ((m(xs) - ys) ** 2).mean().backward()  # FSDP averages over ranks: the mean over the batch
            for o in opts:
                o.step()
    worst, moved = 0.0, float('inf')
    for (name, p), (_, q) in zip(ref.named_parameters(), model.named_parameters()):
        full = q.full_tensor()
        worst = max(worst, (full - p).abs().max().item())
        moved = min(moved, (p - start[name]).abs().max().item())  # every tensor moved by much more
    return worst, moved


def main():
    kind = sys.argv[1]
    dist.init_process_group('gloo')
    rank, world = dist.get_rank(), dist.get_world_size()
    worst, moved = run(kind, rank, world)
    if rank == 0:
        print(f'{kind}: largest |fsdp - one process| {worst:.2e}; smallest largest-move of a tensor {moved:.2e}')
    assert moved > 1e-3, moved
    assert worst < 1e-5, worst
    dist.barrier()
    # the sharded model is gone with run(): its FSDP state held the gloo group, and a group that
    # outlives destroy_process_group() can abort the process as it is freed ('terminate called
    # without an active exception')
    gc.collect()
    dist.destroy_process_group()


if __name__ == '__main__':
    main()
