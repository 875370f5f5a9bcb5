"""
The policy, whatever the video model: FSDP2 sharding of its blocks, cached prompt embeddings, the
classifier-free-guided velocity, the sampling loop, noise and mp4 files. train.py, sample.py,
models/export.py and the benches call these; none of them names a model class.

A model directory is in diffusers layout (`transformer/`, `vae/`, `text_encoder*/`, `tokenizer*/`,
`model_index.json`); its family file (models/__init__.py: the table and the interface) does what
differs between models.
"""
import hashlib
import json
import os
import warnings

import gc
import imageio
import numpy as np
import torch
import torch.distributed as dist

import sde
from infra import parallel, sp
from models import family, family_of, hold_frozen

# FSDP2 warns that the transformer returns a view (an in-place op on it would skip the backward
# all-gather); velocity() only ever applies out-of-place ops to it
warnings.filterwarnings('ignore', message='FSDP2-wrapped module .* returned a view tensor')

# ----------------------------------------------------------------------------- settings (train.py's, set as its own)
experts = 'both'                # Wan 2.2 A14B's experts that train: 'both' | 'high' | 'low'
gradient_checkpointing = True   # recompute block activations in backward
attention = 'valid_tokens'      # the blocks' attention: padding left out (models/attention.py)
attention_backend = 'native'    # diffusers' attention backend: 'native', '_native_flash', ...
# -----------------------------------------------------------------------------


def kernels():
    """load_policy's keyword arguments from the settings above (train.py's policy)."""
    return dict(experts=experts, checkpointing=gradient_checkpointing, attention=attention,
                backend=attention_backend)


def load_transformer(path, device='cpu', meta=False, attention=None, backend=None):
    """The transformer in float32 (the trainer's master weights); on the meta device if meta; its
    blocks' attention (models/attention.py) and dispatcher backend as given, else the family's defaults."""
    fam = family(path)
    kw = {k: v for k, v in dict(attention=attention, backend=backend).items() if v is not None}
    net = fam.load_transformer(path, meta=meta, **kw)
    return net if meta else net.to(device)


def transformer_config(path):
    """The transformer's config.json of model directory `path` (sizes only, no weights read)."""
    try:
        with open(os.path.join(path, 'transformer', 'config.json')) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise SystemExit(f'{path!r}: no readable transformer/config.json ({type(e).__name__}: {e})')


