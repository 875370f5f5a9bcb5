"""
What train.py measures of its update, for the log:
- UpdateStats: the loss, the mean KL terms, the fraction of clipped ratios, the largest |ratio - 1|,
  the gradient norm and the optimizer steps skipped for a non-finite one, of an iteration's update,
  summed over its micro-batches and then averaged over the ranks; and the drift |d logp| between the
  rollout's log-probs and the update's recomputation at theta_old (the rounding of two batch shapes:
  docs/method.md 4.6), its mean, its largest and the fraction beyond clip_range;
- gradient_norms (diag_every; off by default): the gradient norm of one clip's policy term at the
  first and the last trained step, without and with the equalizer's S_t (the paper's Fig. 3: S_t
  evens them out, docs/method.md section 3), and the ratio of its KL term's gradient norm to its
  policy term's.

    stats = UpdateStats(n_local * n_train, clip_range); stats.add(loss, terms); stats.row(...)
    diag = gradient_norms(terms_at, steps, eq_scale, lam, kl_weights, optimizers, weight, boundary)

gradient_norms costs 4 forward+backward passes of one clip per rank (and 4 anchor forwards with a
position KL), and leaves every .grad empty: call it between optimizer steps, never inside an
accumulation.

Tested by: python -m pytest tests/test_train_ranks.py (the same figures on 2 ranks and 1 process)
"""
import math

import torch
from torch.distributed.tensor import DTensor

from infra import parallel
from infra.optimizer import zero_grad


def reward_row(batch, dims):
    """The log's fields of an iteration's rewards, all ranks', from train.py's advantages: batch
    {'r' (P, G) composites, 'c' (P, G, K) components in `dims` order, 'std' (P, 1) of each group,
    'valid' (P, G)}. A NaN (a clip left out) is left out of the means."""
    std = batch['std']  # a column made contiguous: a strided one sums in another order (last bit)
    return dict(reward=torch.nanmean(batch['r'].flatten()).item(),
                **{k: torch.nanmean(batch['c'][..., j].contiguous()).item() for j, k in enumerate(dims)},
                group_std=std.mean().item(),
                zero_adv_frac=(std.flatten() <= 1e-6).float().mean().item(),  # equal rewards: no signal
                nan_rewards=int((~batch['valid']).sum()))


class UpdateStats:
    def __init__(self, n_terms, clip_range):
        """n_terms: the (clip, trained step) terms of this rank's update, over all optimizer steps."""
        self.n, self.clip_range = n_terms, clip_range
        self.sums = dict(loss=0.0, kl_pos=0.0, kl_vel=0.0, clipfrac=0.0, grad_norm=0.0, ratio_max=0.0,
                         skipped=0, drift=0.0, drift_n=0, drift_out=0, drift_max=0.0, kl_ratio_est=0.0)
        self.g_sq = None  # this optimizer step's sum over its valid terms of ||d term / d mean||^2: policy, KL

    def drifted(self, d):
        """|logp_rollout - logp_recomputed| (n,) of some terms at theta_old."""
        s = self.sums
        s['drift'] += d.sum().item()
        s['drift_n'] += d.numel()
        s['drift_out'] += int((d > self.clip_range).sum())
        s['drift_max'] = max(s['drift_max'], d.max().item())

    def add(self, loss, terms):
        """One micro-batch: its loss and its per-clip terms {'kl', 'kl_pos', 'kl_vel', 'ratio', 'drift',
        'valid', 'g_policy', 'g_kl'} (n,) (drift None: measured by the update's recomputation of the old
        log-probs). Returns the micro-batch's mean KL (the strategy's weighted sum: lambda_KL's input)."""
        g = torch.stack([(terms[k] * terms['valid']).sum() for k in ('g_policy', 'g_kl')])
        self.g_sq = g if self.g_sq is None else self.g_sq + g
        if terms.get('drift') is not None:
            self.drifted(terms['drift'])
        ratio_dev = (terms['ratio'] - 1).abs()  # vs clip_range; float noise at theta_old
        s = self.sums
        s['loss'] += loss.item()
        s['kl_pos'] += terms['kl_pos'].sum().item() / self.n
        s['kl_vel'] += terms['kl_vel'].sum().item() / self.n
        s['clipfrac'] += (ratio_dev > self.clip_range).float().sum().item() / self.n
        s['ratio_max'] = max(s['ratio_max'], ratio_dev.max().item())
        return terms['kl'].mean().item()

    def kl_ratio(self, lam, n_steps, device):
        """The KL/policy gradient ratio of this optimizer step at lambda 1, from every rank's terms since
        the last call (docs/method.md 5.6; nan: no valid clip); lam times it is logged (kl_ratio_est).
        Collective: every rank calls it once an optimizer step."""
        g = parallel.total(self.g_sq if self.g_sq is not None else torch.zeros(2, device=device))
        self.g_sq = None
        r1 = (g[1] / g[0]).sqrt().item()  # an sp group counts its clips on both sides: the ratio stays
        self.sums['kl_ratio_est'] += lam * r1 / n_steps if math.isfinite(r1) else 0.0
        return r1

    def stepped(self, grad_norm, n_steps):
        """One optimizer step's gradient norm (a float, clip_grad_norm_'s), of n_steps this iteration;
        a non-finite one counts as skipped (train.py takes no step)."""
        self.sums['grad_norm'] += grad_norm / n_steps
        self.sums['skipped'] += not math.isfinite(grad_norm)

    def row(self, device, sp_size=1, dp_group=None):
        """The log's figures: means over the ranks (an sp group's ranks each hold the whole loss of
        their clips, hence / sp_size), the largest ratio deviation of any rank; collective."""
        s = self.sums
        mean = lambda k: parallel.mean(s[k], device)  # noqa: E731
        top = parallel.gather(torch.tensor([[s['ratio_max'], s['drift_max']]], device=device), dp_group).amax(0)
        drift = parallel.gather(torch.tensor([[s['drift'], s['drift_n'], s['drift_out']]], device=device,
                                             dtype=torch.float64), dp_group).sum(0)  # (3,) over data-parallel ranks
        n = max(1.0, drift[1].item())
        return dict(loss=mean('loss') / sp_size, kl_pos=mean('kl_pos'), kl_vel=mean('kl_vel'),
                    clipfrac=mean('clipfrac'), grad_norm=s['grad_norm'], ratio_max=top[0].item(),
                    skipped_steps=s['skipped'], kl_ratio_est=s['kl_ratio_est'], logp_drift_mean=drift[0].item() / n, logp_drift_max=top[1].item(),
                    logp_drift_frac=drift[2].item() / n)


