"""
Worker for tests/test_trust_region.py::test_anchor_fsdp2: the Anchor on a model sharded with FSDP2
(fully_shard per block, then the root) over 2 CPU processes with gloo. Exits non-zero on failure.

    python -m torch.distributed.run --nproc_per_node=2 tests/fsdp_anchor_worker.py
"""
import gc
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
from infra.anchor import Anchor  # noqa: E402

DIM = 16  # width of the toy model; 16 rows split 8 + 8 over 2 ranks


class Toy(nn.Module):
    # the root owns weights too (inp, out): those stay gathered after a forward, the case to test
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(DIM, DIM), nn.GELU()) for _ in range(2)])
        self.out = nn.Linear(DIM, DIM)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = x + block(x)
        return self.out(x)


def local_copy(model):
    return {n: p.to_local().clone() for n, p in model.named_parameters()}


def check(rank, world):
    mesh = init_device_mesh('cpu', (world,))
    torch.manual_seed(0)  # the same initial weights on every rank
    model = Toy()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(rank))  # (4, DIM) per rank

    anchor = Anchor(model, 'dual', every=10)
    for name, w in anchor.weights.items():  # shards, not full copies
        full = dict(model.named_parameters())[name]
        assert isinstance(w, DTensor), name
        assert w.to_local().numel() < full.numel(), (name, w.to_local().shape, full.shape)

    with torch.no_grad():
        y_initial = model(x)  # leaves the root gathered
    with anchor.applied(model):
        y_anchor = model(x)
    assert torch.equal(y_anchor, y_initial), 'anchor != policy right after refresh'

    # one optimizer step: the anchor forward first, then the policy's grad-tracking forward
    before = local_copy(model)
    with anchor.applied(model):
        model(x)
    assert all(torch.equal(before[n], p.to_local()) for n, p in model.named_parameters()), 'restore'
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()

    with torch.no_grad():
        y_policy = model(x)
    with anchor.applied(model):
        y_anchor = model(x)
    with torch.no_grad():
        y_policy_again = model(x)  # the root must not keep the anchor's gathered weights
    assert not torch.allclose(y_anchor, y_policy), 'anchor should lag the policy after a step'
    assert torch.equal(y_anchor, y_initial), 'the anchor is still the initial model'
    assert torch.equal(y_policy, y_policy_again), 'policy weights not restored after applied()'

    sd = anchor.state_dict()  # DTensor shards; round trip through a fresh anchor
    other = Anchor(model, 'dual', every=10)
    other.load_state_dict(sd)
    with other.applied(model):
        assert torch.equal(model(x), y_initial), 'state_dict round trip'
    full = {n: w.full_tensor() for n, w in sd.items()}  # and from gathered full tensors
    other.refresh(model)
    other.load_state_dict(full)
    with other.applied(model):
        assert torch.equal(model(x), y_initial), 'load from full tensors'

    anchor.maybe_refresh(model, 10)
    with anchor.applied(model):
        assert torch.equal(model(x), y_policy), 'anchor == policy after maybe_refresh'


def main():
    dist.init_process_group('gloo')
    rank, world = dist.get_rank(), dist.get_world_size()
    check(rank, world)
    dist.barrier()
    print(f'rank {rank} of {world}: fsdp anchor ok', flush=True)
    # the sharded model is gone with check(): FSDP state still holding the gloo group after
    # destroy_process_group() can abort the process on exit ('terminate called without an active exception')
    gc.collect()
    dist.destroy_process_group()


if __name__ == '__main__':
    main()
