"""
The temporal gradient equalizer of SAGE-GRPO (docs/method.md section 3).

The gradient of a step's log-prob reaches the network through the mean only:
    d logp / d v = lambda_t (x_next - mean) / std_t^2 / numel,   lambda_t = d mean / d v
and x_next - mean = std_t z, so its size scales like N_t = |lambda_t| / std_t. Late steps (small
std, small s) get gradients ~150x larger than early ones. The policy term of step t (not its KL
terms, already in units of the step's std) is multiplied by
    S_t = median(N over the iteration's stochastic steps) / N_t
so every trained step contributes a gradient of about the same size. For sage the largest S_t is
the first step's (8.89 on the reference schedule), whose std comes from sde.py's clamp, not from the
integral, which diverges there (docs/method.md 2.2).

Deterministic steps (std 0: ode, eta 0, the last cps step, sage steps above its clamp) are never
trained: their proxy is a placeholder 0 (not inf) and their scale is 1.

With an SDE window (sde.window) only the window's steps are trained: the median is over those
(`steps`), and every other step has scale 1.

Where this differs from the released code: the median of an even number of steps is numpy's (the
mean of the two middle values, docs/method.md's 0.1667); median='lower' gives the released
torch.median.

Tested by: python -m pytest tests/test_equalizer.py (over a window: tests/test_compute.py)
"""

import torch

import sde


def sensitivity(kind, s, s_next, eta):
    """lambda_t = d mean / d v for one step s -> s_next (floats or tensors, like sde.variance): the
    mean is x + dt v - c noise_hat with noise_hat = x + (1 - s) v (sde.py), so for every sampler
    lambda_t = dt - c (1 - s), c its sde.correction."""
    s64, s_next64 = sde._as_tensor(s).double(), sde._as_tensor(s_next).double()
    var = sde.variance(kind, s64, s_next64, eta)  # Sigma, = std^2
    lam = (s_next64 - s64) - sde.correction(kind, s64, s_next64, var) * (1 - s64)  # dt < 0
    return lam.item() if not torch.is_tensor(s) and not torch.is_tensor(s_next) else lam


def proxy(kind, sigmas, eta):
    """N_t = |lambda_t| / std_t for every step of the schedule; 0 for deterministic steps."""
    s, s_next = sigmas[:-1].double(), sigmas[1:].double()  # (T,) each
    std = sde.variance(kind, s, s_next, eta).sqrt()  # (T,)
    lam = sensitivity(kind, s, s_next, eta)  # (T,)
    stochastic = (std > 0) & (s > 0)
    return torch.where(stochastic, lam.abs() / torch.where(stochastic, std, 1.0), 0.0).float()


# the median of an even count: numpy's (docs/method.md 3.3) | torch.median's (the released one)
MEDIANS = ('mean_of_middle', 'lower')
CHOICES = dict(median=MEDIANS)  # train.py's setting that picks one of these names


def scales(kind, sigmas, eta, median='mean_of_middle', steps=None):
    """S_t = median(N) / N_t over the stochastic steps (those of `steps` only, if given: the steps
    trained), 1.0 for the others; (T,) float32."""
    if median not in MEDIANS:
        raise ValueError(f'median must be one of {MEDIANS}, got {median!r}')
    sigmas = sigmas.cpu()  # (T + 1,) a schedule is small: S_t is computed on the CPU
    s, s_next = sigmas[:-1].double(), sigmas[1:].double()  # (T,)
    n = proxy(kind, sigmas, eta).double()  # (T,)
    stochastic = (sde.variance(kind, s, s_next, eta) > 0) & (s > 0)
    if steps is not None:  # an SDE window: the other steps are ODE steps in the rollout
        trained = torch.zeros(len(s), dtype=torch.bool)
        trained[list(steps)] = True
        stochastic &= trained
    if not stochastic.any():  # an all-ODE schedule: nothing is trained
        return torch.ones(len(s))
    # for an even count 'mean_of_middle' is the mean of the two middle values (numpy's median): that
    # reproduces the 0.1667 of docs/method.md section 3.3 for 20 sage steps; 'lower' is
    # torch.median's lower middle value, 0.1528, which the released code uses (every S_t is then
    # 0.917x smaller; an odd count gives the same)
    lower = n[stochastic].sort().values[(int(stochastic.sum()) - 1) // 2]
    med = torch.quantile(n[stochastic], 0.5) if median == 'mean_of_middle' else lower
    return torch.where(stochastic, med / torch.where(stochastic, n, 1.0), 1.0).float()
