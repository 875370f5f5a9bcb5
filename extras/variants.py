"""
The released code's switches and the add-ons: each changes SAGE-GRPO at one named seam of train.py,
and each is off (the paper's method) at the defaults below. Their settings are constants here, set
like train.py's own (a config file or --key=value; infra/configurator.py reads this file's too).

    seam in train.py                 what acts there when switched on
    trained_steps: steps             sde_window: a random window of the stochastic steps (Flow-GRPO-Fast)
    trained_steps: eq.scales         median='lower': torch.median's lower middle value (released)
    rollout: initial_noise           prompt_noise='fixed': each prompt's x_1 the same every iteration (released)
    score: credit                    credit='tvrl': token-level credit maps (extras/credit.py)
    advantages: advantages           advantage='per_component' | 'taros': each component in its group
    objective: tr.velocity_kl        kl_estimator='sample': the one-sample velocity KL (released)
    update: lambda_after_backward    kl_update='backward': lambda_KL after every backward (released)

docs/method.md 6.2 argues each released switch's default, 4.3 and 6.3 the add-ons.

Tested by: python -m pytest tests/test_advantage.py tests/test_compute.py tests/test_credit_train.py
"""
import torch

import sde
from extras import credit as tvrl
from infra import parallel
from models.policy import generators, seed_of

# ----------------------------------------------------------------------------- settings
# the released code's switches (docs/method.md 6.2 argues each default)
kl_update = 'step'              # lambda_KL moves each optimizer step | 'backward' (released)
kl_estimator = 'exact'          # velocity KL: exact | 'sample': logp_old - logp (released, 5.4)
prompt_noise = 'fresh'          # initial noise: 'fresh' each iteration | 'fixed' (released)
median = 'mean_of_middle'       # S_t's median of an even count: numpy's | 'lower' (released)
# add-ons, off by default (docs/method.md 4.3, 6.3)
advantage = 'grpo'              # 'grpo' (the paper) | 'per_component' | 'taros'
sde_window = 0                  # > 0: a random window of this many steps is stochastic, trained
credit = 'none'                 # 'none': a video's tokens share its advantage | 'tvrl' (extras/credit.py)
credit_granularity = 'window'   # tvrl: 'window' (a weight a latent token) | 'frame'
credit_window = (1, 3, 3)       # tvrl: (t, h, w) latent tokens of the smoothing box (odd)
# -----------------------------------------------------------------------------
ADVANTAGES = ('grpo', 'per_component', 'taros')
CHOICES = dict(advantage=ADVANTAGES, kl_update=('step', 'backward'), prompt_noise=('fresh', 'fixed'),
               credit=('none', 'tvrl'))
# the two taros thresholds are fixed: our reading of an abstract that states none (docs/method.md 4.3)
TAROS_DEADZONE = 0.5   # a member's standardised component counts only beyond +-this (sparsity)
TAROS_SATURATED = 0.5  # a component whose group spread is under this x the batch's: saturated


def check(ratio_held):
    """A combination no seam can run: one line, before anything loads. ratio_held: train.py's
    lambda_KL holds the gradient ratio (kl_ratio_target > 0 with a KL term)."""
    if ratio_held and kl_update != 'step':
        raise SystemExit("config error: kl_ratio_target > 0 holds lambda_KL once per optimizer step, so "
                         "kl_update='step'; kl_ratio_target=0 gives the paper's controller (config/released.py)")


def window(stochastic, seed):
    """The iteration's stochastic, trained steps: all of them, or sde_window consecutive ones."""
    return sde.window(stochastic, sde_window, seed)


def window_size(stochastic):
    """How many steps window() returns: sde_window of them, or all."""
    return min(sde_window, len(stochastic)) if sde_window else len(stochastic)


def rollout_keeps(on_policy):
    """What the rollout keeps of each step besides x_t and the log-prob: the means where the update
    reads them (updates_per_iter > 1) or tvrl reweights the log-probs (with the stds)."""
    return ('means',) * (not on_policy or credit == 'tvrl') + ('stds',) * (credit == 'tvrl')


