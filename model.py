"""
The video model both worlds share: the diffusers HunyuanVideo 1.5 transformer (or the toy world's
tiny one of the same class), FSDP2 sharding, cached prompt embeddings, the classifier-free-guided
velocity, the sampling loop and the decoder to frames. train.py, sample.py and bench/toy.py call these.

A model directory is in diffusers layout: `<dir>/transformer/` for the policy, plus `vae/`,
`text_encoder*/`, `tokenizer*/` and `model_index.json` for HunyuanVideo 1.5. A directory with only
`transformer/` (the toy world's) brings its text encoder, autoencoder and latent shape as a plugged-in
world (`world` below): toy.py plugs itself in when imported, so this file never imports toy.py.
"""
import gc
import os
import warnings

import imageio
import numpy as np
import torch
import torch.distributed as dist

import sde
import sp
from attention import ATTENTIONS, set_attention  # the blocks' attention: padding masked as keys only

# FSDP2 warns that the transformer returns a view (an in-place op on it would skip the backward
# all-gather); velocity() only ever applies out-of-place ops to it
warnings.filterwarnings('ignore', message='FSDP2-wrapped module .* returned a view tensor')

HUB_ID = 'hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v'  # the default policy
LORA_TARGETS = ['to_q', 'to_k', 'to_v', 'to_out.0']  # attention projections of every block
IMAGE_TOKENS = 1  # t2v image tokens are all-zero and masked out, so their count (729 in the
                  # pipeline) does not change the output (tests/test_model.py checks it); 1 is cheapest


# The world of a directory with only transformer/ (is_toy): a module with encode_prompts(prompts) ->
# (embeds, mask, embeds_2, mask_2) as the pipeline's encode_prompt returns them, decode(latents) ->
# frames (B, F, 3, H, W) in [0, 1], and LATENT_SHAPE (C, F, h, w). Importing toy.py sets it.
world = None


def plugged_world(path):
    if world is None:
        raise SystemExit(f'{path!r} has only a transformer/: import the world that goes with it first '
                         '(for assets/toy: import toy)')
    return world


def is_toy(path):
    # the real model is a whole diffusers pipeline; the toy world ships only the transformer
    return not os.path.isfile(os.path.join(path, 'model_index.json')) and \
        os.path.isdir(os.path.join(path, 'transformer'))


def missing_weights(path, what, err):
    return SystemExit(
        f'could not load the {what} from {path!r} ({type(err).__name__}: {err}).\n'
        f'Download the weights first, e.g.\n'
        f'  hf download {HUB_ID} --local-dir weights/HunyuanVideo-1.5-480p_t2v\n'
        f'and pass --model=weights/HunyuanVideo-1.5-480p_t2v (for the toy world: --model=assets/toy).')


def load_transformer(path, device='cpu', meta=False, attention=ATTENTIONS[0]):
    """The transformer in float32 (the trainer's master weights); on the meta device if meta;
    its blocks' attention set by set_attention."""
    from diffusers import HunyuanVideo15Transformer3DModel as T
    try:
        if meta:  # shapes only: filled later from rank 0 (see load_policy)
            with torch.device('meta'):
                model = T.from_config(T.load_config(path, subfolder='transformer'))
        else:
            model = T.from_pretrained(path, subfolder='transformer', torch_dtype=torch.float32).to(device)
    except (OSError, ValueError) as e:
        raise missing_weights(path, 'transformer', e) from e
    return set_attention(model, attention)


