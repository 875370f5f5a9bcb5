"""
extras/variants.py component_advantages ('per_component', 'taros') against a slow reference written here in plain
Python, loop by loop, from the formulas of docs/method.md section 4.3. What a failure would show: a
component standardised over the batch instead of its group, a NaN component that leaks into its group's
mean, a sparsity or saturation rule that acts the wrong way.
Groups that span ranks: tests/test_train_ranks.py runs both kinds on 2 ranks against one process.
"""
import math
import random

import pytest
import torch

from extras.variants import TAROS_DEADZONE, TAROS_SATURATED, component_advantages
from reward import group_advantages

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


# ----------------------------------------------------------------------------- slips, each against a hand count

def test_a_component_flat_up_to_rounding_contributes_nothing():
    # VQ of each group equal up to one float32 ulp (3e-8 apart, std 3e-8 < eps): no signal, so z = 0, not
    # the rounding noise over eps (0.03, which the batch scale would then blow up to a unit advantage)
    ulp = torch.nextafter(torch.tensor(0.9), torch.tensor(1.0)).item()
    vq = [0.9, ulp, 0.9, ulp]
    flat = torch.tensor([[[v, 0.5, 0.2] for v in vq], [[v, 0.3, 0.7] for v in vq]], dtype=torch.float32)
    for kind in ('per_component', 'taros'):
        adv, valid = component_advantages(flat, W, kind)
        assert valid.all() and (adv == 0).all(), (kind, adv)
    # beside a group that separates on TA (0, .3, .6, .9): the flat group gets exactly 0 and the other its
    # z-scores (-3, -1, 1, 3) / sqrt(5), over the batch scale: the std of those and four zeros, 1 / sqrt(2)
    mixed = torch.cat([flat[:1], torch.tensor([[[0.5, 0.5, t] for t in (0.0, 0.3, 0.6, 0.9)]])])
    adv, _ = component_advantages(mixed, W, 'per_component')
    z = torch.tensor([-3.0, -1.0, 1.0, 3.0]) / 5 ** 0.5
    assert (adv[0] == 0).all(), adv
    assert torch.allclose(adv[1], z * 2 ** 0.5, atol=1e-5), adv


def test_a_group_of_one_valid_member_takes_no_part_in_the_batch_scale():
    # groups 0 and 2 separate on TA (z = -1, +1), group 1 has one scored clip: its 0 stays out of the batch
    # std, which is 1, so the others' advantages are exactly -1, +1 (with it counted: sqrt(5/4) larger)
    nan = float('nan')
    c = torch.tensor([[[0.3, 0.3, 0.0], [0.3, 0.3, 1.0]],
                      [[0.3, 0.3, 0.5], [nan, 0.3, 0.5]],
                      [[0.3, 0.3, 0.2], [0.3, 0.3, 0.6]]], dtype=torch.float64)
    for kind in ('per_component', 'taros'):
        adv, valid = component_advantages(c, W, kind)
        assert valid.tolist() == [[True, True], [True, False], [True, True]]
        assert adv[1].tolist() == [0.0, 0.0]
        assert torch.allclose(adv, torch.tensor([[-1.0, 1.0], [0.0, 0.0], [-1.0, 1.0]], dtype=torch.float64)), (kind, adv)


def test_the_clip_is_symmetric():
    # one outlier among 10 equal rewards: z = -+3 (mean 0.1, std 2.7 for 9 x 1 and -8), the others +-1/3;
    # clipped at 2, a low outlier gives -2 as a high one gives +2
    low = torch.tensor([[1.0] * 9 + [-8.0]], dtype=torch.float64)
    for r, sign in ((low, 1), (-low, -1)):
        adv, _, std = group_advantages(r, clip=2.0)
        assert std.item() == pytest.approx(2.7)
        assert adv[0, :9].tolist() == pytest.approx([sign / 3] * 9) and adv[0, 9].item() == -2.0 * sign, adv
        # the same single component through component_advantages: z has std 1, so the batch scale is 1
        comp, _ = component_advantages(r.unsqueeze(-1), (1.0,), 'per_component', clip=2.0)
        assert comp[0, :9].tolist() == pytest.approx([sign / 3] * 9) and comp[0, 9].item() == -2.0 * sign, comp
