"""
KVPO's edges (kvpo/kvpo.py, kvpo/train.py) and GRPO-SDE's (kvpo/sde_ar.py, kvpo/grpo_ar.py), each against
something written here. python -m pytest tests/test_kvpo_edges.py
- a fork exactly at the window is eligible (the conditions restated and enumerated by brute force);
- the pool's permutation is applied: over seeds every pool frame is routed by the first branch about
  n_random / |pool| of the time (a branch of consecutive pool frames would always take the first ones);
- the fused advantage is clamped on both sides (statistics.pstdev, min/max written out);
- backward's scale multiplies the gradient (kvpo.backward), and kvpo.train's update averages its prompts'
  gradients: the mean of each prompt's gradient computed here all at once (kvpo.scores with grad);
- the old (rollout) policy syncs after every old_every-th iteration, not before: at the iteration after a
  step and before a sync the ratio leaves 1; pi_init's scores come from the frozen initial model (the KL
  of the update's statistics equals torch.distributions' KL against a copy of the initial model taken
  here, also right after a sync, when the old policy is the current one);
- GRPO-SDE draws one z a block and step, at ODE steps too: the noise a stochastic step gets is the same
  whichever other steps are stochastic, and is the generator's (block * S + step)-th draw;
- grpo_ar's loss divides by the valid clips of all ranks (a sum): with a second rank faked by its count
  (parallel.mean of this rank's and another's), this rank's gradient is the one-process gradient of its
  clips times mine / (mine + other), an empty second rank included (an average would double it).
- the prompts: each rank's share of one seeded draw (the shares make up one process's list), the same for
  kvpo.train and kvpo.grpo_ar.
kvpo.train and kvpo.grpo_ar are set up once each (runpy, max_iters=0, the committed toy) and their phase
functions called here; every test starts from the same weights and a fresh optimizer.
"""
import copy
import math
import runpy
import statistics
import sys

import pytest
import torch

import sde
from kvpo import kvpo, sde_ar
import streaming
from streaming import toy_ar
from infra import parallel

TOY = toy_ar.LAYOUT  # block 1, sink 1, window 4


# ----------------------------------------------------------------------------- routing
def brute_forks(frames, layout, m, P, keep, first, then, within):
    """Block starts that may fork, from the docstrings' conditions, by enumeration."""
    bounds, start = [], 0
    while start < frames:
        end = min(frames, start + (then if bounds else first))
        bounds.append((start, end))
        start = end
    out = []
    for a, b in bounds[:within]:
        for f in range(a, b, layout['block']):
            last = f + (P - 1) * layout['block']  # the P-th routed block's start
            resident = set(range(max(layout['sink'], last - (keep - layout['sink'])), last))  # non-sink frames kept
            pool = [x for x in range(layout['sink'], f - m) if x in resident]
            if f >= layout['window'] and f + P * layout['block'] <= b and \
                    len(pool) >= layout['window'] - layout['sink'] - m:
                out.append(f)
    return out


def test_a_fork_at_the_window_is_eligible():
    toy = kvpo.eligible_forks(9, TOY, 1, 2, 9, 9, 9, 1)
    assert toy == brute_forks(9, TOY, 1, 2, 9, 9, 9, 1) == [4, 5, 6, 7] and toy[0] == TOY['window']
    # the released layout with one 30-frame chunk: block 12 (the window) has a pool of 5 = n_random
    L = streaming.LAYOUT
    rel = kvpo.eligible_forks(30, L, 4, 5, 33, 30, 18, 1)
    assert rel == brute_forks(30, L, 4, 5, 33, 30, 18, 1) == [12, 15] and rel[0] == L['window']
    assert 12 in {kvpo.plan(30, L, 2, 4, 5, 33, s, 30, 18, 1)['fork'] for s in range(20)}


