"""
The samplers: one step of the rectified-flow reverse process, deterministic (ODE) or stochastic
(DanceGRPO, FlowGRPO, SAGE-GRPO, CPS), with the log-probability of the transition for GRPO, and the
loop that takes these steps from noise to data (rollout: train.py's rollouts, the ODE evaluation).

    x_s = (1 - s) x0 + s noise,  v = noise - x0,  noise_hat = x + (1 - s) v,  score = -noise_hat / s
    dance/flow/sage:  mean = x + dt v + 0.5 Sigma score,      x_next = mean + sqrt(Sigma) z
    cps:              mean = (1-s') x0_hat + sqrt(s'^2 - std^2) noise_hat,   x_next = mean + std z
Both are written below as  mean = x + dt v - c * noise_hat,  with c = 0.5 Sigma / s for the SDEs
and c = s' - sqrt(s'^2 - std^2) for CPS (expand CPS's mean to see it), so c = 0 is the Euler step.
A new sampler is its name in KINDS, its Sigma in variance() and its c in correction(), here
(an unknown name raises in both; equalizer.py derives d mean / d v = dt - c (1 - s) from c).

Sigma is the noise variance of one step (docs/method.md section 2):
    dance  eta^2 d            flow  eta^2 s/(1-s) d  (1-s at s=1 taken at s_1)
    sage   eta^2 int_{s'}^{s} u/(1-u) du, exact on every step but the first: that one starts at
           u = 1, where the integral diverges, so its Sigma is set by clamping both ends at 1-3e-3
           (std 0.56 on the reference schedule; 0.76 with 1e-3): the step with the largest S_t
    cps    std^2 = (s' sin(eta pi/2))^2

Where this differs from the paper (each argued once in docs/method.md 6.2):
- sage on fine schedules: a step lying (almost) wholly above the clamp would get a negative Sigma;
  it is floored at 0, an ODE step: no noise, no log-prob, not trained (6.2.9).
- cps: the true Gaussian density, as for every kind (the reference drops its constants and the
  1/(2 std^2) factor); its last step (std 0) has no log-probability and is never trained (6.2.8).
- the mean is always computed in float32 (bf16 latents are upcast); the sample is cast back.
- optional, not in the paper: log_prob's per-element weight (TVRL's weighted_logprob,
  extras/credit.py; weight=None is the mean, bitwise); window(): only w consecutive steps are
  stochastic and trained, ODE steps elsewhere (Flow-GRPO-Fast, 6.3).

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
        # the paper's formula, both ends clamped at c inside the log (d stays the step's own): for
        # s <= c exactly the paper's; a step reaching above c loses the piece above it; one wholly
        # above c would get -eta^2 d < 0, floored at 0 (an ODE step: docs/method.md 2.2)
        hi, lo = s.clamp(max=SAGE_CLAMP), s_next.clamp(max=SAGE_CLAMP)
        var = (eta**2 * (-d + torch.log1p((hi - lo) / (1 - hi)))).clamp(min=0)  # log((1-lo)/(1-hi))
    elif kind == 'cps':
        var = (s_next * math.sin(eta * math.pi / 2)) ** 2
    else:  # a name in KINDS without its variance here
        raise ValueError(f'sampler kind {kind!r} has no variance in sde.variance')
    return var.item() if is_float else var.to(dtype)


def stochastic_steps(kind, sigmas, eta):
    """The indices of the steps of schedule sigmas (N+1,) that have noise: the only ones trained."""
    return [i for i in range(len(sigmas) - 1)
            if variance(kind, float(sigmas[i]), float(sigmas[i + 1]), eta) > 0]


def window(steps, size, seed):
    """The stochastic, trained steps of a rollout with sde_window=size: `size` consecutive ones of
    `steps` (the schedule's stochastic ones) from a start drawn uniformly from seed (train.py: one a
    run and iteration); all of `steps` if size is 0 or covers them (docs/method.md section 6.3)."""
    if not size or size >= len(steps):
        return list(steps)
    gen = torch.Generator().manual_seed(seed % 2 ** 63)
    start = int(torch.randint(len(steps) - size + 1, (), generator=gen))
    return list(steps[start:start + size])


def correction(kind, s, s_next, var):
    # c in mean = x + dt v - c noise_hat (float64 tensors in, same out); c = 0 exactly when var = 0
    if kind == 'cps':  # = s' - sqrt(s'^2 - std^2) without cancellation; 0 (not 0/0) when std = 0
        root = torch.sqrt((s_next**2 - var).clamp(min=0))
        return torch.where(var > 0, var / (s_next + root).clamp(min=1e-300), 0.0)
    if kind in ('ode', 'dance', 'flow', 'sage'):  # Ito's 0.5 Sigma score, score = -noise_hat / s
        return 0.5 * var / s
    raise ValueError(f'sampler kind {kind!r} has no correction in sde.correction')


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
    generator. x_next given: score it (training). weight: of the log-prob's elements (log_prob)."""
    B, ndim = x.shape[0], x.dim()
    s64 = _as_tensor(s).double().to(x.device).expand(B)  # (B,) per-sample sigma
    s_next64 = _as_tensor(s_next).double().to(x.device).expand(B)  # (B,)
    var = variance(kind, s64, s_next64, eta)  # (B,) float64
    c = correction(kind, s64, s_next64, var)  # (B,)
    bcast = lambda t: t.float().view(B, *[1] * (ndim - 1))  # (B,) -> (B, 1, ...) float32
    # dt rounded once from the exact float64 difference == float32 s' - s, as diffusers computes it
    dt, c_, s_ = bcast(s_next64 - s64), bcast(c), bcast(s64)
    x32, v32 = x.float(), v.float()  # (B, ...) float32: bf16 would lose the small dt * v update
    noise_hat = x32 + (1 - s_) * v32  # (B, ...)
    # Euler first, then the correction: at c = 0 bitwise FlowMatchEulerDiscreteScheduler.step
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


