"""The KL/policy gradient ratio the optimizer sees (extras/diagnostics.py GradientSplit: the norms of the
step's summed KL-term and policy-term gradients in parameter space) and the lambda_KL setting that holds it
(kl_ratio_target, docs/method.md 5.6). python -m pytest tests/test_kl_ratio.py (-m slow: the toy runs)"""
import json
import os
import subprocess
import sys

import pytest
import torch

import trust_region as tr
from extras.diagnostics import GradientSplit
from trust_region import RatioHold

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _normal_logp(x, mean, std):  # (B,) averaged over elements, as sde.step's log-prob
    return torch.distributions.Normal(mean, std).log_prob(x).flatten(1).mean(1)


def _clips(n, seed=0):
    """n clips through one shared network (a linear map of their inputs): transition means (n, 8), a
    std, the rollout's x_next, zero-mean advantages, and an anchor a fixed displacement away."""
    g = torch.Generator().manual_seed(seed)
    net = torch.nn.Linear(16, 8)
    with torch.no_grad():
        net.weight.copy_(torch.randn(8, 16, generator=g) * 0.3)
        net.bias.zero_()
    x = torch.randn(n, 16, generator=g)
    std = torch.full((n,), 0.5)
    with torch.no_grad():
        x_next = net(x) + 0.5 * torch.randn(n, 8, generator=g)
        anchor_w = net.weight - 0.05 * torch.randn(8, 16, generator=g)  # where the anchor sits
    adv = torch.randn(n, generator=g)
    adv = (adv - adv.mean()) / adv.std()  # GRPO's: zero mean
    return net, x, std, x_next, anchor_w, adv


def _terms(net, x, std, x_next, anchor_w, adv, b):
    mean = net(x[b])  # (m, 8)
    logp = _normal_logp(x_next[b], mean, std[b].view(-1, 1))
    policy = -adv[b] * torch.exp(logp - logp.detach())  # the on-policy objective's per-clip term
    kl = tr.gaussian_kl(mean, x[b] @ anchor_w.T + net.bias.detach(), std[b])
    return policy, kl


@pytest.mark.parametrize('n', [16, 160])
def test_the_split_is_the_brute_force_summed_gradients(n):
    # many clips share the weights: their KL gradients (all pulling back along one displacement) add,
    # their policy gradients (zero-mean advantages, independent noise) largely cancel. The split over
    # micro-batches must give the norms of the two *summed* gradients, and leave their sum for the step
    lam, denom = 0.3, float(n)
    net, x, std, x_next, anchor_w, adv = _clips(n)
    opt = torch.optim.SGD(net.parameters(), lr=0.0)
    split = GradientSplit([opt], 0, always=True)
    for b in torch.arange(n).split(8):  # micro-batches of 8 clips
        policy, kl = _terms(net, x, std, x_next, anchor_w, adv, b)
        valid = torch.ones(len(b))
        loss = torch.where(valid > 0, policy + lam * kl, 0.0).sum() / denom  # train.step_loss's form
        split.backward(loss, dict(policy=policy, kl=kl, valid=valid), denom)
    r1 = split.measure(lam)
    summed = {name: p.grad.clone() for name, p in net.named_parameters()}
    # brute force: the whole batch's two terms, each differentiated on its own
    policy, kl = _terms(net, x, std, x_next, anchor_w, adv, torch.arange(n))
    g_pol = torch.autograd.grad(policy.sum() / denom, list(net.parameters()), retain_graph=True)
    g_kl = torch.autograd.grad(lam * kl.sum() / denom, list(net.parameters()))
    norm = lambda gs: torch.sqrt(sum((g.double() ** 2).sum() for g in gs)).item()  # noqa: E731
    want = norm(g_kl) / norm(g_pol)
    assert split.logged == pytest.approx(want, rel=1e-4) and r1 == pytest.approx(want / lam, rel=1e-4)
    for (name, got), a, b in zip(summed.items(), g_pol, g_kl):  # the step sees the sum, as one backward
        torch.testing.assert_close(got, a + b, rtol=1e-5, atol=1e-7, msg=name)
    # the per-clip estimate this replaces (each clip's KL/policy norms at the transition mean, in
    # quadrature) misses the coherence: the summed KL gradient is many times its share
    per_clip = []
    for i in range(n):
        p_i, k_i = _terms(net, x, std, x_next, anchor_w, adv, torch.tensor([i]))
        per_clip.append((norm(torch.autograd.grad(lam * k_i.sum(), list(net.parameters()), retain_graph=True)),
                         norm(torch.autograd.grad(p_i.sum(), list(net.parameters())))))
    estimate = (sum(k ** 2 for k, _ in per_clip) / sum(p ** 2 for _, p in per_clip)) ** 0.5
    assert want > {16: 1.2, 160: 3.0}[n] * estimate, (want, estimate)  # ~sqrt(n) apart: 1.3x, ~4x


def test_off_is_one_backward_and_measures_nothing():
    net, x, std, x_next, anchor_w, adv = _clips(8)
    opt = torch.optim.SGD(net.parameters(), lr=0.0)
    split = GradientSplit([opt], 1)
    policy, kl = _terms(net, x, std, x_next, anchor_w, adv, torch.arange(8))
    loss = (policy + 0.1 * kl).sum() / 8
    split.backward(loss, dict(policy=policy, kl=kl, valid=torch.ones(8)), 8.0)
    want = torch.autograd.grad((lambda p, k: (p + 0.1 * k).sum() / 8)(*_terms(net, x, std, x_next, anchor_w, adv,
                                                                              torch.arange(8))), [net.weight])[0]
    assert torch.equal(net.weight.grad, want)
    assert split.measure(0.1) is None and split.logged is None


