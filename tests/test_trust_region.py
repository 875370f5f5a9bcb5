"""KL, anchor and lambda_KL controller. python -m pytest tests/test_trust_region.py
(the FSDP2 test launches tests/fsdp_anchor_worker.py under torchrun, 2 CPU processes, gloo)"""
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
from peft import LoraConfig, get_peft_model

import trust_region as tr
from infra.anchor import Anchor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repo root
# the schedule of docs/method.md 5.5 (train.py's kl_init, kl_min, kl_max, kl_target, kl_warmup)
PAPER = dict(lam_init=1e-7, lam_min=1e-7, lam_max=1e-5, target=1e-5, warmup=100)


def test_gaussian_kl_is_the_mean_log_ratio():
    # KL(a || b) = E_{x~a}[logp_a(x) - logp_b(x)], logp averaged over elements like sde.step's
    g = torch.Generator().manual_seed(0)
    mean_a, mean_b = torch.randn(2, 3, 4, generator=g), torch.randn(2, 3, 4, generator=g)  # (B, ...)
    std = torch.tensor([0.7, 1.3])  # (B,)
    kl = tr.gaussian_kl(mean_a, mean_b, std)
    assert kl.shape == (2,) and kl.dtype == torch.float32
    sd = std.view(2, 1, 1)  # (B, 1, 1): broadcasts over (M, B, 3, 4)
    x = mean_a + sd * torch.randn(20000, 2, 3, 4, generator=g)  # (M, B, ...) samples of a
    logp = lambda m: torch.distributions.Normal(m, sd).log_prob(x).flatten(2).mean(2)  # (M, B)
    diff = logp(mean_a) - logp(mean_b)  # (M, B)
    err = diff.std(0) / math.sqrt(len(diff))  # standard error of the Monte-Carlo mean
    assert ((diff.mean(0) - kl).abs() < 3 * err).all(), (diff.mean(0), kl, err)
    assert torch.allclose(tr.gaussian_kl(mean_a, mean_b, 0.7), tr.gaussian_kl(mean_a, mean_b, std[[0, 0]]))


# ---- lambda_KL controller ----

def test_controller_warmup_deadband_and_clip():
    c = tr.KLController(**PAPER)
    assert c.value == 1e-7  # optimizer step 0 trains with lam_init
    values = [c.update(0.0) for _ in range(100)]  # KL ignored during warm-up
    assert math.isclose(values[0], 1e-7 + (1e-5 - 1e-7) / 100)  # after update 1: step 1's value
    assert math.isclose(values[49], 1e-7 + (1e-5 - 1e-7) / 2)
    assert math.isclose(values[-1], 1e-5) and c.value == values[-1]
    c = tr.KLController(**dict(PAPER, warmup=0, lam_init=1e-6))
    assert math.isclose(c.update(1e-5), 1e-6)  # inside the deadband: unchanged
    assert math.isclose(c.update(3e-5), 1e-6 * 0.9)  # window mean 2e-5 > 1.5e-5: printed rule relaxes
    c = tr.KLController(**dict(PAPER, warmup=0, lam_init=1e-6), direction=-1)
    c.update(1e-5)
    assert math.isclose(c.update(3e-5), 1e-6 * 1.1)  # the stabilising rule tightens
    c = tr.KLController(**dict(PAPER, warmup=0, lam_init=1e-5))
    assert c.update(0.0) == 1e-5  # would grow, clipped at lam_max
    c = tr.KLController(**dict(PAPER, warmup=0, lam_init=1e-7))
    assert c.update(1.0) == 1e-7  # would shrink, clipped at lam_min
    c2 = tr.KLController(**PAPER)
    c2.load_state_dict(c.state_dict())
    assert c2.state_dict() == c.state_dict() and isinstance(c.state_dict()['history'], list)


@pytest.mark.parametrize('lam_max', [1e-5, 1e-3])
def test_controller_direction_in_a_loop(lam_max):
    # the policy drifts less the stronger the penalty: observed KL = k / lambda, KL = target at 1e-6
    k = 1e-6 * PAPER['target']
    for start in dict(), dict(warmup=0, lam_init=1e-7):  # after the warm-up (at lam_max) / from below
        printed = tr.KLController(**dict(PAPER, lam_max=lam_max, **start))
        flipped = tr.KLController(**dict(PAPER, lam_max=lam_max, **start), direction=-1)
        for _ in range(1000):
            printed.update(k / printed.value)
            flipped.update(k / flipped.value)
        assert printed.value in (printed.lam_min, lam_max)  # the printed rule runs to a bound
        assert 0.5 < k / flipped.value / PAPER['target'] < 1.5  # the flipped rule settles in the deadband
        before = flipped.value
        flipped.update(k / flipped.value)
        assert flipped.value == before


