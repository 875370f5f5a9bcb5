"""Samplers against independent references: diffusers' scheduler, a quadrature, docs/method.md's table,
torch.distributions, and the exact marginals of Gaussian data. python -m pytest tests/test_sde.py"""
import math

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

import equalizer
import sde

STOCHASTIC = ('dance', 'flow', 'sage', 'cps')
C = 0.5  # std of the toy data x0 ~ N(0, C^2 I) in the marginal tests


def scheduler(num_steps, shift):
    # what HunyuanVideo15Pipeline does: linear sigmas without the 0, shifted by the scheduler
    sch = FlowMatchEulerDiscreteScheduler(shift=shift)
    sch.set_timesteps(sigmas=np.linspace(1.0, 0.0, num_steps + 1)[:-1])
    return sch


@pytest.mark.parametrize('num_steps,shift', [(20, 5.0), (50, 9.0), (7, 1.0), (200, 5.0)])
def test_sigmas_match_diffusers(num_steps, shift):
    s = sde.sigmas(num_steps, shift)
    assert s.dtype == torch.float32 and len(s) == num_steps + 1
    assert s[0].item() == 1.0 and s[-1].item() == 0.0
    assert torch.equal(s, scheduler(num_steps, shift).sigmas)


def test_ode_is_the_euler_scheduler_step():
    sch, s = scheduler(20, 5.0), sde.sigmas(20, 5.0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 3, 5, 6, generator=g)  # (B, C, F, H, W)
    for i, t in enumerate(sch.timesteps):
        v = torch.randn(x.shape, generator=g)
        ref = sch.step(v, t, x).prev_sample
        out = sde.step(x, v, s[i].item(), s[i + 1].item(), 'ode')
        assert torch.equal(out.x_next, ref) and out.logp is None
        assert torch.equal(sde.step(x, v, s[i], s[i + 1], 'sage', eta=0.0).x_next, ref)  # eta 0
        assert torch.equal(sde.step(x, v, s[i].expand(2), s[i + 1].expand(2), 'cps', 0.0).x_next, ref)
        x = ref


def simpson(f, a, b, n=2**16):
    u = torch.linspace(a, b, n + 1, dtype=torch.float64)
    w = torch.ones(n + 1, dtype=torch.float64)
    w[1:-1:2], w[2:-1:2] = 4, 2
    return ((b - a) / (3 * n) * (w * f(u)).sum()).item()


def test_sage_is_the_exact_integral():
    g, eta = torch.Generator().manual_seed(1), 0.7
    for _ in range(50):
        s_next, s = sorted(torch.rand(2, generator=g, dtype=torch.float64).mul(sde.SAGE_CLAMP).tolist())
        ref = simpson(lambda u: eta**2 * u / (1 - u), s_next, s)
        assert abs(sde.variance('sage', s, s_next, eta) / ref - 1) < 1e-6
        assert sde.variance('sage', s, s_next, eta) <= sde.variance('flow', s, s_next, eta)  # excess noise


def test_sage_below_flow_on_the_default_schedule():
    s = sde.sigmas(20, 5.0).double()
    for i in range(20):
        if s[i] <= sde.SAGE_CLAMP:
            assert sde.variance('sage', s[i], s[i + 1], 0.5) <= sde.variance('flow', s[i], s[i + 1], 0.5)


def test_sage_clamp_on_fine_schedules():
    for n, shift in [(200, 5.0), (1000, 9.0)]:
        s = sde.sigmas(n, shift)
        var = sde.variance('sage', s[:-1], s[1:], 0.5)  # (n,)
        assert torch.isfinite(var).all() and (var >= 0).all()
        assert var[0] == 0  # a step inside [1 - 3e-3, 1] is an ODE step
        x = torch.randn(1, 8)
        assert sde.step(x, x, s[0], s[1], 'sage').logp is None
    # continuous across the clamp: s = 1, s_next swept through 1 - 3e-3 in steps of 1e-7
    s_next = torch.linspace(sde.SAGE_CLAMP - 1e-4, sde.SAGE_CLAMP + 1e-4, 2001, dtype=torch.float64)
    var = sde.variance('sage', torch.ones_like(s_next), s_next, 0.5)
    assert (var >= 0).all() and var.diff().abs().max() < 1e-4


# docs/method.md section 2.6: per-step std at eta 0.5, 20 steps, shift 5, at steps 0, 1, 5, 10, 15, 19
REFERENCE_STD = {
    'sage': [0.5555, 0.4256, 0.2330, 0.1834, 0.1585, 0.0795],
    'flow': [0.5000, 0.5186, 0.2484, 0.1929, 0.1701, 0.1171],
    'dance': [0.0510, 0.0532, 0.0641, 0.0863, 0.1318, 0.2282],
    'cps': [0.6997, 0.6917, 0.6513, 0.5682, 0.3928, 0.0],
}


