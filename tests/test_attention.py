"""The blocks' attention (attention.py, hunyuan15.ValidTokensAttention and MaskedKeysAttention) against
diffusers' own HunyuanVideo15AttnProcessor2_0, on the tiny real pipeline (tests/tiny_hunyuan.py:
random qk-norm gains) with prompts encoded by its own encoders: every valid token of every block,
the velocity and its gradients agree to float32 rounding, in batches that mix prompt lengths (with
and without ByT5 text), both CFG branches and t2v's masked image tokens; every dispatcher backend a
CPU runs gives native's result; the default path hands no backend a mask, and nothing makes a
tensor of S x S elements. python -m pytest tests/test_attention.py
(sequence parallel: tests/test_sp.py)"""
import itertools
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from models import attention
from models import hunyuan15
from models import policy as model

sys.path.insert(0, os.path.dirname(__file__))
from tiny_hunyuan import make_tiny_hunyuan  # noqa: E402

PROMPTS = ['a red car', 'a "quoted" sign on a long winding road at dusk', 'x']  # 3 lengths, one with ByT5
NEG = ['', 'blurry']  # the negative prompts: shorter than the prompts, no ByT5 text
CPU_BACKENDS = ('native', '_native_math', '_native_flash', 'flex')  # those that run on a CPU (no mask: _native_flash)


@pytest.fixture(scope='module')
def root(tmp_path_factory):
    return make_tiny_hunyuan(tmp_path_factory.mktemp('tiny_hunyuan'))


@pytest.fixture(scope='module')
def cache(root):
    return model.encode_prompts(root, PROMPTS + NEG)


def net(root, kind, backend='native'):
    """The tiny transformer loaded through model.py with the blocks' attention `kind`."""
    from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15AttnProcessor2_0
    n = model.load_transformer(root, attention=kind, backend=backend).eval()
    cls = dict(valid_tokens=hunyuan15.ValidTokensAttention, masked_keys=hunyuan15.MaskedKeysAttention,
               diffusers=HunyuanVideo15AttnProcessor2_0)[kind]
    assert all(type(blk.attn.processor) is cls for blk in n.transformer_blocks)
    return n


def block_outputs(net, fn):
    """Run fn(); return per block (video out (B, V, D), text out (B, T, D), text mask (B, T))."""
    out, hooks = [], []
    for blk in net.transformer_blocks:
        hooks.append(blk.register_forward_hook(
            lambda mod, args, res: out.append((res[0], res[1], args[3].bool())), with_kwargs=False))
    try:
        fn()
    finally:
        for h in hooks:
            h.remove()
    return out


def inputs(cache, prompts, negs, B=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, 4, 3, 2, 3, generator=g)                          # (B, C, F, h, w): 18 video tokens
    s = torch.rand(B, generator=g)
    return x, s, model.batch_text(cache, prompts, 'cpu'), model.batch_text(cache, negs, 'cpu')


@torch.no_grad()
@pytest.mark.parametrize('kind', ['valid_tokens', 'masked_keys'])
def test_every_valid_token_and_the_velocity_equal_diffusers(root, cache, kind):
    ours, ref = net(root, kind), net(root, 'diffusers')
    x, s, text, neg = inputs(cache, PROMPTS, ['', 'blurry', ''])
    assert len({int(m.sum()) for m in text[1]}) == 3 and text[3].sum(1).min() == 0  # mixed lengths, ByT5 or not
    res = {}
    for name, n in (('ours', ours), ('ref', ref)):  # one batched forward of both CFG branches (2B = 6)
        res[name] = (block_outputs(n, lambda: res.setdefault(name + '_v', model.velocity(n, x, s, text, 6.0, neg))))
    assert len(res['ours']) == len(ours.transformer_blocks) == 2
    for (vo, to, mo), (vr, tr, mr) in zip(res['ours'], res['ref']):
        assert torch.equal(mo, mr) and (~mr).any()  # the same reordered text mask, with padding in it
        torch.testing.assert_close(vo, vr, rtol=1e-5, atol=1e-6)          # every video token
        torch.testing.assert_close(to[mr], tr[mr], rtol=1e-5, atol=1e-6)  # every valid text token
    torch.testing.assert_close(res['ours_v'], res['ref_v'], rtol=1e-5, atol=1e-6)
    assert res['ref_v'].abs().max() > 0.1
    # the check has teeth: attending to the padded keys as well changes the velocity
    for blk in ours.transformer_blocks:
        blk.attn.processor = Unmasked()
    v = model.velocity(ours, x, s, text, 6.0, neg)
    assert (v - res['ref_v']).abs().max() > 1e-3


