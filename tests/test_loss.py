"""
train.py's objective: its own step_loss (read from train.py's source and run here, with the forwards
replaced by given means and log-probs) and its own normaliser (the `denom` line of its update),
against a plain-Python reference written here number by number (docs/method.md sections 4-5):
- the sign: one SGD step on the loss raises logp where A > 0 and lowers it where A < 0;
- the clip: the pessimistic max takes the unclipped term (gradient -A r) where it must and the
  clipped one (gradient 0) where it must, for both signs of A and a ratio on both sides of the band;
- S_t scales the policy term only; each KL term is measured against its own mean (position vs the
  anchor's, velocity vs the rollout's), and equals torch.distributions' KL;
- a NaN-reward clip (valid 0) gets no gradient at all, policy or KL;
- the normaliser: summed over micro-batches, trained steps and ranks (averaged by FSDP), the gradient
  is the mean over valid clips x trained steps.
"""
import ast
import contextlib
import math
import os
from types import SimpleNamespace

import torch

from trust_region import gaussian_kl, velocity_kl

EPS = 1e-4  # clip range
SOURCE = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'train.py')).read()
TREE = ast.parse(SOURCE)


def train_function(name):
    """The source of train.py's top-level function `name`."""
    fn, = [n for n in TREE.body if isinstance(n, ast.FunctionDef) and n.name == name]
    return ast.get_source_segment(SOURCE, fn)


def train_expression(target):
    """The source of the right-hand side of train.py's (only) assignment to `target`."""
    found = [n.value for n in ast.walk(TREE) if isinstance(n, ast.Assign)
             and any(isinstance(t, ast.Name) and t.id == target for t in n.targets)]
    assert len(found) == 1, (target, len(found))
    return ast.get_source_segment(SOURCE, found[0])


def denominator(n_valid, n_train, world, n_chunks=1):
    """train.py's denom for n_valid valid clips (all ranks), n_train trained steps, n_chunks optimizer steps."""
    names = dict(batch=dict(valid=torch.ones(int(n_valid))), n_train=n_train, world=world, updates_per_iter=n_chunks,
                 max=max)
    return eval(train_expression('denom'), names)


def call(logp, logp_old, adv, mean=None, mean_anchor=None, mean_old=None, std=None, scale=1.0, lam=0.0,
         beta_pos=1.0, beta_vel=0.1, valid=None, denom=1.0, kl_estimator='exact', on_policy=False):
    """train.py's step_loss of n clips at one trained step each (clip i at step i, so S_t may differ per
    clip), its forwards replaced: the policy's step gives (mean, std, logp), the anchor's mean_anchor.
    on_policy False: the old log-prob and mean are the given ones (train.py with updates_per_iter > 1,
    the general objective); True: train.py's default, the recomputed forward's own, detached."""
    n = logp.shape[0]
    mean = torch.zeros(n, 3, dtype=logp.dtype) if mean is None else mean
    std = torch.ones(n, dtype=logp.dtype) if std is None else std
    valid = torch.ones(n, dtype=logp.dtype) if valid is None else valid
    eye = torch.eye(n, dtype=torch.bool)  # (clip, step) pairs (i, i)
    logps = torch.zeros(n, n, dtype=logp.dtype).masked_scatter(eye, logp_old.detach())
    means = torch.zeros(n, n, mean.shape[1], dtype=mean.dtype)
    if mean_old is not None:
        means[eye] = mean_old
    clips = dict(xs=torch.zeros(n, n + 1, 1), logps=logps, means=means, adv=adv, valid=valid, prompts=[''] * n)

    def step():  # train.py's policy_step: one forward and the SDE step at it
        if torch.is_grad_enabled():  # the policy's grad forward
            return SimpleNamespace(mean=mean, std=std, logp=logp)
        return SimpleNamespace(mean=mean_anchor, std=std, logp=None)  # the anchor's, under no_grad
    names = dict(torch=torch, policy_step=lambda clips, b, t: step(),
                 on_policy=on_policy,
                 tr=SimpleNamespace(gaussian_kl=gaussian_kl, velocity_kl=velocity_kl),
                 variants=SimpleNamespace(kl_estimator=kl_estimator, credit_of=lambda clips, b: None),
                 anchor=SimpleNamespace(applied=lambda policy: contextlib.nullcontext()), policy=None,
                 clip_range=EPS, device='cpu', kl_estimator=kl_estimator,
                 kl_pos_weight=beta_pos if mean_anchor is not None else 0.0,
                 kl_vel_weight=beta_vel if mean_old is not None else 0.0)
    exec(train_function('step_loss'), names)
    scale = torch.as_tensor(scale, dtype=logp.dtype).expand(n)  # (n,) S_t of clip i's step i
    loss, terms = names['step_loss'](clips, list(range(n)), torch.arange(n), scale, lam, denom)
    return loss, SimpleNamespace(**terms)


