"""
Worker for tests/test_optimizer.py: the same two optimizer steps (optimizer.build, 'muon' or 'adamw')
on a small model sharded with FSDP2 over 2 CPU ranks (gloo) and on an unsharded copy in one process
give the same weights. Every rank also runs the one-process reference (same seed, the whole batch),
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
from optimizer import build  # noqa: E402

DIM = 16  # rows split 8 + 8 over 2 ranks; the head's 5 rows split 3 + 2 (an uneven shard)
LR = 1e-2  # large enough that two steps move every weight well above float noise


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


def run(kind, rank, world):
    """Two steps on both models; returns (largest |fsdp - one process|, smallest largest-move of a tensor)."""
    torch.manual_seed(0)
    ref = Net()
    model = copy.deepcopy(ref)
    for block in model.blocks:
        fully_shard(block, mesh=init_device_mesh('cpu', (world,)))
    fully_shard(model, mesh=init_device_mesh('cpu', (world,)))
    opt_ref, opt = build(ref, kind, LR, 0.01), build(model, kind, LR, 0.01)
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
