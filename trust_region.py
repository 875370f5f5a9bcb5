"""
The trust region of SAGE-GRPO (docs/method.md section 5): the KL of two transition Gaussians, the
strategies that weigh its two terms, and lambda_KL: held at a ratio of the gradients (our default) or
the paper's controller. The anchor is a frozen copy of the policy's trainable weights, refreshed every
anchor_every optimizer steps ('moving', 'dual'; never for 'fixed'); how it is stored sharded and
swapped in for a forward is infra/anchor.py.

    KL(mean_a, mean_b) = mean over elements of (mean_a - mean_b)^2 / (2 std_t^2)
    loss_kl = lambda_KL * (beta_pos * KL(mean_theta, mean_anchor)
                           + beta_vel * KL(mean_theta, mean_old))
    lambda_KL = kl_ratio_target / mean over the last 10 steps of ||g_KL|| / ||g_policy|| at lambda 1

Strategies: 'none' (no KL), 'fixed' (anchor = initial model), 'stepwise' (velocity term only),
'moving' (anchor refreshed every N optimizer steps, position term), 'dual' (both: the paper's).
'none' and 'stepwise' need no anchor: infra/anchor.py's Anchor holds nothing for them.

Where this differs from the paper and the released code (docs/method.md sections 5.6, 6):
lambda_KL holds the ratio of the KL term's summed gradient to the policy term's (RatioHold): at the
paper's lambda_KL (1e-7 warming to 1e-5) the region does not act, and held where it acts it beats
'none' at its best learning rate, with AdamW and Muon and at two toy widths (results/trust_region.md);
kl_ratio_target=0 restores the paper's KLController (config/released.py). Of that controller:
train.py calls KLController.update once per optimizer step with the KL averaged over all ranks,
where the released code calls it after every backward with the rank's own KL (extras/variants.py
kl_update='backward': its warm-up is over in ~2.5 optimizer steps and the ranks' lambdas drift
apart); the velocity term is the exact Gaussian KL, not the released sample estimate (why: section
5.4; kl_estimator='sample' restores it); the controller keeps the printed direction (high KL
*relaxes* the penalty); direction = -1 reverses it (high KL raises lambda, low KL lowers it),
but the warm-up ends at the ceiling kl_max, so either way lambda only moves below kl_max and back
up to it. Its start, floor, ceiling, warm-up and target are train.py's kl_init, kl_min, kl_max,
kl_warmup and kl_target (section 5.5): arguments without defaults here, written once.

Tested by: python -m pytest tests/test_trust_region.py   (the FSDP2 part runs torchrun on CPU)
           python -m pytest tests/test_kl_ratio.py       (RatioHold; the ratio against brute force)
"""
import math
from collections import deque

import torch

STRATEGIES = ('none', 'fixed', 'stepwise', 'moving', 'dual')  # KL strategies (docs/method.md 5.3)
ESTIMATORS = ('exact', 'sample')  # the velocity term: the Gaussian KL | the released 1-sample one
# train.py's settings that pick these
CHOICES = dict(kl_strategy=STRATEGIES, kl_estimator=ESTIMATORS)
# the controller's rule: the paper's printed values, fixed (docs/method.md 5.5), not settings
WINDOW = 10  # the deadband compares the mean of the last WINDOW observed KLs (printed value, fixed)
HIGH, LOW = 1.5, 0.5  # deadband edges, as multiples of the target (printed values, fixed)
DECAY, GROW = 0.9, 1.1  # multipliers of lambda_KL leaving the deadband (printed values, fixed)
DIRECTION = +1  # printed: KL high -> lambda *= DECAY, relaxing; -1 stabilises (kl_direction)


def kl_weights(strategy, beta_pos, beta_vel):
    """(position weight, velocity weight) of a strategy: 'fixed' and 'moving' keep the position
    term only, 'stepwise' the velocity term only, 'dual' both, 'none' neither."""
    return (beta_pos if strategy in ('fixed', 'moving', 'dual') else 0.0,
            beta_vel if strategy in ('stepwise', 'dual') else 0.0)


def gaussian_kl(mean, mean_ref, std):
    """KL(N(mean, std^2) || N(mean_ref, std^2)) per sample, averaged over elements; (B,) float32."""
    B = mean.shape[0]
    std = torch.as_tensor(std, dtype=torch.float32, device=mean.device).expand(B)  # (B,)
    sq = (mean.float() - mean_ref.float()).pow(2).flatten(1).mean(1)  # (B,)
    return sq / (2 * std**2)


