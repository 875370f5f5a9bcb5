"""What the first 8-GPU launch would meet and only CUDA shows, simulated on the CPU (docs/method.md 4.6):
- the recompute of activation checkpointing under FSDP2's bf16 mixed precision on torch <= 2.12, which did
  not cast a block's inputs in the recompute (pytorch issue 159359): the forward saved bf16 tensors, the
  recompute made fp32 ones, and torch.utils.checkpoint stopped the first backward;
- the rollout's forward (rollout_batch clips, no grad) and the update's (train_batch clips, with grad) differ
  by their rounding in bf16; a 1% velocity difference at the late steps stands in for it: every losing
  clip keeps its gradient, and the drift is in metrics.jsonl;
- a non-finite gradient skips its optimizer step, and a few in a row stop the run with the last good
  checkpoint as it was; a NaN frame from the decoder scores its clip NaN instead of stopping a rank.
python -m pytest tests/test_gpu_launch.py"""
import os
import socket
import sys

import json

import pytest
import torch
import torch.distributed as dist

import sde
from extras import diagnostics
from models import policy as model
from models.videoalign import load_reward

sys.path.insert(0, os.path.dirname(__file__))
from tiny_hunyuan import make_tiny_hunyuan  # noqa: E402
from tiny_wan import make_tiny_wan  # noqa: E402
from tiny_videoalign import make_tiny_videoalign  # noqa: E402
from test_train import SMALL, metrics, run_here, weights  # noqa: E402


@pytest.fixture(scope='module')
def roots(tmp_path_factory):
    return {'hunyuan': make_tiny_hunyuan(tmp_path_factory.mktemp('tiny_hunyuan')),
            'wan': make_tiny_wan(tmp_path_factory.mktemp('tiny_wan'))}


@pytest.fixture
def one_rank():
    # a process group of one gloo rank in this process: FSDP2 needs one, a world of 1 shards nothing
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        port = s.getsockname()[1]
    dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def recompute_without_cast(monkeypatch):
    """FSDP2's pre-forward hook as torch 2.9-2.12 ran it in a checkpoint's recompute (the block is then in
    PRE_BACKWARD): its parameters unsharded, its inputs passed on as they came, not cast to param_dtype
    (torch 2.13 casts them there too)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
    new = FSDPState._pre_forward

    def old(self, module, args, kwargs):
        if self._training_state == TrainingState.PRE_BACKWARD:
            for group in self._fsdp_param_groups:
                if not group.is_unsharded:
                    group.unshard()
                    group.wait_for_unshard()
            return args, kwargs
        return new(self, module, args, kwargs)
    monkeypatch.setattr(FSDPState, '_pre_forward', old)


def batch(root, B=2):
    cache = model.encode_prompts(root, ['a red car', ''])
    text = model.batch_text(cache, ['a red car'] * B, 'cpu')
    C, F, h, w = model.latent_shape(root, 9, 32, 32)
    return torch.randn(B, C, F, h, w, generator=torch.Generator().manual_seed(0)), text


@pytest.mark.parametrize('name', ['hunyuan', 'wan'])
def test_first_backward_survives_the_recompute_of_torch_2_12(roots, name, one_rank, monkeypatch):
    """The family's forward through load_policy's FSDP2 wrapping with bf16 parameters (as on a GPU), under
    bf16 autocast (velocity() on a GPU), with gradient checkpointing, then one backward with torch <= 2.12's
    uncast recompute patched in: it runs, and every trained weight gets a finite gradient."""
    recompute_without_cast(monkeypatch)
    net = model.load_transformer(roots[name])
    net.enable_gradient_checkpointing()
    fam = model.family(roots[name])
    model.shard(net, fam.blocks(net), cuda=True)  # cuda: bf16 parameters and compute, as on a GPU
    x, text = batch(roots[name])
    with torch.autocast('cpu', torch.bfloat16):
        v = fam.forward(net, x, torch.tensor([0.9, 0.3]), text)
    v.float().square().mean().backward()  # torch <= 2.12 with cast_forward_inputs: CheckpointError here
    grads = [p.grad for p in net.parameters() if p.requires_grad]
    assert grads and all(g is not None for g in grads[:4])
    assert all(torch.isfinite(g.full_tensor() if hasattr(g, 'full_tensor') else g).all() for g in grads
               if g is not None)


def perturbed(monkeypatch, batch, factor=1.01, below=0.8):
    """policy.velocity times factor in forwards of `batch` clips at sigma < below (SMALL: its last two of
    4 steps, sigma 0.75 and 0.5): one batch shape's
    forward differs from the other's at the late steps, as bf16 GEMMs tiled for another shape do."""
    inner = model.velocity

    def velocity(net, x, s, *a, **kw):
        v = inner(net, x, s, *a, **kw)
        return v * factor if x.shape[0] == batch and float(s.max()) < below else v
    monkeypatch.setattr(model, 'velocity', velocity)


def recorded(monkeypatch):
    """[(adv (n,), d loss / d logp (n,), ratio (n,))] of every micro-batch of the update: the gradient that
    reaches each clip's recomputed log-prob, read by a hook on it."""
    seen, grads = [], []
    step, add = sde.step, diagnostics.UpdateStats.add

    def hooked(*a, **kw):
        out = step(*a, **kw)
        if out.logp is not None and out.logp.requires_grad:
            out.logp.register_hook(lambda g: grads.append(g.detach().clone()))
        return out

    def added(self, loss, terms, *rest):
        seen.append((terms['adv'].detach().clone(), grads.pop(), terms['ratio'].detach().clone()))
        return add(self, loss, terms, *rest)
    monkeypatch.setattr(sde, 'step', hooked)
    monkeypatch.setattr(diagnostics.UpdateStats, 'add', added)
    return seen


