"""
The distilled streaming toy (streaming/toy_sf.py). python -m pytest tests/test_toy_sf.py
- the sampler's schedule and re-noising: the sigmas are the stated 1, 15/16, 5/6, 5/8 (timesteps 1000..250 at
  shift 5, computed here from the formula), and with a stand-in velocity every step's input is
  (1 - s') (x - s v) + s' z with z the sample's own generator's next draw, the block written at sigma 0;
- DMD on a Gaussian, against its closed form: with the exact x0-denoisers of N(mu_real, I) and N(mu_fake, I),
  dmd_grad is (mu_fake - mu_real) s^2 / ((1-s)^2 + s^2) / mean|x - real|, the loss's gradient is grad / numel,
  and its steps carry a generator's mean to mu_real;
- the training rollout: in each block exactly one forward carries gradient (the exit step's), a block's clip
  depends on no earlier block through the gradient, and with every exit at the last step it is
  streaming.generate's clip;
- the training script runs end to end at tiny size, and what it writes loads through the family table (the model
  is no longer committed: the story toy's student succeeded it, tests/test_story_kvpo.py).
"""

import pytest
import torch

from models import family, toy
import streaming
from streaming import toy_ar, toy_sf



def test_sigmas_are_the_released_four():
    a, t = 5.0, [1.0, 0.75, 0.5, 0.25]
    expected = [a * u / (1 + (a - 1) * u) for u in t]  # Self-Forcing's warp of timestep / 1000
    assert toy_sf.LAYOUT['timesteps'] == (1000, 750, 500, 250) and toy_sf.LAYOUT['renoise'] == 'fresh'
    assert streaming.sigmas(toy_sf.LAYOUT) == pytest.approx(expected, abs=1e-12)
    assert expected == pytest.approx([1, 15 / 16, 5 / 6, 5 / 8], abs=1e-12)


def test_renoising_uses_fresh_noise_at_the_next_sigma(monkeypatch):
    calls = []

    def fake_block(net, x, s, context, cache, start, write=False):  # v = x: x0 = (1 - s) x
        calls.append((start, s[0].item(), x.clone(), write))
        return x

    monkeypatch.setattr(streaming, 'forward_block', fake_block)
    net = type('Net', (), {'layout': toy_sf.LAYOUT})()
    noise = torch.randn(2, 3, 2, 2, 2, generator=torch.Generator().manual_seed(0))
    out = streaming.generate(net, noise, torch.zeros(2, 1, 1), [torch.Generator().manual_seed(i) for i in (7, 8)])
    sig = [1, 15 / 16, 5 / 6, 5 / 8]
    gens = [torch.Generator().manual_seed(i) for i in (7, 8)]
    for b in range(2):  # the expected trajectory, from the formula and the same generators' draws
        x = noise[:, :, b:b + 1]
        for k, s in enumerate(sig):
            start, s_got, x_got, write = calls[5 * b + k]
            assert (start, write) == (b, False) and s_got == pytest.approx(s) and torch.allclose(x_got, x, atol=1e-6)
            x0 = (1 - s) * x
            if k < 3:
                z = torch.stack([torch.randn(x.shape[1:], generator=g) for g in gens])
                x = (1 - sig[k + 1]) * x0 + sig[k + 1] * z
        start, s_got, x_got, write = calls[5 * b + 4]  # the finished block written at sigma 0
        assert write and s_got == 0 and torch.allclose(x_got, x0, atol=1e-6)
        assert torch.allclose(out[:, :, b:b + 1], x0, atol=1e-6)
    assert len(calls) == 10


def gaussian_x0(mu, xs, s):
    """E[x0 | x_s] for x0 ~ N(mu, I), x_s = (1 - s) x0 + s eps: mu + (1-s) / ((1-s)^2 + s^2) (x_s - (1-s) mu)."""
    a = 1 - s
    return mu + a / (a * a + s * s) * (xs - a * mu)


def test_dmd_gradient_on_a_gaussian():
    torch.manual_seed(0)
    d = (4, 3, 2, 2, 2)  # clips of a 5-d shape, as the student's (B, C, F, h, w)
    mu_real, theta = torch.full(d[1:], 1.0), torch.zeros(d[1:], requires_grad=True)  # the generator: x = theta + z
    s = torch.tensor(0.6)
    for step in range(300):
        x = theta + torch.randn(d)
        xs = (1 - s) * x.detach() + s * torch.randn(d)
        real, fake = gaussian_x0(mu_real, xs, s), gaussian_x0(theta.detach(), xs, s)
        g = toy_sf.dmd_grad(x.detach(), real, fake)
        if step == 0:  # the closed form: (mu_fake - mu_real) s^2 / ((1-s)^2 + s^2), normalised per clip
            norm = (x.detach() - real).abs().mean((1, 2, 3, 4), keepdim=True)
            closed = (theta.detach() - mu_real) * s ** 2 / ((1 - s) ** 2 + s ** 2) / norm
            torch.testing.assert_close(g, closed.expand(d), atol=1e-6, rtol=1e-5)
            assert (g < 0).all()  # the student sits below the teacher: the step raises it
            xr = x.detach().requires_grad_(True)
            toy_sf.dmd_loss(xr, g).backward()
            torch.testing.assert_close(xr.grad, g / g.numel())
        theta.grad = None
        toy_sf.dmd_loss(x, g).backward()
        with torch.no_grad():
            theta -= 2.0 * theta.grad * x.shape[0]  # plain SGD on the DMD loss
    assert (theta - mu_real).abs().max() < 0.05, theta