@pytest.mark.parametrize('kind', STOCHASTIC)
def test_paper_std_table(kind):
    s = sde.sigmas(20, 5.0)
    std = [math.sqrt(sde.variance(kind, s[i].item(), s[i + 1].item(), 0.5)) for i in (0, 1, 5, 10, 15, 19)]
    # half a unit of the 4th decimal, +1e-6: flow step 5 is 0.248350 (6 d.p.), printed 0.2484
    assert np.allclose(std, REFERENCE_STD[kind], rtol=0, atol=5e-5 + 1e-6), (kind, std)


def test_variance_input_types():
    s = sde.sigmas(20, 5.0)
    f = sde.variance('sage', s[3].item(), s[4].item(), 0.5)
    assert isinstance(f, float)
    t0 = sde.variance('sage', s[3], s[4], 0.5)
    tb = sde.variance('sage', s[[3, 3]], s[[4, 4]], 0.5)
    assert t0.shape == () and tb.shape == (2,) and tb.dtype == torch.float32
    assert abs(t0.item() - f) < 1e-7 and torch.allclose(tb, t0.expand(2))
    with pytest.raises(ValueError):
        sde.variance('euler', 0.5, 0.4, 0.5)


def paper_mean(kind, x, v, s, s_next, std):
    # docs/method.md section 2 written out, independently of sde.step's single form
    x0_hat, noise_hat = x - s * v, x + (1 - s) * v
    if kind == 'cps':
        return (1 - s_next) * x0_hat + (s_next**2 - std**2).sqrt() * noise_hat
    return x + (s_next - s) * v + 0.5 * std**2 * (-noise_hat / s)


@pytest.mark.parametrize('kind', STOCHASTIC)
def test_logp_is_the_gaussian_density(kind):
    g = torch.Generator().manual_seed(2)
    sig = sde.sigmas(20, 5.0)
    idx = torch.tensor([0, 7, 18])  # per-sample steps, all stochastic for every kind
    s, s_next = sig[idx], sig[idx + 1]  # (B,)
    x, v = torch.randn(3, 2, 3, 4, generator=g), torch.randn(3, 2, 3, 4, generator=g)  # (B, ...)
    out = sde.step(x, v, s, s_next, kind, 0.5, generator=g)
    b = lambda t: t.view(3, 1, 1, 1)  # (B,) -> (B, 1, 1, 1)
    std = sde.variance(kind, s, s_next, 0.5).sqrt()
    assert out.std.shape == (3,) and torch.allclose(out.std, std)
    assert torch.allclose(out.mean, paper_mean(kind, x, v, b(s), b(s_next), b(std)), atol=1e-6)
    ref = torch.distributions.Normal(out.mean, b(out.std)).log_prob(out.x_next).flatten(1).mean(1)
    assert out.logp.dtype == torch.float32 and torch.allclose(out.logp, ref, atol=1e-5)
    # training: score the stored sample under v; d logp / d v = lambda (x_next - mean) / std^2 / numel
    v = v.clone().requires_grad_()
    again = sde.step(x, v, s, s_next, kind, 0.5, x_next=out.x_next)
    assert torch.allclose(again.logp, out.logp)
    again.logp.sum().backward()
    lam = equalizer.sensitivity(kind, s.double(), s_next.double(), 0.5).float()  # (B,)
    grad = b(lam) * (out.x_next - again.mean.detach()) / b(std) ** 2 / x[0].numel()
    assert torch.allclose(v.grad, grad, rtol=1e-4, atol=1e-7)


def test_dtypes_determinism_and_errors():
    s = sde.sigmas(20, 5.0)
    x = torch.randn(2, 4, 8).bfloat16()
    out = sde.step(x, x, s[3], s[4], 'sage', generator=torch.Generator().manual_seed(3))
    assert out.x_next.dtype == torch.bfloat16 and out.mean.dtype == torch.float32
    assert out.logp.dtype == torch.float32 and out.std.dtype == torch.float32 and out.std.shape == (2,)
    again = sde.step(x, x, s[3], s[4], 'sage', generator=torch.Generator().manual_seed(3))
    assert torch.equal(out.x_next, again.x_next)
    z = torch.randn(2, 4, 8)  # a caller's own noise
    given = sde.step(x.float(), x.float(), s[3], s[4], 'sage', noise=z)
    assert torch.allclose(given.x_next, given.mean + given.std.view(2, 1, 1) * z)
    assert sde.step(x, x, s[19], s[20], 'cps').logp is None  # CPS's last step: std 0
    with pytest.raises(ValueError):  # one sample on the last cps step, one not
        sde.step(x, x, s[[18, 19]], s[[19, 20]], 'cps')


