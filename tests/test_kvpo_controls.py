"""
The controls of bench/kvpo_verdicts.py on KVPO. The shuffled advantages (kvpo/train.py --adv_shuffle), on the
distilled streaming toy (the story toy's student, assets/toy_story, on 9-frame clips): the rollout and the rewards are the real run's bitwise, the
advantages the loss receives are the real ones permuted within the video (not the identity for this seed), the
safe gate unchanged, and the update differs; --adv_shuffle=False is the default bitwise. The suspects' switches:
--fork_min (kvpo.plan's earliest) and --fuse_std=False (kvpo.fuse's normalise).
"""
import runpy
import sys

import torch

from kvpo import kvpo
from test_train import metrics, weights

STUDENT = ('--model=assets/toy_story', '--context_noise=0.0')  # the story toy's streaming student, 9-frame clips


def one(tmp_path, monkeypatch, name, *extra):
    out, seen = str(tmp_path / name), []
    loss = kvpo.loss

    def recording(s, s_old, s_init, adv, safe, *a, **k):
        seen.append((adv.detach().clone(), safe))
        return loss(s, s_old, s_init, adv, safe, *a, **k)
    monkeypatch.setattr(kvpo, 'loss', recording)
    monkeypatch.setattr(sys, 'argv', ['kvpo.train', 'kvpo/config/toy.py', *STUDENT, '--prompts_per_iter=1', '--max_iters=1',
                                      '--eval_every=0', '--save_every=0', '--seed=3', f'--out_dir={out}', *extra])  # seed 3: a video
    # whose branches do not all tie (the student's groups often do: results/toy_story.md)
    runpy.run_module('kvpo.train', run_name='__main__')
    return metrics(out)[0], weights(out), seen


def test_kvpo_shuffled_advantages_permute_the_real_ones(tmp_path, monkeypatch):
    (real, w_real, a_real), (shuf, w_shuf, a_shuf), (_, w_off, a_off) = (
        one(tmp_path, monkeypatch, 'real'), one(tmp_path, monkeypatch, 'shuf', '--adv_shuffle=True'),
        one(tmp_path, monkeypatch, 'off', '--adv_shuffle=False'))
    assert (shuf['reward'], shuf['anchor_local'], shuf['safe']) == (real['reward'], real['anchor_local'], real['safe'])
    (ar, safe_r), (ash, safe_s) = a_real[0], a_shuf[0]  # the objective's first call: the update's
    assert safe_r == safe_s and len(set(ar.tolist())) > 1  # distinct values: a permutation can show
    assert torch.equal(ar.sort().values, ash.sort().values) and not torch.equal(ar, ash)
    assert torch.equal(a_off[0][0], ar)
    assert max((w_real[k] - w_shuf[k]).abs().max().item() for k in w_real) > 0
    assert all(torch.equal(w_real[k], w_off[k]) for k in w_real)


def test_fork_min_draws_only_later_forks():
    # kvpo.plan's earliest (kvpo/train.py --fork_min, bench/kvpo_verdicts.py's suspect control): forks before it are
    # never drawn; with it at 0 every eligible fork is drawn, fork 4's branches all alike (pool 2 = n_random)
    from streaming import toy_sf
    L, args = toy_sf.LAYOUT, (9, toy_sf.LAYOUT, 6, 1, 2, 9)
    assert kvpo.eligible_forks(9, L, 1, 2, 9, 9, 9, 1) == [4, 5, 6, 7]
    late = [kvpo.plan(*args, s, 9, 9, 1, earliest=6) for s in range(40)]
    assert {p['fork'] for p in late} == {6, 7}
    assert all(len({tuple(o) for o in p['older']}) >= 4 for p in late)  # pools of 4 and 5: no identical branches
    every = [kvpo.plan(*args, s, 9, 9, 1) for s in range(40)]
    assert {p['fork'] for p in every} == {4, 5, 6, 7}
    assert all(len({tuple(o) for o in p['older']}) == 1 for p in every if p['fork'] == 4)


def test_fuse_without_the_second_normalisation():
    # --fuse_std=False: w_l A_l + w_g A_g, clamped; the released fuse divides each by its population std (numbers by
    # hand: std([0.5, -1, 3]) = sqrt(49/18) = 1.6499)
    a_l, a_g = torch.tensor([0.5, -1.0, 3.0]), torch.tensor([1.0, 1.0, -4.0])
    assert torch.allclose(kvpo.fuse(a_l, a_g, normalise=False), torch.tensor([1.0, -0.5, 1.0]))
    assert torch.allclose(kvpo.fuse(a_l, None, clamp=10.0, normalise=False), a_l)
    assert torch.allclose(kvpo.fuse(a_l, None, clamp=10.0), torch.tensor([0.30305, -0.60609, 1.81827]), atol=1e-4)


def test_train_passes_fork_min_and_fuse_std(tmp_path, monkeypatch):
    # the switches reach the loop: every logged fork >= fork_min, and fuse sees normalise=False
    seen = []
    fuse = kvpo.fuse
    monkeypatch.setattr(kvpo, 'fuse', lambda *a, **k: seen.append(a[5] if len(a) > 5 else k.get('normalise', True))
                        or fuse(*a, **k))
    out = str(tmp_path / 'run')
    monkeypatch.setattr(sys, 'argv', ['kvpo.train', 'kvpo/config/toy.py', *STUDENT, '--prompts_per_iter=2', '--max_iters=2',
                                      '--eval_every=0', '--save_every=0', '--fork_min=7', '--fuse_std=False',
                                      f'--out_dir={out}'])
    runpy.run_module('kvpo.train', run_name='__main__')
    assert [r['fork'] for r in metrics(out) if 'fork' in r] == [7, 7] and seen == [False] * 4
