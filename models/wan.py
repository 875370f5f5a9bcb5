"""
Wan 2.1, Wan 2.2 TI2V-5B and Wan 2.2 T2V-A14B (diffusers' WanPipeline) behind the model interface
(models/__init__.py).

    hf download Wan-AI/Wan2.1-T2V-1.3B-Diffusers --local-dir weights/Wan2.1-T2V-1.3B
    python train.py config/wan_1gpu.py                            # Wan 2.1 1.3B on one GPU
    torchrun --nproc_per_node=8 train.py config/wan22_a14b.py --sp_size=2   # Wan 2.2 A14B: two experts
    torchrun --nproc_per_node=8 train.py config/wan_1gpu.py --model=weights/Wan2.1-T2V-14B --sp_size=2 \
        --prompts_per_iter=8                                      # 14B: FSDP2 and sequence parallel

Also Wan-AI/Wan2.1-T2V-14B-Diffusers (40 blocks of width 5120) and Wan-AI/Wan2.2-TI2V-5B-Diffusers
(its text-to-video path: 48 latent channels, 16x spatial compression, one timestep per video token;
its own clip size is 121 frames at 704x1280, 24 fps; DEFAULTS are Wan 2.1's).

Wan specifics (docs/method.md section 11.2): one text encoder, UMT5-XXL, every prompt padded to 512 tokens
with its embeddings zeroed after the prompt's own tokens; the transformer's cross-attention takes no
mask and so attends to those zeros too, so forward() pads the cached text (trimmed to its valid
tokens) back to 512 zero tokens: the velocity is the pipeline's. The timestep is 1000 s (Wan 2.2
TI2V-5B: the same value for every video token, as WanPipeline's expand_timesteps builds it for
text-to-video). Latents are normalised per channel: decode multiplies by latents_std and adds
latents_mean before the VAE.

Wan 2.2 T2V-A14B (Wan-AI/Wan2.2-T2V-A14B-Diffusers, config/wan22_a14b.py): two experts of Wan 2.1 14B's
shape, `transformer` (high noise) and `transformer_2` (low noise), and the pipeline setting boundary_ratio
(0.875) in model_index.json. load_transformer returns them as one module, Experts (attributes
`transformer`, `transformer_2`; parameter names prefixed by expert), so FSDP2 (blocks(): both experts'),
LoRA, the anchor, the optimizer and the checkpoints treat it as one policy, and the export writes
transformer/ and transformer_2/ (WanTransformer3DModel.from_pretrained(dest, subfolder=...) loads each).
forward() routes each sample by its own sigma, as WanPipeline.__call__ picks the model of a step: the
high-noise expert where the timestep 1000 s >= boundary_ratio * 1000, else the low-noise one; a batch
may mix both (the update trains random steps of each clip). guidance() gives each sample its expert's
guidance scale: the run's `cfg` is WanPipeline's guidance_scale (the high-noise expert's; Wan's recipe
4.0), the low-noise expert's is Experts.guidance_2 (WanPipeline's guidance_scale_2; Wan's recipe 3.0,
GUIDANCE_2), so cfg 4.0 is the recipe. train.py's `experts` picks which train ('both'; 'high' or 'low':
the other frozen, requires_grad False, so neither the optimizer, the anchor nor a checkpoint holds it;
bf16 on a GPU: Experts.freeze).
Under torch.distributed the ranks agree on the experts a forward runs (a max of two flags over the
ranks), in one order, and a rank none of whose samples need one runs it on one token, its output
times 0: ranks whose samples route differently run the same FSDP collectives.

Where it differs from WanPipeline: the sampler. The pipeline's default scheduler is UniPC, a multistep
solver on the flow sigmas; this project's rollouts and sample.py take their own Euler / SDE steps
(docs/method.md section 2) on the flow sigmas of section 1.2, whose ODE step equals diffusers'
FlowMatchEulerDiscreteScheduler(shift=...).step (docs/method.md section 11.2).

attention (models/attention.py's settings): Wan's own WanAttnProcessor has no mask to drop, so every value
of `attention` runs it as shipped: valid_tokens (the video self-attention has no padding; the text
cross-attention's 512 tokens, zeros included, are all valid: masking the zeros would change the
pipeline's velocity), masked_keys (no key is masked) and diffusers (its processor) are one
computation. attention_backend is its kernel (every block's self- and cross-attention). Sequence
parallel runs diffusers' own Ulysses on the self-attention (its _cp_plan for this class; the
cross-attention keeps the whole text), which needs a backend with context parallelism (cp_plan says so).
Tested by: python -m pytest tests/test_wan.py tests/test_wan22.py (two experts)
"""
import inspect
import json
import os

