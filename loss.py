"""
The pieces of the GRPO objective that train.py composes, one trained step of a few clips at a time
(docs/method.md section 4):

    ratio  = exp(logp_theta - logp_old)
    loss   = sum over valid clips of  S_t * clipped_surrogate(ratio, A)
                                    + lambda_KL * (beta_pos * KL(mean_theta, mean_anchor)
                                                   + beta_vel * KL(mean_theta, mean_old))
             / denominator(...)

The KL is trust_region.gaussian_kl. A clip whose reward is NaN (valid 0) drops out whole, policy
and KL alike (masked_sum). `denominator` makes the sum of these losses over every micro-batch,
trained step and rank the mean over valid clips x trained steps.

Tested by: python -m pytest tests/test_loss.py   (against a plain-Python reference of the above)
"""
import torch


def clipped_surrogate(ratio, adv, clip_range):
    """(n,) PPO's pessimistic clipped term max(-A r, -A clip(r, 1 - eps, 1 + eps)): the unclipped term's
    gradient flows only where clipping would not make the objective more optimistic."""
    return torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - clip_range, 1 + clip_range))


def masked_sum(per_clip, valid):
    """The sum of per_clip (n,) over the clips with valid > 0. where(), not a product: a NaN or inf
    term of a dropped clip must not leak in as 0 * NaN."""
    return torch.where(valid > 0, per_clip, 0.0).sum()


def denominator(n_valid, n_train, world, n_chunks=1):
    """What each rank divides its summed per-clip losses by, so that the gradient after FSDP's
    average over ranks is the mean over the n_valid valid clips (all ranks) x n_train trained steps:
    sum_ranks sum_clips,steps / (n_valid * n_train / world) / world. With n_chunks optimizer steps
    per rollout batch, each step sees about 1/n_chunks of the clips."""
    return max(1.0, float(n_valid)) * n_train / world / n_chunks
