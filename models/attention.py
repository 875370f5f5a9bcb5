"""
The blocks' attention, whatever the model family: which tokens take part, which kernel computes it,
and the Ulysses all-to-all of sequence parallel. A family file (models/hunyuan15.py) builds its blocks'
processors from these pieces; train.py and sample.py choose with two settings:

    python train.py config/toy.py --attention=masked_keys --attention_backend=_native_math

`attention` (ATTENTIONS, the first is the default):
    valid_tokens  each sample attends over its valid tokens alone, with no mask: padding (the text of
                  a shorter prompt, t2v's all-zero image token) never enters the attention
    masked_keys   padding excluded as keys only: a (B, 1, 1, S) key mask, a broadcast bias of O(S)
    diffusers     the family's diffusers processor as shipped (HunyuanVideo 1.5: a dense (B, 1, S, S) mask)
`attention_backend`: any backend of diffusers' dispatcher (BACKENDS, diffusers 0.42's
AttentionBackendName): 'native' (torch's SDPA, which picks its kernel), '_native_flash',
'_native_cudnn', '_native_efficient', '_native_math', 'flex', 'flash', '_flash_3', 'sage', ...
Where a mask remains it is handed over in the form the backend reads right (key_mask); a backend
that takes no mask (NO_MASK) runs valid_tokens only (configurator says so before anything loads).

Why a mask matters: with any attn_mask torch's SDPA never picks its flash kernel, and every t2v batch
has masked tokens (docs/method.md section 12.3). valid_tokens runs without one; for a batch whose
samples have different valid lengths (CFG's two branches always do) it calls the backend once per
run of equal lengths (attend). The options, at the real sizes (bench/attention.py ->
results/attention_flops.md):
- split by length (this): exactly the valid tokens' FLOPs; one call per run of equal lengths, at most
  one per sample (train.py's batches hold one prompt's clips next to each other, then as many
  negative prompts: 4 clips of one prompt with CFG are 2 calls a block). Each call is at least one
  sequence of 18-35k tokens x 16 heads (2,256+ tiles of 128 queries: the GPU is full), milliseconds
  of kernel against microseconds of launch. The slices are views: no copy of q, k, v.
- pack (variable-length kernel): the same FLOPs in one call, but only backends with a varlen kernel
  (flash-attn's; torch's varlen_attn has no CPU kernel to test against diffusers), and a gather into
  the packed layout.
- a FlexAttention block mask: one call, but whole 128 x 128 tiles across each length boundary are
  computed, and diffusers calls flex eagerly (an unfused S x S implementation without torch.compile).
The valid lengths are read from the block's text mask once per forward (valid_lengths: one
device-to-host copy; every block and the checkpointed recomputation get the same mask tensor).

Sequence parallel (infra/sp.py): valid_tokens does Ulysses itself (gather_tokens, scatter_tokens:
torch.distributed.nn.functional's differentiable all_to_all), so the padding that makes the text split
evenly over the ranks is dropped like any padding, and the backward is the backend's own (no
recompute; diffusers' NATIVE Ulysses recomputes the attention forward in its backward).
masked_keys and diffusers go through diffusers' own Ulysses, which needs a backend with context
parallelism (ulysses_refuses, checked by the family's cp_plan).

Run here (CPU) and equal to 'native': native, _native_math, _native_flash (no mask), flex (forward
only: no CPU backward). Untested
(they need a GPU or packages absent here): _native_cudnn, _native_efficient, flash and every other
flash-attn, sage, xformers, npu and xla backend; bench/attention.py --gpu times and checks those a GPU has.

Wan (models/wan.py): its processor has no mask (no padding among the video tokens; the cross-attention
attends to all 512 text tokens, zeros included, as WanPipeline does), so all three values run it as
shipped, on attention_backend's kernel, and sequence parallel takes diffusers' own Ulysses.
Tested by: python -m pytest tests/test_attention.py tests/test_sp.py
"""
import torch

from infra.configurator import one_of