def load_policy(path, device, fsdp=False, lora_rank=0, checkpointing=False, base_dtype=None, attention=None,
                backend=None, mesh=None, experts='both', solo_timeout=60.0, sp_mesh=None):
    """The trainable transformer: LoRA adapters if lora_rank > 0, FSDP2-sharded per block and at
    the root when fsdp, over `mesh` (None: flat over all ranks; 2-D: HSDP, parallel.fsdp_mesh).
    Under FSDP only rank 0 reads the base model from disk; the other ranks build on the meta device
    and receive their shards by broadcast, so no process ever holds more than one full copy in host
    memory. While rank 0 reads (and upcasts to fp32: minutes at 8.3B) the others wait on the c10d store
    for at most solo_timeout minutes (parallel.solo), not in the broadcast, whose dist_timeout counts
    only the broadcast itself. Trained weights are read into it afterwards (infra/checkpoint.py).
    base_dtype: of the frozen base weights of a LoRA run; default bf16 for LoRA on one GPU (8.3B:
    17 GB instead of 33 GB; velocity() computes in bf16 there anyway), else fp32.
    experts: of a two-expert model (Wan 2.2 A14B), which train: 'both', 'high' or 'low' (the other
    frozen: requires_grad False, so the optimizer, the anchor and the checkpoints leave it out; bf16
    on a GPU, where it computes in bf16 anyway: Experts.freeze). sp_mesh: every forward splits its
    tokens over the sp group (infra/sp.py; FSDP shards over its own mesh)."""
    master = not fsdp or dist.get_rank() == 0
    fam = family(path)
    read = lambda meta: load_transformer(path, meta=meta, attention=attention, backend=backend)  # noqa: E731
    # under FSDP rank 0 reads the full model while the others wait on the store (None), then build on meta
    net = parallel.solo(lambda: read(False), 'load_policy', solo_timeout) if fsdp else read(False)
    if net is None:
        net = read(True)  # the same modules, no weights: rank 0's arrive by broadcast below
    if lora_rank > 0:  # freeze the base, train only the adapters (diffusers' peft integration)
        from peft import LoraConfig
        net.requires_grad_(False)
        if base_dtype is None:
            base_dtype = torch.bfloat16 if not fsdp and torch.device(device).type == 'cuda' else torch.float32
        hold_frozen(net, base_dtype, buffers=True)
        net.add_adapter(LoraConfig(r=lora_rank, lora_alpha=lora_rank, target_modules=fam.LORA_TARGETS))
        for p in net.parameters():  # peft builds adapters in the base's dtype: they (and so their
            if p.requires_grad:     # AdamW state and the anchor) stay fp32, master weights
                p.data = p.data.float()
    if experts != 'both':
        if not hasattr(net, 'freeze'):
            raise SystemExit(f"experts={experts!r}: {path!r} has one transformer; only a two-expert model "
                             "(Wan 2.2 T2V-A14B) trains one expert of two")
        net.freeze(experts, torch.bfloat16 if torch.device(device).type == 'cuda' else torch.float32)
    if checkpointing:
        net.enable_gradient_checkpointing()  # recompute each block's activations in backward
    if not fsdp:  # fp32 trained weights; on a GPU velocity() computes in bf16 under autocast
        return _split(net.to(device), sp_mesh, fam)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    full = net.state_dict() if master else {}  # references, kept alive across the sharding
    # non-persistent buffers (Wan's rope tables) are in no state dict: rank 0's, broadcast below
    saved = net.state_dict().keys()
    extra = {n: b for n, b in net.named_buffers() if n not in saved}
    shard(net, fam.blocks(net), cuda=torch.device(device).type == 'cuda', mesh=mesh)
    net.to_empty(device=device)  # every parameter and buffer uninitialised, on every rank
    set_model_state_dict(net, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    for n, b in net.named_buffers():
        if n in extra:
            if master:
                b.copy_(extra[n])
            dist.broadcast(b, 0)
    del full, extra
    return _split(net, sp_mesh, fam)


def _split(net, sp_mesh, fam):
    if sp_mesh is not None:
        sp.enable(net, sp_mesh, fam.cp_plan(net))
    return net


def shard(net, blocks, cuda, mesh=None):
    """FSDP2 as the trainer applies it: each block, then the root (bench/fullsize.py measures this);
    mesh None: sharded over all ranks, a 2-D (replicate, shard) mesh: HSDP."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    # fp32 master shards, bf16 compute and fp32 gradient reduce-scatter: an update of lr 1e-5
    # would vanish in the rounding of bf16 weights
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if cuda else None, reduce_dtype=torch.float32)
    # a block's inputs are not cast: torch <= 2.12 cast them in the forward but not in the recompute of
    # activation checkpointing (pytorch issue 159359), so the first backward stopped on fp32 RoPE tables
    # where bf16 ones were saved. Uncast, the block computes under velocity()'s autocast, RoPE in fp32 as
    # diffusers' own bf16 pipeline keeps it (tests/test_gpu_launch.py)
    mp_block = MixedPrecisionPolicy(param_dtype=mp.param_dtype, reduce_dtype=torch.float32,
                                    cast_forward_inputs=False)
    for block in blocks:  # the FSDP (and checkpointing) unit
        fully_shard(block, mp_policy=mp_block, mesh=mesh)
    fully_shard(net, mp_policy=mp, mesh=mesh)


# ----------------------------------------------------------------------------- text

def encode_prompts(path, prompts, device='cpu', sink=None, chunk=256):
    """{prompt: (embeds, mask, ...)} on the CPU, each pair trimmed to its valid tokens (at least one),
    with the family's own text encoders. With sink, each chunk of prompts is handed to sink(dict) as
    soon as it is encoded and dropped (infra/prompt_cache.py writes it to disk): host memory holds one
    chunk, not the prompt set."""
    prompts = sorted(set(prompts))
    cache = {}
    sink = sink or cache.update
    encode = family(path).text_encoder(path, device)
    for c in range(0, len(prompts), chunk):
        ps = prompts[c:c + chunk]
        tensors = [t.detach().cpu() for t in encode(ps)]  # [embeds (B, L, D), mask (B, L), ...]
        out = {}
        for i, p in enumerate(ps):
            item = []
            for embeds, mask in zip(tensors[::2], tensors[1::2]):
                # count_nonzero, not sum: a bf16 sum of ones rounds above 256 (257 -> 256)
                n = max(1, int(mask[i].count_nonzero()))
                # valid tokens come first (right padding); clone: not a view of the batch
                item += [embeds[i, :n].clone(), mask[i, :n].clone()]
            out[p] = tuple(item)
        sink(out)
    del encode  # the text encoders, freed before training starts
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return cache


def batch_text(cache, prompts, device, dtype=torch.float32):
    """The cached text tensors of a list of prompts, each zero-padded to the longest and stacked:
    (B, L, D), (B, L), ... as the family's encoder returns them (masks: float32)."""
    out = []
    for j in range(len(cache[prompts[0]])):
        items = [cache[p][j] for p in prompts]
        L = max(t.shape[0] for t in items)
        pad = [torch.cat([t, t.new_zeros((L - t.shape[0],) + t.shape[1:])]) for t in items]
        out.append(torch.stack(pad).to(device, dtype if j % 2 == 0 else torch.float32))
    return out


def guided_text(cache, prompts, negative, device):
    """batch_text() of the prompts and of as many negative prompts: the (text, text_neg) of a guided
    velocity (classifier-free guidance's two branches)."""
    return batch_text(cache, prompts, device), batch_text(cache, [negative] * len(prompts), device)


def _cat_text(a, b):
    out = []
    for ta, tb in zip(a, b):  # pad both to a common length, then stack on the batch
        L = max(ta.shape[1], tb.shape[1])
        pad = lambda t: torch.cat([t, t.new_zeros((t.shape[0], L - t.shape[1]) + t.shape[2:])], 1)
        out.append(torch.cat([pad(ta), pad(tb)]))
    return out


# ----------------------------------------------------------------------------- velocity, sampling

# transformer passes of this process since the last count_passes(), [without grad, with grad]: a pass
# is one clip through the transformer for one CFG branch (a forward; with grad, forward + backward)
PASSES = [0, 0]
PASS_KINDS = ('rollout', 'old', 'anchor', 'update', 'diag_anchor', 'diag', 'eval')  # train.py's; with grad: update, diag


def count_passes(totals, kinds, device='cpu'):
    """Add the passes of every rank since the last call to totals[kinds[0]] (without grad) and
    totals[kinds[1]] (with grad), then start again from 0. Collective: every rank calls it alike."""
    n = torch.tensor(PASSES, device=device)  # (2,) int64
    if dist.is_initialized():
        dist.all_reduce(n)  # a sum of integers: exact
    PASSES[:] = [0, 0]
    for kind, k in zip(kinds, n.tolist()):
        totals[kind] += k
    if len(kinds) < 2 and n[1]:
        raise RuntimeError(f'{kinds[0]}: {int(n[1])} passes with grad where none were expected')


def velocity(net, x, s, text, cfg=1.0, text_neg=None):
    """Guided velocity v = v_u + cfg * (v_c - v_u), both branches in one batched forward.
    x: (B, C, F, h, w) float32, s: (B,) sigmas, text/text_neg: batch_text() outputs. A family with
    guidance() (models/__init__.py OPTIONAL) scales each sample by its own: Wan 2.2 A14B's expert's."""
    B = x.shape[0]
    fam = family_of(net)
    if hasattr(fam, 'guidance'):
        cfg = fam.guidance(net, s, cfg)  # a number, or (B,)
        if torch.is_tensor(cfg):
            cfg = cfg.view(-1, *[1] * (x.dim() - 1)) if (cfg != 1.0).any() else 1.0
    if torch.is_tensor(cfg) or cfg != 1.0:
        x, s = torch.cat([x, x]), torch.cat([s, s])
        text = _cat_text(text, text_neg)
    PASSES[torch.is_grad_enabled()] += x.shape[0] * sp.leads_group(net)  # clips x CFG branches, once per sp group
    with torch.autocast('cuda', torch.bfloat16, enabled=x.is_cuda):  # bf16 compute on GPUs
        v = fam.forward(net, x, s, text)
    v = v.float()  # the SDE step and its log-prob run in float32
    if not torch.is_tensor(cfg) and cfg == 1.0:
        return v
    v_cond, v_uncond = v[:B], v[B:]
    return v_uncond + cfg * (v_cond - v_uncond)


def noise(shape, generators, device):
    """One N(0, I) draw per sample from its own generator: a rollout does not depend on how
    rollouts are batched or spread over ranks."""
    return torch.stack([torch.randn(shape, generator=g) for g in generators]).to(device)


def generators(seeds):
    return [torch.Generator().manual_seed(int(s) % (2 ** 63)) for s in seeds]


def seed_of(*parts):
    """A 63-bit seed from any tuple, e.g. (seed, 'rollout', iteration, clip): every random draw of a
    run is a function of what it is for, so a resumed run draws the same and no RNG state is saved."""
    return int(hashlib.sha256(repr(parts).encode()).hexdigest()[:15], 16)


RECORDS = sde.RECORDS  # what sample() can keep of every step


def sample(net, x, sigmas, text, cfg, text_neg, kind, eta, gens, keep=(), window=None, boundary=None):
    """sde.rollout with the guided velocity of transformer net for text, text_neg: the ODE sampler
    (kind 'ode') of the evaluation and sample.py, and the SDE at the steps in `window` (all if None)."""
    def v(x, s):
        return velocity(net, x, s, text, cfg, text_neg)
    return sde.rollout(v, x, sigmas, kind, eta, gens, steps=window, keep=keep, boundary=boundary)


# ----------------------------------------------------------------------------- frames

def load_decoder(path, device):
    """decode(latents (B, C, F, h, w)) -> frames (B, F, 3, H, W) in [0, 1], the family's own VAE."""
    return family(path).load_decoder(path, device)


def latent_shape(path, num_frames, height, width):
    """(C, F, h, w) of one clip's latents."""
    return tuple(family(path).latent_shape(path, num_frames, height, width))


def save_mp4(frames, path, fps):
    """frames (F, 3, H, W) in [0, 1] -> an H.264 mp4 (yuv420p wants even sides: pad if needed)."""
    a = (frames.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    a = np.pad(a, ((0, 0), (0, a.shape[1] % 2), (0, a.shape[2] % 2), (0, 0)), mode='edge')
    imageio.mimwrite(path, list(a), fps=fps, macro_block_size=1)
