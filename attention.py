"""
The attention of the transformer blocks. diffusers 0.42's HunyuanVideo15AttnProcessor2_0 builds a dense
(B, 1, S, S) mask (key mask AND query mask) over all S = video + text + image tokens; here padding is
masked as keys only, a (B, S) mask through diffusers' attention dispatcher, so nothing S x S exists and
diffusers' context parallelism (sp.py) composes with it. model.py sets it on every model it loads.

    python train.py config/toy.py --attention=diffusers     # diffusers' own processor instead

Where this differs from diffusers: a padded token's query row computes something no one reads (it is a
masked key in every later block and dropped at the end); every valid token's output is diffusers' to
float rounding. Tested by: python -m pytest tests/test_attention.py (bench/fullsize.py: the memory).
"""
import torch

ATTENTIONS = ('masked_keys', 'diffusers')  # the blocks' attention (set_attention); the first is the default


class MaskedKeysAttention:
    """diffusers 0.42's HunyuanVideo15AttnProcessor2_0 (joint attention of the video tokens and the
    text + image tokens of a block) with the padding excluded as keys only. diffusers builds a dense
    (B, 1, S, S) boolean mask, key mask AND query mask, over all S = video + text tokens (~34,600
    at 480p, 81 frames), which SDPA turns into an (S, S) bf16 bias per sequence (~29 GB of mask and
    bias for 8 sequences). A padded token's query row computes something no one
    reads: the token is masked as a key in every later block and dropped at the end. So a key mask
    (B, S) is enough: diffusers' NATIVE backend hands it to SDPA as (B, 1, 1, S), which the cuDNN and
    memory-efficient kernels take as a broadcast bias of O(S) memory (flash takes no mask at all,
    and t2v always has its masked image token). Every valid token's output, hence the velocity,
    equals diffusers' to float rounding (tests/test_attention.py); bench/fullsize.py measures the memory."""
    _attention_backend = None  # diffusers' dispatcher settings (attention_backend, context parallel)
    _parallel_config = None

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 image_rotary_emb=None):
        from diffusers.models.attention_dispatch import dispatch_attention_fn
        from diffusers.models.embeddings import apply_rotary_emb
        heads = lambda t: t.unflatten(2, (attn.heads, -1))                  # (B, L, D) -> (B, L, heads, d)
        q, k, v = (heads(f(hidden_states)) for f in (attn.to_q, attn.to_k, attn.to_v))  # video (B, V, heads, d)
        q, k = attn.norm_q(q), attn.norm_k(k)
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
        mask = None
        if attention_mask is not None:  # (B, T) of the text tokens -> (B, S) of all keys: video always valid
            mask = torch.nn.functional.pad(attention_mask.bool(), (q.shape[1] - attention_mask.shape[1], 0), value=True)
        out = dispatch_attention_fn(q, k, v, attn_mask=mask, backend=self._attention_backend,
                                    parallel_config=self._parallel_config)  # (B, S, heads, d)
        out = out.flatten(2, 3).to(q.dtype)                                  # (B, S, D)
        if encoder_hidden_states is None:  # as diffusers: no output projection without text
            return out, None
        T = encoder_hidden_states.shape[1]
        return attn.to_out[1](attn.to_out[0](out[:, :-T])), attn.to_add_out(out[:, -T:])


def set_attention(model, kind):
    """The attention of every transformer block: 'masked_keys' (MaskedKeysAttention, the default)
    or 'diffusers' (its own HunyuanVideo15AttnProcessor2_0, with the (B, 1, S, S) mask). The token
    refiner's attention (over the <= 1000 Qwen tokens alone) stays diffusers'."""
    from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15AttnProcessor2_0
    if kind not in ATTENTIONS:
        raise SystemExit(f'attention must be one of {ATTENTIONS}, got {kind!r}')
    for block in model.transformer_blocks:
        block.attn.set_processor(MaskedKeysAttention() if kind == 'masked_keys' else HunyuanVideo15AttnProcessor2_0())
    return model