def load_policy(path, device, fsdp=False, lora_rank=0, checkpointing=False, base_dtype=None,
                attention=ATTENTIONS[0]):
    """The trainable transformer: LoRA adapters if lora_rank > 0, FSDP2-sharded per block and at
    the root when fsdp. Under FSDP only rank 0 reads the base model from disk; the other ranks build
    on the meta device and receive their shards by broadcast, so no process ever holds more than
    one full copy in host memory. Trained weights are read into it afterwards (checkpoint.py).
    base_dtype: of the frozen base weights of a LoRA run; default bf16 for LoRA on one GPU (8.3B:
    17 GB instead of 33 GB; velocity() computes in bf16 there anyway), else fp32."""
    master = not fsdp or dist.get_rank() == 0
    model = load_transformer(path, meta=not master, attention=attention)
    if is_toy(path):  # the toy's ByT5 branch only ever sees masked zeros: its gradient is exactly 0
        model.context_embedder_2.requires_grad_(False)
    if lora_rank > 0:  # freeze the base, train only the adapters (diffusers' peft integration)
        from peft import LoraConfig
        model.requires_grad_(False)
        if base_dtype is None:
            base_dtype = torch.bfloat16 if not fsdp and torch.device(device).type == 'cuda' else torch.float32
        model.to(base_dtype)
        model.add_adapter(LoraConfig(r=lora_rank, lora_alpha=lora_rank, target_modules=LORA_TARGETS))
        for p in model.parameters():  # peft builds adapters in the base's dtype: they (and so their
            if p.requires_grad:       # AdamW state and the anchor) stay fp32, master weights
                p.data = p.data.float()
    if checkpointing:
        model.enable_gradient_checkpointing()  # recompute each block's activations in backward
    if not fsdp:  # fp32 trained weights; on a GPU velocity() computes in bf16 under autocast
        return model.to(device)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    full = model.state_dict() if master else {}  # references, kept alive across the sharding
    shard(model, cuda=torch.device(device).type == 'cuda')
    model.to_empty(device=device)
    set_model_state_dict(model, full, options=StateDictOptions(
        full_state_dict=True, broadcast_from_rank0=True))
    del full
    return model


def shard(model, cuda, mesh=None):
    """FSDP2 as the trainer applies it (bench/fullsize.py measures this same layout)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    # fp32 master shards, bf16 compute and fp32 gradient reduce-scatter: an update of lr 1e-5
    # would vanish in the rounding of bf16 weights
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if cuda else None, reduce_dtype=torch.float32)
    for block in model.transformer_blocks:  # the FSDP (and checkpointing) unit
        fully_shard(block, mp_policy=mp, mesh=mesh)
    fully_shard(model, mp_policy=mp, mesh=mesh)


# ----------------------------------------------------------------------------- text

def encode_prompts(path, prompts, device='cpu', sink=None, chunk=256):
    """{prompt: (embeds (L, D), mask (L,), embeds_2 (L2, D2), mask_2 (L2,))} on the CPU, trimmed to
    the valid tokens (at least one), with the pipeline's own encoders (a plugged-in world's for the toy).
    With sink, each chunk of prompts is handed to sink(dict) as soon as it is encoded and dropped
    (prompt_cache.py writes it to disk): host memory holds one chunk, not the prompt set."""
    prompts = sorted(set(prompts))
    cache = {}
    sink = sink or cache.update
    if is_toy(path):
        toy_world = plugged_world(path)

        def encode(ps):
            try:
                return toy_world.encode_prompts(ps)
            except ValueError as e:  # a word the toy's text table has no row for: one line, no traceback
                raise SystemExit(str(e))
    else:
        from diffusers import HunyuanVideo15Pipeline
        try:  # no transformer; freed again before training starts (diffusers 0.42 cannot skip the
              # VAE: its __init__ reads vae.config even when vae=None)
            pipe = HunyuanVideo15Pipeline.from_pretrained(path, transformer=None,
                                                          torch_dtype=torch.bfloat16).to(device)
        except (OSError, ValueError) as e:
            raise missing_weights(path, 'text encoders', e) from e

        @torch.no_grad()
        def encode(ps):
            parts = [pipe.encode_prompt(ps[i:i + 8], device=device, batch_size=len(ps[i:i + 8]))
                     for i in range(0, len(ps), 8)]
            return [torch.cat(p) for p in zip(*parts)]
    for c in range(0, len(prompts), chunk):
        ps = prompts[c:c + chunk]
        e1, m1, e2, m2 = [t.detach().cpu() for t in encode(ps)]
        out = {}
        for i, p in enumerate(ps):
            # count_nonzero, not sum: a bf16 sum of ones rounds above 256 (257 -> 256)
            n1, n2 = max(1, int(m1[i].count_nonzero())), max(1, int(m2[i].count_nonzero()))
            # valid tokens come first in both masks (right padding); clone: not a view of the batch
            out[p] = tuple(t.clone() for t in (e1[i, :n1], m1[i, :n1], e2[i, :n2], m2[i, :n2]))
        sink(out)
    if not is_toy(path):
        del pipe, encode
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return cache


def batch_text(cache, prompts, device, dtype=torch.float32):
    """Pad cached embeddings of a list of prompts into the transformer's four text inputs."""
    out = []
    for j in range(4):
        items = [cache[p][j] for p in prompts]
        L = max(t.shape[0] for t in items)
        pad = [torch.cat([t, t.new_zeros((L - t.shape[0],) + t.shape[1:])]) for t in items]
        out.append(torch.stack(pad).to(device, dtype if j % 2 == 0 else torch.float32))
    return out  # (B, L, D), (B, L), (B, L2, D2), (B, L2)