ATTENTIONS = ('valid_tokens', 'masked_keys', 'diffusers')  # the `attention` setting; the first is the default
# diffusers 0.42's AttentionBackendName values (tests/test_attention.py checks them against diffusers)
BACKENDS = ('native', '_native_flash', '_native_cudnn', '_native_efficient', '_native_math', 'flex', 'flash',
            'flash_hub', 'flash_varlen', 'flash_varlen_hub', 'flash_4_hub', '_flash_3', '_flash_varlen_3',
            '_flash_3_hub', '_flash_3_varlen_hub', 'aiter_fa2_hub', '_native_npu', '_native_xla', 'sage',
            'sage_hub', 'sage_blackwell_hub', 'sage_varlen', '_sage_qk_int8_pv_fp8_cuda',
            '_sage_qk_int8_pv_fp8_cuda_sm90', '_sage_qk_int8_pv_fp16_cuda', '_sage_qk_int8_pv_fp16_triton',
            'xformers')
# backends that raise on any attn_mask (diffusers 0.42, docs/method.md section 12.3): valid_tokens only
NO_MASK = ('_native_flash', 'flash', 'flash_hub', 'flash_4_hub', '_flash_3', '_flash_3_hub', 'aiter_fa2_hub',
           '_native_xla', 'sage', 'sage_hub', 'sage_blackwell_hub', '_sage_qk_int8_pv_fp8_cuda',
           '_sage_qk_int8_pv_fp8_cuda_sm90', '_sage_qk_int8_pv_fp16_cuda', '_sage_qk_int8_pv_fp16_triton')


def check(kind, backend):
    """None, or one line on why attention `kind` cannot run on `backend` (configurator's rule)."""
    if kind != 'valid_tokens' and backend in NO_MASK:
        return (f"attention_backend {backend!r} takes no mask, which attention={kind!r} needs: use it with "
                "attention='valid_tokens' (the default)")
    if kind == 'diffusers' and backend == 'xformers':  # reads diffusers' 4-D boolean mask as a 0/1 bias
        return "attention_backend 'xformers' misreads diffusers' (B, 1, S, S) mask: use attention='masked_keys'"
    return None


# the settings' rules (infra/configurator.py): the names, and the pair checked together
RULES = {'attention': one_of(*ATTENTIONS),
         'attention_backend': ((lambda v: v in BACKENDS), "a diffusers attention backend: 'native', '_native_flash', "
                               "'_native_cudnn', '_native_efficient', '_native_math', 'flex', 'flash', '_flash_3', "
                               "'sage', ... (models/attention.py BACKENDS)"),
         ('attention', 'attention_backend'): (check, 'a pair that can run')}


def backend(name):
    """diffusers' AttentionBackendName of `name`, its packages checked (and a hub kernel fetched) as
    diffusers' set_attention_backend does; one line if it cannot run here."""
    from diffusers.models.attention_dispatch import (AttentionBackendName, _check_attention_backend_requirements,
                                                     _maybe_download_kernel_for_backend)
    if name not in BACKENDS:
        raise SystemExit(f'attention_backend must be one of {", ".join(BACKENDS)}, got {name!r}')
    b = AttentionBackendName(name)
    try:
        _check_attention_backend_requirements(b)
        _maybe_download_kernel_for_backend(b)
    except (RuntimeError, ImportError, OSError) as e:
        raise SystemExit(f'attention_backend {name!r} cannot run here: {e}')
    return b


def ulysses_refuses(backend):
    """None, or one line on why diffusers' own Ulysses (masked_keys and diffusers under sequence
    parallel) cannot run on `backend`: diffusers registers context parallelism for a few backends
    only, and the others would silently attend within each rank's tokens alone."""
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry
    b = AttentionBackendName(backend or 'native')
    if _AttentionBackendRegistry._is_context_parallel_available(b):
        return None
    able = ', '.join(sorted(_AttentionBackendRegistry._supports_context_parallel))
    return (f"sequence parallel with a mask runs diffusers' Ulysses, which attention_backend {b.value!r} "
            f"lacks: use attention='valid_tokens' (the default, any backend) or one of {able}")


def key_mask(mask, backend):
    """A (B, S) boolean key mask (True: attend) in the form `backend` reads right: (B, S) for xformers,
    which would read a 4-D boolean mask as a 0/1 bias; (B, 1, 1, S) for every other (diffusers reshapes
    a 2-D mask for NATIVE only: _native_cudnn fails on its shape for B >= 2 and flex reads it as a
    query mask, silently wrong)."""
    return mask if backend == 'xformers' else mask[:, None, None, :]