import torch
import torch.nn.functional as F

from infra import sp
from models import hold_frozen, weights_missing
from models.attention import ATTENTIONS, backend as dispatcher_backend, ulysses_refuses

PIPELINE = 'WanPipeline'
TRANSFORMER = 'WanTransformer3DModel'
HUB_ID = 'Wan-AI/Wan2.1-T2V-1.3B-Diffusers'
# WanPipeline's own defaults (it has no default negative prompt); shift: diffusers' 480p value
DEFAULTS = dict(sample_steps=50, shift=3.0, cfg=5.0, fps=16, negative_prompt='', num_frames=81, height=480,
                width=832, sample_prompts=4, sample_seeds=1)
LORA_TARGETS = ['to_q', 'to_k', 'to_v', 'to_out.0']  # self- and cross-attention projections of every block
TEXT_TOKENS = 512  # UMT5 tokens a prompt is padded to: WanPipeline.__call__'s max_sequence_length
                   # (encode_prompt's own default is 226: passed explicitly below)


GUIDANCE_2 = 3.0  # Wan 2.2 T2V-A14B's recipe: guidance 4.0 high noise (the run's cfg), 3.0 low noise
EXPERTS = ('both', 'high', 'low')  # train.py's `experts`: which experts of a two-expert model train


def missing(path, what, err):
    return weights_missing(path, what, err, HUB_ID, 'weights/Wan2.1-T2V-1.3B')


def _load_one(path, subfolder, meta, expand, backend):
    from diffusers import WanTransformer3DModel as T
    if meta:
        with torch.device('meta'):
            net = T.from_config(T.load_config(path, subfolder=subfolder))
    else:
        net = T.from_pretrained(path, subfolder=subfolder, torch_dtype=torch.float32)
    net.expand_timesteps = expand  # a pipeline setting, not the transformer's: kept on the module for forward()
    for block in net.blocks:  # WanAttnProcessor: no mask, in self- and cross-attention alike
        block.attn1.processor._attention_backend = backend
        block.attn2.processor._attention_backend = backend
    return net


