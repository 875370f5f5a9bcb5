"""
KVPO's method (kvpo/kvpo.py) against references written here. python -m pytest tests/test_kvpo.py
- the routing plan at the released layout (147 frames in chunks of 21 + 18, window 12, sink 3, m 4, P 5):
  every fork eligible by the conditions restated here, each branch's older frames from the pool,
  consecutive branches overlapping in n_random - shift frames and farther ones not at all;
- in a rollout (a tiny random streaming model) every routed block attends exactly the sink, its branch's
  older frames and the cached ones of its m nearest, the window's size in all; a branch routed as the
  window is the anchor bit for bit, the prefix is shared, and the anchor is streaming.generate's clip;
- TVE against a brute-force replay (one masked full forward of every earlier frame per block and step):
  its value, the velocity form, the gradient through the first 2 of 4 steps only; the backward one branch
  at a time, with activations recomputed or not, equal to all at once;
- advantages against the anchor per component (statistics.stdev), fusion (pstdev) and the clamp;
- the loss and its gradient on a 3-branch example by hand (one branch clipped above, one below), the
  log-ratio clamp, the safety gate in both released states, the KL against torch.distributions.
"""
import math
import statistics

import pytest
import torch
import torch.nn.functional as F

from kvpo import kvpo
import streaming
from streaming import toy_ar

RELEASED = dict(frames=147, first=21, then=18, within=7, m=4, P=5, keep=33, K=8)
SHAPE = (4, 2, 2)  # a frame's latent (C, h, w) for the tiny model


def tiny(layout, seed=0):
    torch.manual_seed(seed)
    cfg = dict(toy_ar.CONFIG, in_channels=4, out_channels=4, num_layers=2, num_attention_heads=2,
               attention_head_dim=8, ffn_dim=32, rope_max_seq_len=64)
    return streaming.install(toy_ar.ToyARTransformer(**cfg), layout).eval()


def text(seed=0):
    return torch.randn(1, 4, toy_ar.CONFIG['text_dim'], generator=torch.Generator().manual_seed(seed))


