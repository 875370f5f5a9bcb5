"""
The samplers: one step of the rectified-flow reverse process, deterministic (ODE) or stochastic
(DanceGRPO, FlowGRPO, SAGE-GRPO, CPS), with the log-probability of the transition for GRPO; and the
rollout that takes those steps from noise to data, keeping what training needs (sample).

    x_s = (1 - s) x0 + s noise,  v = noise - x0,  noise_hat = x + (1 - s) v,  score = -noise_hat / s
    dance/flow/sage:  mean = x + dt v + 0.5 Sigma score,      x_next = mean + sqrt(Sigma) z
    cps:              mean = (1-s') x0_hat + sqrt(s'^2 - std^2) noise_hat,   x_next = mean + std z
Both are written below as  mean = x + dt v - c * noise_hat,  with c = 0.5 Sigma / s for the SDEs
and c = s' - sqrt(s'^2 - std^2) for CPS (expand CPS's mean to see it), so c = 0 is the Euler step.

Sigma is the noise variance of one step (docs/method.md section 2):
    dance  eta^2 d            flow  eta^2 s/(1-s) d  (1-s at s=1 taken at s_1)
    sage   eta^2 int_{s'}^{s} u/(1-u) du  (exact, the singularity at u=1 clamped at 1-3e-3)
    cps    std^2 = (s' sin(eta pi/2))^2

Where this differs from the paper and why:
- sage on fine schedules: the paper's formula -d + log((1-s')/(1-min(s, 1-eps))) goes negative for a
  step lying (almost) entirely above the clamp (e.g. the first two steps of a 200-step schedule).
  We floor it at 0, so such a step is an ODE step (no noise, no log-prob, not trained); see
  variance().
- cps: the log-prob is the true Gaussian density (the CPS reference code drops the constants and
  the 1/(2 std^2) factor), the same density as every other kind.
- the mean is always computed in float32 (bf16 latents are upcast); the sample is cast back.
- optional (not in the paper; TVRL's weighted_logprob): log_prob's per-element weight makes the
  reduction a weighted mean sum(w logp)/sum(w) (extras/credit.py); weight=None is the mean, bitwise.
- the last CPS step (s' = 0: std 0, a deterministic step) has no log-probability (logp None) and is
  never trained; reference implementations return a finite value there (their density with its
  std-dependent terms dropped or floored) and train that step too.
- optional (not in the paper; Flow-GRPO-Fast, MixGRPO): window() makes only a window of w
  consecutive steps stochastic (and trained); the rollout takes ODE steps (kind 'ode') everywhere
  else.

Tested by: python -m pytest tests/test_sde.py (the window: tests/test_compute.py)
"""
import math
from typing import NamedTuple

import torch

KINDS = ('ode', 'dance', 'flow', 'sage', 'cps')  # sampler names
TRAINABLE = KINDS[1:]  # the SDEs: an ODE step has no log-probability to train
CHOICES = dict(sampler=TRAINABLE)  # train.py's settings that pick one of these names
# sage: upper end of the noise integral, u/(1-u) diverging at u = 1. Fixed, not a setting: the
# released code's clamp 3e-3, which the paper's figures were made with (docs/method.md 2.2)
SAGE_CLAMP = 1 - 3e-3
LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)  # Gaussian normalising constant per element


def sigmas(num_steps, shift):
    # exactly what HunyuanVideo15Pipeline hands FlowMatchEulerDiscreteScheduler: numpy's linspace in
    # float64 (i * (-1/N) + 1, as numpy computes it), rounded to float32, then shifted in float32
    # (the same correctly rounded float32 operations as numpy's), then a terminal 0 is appended
    u = (torch.arange(num_steps, dtype=torch.float64) * (-1.0 / num_steps) + 1.0).float()  # (N,)
    s = shift * u / (1 + (shift - 1) * u)  # (N,) float32, s[0] == 1.0 exactly
    return torch.cat([s, torch.zeros(1)])  # (N+1,)


def _as_tensor(s):
    # floats become 0-d float64 tensors so every kind is one tensor formula; the caller converts
    # back
    return s if torch.is_tensor(s) else torch.tensor(float(s), dtype=torch.float64)


