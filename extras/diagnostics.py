"""
What train.py measures of its update, for the log:
- UpdateStats: the loss, the mean KL terms, the fraction of clipped ratios, the largest |ratio - 1|,
  the gradient norm and the optimizer steps skipped for a non-finite one, of an iteration's update,
  summed over its micro-batches and then averaged over the ranks; and the drift |d logp| between the
  rollout's log-probs and the update's recomputation at theta_old (the rounding of two batch shapes:
  docs/method.md 4.6), its mean, its largest and the fraction beyond clip_range;
- GradientSplit: the KL/policy ratio of the step's summed gradients, on every step while lambda_KL holds it
  (train.py's default, trust_region.py RatioHold), else every ratio_every iterations (off by default);
- gradient_norms (diag_every; off by default): the gradient norm of one clip's policy term at the
  first and the last trained step, without and with the equalizer's S_t (the paper's Fig. 3: S_t
  evens them out, docs/method.md section 3), and the ratio of its KL term's gradient norm to its
  policy term's.

    stats = UpdateStats(n_local * n_train, clip_range); stats.add(loss, terms, logp); stats.row(...)
    diag = gradient_norms(terms_at, steps, eq_scale, lam, kl_weights, optimizers, weight, boundary)

gradient_norms costs 4 forward+backward passes of one clip per rank (and 4 anchor forwards with a
position KL), and leaves every .grad empty: call it between optimizer steps, never inside an
accumulation.

Tested by: python -m pytest tests/test_train_ranks.py (the same figures on 2 ranks and 1 process),
tests/test_kl_ratio.py (GradientSplit against brute-force summed gradients)
"""
import math

import torch
from torch.distributed.tensor import DTensor

from infra import parallel
from infra.optimizer import zero_grad
from models.policy import count_passes

# ----------------------------------------------------------------------------- settings (train.py's, set as its own)
diag_every = 0                  # iterations between one clip's 4-pass gradient norms (0: never)
ratio_every = 0                 # iterations between the batch's KL/policy ratio under kl_ratio_target=0 (0: never)
# -----------------------------------------------------------------------------


def diag_due(it):
    """gradient_norms' cadence: every diag_every iterations (off at 0)."""
    return bool(diag_every) and it % diag_every == 0


def ratio_due(it):
    """GradientSplit's cadence: every ratio_every iterations (off at 0)."""
    return bool(ratio_every) and it % ratio_every == 0


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
    def __init__(self, n_terms, clip_range, on_policy=True):
        """n_terms: the (clip, trained step) terms of this rank's update, over all optimizer steps;
        on_policy: the drift is measured by add() (else by the update's recomputation, drifted())."""
        self.n, self.clip_range, self.on_policy = n_terms, clip_range, on_policy
        self.sums = dict(loss=0.0, kl_pos=0.0, kl_vel=0.0, clipfrac=0.0, grad_norm=0.0, ratio_max=0.0,
                         skipped=0, drift=0.0, drift_n=0, drift_out=0, drift_max=0.0, kl_ratio=0.0, kl_ratio_n=0)

    def drifted(self, d):
        """|logp_rollout - logp_recomputed| (n,) of some terms at theta_old."""
        s = self.sums
        s['drift'] += d.sum().item()
        s['drift_n'] += d.numel()
        s['drift_out'] += int((d > self.clip_range).sum())
        s['drift_max'] = max(s['drift_max'], d.max().item())

    def add(self, loss, terms, rollout_logp):
        """One micro-batch: its loss and its per-clip terms {'kl_pos', 'kl_vel', 'ratio', 'logp', 'valid'}
        (n,) (train.step_loss's), of its valid clips (a stand-in micro-batch has none); rollout_logp
        (n,): the rollout's log-probs of the same steps (the drift, on policy)."""
        s, valid = self.sums, terms['valid'] > 0
        s['loss'] += loss.item()
        if not valid.any():
            return
        if self.on_policy:  # the update's forward at theta_old against the rollout's: two batch shapes
            self.drifted((terms['logp'].detach() - rollout_logp)[valid].abs())
        ratio_dev = (terms['ratio'] - 1).abs()[valid]  # vs clip_range; float noise at theta_old
        s['kl_pos'] += terms['kl_pos'][valid].sum().item() / self.n
        s['kl_vel'] += terms['kl_vel'][valid].sum().item() / self.n
        s['clipfrac'] += (ratio_dev > self.clip_range).float().sum().item() / self.n
        s['ratio_max'] = max(s['ratio_max'], ratio_dev.max().item())

    def stepped(self, grad_norm, n_steps, kl_ratio=None):
        """One optimizer step's gradient norm (a float, clip_grad_norm_'s), of n_steps this iteration;
        a non-finite one counts as skipped (train.py takes no step); kl_ratio: GradientSplit's, if measured."""
        self.sums['grad_norm'] += grad_norm / n_steps
        self.sums['skipped'] += not math.isfinite(grad_norm)
        if kl_ratio is not None:
            self.sums['kl_ratio'] += kl_ratio
            self.sums['kl_ratio_n'] += 1

    def row(self, device, sp_size=1, dp_group=None):
        """The log's figures: means over the ranks (an sp group's ranks each hold the whole loss of
        their clips, hence / sp_size), the largest ratio deviation of any rank; collective."""
        s = self.sums
        mean = lambda k: parallel.mean(s[k], device)  # noqa: E731
        top = parallel.gather(torch.tensor([[s['ratio_max'], s['drift_max']]], device=device), dp_group).amax(0)
        drift = parallel.gather(torch.tensor([[s['drift'], s['drift_n'], s['drift_out']]], device=device,
                                             dtype=torch.float64), dp_group).sum(0)  # (3,) over data-parallel ranks
        n = max(1.0, drift[1].item())
        ratio = dict(kl_ratio=s['kl_ratio'] / s['kl_ratio_n']) if s['kl_ratio_n'] else {}  # the same on every rank
        return dict(loss=mean('loss') / sp_size, kl_pos=mean('kl_pos'), kl_vel=mean('kl_vel'),
                    clipfrac=mean('clipfrac'), grad_norm=s['grad_norm'], ratio_max=top[0].item(),
                    skipped_steps=s['skipped'], **ratio, logp_drift_mean=drift[0].item() / n,
                    logp_drift_max=top[1].item(), logp_drift_frac=drift[2].item() / n)


