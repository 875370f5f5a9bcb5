"""hunyuan15.MaskedKeysAttention against diffusers' own HunyuanVideo15AttnProcessor2_0, on the tiny
real pipeline (tests/tiny_hunyuan.py) with prompts encoded by its own encoders: every valid token
of every block and the model's output agree to float32 rounding, in batches that mix prompt
lengths (with and without ByT5 text), both CFG branches and t2v's masked image tokens; and no
tensor of S x S elements is ever made. python -m pytest tests/test_attention.py"""
import os
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hunyuan15
import model

sys.path.insert(0, os.path.dirname(__file__))
from tiny_hunyuan import make_tiny_hunyuan  # noqa: E402

PROMPTS = ['a red car', 'a "quoted" sign on a long winding road at dusk', 'x']  # 3 lengths, one with ByT5
NEG = ['', 'blurry']  # the negative prompts: shorter than the prompts, no ByT5 text


@pytest.fixture(scope='module')
def root(tmp_path_factory):
    return make_tiny_hunyuan(tmp_path_factory.mktemp('tiny_hunyuan'))


@pytest.fixture(scope='module')
def cache(root):
    return model.encode_prompts(root, PROMPTS + NEG)


def nets(root):
    """The tiny transformer loaded twice through model.py: masked keys (default) and diffusers'."""
    a, b = model.load_transformer(root).eval(), model.load_transformer(root, attention='diffusers').eval()
    from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15AttnProcessor2_0
    assert all(isinstance(blk.attn.processor, hunyuan15.MaskedKeysAttention) for blk in a.transformer_blocks)
    assert all(isinstance(blk.attn.processor, HunyuanVideo15AttnProcessor2_0) for blk in b.transformer_blocks)
    return a, b


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
def test_every_valid_token_and_the_velocity_equal_diffusers(root, cache):
    ours, ref = nets(root)
    x, s, text, neg = inputs(cache, PROMPTS, ['', 'blurry', ''])
    assert len({int(m.sum()) for m in text[1]}) == 3 and text[3].sum(1).min() == 0  # mixed lengths, ByT5 or not
    res = {}
    for name, net in (('ours', ours), ('ref', ref)):  # one batched forward of both CFG branches (2B = 6)
        res[name] = (block_outputs(net, lambda: res.setdefault(name + '_v', model.velocity(net, x, s, text, 6.0, neg))))
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


@torch.no_grad()
@pytest.mark.parametrize('image_tokens', [1, 5])
def test_model_output_equals_diffusers_each_branch(root, cache, image_tokens):
    # the transformer called directly, as the pipeline does, one CFG branch at a time, with t2v's
    # all-zero (masked) image tokens in any number
    ours, ref = nets(root)
    x, s, text, neg = inputs(cache, PROMPTS[::-1], NEG + [''], seed=1)
    for e1, m1, e2, m2 in (text, neg):
        kw = dict(hidden_states=torch.cat([x, torch.zeros_like(x), torch.zeros(3, 1, *x.shape[2:])], 1),
                  timestep=1000 * s, encoder_hidden_states=e1, encoder_attention_mask=m1,
                  encoder_hidden_states_2=e2, encoder_attention_mask_2=m2,
                  image_embeds=torch.zeros(3, image_tokens, 12), return_dict=False)
        torch.testing.assert_close(ours(**kw)[0], ref(**kw)[0], rtol=1e-5, atol=1e-6)


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
def test_nothing_of_size_s_by_s(root, cache):
    ours, ref = nets(root)
    x, s, text, neg = inputs(cache, PROMPTS, NEG + [''])
    V, T = 3 * 2 * 3, text[1].shape[1] + text[3].shape[1] + hunyuan15.IMAGE_TOKENS  # video and text tokens
    seen = {}
    for name, net in (('ours', ours), ('ref', ref)):
        with Shapes() as mode:
            model.velocity(net, x, s, text)
        seen[name] = {sh for sh in mode.shapes if sum(d == V + T for d in sh) >= 2}
    assert seen['ref']  # diffusers' (B, 1, S, S) mask: the probe sees it
    assert not seen['ours'], seen['ours']


def test_switch(root):
    with pytest.raises(SystemExit, match='attention must be one of'):
        model.load_transformer(root, attention='flash')
