"""The logged KL/policy gradient ratio (kl_ratio_est) and the lambda_KL setting that holds it
(kl_ratio_target, docs/method.md 5.6). python -m pytest tests/test_kl_ratio.py (-m slow: the toy run)"""
import json
import os
import subprocess
import sys

import pytest
import torch

import trust_region as tr

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _normal_logp(x, mean, std):  # (B,) averaged over elements, as sde.step's log-prob
    return torch.distributions.Normal(mean, std).log_prob(x).flatten(1).mean(1)


def test_output_grad_sq_is_the_closed_form_and_leaves_the_weights_alone():
    g = torch.Generator().manual_seed(0)
    B, D, std = 3, 12, 0.4
    net = torch.nn.Linear(5, D)
    mean = net(torch.randn(B, 5, generator=g))  # (B, D): a non-leaf, like the policy's transition mean
    x_next, ref = torch.randn(B, D, generator=g), torch.randn(B, D, generator=g)
    adv = torch.tensor([1.5, -0.5, 0.0])
    logp = _normal_logp(x_next, mean, std)
    policy = -adv * torch.exp(logp - logp.detach())  # at theta_old: the ratio's value is 1
    kl = tr.gaussian_kl(mean, ref, std)
    # closed forms of d term_i / d mean_i: -A (x - m) / (D std^2) and (m - ref) / (D std^2)
    want_p = ((-adv[:, None] * (x_next - mean) / (D * std**2)) ** 2).sum(1)
    want_k = (((mean - ref) / (D * std**2)) ** 2).sum(1)
    assert torch.allclose(tr.output_grad_sq(policy, mean), want_p.detach(), rtol=1e-5)
    assert torch.allclose(tr.output_grad_sq(kl, mean), want_k.detach(), rtol=1e-5)
    assert net.weight.grad is None  # autograd stopped at the mean: nothing accumulated
    (policy + kl).sum().backward()  # the graph is kept for the backward that follows
    assert net.weight.grad is not None
    off = torch.zeros(B)  # a term that is off
    assert torch.equal(tr.output_grad_sq(off, mean.detach()), torch.zeros(B))


def test_ratio_equals_the_parameter_gradient_ratio_where_the_mean_is_the_parameter():
    # one clip whose transition mean is the trained tensor itself (the identity Jacobian): the ratio
    # of the output-gradient norms is the ratio of the two terms' parameter-gradient norms
    g = torch.Generator().manual_seed(1)
    D, std, lam = 50, 0.3, 0.37
    theta = torch.randn(1, D, generator=g).requires_grad_()
    x_next, anchor = torch.randn(1, D, generator=g), theta.detach() + 0.1 * torch.randn(1, D, generator=g)
    mean = theta * 1.0  # a non-leaf view of the parameter
    logp = _normal_logp(x_next, mean, std)
    policy, kl = -0.8 * torch.exp(logp - logp.detach()), tr.gaussian_kl(mean, anchor, std)
    r1 = (tr.output_grad_sq(kl, mean) / tr.output_grad_sq(policy, mean)).sqrt().item()
    gp, = torch.autograd.grad(policy.sum(), theta, retain_graph=True)
    gk, = torch.autograd.grad(lam * kl.sum(), theta)
    assert lam * r1 == pytest.approx((gk.norm() / gp.norm()).item(), rel=1e-5)


def test_ratio_target_holds_the_ratio_over_an_anchor_period():
    # the KL gradient grows with the steps since the anchor's refresh (0 right after it) and is linear
    # in lambda: r1_k = c (k mod 10). The held ratio lambda * r1, averaged over a period, is the target.
    target, c = 0.03, 2.0
    ctl = tr.KLController(lam_init=1e-7, lam_min=1e-7, lam_max=1e-5, target=1e-5, warmup=100,
                          ratio_target=target)
    held = []
    for k in range(40):
        r1 = c * (k % 10)
        if k == 0:
            assert ctl.value == 1e-7  # lam_init until a positive r1 is seen
        held.append(ctl.value * r1)
        ctl.update(kl=1.0, r1=r1)
        if k == 5:  # a non-finite measurement (no valid clip) is left out
            before = ctl.value
            ctl.update(kl=1.0, r1=float('nan'))
            assert ctl.value == before
    # after the first full window the period mean is held exactly (kl_min/kl_max not read)
    last = held[-10:]
    assert sum(last) / 10 == pytest.approx(target, rel=1e-9)
    assert ctl.value == pytest.approx(target / (c * 4.5))


def test_ratio_target_resumes_bitwise():
    def drive(ctl, ks):
        for k in ks:
            ctl.update(kl=0.1 * k, r1=0.5 + (k % 7))
        return ctl.value
    mk = lambda: tr.KLController(lam_init=1e-3, lam_min=0, lam_max=1, target=1, warmup=0, ratio_target=0.05)
    straight = mk()
    drive(straight, range(23))
    first = mk()
    drive(first, range(11))
    again = mk()
    again.load_state_dict(json.loads(json.dumps(first.state_dict())))  # as a checkpoint stores it
    assert drive(again, range(11, 23)) == straight.value
    old = first.state_dict()
    del old['ratios']  # an older checkpoint: no ratio history
    mk().load_state_dict(old)


@pytest.mark.slow
def test_toy_run_holds_the_ratio_in_a_band(tmp_path):
    # the toy (config/toy.py: dual KL, anchor every 10 steps), lambda_KL held by the ratio target:
    # over the last two anchor periods the mean logged ratio is within [0.5, 2] x the target
    target = 0.02
    out = tmp_path / 'run'
    cmd = [sys.executable, 'train.py', 'config/toy.py', f'--out_dir={out}', '--max_iters=30',
           '--prompts_per_iter=4', '--eval_every=0', '--save_every=0', '--export_dtype=',
           '--diag_every=0', f'--kl_ratio_target={target}']
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                       env=dict(os.environ, OMP_NUM_THREADS='1'))
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(l) for l in open(out / 'metrics.jsonl')]
    rows = [r for r in rows if 'reward' in r]
    est = [r['kl_ratio_est'] for r in rows]
    assert len(est) == 30
    late = sum(est[-20:]) / 20
    assert 0.5 * target <= late <= 2 * target, (late, est)
    assert rows[-1]['lambda_kl'] > 1e-3  # far above the paper's 1e-5: the target, not the schedule