def initial_noise(gens, prompts, ids, prompt_seeds, seed, group_size):
    """The generators of the rollout's x_1: each video's own ('fresh'), or with prompt_noise='fixed'
    member i % G of each prompt the same every iteration (a CSV's seed column, else one of its own)."""
    if prompt_noise == 'fresh':
        return gens
    return generators([prompt_seeds[p] + i % group_size if p in prompt_seeds
                       else seed_of(seed, 'noise', p, i % group_size) for p, i in zip(prompts, ids)])


def scorer(reward_fn, weights, shape):
    """The score phase's reward: reward_fn, or with tvrl one that also returns each video's credit."""
    return reward_fn if credit == 'none' else tvrl.scorer(reward_fn, weights, shape, credit_window,
                                                          credit_granularity)


def credit_maps(videos, scores, steps):
    """tvrl: each video's credit (n, 1, F, h, w) and its old log-probs weighted by it; its peak logged."""
    if credit == 'tvrl':
        videos['credit'], scores['credit_peak'] = tvrl.reweight(videos, scores.pop('credit'), steps)


def credit_row(scores, device):
    """tvrl: the log's mean of each video's largest credit (all ranks'); {} when off."""
    return dict(credit_peak=parallel.mean(scores['credit_peak'].mean(), device)) if credit == 'tvrl' else {}


def credit_of(videos, b):
    """The log-prob's per-token weights of videos b (tvrl), or None: the plain mean."""
    return videos['credit'][b] if 'credit' in videos else None


def lambda_after_backward(controller, kl):
    """kl_update='backward' (released): lambda_KL after every backward, on the rank's own KL."""
    if kl_update == 'backward' and kl is not None:
        controller.update(kl)  # (the ranks' lambdas drift apart; a checkpoint keeps rank 0's)


def advantages(adv, valid, c, weights, clip):
    """GRPO's (adv, valid) as they are, or each component judged within its group first."""
    return (adv, valid) if advantage == 'grpo' else component_advantages(c, weights, advantage, clip)


def component_advantages(c, weights, kind, clip=5.0, eps=1e-6):
    """Advantages (P, G) of component rewards c (P, G, K), the K components in reward.DIMS order, one
    group a row (docs/method.md 4.3 argues each choice; 'taros' is our reading of an abstract):
        z_k = (c_k - mean_k) / std_k        each component standardised within its group (population
                                            std over the group's valid members; a flat component: 0)
        'per_component': a = sum_k w_k z_k  (decoupled normalisation of multi-reward GRPO)
        'taros':  a = sum_k w_k f_k soft(z_k),  soft(z) = sign(z) max(|z| - TAROS_DEADZONE, 0); f_k =
                  min(1, std_k / (TAROS_SATURATED * batch std_k)): a saturated component counts less
        A = a / (batch std of a), clipped to [-clip, clip].
    A clip with a NaN component leaves its group (valid False, advantage 0); a group with fewer than 2
    valid members has advantage 0. Returns (adv, valid)."""
    w = torch.tensor(weights, dtype=c.dtype, device=c.device)  # (K,)
    valid = ~torch.isnan(c).any(-1)  # (P, G)
    m = valid.unsqueeze(-1)  # (P, G, 1)
    n = m.sum(1, keepdim=True).clamp(min=1)  # (P, 1, 1)
    mean = torch.where(m, c, 0.0).sum(1, keepdim=True) / n  # (P, 1, K)
    std = (torch.where(m, (c - mean) ** 2, 0.0).sum(1, keepdim=True) / n).sqrt()  # (P, 1, K)
    z = torch.where(m & (std > eps), (c - mean) / std.clamp(min=eps), 0.0)  # (P, G, K)
    if kind == 'taros':
        z = z.sign() * (z.abs() - TAROS_DEADZONE).clamp(min=0)
        # (K,) the spread over the whole batch
        spread = c[valid].std(0, unbiased=False) if valid.sum() > 1 else torch.zeros_like(w)
        z = z * (std / (TAROS_SATURATED * spread).clamp(min=eps)).clamp(max=1)
    elif kind != 'per_component':
        raise ValueError(f'unknown advantage {kind!r}')
    a = (z * w).sum(-1)  # (P, G)
    ok = valid & (valid.sum(1, keepdim=True) >= 2)
    scale = a[ok].std(unbiased=False) if ok.sum() > 1 else a.new_ones(())
    return torch.where(ok, a / scale.clamp(min=eps), 0.0).clamp(-clip, clip), valid
