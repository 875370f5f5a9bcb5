"""
HunyuanVideo 1.5 (diffusers' HunyuanVideo15Pipeline) behind the model interface (models/__init__.py).

    torchrun --nproc_per_node=8 train.py --model=weights/HunyuanVideo-1.5-480p_t2v

HunyuanVideo 1.5 specifics (docs/method.md section 11.1): two text encoders, Qwen2.5-VL (embeds, mask)
and ByT5 for quoted text (embeds_2, mask_2); the transformer input is [latents, zeros, zero mask]
channel-wise with an all-zero image token for text-to-video; the timestep is 1000 s; the VAE's
latents are scaled by its scaling_factor.

Where the blocks' attention differs from diffusers' (docs/method.md section 12.3): diffusers 0.42's
HunyuanVideo15AttnProcessor2_0 builds a dense (B, 1, S, S) mask, key mask AND query mask, over all
S = video + text tokens (~34,600 at 480p, 81 frames), and with any mask torch's SDPA never takes its
flash kernel. In a t2v forward the masked tokens are the all-zero image token, the zero ByT5 token of
a prompt without quoted text, and the padding of prompts shorter than the batch's longest (CFG's two
branches always differ). ValidTokensAttention (attention='valid_tokens', the default) leaves them
out of the attention altogether, with no mask (attention.attend: one call per run of equal valid
lengths); MaskedKeysAttention ('masked_keys') masks them as keys only. A padded token's query row
computes something no one reads (it is a masked key in every later block and dropped at the end), so
every valid token's output equals diffusers' to float rounding either way.
Tested by: python -m pytest tests/test_model.py tests/test_attention.py tests/test_sp.py
"""
import torch
import torch.nn.functional as F

from infra import sp
from models import weights_missing
from models.attention import (ATTENTIONS, attend, backend as dispatcher_backend, check, gather_tokens, key_mask,
                       scatter_tokens, ulysses_group, ulysses_refuses, valid_lengths)

PIPELINE = 'HunyuanVideo15Pipeline'
TRANSFORMER = 'HunyuanVideo15Transformer3DModel'
HUB_ID = 'hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v'
DEFAULTS = dict(sample_steps=50, shift=5.0, cfg=6.0, fps=24, negative_prompt='', num_frames=81, height=480, width=848,
                sample_prompts=4, sample_seeds=1)  # sample.py: prompts spread over its file, seeds each
LORA_TARGETS = ['to_q', 'to_k', 'to_v', 'to_out.0']  # attention projections of every block
IMAGE_TOKENS = 1  # t2v image tokens are all-zero and masked out, so their count (729 in the
                  # pipeline) does not change the output (tests/test_model.py checks it); 1 is cheapest


def missing(path, what, err):
    return weights_missing(path, what, err, HUB_ID, 'weights/HunyuanVideo-1.5-480p_t2v',
                           ' (for the toy world: --model=assets/toy).')


def load_transformer(path, meta=False, attention=ATTENTIONS[0], backend='native'):
    """The transformer in float32 (the trainer's master weights) on the CPU, or on the meta device
    (shapes only); its blocks' attention set by set_attention."""
    from diffusers import HunyuanVideo15Transformer3DModel as T
    try:
        if meta:
            with torch.device('meta'):
                net = T.from_config(T.load_config(path, subfolder='transformer'))
        else:
            net = T.from_pretrained(path, subfolder='transformer', torch_dtype=torch.float32)
    except (OSError, ValueError) as e:
        raise missing(path, 'transformer', e) from e
    return set_attention(net, attention, backend)


def blocks(net):
    return net.transformer_blocks


def text_encoder(path, device):
    """encode(prompts) -> [embeds (B, L, D), mask (B, L), embeds_2 (B, L2, D2), mask_2 (B, L2)]: the
    pipeline's own encode_prompt (Qwen2.5-VL, then ByT5 for quoted text), valid tokens first."""
    from diffusers import HunyuanVideo15Pipeline
    try:  # no transformer (diffusers 0.42 cannot skip the VAE: its __init__ reads vae.config)
        pipe = HunyuanVideo15Pipeline.from_pretrained(path, transformer=None, torch_dtype=torch.bfloat16).to(device)
    except (OSError, ValueError) as e:
        raise missing(path, 'text encoders', e) from e

    @torch.no_grad()
    def encode(prompts):
        parts = [pipe.encode_prompt(prompts[i:i + 8], device=device, batch_size=len(prompts[i:i + 8]))
                 for i in range(0, len(prompts), 8)]
        return [torch.cat(p) for p in zip(*parts)]
    return encode