class Unmasked(hunyuan15.MaskedKeysAttention):
    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        return super().__call__(attn, hidden_states, encoder_hidden_states, None, image_rotary_emb)


def test_gradients_equal_diffusers_in_training(root, cache, monkeypatch):
    # as train.py runs it: gradient checkpointing (the blocks recomputed in backward), both CFG branches
    # with grad, a fixed linear function of the velocity; the valid lengths are read from the mask once
    # (one device-to-host copy on a GPU), not once per block or again in the recomputation
    x, s, text, neg = inputs(cache, PROMPTS, ['', 'blurry', ''], seed=2)
    w = torch.randn(x.shape, generator=torch.Generator().manual_seed(3))
    reads, count = [], torch.Tensor.count_nonzero
    monkeypatch.setattr(torch.Tensor, 'count_nonzero', lambda t, *a, **k: reads.append(t.shape) or count(t, *a, **k))
    grads = {}
    for kind in ('valid_tokens', 'diffusers'):
        n = net(root, kind).train()
        n.enable_gradient_checkpointing()
        (model.velocity(n, x, s, text, 6.0, neg) * w).sum().backward()
        grads[kind] = {k: p.grad for k, p in n.named_parameters() if p.grad is not None}
        if kind == 'valid_tokens':
            assert len(reads) == 1, reads  # 2 blocks, forward and recomputation: one read
    assert grads['valid_tokens'].keys() == grads['diffusers'].keys()
    total = torch.cat([g.flatten() for g in grads['diffusers'].values()]).norm()
    for k, g in grads['diffusers'].items():
        # the refiner's key bias shifts all of a query's scores alike: its gradient is 0 up to rounding
        torch.testing.assert_close(grads['valid_tokens'][k], g, rtol=1e-4, atol=1e-6 * total, msg=k)
    assert grads['diffusers']['transformer_blocks.0.attn.norm_added_k.weight'].abs().max() > 1e-3


@torch.no_grad()
@pytest.mark.parametrize('kind', ['valid_tokens', 'masked_keys', 'diffusers'])
def test_every_cpu_backend_equals_native(root, cache, kind):
    # the dispatcher backends a CPU runs, each given its mask form (attention.key_mask) where one remains
    x, s, text, neg = inputs(cache, PROMPTS, ['', 'blurry', ''], seed=4)
    ref = model.velocity(net(root, kind), x, s, text, 6.0, neg)
    ran = []
    for b in CPU_BACKENDS:
        if attention.check(kind, b):  # _native_flash takes no mask: valid_tokens only
            assert b in attention.NO_MASK and kind != 'valid_tokens'
            continue
        v = model.velocity(net(root, kind, b), x, s, text, 6.0, neg)
        torch.testing.assert_close(v, ref, rtol=1e-5, atol=1e-5, msg=b)
        ran.append(b)
    assert ran == list(CPU_BACKENDS if kind == 'valid_tokens' else ('native', '_native_math', 'flex'))


def test_valid_tokens_trains_on_cpu_backends_with_a_backward(root, cache):
    # _native_math and _native_flash differentiate on a CPU (flex has no CPU backward): native's gradients
    x, s, text, neg = inputs(cache, PROMPTS[:2], NEG, B=2, seed=5)
    grads = {}
    for b in ('native', '_native_math', '_native_flash'):
        n = net(root, 'valid_tokens', b)
        model.velocity(n, x, s, text, 6.0, neg).square().sum().backward()
        grads[b] = torch.cat([p.grad.flatten() for p in n.parameters() if p.grad is not None])
    for b in ('_native_math', '_native_flash'):
        torch.testing.assert_close(grads[b], grads['native'], rtol=1e-4, atol=1e-5 * grads['native'].norm(), msg=b)