def ref_policy(r, A, S):
    """(value, d value / d logp) of S * max(-A r, -A clip(r)), by cases, r = exp(logp - logp_old)."""
    lo, hi = 1 - EPS, 1 + EPS
    unclipped, clipped = -A * r, -A * min(max(r, lo), hi)
    value = S * max(unclipped, clipped)
    if unclipped > clipped:  # the pessimistic bound is the unclipped term: its gradient flows
        grad = -A * r * S
    elif unclipped < clipped:  # the clipped term, outside the band: a constant, no gradient
        grad = 0.0
    else:  # equal: r inside the band, both terms are -A r
        grad = -A * r * S
    return value, grad


def test_sgd_step_raises_logp_for_positive_advantage():
    adv = torch.tensor([1.5, -0.7, 0.0, 2.0])
    logp = torch.tensor([-1.0, -2.0, -0.5, 0.3], requires_grad=True)
    loss, terms = call(logp, logp.detach().clone(), adv, scale=torch.tensor([1.0, 2.0, 1.0, 0.5]))
    assert torch.equal(terms.ratio, torch.ones(4))  # theta == theta_old: ratio 1
    loss.backward()
    new = logp.detach() - 0.1 * logp.grad  # one SGD step on the loss
    assert new[0] > logp[0] and new[3] > logp[3]  # A > 0: the rollout becomes more likely
    assert new[1] < logp[1]  # A < 0: less likely
    assert new[2] == logp[2]  # A = 0: untouched
    # and the size: -A S per clip at ratio 1
    assert torch.allclose(logp.grad, torch.tensor([-1.5, 1.4, 0.0, -1.0]))


def test_clip_is_pessimistic_for_both_signs_of_the_advantage():
    cases = [(A, r) for A in (1.3, -0.8) for r in (1 - 5 * EPS, 1 - EPS / 3, 1.0, 1 + EPS / 2, 1 + 7 * EPS, 1.3, 0.6)]
    A = torch.tensor([a for a, _ in cases], dtype=torch.float64)
    r = torch.tensor([x for _, x in cases], dtype=torch.float64)
    logp_old = torch.full_like(r, -0.25)
    logp = (logp_old + r.log()).requires_grad_()
    S = 1.7
    loss, terms = call(logp, logp_old, A, scale=S)
    loss.backward()
    for i, (a, x) in enumerate(cases):
        value, grad = ref_policy(x, a, S)
        assert math.isclose(terms.policy[i].item(), value, rel_tol=1e-9), (a, x)
        assert math.isclose(logp.grad[i].item(), grad, rel_tol=1e-9, abs_tol=1e-12), (a, x, logp.grad[i].item(), grad)
    # the four outside-band cases: unclipped where (A > 0, r low) and (A < 0, r high), clipped otherwise
    grads = dict(zip(cases, logp.grad.tolist()))
    assert grads[(1.3, 1 - 5 * EPS)] != 0 and grads[(-0.8, 1 + 7 * EPS)] != 0
    assert grads[(1.3, 1 + 7 * EPS)] == 0 and grads[(-0.8, 1 - 5 * EPS)] == 0