class GradientSplit:
    """The KL/policy gradient ratio the optimizer sees (docs/method.md 5.6): ||g_KL|| / ||g_policy||, the
    norms of the optimizer step's summed KL-term and policy-term gradients in parameter space, after the
    ranks' reduction (FSDP's reduce-scatter: the norms are of every rank's shards). The KL gradients of
    all clips pull along one displacement and add, the policy gradients (zero-mean advantages) largely
    cancel, so a per-clip ratio misses what the sum shows. When on, each micro-batch's backward runs
    the two terms apart (two backward passes of one forward) into separate sums, added back before the
    step (the same gradient, to float rounding); off, backward() is loss.backward().

        split = GradientSplit(optimizers, it, always=held)  # on at ratio_every, or always
        split.backward(loss, terms, denom)  # every micro-batch
        r1 = split.measure(lam)             # before the clip: the ratio at lambda 1 (None: off);
                                            # split.logged: lam * r1, the ratio the step sees"""

    def __init__(self, optimizers, it, always=False):  # on every ratio_every iterations, or always
        self.params = [p for o in optimizers for g in o.param_groups for p in g['params']]
        self.on, self.kl, self.logged = ratio_due(it) or always, None, None

    def backward(self, loss, terms, denom):
        if not self.on:
            return loss.backward()
        policy = torch.where(terms['valid'] > 0, terms['policy'], 0.0).sum() / denom  # loss's policy part
        stash = [p.grad for p in self.params]  # the policy gradients accumulated so far
        for p in self.params:
            p.grad = None
        (loss - policy).backward(retain_graph=True)  # the KL term alone: the policy's cancels exactly
        self.kl = self.kl or [None] * len(self.params)
        for i, p in enumerate(self.params):
            if p.grad is not None:
                self.kl[i] = p.grad if self.kl[i] is None else self.kl[i] + p.grad
            p.grad = stash[i]
        policy.backward()

    def measure(self, lam):
        if not self.on:
            return None
        norm = lambda gs: _full(torch.nn.utils.get_total_norm([g for g in gs if g is not None]))  # noqa: E731
        g_policy, g_kl = norm([p.grad for p in self.params]), norm(self.kl or [])
        self.add_back()
        r1 = g_kl / lam / g_policy if g_policy > 0 else float('nan')
        self.logged = lam * r1
        return r1

    def add_back(self):
        """The KL term's gradient sum added into the parameters' gradients: the step's whole gradient."""
        for p, g in zip(self.params, self.kl or []):
            if g is not None:
                p.grad = g if p.grad is None else p.grad + g
        self.kl = None


def _full(n):
    return (n.full_tensor() if isinstance(n, DTensor) else n).item()  # FSDP2: a DTensor


def grad_norm(loss, optimizers, weight):
    """The global gradient norm of loss * weight over the optimizers' parameters (FSDP shards
    included). Every rank must call it (FSDP's collectives) and FSDP averages the gradient over
    the ranks, so weight = world on the ranks whose loss is measured and 0 elsewhere."""
    params = [p for o in optimizers for g in o.param_groups for p in g['params']]
    zero_grad(optimizers)
    (loss * weight).backward()
    n = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    zero_grad(optimizers)
    return _full(n)


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


def gradient_norms_due(it, terms_at, steps, eq_scale, lam, kl_weights, optimizers, weight, boundary,
                       passes, device):
    """gradient_norms() every diag_every iterations ({} otherwise), its passes counted in `passes`."""
    if not diag_due(it):
        return {}
    norms = gradient_norms(terms_at, steps, eq_scale, lam, kl_weights, optimizers, weight, boundary)
    count_passes(passes, ('diag_anchor', 'diag'), device)
    return norms


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