def test_plan_released_layout():
    R, L = RELEASED, streaming.LAYOUT
    forks = kvpo.eligible_forks(R['frames'], L, R['m'], R['P'], R['keep'], R['first'], R['then'], R['within'])
    bounds = [0, 21] + list(range(39, 148, 18))  # chunk starts: 0, 21, 39, ..., 129, 147
    first7 = list(zip(bounds, bounds[1:]))[:7]  # perturb_within_first_x_chunks: [129, 147) is the eighth
    want = [f for f in range(0, 147, 3) if f >= 12 and any(a <= f and f + 15 <= b for a, b in first7)]
    assert forks == want and forks[:4] == [21, 24, 39, 42]
    for seed in range(20):
        p = kvpo.plan(R['frames'], L, R['K'], R['m'], R['P'], R['keep'], seed, R['first'], R['then'], R['within'])
        f, older = p['fork'], p['older']
        lo = max(3, f + 12 - 30)  # the P-th block starts at f + 12; 30 non-sink frames resident
        pool = list(range(lo, f - 4))
        assert f in forks and len(older) == 8
        assert all(len(o) == 5 == len(set(o)) and set(o) <= set(pool) for o in older)
        shift = max(1, len(pool) // 8)
        for i in range(8):
            for j in range(i + 1, 8):
                d = j - i
                if (7 * shift + 5) <= len(pool):  # no wrap around the permutation
                    assert len(set(older[i]) & set(older[j])) == max(0, 5 - shift * d)
    assert kvpo.n_random(L, 4) == 5


def test_routed_blocks_attend_exactly_sink_older_nearest():
    L = dict(streaming.LAYOUT)
    net, ctx = tiny(L), text()
    frames, m, P, keep = 39, 4, 5, 33
    p = kvpo.plan(frames, L, 2, m, P, keep, 3, 21, 18, 7)
    seen = []
    real = kvpo.router

    def spy(*a):
        route = real(*a)
        return lambda cache, s, e: seen.append((s, e, r := route(cache, s, e))) or r
    kvpo.router = spy
    try:
        clips, traj, state = kvpo.rollout(net, ctx, frames, SHAPE, p, 0, m, P, keep)
    finally:
        kvpo.router = real
    f = p['fork']
    routed = [(s, e, r) for s, e, r in seen if f <= s < f + 15]
    assert len(routed) == 2 * P * 5  # 2 branches x P blocks x (4 steps + the write)
    for k, (s, e, r) in enumerate(routed):
        older = p['older'][k // (P * 5)]
        assert r == [0, 1, 2] + older + list(range(e - m, s))  # nearest: its block and m - 3 before it
        assert len(r) + 3 == L['window']
    later = [(s, e, r) for s, e, r in seen if s >= f + 15]
    assert all(r == streaming.visible_frames(list(range(s)), s, e, L) for s, e, r in later)
    assert clips.shape == (3, 4, frames, 2, 2) and traj['x'].shape == (2, P, 4, 4, 3, 2, 2)
    assert torch.equal(clips[0, :, :f], clips[2, :, :f]) and not torch.equal(clips[0, :, f:], clips[2, :, f:])


def toy_case(P=2, older=None, seed=1):
    L = toy_ar.LAYOUT  # block 1, sink 1, window 4
    net, ctx = tiny(L, seed), text(seed)
    fork = 5
    older = older or [[1, 3], [2, 4]]
    clips, traj, state = kvpo.rollout(net, ctx, 9, SHAPE, dict(fork=fork, older=older), seed, 1, P, 9)
    return net, ctx, fork, clips, traj, state


def test_branch_routed_as_the_window_is_the_anchor():
    # at fork 5 the window shows 0, 3, 4: a 1-block route to older [3, 4] (m = 1: the block itself) is no change
    net, ctx, fork, clips, traj, state = toy_case(P=1, older=[[3, 4], [1, 2]])
    assert torch.equal(clips[0], clips[2]) and not torch.equal(clips[1], clips[2])
    # its trajectory is the replaying model's own: TVE 0 (with or without the sigma floor)
    assert kvpo.tve(net, ctx, state, fork, traj['x'][0], traj['x0'][0], 9).abs() < 1e-10
    assert kvpo.tve(net, ctx, state, fork, traj['x'][1], traj['x0'][1], 9) < -1e-6


def test_anchor_is_the_models_own_generation():
    # the toy's layout re-noises by the ODE (x0 + v): the unrouted anchor is streaming.generate from the same noise
    assert toy_ar.LAYOUT.get('renoise') == 'ode'
    net, ctx, fork, clips, traj, state = toy_case()
    x = streaming.generate(net, kvpo.noise_at(1, range(9), 0, SHAPE), ctx)
    assert torch.allclose(clips[-1:], x, atol=1e-6) and not torch.allclose(clips[0:1], x, atol=1e-3)


def brute_force_terms(net, ctx, clean_prefix, fork, x, x0):
    """Per (block, step): x0 prediction of the replay from one masked full forward over every earlier clean
    frame (the prefix's, then the replay's own last predictions) and the noisy block, each frame seeing
    the frames it saw when it was computed (its window, clean, at timestep 0). The clean frames' keys and
    values are detached in every layer, and the text's (hooks): what the cache holds carries no gradient."""
    L, sig = net.layout, streaming.sigmas(net.layout)
    clean, preds, cut = list(clean_prefix.unbind(2)), {}, [0]
    T = x.shape[-1] * x.shape[-2]  # tokens a frame (patch 1)
    detach = lambda mod, inp, out: torch.cat([out[:, :cut[0]].detach(), out[:, cut[0]:]], 1)
    hooks = [m.register_forward_hook(detach) for blk in net.blocks for m in (blk.attn1.norm_k, blk.attn1.to_v)]
    # the text's keys and values too: the replay reads them from the rollout's cache (as released)
    hooks += [m.register_forward_hook(lambda mod, inp, out: out.detach())
              for blk in net.blocks for m in (blk.attn2.norm_k, blk.attn2.to_v)]
    for b in range(x.shape[0]):
        start = fork + b
        for k, s in enumerate(sig):
            n = len(clean)
            cut[0] = n * T
            seq = torch.cat([torch.stack(clean, 2), x[b, k][None]], 2)
            pos = list(range(n)) + [start]

            def sees(i, j):  # query frame i, key frame j (absolute, 1-frame blocks)
                return j == i or (j < i and (j < L['sink'] or j >= i + 1 - (L['window'] - L['sink'])))
            mask = torch.tensor([[sees(pos[i], pos[j]) for j in range(n + 1)] for i in range(n + 1)])
            sg = torch.tensor([[0.0] * n + [s]])
            v = streaming.forward_masked(net, seq, sg, ctx, pos, mask)[:, :, -1:]
            preds[b, k] = x[b, k][None] - s * v
        clean.append(preds[b, len(sig) - 1].detach()[:, :, 0])
    for h in hooks:
        h.remove()
    return preds


def test_tve_against_brute_force_replay_and_gradient_steps():
    net, ctx, fork, clips, traj, state = toy_case()
    sig = streaming.sigmas(net.layout)
    g = 1
    x, x0 = traj['x'][g], traj['x0'][g]
    # the reference, with grad everywhere; terms per (block, step)
    preds = brute_force_terms(net, ctx, clips[g:g + 1, :, :fork], fork, x, x0)
    terms = {bk: -(x0[bk][None] - p).square().mean() / (2 * max(sig[bk[1]], 1.0) ** 2) for bk, p in preds.items()}
    vel = {bk: -(x0[bk][None] - p).square().mean() / (2 * sig[bk[1]] ** 2) for bk, p in preds.items()}
    ref = sum(terms.values())
    s2 = kvpo.tve(net, ctx, state, fork, x, x0, 9, grad_steps=2)
    s4 = kvpo.tve(net, ctx, state, fork, x, x0, 9, grad_steps=4)
    sv = kvpo.tve(net, ctx, state, fork, x, x0, 9, grad_steps=2, form='velocity')
    assert abs(s2.item() - ref.item()) < 1e-6 * max(1, abs(ref.item())) and s2.item() < 0
    assert abs(s4.item() - s2.item()) < 1e-7 * max(1, abs(ref.item()))
    assert abs(sv.item() - sum(vel.values()).item()) < 1e-5 * abs(sv.item())
    params = [p for p in net.parameters() if p.requires_grad]
    want = torch.autograd.grad(sum(t for (b, k), t in terms.items() if k < 2), params, allow_unused=True)
    got = torch.autograd.grad(s2, params, allow_unused=True)
    full = torch.autograd.grad(kvpo.tve(net, ctx, state, fork, x, x0, 9, grad_steps=4), params, allow_unused=True)
    flat = lambda gs: torch.cat([(torch.zeros_like(p) if g is None else g).flatten() for g, p in zip(gs, params)])
    w, gg, ff = flat(want), flat(got), flat(full)
    assert (gg - w).norm() < 1e-4 * w.norm() and w.norm() > 0
    assert (ff - gg).norm() > 1e-3 * ff.norm()  # steps 3 and 4 would add gradient: they are cut


def test_backward_one_branch_at_a_time_and_checkpointed_equals_all_at_once():
    net, ctx, fork, clips, traj, state = toy_case(older=[[1, 3], [2, 4], [1, 4]])
    g = torch.Generator().manual_seed(0)
    s_old, s_init, adv = torch.randn(3, generator=g), torch.randn(3, generator=g), torch.tensor([0.5, -1.0, 0.2])
    objective = lambda s: kvpo.loss(s, s_old, s_init, adv, is_safe=True)
    params = [p for p in net.parameters() if p.requires_grad]
    total, _ = objective(kvpo.scores(net, ctx, state, fork, traj, 9, grad_steps=2))
    total.backward()
    grads = lambda: [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in params]
    want = grads()
    net.zero_grad()
    for checkpoint in (False, True):  # and the activations recomputed in backward, from the cache as it was
        net.zero_grad()
        got_total, _ = kvpo.backward(net, ctx, state, fork, traj, 9, objective, grad_steps=2, checkpoint=checkpoint)
        got = grads()
        assert abs(got_total.item() - total.item()) < 1e-6
        num = sum((a - b).square().sum() for a, b in zip(got, want)).sqrt()
        assert num < 1e-5 * sum(a.square().sum() for a in want).sqrt()


def test_anchor_advantage_per_component_fusion_and_clamp():
    r = {'VQ': torch.tensor([0.1, 0.5, 0.3]), 'TA': torch.tensor([1.0, 0.0, 2.0])}
    anchor = {'VQ': torch.tensor(0.2), 'TA': torch.tensor(1.0)}
    w = {'VQ': 0.5, 'TA': 2.0}
    got = kvpo.component_advantage(r, anchor, w)
    want = [sum(w[c] * (r[c][g].item() - anchor[c].item()) /
                (statistics.stdev(r[c].tolist() + [anchor[c].item()]) + 1e-8) for c in w) for g in range(3)]
    assert torch.allclose(got, torch.tensor(want), atol=1e-6)
    a_l, a_g = torch.tensor([2.0, 0.0, -0.1]), torch.tensor([3.0, 0.0, -0.2])
    fused = kvpo.fuse(a_l, a_g)
    want = [min(2.5, max(-2.5, 1.0 * a / (statistics.pstdev(a_l.tolist()) + 1e-8) +
                          0.5 * b / (statistics.pstdev(a_g.tolist()) + 1e-8))) for a, b in zip(a_l.tolist(), a_g.tolist())]
    assert torch.allclose(fused, torch.tensor(want), atol=1e-6) and fused.abs().max() == 2.5  # one clamped
    assert (fused.sign() == torch.tensor(want).sign()).all() and fused.sum() != 0  # no mean removed
    same = torch.full((3,), 0.7)  # no spread: not divided
    assert torch.allclose(kvpo.fuse(same, None), same) and torch.allclose(kvpo.fuse(None, same), 0.5 * same)
    assert kvpo.safe([(torch.tensor([0.1, 0.2]), torch.tensor(0.3)), (torch.tensor([0.5]), torch.tensor(0.4))])
    assert not kvpo.safe([(torch.tensor([0.1, 0.3]), torch.tensor(0.3))])


def test_loss_and_gradient_by_hand():
    s = torch.tensor([-1.0, -1.5, -0.8], requires_grad=True)
    s_old = torch.tensor([-1.4, -1.0, -0.8])
    s_init = torch.tensor([-1.2, -1.1, -0.9])
    A = torch.tensor([1.0, -0.5, 0.7])
    sm = lambda v: [math.exp(a) / sum(math.exp(b) for b in v) for a in v]
    p, po, q = sm(s.tolist()), sm(s_old.tolist()), sm(s_init.tolist())
    rho = [a / b for a, b in zip(p, po)]
    assert rho[0] > 1.2 and rho[1] < 0.9 and 0.9 < rho[2] < 1.2  # one clipped above (A>0), one below (A<0)
    surr = [min(r * a, min(max(r, 0.9), 1.2) * a) for r, a in zip(rho, A.tolist())]
    kl = sum(pi * (math.log(pi) - math.log(qi)) for pi, qi in zip(p, q))
    total, st = kvpo.loss(s, s_old, s_init, A, is_safe=True)
    assert abs(total.item() - (-sum(surr) / 3 + 10 * kl)) < 1e-5 and st['pi_anchor'] == 0
    total.backward()
    # by hand: clipped branches carry no gradient; branch 2's -rho A / 3 gives -(A_2 rho_2 / 3)(delta_2j - p_j);
    # the KL gives p_j (log p_j - log q_j - KL)
    grad = [-(A[2].item() * rho[2] / 3) * ((j == 2) - p[j]) + 10 * p[j] * (math.log(p[j]) - math.log(q[j]) - kl)
            for j in range(3)]
    assert torch.allclose(s.grad, torch.tensor(grad), atol=1e-5)
    assert abs(st['clip_frac'] - 2 / 3) < 1e-6


def test_log_ratio_clamp():
    s, s_old = torch.tensor([0.0, -100.0, 0.0]), torch.tensor([-100.0, 0.0, 0.0])
    _, st = kvpo.loss(s, s_old, s, torch.zeros(3), True)
    assert st['ratio_max'] == pytest.approx(math.exp(20.0), rel=1e-5)


@pytest.mark.parametrize('gate', ['mechanism_2', 'mechanism_1'])
def test_safety_gate(gate):
    s0 = torch.tensor([-1.0, -1.5, -0.8])
    args = (torch.tensor([-1.1, -1.4, -0.9]), torch.tensor([-1.2, -1.1, -0.9]), torch.tensor([0.3, -0.5, 0.2]))
    grads = {}
    for is_safe in (True, False):
        s = s0.clone().requires_grad_()
        total, st = kvpo.loss(s, *args, is_safe=is_safe, gate=gate)
        total.backward()
        grads[is_safe] = (total.item(), s.grad.clone(), st['pi_anchor'])
    (l1, g1, pa1), (l0, g0, pa0) = grads[True], grads[False]
    assert pa1 == 0
    if gate == 'mechanism_2':  # an anchor slot of logit 0 beside log-softmaxed branches: pi_anchor = 1/2
        assert pa0 == pytest.approx(0.5) and l0 == pytest.approx(0.5 * l1) and torch.allclose(g0, 0.5 * g1)
    else:  # an unsafe prompt contributes nothing
        assert l0 == 0 and torch.equal(g0, torch.zeros(3)) and g1.abs().sum() > 0


def test_kl_on_the_simplex():
    a, b = torch.randn(8, generator=torch.Generator().manual_seed(0)), torch.randn(8)
    want = torch.distributions.kl_divergence(torch.distributions.Categorical(logits=a),
                                             torch.distributions.Categorical(logits=b))
    assert torch.allclose(kvpo.kl_simplex(F.log_softmax(a, 0), F.log_softmax(b, 0)), want, atol=1e-6)
    assert kvpo.kl_simplex(F.log_softmax(a, 0), F.log_softmax(a, 0)).abs() < 1e-6


def test_replay_under_the_branch_routing_reproduces_it():
    # kvpo/train.py's replay_routed (an experiment, not released): replayed under its own routing at the rollout's
    # weights, a branch's trajectory is the model's own (TVE 0) where routing off it is not; the backward one
    # branch at a time, checkpointed or not, keeps the routing
    older = [[1, 3], [2, 4], [1, 4]]
    net, ctx, fork, clips, traj, state = toy_case(older=older)
    routes = [kvpo.router(fork, o, net.layout, 1, 2) for o in older]
    on = kvpo.scores(net, ctx, state, fork, traj, 9, routes=routes)
    off = kvpo.scores(net, ctx, state, fork, traj, 9)
    assert on.abs().max() < 1e-10 and (off < -1e-6).all()
    adv = torch.tensor([0.5, -1.0, 0.2])
    objective = lambda s: kvpo.loss(s, on.detach() + 0.1 * adv, on.detach(), adv, is_safe=True)
    params = [p for p in net.parameters() if p.requires_grad]
    with torch.no_grad():  # the weights move after the rollout: TVE and its gradient leave 0
        for p in params:
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    grads = []
    for checkpoint in (False, True):
        net.zero_grad()
        kvpo.backward(net, ctx, state, fork, traj, 9, objective, grad_steps=2, checkpoint=checkpoint, routes=routes)
        grads.append(torch.cat([torch.zeros_like(p).flatten() if p.grad is None else p.grad.flatten() for p in params]))
    net.zero_grad()
    objective(kvpo.scores(net, ctx, state, fork, traj, 9, grad_steps=2, routes=routes))[0].backward()
    want = torch.cat([torch.zeros_like(p).flatten() if p.grad is None else p.grad.flatten() for p in params])
    assert want.norm() > 0 and all((g - want).norm() < 1e-5 * want.norm() for g in grads)
