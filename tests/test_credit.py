"""Token-level credit (credit.py and its score_and_grad, sde.log_prob's weight) against independent
references: hand-computed latent tokens of a hot pixel and of a hot VideoAlign patch, the toy's own
encoder, torch.distributions with explicit weights, and central finite differences of the rewards.
python -m pytest tests/test_credit.py"""
import pytest
import torch

from extras import credit
import reward
import sde
from models import toy, videoalign


def hot(shape, f, y, x):
    g = torch.zeros(shape)  # (1, F, 3, H, W)
    g[0, f, 1, y, x] = -2.0  # the sign must not matter: credit is a magnitude
    return g


# ----------------------------------------------------------------------------- geometry

# HunyuanVideo 1.5's causal VAE: 9 frames -> 3 latent frames (frame 0 | 1-4 | 5-8), 16 px per position
HV_CASES = [((0, 0, 0), (0, 0, 0)), ((1, 0, 0), (1, 0, 0)), ((4, 17, 47), (1, 1, 2)),
            ((5, 15, 16), (2, 0, 1)), ((8, 31, 31), (2, 1, 1))]


@pytest.mark.parametrize('pixel,token', HV_CASES)
def test_hot_pixel_lands_on_its_hunyuan_token(pixel, token):
    Fl, h, w = 3, 2, 3
    c = credit.credit_map(hot((1, 9, 3, 32, 48), *pixel), (32, Fl, h, w), window=(1, 1, 1))  # (1, 1, Fl, h, w)
    assert c.shape == (1, 1, Fl, h, w)
    expect = torch.zeros(Fl, h, w)
    expect[token] = Fl * h * w  # all the credit on one token, mean 1
    assert torch.equal(c[0, 0], expect)