def forward(net, x, s, text):
    """The velocity of latents x (B, C, F, h, w) at sigmas s (B,) for text: batch_text's four tensors."""
    e1, m1, e2, m2 = pad_for_sp(net, x, text)
    hidden = torch.cat([x, torch.zeros_like(x), x.new_zeros(x.shape[0], 1, *x.shape[2:])], 1)  # t2v
    image = x.new_zeros(x.shape[0], IMAGE_TOKENS, net.config.image_embed_dim)  # all zero: t2v
    return net(hidden_states=hidden, timestep=1000 * s, encoder_hidden_states=e1, encoder_attention_mask=m1,
               encoder_hidden_states_2=e2, encoder_attention_mask_2=m2, image_embeds=image, return_dict=False)[0]


def pad_for_sp(net, x, text):
    """text with the Qwen text padded by masked tokens, so that the model's text tokens (Qwen + ByT5
    + image) split evenly over the sequence-parallel group; checks that the video tokens do."""
    n = sp.group_size(net)
    if n == 1:
        return text
    video = x.shape[2:].numel() // (net.config.patch_size_t * net.config.patch_size ** 2)
    if video % n:
        raise SystemExit(f'sequence parallel: {video} video tokens (latents {tuple(x.shape[1:])}) do not '
                         f'split over sp_size {n}; choose a frame count or size whose latent grid divides')
    e1, m1, e2, m2 = text
    extra = -(e1.shape[1] + e2.shape[1] + IMAGE_TOKENS) % n
    return [F.pad(e1, (0, 0, 0, extra)), F.pad(m1, (0, extra)), e2, m2]  # padding: masked (0)


def load_decoder(path, device):
    """decode(latents (B, C, F, h, w)) -> frames (B, F, 3, H, W) in [0, 1]."""
    from diffusers import AutoencoderKLHunyuanVideo15
    try:
        vae = AutoencoderKLHunyuanVideo15.from_pretrained(path, subfolder='vae', torch_dtype=torch.bfloat16)
    except (OSError, ValueError) as e:
        raise missing(path, 'VAE', e) from e
    vae.encoder = None  # decode only: the encoder's weights never reach the GPU
    vae = vae.to(device).requires_grad_(False).eval()
    vae.enable_tiling()  # 81 frames at 480p do not fit in one pass
    vae.enable_slicing()  # one clip at a time: diffusers 0.42's VAE attention mask breaks for B > 1

    @torch.no_grad()
    def decode(latents):
        video = vae.decode(latents.to(vae.dtype) / vae.config.scaling_factor, return_dict=False)[0]
        return ((video.float().clamp(-1, 1) + 1) / 2).permute(0, 2, 1, 3, 4)  # (B,3,F,H,W)->(B,F,3,H,W)
    return decode