def velocity_kl(new, mean_old, logp_old, estimator='exact'):
    """The velocity term (B,): KL(policy's step || the rollout policy's), exact between the two
    Gaussians, or the released code's one-sample estimate logp_old - logp of the rollout's own
    x_{t+1} ('sample': 0 in expectation at theta_old, its gradient not; docs/method.md 5.4)."""
    if estimator == 'exact':
        return gaussian_kl(new.mean, mean_old, new.std)
    if estimator == 'sample':
        return logp_old - new.logp
    raise ValueError(f'unknown kl_estimator {estimator!r}, expected one of {ESTIMATORS}')


class KLController:
    """lambda_KL: linear warm-up, then a deadband rule on the windowed mean KL (docs/method.md 5.5).

    .value is the lambda for the next optimizer step. update(kl) is called once after each
    optimizer step with the KL that step observed; after update number k (1-based) the value is
        k <= warmup:  lam_init + (lam_max - lam_init) * k / warmup    (step 0 trains with lam_init,
                                                                       step `warmup` with lam_max)
        k >  warmup:  the deadband rule on the mean of the last `window` KLs (warm-up KLs count).
    (kl_update='backward': after every backward; kl_ratio_target > 0: RatioHold instead.)
    """

    def __init__(self, lam_init, lam_min, lam_max, target, warmup, window=WINDOW, high=HIGH,
                 low=LOW, decay=DECAY, grow=GROW, direction=DIRECTION):
        self.lam_init, self.lam_min, self.lam_max, self.target = lam_init, lam_min, lam_max, target
        self.warmup, self.high, self.low, self.direction = warmup, high, low, direction
        self.decay, self.grow = decay, grow
        self.value = lam_init  # lambda_KL of the next optimizer step
        self.updates = 0  # update() calls so far = optimizer steps done
        self.history = deque(maxlen=window)  # the last `window` observed KLs

    def update(self, kl, r1=None):  # r1: the step's gradient ratio, read by RatioHold only
        self.updates += 1
        self.history.append(float(kl))
        if self.updates <= self.warmup:
            frac = self.updates / self.warmup
            self.value = self.lam_init + (self.lam_max - self.lam_init) * frac
            return self.value
        mean_kl = sum(self.history) / len(self.history)
        if mean_kl > self.high * self.target:  # KL too high: +1 relaxes (as printed), -1 tightens
            self.value *= self.decay if self.direction > 0 else self.grow
        elif mean_kl < self.low * self.target:  # KL too low: +1 tightens, -1 relaxes
            self.value *= self.grow if self.direction > 0 else self.decay
        self.value = min(max(self.value, self.lam_min), self.lam_max)
        return self.value

    def state_dict(self):
        return {'value': self.value, 'updates': self.updates, 'history': list(self.history)}

    def load_state_dict(self, sd):
        if 'history' not in sd:
            raise SystemExit('the checkpoint\'s lambda_KL held the gradient ratio (kl_ratio_target > 0 when it '
                             'was saved): resume it with that kl_ratio_target, or start a new out_dir')
        self.value, self.updates = float(sd['value']), int(sd['updates'])
        self.history.clear()
        self.history.extend(float(k) for k in sd['history'])


class RatioHold:
    """lambda_KL holding the KL/policy gradient ratio the optimizer sees (docs/method.md 5.6), instead of
    KLController. update(kl, r1) after each optimizer step, r1 its ratio at lambda 1: the norms of
    the step's summed KL-term and policy-term gradients (extras/diagnostics.py GradientSplit, on every
    step while the ratio is held). The KL term's gradient is linear in lambda, so
        value = target / mean(the last `window` r1)   (lam_init until an r1 is positive),
    not clipped. The window spans one anchor period at the defaults (10 = anchor_every): r1 is 0 right
    after a refresh and grows until the next, and its mean over a period is what is held."""

    def __init__(self, lam_init, target, window=WINDOW):
        self.value, self.target, self.updates = lam_init, target, 0
        self.ratios = deque(maxlen=window)

    def update(self, kl, r1=None):
        self.updates += 1
        if r1 is not None and math.isfinite(r1):
            self.ratios.append(float(r1))
        mean_r1 = sum(self.ratios) / len(self.ratios) if self.ratios else 0.0
        if mean_r1 > 0:
            self.value = self.target / mean_r1
        return self.value

    def state_dict(self):
        return {'value': self.value, 'updates': self.updates, 'ratios': list(self.ratios)}

    def load_state_dict(self, sd):
        if 'history' in sd:  # KLController's
            raise SystemExit('the checkpoint\'s lambda_KL is the paper\'s controller (kl_ratio_target=0 when it '
                             'was saved): resume it with --kl_ratio_target=0, or start a new out_dir')
        self.value, self.updates = float(sd['value']), int(sd['updates'])
        self.ratios.clear()
        self.ratios.extend(float(r) for r in sd.get('ratios', ()))  # none in early checkpoints