# ----------------------------------------------------------------------------- velocity, sampling

# transformer passes of this process since the last count_passes(), [without grad, with grad]: a pass
# is one clip through the transformer for one CFG branch (a forward; with grad, forward + backward)
PASSES = [0, 0]
PASS_KINDS = ('rollout', 'anchor', 'update', 'diag_anchor', 'diag', 'eval')  # train.py's; with grad: update, diag


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


def velocity(model, x, s, text, cfg=1.0, text_neg=None):
    """Guided velocity v = v_u + cfg * (v_c - v_u), both branches in one batched forward.
    x: (B, C, F, H, W) float32, s: (B,) sigmas, text/text_neg: batch_text() outputs."""
    B = x.shape[0]
    if cfg != 1.0:
        x, s = torch.cat([x, x]), torch.cat([s, s])
        text = _cat_text(text, text_neg)
    PASSES[torch.is_grad_enabled()] += x.shape[0] * sp.first(model)  # clips x CFG branches, once per sp group
    e1, m1, e2, m2 = sp.pad_text(model, x, text, IMAGE_TOKENS)  # sequence parallel: text splits evenly
    hidden = torch.cat([x, torch.zeros_like(x), x.new_zeros(x.shape[0], 1, *x.shape[2:])], 1)
    image = x.new_zeros(x.shape[0], IMAGE_TOKENS, model.config.image_embed_dim)
    with torch.autocast('cuda', torch.bfloat16, enabled=x.is_cuda):  # bf16 compute on GPUs
        v = model(hidden_states=hidden, timestep=1000 * s, encoder_hidden_states=e1,
                  encoder_attention_mask=m1, encoder_hidden_states_2=e2, encoder_attention_mask_2=m2,
                  image_embeds=image, return_dict=False)[0]
    v = v.float()  # the SDE step and its log-prob run in float32
    if cfg == 1.0:
        return v
    v_cond, v_uncond = v[:B], v[B:]
    return v_uncond + cfg * (v_cond - v_uncond)


def _cat_text(a, b):
    out = []
    for ta, tb in zip(a, b):  # pad both to a common length, then stack on the batch
        L = max(ta.shape[1], tb.shape[1])
        pad = lambda t: torch.cat([t, t.new_zeros((t.shape[0], L - t.shape[1]) + t.shape[2:])], 1)
        out.append(torch.cat([pad(ta), pad(tb)]))
    return out


def noise(shape, generators, device):
    """One N(0, I) draw per sample from its own generator: a rollout does not depend on how
    rollouts are batched or spread over ranks."""
    return torch.stack([torch.randn(shape, generator=g) for g in generators]).to(device)


def generators(seeds):
    return [torch.Generator().manual_seed(int(s) % (2 ** 63)) for s in seeds]