def latent_shape(path, num_frames, height, width):
    """(C, F, h, w): 32 channels, 4x temporal and 16x spatial compression."""
    from diffusers import AutoencoderKLHunyuanVideo15
    try:
        c = AutoencoderKLHunyuanVideo15.load_config(path, subfolder='vae')
    except (OSError, ValueError) as e:
        raise missing(path, 'VAE config', e) from e
    t, s = c['temporal_compression_ratio'], c['spatial_compression_ratio']
    return (c['latent_channels'], (num_frames - 1) // t + 1, height // s, width // s)


# ----------------------------------------------------------------------------- sequence parallel

def cp_plan(net):
    """Where diffusers' hooks split and gather (module name -> inputs or outputs): the rope tables and
    the first block's two streams are split on the token axis; the last layer's output is gathered
    (diffusers 0.42 ships no _cp_plan for this class). ValidTokensAttention reads the whole text mask
    (the valid lengths) and does Ulysses itself; MaskedKeysAttention gets every block's text mask split
    too, for diffusers' Ulysses, which all-gathers it with the keys. diffusers' own processor cannot
    compose (infra/sp.py): it is replaced by MaskedKeysAttention, its backend kept."""
    from diffusers.models._modeling_parallel import ContextParallelInput as In, ContextParallelOutput as Out
    proc = net.transformer_blocks[0].attn.processor
    if not isinstance(proc, (ValidTokensAttention, MaskedKeysAttention)):
        backend = proc._attention_backend  # diffusers' AttentionBackendName
        set_attention(net, 'masked_keys', backend.value if backend else 'native')
    plan = {
        'rope': {0: In(split_dim=0, expected_dims=2, split_output=True),    # cos (V, d)
                 1: In(split_dim=0, expected_dims=2, split_output=True)},   # sin (V, d)
        'transformer_blocks.0': {  # after the text streams are merged and reordered (valid tokens first)
            'hidden_states': In(split_dim=1, expected_dims=3),              # video (B, V, D)
            'encoder_hidden_states': In(split_dim=1, expected_dims=3),      # text (B, T, D)
        },
        'proj_out': Out(gather_dim=1, expected_dims=3),                     # (B, V/sp, p) -> (B, V, p)
    }
    proc = net.transformer_blocks[0].attn.processor
    if isinstance(proc, MaskedKeysAttention):  # diffusers' Ulysses, which all-gathers the split mask
        why = ulysses_refuses(proc._attention_backend)
        if why:
            raise SystemExit(why)
        plan['transformer_blocks.*'] = {'attention_mask': In(split_dim=1, expected_dims=2)}  # text mask (B, T)
    return plan


# ----------------------------------------------------------------------------- attention

def joint_qkv(attn, hidden_states, encoder_hidden_states, image_rotary_emb):
    """q, k, v (B, V + T, heads, d) of a block's joint attention, as diffusers 0.42's
    HunyuanVideo15AttnProcessor2_0 forms them: video tokens (B, V, D) with their qk-norm, then rope;
    text + image tokens (B, T, D) with their own qk-norm (norm_added_q, norm_added_k), no rope."""
    from diffusers.models.embeddings import apply_rotary_emb
    heads = lambda t: t.unflatten(2, (attn.heads, -1))  # (B, L, D) -> (B, L, heads, d)
    q, k, v = (heads(f(hidden_states)) for f in (attn.to_q, attn.to_k, attn.to_v))  # video (B, V, heads, d)
    q, k = attn.norm_q(q), attn.norm_k(k)  # the qk-norm before rope
    if image_rotary_emb is not None:  # rope on the video tokens only
        q = apply_rotary_emb(q, image_rotary_emb, sequence_dim=1)
        k = apply_rotary_emb(k, image_rotary_emb, sequence_dim=1)
    if encoder_hidden_states is not None:  # text + image tokens (B, T, D), valid ones first
        eq, ek, ev = (heads(f(encoder_hidden_states)) for f in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj))
        if attn.norm_added_q is not None:
            eq = attn.norm_added_q(eq)
        if attn.norm_added_k is not None:
            ek = attn.norm_added_k(ek)
        q, k, v = torch.cat([q, eq], 1), torch.cat([k, ek], 1), torch.cat([v, ev], 1)  # (B, S, heads, d)
    return q, k, v


def joint_out(attn, out, encoder_hidden_states, dtype):
    """The block's two outputs from the attention's (B, S, heads, d): video (B, V, D), text (B, T, D)."""
    out = out.flatten(2, 3).to(dtype)  # (B, S, D)
    if encoder_hidden_states is None:  # as diffusers: no output projection without text
        return out, None
    T = encoder_hidden_states.shape[1]
    return attn.to_out[1](attn.to_out[0](out[:, :-T])), attn.to_add_out(out[:, -T:])


