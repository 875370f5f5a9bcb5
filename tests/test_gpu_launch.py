"""What the first 8-GPU launch would meet and only CUDA shows, simulated on the CPU (docs/method.md 4.6):
- the recompute of activation checkpointing under FSDP2's bf16 mixed precision on torch <= 2.12, which did
  not cast a block's inputs in the recompute (pytorch issue 159359): the forward saved bf16 tensors, the
  recompute made fp32 ones, and torch.utils.checkpoint stopped the first backward;
python -m pytest tests/test_gpu_launch.py"""
import os
import socket
import sys

import pytest
import torch
import torch.distributed as dist

from models import policy as model

sys.path.insert(0, os.path.dirname(__file__))
from tiny_hunyuan import make_tiny_hunyuan  # noqa: E402
from tiny_wan import make_tiny_wan  # noqa: E402


@pytest.fixture(scope='module')
def roots(tmp_path_factory):
    return {'hunyuan': make_tiny_hunyuan(tmp_path_factory.mktemp('tiny_hunyuan')),
            'wan': make_tiny_wan(tmp_path_factory.mktemp('tiny_wan'))}


@pytest.fixture
def one_rank():
    # a process group of one gloo rank in this process: FSDP2 needs one, a world of 1 shards nothing
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        port = s.getsockname()[1]
    dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def recompute_without_cast(monkeypatch):
    """FSDP2's pre-forward hook as torch 2.9-2.12 ran it in a checkpoint's recompute (the block is then in
    PRE_BACKWARD): its parameters unsharded, its inputs passed on as they came, not cast to param_dtype
    (torch 2.13 casts them there too)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
    new = FSDPState._pre_forward

    def old(self, module, args, kwargs):
        if self._training_state == TrainingState.PRE_BACKWARD:
            for group in self._fsdp_param_groups:
                if not group.is_unsharded:
                    group.unshard()
                    group.wait_for_unshard()
            return args, kwargs
        return new(self, module, args, kwargs)
    monkeypatch.setattr(FSDPState, '_pre_forward', old)


def batch(root, B=2):
    cache = model.encode_prompts(root, ['a red car', ''])
    text = model.batch_text(cache, ['a red car'] * B, 'cpu')
    C, F, h, w = model.latent_shape(root, 9, 32, 32)
    return torch.randn(B, C, F, h, w, generator=torch.Generator().manual_seed(0)), text


@pytest.mark.parametrize('name', ['hunyuan', 'wan'])
def test_first_backward_survives_the_recompute_of_torch_2_12(roots, name, one_rank, monkeypatch):
    """The family's forward through load_policy's FSDP2 wrapping with bf16 parameters (as on a GPU), under
    bf16 autocast (velocity() on a GPU), with gradient checkpointing, then one backward with torch <= 2.12's
    uncast recompute patched in: it runs, and every trained weight gets a finite gradient."""
    recompute_without_cast(monkeypatch)
    net = model.load_transformer(roots[name])
    net.enable_gradient_checkpointing()
    fam = model.family(roots[name])
    model.shard(net, fam.blocks(net), cuda=True)  # cuda: bf16 parameters and compute, as on a GPU
    x, text = batch(roots[name])
    with torch.autocast('cpu', torch.bfloat16):
        v = fam.forward(net, x, torch.tensor([0.9, 0.3]), text)
    v.float().square().mean().backward()  # torch <= 2.12 with cast_forward_inputs: CheckpointError here
    grads = [p.grad for p in net.parameters() if p.requires_grad]
    assert grads and all(g is not None for g in grads[:4])
    assert all(torch.isfinite(g.full_tensor() if hasattr(g, 'full_tensor') else g).all() for g in grads
               if g is not None)