# ---- marginals: data x0 ~ N(0, C^2), so x_s ~ N(0, V(s)) and everything is linear in x ----

def V(s):
    return (1 - s) ** 2 * C**2 + s**2  # Var(x_s) = (1-s)^2 C^2 + s^2


def velocity(x, s):
    # E[noise - x0 | x_s] = (Cov(noise, x_s) - Cov(x0, x_s)) / V x_s = (s - (1-s) C^2) / V x_s
    return (s - (1 - s) * C**2) / V(s) * x


def exact_log_ratios(kind, num_steps, eta, shift=5.0):
    # propagate Var exactly: x' = a x + std z  =>  Var' = a^2 Var + std^2, with a read off the mean
    s, var, out = sde.sigmas(num_steps, shift).tolist(), 1.0, []
    for i in range(num_steps):
        x = torch.ones(1, 1, dtype=torch.float64)
        assert abs(-(x + (1 - s[i]) * velocity(x, s[i])).item() / s[i] + 1 / V(s[i])) < 1e-12  # score
        st = sde.step(x, velocity(x, s[i]), s[i], s[i + 1], kind, eta, x_next=x)
        var = st.mean.item() ** 2 * var + st.std.item() ** 2
        out.append(math.log(var / V(s[i + 1])))
    return out


def test_marginals_1000_steps():
    n, eta, s = 100_000, 0.5, sde.sigmas(1000, 5.0).tolist()
    exact = {k: exact_log_ratios(k, 1000, eta) for k in STOCHASTIC}
    for kind in STOCHASTIC:  # Monte Carlo through the real sampling path agrees with the recursion
        g = torch.Generator().manual_seed(4)
        x = torch.randn(1, n, generator=g, dtype=torch.float64)
        x = x / x.std()  # start from exactly unit sample variance: only the sampler's noise is left
        for i in range(1000):
            x = sde.step(x, velocity(x, s[i]), s[i], s[i + 1], kind, eta, generator=g).x_next
            if i % 50 == 49 or i == 999:  # 4.5 standard errors of a sample variance, sqrt(2/n)
                mc = math.log(x.var().item() / V(s[i + 1]))
                assert abs(mc - exact[kind][i]) < 4.5 * math.sqrt(2 / n)
    worst = {k: max(map(abs, r)) for k, r in exact.items()}
    print('1000 steps, worst |log Var ratio|:', {k: round(w, 4) for k, w in worst.items()})
    # dance and sage converge: within 1% of the true marginal at every step
    assert worst['dance'] < 0.01 and worst['sage'] < 0.01
    # flow does not: its first step has Sigma = eta^2 whatever N is (1 - s at s = 1 is taken at
    # s_1, so s/(1-s) d = 1), an O(1) excess of noise at the start that only slowly decays
    assert 0.02 < worst['flow'] < 0.04 and max(range(1000), key=lambda i: exact['flow'][i]) < 10
    # cps does not either: with a posterior-mean denoiser each step loses Var by
    # A B (1 - cos)^2 / V (A = (1-s)^2 C^2, B = s^2), independent of the step size
    assert exact['cps'][-1] < -0.1


def test_marginal_drift_20_steps():
    kinds = ('dance', 'flow', 'sage', 'ode', 'cps')
    for eta in (0.5, 0.7, 1.0):
        ratios = {k: exact_log_ratios(k, 20, eta) for k in kinds}
        worst = {k: max(map(abs, r)) for k, r in ratios.items()}
        excess = {k: max(r) for k, r in ratios.items()}
        print(f'eta {eta}: worst |log Var ratio|', {k: round(w, 3) for k, w in worst.items()},
              'max excess', {k: round(e, 3) for k, e in excess.items()})
        # observed at every eta: dance < flow < sage < ode < cps. With 20 steps the largest drift is
        # the variance *deficit* of the last big steps (the Euler step lands on the posterior mean,
        # shrunk toward 0: under-dispersed, a blur), which the ODE shows alone. Fresh noise late in
        # the trajectory re-inflates it: dance, whose noise eta^2 d peaks at the end, drifts least;
        # sage injects less than flow (no rectangle-rule excess) so it sits between flow and ode;
        # cps's O(1) re-noising with a shrunk noise_hat loses variance every step and drifts most.
        # Early on flow and sage are over-dispersed (max excess > 0: the off-manifold side).
        assert sorted(kinds, key=worst.get) == list(kinds), worst
        assert excess['flow'] > 0.01 and excess['sage'] > 0.01 and excess['ode'] < 1e-6