class Experts(torch.nn.Module):
    """Wan 2.2 T2V-A14B's two experts as one policy (the module docstring): `transformer` at high
    noise, `transformer_2` at low noise, `boundary` (the pipeline's boundary_ratio), `guidance_2` (the
    low-noise expert's guidance scale). The diffusers calls the project makes of a transformer
    (checkpointing, LoRA, sequence parallel, save_pretrained) apply to both."""

    def __init__(self, transformer, transformer_2, boundary, guidance_2=GUIDANCE_2):
        super().__init__()
        self.transformer, self.transformer_2 = transformer, transformer_2
        self.boundary, self.guidance_2 = float(boundary), float(guidance_2)

    @property
    def experts(self):
        return (self.transformer, self.transformer_2)

    @property
    def config(self):  # both experts have one shape (heads, patch size: sp.check, forward)
        return self.transformer.config

    @property
    def _keep_in_fp32_modules(self):
        return self.transformer._keep_in_fp32_modules

    @property
    def _parallel_config(self):  # infra/sp.py reads it
        return getattr(self.transformer, '_parallel_config', None)

    def high(self, s):
        """(B,) bool: the samples at sigmas s that the high-noise expert runs, WanPipeline's
        `t >= boundary_timestep` with t = 1000 s (float32, as the scheduler's timesteps)."""
        return 1000 * s.float() >= self.boundary * 1000

    def forward(self, x, t, text, high):
        """Each sample's velocity from its expert: high (B,) bool picks transformer, else transformer_2;
        t (B,): the timesteps 1000 s. High, then low, on every rank alike (_to_run)."""
        rows = [high.nonzero().flatten(), (~high).nonzero().flatten()]
        parts = []
        for e, idx, run in zip(self.experts, rows, _to_run(self.experts, rows, t.device)):
            if len(idx) == len(t):
                parts.append((idx, _forward(e, x, t, text)))
            elif len(idx):
                parts.append((idx, _forward(e, x[idx], t[idx], [u[idx] for u in text])))
            elif run:
                parts.append((None, _token(e, x, t, text)))
        v = None
        for idx, out in parts:
            if idx is not None:
                v = out if len(idx) == len(t) else \
                    (out.new_zeros((len(t),) + out.shape[1:]) if v is None else v).index_copy(0, idx, out)
        for idx, out in parts:  # the unused expert's pass on one token, times 0 (its gradient: zeros)
            if idx is None:
                v = v + 0 * out.sum()
        return v

    def freeze(self, experts, dtype=torch.float32):
        """Train only `experts` ('high' | 'low'; 'both': no change): the other's parameters requires_grad
        False and held in `dtype`, except diffusers' _keep_in_fp32_modules (norms, time embedding). The
        loader passes bf16 on a GPU, the dtype the expert computes in there (FSDP's param_dtype, or
        autocast on one GPU, rounds fp32 weights to bf16 the same way), so its forward is unchanged and
        it holds half the memory: 14B frozen, 3.3 GiB a GPU over 8 (results/fullsize.md)."""
        if experts not in EXPERTS:
            raise SystemExit(f'experts must be one of {EXPERTS}, got {experts!r}')
        if experts != 'both':
            frozen = self.transformer_2 if experts == 'high' else self.transformer
            hold_frozen(frozen.requires_grad_(False), dtype)  # its buffers (rope tables) stay as they are
        return self

    def enable_gradient_checkpointing(self):
        for e in self.experts:
            e.enable_gradient_checkpointing()

    def add_adapter(self, config):
        import copy
        for e in self.experts:
            e.add_adapter(copy.deepcopy(config))

    def save_lora_adapter(self, path):
        for name, e in zip(SUBFOLDERS, self.experts):
            e.save_lora_adapter(os.path.join(path, name))

    def fuse_lora(self):
        for e in self.experts:
            e.fuse_lora()

    def unload_lora(self):
        for e in self.experts:
            e.unload_lora()

    def enable_parallelism(self, **kw):
        for e in self.experts:
            e.enable_parallelism(**kw)

    def save_pretrained(self, path, **kw):
        """path/transformer and path/transformer_2: the pipeline's own layout of the two experts."""
        for name, e in zip(SUBFOLDERS, self.experts):
            e.save_pretrained(os.path.join(path, name), **kw)


SUBFOLDERS = ('transformer', 'transformer_2')


def load_transformer(path, meta=False, attention=ATTENTIONS[0], backend='native'):
    """The transformer in float32 (the trainer's master weights) on the CPU, or on the meta device
    (shapes only), with diffusers' own attention processor on dispatcher backend `backend` (every
    `attention` value is that one computation: see the module docstring). A two-expert directory
    (model_index.json names a transformer_2 and a boundary_ratio: Wan 2.2 T2V-A14B): both, as Experts."""
    if attention not in ATTENTIONS:
        raise SystemExit(f'attention must be one of {ATTENTIONS}, got {attention!r}')
    backend = dispatcher_backend(backend)  # diffusers' AttentionBackendName, its packages checked
    try:
        with open(os.path.join(path, 'model_index.json')) as f:
            index = json.load(f)
        expand = bool(index.get('expand_timesteps', False))
        two = (index.get('transformer_2') or [None])[0] is not None and index.get('boundary_ratio') is not None
        nets = [_load_one(path, sub, meta, expand, backend) for sub in SUBFOLDERS[:1 + two]]
    except (OSError, ValueError) as e:
        raise missing(path, 'transformer', e) from e
    return Experts(*nets, index['boundary_ratio']) if two else nets[0]


def blocks(net):
    if isinstance(net, Experts):
        return [*net.transformer.blocks, *net.transformer_2.blocks]
    return net.blocks