def test_mask_forms():
    # diffusers 0.42 reshapes a 2-D (B, S) mask for NATIVE only: flex reads it as a query mask, silently
    # wrong; the (B, 1, 1, S) form key_mask gives it is right (and xformers gets (B, S), see key_mask)
    from diffusers.models.attention_dispatch import dispatch_attention_fn
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 10, 2, 8) for _ in range(3))
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[1, 6:] = False
    ref = dispatch_attention_fn(q, k, v, attn_mask=mask, backend='native')
    got = dispatch_attention_fn(q, k, v, attn_mask=attention.key_mask(mask, 'flex'), backend='flex')
    torch.testing.assert_close(got[1, :6], ref[1, :6])
    torch.testing.assert_close(got[0], ref[0])
    assert (dispatch_attention_fn(q, k, v, attn_mask=mask, backend='flex')[1, :6] - ref[1, :6]).abs().max() > 0.1
    assert attention.key_mask(mask, 'xformers').shape == (2, 10)


def test_backend_list_is_diffusers_and_no_mask_is_what_refuses_a_mask():
    # attention.BACKENDS is diffusers' AttentionBackendName; NO_MASK is exactly the backends that raise
    # on any attn_mask (they do so before touching a kernel, so a CPU can tell)
    from diffusers.models.attention_dispatch import AttentionBackendName, dispatch_attention_fn
    assert sorted(attention.BACKENDS) == sorted(b.value for b in AttentionBackendName)
    q = torch.randn(1, 4, 1, 8)
    refuses = set()
    for b in attention.BACKENDS:
        try:
            dispatch_attention_fn(q, q, q, attn_mask=torch.ones(1, 1, 1, 4, dtype=torch.bool), backend=b)
        except ValueError as e:
            if 'not supported' in str(e) and 'attn_mask' in str(e):
                refuses.add(b)
        except Exception:  # a kernel this machine lacks: not a refusal of the mask
            pass
    assert refuses == set(attention.NO_MASK)


@torch.no_grad()
def test_default_path_calls_sdpa_without_a_mask_in_every_block(root, cache, monkeypatch):
    # F.scaled_dot_product_attention patched to record its calls: the blocks' calls carry no mask, one
    # per run of equal valid lengths, each over exactly the video + valid text tokens of its samples
    n = model.load_transformer(root).eval()  # the defaults: valid_tokens, native
    x, s, text, neg = inputs(cache, PROMPTS, ['', '', ''])
    seen, inside, sdpa = [], [False], F.scaled_dot_product_attention

    def record(query, key, value, attn_mask=None, **kw):
        if inside[0]:  # a block's attention (the token refiner's is diffusers' own, with its mask)
            seen.append((tuple(query.shape), attn_mask))
        return sdpa(query, key, value, attn_mask=attn_mask, **kw)
    monkeypatch.setattr(F, 'scaled_dot_product_attention', record)
    for blk in n.transformer_blocks:
        blk.attn.register_forward_pre_hook(lambda *a: inside.__setitem__(0, True))
        blk.attn.register_forward_hook(lambda *a: inside.__setitem__(0, False))
    model.velocity(n, x, s, text, 6.0, neg)
    V = 3 * 2 * 3
    valid = (text[1].sum(1) + text[3].sum(1)).tolist() + (neg[1].sum(1) + neg[3].sum(1)).tolist()  # 6 samples
    # neighbours of equal length share a call: 'x' and the three '' have the same valid tokens
    runs = [(len(list(g)), V + int(t)) for t, g in itertools.groupby(valid)]
    assert runs[-1][0] == 4
    blocks = seen
    assert len(blocks) == len(n.transformer_blocks) * len(runs)
    assert all(m is None for _, m in blocks), 'a block handed SDPA a mask'
    assert [(sh[0], sh[2]) for sh, _ in blocks] == runs * len(n.transformer_blocks)