def small_student():
    torch.manual_seed(0)
    cfg = dict(toy_ar.CONFIG, num_layers=1)
    return streaming.install(toy_sf.ToySFTransformer(**cfg), toy_sf.LAYOUT)


def test_rollout_one_exit_step_carries_gradient():
    torch.set_num_threads(1)
    net = small_student()
    grad_calls = []
    hook = net.register_forward_pre_hook(lambda m, a, k: grad_calls.append(
        (net.stream_ctx.frames[0], torch.is_grad_enabled(), float(k['timestep'].flatten()[0]))), with_kwargs=True)
    ctx = toy_ar.context(toy.encode_prompts(['a red circle moving left', 'a blue cross moving up']))
    noise = torch.randn(2, *toy.LATENT_SHAPE, generator=torch.Generator().manual_seed(1)).requires_grad_(True)
    exits = [0, 3, 1, 2, 0, 1, 3, 2, 2]
    x = toy_sf.rollout(net, noise, ctx, exits)
    hook.remove()
    sig = streaming.sigmas(toy_sf.LAYOUT)
    for b, e in enumerate(exits):
        mine = [(g, t) for f, g, t in grad_calls if f == b]
        assert len(mine) == e + 2  # e + 1 steps, then the write at timestep 0
        assert [t for g, t in mine if g] == [pytest.approx(1000 * sig[e])]  # one forward with gradient: the exit's
    for b, e in enumerate(exits):  # through the gradient a block sees only its own step's input
        gn, = torch.autograd.grad(x[:, :, b].sum(), noise, retain_graph=True)
        assert gn[:, :, [f for f in range(9) if f != b]].abs().max() == 0
        assert (gn[:, :, b].abs().max() > 0) == (e == 0)  # the noise itself is the input only at step 0
    gp = torch.autograd.grad(x.sum(), [p for p in net.parameters()], allow_unused=True)
    assert any(g is not None and g.abs().max() > 0 for g in gp)
    gens = lambda: [torch.Generator().manual_seed(i) for i in (3, 4)]  # noqa: E731
    with torch.no_grad():
        full = toy_sf.rollout(net, noise.detach(), ctx, [3] * 9, gens())
        torch.testing.assert_close(full, streaming.generate(net, noise.detach(), ctx, gens()), atol=1e-5, rtol=0)




def test_training_script_runs_end_to_end(tmp_path, monkeypatch):
    torch.set_num_threads(1)
    ar = str(tmp_path / 'toy_ar')  # its start and stage-1 teacher, no longer committed: a 2-step one built here
    monkeypatch.setattr(toy_ar, 'DIR', ar)  # stage 1's AR teacher is read from DIR
    toy_ar.train(steps=2, out=ar)
    monkeypatch.setattr(toy_sf, 'INIT', ar)
    for k, v in dict(DIR=str(tmp_path / 'toy_sf'), ODE_CLIPS=4, ODE_ITERS=2, ODE_BATCH=2, DMD_ITERS=2, DMD_BATCH=2,
                     CRITIC_WARMUP=1).items():
        monkeypatch.setattr(toy_sf, k, v)
    monkeypatch.setattr(toy_sf, 'probe', lambda net: 0.0)
    toy_sf.train()
    for sub in ('', 'ode_init'):
        fam = family(str(tmp_path / 'toy_sf' / sub))
        net = fam.load_transformer(str(tmp_path / 'toy_sf' / sub))
        x = fam.generate(net, torch.randn(1, *toy.LATENT_SHAPE), fam.text_encoder(str(tmp_path / 'toy_sf'), 'cpu')(['']))
        assert fam is toy_sf and x.shape == (1, *toy.LATENT_SHAPE) and torch.isfinite(x).all()
    assert 'done: stage 1' in open(tmp_path / 'toy_sf' / 'train.log').read()


def test_an_unbuilt_toy_names_the_command_that_builds_it(tmp_path, monkeypatch):
    missing = str(tmp_path / 'toy_sf')
    monkeypatch.setattr(toy_sf, 'DIR', missing)
    with pytest.raises(SystemExit, match='python -m streaming.toy_sf'):
        family(missing)
