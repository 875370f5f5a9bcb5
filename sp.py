"""
Sequence (context) parallel: one clip's tokens split over sp_size ranks, Ulysses over the attention
heads, with diffusers' own context-parallel machinery (ContextParallelConfig, enable_parallelism, the
NATIVE attention backend's all-to-all). diffusers 0.42 ships no `_cp_plan` for
HunyuanVideo15Transformer3DModel: CP_PLAN below is this project's.

    torchrun --nproc_per_node=8 train.py config/released.py     # sp_size 2: 4 groups of 2 GPUs

Layout: world = dp x sp; ranks r = dp_rank * sp + sp_rank (an sp group is consecutive ranks, one
node's fast links). The ranks of a group hold the same clips, draw the same noise and compute the same
velocity (gathered at the end of the model); each runs the blocks on 1/sp of the video tokens and
1/sp of the text tokens. FSDP2 still shards the weights over all ranks. Gradients need no correction:
the gather's backward hands each rank only its own tokens' gradient, so a group's ranks together
contribute one clip's gradient once, and train.py's loss denominator stays per world rank.

What the blocks' attention processor must do to compose (diffusers' dispatcher does the rest):
call `dispatch_attention_fn(q, k, v, attn_mask=key_mask, backend=self._attention_backend,
parallel_config=self._parallel_config)` with q, k, v (B, S_local, heads, d) the local [video, text]
tokens and key_mask (B, S_local) bool: the dispatcher reshapes it to (B, 1, 1, S_local) and Ulysses
all-gathers it in the same rank order as the keys. diffusers' own HunyuanVideo15AttnProcessor2_0 cannot:
its dense (B, 1, S_local, S_local) mask has the local query length, which the all-to-all makes global
(a shape error), so enable() sets attention.MaskedKeysAttention, which does (identical outputs on valid tokens).

Limits: heads % sp == 0 (16 heads: sp 1, 2, 4, 8, 16; the toy's 3 heads: sp 1 or 3) and the video
tokens F*h*w % sp == 0 (81 frames at 480x848, 33,390 tokens, or at 352x624, 18,018: sp 2 only;
121 frames at 720x1280, 111,600: up to 16),
both checked with a clear error. The text tokens are padded with masked tokens to a multiple of sp.
diffusers' Ulysses-anything mode (uneven splits) has no backward pass, so it cannot train.

Cost per GPU at sp 1 / 2 / 4: results/fullsize.md's sequence-parallel section. diffusers' NATIVE backend (what
the processor dispatches to by default) saves only q, k, v for Ulysses and recomputes the attention forward in its
backward, one more attention forward per block; its `_native_cudnn` backend saves the logsumexp instead (a GPU
and bf16: `policy.set_attention_backend('_native_cudnn')`; untested here).
"""
import contextlib
from unittest import mock

import torch
import torch.nn.functional as F
from diffusers.models._modeling_parallel import (ContextParallelConfig, ContextParallelInput,
                                                 ContextParallelOutput)
from torch.distributed.device_mesh import init_device_mesh

from attention import MaskedKeysAttention, set_attention

# where diffusers' hooks split and gather (module name -> inputs or outputs): the rope tables, the
# first block's two streams and every block's text mask are split on the token axis; the last
# layer's output is gathered
CP_PLAN = {
    'rope': {0: ContextParallelInput(split_dim=0, expected_dims=2, split_output=True),   # cos (V, d)
             1: ContextParallelInput(split_dim=0, expected_dims=2, split_output=True)},  # sin (V, d)
    'transformer_blocks.0': {  # after the text streams are merged and reordered (valid tokens first)
        'hidden_states': ContextParallelInput(split_dim=1, expected_dims=3),          # video (B, V, D)
        'encoder_hidden_states': ContextParallelInput(split_dim=1, expected_dims=3),  # text (B, T, D)
    },
    'transformer_blocks.*': {  # the model hands every block the whole text mask
        'attention_mask': ContextParallelInput(split_dim=1, expected_dims=2),         # text (B, T)
    },
    'proj_out': ContextParallelOutput(gather_dim=1, expected_dims=3),  # (B, V/sp, p) -> (B, V, p)
}


def mesh(sp_size, device):
    """The (dp, ring, ulysses) device mesh of world = dp x sp ranks; ring is always 1."""
    import torch.distributed as dist
    if not dist.is_initialized():
        raise SystemExit(f'sp_size {sp_size} needs several processes: torchrun --nproc_per_node=N with N a multiple of it')
    world = dist.get_world_size()
    if sp_size < 1 or world % sp_size:
        raise SystemExit(f'sp_size {sp_size} must divide the world size {world}')
    return init_device_mesh(torch.device(device).type, (world // sp_size, 1, sp_size),
                            mesh_dim_names=('dp', 'ring', 'ulysses'))


def enable(model, device_mesh):
    """Split every forward of model over the mesh's ulysses ranks (call once, before or after FSDP)."""
    sp_size = device_mesh['ulysses'].size()
    heads = model.config.num_attention_heads
    if heads % sp_size:
        raise SystemExit(f'sp_size {sp_size} must divide the transformer\'s {heads} attention heads '
                         '(Ulysses gives each rank heads / sp_size of them)')
    if not all(isinstance(b.attn.processor, MaskedKeysAttention) for b in model.transformer_blocks):
        set_attention(model, 'masked_keys')  # diffusers' own processor cannot compose (module docstring)
    config = ContextParallelConfig(ulysses_degree=sp_size, mesh=device_mesh)
    # diffusers picks the device as rank % torch.accelerator.device_count(), which is 0 on a CPU
    cpu = torch.device(device_mesh.device_type).type == 'cpu'
    with mock.patch.object(torch.accelerator, 'device_count', lambda: 1) if cpu else contextlib.nullcontext():
        model.enable_parallelism(config=config, cp_plan=CP_PLAN)
    return model


def degree(model):
    """sp_size of a model enable() was applied to, else 1."""
    pc = getattr(model, '_parallel_config', None)
    return pc.context_parallel_config.ulysses_degree if pc is not None and pc.context_parallel_config else 1


def first(model):
    """Whether this rank is the first of its sp group (always, without sequence parallel)."""
    pc = getattr(model, '_parallel_config', None)
    return pc is None or pc.context_parallel_config is None or pc.context_parallel_config._ulysses_local_rank == 0


def pad_text(model, x, text, image_tokens):
    """text (batch_text's four tensors) with the Qwen text padded by masked tokens, so that the
    model's text tokens (Qwen + ByT5 + image) split evenly; checks that the video tokens do."""
    n = degree(model)
    if n == 1:
        return text
    video = x.shape[2:].numel() // (model.config.patch_size_t * model.config.patch_size ** 2)
    if video % n:
        raise SystemExit(f'sequence parallel: {video} video tokens (latents {tuple(x.shape[1:])}) do not '
                         f'split over sp_size {n}; choose a frame count or size whose latent grid divides')
    e1, m1, e2, m2 = text
    extra = -(e1.shape[1] + e2.shape[1] + image_tokens) % n
    return [F.pad(e1, (0, 0, 0, extra)), F.pad(m1, (0, extra)), e2, m2]  # padding: masked (0)


def spread(fn, n, device_mesh):
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
    first = next(p for p in parts if p is not None)
    out = {k: v.new_empty((n,) + v.shape[1:]) for k, v in first.items()}
    for j, p in enumerate(parts):
        for k, v in (p or {}).items():
            out[k][j::size] = v
    return out