def variance(kind, s, s_next, eta):
    """Noise variance Sigma of one step s -> s_next; floats in -> float out, tensors -> tensor."""
    if kind not in KINDS:
        raise ValueError(f'unknown sampler kind {kind!r}, expected one of {KINDS}')
    is_float = not torch.is_tensor(s) and not torch.is_tensor(s_next)
    s, s_next = _as_tensor(s), _as_tensor(s_next)
    dtype = torch.promote_types(s.dtype, s_next.dtype)
    s, s_next = s.double(), s_next.double()  # float64 inside: the sage log term cancels against -d
    d = s - s_next  # > 0
    if kind == 'ode':
        var = torch.zeros_like(d)
    elif kind == 'dance':
        var = eta**2 * d
    elif kind == 'flow':
        # FlowGRPO uses s_1 for s = 1 (the first step)
        one_minus = torch.where(s >= 1, 1 - s_next, 1 - s)
        var = eta**2 * s / one_minus * d
    elif kind == 'sage':
        # the paper's formula, with min() on both ends: the log part integrates 1/(1-u) over
        # [s', s] ∩ [0, c] while -d still spans the whole step. For s' <= c this is the paper's
        # formula exactly (and docs/method.md's table); for a step reaching into [c, 1] the log part
        # loses the piece above c, and a step inside [c, 1] would get -eta^2 d < 0. The floor at 0
        # keeps it continuous and makes such a step an ODE step: near u = 1 the noise rate
        # eta^2 u/(1-u) is infinite, any finite choice is arbitrary, and a zero-noise step still
        # preserves the marginals (the ODE does), whereas capping the rate at c would change that
        # table.
        hi, lo = s.clamp(max=SAGE_CLAMP), s_next.clamp(max=SAGE_CLAMP)
        var = (eta**2 * (-d + torch.log1p((hi - lo) / (1 - hi)))).clamp(min=0)  # log((1-lo)/(1-hi))
    else:  # cps
        var = (s_next * math.sin(eta * math.pi / 2)) ** 2
    return var.item() if is_float else var.to(dtype)


def stochastic_steps(kind, sigmas, eta):
    """The indices of the steps of schedule sigmas (N+1,) that have noise: the only ones trained."""
    return [i for i in range(len(sigmas) - 1)
            if variance(kind, float(sigmas[i]), float(sigmas[i + 1]), eta) > 0]


def window(steps, size, seed):
    """The steps that are stochastic, and trained, in a rollout with sde_window=size: `size`
    consecutive entries of `steps` (the schedule's stochastic steps) from a start drawn uniformly
    from seed (train.py: a function of (seed, iteration), shared by every clip and rank, so a
    resumed run draws the same); all of `steps` if size is 0 or covers them. Flow-GRPO-Fast's random
    window, not MixGRPO's sliding one: docs/method.md section 6.3 says why."""
    if not size or size >= len(steps):
        return list(steps)
    gen = torch.Generator().manual_seed(seed % 2 ** 63)
    start = int(torch.randint(len(steps) - size + 1, (), generator=gen))
    return list(steps[start:start + size])


def _correction(kind, s, s_next, var):
    # c in mean = x + dt v - c noise_hat (float64 tensors in, same out); c = 0 exactly when var = 0
    if kind == 'cps':  # = s' - sqrt(s'^2 - std^2) without cancellation; 0 (not 0/0) when std = 0
        root = torch.sqrt((s_next**2 - var).clamp(min=0))
        return torch.where(var > 0, var / (s_next + root).clamp(min=1e-300), 0.0)
    return 0.5 * var / s


class Step(NamedTuple):
    x_next: torch.Tensor  # (B, ...) the next latent x_{s'}: sampled, or the one given; x's dtype
    mean: torch.Tensor  # (B, ...) float32 mean of the transition, differentiable in v
    std: torch.Tensor  # (B,) float32 noise std of the transition (0 for an ODE step)
    logp: torch.Tensor | None  # (B,) float32 mean log-density of x_next, None for an ODE step


def log_prob(x_next, mean, std, weight=None):
    """(B,) float32 log-density of x_next (B, ...) under N(mean, std^2 I), std (B,) > 0: the full
    Gaussian per element, then the mean over all non-batch elements, or with weight (broadcastable
    to x_next, >= 0, detached: extras/credit.py) the weighted mean sum(w logp) / sum(w).
    weight=None is bitwise the mean."""
    sd = std.float().view(x_next.shape[0], *[1] * (x_next.dim() - 1))  # (B, 1, ...)
    logp = -(x_next.float() - mean) ** 2 / (2 * sd**2) - torch.log(sd) - LOG_SQRT_2PI  # (B, ...)
    if weight is None:
        return logp.flatten(1).mean(1)
    w = weight.detach().float().expand_as(logp)  # (B, ...) credit is data, not of the weights
    return (w * logp).flatten(1).sum(1) / w.flatten(1).sum(1)