def test_the_pools_permutation_is_applied():
    # one eligible fork (frames 30, one chunk of 30, P = 5 blocks: forks 12 and 15 -> take frames 27: only 12)
    L, K = streaming.LAYOUT, 4
    assert kvpo.eligible_forks(27, L, 4, 5, 33, 27, 18, 1) == [12]
    pool, n = list(range(3, 8)), kvpo.n_random(L, 4)  # [3, 8): 5 frames, all of them needed
    assert n == 5  # the pool is exactly one branch: each branch is the whole pool, sorted
    assert all(o == pool for o in kvpo.plan(27, L, K, 4, 5, 33, 0, 27, 18, 1)['older'])
    # a larger pool: a cache of 33 frames, one chunk of 60, the first eligible fork of a 3-block route
    frames, P = 60, 3
    forks = kvpo.eligible_forks(frames, L, 4, P, 33, frames, 18, 1)
    counts, seen = {}, 0
    for seed in range(300):
        p = kvpo.plan(frames, L, K, 4, P, 33, seed, frames, 18, 1)
        if p['fork'] != forks[-1]:
            continue
        seen += 1
        for f in p['older'][0]:
            counts[f] = counts.get(f, 0) + 1
    last = forks[-1] + (P - 1) * 3
    pool = list(range(max(3, last - 30), forks[-1] - 4))
    share = n / len(pool)  # each pool frame's chance to be among branch 0's n under a uniform permutation
    assert len(pool) >= 2 * n and seen > 5
    assert set(counts) <= set(pool)
    # consecutive pool frames would put pool[:n] in branch 0 every time and the rest never
    assert all(counts.get(f, 0) < seen for f in pool) and sum(f in counts for f in pool) > len(pool) - 2
    assert max(counts.values()) / seen < share + 0.45


# ----------------------------------------------------------------------------- the fused advantage
def test_fused_advantage_clamped_on_both_sides():
    a_l = torch.tensor([-10.0, 0.1, 0.2, 0.3])
    a_g = torch.tensor([-8.0, 0.5, 0.0, 0.4])
    want = [min(2.5, max(-2.5, a / statistics.pstdev(a_l.tolist()) + 0.5 * b / statistics.pstdev(a_g.tolist())))
            for a, b in zip(a_l.tolist(), a_g.tolist())]
    got = kvpo.fuse(a_l, a_g)
    assert want[0] == -2.5 and torch.allclose(got, torch.tensor(want), atol=1e-5)
    # one side alone (no mean removed): -1 among seven 0s is 1 / pstdev = 8 / sqrt(7) = 3.02, past 2.5 either way
    one = torch.tensor([-1.0] + [0.0] * 7)
    assert kvpo.fuse(one, None)[0] == -2.5 and kvpo.fuse(-one, None)[0] == 2.5
    assert kvpo.fuse(one, None, clamp=3.5)[0] == pytest.approx(-8 / math.sqrt(7), rel=1e-5)


# ----------------------------------------------------------------------------- backward's scale
def tiny(layout, seed=0):
    torch.manual_seed(seed)
    cfg = dict(toy_ar.CONFIG, in_channels=4, out_channels=4, num_layers=2, num_attention_heads=2,
               attention_head_dim=8, ffn_dim=32, rope_max_seq_len=64)
    return streaming.install(toy_ar.ToyARTransformer(**cfg), layout).eval()


def flat_grads(params):
    return torch.cat([(torch.zeros_like(p) if p.grad is None else p.grad).flatten() for p in params])


