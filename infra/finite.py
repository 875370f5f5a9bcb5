"""
A clip whose rollout went non-finite (a NaN or inf latent or log-prob: a bf16 overflow) leaves the
update, instead of throwing away every rank's optimizer step. Masking its loss is not enough: the
update's forward of a NaN x_t is NaN, and the backward multiplies the mask's zero by it (0 * NaN = NaN)
into every weight's gradient. So such a clip is
- scored NaN in every reward output (it leaves its group's mean and std as a NaN reward does, and the
  loss's global normalisation counts only the valid clips);
- removed from the update's micro-batches; a micro-batch left with none of its clips (a rank whose
  clips all went non-finite) still runs its forward and backward, on the clips' latents set to 0
  (finite) at weight 0 (invalid: train.step_loss's where()), because FSDP's all-gathers and
  reduce-scatters need every rank in every pass; its gradient is exactly 0, and as its clips are not
  valid it adds nothing to lambda_KL's input or the log;
- counted in the log (nonfinite_clips, all ranks').

    clips['finite'] = finite.mark(clips, scores)  # score(): [bool] a clip; the bad ones scored NaN, zeroed
    for b, k in finite.micro_batches(ids, clips['finite'], size, n_steps)  # update(): finite clips, or a stand-in
    finite.count(clips['finite'], device, dp_group)  # the log's nonfinite_clips

Tested by: python -m pytest tests/test_launch_second.py (one NaN clip among four: the step is taken
and the gradient is that of the three others, computed apart; 2 ranks, one of them all NaN)
"""
import torch

from infra import parallel

ROLLOUT = ('xs', 'logps')  # what a rollout keeps that must be finite (a NaN mean reaches x_{t+1})
ZEROED = ('xs', 'means', 'logps')  # a removed clip's stand-in: finite, never trained (valid 0)


def mark(clips, scores):
    """[bool] a local clip, whether its rollout is finite; a clip that is not gets NaN in every
    per-clip score (n,) and 0 in its latents, means and log-probs (in place)."""
    finite = torch.stack([torch.isfinite(clips[k].flatten(1)).all(1) for k in ROLLOUT]).all(0)  # (n,)
    flags = finite.tolist()  # one host sync an iteration
    if all(flags):
        return flags
    bad = ~finite
    for k in ZEROED:
        if k in clips:
            clips[k][bad.to(clips[k].device)] = 0
    for k, v in scores.items():
        if torch.is_tensor(v) and v.dim() == 1 and v.is_floating_point():
            scores[k] = torch.where(bad.to(v.device), float('nan'), v)
    return flags


def part(b, finite):
    """(the finite clips of micro-batch b, False), or (b, True) when none is: a stand-in pass."""
    kept = [i for i in b if finite[i]]
    return (kept, False) if kept else (b, True)


def micro_batches(ids, finite, size, n_steps):
    """[(clips, k)] of the update: each `size` clips of ids at each of their n_steps trained steps
    (step k of each clip's order), the non-finite clips left out; a micro-batch left with none keeps
    its (zeroed, invalid) clips as a stand-in, so every rank runs the same passes."""
    return [(part(ids[i:i + size], finite)[0], k) for i in range(0, len(ids), size) for k in range(n_steps)]


def count(finite, device, dp_group=None):
    """Non-finite clips of the iteration over all data-parallel ranks (an sp group's ranks share
    theirs); collective."""
    n = torch.tensor([[float(len(finite) - sum(finite))]], device=device)
    return int(parallel.gather(n, dp_group).sum().item())


class FiniteFrames:
    """reward_fn whose clips with a NaN or inf frame (a bf16 decoder's overflow) score NaN in every
    output, so they leave their group as a NaN reward does, instead of failing the reward's input
    check on one rank while the others wait in a collective. Such clips are scored as black frames
    (same keys and shapes on every rank), then set NaN. Its other attributes are reward_fn's
    (sample_fps)."""

    def __init__(self, fn):
        self.fn = fn

    def __getattr__(self, name):
        return getattr(self.fn, name)

    def __call__(self, frames, prompts, fps, fn=None):
        fn = fn or self.fn
        bad = ~torch.isfinite(frames.detach()).flatten(1).all(1)  # (B,)
        if not bad.any():
            return fn(frames, prompts, fps)
        at = lambda t: bad.to(t.device).view(-1, *[1] * (t.dim() - 1))  # noqa: E731
        scores = fn(torch.where(at(frames), 0.0, frames), prompts, fps)
        return {k: torch.where(at(v), float("nan"), v)
                if torch.is_tensor(v) and v.is_floating_point() else v for k, v in scores.items()}

    def score(self, frames, prompts, fps):  # score_and_grad's differentiable call, guarded alike
        return self(frames, prompts, fps, getattr(self.fn, "score", self.fn))