def step(x, v, s, s_next, kind='sage', eta=0.5, x_next=None, generator=None, noise=None,
         weight=None):
    """One step s -> s_next. x_next=None: sample it (rollout) with z = noise, or drawn from
    generator. x_next given: score it (training). weight: per-element weight of the log-prob (see
    log_prob)."""
    B, ndim = x.shape[0], x.dim()
    s64 = _as_tensor(s).double().to(x.device).expand(B)  # (B,) per-sample sigma
    s_next64 = _as_tensor(s_next).double().to(x.device).expand(B)  # (B,)
    var = variance(kind, s64, s_next64, eta)  # (B,) float64
    c = _correction(kind, s64, s_next64, var)  # (B,)
    bcast = lambda t: t.float().view(B, *[1] * (ndim - 1))  # (B,) -> (B, 1, ...) float32
    # dt rounded once from the exact float64 difference == float32 s' - s, as diffusers computes it
    dt, c_, s_ = bcast(s_next64 - s64), bcast(c), bcast(s64)
    x32, v32 = x.float(), v.float()  # (B, ...) float32: bf16 would lose the small dt * v update
    noise_hat = x32 + (1 - s_) * v32  # (B, ...)
    # Euler first, then the correction: with c = 0 this is bitwise
    # FlowMatchEulerDiscreteScheduler.step
    mean = x32 + dt * v32 - c_ * noise_hat  # (B, ...)
    std = var.sqrt().float()  # (B,)
    stochastic = std > 0  # (B,); the check below is a host sync on GPU (a few bytes)
    if stochastic.any() and not stochastic.all():
        raise ValueError('a batch mixes deterministic (std 0) and stochastic steps')
    if not stochastic.any():  # ODE step: no noise drawn, no log-prob
        return Step(mean.to(x.dtype) if x_next is None else x_next, mean, std, None)
    if x_next is None:  # the sample is data, not a function of the weights: no gradient through it
        # z ~ N(0, I) (B, ...): given, or drawn in float32 whatever x's dtype (one stream per seed)
        z = noise.float() if noise is not None else \
            torch.randn(x.shape, generator=generator, device=x.device, dtype=torch.float32)
        x_next = (mean.detach() + bcast(std) * z).to(x.dtype)
    # full Gaussian log-density per element, float32, averaged (or credit-weighted) over elements
    return Step(x_next, mean, std, log_prob(x_next, mean, std, weight))


def sample(velocity, x, sigmas, kind, eta, generators, keep=False, window=None, boundary=None):
    """The rollout: integrate x (B, ...) from sigmas[0] down to sigmas[-1] with step() of this kind
    (at the steps in `window` only, if given: ODE steps elsewhere). velocity(x, s) -> v, s (B,)
    the sigmas; generators: one per sample, its own noise stream, so a clip's rollout does not
    depend on how clips are batched. Returns the final latents and, if keep, what training needs of
    every step: xs (B, N+1, ...), means (B, N, ...), logps (B, N), stds (B, N) (an ODE step: std 0,
    logp 0; it has no log-probability and is never trained). boundary(): before each forward."""
    B, N = x.shape[0], len(sigmas) - 1
    xs, means, logps, stds = [x], [], [], []
    for i in range(N):
        if boundary is not None:
            boundary()
        v = velocity(x, sigmas[i].expand(B).to(x.device))
        # z (B, ...) drawn even for an ODE step: every clip's stream stays aligned with its steps
        z = torch.stack([torch.randn(x.shape[1:], generator=g) for g in generators]).to(x.device)
        st = step(x, v, sigmas[i].item(), sigmas[i + 1].item(), noise=z,
                  kind=kind if window is None or i in window else 'ode', eta=eta)
        x = st.x_next
        if keep:
            xs.append(x)
            means.append(st.mean)
            logps.append(st.logp if st.logp is not None else x.new_zeros(B))
            stds.append(st.std)
    if not keep:
        return x, None
    return x, dict(xs=torch.stack(xs, 1), means=torch.stack(means, 1), logps=torch.stack(logps, 1),
                   stds=torch.stack(stds, 1))