def test_kl_terms_measure_against_their_own_means_and_equal_torch_distributions():
    g = torch.Generator().manual_seed(0)
    n, d = 3, 5
    mean = torch.randn(n, d, generator=g, dtype=torch.float64).requires_grad_()
    mean_anchor = mean.detach() + 0.3 * torch.randn(n, d, generator=g, dtype=torch.float64)
    mean_old = mean.detach() + 0.05 * torch.randn(n, d, generator=g, dtype=torch.float64)
    std = torch.tensor([0.5, 0.2, 0.9], dtype=torch.float64)
    lam, bp, bv, denom = 0.01, 1.0, 0.1, 4.0
    logp = torch.zeros(n, dtype=torch.float64)
    loss, terms = call(logp, logp, torch.zeros(n, dtype=torch.float64), mean, mean_anchor, mean_old, std,
                       scale=3.0, lam=lam, beta_pos=bp, beta_vel=bv, denom=denom)
    N = torch.distributions.Normal
    for i in range(n):
        kl_a = torch.distributions.kl_divergence(N(mean[i].detach(), std[i]), N(mean_anchor[i], std[i])).mean().item()
        kl_o = torch.distributions.kl_divergence(N(mean[i].detach(), std[i]), N(mean_old[i], std[i])).mean().item()
        assert math.isclose(terms.kl_pos[i].item(), kl_a, rel_tol=1e-6)  # gaussian_kl works in float32
        assert math.isclose(terms.kl_vel[i].item(), kl_o, rel_tol=1e-6)
    assert math.isclose(loss.item(), lam * (bp * terms.kl_pos + bv * terms.kl_vel).sum().item() / denom, rel_tol=1e-6)
    # gradient w.r.t. the mean: lam (bp (m - m_a) + bv (m - m_o)) / (std^2 d) / denom, whatever S_t is
    loss.backward()
    for i in range(n):
        for j in range(d):
            m, ma, mo = mean[i, j].item(), mean_anchor[i, j].item(), mean_old[i, j].item()
            ref = lam * (bp * (m - ma) + bv * (m - mo)) / (std[i].item() ** 2 * d) / denom
            assert math.isclose(mean.grad[i, j].item(), ref, rel_tol=1e-5, abs_tol=1e-12)
    # each term off alone
    _, t = call(logp, logp, torch.zeros(n, dtype=torch.float64), mean, None, mean_old, std)
    assert torch.equal(t.kl_pos, torch.zeros(n, dtype=torch.float64)) and torch.equal(t.kl_vel, terms.kl_vel)
    _, t = call(logp, logp, torch.zeros(n, dtype=torch.float64), mean, mean_anchor, None, std)
    assert torch.equal(t.kl_vel, torch.zeros(n, dtype=torch.float64)) and torch.equal(t.kl_pos, terms.kl_pos)


def test_equalizer_scales_the_policy_term_only():
    g = torch.Generator().manual_seed(1)
    mean0 = torch.randn(2, 4, generator=g)
    grads = []
    for S in (1.0, 8.0):
        logp = torch.tensor([-0.3, -0.4], requires_grad=True)
        mean = mean0.clone().requires_grad_()
        loss, _ = call(logp, logp.detach(), torch.tensor([1.0, -1.0]), mean, mean0 + 0.1, mean0 - 0.2,
                       scale=torch.tensor([S, S]), lam=0.5)
        loss.backward()
        grads.append((logp.grad.clone(), mean.grad.clone()))
    assert torch.allclose(grads[1][0], 8.0 * grads[0][0])  # the policy gradient scales with S_t
    assert torch.equal(grads[1][1], grads[0][1])  # the KL gradient does not


def test_nan_reward_clip_gets_no_gradient_at_all():
    logp = torch.tensor([-0.3, -0.4, -0.5], requires_grad=True)
    mean = torch.randn(3, 4, generator=torch.Generator().manual_seed(2), requires_grad=True)
    valid = torch.tensor([1.0, 0.0, 1.0])  # clip 1: its reward was NaN (advantage 0, left out)
    loss, _ = call(logp, logp.detach() + 0.01, torch.tensor([0.8, 0.0, -0.8]), mean, mean.detach() + 0.3,
                   mean.detach() - 0.3, scale=2.0, lam=0.5, valid=valid)
    loss.backward()
    assert logp.grad[1] == 0 and torch.equal(mean.grad[1], torch.zeros(4))  # KL included
    assert logp.grad[0] != 0 and mean.grad[0].abs().sum() > 0 and mean.grad[2].abs().sum() > 0
    # a non-finite term of a dropped clip does not poison the loss
    bad = mean.detach().clone()
    bad[1] = float('nan')
    loss, _ = call(logp, logp.detach(), torch.tensor([0.8, 0.0, -0.8]), mean, bad, None, lam=0.5, valid=valid)
    assert torch.isfinite(loss)