RECORDS = ('xs', 'means', 'logps', 'stds')  # what rollout() can keep of every step


@torch.no_grad()
def rollout(velocity, x, sigmas, kind, eta, gens, steps=None, keep=(), boundary=None):
    """The sampling loop: x (B, C, F, h, w) from sigmas[0] down to sigmas[-1], one step() a sigma
    interval, v = velocity(x, s) at the samples' sigmas s (B,); the step is of `kind` at the indices
    in `steps` (every one if None), an ODE (Euler) step elsewhere. gens: one generator a sample, its
    own noise stream, drawn at every step (ODE ones too) so a clip's rollout does not depend on how
    clips are batched or which steps are stochastic. boundary(): before each forward (preemption).
    Returns the final latents and {name: every step's} of the RECORDS in keep (None if none): xs
    (B, N+1, ...) the latents, means (B, N, ...) float32, logps (B, N) (0 at an ODE step: it has no
    log-probability and is never trained), stds (B, N)."""
    if set(keep or ()) - set(RECORDS):
        raise ValueError(f'keep={keep!r}: rollout() keeps only {RECORDS}')
    B, N = x.shape[0], len(sigmas) - 1
    kept = {k: [x] if k == 'xs' else [] for k in keep or ()}
    for i in range(N):
        if boundary is not None:
            boundary()
        v = velocity(x, sigmas[i].expand(B).to(x.device))  # (B, C, F, h, w)
        z = torch.stack([torch.randn(x.shape[1:], generator=g) for g in gens]).to(x.device)
        st = step(x, v, sigmas[i].item(), sigmas[i + 1].item(), noise=z,
                  kind=kind if steps is None or i in steps else 'ode', eta=eta)
        x = st.x_next
        logp = st.logp if st.logp is not None else x.new_zeros(B)  # (B,) 0 at an ODE step
        now = dict(xs=x, means=st.mean, stds=st.std, logps=logp)
        for k in kept:
            kept[k].append(now[k])
    return x, {k: torch.stack(v, 1) for k, v in kept.items()} if kept else None