def guidance(net, s, cfg):
    """The guidance scale of each sample at sigmas s (B,): cfg (WanPipeline's guidance_scale), and with
    two experts net.guidance_2 (its guidance_scale_2) where the low-noise expert runs."""
    if not isinstance(net, Experts):
        return cfg
    return torch.where(net.high(s), float(cfg), net.guidance_2).to(s.device)  # (B,) float32


def text_encoder(path, device):
    """encode(prompts) -> [embeds (B, 512, D), mask (B, 512)]: WanPipeline's own encode_prompt (UMT5,
    embeddings zero after each prompt's tokens) and its tokenizer's attention mask, valid tokens first."""
    from diffusers import WanPipeline
    from diffusers.pipelines.wan.pipeline_wan import prompt_clean
    try:  # the text encoder and tokenizer alone (WanPipeline reads the VAE's config only if it has one)
        pipe = WanPipeline.from_pretrained(path, transformer=None, transformer_2=None, vae=None,
                                           torch_dtype=torch.bfloat16).to(device)
    except (OSError, ValueError) as e:
        raise missing(path, 'text encoder', e) from e

    @torch.no_grad()
    def encode(prompts):
        out = []
        for i in range(0, len(prompts), 8):
            ps = prompts[i:i + 8]
            embeds = pipe.encode_prompt(ps, do_classifier_free_guidance=False, max_sequence_length=TEXT_TOKENS,
                                        device=device)[0]  # (b, 512, D)
            mask = pipe.tokenizer([prompt_clean(p) for p in ps], padding='max_length', max_length=TEXT_TOKENS,
                                  truncation=True, add_special_tokens=True, return_tensors='pt').attention_mask
            out.append((embeds, mask.to(embeds.device)))  # the tokenizer call encode_prompt makes
        return [torch.cat(t) for t in zip(*out)]
    return encode


def forward(net, x, s, text):
    """The velocity of latents x (B, C, F, h, w) at sigmas s (B,) for text: batch_text's [embeds, mask].
    The mask is not used: Wan attends to every one of the 512 text tokens. Two experts: each sample
    from the expert of its own sigma (Experts.high), through the module's own call (FSDP2's root)."""
    if isinstance(net, Experts):  # the routing before the call: FSDP may cast s to bf16, not a bool
        return net(x, 1000 * s, text, net.high(s))
    return _forward(net, x, 1000 * s, text)