@torch.no_grad()
def sample(model, x, sigmas, text, cfg, text_neg, kind, eta, gens, keep=False, window=None, boundary=None):
    """Integrate from x at sigmas[0] down to sigmas[-1] with sde.step of the given kind (at the steps
    in `window` only, if given: ODE steps elsewhere, see sde.window). Returns the final latents and,
    if keep, what training needs for every step: xs (B, N+1, ...), means (B, N, ...), logps (B, N),
    stds (B, N); an ODE step has std 0 and logp 0 (it has no log-probability, and is never trained).
    boundary(): called before each step's forward (train.py's preemption point)."""
    B, N = x.shape[0], len(sigmas) - 1
    xs, means, logps, stds = [x], [], [], []
    for i in range(N):
        if boundary is not None:
            boundary()
        s = sigmas[i].expand(B).to(x.device)
        v = velocity(model, x, s, text, cfg, text_neg)
        z = noise(x.shape[1:], gens, x.device)  # drawn even for ODE steps: keeps streams aligned
        st = sde.step(x, v, sigmas[i].item(), sigmas[i + 1].item(), noise=z,
                      kind=kind if window is None or i in window else 'ode', eta=eta)
        x = st.prev
        if keep:
            xs.append(x)
            means.append(st.mean)
            logps.append(st.logp if st.logp is not None else x.new_zeros(B))
            stds.append(st.std)
    if not keep:
        return x, None
    return x, dict(xs=torch.stack(xs, 1), means=torch.stack(means, 1),
                   logps=torch.stack(logps, 1), stds=torch.stack(stds, 1))


# ----------------------------------------------------------------------------- frames

def load_decoder(path, device):
    """decode(latents (B, C, F, h, w)) -> frames (B, F, 3, H, W) in [0, 1]."""
    if is_toy(path):
        return plugged_world(path).decode
    from diffusers import AutoencoderKLHunyuanVideo15
    try:
        vae = AutoencoderKLHunyuanVideo15.from_pretrained(path, subfolder='vae', torch_dtype=torch.bfloat16)
    except (OSError, ValueError) as e:
        raise missing_weights(path, 'VAE', e) from e
    vae = vae.to(device).requires_grad_(False).eval()
    vae.enable_tiling()  # 81 frames at 480p do not fit in one pass
    vae.enable_slicing()  # one clip at a time: diffusers 0.42's VAE attention mask breaks for B > 1

    @torch.no_grad()
    def decode(latents):
        video = vae.decode(latents.to(vae.dtype) / vae.config.scaling_factor, return_dict=False)[0]
        return ((video.float().clamp(-1, 1) + 1) / 2).permute(0, 2, 1, 3, 4)  # (B,3,F,H,W)->(B,F,3,H,W)
    return decode


def latent_shape(path, num_frames, height, width):
    """(C, F, h, w) of one clip's latents."""
    if is_toy(path):
        return tuple(plugged_world(path).LATENT_SHAPE)
    from diffusers import AutoencoderKLHunyuanVideo15
    try:  # HunyuanVideo 1.5: 32 channels, 4x temporal and 16x spatial compression
        c = AutoencoderKLHunyuanVideo15.load_config(path, subfolder='vae')
    except (OSError, ValueError) as e:
        raise missing_weights(path, 'VAE config', e) from e
    t, sp = c['temporal_compression_ratio'], c['spatial_compression_ratio']
    return (c['latent_channels'], (num_frames - 1) // t + 1, height // sp, width // sp)


def save_mp4(frames, path, fps):
    """frames (F, 3, H, W) in [0, 1] -> an H.264 mp4 (yuv420p wants even sides: pad if needed)."""
    a = (frames.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    a = np.pad(a, ((0, 0), (0, a.shape[1] % 2), (0, a.shape[2] % 2), (0, 0)), mode='edge')
    imageio.mimwrite(path, list(a), fps=fps, macro_block_size=1)