def grad_norm(loss, optimizers, weight):
    """The global gradient norm of loss * weight over the optimizers' parameters (FSDP shards
    included). Every rank must call it (FSDP's collectives) and FSDP averages the gradient over
    the ranks, so weight = world on the ranks whose loss is measured and 0 elsewhere."""
    params = [p for o in optimizers for g in o.param_groups for p in g['params']]
    zero_grad(optimizers)
    (loss * weight).backward()
    n = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    zero_grad(optimizers)
    return (n.full_tensor() if isinstance(n, DTensor) else n).item()  # FSDP2: a DTensor


class NonFinite:
    """Optimizer steps skipped in a row for a non-finite global gradient norm (NaN or inf: the step
    would write NaN weights, moments and lambda). nonfinite(norm, iteration) -> True: skip this
    step; the `stop`-th in a row ends the run with one line (the newest checkpoint is good)."""

    def __init__(self, stop, out_dir):
        self.stop, self.out_dir, self.row = stop, out_dir, 0

    def __call__(self, norm, iteration):
        self.row = 0 if math.isfinite(norm) else self.row + 1
        if self.row >= self.stop:
            raise SystemExit(f'iteration {iteration}: {self.row} optimizer steps in a row had a '
                             f'non-finite gradient norm ({norm}); none was taken, and the newest '
                             f'checkpoint in {self.out_dir} is the last good one')
        return self.row > 0


def gradient_norms(terms_at, steps, eq_scale, lam, kl_weights, optimizers, weight, boundary=None):
    """{'gnorm_first', 'gnorm_first_eq', 'gnorm_last', 'gnorm_last_eq'} and, with a KL term,
    'kl_grad_ratio'. terms_at(t): the per-clip terms {'policy', 'kl_pos', 'kl_vel'} (1,) of the
    measured clip at step t, from a fresh forward; steps: the trained steps (sorted); eq_scale
    (N,): S_t; kl_weights: (beta_pos, beta_vel) as the strategy weights them; boundary: called
    before each measurement (a preemption point)."""
    boundary = boundary or (lambda: None)
    diag = {}
    for name, t in (('first', steps[0]), ('last', steps[-1])):
        boundary()
        policy = terms_at(t)['policy'].sum() / eq_scale[t]  # S_t * term, divided back: without S_t
        diag[f'gnorm_{name}'] = grad_norm(policy, optimizers, weight)
        diag[f'gnorm_{name}_eq'] = diag[f'gnorm_{name}'] * eq_scale[t].item()  # S_t is a constant
    if any(kl_weights):
        t = steps[len(steps) // 2]
        boundary()
        g_policy = grad_norm(terms_at(t)['policy'].sum(), optimizers, weight)
        terms = terms_at(t)
        kl = kl_weights[0] * terms['kl_pos'] + kl_weights[1] * terms['kl_vel']
        diag['kl_grad_ratio'] = grad_norm(lam * kl.sum(), optimizers, weight) / max(g_policy, 1e-30)
    return diag
