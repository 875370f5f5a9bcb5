"""
The trust region of SAGE-GRPO (docs/method.md section 5): the KL of two transition Gaussians, the
anchor (a frozen copy of the policy's trainable weights) and the lambda_KL controller.

    KL(mean_a, mean_b) = mean over elements of (mean_a - mean_b)^2 / (2 std_t^2)
    loss_kl = lambda_KL * (beta_pos * KL(mean_theta, mean_anchor)
                           + beta_vel * KL(mean_theta, mean_old))

Strategies: 'none' (no KL), 'fixed' (anchor = initial model), 'stepwise' (velocity term only),
'moving' (anchor refreshed every N optimizer steps, position term), 'dual' (both: the paper's).
'none' and 'stepwise' need no anchor: Anchor() may be built for them but holds nothing.

Where this differs from the paper and the released code (docs/method.md section 6):
train.py calls KLController.update once per optimizer step with the KL averaged over all ranks,
where the released code calls it after every backward with the rank's own KL (extras/variants.py
kl_update='backward': its warm-up is over in ~2.5 optimizer steps and the ranks' lambdas drift apart);
the velocity term is the exact Gaussian KL, not the released sample estimate (why: section 5.4;
kl_estimator='sample' restores it); the controller keeps the printed direction (high KL *relaxes* the
penalty); direction = -1 reverses the rule (high KL raises lambda, low KL lowers it), but the warm-up
ends at the ceiling kl_max, so either way lambda only moves below kl_max and back up to it. Its start, floor, ceiling,
warm-up and target are train.py's settings kl_init, kl_min, kl_max, kl_warmup, kl_target, and the
anchor's refresh period anchor_every (section 5.5): arguments without defaults here, written once.

Tested by: python -m pytest tests/test_trust_region.py   (the FSDP2 part runs torchrun on CPU)
"""
import contextlib
import math
from collections import deque

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, distribute_tensor

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
    Gaussians, or the released code's one-sample estimate logp_old - logp of the rollout's own x_{t+1}
    ('sample': 0 in expectation at theta_old, its gradient not; docs/method.md 5.4). new: sde.step's."""
    if estimator == 'exact':
        return gaussian_kl(new.mean, mean_old, new.std)
    if estimator == 'sample':
        return logp_old - new.logp
    raise ValueError(f'unknown kl_estimator {estimator!r}, expected one of {ESTIMATORS}')


def _trainable(model):
    # the weights the optimizer moves: all of them for a full fine-tune, the adapters for LoRA (peft
    # freezes the base; with diffusers' add_adapter, call requires_grad_(False) first). FSDP2 leaves
    # the root's weights all-gathered after a forward; resharding every unit first returns the
    # sharded DTensors the optimizer holds (infra/parallel.py's reshard, not imported here)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t  # a DTensor's shard on this rank (a view)