def test_backward_scales_the_gradient():
    net = tiny(TOY, 1)
    ctx = torch.randn(1, 4, toy_ar.CONFIG['text_dim'], generator=torch.Generator().manual_seed(1))
    _, traj, state = kvpo.rollout(net, ctx, 9, (4, 2, 2), dict(fork=5, older=[[1, 3], [2, 4], [1, 4]]), 1, 1, 2, 9)
    g = torch.Generator().manual_seed(0)
    s_old, s_init, adv = torch.randn(3, generator=g), torch.randn(3, generator=g), torch.tensor([0.5, -1.0, 0.2])
    objective = lambda s: kvpo.loss(s, s_old, s_init, adv, is_safe=True)  # noqa: E731
    params = [p for p in net.parameters() if p.requires_grad]
    objective(kvpo.scores(net, ctx, state, 5, traj, 9, grad_steps=2))[0].backward()  # all at once, unscaled
    want = flat_grads(params)
    for scale in (0.25, 3.0):
        net.zero_grad()
        total, _ = kvpo.backward(net, ctx, state, 5, traj, 9, objective, grad_steps=2, scale=scale)
        got = flat_grads(params)
        assert want.norm() > 0 and (got - scale * want).norm() < 1e-5 * scale * want.norm()
        assert total.item() == pytest.approx(objective(kvpo.scores(net, ctx, state, 5, traj, 9, 0))[0].item())