@torch.no_grad()
def test_nothing_of_size_s_by_s(root, cache):
    x, s, text, neg = inputs(cache, PROMPTS, NEG + [''])
    V, T = 3 * 2 * 3, text[1].shape[1] + text[3].shape[1] + hunyuan15.IMAGE_TOKENS  # video and text tokens
    seen = {}
    for kind in ('valid_tokens', 'masked_keys', 'diffusers'):
        with Shapes() as mode:
            model.velocity(net(root, kind), x, s, text)
        seen[kind] = {sh for sh in mode.shapes if sum(d == V + T for d in sh) >= 2}
    assert seen['diffusers']  # diffusers' (B, 1, S, S) mask: the probe sees it
    assert not seen['masked_keys'] and not seen['valid_tokens'], seen


class Shapes(TorchDispatchMode):
    """Records the shape of every tensor any op returns."""
    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(t, torch.Tensor):
                self.shapes.append(tuple(t.shape))
        return out


@torch.no_grad()
@pytest.mark.parametrize('image_tokens', [1, 5])
def test_model_output_equals_diffusers_each_branch(root, cache, image_tokens):
    # the transformer called directly, as the pipeline does, one CFG branch at a time, with t2v's
    # all-zero (masked) image tokens in any number
    ours, ref = net(root, 'valid_tokens'), net(root, 'diffusers')
    x, s, text, neg = inputs(cache, PROMPTS[::-1], NEG + [''], seed=1)
    for e1, m1, e2, m2 in (text, neg):
        kw = dict(hidden_states=torch.cat([x, torch.zeros_like(x), torch.zeros(3, 1, *x.shape[2:])], 1),
                  timestep=1000 * s, encoder_hidden_states=e1, encoder_attention_mask=m1,
                  encoder_hidden_states_2=e2, encoder_attention_mask_2=m2,
                  image_embeds=torch.zeros(3, image_tokens, 12), return_dict=False)
        torch.testing.assert_close(ours(**kw)[0], ref(**kw)[0], rtol=1e-5, atol=1e-6)


def test_switches_one_line(root):
    from infra.configurator import configure
    with pytest.raises(SystemExit, match='attention must be one of'):
        model.load_transformer(root, attention='flash')
    with pytest.raises(SystemExit, match="attention_backend 'flash' cannot run here"):  # flash-attn absent
        model.load_transformer(root, backend='flash')
    # sequence parallel: a mask needs diffusers' Ulysses, which _native_math lacks (it would attend within
    # each rank's tokens); valid tokens do their own all-to-all, so any backend, and no mask is split
    with pytest.raises(SystemExit, match="attention_backend '_native_math' lacks"):
        hunyuan15.cp_plan(net(root, 'masked_keys', '_native_math'))
    assert 'transformer_blocks.*' not in hunyuan15.cp_plan(net(root, 'valid_tokens', '_native_math'))
    g = dict(attention='valid_tokens', attention_backend='native')
    configure(dict(g), ['--attention_backend=_native_flash'], rules=attention.RULES)  # no mask: fine without one
    with pytest.raises(SystemExit, match=r"^config error: attention_backend '_native_flash' takes no mask"):
        configure(dict(g), ['--attention=masked_keys', '--attention_backend=_native_flash'], rules=attention.RULES)


def test_attend_one_shared_short_length_drops_the_padding():
    """attend() with every sample at the same short length (one run, shorter than S): each sample
    attends over its valid tokens alone, the padding neither as keys nor as output (0 there), as
    plain softmax attention over the prefix computes it; and the full-length batch is plain attention."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 7, 2, 4) for _ in range(3))  # (B, S, heads, d)

    def ref(L):  # softmax(q k^T / sqrt(d)) v over the first L tokens, written out
        w = torch.einsum('bqhd,bkhd->bhqk', q[:, :L], k[:, :L]) / 4 ** 0.5
        return torch.einsum('bhqk,bkhd->bqhd', w.softmax(-1), v[:, :L])
    got = attention.attend(q, k, v, [4, 4])
    torch.testing.assert_close(got[:, :4], ref(4))
    assert got[:, 4:].eq(0).all()
    torch.testing.assert_close(attention.attend(q, k, v, [7, 7]), ref(7))
