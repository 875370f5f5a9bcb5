"""
The GRPO objective of SAGE-GRPO for one trained step of a few clips (SPEC section 4), as the math:

    ratio  = exp(logp_theta - logp_old)                                  the PPO ratio
    policy = S_t * max(-A * ratio, -A * clip(ratio, 1 - eps, 1 + eps))   pessimistic clip, equalized
    kl     = beta_pos * KL(mean_theta, mean_anchor) + beta_vel * KL(mean_theta, mean_old)
    loss   = sum over the clips of valid * (policy + lambda_KL * kl) / denom

S_t (equalizer.py) scales the policy term only: the KL terms are already measured in units of the
step's own std. A clip whose reward is NaN has valid = 0, and its whole loss (policy and KL) is
dropped, not just its advantage. `denominator` makes the sum of these losses over every
micro-batch, trained step and rank the mean over valid clips x trained steps.

Where this differs from the paper and why:
- the velocity term is the exact Gaussian KL of the two means; the released code uses the sample
  estimate 0.1 * mean(logp_old - logp_theta), whose expectation is the same KL at first order but
  whose per-sample gradient is noise. At one optimizer step per rollout batch both are 0.

Tested by: python -m pytest tests/test_loss.py   (against a plain-Python reference of the above)
"""
from typing import NamedTuple

import torch

from trust_region import gaussian_kl


class Terms(NamedTuple):
    policy: torch.Tensor  # (n,) S_t-scaled clipped policy loss, per clip, before the valid mask
    kl_pos: torch.Tensor  # (n,) KL(mean_theta || mean_anchor), 0 without an anchor
    kl_vel: torch.Tensor  # (n,) KL(mean_theta || mean_old), 0 without the velocity term
    ratio: torch.Tensor  # (n,) exp(logp_theta - logp_old)


def grpo_loss(logp, logp_old, adv, mean, mean_anchor, mean_old, std, *, scale, lam, beta_pos, beta_vel,
              clip_range, valid, denom):
    """Scalar loss of n clips at one trained step each, and its per-clip terms.

    logp (n,): log-prob of the rollout's x_next under the current policy (differentiable);
    logp_old (n,): the same at rollout time; adv (n,): GRPO advantages; mean (n, ...): the current
    policy's transition mean (differentiable); mean_anchor, mean_old (n, ...) or None (the term is
    off); std (n,): the step's noise std; scale (n,) or float: S_t; valid (n,): 1 for a scored clip,
    0 for a NaN reward; denom: see denominator()."""
    ratio = torch.exp(logp - logp_old)                                             # (n,)
    clipped = torch.clamp(ratio, 1 - clip_range, 1 + clip_range)
    policy = scale * torch.maximum(-adv * ratio, -adv * clipped)                   # (n,)
    zero = torch.zeros_like(policy)
    kl_pos = gaussian_kl(mean, mean_anchor, std) if mean_anchor is not None else zero  # position
    kl_vel = gaussian_kl(mean, mean_old, std) if mean_old is not None else zero        # velocity
    total = policy + lam * (beta_pos * kl_pos + beta_vel * kl_vel)                 # (n,)
    # where(), not a product: a NaN or inf term of a dropped clip must not leak in as 0 * NaN
    loss = torch.where(valid > 0, total, 0.0).sum() / denom
    return loss, Terms(policy, kl_pos, kl_vel, ratio)


def denominator(n_valid, n_train, world, n_chunks=1):
    """What each rank divides its summed per-clip losses by, so that the gradient after FSDP's
    average over ranks is the mean over the n_valid valid clips (all ranks) x n_train trained steps:
    sum_ranks sum_clips,steps / (n_valid * n_train / world) / world. With n_chunks optimizer steps
    per rollout batch, each step sees about 1/n_chunks of the clips."""
    return max(1.0, float(n_valid)) * n_train / world / n_chunks
