"""
Sequence (context) parallel: one clip's tokens split over sp_size ranks, Ulysses over the attention
heads, with diffusers' own context-parallel machinery (ContextParallelConfig, enable_parallelism and
its split and gather hooks; the all-to-all in the attention processor, see below). diffusers 0.42
ships no `_cp_plan` for HunyuanVideo15Transformer3DModel (hunyuan15.cp_plan is this project's;
wan.cp_plan is diffusers' own WanTransformer3DModel._cp_plan); every family file hands its plan
to enable().

    torchrun --nproc_per_node=8 train.py config/released.py     # sp_size 2: 4 groups of 2 GPUs

Layout: world = dp x sp; ranks r = dp_rank * sp + sp_rank (an sp group is consecutive ranks inside
one node, on its fast links: parallel.check_layout). The ranks of a group hold the same clips, draw
the same noise and compute the same velocity (gathered at the end of the model); each runs the
blocks on 1/sp of the video tokens and 1/sp of the text tokens. FSDP2 shards the weights over its
own mesh (parallel.fsdp_mesh). Gradients need no correction: the gather's backward hands each rank
only its own tokens' gradient, so a group's ranks together contribute one clip's gradient once, and
train.py's loss denominator stays per world rank.

What a family's attention processor must do to compose, one of:
- Ulysses itself (hunyuan15.ValidTokensAttention, the default): diffusers' enable_parallelism sets its
  `_parallel_config`; attention.gather_tokens and attention.scatter_tokens do the all-to-alls over
  attention.ulysses_group(parallel_config), differentiably, around any dispatcher backend, so the
  backward is the backend's own and the padding is dropped, not masked.
- diffusers' Ulysses (hunyuan15.MaskedKeysAttention): call `dispatch_attention_fn(q, k, v,
  attn_mask=key_mask, backend=self._attention_backend, parallel_config=self._parallel_config)` with
  q, k, v (B, S_local, heads, d) the local [video, text] tokens and key_mask (B, 1, 1, S_local)
  bool: Ulysses all-gathers it in the same rank order as the keys. Only backends with diffusers'
  context parallelism (native, _native_cudnn, _native_flash, flash, ...; no mask for the flash ones)
  run it, and NATIVE saves only q, k, v and recomputes the attention forward in its backward.
diffusers' own HunyuanVideo15AttnProcessor2_0 cannot: its dense (B, 1, S_local, S_local) mask has
the local query length, which the all-to-all makes global (a shape error), so hunyuan15.cp_plan()
sets MaskedKeysAttention in its place (identical outputs on valid tokens).

Limits: heads % sp == 0 (16 heads: sp 1, 2, 4, 8, 16; the toy's 3 heads: sp 1 or 3) and the video
tokens F*h*w % sp == 0 (81 frames at 480x848, 33,390 tokens, or at 352x624, 18,018: sp 2 only;
121 frames at 720x1280, 111,600: up to 16),
both checked with a clear error before anything loads (check()). The text tokens are padded with
masked tokens to a multiple of sp.
diffusers' Ulysses-anything mode (uneven splits) has no backward pass, so it cannot train.

Cost per GPU at sp 1 / 2 / 4: results/fullsize.md's sequence-parallel section (measured with
MaskedKeysAttention on diffusers' NATIVE Ulysses, whose backward recomputes the attention forward).
Tested by: python -m pytest tests/test_sp.py (sp 2, sp 4 and dp 2 x sp 2 against one process)
"""
import contextlib
import math
from unittest import mock

import torch

from infra import parallel