def _to_run(experts, rows, device):
    """Whether each expert runs: where a sample needs it, and where it trains and grad is on (the
    update's loss keeps a graph, its gradient 0, even if no sample of this batch needs it). Under
    torch.distributed an expert runs on every rank if on any (a max over the world's ranks): an
    FSDP all-gather is a collective, so ranks whose samples route differently gather the same experts
    (one on one token where none of the rank's own samples need it); and none gathers an expert that
    no rank needs (a rollout step: every clip is at the same sigma)."""
    import torch.distributed as dist
    grad = torch.is_grad_enabled()
    run = [len(idx) > 0 or (grad and any(p.requires_grad for p in e.parameters())) for e, idx in zip(experts, rows)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        flags = torch.tensor(run, dtype=torch.int32, device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        run = [bool(f) for f in flags.tolist()]
    return run


def _token(e, x, t, text):
    """One clip of sp-size video tokens (zeros, at timestep t[0]) through expert e: the cheapest pass."""
    pt, ph, pw = e.config.patch_size
    z = x.new_zeros(1, x.shape[1], pt, ph, pw * sp.group_size(e))
    return _forward(e, z, t[:1], [u[:1] for u in text])


def _forward(net, x, t, text):
    """One transformer's velocity at timesteps t = 1000 s (B,)."""
    embeds = text[0]  # (B, L, D) valid tokens first, zeros after
    embeds = F.pad(embeds, (0, 0, 0, TEXT_TOKENS - embeds.shape[1]))  # (B, 512, D): zeros, as the pipeline's
    pt, ph, pw = net.config.patch_size
    video = x.shape[2] // pt * (x.shape[3] // ph) * (x.shape[4] // pw)  # tokens of a clip
    n = sp.group_size(net)
    if video % n:
        raise SystemExit(f'sequence parallel: {video} video tokens (latents {tuple(x.shape[1:])}) do not '
                         f'split over sp_size {n}; choose a frame count or size whose latent grid divides')
    if getattr(net, 'expand_timesteps', False):  # Wan 2.2 TI2V-5B: one per video token, all equal for t2v
        t = t[:, None].expand(-1, video)  # (B, V)
    return net(hidden_states=x, timestep=t, encoder_hidden_states=embeds, return_dict=False)[0]


def vae_config(path):
    """The VAE's config with the class defaults filled in: Wan 2.1's released config predates
    scale_factor_temporal / scale_factor_spatial (its values are the defaults, 4 and 8)."""
    from diffusers import AutoencoderKLWan
    try:
        c = AutoencoderKLWan.load_config(path, subfolder='vae')
    except (OSError, ValueError) as e:
        raise missing(path, 'VAE config', e) from e
    defaults = {k: p.default for k, p in inspect.signature(AutoencoderKLWan.__init__).parameters.items()
                if p.default is not inspect.Parameter.empty}
    return {**defaults, **c}


def load_decoder(path, device):
    """decode(latents (B, C, F, h, w)) -> frames (B, F, 3, H, W) in [0, 1]."""
    from diffusers import AutoencoderKLWan
    try:  # float32, as diffusers recommends for Wan's VAE (127M parameters at 2.1: 0.5 GB)
        vae = AutoencoderKLWan.from_pretrained(path, subfolder='vae', torch_dtype=torch.float32)
    except (OSError, ValueError) as e:
        raise missing(path, 'VAE', e) from e
    vae.encoder = vae.quant_conv = None  # decode only (diffusers counts the encoder's convs at build time)
    vae = vae.to(device).requires_grad_(False).eval()
    vae.enable_slicing()  # one clip at a time: the batch's activations never coexist
    mean = torch.tensor(vae.config.latents_mean, device=device).view(1, -1, 1, 1, 1)  # (1, C, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std, device=device).view(1, -1, 1, 1, 1)

    @torch.no_grad()
    def decode(latents):
        video = vae.decode(latents.float() * std + mean, return_dict=False)[0]  # (B, 3, F, H, W) in [-1, 1]
        return ((video.float().clamp(-1, 1) + 1) / 2).permute(0, 2, 1, 3, 4)  # -> (B, F, 3, H, W)
    return decode


def latent_shape(path, num_frames, height, width):
    """(C, F, h, w): z_dim channels (16 at 2.1, 48 at 2.2 TI2V-5B), 4x temporal and 8x (2.1) or 16x
    (2.2) spatial compression; height and width must also divide into the transformer's 2x2 patches."""
    from diffusers import WanTransformer3DModel
    c = vae_config(path)
    t, s = c['scale_factor_temporal'], c['scale_factor_spatial']
    try:
        _, ph, pw = WanTransformer3DModel.load_config(path, subfolder='transformer')['patch_size']
    except (OSError, ValueError) as e:
        raise missing(path, 'transformer config', e) from e
    if height % (s * ph) or width % (s * pw):
        raise SystemExit(f'height and width must be multiples of {s * ph} x {s * pw} for {path!r} '
                         f'(VAE {s}x, transformer patch {ph}x{pw}), got {height}x{width}')
    return (c['z_dim'], (num_frames - 1) // t + 1, height // s, width // s)


def cp_plan(net):
    """diffusers' own WanTransformer3DModel._cp_plan: the rope tables and block 0's video tokens split
    on the token axis, the output projection gathered; the text is not split (each rank's video
    queries attend to all of it). Its per-token timestep entry only where timesteps are per token
    (Wan 2.1's are per clip: diffusers would warn that it cannot split them). The backend must
    have diffusers' Ulysses: any other would attend within each rank's own tokens, silently."""
    net = net.transformer if isinstance(net, Experts) else net  # both: one class, one plan
    backend = net.blocks[0].attn1.processor._attention_backend
    if ulysses_refuses(backend):
        from diffusers.models.attention_dispatch import _AttentionBackendRegistry
        able = ', '.join(sorted(_AttentionBackendRegistry._supports_context_parallel))
        raise SystemExit(f"sequence parallel runs diffusers' Ulysses for Wan, which attention_backend "
                         f"{backend.value!r} lacks: use one of {able}")
    return {k: v for k, v in net._cp_plan.items() if k or getattr(net, 'expand_timesteps', False)}