def valid_lengths(mask):
    """[n_0, ..., n_{B-1}] on the host: the valid tokens of each row of a (B, T) mask whose valid
    tokens come first. Read once per mask tensor and kept on it, so the blocks of a forward, which
    all get the same mask, and their checkpointed recomputation cost one device-to-host copy together."""
    n = getattr(mask, 'valid_lengths', None)
    if n is None:
        n = mask.count_nonzero(1).tolist()  # the one sync point of a forward
        mask.valid_lengths = n
    return n


def attend(q, k, v, lengths, backend=None):
    """softmax(q k^T / sqrt(d)) v of each sample b over its first lengths[b] tokens alone, no mask:
    the backend is called once per run of equal lengths in the batch, on views of q, k, v (B, S,
    heads, d). Returns (B, S, heads, d); a token past its sample's length gets 0 (read by no one)."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn
    B, S = q.shape[:2]
    runs, start = [], 0  # (first, end, length) of each run of equal lengths
    for b in range(1, B + 1):
        if b == B or lengths[b] != lengths[start]:
            runs.append((start, b, lengths[start]))
            start = b
    if runs == [(0, B, S)]:  # nothing to drop
        return dispatch_attention_fn(q, k, v, backend=backend)
    out = torch.zeros_like(q)
    for i, j, L in runs:
        out[i:j, :L] = dispatch_attention_fn(q[i:j, :L], k[i:j, :L], v[i:j, :L], backend=backend)
    return out


# ----------------------------------------------------------------------------- Ulysses

def ulysses_group(parallel_config):
    """The process group of a transformer's Ulysses ranks (diffusers' ParallelConfig, which
    enable_parallelism sets on every attention processor), or None without sequence parallel."""
    cp = parallel_config.context_parallel_config if parallel_config is not None else None
    return cp._ulysses_mesh.get_group() if cp is not None and cp.ulysses_degree > 1 else None


def _all_to_all(x, group):
    """x (n, ...): chunk j goes to rank j of group; returns (n, ...) with chunk j from rank j. Differentiable
    (its backward is the reverse all-to-all)."""
    from torch.distributed.nn.functional import all_to_all_single
    x = x.contiguous()
    return all_to_all_single(torch.empty_like(x), x, group=group)


def gather_tokens(x, split, group):
    """Ulysses' first all-to-all for the joint attention of two token streams, each split evenly over
    the n ranks of `group` in rank order (as diffusers' cp plans split them): x (B, S_r, H, d), this
    rank's tokens, its `split` tokens of the first stream first. Returns (B, n S_r, H/n, d): every
    rank's tokens for this rank's heads, the whole first stream, then the whole second, each in its
    unsplit order (so a sample's valid tokens are a prefix again)."""
    n = torch.distributed.get_world_size(group)
    B, S_r, H, d = x.shape
    x = x.reshape(B, S_r, n, H // n, d).permute(2, 0, 1, 3, 4)  # (n, B, S_r, H/n, d): heads j to rank j
    x = _all_to_all(x, group)                                   # (n, B, S_r, H/n, d): rank j's tokens
    first = x[:, :, :split].transpose(0, 1).reshape(B, n * split, H // n, d)
    second = x[:, :, split:].transpose(0, 1).reshape(B, n * (S_r - split), H // n, d)
    return torch.cat([first, second], 1)


def scatter_tokens(x, split, group):
    """The inverse of gather_tokens: (B, S, H/n, d) in its order -> (B, S/n, H, d), this rank's
    tokens with every head."""
    n = torch.distributed.get_world_size(group)
    B, S, h, d = x.shape
    first = x[:, :n * split].reshape(B, n, split, h, d)                  # rank j's share of each stream
    second = x[:, n * split:].reshape(B, n, S // n - split, h, d)
    x = _all_to_all(torch.cat([first, second], 2).transpose(0, 1), group)  # (n, B, S/n, h, d): heads of rank j
    return x.permute(1, 2, 0, 3, 4).reshape(B, S // n, n * h, d)