def test_ratio_target_holds_the_ratio_over_an_anchor_period():
    # the KL gradient grows with the steps since the anchor's refresh (0 right after it) and is linear
    # in lambda: r1_k = c (k mod 10). The held ratio lambda * r1, averaged over a period, is the target.
    target, c = 0.03, 2.0
    ctl = RatioHold(lam_init=1e-7, target=target)
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
    mk = lambda: RatioHold(lam_init=1e-3, target=0.05)  # noqa: E731
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


def test_a_checkpoint_of_the_other_rule_is_named():
    # a run saved under one lambda_KL rule and resumed under the other: one line naming the setting
    paper = tr.KLController(1e-7, 1e-7, 1e-5, 1e-5, 100)
    paper.update(1e-6)
    with pytest.raises(SystemExit, match='kl_ratio_target=0'):
        RatioHold(1e-7, 1.0).load_state_dict(paper.state_dict())
    hold = RatioHold(1e-7, 1.0)
    hold.update(0.0, 2.0)
    with pytest.raises(SystemExit, match='resume it with that kl_ratio_target'):
        tr.KLController(1e-7, 1e-7, 1e-5, 1e-5, 100).load_state_dict(hold.state_dict())


def test_train_defaults_hold_the_ratio_and_the_release_keeps_the_paper(tmp_path, monkeypatch):
    # train.py's default lambda_KL is the hold (kl_ratio_target 1, measured every step: a kl_ratio in
    # every row); by hand from the log: the step's lambda is the previous row's (kl_init first), its r1 =
    # kl_ratio / lambda, and the next lambda is 1 / mean(r1 so far) once one is positive
    from test_train import SMALL, metrics, run_here
    out = str(tmp_path / 'run')
    run_here(monkeypatch, SMALL + [f'--out_dir={out}', '--max_iters=4', '--diag_every=0', '--save_every=0'])
    rows = [r for r in metrics(out) if 'reward' in r]
    lam, r1s = 1e-7, []  # train.py's kl_init
    for r in rows:
        r1s.append(r['kl_ratio'] / lam)
        mean = sum(r1s) / len(r1s)
        lam = 1.0 / mean if mean > 0 else lam
        assert r['lambda_kl'] == pytest.approx(lam, rel=1e-6), (rows, r1s)
    assert r1s[0] == 0 and all(r > 0 for r in r1s[1:]) and rows[-1]['lambda_kl'] > 1e-3
    # the release and the paper's baselines keep their constants (config/released.py, config/fixed_kl.py)
    for name, want in (('released', dict(kl_ratio_target=0.0, kl_update='backward')),
                       ('fixed_kl', dict(kl_ratio_target=0.0, kl_init=0.04))):
        cfg = {}
        exec(open(os.path.join(ROOT, 'config', name + '.py')).read(), {}, cfg)
        assert {k: cfg[k] for k in want} == want, name


@pytest.mark.slow
def test_toy_run_holds_the_ratio_in_a_band(tmp_path):
    # the toy (config/toy.py: dual KL, anchor every 10 steps), lambda_KL held by the ratio target, the
    # ratio measured on every step: after three anchor periods the mean logged ratio of the last period
    # is within [0.7, 1.4] x the target
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
    est = [r['kl_ratio'] for r in rows]
    assert len(est) == 30
    late = sum(est[-10:]) / 10
    assert 0.7 * target <= late <= 1.4 * target, (late, est)
    assert rows[-1]['lambda_kl'] > 1e-4  # far above the paper's 1e-5: the target, not the schedule


@pytest.mark.slow
def test_two_ranks_log_the_ratio_of_one_process(tmp_path):
    # the norms are of the summed gradient after FSDP's reduction: 2 ranks and 1 process log one ratio,
    # and train.py's default lambda_KL, which holds it, moves the same (iteration 1: r1 0, lambda kl_init)
    common = ['config/toy.py', '--max_iters=3', '--prompts_per_iter=2', '--group_size=2', '--eval_every=0',
              '--save_every=0', '--export_dtype=', '--diag_every=0', '--train_batch=1', '--rollout_batch=2']
    rows = {}
    for nproc in (1, 2):
        out = tmp_path / f'n{nproc}'
        head = [sys.executable] if nproc == 1 else [sys.executable, '-m', 'torch.distributed.run', '--standalone',
                                                    f'--nproc_per_node={nproc}']
        p = subprocess.run(head + ['train.py'] + common + [f'--out_dir={out}'], cwd=ROOT, capture_output=True,
                           text=True, env=dict(os.environ, OMP_NUM_THREADS='1'))
        assert p.returncode == 0, p.stderr[-3000:]
        rows[nproc] = [(r['kl_ratio'], r['lambda_kl']) for r in map(json.loads, open(out / 'metrics.jsonl'))
                       if 'reward' in r]
    assert len(rows[1]) == 3 and rows[1][0] == (0.0, 1e-7) and rows[1][1][0] > 0 and rows[1][2][1] > 1e-3
    assert [x for r in rows[2] for x in r] == pytest.approx([x for r in rows[1] for x in r], rel=1e-3)