# ----------------------------------------------------------------------------- kvpo.train's update
def setup(module, argv, out):
    """The module's globals after a run of max_iters=0 (its setup: model, copies, optimizer, phases)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys, 'argv', [module] + argv + ['--max_iters=0', '--eval_every=0', '--save_every=0',
                                                   f'--out_dir={out}'])
        fn = runpy.run_module(module, run_name='__main__')['update']
    return fn.__globals__  # the globals the phase functions read (run_module returns a copy)


@pytest.fixture(scope='module')
def kt(tmp_path_factory):
    G = setup('kvpo.train', ['kvpo/config/toy.py', '--prompts_per_iter=2', '--group=3'],
              str(tmp_path_factory.mktemp('kvpo_edges') / 'run'))
    start = {n: p.detach().clone() for n, p in G['trained']}
    # two prompts whose branches differ (at fork 4 the toy's pool is the window itself: 3 equal branches,
    # whose softmax no weight moves), rolled out by the initial (old) policy
    rollouts = (G['rollout'](it, j, p) for it in range(4) for j, p in G['my_prompts'](it))
    groups = [g for g, _ in zip((g for g in rollouts if len({tuple(o) for o in g['plan']['older']}) == G['group']),
                                range(2))]
    assert len(groups) == 2
    for g, adv in zip(groups, ([1.0, -1.0, 0.5], [-0.3, 0.8, -1.2])):
        g['adv'], g['safe'] = torch.tensor(adv), True
    return G, start, groups


def fresh(G, start, **settings):
    """Every copy back at the initial weights, a new optimizer, the given settings."""
    with torch.no_grad():
        for net in ('policy', 'old', 'init', 'ema'):
            for n, p in G[net].named_parameters():
                if n in start:
                    p.copy_(start[n])
    G['opt'] = torch.optim.AdamW([p for _, p in G['trained']], lr=1e-3, weight_decay=0.0)
    G.update(dict(learning_rate=1e-3, warmup=1, lr_schedule='per_rollout', grad_clip=1e30, old_every=2, ema_decay=0.9,
                  gate='mechanism_2') | settings)  # per_rollout: lr x min(1, (it + 1) / warmup), the toy's


def weights_of(net, names):
    return {n: p.detach().clone() for n, p in net.named_parameters() if n in names}


def same(a, b):
    return all(torch.equal(a[n], b[n]) for n in a)


def test_update_averages_its_prompts_gradients(kt):
    G, start, groups = kt
    fresh(G, start, learning_rate=0.0)  # lr 0: the weights stay; the gradients are left in .grad
    params = [p for _, p in G['trained']]
    ref = torch.zeros(sum(p.numel() for p in params))
    for g in groups:  # each prompt's gradient, its branches' graphs all at once
        args = (g['ctx'], g['state'], g['plan']['fork'], g['traj'], G['cache_frames'])
        with torch.no_grad():
            s_old, s_init = (kvpo.scores(n, *args, 0) for n in (G['old'], G['init']))
        for p in params:
            p.grad = None
        kvpo.loss(kvpo.scores(G['policy'], *args, G['grad_steps']), s_old, s_init, g['adv'], True)[0].backward()
        ref += flat_grads(params) / len(groups)
    G['update'](groups, 0)
    got = flat_grads(params)
    assert ref.norm() > 0 and (got - ref).norm() < 1e-4 * ref.norm()  # the mean, not the sum (2x)


def test_old_policy_syncs_after_every_old_every_th_iteration(kt):
    G, start, groups = kt
    names = set(start)
    for every in (3,):  # syncs after iteration 2 (the 3rd), not after 0, 1 or 3
        fresh(G, start, old_every=every)
        for it in range(every + 1):
            before = weights_of(G['old'], names)
            st = G['update'](groups[:1], it)
            now, old = weights_of(G['policy'], names), weights_of(G['old'], names)
            if (it + 1) % every == 0:
                assert same(old, now), (every, it)  # the rollout policy caught up
            else:
                assert same(old, before) and not same(old, now), (every, it)
            # groups[:1] was rolled out by the initial weights: the ratio is 1 only at iteration 0
            if it == 0:
                assert st['ratio_max'] == pytest.approx(1.0, abs=1e-6)
            elif it < every:  # old = the initial model, the policy moved: the ratio leaves 1
                assert abs(st['ratio_max'] - 1) > 1e-4, (every, it, st)


def test_pi_init_is_the_frozen_initial_model(kt):
    G, start, groups = kt
    fresh(G, start, learning_rate=1e-2)
    initial = copy.deepcopy(G['policy'])  # the reference, taken here before any step
    g = groups[1]
    args = (g['ctx'], g['state'], g['plan']['fork'], g['traj'], G['cache_frames'])
    for it in range(3):  # iteration 1 syncs old to the policy: at iteration 2 old == policy != init
        with torch.no_grad():
            s, s0 = kvpo.scores(G['policy'], *args, 0), kvpo.scores(initial, *args, 0)
        want = torch.distributions.kl_divergence(torch.distributions.Categorical(logits=s),
                                                 torch.distributions.Categorical(logits=s0)).item()
        st = G['update']([g], it)
        if it:  # the policy has left the initial model (at iteration 0 both are float noise around 0)
            assert want > 1e-5 and st['kl'] == pytest.approx(want, rel=1e-2), it
    assert same(weights_of(G['init'], set(start)), start)  # frozen: the initial weights still


def fake_ranks(monkeypatch, other_safe=None):
    """torch.distributed.all_reduce as a second rank with this rank's gradients (SUM: doubled) and, for
    the safety flag (MAX), other_safe (None: this rank's own)."""
    import torch.distributed as dist

    def all_reduce(t, op=dist.ReduceOp.SUM, **kw):
        if op == dist.ReduceOp.MAX:
            t.clamp_(min=t.item() if other_safe is None else other_safe)
        else:
            t.mul_(2)
    monkeypatch.setattr(dist, 'all_reduce', all_reduce)


def test_update_two_identical_ranks_equal_one_process(kt, monkeypatch):
    # every rank holds the whole model and the gradients are averaged: a second rank with the same prompts
    # leaves the gradient and the step as one process makes them
    G, start, groups = kt
    fresh(G, start)
    G['update'](groups, 0)
    one = weights_of(G['policy'], set(start))
    fresh(G, start)
    with monkeypatch.context() as mp:
        fake_ranks(mp)
        mp.setitem(G, 'ddp', True)
        mp.setitem(G, 'world', 2)
        G['update'](groups, 0)
    assert same(weights_of(G['policy'], set(start)), one) and not same(one, start)


def adam_first_step(G, start):
    """max |w - w0| after a first AdamW step (weight decay 0): lr |g| / (|g| + eps) ~ lr for every moved weight."""
    return max((p.detach() - start[n]).abs().max().item() for n, p in G['trained'])


def test_warmup_ema_and_mechanism_1(kt, monkeypatch):
    G, start, groups = kt
    names = set(start)
    # the first step of AdamW moves a weight by the learning rate: here the warm-up's lr (it + 1) / warmup
    for it in (0, 2):
        fresh(G, start, learning_rate=1e-3, warmup=5, ema_decay=0.75)
        G['update'](groups[:1], it)
        assert adam_first_step(G, start) == pytest.approx(1e-3 * (it + 1) / 5, rel=1e-3), it
        ema, now = weights_of(G['ema'], names), weights_of(G['policy'], names)
        assert all(torch.allclose(ema[n], 0.75 * start[n] + 0.25 * now[n], atol=1e-7) for n in names)
    # mechanism_1: a step no rank finds safe is skipped (AdamW's momentum would move the weights), and the EMA
    # with it; a step another rank finds safe is taken
    fresh(G, start, gate='mechanism_1')
    G['opt'] = torch.optim.AdamW([p for _, p in G['trained']], lr=1e-3, weight_decay=0.01)
    G['update'](groups[:1], 0)  # safe: a step, AdamW's moments no longer 0
    unsafe = [dict(g, safe=False) for g in groups[:1]]
    for other, moves in ((0.0, False), (1.0, True)):
        before, ema = weights_of(G['policy'], names), weights_of(G['ema'], names)
        with monkeypatch.context() as mp:
            fake_ranks(mp, other_safe=other)
            mp.setitem(G, 'ddp', True)
            mp.setitem(G, 'world', 2)
            st = G['update'](unsafe, 2)
        assert st['loss'] == 0  # an unsafe prompt contributes nothing
        assert same(weights_of(G['policy'], names), before) != moves, other
        assert same(weights_of(G['ema'], names), ema) != moves, other


# ----------------------------------------------------------------------------- GRPO-SDE's noise
def test_grpo_sde_noise_does_not_shift_with_the_window(monkeypatch):
    S, real, calls = len(sde_ar.schedule(TOY)) - 1, sde.step, []

    def step(*a, noise=None, **kw):  # the z each transition is given, in call order: block by block, step by step
        calls.append(None if noise is None else noise.clone())
        return real(*a, noise=noise, **kw)
    monkeypatch.setattr(sde, 'step', step)
    net = tiny(TOY, 0)
    ctx = torch.randn(2, 4, toy_ar.CONFIG['text_dim'], generator=torch.Generator().manual_seed(1))
    noise = torch.randn(2, 4, 5, 2, 2, generator=torch.Generator().manual_seed(2))  # 5 one-frame blocks
    z = {}
    for steps in ([5], [2, 5, 6]):
        calls.clear()
        sde_ar.generate(net, noise, ctx, steps, 'sage', 0.5, [torch.Generator().manual_seed(s) for s in (5, 6)])
        assert len(calls) == 5 * S
        z[tuple(steps)] = {(i // S, i % S): c for i, c in enumerate(calls)}  # (block, step) -> z
    # the generators' stream, written here: one (C, f, h, w) draw a block and step, in that order
    gens = [torch.Generator().manual_seed(s) for s in (5, 6)]
    stream = [torch.stack([torch.randn(4, 1, 2, 2, generator=g) for g in gens]) for _ in range(5 * S)]
    for b in range(5):
        assert torch.equal(z[5,][b, 5], z[2, 5, 6][b, 5]), b  # whichever other steps are stochastic
        for k in (2, 5, 6):
            assert torch.equal(z[2, 5, 6][b, k], stream[b * S + k]), (b, k)


# ----------------------------------------------------------------------------- grpo_ar's valid count
@pytest.fixture(scope='module')
def ga(tmp_path_factory):
    G = setup('kvpo.grpo_ar', ['kvpo/config/grpo_toy.py', '--prompts_per_iter=1', '--group=3', '--kl_coef=0'],
              str(tmp_path_factory.mktemp('grpo_edges') / 'run'))
    steps, train, s_t = G['trained_steps'](0)
    groups = [G['rollout'](0, j, p, steps) for j, p in G['my_prompts'](0)]
    for g in groups:
        g['scores'] = G['score'](g)
        g['adv'], g['valid'], g['std'] = G['advantages'](g['scores'], 0, g['j'])
    return G, groups, train, s_t


def test_grpo_ar_divides_by_the_valid_clips_of_all_ranks(ga, monkeypatch):
    G, groups, train, s_t = ga
    G.update(learning_rate=0.0, grad_clip=1e30)  # lr 0: the weights stay, the gradients are left in .grad
    groups[0]['adv'] = torch.tensor([1.0, -0.4, -0.6])  # one rank's group; its 3 clips valid
    groups[0]['valid'] = torch.tensor([True, True, True])
    params = [p for _, p in G['trained']]
    G['update'](groups, 0, train, s_t)  # one process: its 3 clips are all there are
    alone, mine = flat_grads(params), 3
    assert alone.norm() > 0
    for other in (0, 3, 9):  # a second rank's valid clips: this rank's share is mine / (mine + other) of alone
        with monkeypatch.context() as mp:
            mp.setattr(parallel, 'mean', lambda x, device, o=other: (x + o) / 2)  # the two ranks' mean
            mp.setitem(G, 'world', 2)
            G['update'](groups, 0, train, s_t)
        want = alone * mine / (mine + other)
        assert (flat_grads(params) - want).norm() < 1e-5 * want.norm(), other


def test_grpo_ar_two_identical_ranks_equal_one_process(ga, monkeypatch):
    # each rank's loss is its share of the mean over all ranks' clips; the all-reduce sums the shares
    G, groups, train, s_t = ga
    G.update(learning_rate=0.0, grad_clip=1e30)
    params = [p for _, p in G['trained']]
    G['update'](groups, 0, train, s_t)
    one = flat_grads(params)
    with monkeypatch.context() as mp:
        fake_ranks(mp)
        mp.setattr(parallel, 'mean', lambda x, device: x)  # the other rank has as many valid clips
        mp.setitem(G, 'ddp', True)
        mp.setitem(G, 'world', 2)
        G['update'](groups, 0, train, s_t)
    assert one.norm() > 0 and (flat_grads(params) - one).norm() < 1e-6 * one.norm()


def test_prompts_split_over_ranks_and_shared_by_both_methods(kt, ga, monkeypatch):
    # a seeded draw of prompts_per_iter prompts over all ranks: the ranks' shares are disjoint and make up
    # one process's list; kvpo.grpo_ar draws the same prompts as kvpo.train (bench/kvpo_verdicts pairs them)
    K, A = kt[0], ga[0]
    for G in (K, A):
        monkeypatch.setitem(G, 'prompts_per_iter', 4)
        monkeypatch.setitem(G, 'train_list', [f'prompt {i}' for i in range(10)])
    drawn = set()
    for it in range(3):
        monkeypatch.setitem(K, 'rank', 0)
        monkeypatch.setitem(K, 'world', 1)
        alone = K['my_prompts'](it)
        drawn |= {p[0] for _, p in alone}
        assert [j for j, _ in alone] == [0, 1, 2, 3] and all(len(p) == 1 for _, p in alone)
        assert [(j, [p]) for j, p in A['my_prompts'](it)] == alone  # the toy's videos: one prompt segment each
        for world in (2, 4):
            shares = []
            for rank in range(world):
                monkeypatch.setitem(K, 'rank', rank)
                monkeypatch.setitem(K, 'world', world)
                shares += K['my_prompts'](it)
            assert sorted(shares) == alone
    assert len(drawn) > 4  # the iterations draw differently
