"""
reward.component_advantages ('per_component', 'taros') against a slow reference written here in plain
Python, loop by loop, from the formulas of docs/method.md section 4.3. What a failure would show: a
component standardised over the batch instead of its group, a NaN component that leaks into its group's
mean, a sparsity or saturation rule that acts the wrong way.
Groups that span ranks: tests/test_train_ranks.py runs both kinds on 2 ranks against one process.
"""
import math
import random

import pytest
import torch

from reward import TAROS_DEADZONE, TAROS_SATURATED, component_advantages, group_advantages

W = (0.5, 0.5, 1.0)  # Setting B


def pstd(xs):
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))


def reference(c, weights, kind, clip=5.0, eps=1e-6):
    """Lists in, lists out: c[p][g][k] -> (adv[p][g], valid[p][g])."""
    P, G, K = len(c), len(c[0]), len(c[0][0])
    valid = [[not any(math.isnan(x) for x in c[p][g]) for g in range(G)] for p in range(P)]
    members = [[g for g in range(G) if valid[p][g]] for p in range(P)]
    everyone = [c[p][g] for p in range(P) for g in members[p]]
    spread = [pstd([v[k] for v in everyone]) if len(everyone) > 1 else 0.0 for k in range(K)]
    a = [[0.0] * G for _ in range(P)]
    for p in range(P):
        for k in range(K):
            col = [c[p][g][k] for g in members[p]]
            if not col:
                continue
            mean, sd = sum(col) / len(col), pstd(col)
            for g in members[p]:
                z = (c[p][g][k] - mean) / sd if sd > eps else 0.0
                if kind == 'taros':
                    z = math.copysign(max(abs(z) - TAROS_DEADZONE, 0.0), z)
                    z *= min(1.0, sd / max(TAROS_SATURATED * spread[k], eps))
                a[p][g] += weights[k] * z
    ok = [(p, g) for p in range(P) for g in members[p] if len(members[p]) >= 2]
    scale = pstd([a[p][g] for p, g in ok]) if len(ok) > 1 else 1.0
    adv = [[max(-clip, min(clip, a[p][g] / max(scale, eps))) if (p, g) in ok else 0.0 for g in range(G)]
           for p in range(P)]
    return adv, valid


def batch(P, G, seed, nan=0, flat=False):
    rnd = random.Random(seed)
    c = [[[rnd.gauss(0.3, 0.2), rnd.gauss(0.5, 0.1), rnd.gauss(0.2, 0.3)] for _ in range(G)] for _ in range(P)]
    for i in range(nan):  # a component the reward model could not score
        c[rnd.randrange(P)][rnd.randrange(G)][rnd.randrange(3)] = float('nan')
    if flat:  # group 0's VQ saturated: equal up to 1e-4, group 1 all equal
        c[0] = [[0.9 + 1e-4 * g, x[1], x[2]] for g, x in enumerate(c[0])]
        c[1] = [[0.7, 0.5, 0.2] for _ in c[1]]
    return c


@pytest.mark.parametrize('kind', ['per_component', 'taros'])
@pytest.mark.parametrize('P,G,nan,flat', [(4, 4, 0, False), (6, 2, 0, False), (5, 4, 3, False), (4, 4, 2, True)])
def test_component_advantages_match_the_slow_reference(kind, P, G, nan, flat):
    for seed in range(5):
        c = batch(P, G, seed, nan, flat)
        adv, valid = component_advantages(torch.tensor(c, dtype=torch.float64), W, kind)
        ref_adv, ref_valid = reference(c, W, kind)
        assert valid.tolist() == ref_valid
        assert torch.allclose(adv, torch.tensor(ref_adv, dtype=torch.float64), atol=1e-9), (seed, adv, ref_adv)
        assert torch.isfinite(adv).all() and (adv[~valid] == 0).all()


def test_what_each_kind_does_with_a_saturated_component():
    # group 0: VQ all but equal (1e-4 apart), MQ and TA flat: per_component standardises the 1e-4 to unit
    # size (noise drives the update), taros down-weights it to nearly nothing; group 1 separates on TA
    c = torch.tensor([[[0.9, 0.5, 0.2], [0.9001, 0.5, 0.2], [0.9002, 0.5, 0.2], [0.9003, 0.5, 0.2]],
                      [[0.5, 0.5, 0.0], [0.5, 0.5, 0.3], [0.5, 0.5, 0.6], [0.5, 0.5, 0.9]]], dtype=torch.float64)
    per, _ = component_advantages(c, W, 'per_component')
    taros, _ = component_advantages(c, W, 'taros')
    assert per[0].abs().max() >= 0.49 * per[1].abs().max()  # the saturated group moves as a real one (w 0.5 vs 1)
    assert taros[0].abs().max() < 1e-3 * taros[1].abs().max()  # saturated: all but switched off
    # sparsity: the two middle members of group 1 (|z| = 0.45 < 0.5) get nothing from TA under taros
    assert taros[1, 1] == 0 and taros[1, 2] == 0 and taros[1, 0] < 0 < taros[1, 3]
    # one component only: per_component is GRPO's advantage of the composite, up to the batch scale
    one = c[1:, :, 2:]
    grpo, _, _ = group_advantages(one.sum(-1))
    per, _ = component_advantages(one, (1.0,), 'per_component')
    assert torch.allclose(per, grpo / grpo.std(unbiased=False))