def paper_lambdas(kls, direction=+1):
    """lambda_KL after each update, docs/method.md section 5.5 in plain Python with its literal numbers: linear
    warm-up 1e-7 -> 1e-5 over the first 100 updates, then the mean of the last 10 observed KLs vs.
    the target 1e-5: above 1.5x -> *0.9, below 0.5x -> *1.1 (direction +1; -1 swaps them), clipped
    to [1e-7, 1e-5]."""
    lam, seen, out = 1e-7, [], []
    for k, kl in enumerate(kls, start=1):
        seen.append(kl)
        if k <= 100:
            lam = 1e-7 + (1e-5 - 1e-7) * k / 100
        else:
            window = seen[-10:]
            mean = sum(window) / len(window)
            if mean > 1.5e-5:
                lam *= 0.9 if direction > 0 else 1.1
            elif mean < 0.5e-5:
                lam *= 1.1 if direction > 0 else 0.9
            lam = min(max(lam, 1e-7), 1e-5)
        out.append(lam)
    return out


def run(kls, **kw):
    c = tr.KLController(**PAPER, **kw)
    return [c.update(kl) for kl in kls]


def test_controller_ends_warmup_exactly():
    # KL far above the deadband all along: a deadband update would shrink lambda, so update 100
    # (the last of the warm-up) must still give exactly lam_max, and update 101 the first * 0.9
    got = run([1e-3] * 102)
    assert got == pytest.approx(paper_lambdas([1e-3] * 102), rel=1e-12, abs=0)
    assert got[98] == pytest.approx(1e-7 + (1e-5 - 1e-7) * 99 / 100, rel=1e-12)  # update 99
    assert got[99] == 1e-5  # update 100 = warmup: exactly lam_max
    assert got[100] == pytest.approx(0.9e-5, rel=1e-12)  # update 101: the deadband rule
    assert got[101] == pytest.approx(0.81e-5, rel=1e-12)
    # far below: update 101 would grow lambda, clipped at lam_max, so it stays
    assert run([0.0] * 101)[99:] == [1e-5, 1e-5]



def test_warmup_starts_at_kl_init_not_kl_min():
    # kl_init 1e-6 above the floor kl_min 1e-7: the warm-up runs 1e-6 -> 1e-5 over 4 updates, by hand
    # 1e-6 + 9e-6 k / 4; from the floor it would be 1e-7 + 9.9e-6 k / 4 (3.3e-6 vs 3.25e-6 at k = 1)
    c = tr.KLController(lam_init=1e-6, lam_min=1e-7, lam_max=1e-5, target=1e-5, warmup=4)
    assert c.value == 1e-6  # the first optimizer step trains with kl_init
    got = [c.update(1e-3) for _ in range(4)]
    assert got == pytest.approx([3.25e-6, 5.5e-6, 7.75e-6, 1e-5], rel=1e-12, abs=0)
    assert c.update(1e-3) == pytest.approx(0.9e-5, rel=1e-12)  # then the deadband rule (KL far above)

def edge_kls():
    """KLs whose windows sit at the deadband's edges after the warm-up; returns (kls, checks), checks
    = [(update index, 'same' or factor)] saying what each edge update must do to lambda."""
    kls = [1e-5] * 100 + [1e-4] * 5  # warm-up at the target; then high: lambda 1e-5 * 0.9^5, off the bounds
    kls += [1e-5] * 10  # the window is back at the target: unchanged at its end
    checks = [(len(kls) - 1, 'same')]
    kls += [5e-5]  # mean (9e-5 + 5e-5) / 10 = 1.4e-5: inside, though the last KL is 3.3x the target
    checks.append((len(kls) - 1, 'same'))
    kls += [0.0]  # mean (8e-5 + 5e-5) / 10 = 1.3e-5: inside, though the last KL is below 0.5x
    checks.append((len(kls) - 1, 'same'))
    kls += [1.58e-5] * 9 + [1e-5]  # mean 1.522e-5: just above 1.5x, though the last KL is the target
    checks.append((len(kls) - 1, 0.9))
    kls += [0.42e-5] * 9 + [1e-5]  # mean 0.478e-5: just below 0.5x, though the last KL is the target
    checks.append((len(kls) - 1, 1.1))
    kls += [1.45e-5] * 9 + [2e-5]  # mean 1.505e-5 (just above) with the last above too
    checks.append((len(kls) - 1, 0.9))
    kls += [1.4e-5] * 10 + [1.6e-5]  # mean 1.42e-5: just inside with the last just outside
    checks.append((len(kls) - 1, 'same'))
    return kls, checks


def test_controller_deadband_uses_the_window_mean_not_the_last_kl():
    kls, checks = edge_kls()
    got, want = run(kls), paper_lambdas(kls)
    assert got == pytest.approx(want, rel=1e-12, abs=0)
    for i, what in checks:
        assert 1e-7 < want[i - 1] < 1e-5 / 1.1  # off the clip bounds: a change would show
        expect = want[i - 1] if what == 'same' else want[i - 1] * what
        assert got[i] == pytest.approx(expect, rel=1e-12), (i, what)