def test_normalisation_over_valid_clips_trained_steps_and_ranks():
    """Clips spread over 2 ranks, T trained steps each, micro-batches of 2: the per-rank sums of
    loss / denominator, averaged over ranks as FSDP does, give the gradient of the mean over valid
    (clip, step) pairs, computed here by hand."""
    g = torch.Generator().manual_seed(3)
    world, n, T = 2, 6, 3
    A = torch.randn(n, generator=g, dtype=torch.float64)
    valid = torch.tensor([1, 1, 0, 1, 1, 1], dtype=torch.float64)
    S = torch.rand(T, generator=g, dtype=torch.float64) + 0.5
    c = torch.randn(n, T, generator=g, dtype=torch.float64)  # logp_{i,t} = theta * c_{i,t}
    # reference: d/dtheta of mean over valid (i, t) of S_t * (-A_i) * exp(theta c - theta c) at theta = 0
    pairs = [(i, t) for i in range(n) for t in range(T) if valid[i] > 0]
    ref = sum(-A[i].item() * S[t].item() * c[i, t].item() for i, t in pairs) / len(pairs)
    denom = denominator(valid.sum().item(), T, world)
    per_rank = []
    for rank in range(world):
        theta = torch.zeros((), dtype=torch.float64, requires_grad=True)
        mine = list(range(rank * n // world, (rank + 1) * n // world))
        for b in (mine[:2], mine[2:]):  # micro-batches
            for t in range(T):
                logp = theta * c[b, t]
                loss, _ = call(logp, logp.detach(), A[b], mean=torch.zeros(len(b), 2, dtype=torch.float64),
                               std=torch.ones(len(b), dtype=torch.float64), scale=S[t], valid=valid[b], denom=denom)
                loss.backward()
        per_rank.append(theta.grad.item())
    assert math.isclose(sum(per_rank) / world, ref, rel_tol=1e-12)
    assert denominator(0, T, world) == T / world  # no valid clip: no division by zero (the loss is 0)


def test_sample_estimator_of_the_velocity_term_is_the_log_ratio():
    """kl_estimator='sample' (the released step-wise term): log pi_old - log pi_theta of the rollout's own
    sample; 0 at theta_old and yet a gradient of -lam beta_vel / denom per clip on logp, where the exact
    KL's is 0."""
    logp = torch.tensor([-0.3, -0.4, -0.5], dtype=torch.float64, requires_grad=True)
    old = logp.detach() + torch.tensor([0.0, 0.02, -0.01], dtype=torch.float64)
    mean = torch.zeros(3, 2, dtype=torch.float64, requires_grad=True)
    lam, bv, denom = 0.5, 0.1, 2.0
    loss, t = call(logp, old, torch.zeros(3, dtype=torch.float64), mean, None, mean.detach() + 0.1, lam=lam,
                   beta_vel=bv, denom=denom, kl_estimator='sample')
    assert torch.allclose(t.kl_vel, old - logp.detach(), rtol=0, atol=1e-15)
    loss.backward()
    assert torch.allclose(logp.grad, torch.full((3,), -lam * bv / denom, dtype=torch.float64))
    assert mean.grad is None or torch.equal(mean.grad, torch.zeros(3, 2, dtype=torch.float64))
    _, exact = call(logp, old, torch.zeros(3, dtype=torch.float64), mean, None, mean.detach() + 0.1, lam=lam,
                    beta_vel=bv, denom=denom)
    assert torch.allclose(exact.kl_vel.double(), torch.full((3,), 0.1 ** 2 / 2, dtype=torch.float64))  # (0.1)^2 / (2 std^2)


def test_on_policy_the_ratio_is_the_forward_own_and_losers_keep_their_gradient():
    """train.py's default (updates_per_iter = 1, on_policy): the old log-prob and mean are the recomputed
    forward's own, detached. The rollout's log-probs sit 1e-3 above (a velocity mismatch always lowers the
    recomputed log-prob of the sampled step: -|dm|^2 / 2 std^2; another batch shape's rounding, beyond
    the 1e-4 clip): the ratio is exactly 1 all the same, every clip's gradient on logp is -A S (the
    reference at r = 1), losers included, and the exact velocity KL and its gradient are 0."""
    adv = torch.tensor([1.2, -0.9, -2.0, 0.4], dtype=torch.float64)
    logp = torch.tensor([-0.2, -0.6, -1.1, 0.1], dtype=torch.float64, requires_grad=True)
    rollout = logp.detach() + 1e-3  # what the rollout's forward gave
    mean = torch.randn(4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).requires_grad_()
    S, lam = torch.tensor([2.0, 0.5, 1.0, 3.0], dtype=torch.float64), 0.7
    loss, t = call(logp, rollout, adv, mean, None, mean.detach() + 0.2, scale=S, lam=lam, on_policy=True)
    assert torch.equal(t.ratio, torch.ones(4, dtype=torch.float64)) and torch.equal(t.kl_vel, torch.zeros(4))
    loss.backward()
    expected = [ref_policy(1.0, a, s)[1] for a, s in zip(adv.tolist(), S.tolist())]
    assert torch.allclose(logp.grad, torch.tensor(expected, dtype=torch.float64)), (logp.grad, expected)
    assert (logp.grad[adv < 0] > 0).all()  # the losers: pushed down (an SGD step lowers their logp)
    assert torch.equal(mean.grad, torch.zeros_like(mean))  # the velocity KL to its own detached mean
    # the same clips against the rollout's log-probs (train.py before: the ratio exp(-1e-3) < 1 - 1e-4)
    logp.grad = None
    loss, t = call(logp, rollout, adv, scale=S)
    loss.backward()
    assert (logp.grad[adv < 0] == 0).all() and (t.ratio < 1 - EPS).all()  # every loser's gradient clipped away
