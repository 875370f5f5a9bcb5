"""The gradient equalizer against docs/method.md's figures and autograd. python -m pytest tests/test_equalizer.py"""
import pytest
import torch

import equalizer
import sde

STOCHASTIC = ('dance', 'flow', 'sage', 'cps')


def test_paper_table():
    # docs/method.md section 3.3, sage at eta 0.5, 20 steps, shift 5, steps 0, 1, 5, 10, 15, 19
    sig, idx = sde.sigmas(20, 5.0), [0, 1, 5, 10, 15, 19]
    n, S = equalizer.proxy('sage', sig, 0.5), equalizer.scales('sage', sig, 0.5)
    assert n.shape == S.shape == (20,) and S.dtype == torch.float32
    assert torch.allclose(n[idx], torch.tensor([0.0188, 0.0288, 0.0784, 0.1806, 0.4858, 2.7716]), atol=5e-5)
    assert torch.allclose(S[idx], torch.tensor([8.89, 5.78, 2.13, 0.92, 0.34, 0.060]), atol=5e-3)
    # 20 stochastic steps, an even count: the median is the mean of the middle two, 0.1667
    middle = n.sort().values[9:11]
    assert abs(middle.mean().item() - 0.1667) < 5e-5 and abs(middle[0].item() - 0.1667) > 0.01
    assert abs((S * n).median().item() - 0.1667) < 5e-5  # S_t N_t = median for every step


def test_deterministic_steps_get_scale_one():
    sig = sde.sigmas(20, 5.0)
    S, n = equalizer.scales('cps', sig, 0.5), equalizer.proxy('cps', sig, 0.5)
    assert S[-1] == 1.0 and n[-1] == 0.0 and torch.isfinite(n).all()  # cps: std 0 on the last step
    assert torch.equal(equalizer.scales('ode', sig, 0.5), torch.ones(20))
    assert torch.equal(equalizer.scales('sage', sig, 0.0), torch.ones(20))  # eta 0
    fine = sde.sigmas(200, 5.0)  # sage's first two steps lie above its clamp: ODE steps
    S, n = equalizer.scales('sage', fine, 0.5), equalizer.proxy('sage', fine, 0.5)
    assert S[:2].tolist() == [1.0, 1.0] and n[:2].tolist() == [0.0, 0.0] and (n[2:] > 0).all()
    assert torch.isfinite(S).all()


@pytest.mark.parametrize('kind', STOCHASTIC)
def test_sensitivity_is_dmean_dv(kind):
    # lambda_t from docs/method.md's formulas vs the Jacobian of sde.step's mean (diagonal, the same everywhere)
    sig = sde.sigmas(20, 5.0)
    for i in (0, 3, 10, 18):
        x, v = torch.randn(1, 5), torch.randn(1, 5, requires_grad=True)
        mean = sde.step(x, v, sig[i], sig[i + 1], kind, 0.7, x_next=x).mean
        (grad,) = torch.autograd.grad(mean.sum(), v)
        lam = equalizer.sensitivity(kind, sig[i].item(), sig[i + 1].item(), 0.7)
        assert isinstance(lam, float) and torch.allclose(grad, torch.full_like(grad, lam), rtol=1e-5)


@pytest.mark.parametrize('kind', STOCHASTIC)
def test_scales_equalize_gradient_norms(kind):
    # the paper's Fig. 3/4 in miniature: ||d logp / d v|| at a sampled x_next tracks N_t, and after
    # multiplying by S_t every trained step has about the same gradient norm
    sig, g = sde.sigmas(20, 5.0), torch.Generator().manual_seed(0)
    n, S = equalizer.proxy(kind, sig, 0.5), equalizer.scales(kind, sig, 0.5)
    raw, equalized = [], []
    for i in torch.nonzero(n).flatten().tolist():  # the stochastic (trained) steps
        x, v = torch.randn(1, 4096, generator=g), torch.randn(1, 4096, generator=g).requires_grad_()
        out = sde.step(x, v, sig[i], sig[i + 1], kind, 0.5, generator=g)
        (grad,) = torch.autograd.grad(out.logp.sum(), v)  # = lambda z / std / 4096, z ~ N(0, I)
        raw.append(grad.norm().item() * 64)  # ||z|| ~ 64: expect N_t (1.1% noise)
        equalized.append(S[i].item() * raw[-1])
        assert abs(raw[-1] / n[i].item() - 1) < 0.05, (i, raw[-1], n[i])
    assert max(raw) / min(raw) > 5  # without the scale, steps differ a lot (sage: ~150x)
    assert max(equalized) / min(equalized) < 1.1  # with it, all within 10%


@pytest.mark.parametrize('kind', STOCHASTIC)
@pytest.mark.parametrize('steps', (20, 9))
def test_median_settings_match_numpy_and_torch_median(kind, steps):
    # 'mean_of_middle' is numpy's median, 'lower' torch.median's (the released code); independent
    # references on the proxies of the stochastic steps. An odd count (steps 9) gives the same for both
    import numpy as np
    sig = sde.sigmas(steps, 5.0)
    n = equalizer.proxy(kind, sig, 0.5).double()
    live = n > 0
    for median, ref in (('mean_of_middle', float(np.median(n[live].numpy()))), ('lower', n[live].median().item())):
        S = equalizer.scales(kind, sig, 0.5, median).double()
        assert torch.allclose(S[live] * n[live], torch.full_like(n[live], ref), rtol=1e-6), median
    a, b = equalizer.scales(kind, sig, 0.5), equalizer.scales(kind, sig, 0.5, 'lower')
    if int(live.sum()) % 2:
        assert torch.equal(a, b)
    elif kind == 'sage' and steps == 20:  # docs/method.md section 6.2.4: the released S_t is 0.917x the project's
        assert abs((b[live] / a[live]).mean().item() - 0.1528 / 0.1667) < 2e-3
    with pytest.raises(ValueError):
        equalizer.scales(kind, sig, 0.5, 'upper')


@pytest.mark.parametrize('kind', ['dance', 'flow', 'sage', 'cps'])
def test_sensitivity_is_the_step_means_derivative_by_autograd(kind):
    # lambda_t = d mean / d v, derived in equalizer.py from sde.correction alone, against autograd
    # through sde.step's own mean at every step of a schedule (an independent route to the same number)
    import sde
    sig = sde.sigmas(10, 3.0)
    for i in range(10):
        s, s_next = float(sig[i]), float(sig[i + 1])
        if sde.variance(kind, s, s_next, 0.7) <= 0:
            continue
        v = torch.zeros(1, 4, dtype=torch.float64, requires_grad=True)
        x = torch.randn(1, 4, dtype=torch.float64)
        mean = sde.step(x, v, s, s_next, kind, 0.7, x_next=x.float()).mean
        g, = torch.autograd.grad(mean.sum(), v)  # the same on every element: d mean_j / d v_j
        assert g[0, 0].item() == pytest.approx(equalizer.sensitivity(kind, s, s_next, 0.7), rel=1e-5, abs=1e-7)


def test_an_unknown_sampler_raises_everywhere():
    import sde
    for fn in (lambda: sde.variance('euler_a', 0.5, 0.4, 0.7), lambda: equalizer.sensitivity('euler_a', 0.5, 0.4, 0.7),
               lambda: sde.correction('euler_a', torch.tensor(0.5), torch.tensor(0.4), torch.tensor(0.01))):
        with pytest.raises(ValueError):
            fn()