def test_losing_clips_keep_their_gradient_when_the_rollout_forward_rounds_differently(tmp_path, monkeypatch):
    """SMALL's rollouts run 4 clips a forward, its update 2: the 4-clip forward is 1% off at the late steps.
    The recomputed log-prob then sits below the rollout's by more than clip_range; a ratio against the
    rollout's would be clipped, and the pessimistic clip would zero every negative-advantage clip's gradient.
    At one optimizer step per rollout batch the ratio is the recomputation's own (exactly 1), so each clip's
    log-prob gets -A S_t / denominator, losers included, and metrics.jsonl reports the drift."""
    perturbed(monkeypatch, batch=4)
    seen = recorded(monkeypatch)
    out = str(tmp_path / 'drift')
    run_here(monkeypatch, SMALL + [f'--out_dir={out}', '--max_iters=1', '--diag_every=0'])
    (row,) = [r for r in metrics(out) if 'reward' in r]
    assert row['logp_drift_max'] > 1e-4 and row['logp_drift_frac'] > 0, row  # the 1% is visible
    losers = [(a, g) for adv, grad, _ in seen for a, g in zip(adv.tolist(), grad.tolist()) if a < 0]
    assert len(losers) >= 2 and all(g > 0 for _, g in losers), losers  # d(-A ratio)/d logp = -A > 0
    assert row['clipfrac'] == 0 and row['ratio_max'] == 0, row


def test_several_updates_recompute_the_old_log_probs_in_the_update_shape(tmp_path, monkeypatch):
    """updates_per_iter=2: before its first optimizer step the update recomputes every trained step's old
    log-prob at theta_old in its own batch shape, so the first step's ratios are 1 (the policy has not moved)
    though the rollout's 4-clip forward was 1% off; the drift is measured there, and the passes counted."""
    perturbed(monkeypatch, batch=4)
    seen = recorded(monkeypatch)
    out = str(tmp_path / 'two')
    run_here(monkeypatch, SMALL + [f'--out_dir={out}', '--max_iters=1', '--diag_every=0', '--updates_per_iter=2'])
    (row,) = [r for r in metrics(out) if 'reward' in r]
    assert row['logp_drift_max'] > 1e-4, row
    n_train = 2  # timestep_fraction 0.5 of config/toy.py x 4 steps
    assert row['passes_old'] == 4 * n_train, row  # 2 prompts x G=2 clips, each trained step once
    first = seen[:len(seen) // 2]  # the first optimizer step's micro-batches
    assert all((ratio - 1).abs().max() < 1e-6 for _, _, ratio in first), [r for _, _, r in first]


def test_non_finite_gradients_skip_the_step_then_stop_with_the_last_good_checkpoint(tmp_path, monkeypatch):
    """Two good iterations (a checkpoint at 2), then every update's gradient NaN: iterations 3 and 4 skip their
    optimizer step (logged), the checkpoint of 4 holds the weights of 2, and the third skip in a row stops the
    run with one line; no weight in any checkpoint is NaN."""
    out = str(tmp_path / 'nan')
    run_here(monkeypatch, SMALL + [f'--out_dir={out}', '--max_iters=2'])
    good = weights(out)
    inner = model.velocity
    monkeypatch.setattr(model, 'velocity', lambda net, x, *a, **kw: inner(net, x, *a, **kw) *
                        (float('nan') if torch.is_grad_enabled() else 1.0))
    message, _ = run_here(monkeypatch, SMALL + [f'--out_dir={out}', '--max_iters=8'], check=False)
    assert message and 'iteration 5: 3 optimizer steps in a row had a non-finite gradient norm' in message, message
    rows = [r for r in metrics(out) if 'reward' in r]
    assert [r['iter'] for r in rows] == [1, 2, 3, 4] and [r['skipped_steps'] for r in rows] == [0, 0, 1, 1]
    with open(os.path.join(out, 'latest')) as f:
        assert f.read().strip().endswith('000004')
    now = weights(out)
    assert now.keys() == good.keys() and all(torch.equal(now[k], good[k]) for k in good)


def test_a_nan_frame_scores_its_clip_nan_and_the_others_as_before(tmp_path):
    """load_reward's VideoAlign (tiny, random) given 3 clips, one with a NaN pixel (a bf16 decoder's
    overflow): that clip scores NaN in every output, the others what they score without it in the batch."""
    va, qwen = make_tiny_videoalign(str(tmp_path / 'va'))
    fn, _ = load_reward('videoalign', va, qwen, 'cpu')
    frames = torch.rand(3, 8, 3, 32, 48, generator=torch.Generator().manual_seed(0))
    frames[1, 3, 0, 5, 5] = float('nan')
    prompts = ['a red car', 'a dog', 'a cat']
    scores = fn(frames, prompts, 8)
    alone = fn(frames[[0, 2]], [prompts[0], prompts[2]], 8)
    for k in ('VQ', 'MQ', 'TA'):
        assert torch.isnan(scores[k][1]) and torch.isfinite(scores[k][[0, 2]]).all()
        torch.testing.assert_close(scores[k][[0, 2]].float(), alone[k].float(), atol=2e-2, rtol=0)
