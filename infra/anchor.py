"""
The trust region's anchor as stored (trust_region.py has the method: a frozen copy of the policy's
trainable weights, refreshed every anchor_every optimizer steps for 'moving' and 'dual', never for
'fixed', none for 'none' and 'stepwise'): under FSDP2 each rank holds only its local shards, and a
forward under the anchor's weights swaps them into the policy in place through one buffer, never a
second full copy (3.9 GB a GPU at 8.3B in fp32).

    anchor = Anchor(policy, strategy, every)   # train.py
    with torch.no_grad(), anchor.applied(policy): mean_anchor = ...   # before the grad forward
    anchor.maybe_refresh(policy, opt_steps)

Tested by: python -m pytest tests/test_trust_region.py   (the FSDP2 part runs torchrun on CPU)
"""
import contextlib

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, distribute_tensor

STRATEGIES = ('none', 'fixed', 'stepwise', 'moving', 'dual')  # trust_region.STRATEGIES
KEEPS = ('fixed', 'moving', 'dual')  # the strategies with a position term: they keep an anchor
MOVES = ('moving', 'dual')  # ... and refresh it every `every` optimizer steps


def _trainable(model):
    # the weights the optimizer moves: all of them for a full fine-tune, the adapters for LoRA (peft
    # freezes the base; with diffusers' add_adapter, call requires_grad_(False) first). FSDP2 leaves
    # the root's weights all-gathered after a forward; resharding every unit first returns the
    # sharded DTensors the optimizer holds (infra/parallel.py's reshard, not imported here)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t  # a DTensor's shard on this rank (a view)


class Anchor:
    """A frozen copy of the policy's trainable weights; under FSDP2 it holds only local shards."""

    def __init__(self, model, strategy, every):  # every: train.py's anchor_every
        if strategy not in STRATEGIES:
            raise ValueError(f'unknown KL strategy {strategy!r}, expected one of {STRATEGIES}')
        self.strategy, self.every = strategy, every
        self.weights = {}  # name -> tensor (a sharded DTensor under FSDP2); empty if not needed
        self._buffers = {}  # (dtype, device) -> applied()'s swap buffer
        if strategy in KEEPS:
            with torch.no_grad():  # clone of a DTensor is a DTensor with the same local shard size
                self.weights = {n: p.detach().clone() for n, p in _trainable(model).items()}

    @torch.no_grad()
    def refresh(self, model):
        params = _trainable(model)
        for name, w in self.weights.items():  # nothing for 'none' / 'stepwise'
            w.copy_(params[name])

    def maybe_refresh(self, model, step):
        # step = optimizer steps done so far; 'fixed' keeps the initial model forever
        if self.strategy in MOVES and step % self.every == 0:
            self.refresh(model)

    @contextlib.contextmanager
    def applied(self, model):
        """with anchor.applied(model): v_anchor = model(...)  -- anchor weights, no grad.

        Run it BEFORE the policy's grad-tracking forward of the same micro-batch: the weights are
        swapped in place, and a swap between a forward and its backward corrupts autograd (the
        version-counter check raises, and FSDP2's kept-gathered root would serve the anchor).
        Inside the body the anchor's own tensors hold the policy's weights (a swap, not a copy):
        nothing there may read or refresh the anchor.
        """
        if not self.weights:
            raise RuntimeError(f'strategy {self.strategy!r} keeps no anchor')
        swapped = []
        with torch.no_grad():
            try:
                for name, p in _trainable(model).items():
                    self._swap(p, self.weights[name])  # the policy's wait in the anchor's tensors
                    swapped.append(name)
                yield  # the body runs under no_grad too: the anchor's output is a target
            finally:  # reshard first, or the root keeps the anchor's gathered weights
                params = _trainable(model)
                for name in swapped:
                    self._swap(params[name], self.weights[name])  # both back, bitwise: plain copies

    def _swap(self, a, b):
        # exchange the contents of two tensors of one shape and dtype (sharded DTensors: their local
        # shards) through a buffer kept for it: no per-call copy of all the weights (3.9 GB a GPU at
        # 8.3B in fp32), one buffer the size of the largest local tensor, allocated once
        a, b = _local(a), _local(b)
        key = (a.dtype, a.device)
        if key not in self._buffers:
            size = max(_local(w).numel() for w in self.weights.values())
            self._buffers[key] = torch.empty(size, dtype=a.dtype, device=a.device)
        tmp = self._buffers[key][:a.numel()].view(a.shape)
        tmp.copy_(a)
        a.copy_(b)
        b.copy_(tmp)

    def state_dict(self):
        # name -> the anchor's own tensors (no copy, like nn.Module.state_dict): trainable-parameter
        # names of the model; under FSDP2 sharded DTensors, to save with distributed.checkpoint
        # or gather with .full_tensor() on every rank. {} for 'none' / 'stepwise'.
        return dict(self.weights)

    @torch.no_grad()
    def load_state_dict(self, sd):
        if sd.keys() != self.weights.keys():
            raise KeyError(f'anchor keys differ: {sorted(set(sd) ^ set(self.weights))[:5]}')
        for name, w in self.weights.items():
            src = sd[name]
            if isinstance(w, DTensor) and not isinstance(src, DTensor):  # a gathered full tensor
                src = distribute_tensor(src.to(w.device), w.device_mesh, w.placements)
            w.copy_(src)