class ValidTokensAttention:
    """diffusers 0.42's HunyuanVideo15AttnProcessor2_0 over each sample's valid tokens alone, with no
    mask: the video tokens and the first n_b text tokens of sample b (diffusers' forward orders each
    sample's text valid first: image, ByT5, Qwen, then the padding), n_b from the (B, T) text mask once
    per forward (attention.valid_lengths). Under sequence parallel (infra/sp.py) it does Ulysses itself: the
    all-to-all gathers every rank's video, then every rank's text, so the valid tokens are a prefix
    again and the padding that splits the text evenly is dropped like any padding."""
    backend = None  # the dispatcher backend (attention.BACKENDS). Not `_attention_backend`: diffusers'
                    # enable_parallelism would refuse a backend without its own Ulysses, unused here
    _parallel_config = None  # set by diffusers' enable_parallelism (sp.enable): the Ulysses group

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 image_rotary_emb=None):
        q, k, v = joint_qkv(attn, hidden_states, encoder_hidden_states, image_rotary_emb)  # (B, S_r, heads, d)
        B, S, V = q.shape[0], q.shape[1], hidden_states.shape[1]  # this rank's tokens, its video tokens
        group = ulysses_group(self._parallel_config)
        if group is not None:  # one all-to-all for q, k, v: (3B, S_r, heads, d) -> (3B, S, heads/sp, d)
            n = torch.distributed.get_world_size(group)
            q, k, v = gather_tokens(torch.cat([q, k, v]), V, group).chunk(3)
            S, V = S * n, V * n
        # valid tokens of each sample: every video token and its first n_b text tokens
        text = valid_lengths(attention_mask) if attention_mask is not None else [S - V] * B
        out = attend(q, k, v, [V + t for t in text], self.backend)  # (B, S, heads, d), 0 past a length
        if group is not None:
            out = scatter_tokens(out, V // n, group)  # (B, S_r, heads, d)
        return joint_out(attn, out, encoder_hidden_states, q.dtype)


class MaskedKeysAttention:
    """diffusers 0.42's HunyuanVideo15AttnProcessor2_0 with the padding excluded as keys only: a key
    mask in the form the backend reads right (attention.key_mask; (B, 1, 1, S) but for xformers), a
    broadcast bias of O(S) memory, where diffusers' (B, 1, S, S) mask becomes an (S, S) bf16 bias per
    sequence (~29 GB for 8 sequences at 480p). Composes with diffusers' context parallelism (infra/sp.py):
    its Ulysses all-gathers the key mask in the same rank order as the keys."""
    _attention_backend = None  # diffusers' dispatcher settings (attention_backend, context parallel)
    _parallel_config = None

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 image_rotary_emb=None):
        from diffusers.models.attention_dispatch import dispatch_attention_fn
        q, k, v = joint_qkv(attn, hidden_states, encoder_hidden_states, image_rotary_emb)  # (B, S, heads, d)
        mask = None
        if attention_mask is not None:  # (B, T) of the text tokens -> (B, S) of all keys: video always valid
            mask = F.pad(attention_mask.bool(), (q.shape[1] - attention_mask.shape[1], 0), value=True)
            mask = key_mask(mask, self._attention_backend)
        out = dispatch_attention_fn(q, k, v, attn_mask=mask, backend=self._attention_backend,
                                    parallel_config=self._parallel_config)  # (B, S, heads, d)
        return joint_out(attn, out, encoder_hidden_states, q.dtype)


def set_attention(net, kind, backend='native'):
    """The attention of every transformer block (models/attention.py): 'valid_tokens' (the default),
    'masked_keys', or 'diffusers' (its own HunyuanVideo15AttnProcessor2_0, with the (B, 1, S, S) mask),
    computed by the dispatcher backend `backend`. The token refiner's attention (over the <= 1000
    Qwen tokens alone) stays diffusers'."""
    from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15AttnProcessor2_0
    if kind not in ATTENTIONS:
        raise SystemExit(f'attention must be one of {ATTENTIONS}, got {kind!r}')
    why = check(kind, backend)
    if why:
        raise SystemExit(why)
    backend = dispatcher_backend(backend)  # diffusers' AttentionBackendName
    for block in net.transformer_blocks:
        if kind == 'valid_tokens':
            proc = ValidTokensAttention()
            proc.backend = backend
        else:
            proc = MaskedKeysAttention() if kind == 'masked_keys' else HunyuanVideo15AttnProcessor2_0()
            proc._attention_backend = backend
        block.attn.set_processor(proc)
    return net