class Anchor:
    """A frozen copy of the policy's trainable weights; under FSDP2 it holds only local shards."""

    def __init__(self, model, strategy, every):  # every: train.py's anchor_every
        if strategy not in STRATEGIES:
            raise ValueError(f'unknown KL strategy {strategy!r}, expected one of {STRATEGIES}')
        self.strategy, self.every = strategy, every
        self.weights = {}  # name -> tensor (a sharded DTensor under FSDP2); empty if not needed
        self._buffers = {}  # (dtype, device) -> applied()'s swap buffer
        if strategy in ('fixed', 'moving', 'dual'):
            with torch.no_grad():  # clone of a DTensor is a DTensor with the same local shard size
                self.weights = {n: p.detach().clone() for n, p in _trainable(model).items()}

    @torch.no_grad()
    def refresh(self, model):
        params = _trainable(model)
        for name, w in self.weights.items():  # nothing for 'none' / 'stepwise'
            w.copy_(params[name])

    def maybe_refresh(self, model, step):
        # step = optimizer steps done so far; 'fixed' keeps the initial model forever
        if self.strategy in ('moving', 'dual') and step % self.every == 0:
            self.refresh(model)

    @contextlib.contextmanager
    def applied(self, model):
        """with anchor.applied(model): v_anchor = model(...)  -- anchor weights, no grad.

        Run it BEFORE the policy's grad-tracking forward of the same micro-batch: the weights are
        swapped in place, and a swap between a forward and its backward corrupts autograd (the
        version-counter check raises, and FSDP2's kept-gathered root would serve the anchor).
        Inside the body the anchor's own tensors hold the policy's weights (a swap, not a copy):
        nothing there may read or refresh the anchor.
        """
        if not self.weights:
            raise RuntimeError(f'strategy {self.strategy!r} keeps no anchor')
        swapped = []
        with torch.no_grad():
            try:
                for name, p in _trainable(model).items():
                    self._swap(p, self.weights[name])  # the policy's wait in the anchor's tensors
                    swapped.append(name)
                yield  # the body runs under no_grad too: the anchor's output is a target
            finally:  # reshard first, or the root keeps the anchor's gathered weights
                params = _trainable(model)
                for name in swapped:
                    self._swap(params[name], self.weights[name])  # both back, bitwise: plain copies

    def _swap(self, a, b):
        # exchange the contents of two tensors of one shape and dtype (sharded DTensors: their local
        # shards) through a buffer kept for it: no per-call copy of all the weights (3.9 GB a GPU at
        # 8.3B in fp32), one buffer the size of the largest local tensor, allocated once
        a, b = _local(a), _local(b)
        key = (a.dtype, a.device)
        if key not in self._buffers:
            size = max(_local(w).numel() for w in self.weights.values())
            self._buffers[key] = torch.empty(size, dtype=a.dtype, device=a.device)
        tmp = self._buffers[key][:a.numel()].view(a.shape)
        tmp.copy_(a)
        a.copy_(b)
        b.copy_(tmp)

    def state_dict(self):
        # name -> the anchor's own tensors (no copy, like nn.Module.state_dict): trainable-parameter
        # names of the model; under FSDP2 sharded DTensors, to save with distributed.checkpoint
        # or gather with .full_tensor() on every rank. {} for 'none' / 'stepwise'.
        return dict(self.weights)

    @torch.no_grad()
    def load_state_dict(self, sd):
        if sd.keys() != self.weights.keys():
            raise KeyError(f'anchor keys differ: {sorted(set(sd) ^ set(self.weights))[:5]}')
        for name, w in self.weights.items():
            src = sd[name]
            if isinstance(w, DTensor) and not isinstance(src, DTensor):  # a gathered full tensor
                src = distribute_tensor(src.to(w.device), w.device_mesh, w.placements)
            w.copy_(src)


class KLController:
    """lambda_KL: linear warm-up, then a deadband rule on the windowed mean KL (docs/method.md 5.5).

    .value is the lambda for the next optimizer step. update(kl) is called once after each
    optimizer step with the KL that step observed; after update number k (1-based) the value is
        k <= warmup:  lam_init + (lam_max - lam_init) * k / warmup    (step 0 trains with lam_init,
                                                                       step `warmup` with lam_max)
        k >  warmup:  the deadband rule on the mean of the last `window` KLs (warm-up KLs count).
    ratio_target > 0 replaces both (an add-on, docs/method.md 5.6): update(kl, r1) with r1 the step's
    KL/policy gradient ratio at lambda 1; the KL term's gradient is linear in lambda, so
        value = ratio_target / mean(the last `window` r1)   (lam_init until an r1 is positive),
    not clipped (lam_min, lam_max, warmup and target are not read). The window spans one anchor period
    at the defaults (10 = anchor_every): r1 is 0 right after a refresh and grows until the next, and
    its mean over a period is what is held.
    """

    def __init__(self, lam_init, lam_min, lam_max, target, warmup, window=WINDOW, high=HIGH,
                 low=LOW, decay=DECAY, grow=GROW, direction=DIRECTION, ratio_target=0.0):
        self.lam_init, self.lam_min, self.lam_max, self.target = lam_init, lam_min, lam_max, target
        self.warmup, self.high, self.low, self.direction = warmup, high, low, direction
        self.decay, self.grow, self.ratio_target = decay, grow, ratio_target
        self.value = lam_init  # lambda_KL of the next optimizer step
        self.updates = 0  # update() calls so far = optimizer steps done
        self.history = deque(maxlen=window)  # the last `window` observed KLs
        self.ratios = deque(maxlen=window)  # ratio_target: the last `window` r1

    def update(self, kl, r1=None):
        self.updates += 1
        self.history.append(float(kl))
        if self.ratio_target > 0:
            if r1 is not None and math.isfinite(r1):
                self.ratios.append(float(r1))
            mean_r1 = sum(self.ratios) / len(self.ratios) if self.ratios else 0.0
            if mean_r1 > 0:
                self.value = self.ratio_target / mean_r1
            return self.value
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
        return {'value': self.value, 'updates': self.updates, 'history': list(self.history),
                'ratios': list(self.ratios)}

    def load_state_dict(self, sd):
        self.value, self.updates = float(sd['value']), int(sd['updates'])
        self.history.clear()
        self.history.extend(float(k) for k in sd['history'])
        self.ratios.clear()
        self.ratios.extend(float(r) for r in sd.get('ratios', ()))  # none in older checkpoints
