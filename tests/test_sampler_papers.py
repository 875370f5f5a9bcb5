"""sde.step against each method's own step, written here from its paper and not from sde.py's code.

- DanceGRPO (arXiv 2505.07818): the rectified-flow SDE step, noise variance eta^2 d, mean the Euler step plus
  the Ito correction 0.5 Sigma score with score = -(x + (1-s) v) / s.
- Flow-GRPO (arXiv 2505.05470): x_{t+dt} = x_t + [v + sigma_t^2/(2t) (x_t + (1-t) v)] dt + sigma_t sqrt(-dt) eps,
  sigma_t = a sqrt(t/(1-t)), in that form (t = 1 takes 1-t at s_1, Flow-GRPO's and the project's convention).
- CPS, coefficients-preserving sampling (arXiv 2509.05952): x' = (1-s') x0_hat + sqrt(s'^2 - std^2) noise_hat
  + std z, std = s' sin(eta pi/2); the last step (s' = 0) is deterministic.
- SAGE-GRPO (Manifold-Aware Exploration for RL in Video Generation, arXiv 2603.21872): variance = the integral
  of eta^2 u/(1-u) over the step, here by composite Simpson quadrature in float64, not the closed form.

test_step_matches_paper pins, per kind, at steps 0, 1, 5, 10, 15, 19 of sde.sigmas(20, 5.0) and for float32 and
float64 latents: the mean, the std, x_next for a given noise z, and the log-probability (torch.distributions'
Normal, mean over the non-batch elements) of both the sampled x_next and a given one. A failure names the kind,
step and quantity: a wrong mean is a wrong drift (Ito term, x0/noise coefficients), a wrong std a wrong noise
schedule, a wrong logp with the right mean and std a wrong density or reduction.
test_reference_std_table pins docs/method.md section 2.6 (eta 0.5, N 20, shift 5), computed from the references
here, and checks that sde.variance and sde.step give the same figures; a failure of its first assertion means
the table and the papers disagree, of the other two that sde.py and the papers do.
python -m pytest -q tests/test_sampler_papers.py
"""
import math

import pytest
import torch

import sde

ETA = 0.5  # the released noise level; also the table's
N, SHIFT = 20, 5.0  # the reference schedule (docs/method.md section 2.6)
SIGMAS = sde.sigmas(N, SHIFT).tolist()  # (N+1,) float32 values as Python floats, 1 .. 0
S1 = SIGMAS[1]  # Flow-GRPO's sigma_max: stands in for t at t = 1 inside 1 - t
STEPS = (0, 1, 5, 10, 15, 19)  # first step (s = 1) and last step (s' = 0) included
SHAPE = (3, 4, 2, 5, 6)  # (B, C, F, H, W) latents
CLAMP = 1 - 3e-3  # SAGE: u/(1-u) diverges at u = 1; the upper end is clamped here (sde.py's docstring)
QUAD_N = 2**14  # Simpson intervals; error ~1e-16 even on [s_1, CLAMP] where 1/(1-u) reaches 333
TABLE = {  # docs/method.md section 2.6: std at steps 0, 1, 5, 10, 15, 19, to 4 decimals
    'sage': [0.5555, 0.4256, 0.2330, 0.1834, 0.1585, 0.0795],
    'flow': [0.5000, 0.5186, 0.2484, 0.1929, 0.1701, 0.1171],
    'dance': [0.0510, 0.0532, 0.0641, 0.0863, 0.1318, 0.2282],
    'cps': [0.6997, 0.6917, 0.6513, 0.5682, 0.3928, 0.0],
}
ATOL = 2e-5  # sde.step computes in float32, the references in float64: measured error < 4e-7


# ---- the references: each returns (mean (B, ...) float64, std float) from float64 x, v (B, ...) ----

def dance(x, v, s, s_next, eta):
    dt = s_next - s  # < 0
    var = eta**2 * (s - s_next)  # DanceGRPO: eta^2 d per step
    score = -(x + (1 - s) * v) / s  # -E[noise | x] / s
    return x + dt * v + 0.5 * var * score, math.sqrt(var)  # Euler + Ito correction


def flow(x, v, t, t_next, a):
    dt = t_next - t  # < 0
    sigma_t = a * math.sqrt(t / (1 - (S1 if t == 1 else t)))  # gotcha: only in sigma_t's 1-t, not the drift's
    drift = v + sigma_t**2 / (2 * t) * (x + (1 - t) * v)
    return x + drift * dt, sigma_t * math.sqrt(-dt)


def cps(x, v, s, s_next, eta):
    std = s_next * math.sin(eta * math.pi / 2)
    x0_hat, noise_hat = x - s * v, x + (1 - s) * v
    return (1 - s_next) * x0_hat + math.sqrt(s_next**2 - std**2) * noise_hat, std


def simpson(f, a, b, n=QUAD_N):
    u = torch.linspace(a, b, n + 1, dtype=torch.float64)  # (n+1,)
    w = torch.ones(n + 1, dtype=torch.float64)
    w[1:-1:2], w[2:-1:2] = 4, 2  # 1 4 2 4 ... 2 4 1
    return ((b - a) / (3 * n) * (w * f(u)).sum()).item()