def test_hot_pixel_lands_where_the_toy_encoder_puts_it():
    # the toy's space-to-depth is its own reference: a pixel's latent elements share one token
    frames = torch.full((1, toy.FRAMES, 3, toy.HEIGHT, toy.WIDTH), 0.5)
    for f, y, x in [(0, 0, 0), (3, 5, 23), (8, 23, 4)]:
        bumped = frames.clone()
        bumped[0, f, 2, y, x] += 0.1
        changed = (toy.encode(bumped) - toy.encode(frames))[0].abs().sum(0).nonzero().tolist()  # [[t, i, j]]
        c = credit.credit_map(hot(frames.shape, f, y, x), toy.LATENT_SHAPE, window=(1, 1, 1))[0, 0]
        assert c.nonzero().tolist() == changed == [[f, y // 4, x // 4]]


def test_hot_videoalign_patch_lands_on_hand_computed_tokens():
    # 17 frames at 8 fps, 320x320: VideoAlign samples frames 0, 5, 11, 16 and resizes to 336x336 (24x24
    # patches, temporal pairs (0, 5), (11, 16)). Patch (t=1, row 5, col 7) is row 687 of the packed
    # rows: 576 per pair + block (2, 3) of 12 per row, 4 per block, (1, 1) inside it.
    video = torch.full((17, 3, 320, 320), 0.5, requires_grad=True)
    rows, grid = videoalign.preprocess_video(video, 8)
    assert grid.tolist() == [2, 24, 24]
    rows[576 + (2 * 12 + 3) * 4 + 1 * 2 + 1].sum().backward()
    # its pixels are resized rows 70-83, cols 98-111 = original 66.7-80, 93.3-106.7, widened by the
    # bicubic's 2 px: original rows 64-82 (latent rows 4, 5), cols 91-109 (latent cols 5, 6); frames
    # 11 and 16 are latent frames 3 and 4 ((11 - 1) // 4 + 1, (16 - 1) // 4 + 1)
    c = credit.credit_map(video.grad[None], (32, 5, 20, 20), window=(1, 1, 1))[0, 0]
    assert sorted(map(tuple, c.nonzero().tolist())) == [(t, i, j) for t in (3, 4) for i in (4, 5) for j in (5, 6)]
    assert c[3].argmax().item() == 4 * 20 + 6  # most of the patch (cols 93-107) is latent col 6


def test_unseen_latent_frames_are_interpolated():
    m = torch.zeros(1, 5, 1, 1)
    m[0, [0, 2, 4], 0, 0] = torch.tensor([1.0, 3.0, 5.0])
    assert credit.fill(m, [0, 2, 4]).flatten().tolist() == [1, 2, 3, 4, 5]
    m = torch.zeros(1, 5, 1, 1)
    m[0, [1, 2], 0, 0] = torch.tensor([2.0, 4.0])
    assert credit.fill(m, [1, 2]).flatten().tolist() == [2, 2, 4, 4, 4]  # nearest beyond the ends
    # through credit_map: 17 frames, the reward saw 0, 5, 11, 16 -> latent frames 0, 2, 3, 4; 1 is filled
    g = torch.zeros(1, 17, 3, 16, 16)
    g[0, [0, 5, 11, 16]] = torch.tensor([1.0, 3.0, 1.0, 1.0]).view(4, 1, 1, 1)
    c = credit.credit_map(g, (32, 5, 1, 1), seen=[0, 5, 11, 16], window=(1, 1, 1)).flatten()
    assert torch.allclose(c, torch.tensor([1.0, 2.0, 3.0, 1.0, 1.0]) / 1.6)


def test_smoothing_granularity_and_normalisation():
    g = hot((2, 9, 3, 32, 48), 6, 17, 17)  # clip 0: token (2, 1, 1); clip 1: all zero
    g[0, 6, 0, 1, 1] = 2.0  # and token (2, 0, 0), the same weight
    c = credit.credit_map(g, (32, 3, 2, 3), window=(1, 3, 3))[:, 0]  # (2, Fl, h, w)
    # box average of the tokens that exist: the 2x3 grid, each 3x3 window holds 4 or 6 of them
    counts = torch.tensor([[4.0, 6.0, 4.0], [4.0, 6.0, 4.0]])
    both = torch.tensor([[4.0, 4.0, 2.0], [4.0, 4.0, 2.0]]) / counts  # window sums of the two hot tokens
    expect = torch.zeros(3, 2, 3)
    expect[2] = both / both.sum() * 18  # mean 1 over the 18 tokens
    assert torch.allclose(c[0], expect)
    assert torch.equal(c[1], torch.ones(3, 2, 3))  # no gradient: uniform credit, plain GRPO
    f = credit.credit_map(g, (32, 3, 2, 3), window=(1, 1, 1), granularity='frame')[0, 0]
    assert torch.equal(f, torch.cat([torch.zeros(2, 2, 3), torch.full((1, 2, 3), 3.0)]))
    nan = torch.full((1, 9, 3, 32, 48), float('nan'))
    assert torch.equal(credit.credit_map(nan, (32, 3, 2, 3)), torch.ones(1, 1, 3, 2, 3))
    assert not credit.credit_map(g.requires_grad_(), (32, 3, 2, 3)).requires_grad  # detached
    with pytest.raises(ValueError, match='does not decode'):
        credit.credit_map(torch.zeros(1, 8, 3, 32, 48), (32, 3, 2, 3))


# ----------------------------------------------------------------------------- weighted log-prob

def test_weighted_log_prob_matches_torch_distributions():
    gen = torch.Generator().manual_seed(0)
    x, v = torch.randn(3, 4, 5, 2, 3, generator=gen), torch.randn(3, 4, 5, 2, 3, generator=gen)
    w = torch.rand(3, 1, 5, 2, 3, generator=gen) * 2  # per token, shared by the channels
    st = sde.step(x, v, 0.8, 0.7, 'sage', 0.5, generator=gen)
    got = sde.step(x, v, 0.8, 0.7, 'sage', 0.5, x_next=st.x_next, weight=w).logp
    lp = torch.distributions.Normal(st.mean.double(), st.std.double().view(3, 1, 1, 1, 1)).log_prob(st.x_next.double())
    wf = w.double().expand_as(lp)
    ref = (wf * lp).flatten(1).sum(1) / wf.flatten(1).sum(1)
    assert torch.allclose(got.double(), ref, rtol=1e-5, atol=1e-5)
    # weight None is bitwise the plain mean over the clip's elements; weight 1 is the same number up to float rounding
    plain = sde.step(x, v, 0.8, 0.7, 'sage', 0.5, x_next=st.x_next).logp
    sd = st.std.view(3, 1, 1, 1, 1)
    mean = (-(st.x_next - st.mean) ** 2 / (2 * sd ** 2) - torch.log(sd) - sde.LOG_SQRT_2PI).flatten(1).mean(1)
    assert torch.equal(plain, mean) and torch.equal(st.logp, mean)
    assert torch.allclose(sde.step(x, v, 0.8, 0.7, 'sage', 0.5, x_next=st.x_next, weight=torch.ones(1)).logp, plain)
    # the same weight on old and new log-prob: ratio exactly 1 at theta = theta_old
    assert torch.equal(sde.log_prob(st.x_next, st.mean, st.std, w), got)


# ----------------------------------------------------------------------------- reward gradients

def directional(fn, frames, g, gen, eps):
    u = torch.rand(frames.shape, generator=gen, dtype=frames.dtype) * 2 - 1
    fd = (fn(frames + eps * u) - fn(frames - eps * u)) / (2 * eps)  # (B,)
    return fd, (g * u).flatten(1).sum(1)


def test_toy_reward_gradient_matches_finite_differences():
    # float64 and a tiny step: the toy reward is exact but rough (its fit clamps coverage and alpha and
    # uses a finite-difference Jacobian), with kinks every ~1e-4 in pixel space, so float32 central
    # differences at 1e-3 measure an average over kinks, not the derivative
    gen = torch.Generator().manual_seed(0)
    prompts = ['a red circle moving left', 'a blue cross moving up', 'a green square moving down',
               'a yellow triangle moving right']
    clean = torch.stack([toy.render(p, i) for i, p in enumerate(prompts)])
    frames = (clean + 0.04 * torch.randn(clean.shape, generator=gen)).clamp(0.05, 0.95)  # off the manifold
    w = reward.SETTING_B
    scores, g = credit.score_and_grad(toy.reward, frames, prompts, toy.FPS, w)
    assert torch.equal(reward.combine(scores, w), reward.combine(toy.reward(frames, prompts), w))
    assert g.dtype == torch.float32 and g.abs().sum() > 0
    x = frames.double().requires_grad_()
    reward.combine(toy.reward(x, prompts), w).sum().backward()
    assert torch.allclose(g, x.grad.float(), rtol=1e-2, atol=1e-4)  # the float32 gradient, roughly
    fn = lambda f: reward.combine(toy.reward(f, prompts), w)
    for _ in range(3):
        fd, an = directional(fn, x.detach(), x.grad, gen, 1e-6)
        assert torch.allclose(fd, an, rtol=1e-4, atol=1e-7), (fd, an)


@pytest.fixture(scope='module')
def tiny_va(tmp_path_factory):
    from tiny_videoalign import make_tiny_videoalign
    ckpt, qwen = make_tiny_videoalign(str(tmp_path_factory.mktemp('va')))
    return videoalign.load_videoalign(ckpt, qwen, dtype=torch.float64)


def test_videoalign_gradient_matches_finite_differences(tiny_va, monkeypatch):
    gen = torch.Generator().manual_seed(1)
    frames = 0.2 + 0.6 * torch.rand(2, 8, 3, 40, 56, generator=gen)  # 8 frames at 8 fps: 4 sampled
    prompts = ['a cat walks on the grass', 'a dog runs in the park at night']
    w = (0.5, 0.5, 1.0)
    # with the 8-bit rounding on: the same scores as __call__ and a gradient (straight-through)
    scores, g = credit.score_and_grad(tiny_va, frames, prompts, 8, w)
    assert all(torch.equal(scores[k], tiny_va(frames, prompts, 8)[k]) for k in reward.DIMS)
    assert g.shape == frames.shape and g.abs().sum() > 0
    assert all(p.grad is None and not p.requires_grad for p in tiny_va.model.parameters())
    assert tiny_va.rm_head.weight.grad is None
    # rounding off (identity), the pipeline is smooth: autograd == central differences
    monkeypatch.setattr(videoalign, '_round', lambda x: x)
    _, g = credit.score_and_grad(tiny_va, frames, prompts, 8, w)
    fn = lambda f: reward.combine(tiny_va(f, prompts, 8), w).double()
    for _ in range(2):
        fd, an = directional(fn, frames, g, gen, 1e-3)
        assert torch.allclose(fd, an.double(), rtol=0.02, atol=1e-4), (fd, an)
