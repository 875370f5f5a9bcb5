"""
A clip whose rollout went non-finite leaves the update (infra/finite.py), in the fast tier:
- which clips count: a NaN or inf in its latents *or* in its log-probs removes a clip, and a removed clip's
  latents, means and log-probs become 0 (finite) and its scores NaN; a micro-batch with no finite clip is a
  stand-in pass, one with any keeps only those;
- `python train.py` (one process, run here) with a whole micro-batch of NaN clips: the stand-in still runs its
  forward and backward (every rank runs every pass: counted here), on finite zeroed latents (the optimizer
  step is taken, the gradient finite), and nothing of it reaches the log (no log-prob drift from its zeroed
  rollout: a stand-in measured as a clip would drift by its whole log-density) or lambda_KL (the controller's
  input is the finite clips' KL, the one logged, once the policy has moved from the anchor).
The two-rank count (nonfinite_clips over all ranks) is in tests/test_ranks_agree.py.

    python -m pytest tests/test_nonfinite.py
"""
import os
import sys

import json

import torch

import trust_region as tr
from infra import finite
from models import policy as model

sys.path.insert(0, os.path.dirname(__file__))
from test_launch_second import nan_rollouts  # noqa: E402
from test_train import SMALL, metrics, run_here  # noqa: E402


def clips_of(n=5, steps=3):
    g = torch.Generator().manual_seed(0)
    return dict(xs=torch.randn(n, steps + 1, 2, 3, generator=g), means=torch.randn(n, steps, 2, 3, generator=g),
                logps=torch.randn(n, steps, generator=g))


def test_a_nan_in_latents_or_log_probs_removes_the_clip_and_zeroes_it():
    clips = clips_of()
    clean = {k: v.clone() for k, v in clips.items()}
    clips['xs'][1, 2, 0, 1] = float('nan')     # a latent alone
    clips['logps'][2, 1] = float('nan')        # a log-prob alone (its latents finite)
    clips['xs'][3, 3, 1, 2] = float('inf')     # an overflow
    scores = dict(VQ=torch.arange(5.0), MQ=torch.ones(5), TA=torch.zeros(5), names=['a'] * 5)
    flags = finite.mark(clips, scores)
    assert flags == [True, False, False, False, True]
    for k in ('xs', 'means', 'logps'):  # removed: finite, never NaN again (a stand-in forwards them)
        assert torch.equal(clips[k][[1, 2, 3]], torch.zeros_like(clips[k][[1, 2, 3]])), k
        assert torch.equal(clips[k][[0, 4]], clean[k][[0, 4]]), k
    for k in ('VQ', 'MQ', 'TA'):  # every per-clip score NaN for them, the others untouched
        assert torch.isnan(scores[k][[1, 2, 3]]).all() and torch.isfinite(scores[k][[0, 4]]).all(), k
    assert scores['VQ'][4] == 4 and scores['names'] == ['a'] * 5
    clean_scores = dict(VQ=torch.ones(5))
    assert finite.mark(clips_of(), clean_scores) == [True] * 5 and torch.equal(clean_scores['VQ'], torch.ones(5))


def test_a_micro_batch_keeps_its_finite_clips_or_is_a_stand_in():
    ok = [True, False, False, True, False, False]
    assert finite.part([0, 1], ok) == ([0], False)
    assert finite.part([1, 2], ok) == ([1, 2], True)  # none finite: the whole batch, flagged
    assert finite.part([3], ok) == ([3], False)
    assert finite.part([4, 5], ok) == ([4, 5], True)


def test_a_micro_batch_of_nan_clips_runs_as_a_stand_in_and_leaves_no_trace(tmp_path, monkeypatch):
    """G=4, train_batch 2, clips 2 and 3 NaN from step 2, 2 iterations: micro-batch [2, 3] has no finite clip.
    It still runs a forward with grad at each of the 4 trained steps (as many as [0, 1]: FSDP's collectives
    need every rank in every pass), on finite latents: the step is taken (skipped_steps 0, a finite gradient
    norm); its zeroed rollout is not logged as a clip: the update's log-probs drift from the rollout's by float
    noise only (the two finite clips' ones), where a stand-in measured as a clip drifts by a whole
    log-density; and lambda_KL moves on the finite clips' KL alone: at iteration 2 (the policy one step from
    the anchor, KL_pos > 0) the controller's input is the logged KL, the mean over the finite clips."""
    nan_rollouts(monkeypatch, [2, 3])
    kls, update = [], tr.KLController.update
    monkeypatch.setattr(tr.KLController, 'update', lambda self, kl, *a, **k: kls.append(kl) or update(self, kl, *a, **k))
    passes, inner = [], model.velocity

    def counted(net, x, *a, **kw):  # the clips of each forward with grad: the update's
        if torch.is_grad_enabled():
            passes.append(x.shape[0])
        return inner(net, x, *a, **kw)
    monkeypatch.setattr(model, 'velocity', counted)
    out = str(tmp_path / 'standin')
    run_here(monkeypatch, SMALL + [f'--out_dir={out}', '--max_iters=2', '--diag_every=0', '--prompts_per_iter=1',
                                   '--group_size=4', '--timestep_fraction=1.0', '--save_every=0', '--export_dtype=',
                                   '--kl_ratio_target=0'])  # the paper's controller: its input is the KL
    rows = [r for r in metrics(out) if 'reward' in r]
    for row in rows:
        assert row['nonfinite_clips'] == 2 and row['nan_rewards'] == 2, row
        assert row['skipped_steps'] == 0 and 0 < row['grad_norm'] < float('inf'), row
        assert row['logp_drift_max'] < 1e-3, row
    assert passes == [2] * 16, passes  # [0, 1] and the stand-in [2, 3], at each of the 4 steps, twice
    c = json.load(open(os.path.join(out, 'config.json')))['settings']
    w_pos, w_vel = tr.kl_weights(c['kl_strategy'], c['beta_pos'], c['beta_vel'])
    logged = w_pos * rows[1]['kl_pos'] + w_vel * rows[1]['kl_vel']  # the mean over the finite clips' terms
    assert len(kls) == 2 and logged > 0 and abs(kls[1] - logged) <= 1e-5 * logged, (kls, logged)