@pytest.mark.parametrize('direction', [+1, -1])
def test_controller_matches_paper_reference_on_random_kls(direction):
    g = torch.Generator().manual_seed(direction % 7)
    # log-uniform KLs from 0.1x to 10x the target, with runs that hold the window on one side
    kls = (1e-5 * 10 ** (2 * torch.rand(600, generator=g, dtype=torch.float64) - 1)).tolist()
    kls[300:340] = [3e-5] * 40
    kls[400:460] = [1e-6] * 60
    got, want = run(kls, direction=direction), paper_lambdas(kls, direction)
    assert got == pytest.approx(want, rel=1e-12, abs=0)
    assert len(set(want[100:])) > 20  # the rule moved lambda, not only the clip


# ---- anchor ----

def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 6))


def sgd_step(model, x):
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    model(x).pow(2).mean().backward()
    opt.step()


def test_anchor_plain_module():
    model, x = mlp(), torch.randn(4, 6)
    anchor = Anchor(model, 'dual', every=10)
    assert anchor.weights.keys() == dict(model.named_parameters()).keys()
    with anchor.applied(model):
        assert torch.equal(model(x), model(x).detach())
        y_anchor = model(x)
    assert torch.equal(y_anchor, model(x))  # anchor == policy right after refresh
    sgd_step(model, x)
    before = {n: p.clone() for n, p in model.named_parameters()}
    y_policy = model(x)
    with anchor.applied(model):
        assert not model(x).requires_grad  # the anchor forward runs without autograd
        assert torch.equal(model(x), y_anchor) and not torch.equal(model(x), y_policy)
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())  # bitwise restore
    with pytest.raises(ZeroDivisionError):
        with anchor.applied(model):
            1 / 0
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())  # even on error
    anchor.maybe_refresh(model, 7)  # not a multiple of every
    with anchor.applied(model):
        assert torch.equal(model(x), y_anchor)
    anchor.maybe_refresh(model, 10)
    with anchor.applied(model):
        assert torch.equal(model(x), y_policy)
    # state_dict round trip into a fresh anchor of another state
    other = Anchor(mlp(), 'moving', every=10)
    other.load_state_dict(anchor.state_dict())
    with other.applied(model):
        assert torch.equal(model(x), y_policy)


def test_anchor_strategies():
    model, x = mlp(), torch.randn(4, 6)
    fixed = Anchor(model, 'fixed', every=10)
    y0 = model(x).detach()
    for step in range(1, 31):
        sgd_step(model, x)
        fixed.maybe_refresh(model, step)
    with fixed.applied(model):
        assert torch.equal(model(x), y0)  # the initial model, forever
    for strategy in ('none', 'stepwise'):  # no anchor needed
        a = Anchor(model, strategy, every=10)
        a.maybe_refresh(model, 10)
        assert a.weights == {} and a.state_dict() == {}
        with pytest.raises(RuntimeError):
            with a.applied(model):
                pass
    with pytest.raises(ValueError):
        Anchor(model, 'sliding', every=10)


def test_anchor_lora_holds_only_adapters():
    model = get_peft_model(mlp(), LoraConfig(r=2, lora_alpha=4, target_modules=['0', '2']))
    lora = {n for n, p in model.named_parameters() if 'lora_' in n}
    anchor = Anchor(model, 'dual', every=10)
    assert anchor.weights.keys() == lora and len(lora) == 4
    x = torch.randn(4, 6)
    with torch.no_grad():
        model.base_model.model[2].lora_B['default'].weight.normal_()  # LoRA B starts at 0: move it
    anchor.refresh(model)
    y_anchor = model(x)
    sgd_step(model, x)
    base = {n: p.clone() for n, p in model.named_parameters() if n not in lora}
    with anchor.applied(model):
        assert torch.equal(model(x), y_anchor)
    assert not torch.equal(model(x), y_anchor)
    assert all(torch.equal(base[n], p) for n, p in model.named_parameters() if n not in lora)
    sd = anchor.state_dict()
    assert sd.keys() == lora
    fresh = Anchor(model, 'dual', every=10)
    fresh.load_state_dict(sd)
    with fresh.applied(model):
        assert torch.equal(model(x), y_anchor)


def test_anchor_fsdp2():
    env = dict(os.environ, OMP_NUM_THREADS='1', PYTHONPATH=ROOT)
    cmd = [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2',
           os.path.join(ROOT, 'tests', 'fsdp_anchor_worker.py')]
    run = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    why = [l for l in run.stderr.splitlines() if any(k in l for k in ('Error', 'what()', 'terminate'))]
    assert run.returncode == 0, f'rc {run.returncode}\n{run.stdout[-2000:]}\n' + '\n'.join(why[-30:])
    assert all(f'rank {r} of 2: fsdp anchor ok' in run.stdout for r in range(2))
