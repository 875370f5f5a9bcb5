"""
KVPO's shuffled-advantage control (kvpo/train.py --adv_shuffle, the control of bench/kvpo_verdicts.py), on the
distilled streaming toy (kvpo/config/toy_sf.py): the rollout and the rewards are the real run's bitwise, the
advantages the loss receives are the real ones permuted within the video (not the identity for this seed), the
safe gate unchanged, and the update differs; --adv_shuffle=False is the default bitwise.
"""
import runpy
import sys

import torch

from kvpo import kvpo
from test_train import metrics, weights


def one(tmp_path, monkeypatch, name, *extra):
    out, seen = str(tmp_path / name), []
    loss = kvpo.loss

    def recording(s, s_old, s_init, adv, safe, *a, **k):
        seen.append((adv.detach().clone(), safe))
        return loss(s, s_old, s_init, adv, safe, *a, **k)
    monkeypatch.setattr(kvpo, 'loss', recording)
    monkeypatch.setattr(sys, 'argv', ['kvpo.train', 'kvpo/config/toy_sf.py', '--prompts_per_iter=1', '--max_iters=1',
                                      '--eval_every=0', '--save_every=0', '--seed=5', f'--out_dir={out}', *extra])
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