def mesh(sp_size, device):
    """The (dp, ring, ulysses) device mesh of world = dp x sp ranks; ring is always 1."""
    import torch.distributed as dist
    if not dist.is_initialized():
        raise SystemExit(f'sp_size {sp_size} needs several processes: torchrun --nproc_per_node=N with N a multiple of it')
    world = dist.get_world_size()
    if sp_size < 1 or world % sp_size:
        raise SystemExit(f'sp_size {sp_size} must divide the world size {world}')
    return parallel.mesh(device, (world // sp_size, 1, sp_size), ('dp', 'ring', 'ulysses'))


def check(sp_size, config, latent):
    """Before anything loads: sp_size divides the attention heads and the video tokens of transformer
    config (its config.json: num_attention_heads, patch_size, patch_size_t) for latents of shape
    latent (C, F, h, w) (the family's latent_shape); else SystemExit with one line."""
    heads, patch = config['num_attention_heads'], config.get('patch_size', 1)
    per_token = math.prod(patch) if isinstance(patch, (list, tuple)) else \
        config.get('patch_size_t', 1) * patch ** 2  # (t, h, w) latents a token: 1 x 1 x 1 in HunyuanVideo 1.5
    video = math.prod(latent[1:]) // per_token
    if heads % sp_size:
        raise SystemExit(f'sp_size {sp_size} must divide the transformer\'s {heads} attention heads '
                         '(Ulysses gives each rank heads / sp_size of them)')
    if video % sp_size:
        raise SystemExit(f'sequence parallel: {video} video tokens (latents {tuple(latent)}) do not split '
                         f'over sp_size {sp_size}; choose a frame count or size whose latent grid divides')


def enable(net, device_mesh, plan):
    """Split every forward of transformer `net` over the mesh's ulysses ranks, at the places of `plan`
    (its family's cp_plan(net)); call once, before or after FSDP."""
    from diffusers.models._modeling_parallel import ContextParallelConfig
    sp_size = device_mesh['ulysses'].size()
    heads = net.config.num_attention_heads
    if heads % sp_size:
        raise SystemExit(f'sp_size {sp_size} must divide the transformer\'s {heads} attention heads '
                         '(Ulysses gives each rank heads / sp_size of them)')
    config = ContextParallelConfig(ulysses_degree=sp_size, mesh=device_mesh)
    # diffusers picks the device as rank % torch.accelerator.device_count(), which is 0 on a CPU
    cpu = torch.device(device_mesh.device_type).type == 'cpu'
    with mock.patch.object(torch.accelerator, 'device_count', lambda: 1) if cpu else contextlib.nullcontext():
        net.enable_parallelism(config=config, cp_plan=plan)
    return net


def group_size(net):
    """sp_size of a transformer enable() was applied to, else 1."""
    pc = getattr(net, '_parallel_config', None)
    return pc.context_parallel_config.ulysses_degree if pc is not None and pc.context_parallel_config else 1


def leads_group(net):
    """Whether this rank is the first of its sp group (always, without sequence parallel): the rank
    that counts the group's passes and scores its clips."""
    pc = getattr(net, '_parallel_config', None)
    return pc is None or pc.context_parallel_config is None or pc.context_parallel_config._ulysses_local_rank == 0


def divide_work(fn, n, device_mesh):
    """Work on n clips that every rank of an sp group holds, done once: sp rank j runs fn(indices)
    on clips j, j + sp, ... and every rank of the group gets the whole result back. fn(list) -> a dict
    of (len(list), ...) tensors; returns the dict of (n, ...) tensors in clip order (on the CPU when
    sp > 1). device_mesh None (sp 1): fn(range(n))."""
    if device_mesh is None or device_mesh['ulysses'].size() == 1:
        return fn(list(range(n)))
    import torch.distributed as dist
    group = device_mesh['ulysses']
    size, me = group.size(), group.get_local_rank()
    mine = list(range(me, n, size))
    part = {k: v.cpu() for k, v in fn(mine).items()} if mine else None
    parts = [None] * size
    dist.all_gather_object(parts, part, group=group.get_group())  # every rank enters, with or without clips
    done = next(p for p in parts if p is not None)
    out = {k: v.new_empty((n,) + v.shape[1:]) for k, v in done.items()}
    for j, p in enumerate(parts):
        for k, v in (p or {}).items():
            out[k][j::size] = v
    return out