def sage(x, v, s, s_next, eta):
    hi, lo = min(s, CLAMP), min(s_next, CLAMP)
    # gotcha: SAGE's formula -d + log((1-s')/(1-min(s, c))) keeps -d over the whole step, so the part of the step
    # above the clamp still counts -1 per unit (the -1 of u/(1-u) = 1/(1-u) - 1). Integrating only up to c instead
    # gives 0.5562 at step 0, not the table's 0.5555. Floored at 0 (a step wholly above the clamp is an ODE step).
    var = max(eta**2 * (simpson(lambda u: u / (1 - u), lo, hi) - ((s - s_next) - (hi - lo))), 0.0)
    score = -(x + (1 - s) * v) / s  # as in dance
    return x + (s_next - s) * v + 0.5 * var * score, math.sqrt(var)  # Euler + Ito correction


REFS = {'dance': dance, 'flow': flow, 'sage': sage, 'cps': cps}


def gaussian_logp(x_next, mean, std):
    # (B,) full density N(x_next; mean, std^2 I) per element, then the mean over the non-batch elements
    return torch.distributions.Normal(mean, std).log_prob(x_next).flatten(1).mean(1)


@pytest.mark.parametrize('dtype', [torch.float32, torch.float64])
@pytest.mark.parametrize('i', STEPS)
@pytest.mark.parametrize('kind', list(REFS))
def test_step_matches_paper(kind, i, dtype):
    s, s_next = SIGMAS[i], SIGMAS[i + 1]
    g = torch.Generator().manual_seed(100 * i + len(kind))
    x, v, z = (torch.randn(SHAPE, generator=g) for _ in range(3))  # (B, ...) float32 each
    x, v = x.to(dtype), v.to(dtype)
    mean, std = REFS[kind](x.double(), v.double(), s, s_next, ETA)  # (B, ...) float64, float
    out = sde.step(x, v, s, s_next, kind, ETA, noise=z)
    assert out.mean.shape == out.x_next.shape == SHAPE and out.std.shape == (SHAPE[0],), kind
    assert out.x_next.dtype == dtype and out.mean.dtype == out.std.dtype == torch.float32
    assert torch.allclose(out.mean.double(), mean, rtol=0, atol=ATOL), (kind, i, 'mean')
    assert torch.allclose(out.std.double(), torch.full((SHAPE[0],), std, dtype=torch.float64),
                          rtol=1e-6, atol=1e-7), (kind, i, 'std', out.std[0].item(), std)
    if std == 0:  # CPS's last step: deterministic, x_next is the mean whatever z is, and no log-prob
        assert kind == 'cps' and i == N - 1
        assert out.logp is None and torch.allclose(out.x_next.double(), mean, rtol=0, atol=ATOL)
        return
    x_next = mean + std * z.double()  # (B, ...) the paper's sample for this z
    assert torch.allclose(out.x_next.double(), x_next, rtol=0, atol=ATOL), (kind, i, 'x_next')
    logp = gaussian_logp(x_next, mean, std)  # (B,)
    assert out.logp.shape == (SHAPE[0],) and out.logp.dtype == torch.float32
    assert torch.allclose(out.logp.double(), logp, rtol=0, atol=ATOL), (kind, i, 'logp', out.logp, logp)
    # training path: score a given x_next (here one drawn off the sample, so the quadratic term matters)
    given = x_next + 0.3 * std * torch.randn(SHAPE, generator=g, dtype=torch.float64)  # (B, ...)
    scored = sde.step(x, v, s, s_next, kind, ETA, x_next=given.to(dtype))
    assert torch.allclose(scored.logp.double(), gaussian_logp(given.to(dtype).double(), mean, std),
                          rtol=0, atol=ATOL), (kind, i, 'scored logp')


@pytest.mark.parametrize('kind', list(REFS))
def test_reference_std_table(kind):
    x = torch.zeros(1, 1, dtype=torch.float64)  # (1, 1): the std does not depend on the latents
    ours = [REFS[kind](x, x, SIGMAS[i], SIGMAS[i + 1], ETA)[1] for i in STEPS]
    # half a unit of the 4th decimal, +1e-6: flow step 5 is 0.248350 (6 d.p.), printed 0.2484
    assert all(abs(a - b) <= 5e-5 + 1e-6 for a, b in zip(ours, TABLE[kind])), (kind, ours)
    theirs = [math.sqrt(sde.variance(kind, SIGMAS[i], SIGMAS[i + 1], ETA)) for i in STEPS]
    steps = [sde.step(x, x, SIGMAS[i], SIGMAS[i + 1], kind, ETA).std.item() for i in STEPS]
    assert all(abs(a - b) <= 1e-7 for a, b in zip(ours, theirs)), (kind, ours, theirs)
    assert all(abs(a - b) <= 1e-6 for a, b in zip(ours, steps)), (kind, ours, steps)
