"""
The reward interface and GRPO's advantages (docs/method.md sections 4.1-4.3).

A reward is any reward_fn(frames, prompts, fps) -> {'VQ', 'MQ', 'TA', ...: (B,) float}: frames
(B, F, 3, H, W) in [0, 1], one prompt a clip, a clip it cannot score NaN. The paper's is VideoAlign,
frozen (models/videoalign.py); the toy world brings its own exact one (models/toy.py). From the
scores:

    r = w_vq VQ + w_mq MQ + w_ta TA                 combine: Setting B (0.5, 0.5, 1), A (1, 1, 1)
    A = clip((r - mean_group) / std_group, +-clip)  group_advantages: a NaN reward leaves its group
    A = each component standardised in its group    component_advantages: 'per_component', 'taros'
    g = d r / d frames                              score_and_grad (extras/credit.py's TVRL credit)

    reward_fn, manifold_distance = load_reward('videoalign', videoalign_dir, qwen_dir, 'cuda')  # train.py
    r = combine(reward_fn(frames, prompts, fps), reward_weights)                               # (B,)

The reward models are models: load_reward (models/videoalign.py) gives VideoAlign or the family's own.

Where this differs from the paper and the released code: a clip the reward cannot score (NaN, or a
non-finite frame: FiniteFrames) leaves its group's mean and std and the update, where the released
loop scored it 0 (docs/method.md 6.2.5); 'taros' is our reading of an abstract, not its code (4.3).

Tested by: python -m pytest tests/test_reward.py tests/test_advantage.py
"""
import torch

DIMS = ("VQ", "MQ", "TA")  # the components a reward returns, in the order of the weights
SETTING_A = (1.0, 1.0, 1.0)  # (w_vq, w_mq, w_ta): equal weights, VideoAlign's Overall
SETTING_B = (0.5, 0.5, 1.0)  # the paper's main setting (train.py's reward_weights)


def combine(scores, weights):
    """Composite reward (B,): w_vq*VQ + w_mq*MQ + w_ta*TA; a NaN score stays NaN."""
    return sum(w * scores[k] for w, k in zip(weights, DIMS))  # weights in DIMS order (VQ, MQ, TA)


def score_and_grad(reward_fn, frames, prompts, fps, weights):
    """Scores (as reward_fn) and g = d combine(scores, weights) / d frames (B, F, 3, H, W) float32,
    the gradient of each clip's composite w.r.t. its own pixels, the reward's parameters held fixed
    (they never receive gradients: VideoAlign's are frozen, the toy has none). VideoAlign
    differentiates through its torch preprocessing (resize, patchify; 8-bit rounding
    straight-through). A clip whose score is NaN gets g = 0. One backward of the sum: clips do not
    interact in the reward."""
    x = frames.detach().float().requires_grad_(True)
    with torch.enable_grad():
        scores = getattr(reward_fn, "score", reward_fn)(x, prompts, fps)
        r = combine(scores, weights)  # (B,)
        ok = torch.isfinite(r.detach())
        if ok.any():
            torch.where(ok.to(r.device), r, 0.0).sum().backward()
    g = x.grad if x.grad is not None else torch.zeros_like(x)
    g = torch.where(torch.isfinite(g), g, 0.0)  # (B, F, 3, H, W)
    return {k: v.detach() for k, v in scores.items()}, g


def group_advantages(r, clip=5.0, eps=1e-6):
    """GRPO advantages (P, G) of rewards r (P, G), one group per row: (r - mean) / std over the
    group's finite members, clipped to [-clip, clip]. A NaN reward (a video the reward model could
    not score) leaves its group and gets advantage 0; so does every member of a group whose std is
    <= eps (equal rewards, or fewer than 2 finite ones: nothing to learn).
    Returns (adv, valid, std (P, 1))."""
    valid = ~torch.isnan(r)
    n = valid.sum(1, keepdim=True).clamp(min=1)
    mean = torch.where(valid, r, 0.0).sum(1, keepdim=True) / n
    # the population std
    std = (torch.where(valid, (r - mean) ** 2, 0.0).sum(1, keepdim=True) / n).sqrt()
    adv = ((r - mean) / std.clamp(min=eps)).clamp(-clip, clip)
    return torch.where(valid & (std > eps), adv, 0.0), valid, std


def check_valid(valid, iteration, out_dir, log=print):
    """Stop before a broken reward model touches the weights: every reward of the batch NaN is the
    reward model failing, not a bad clip (RuntimeError, checkpoints untouched). Some NaN: one line
    (log: rank 0's print) saying those clips leave their groups and the loss. valid (P, G) bool."""
    if not valid.any():
        raise RuntimeError(f'iteration {iteration}: every reward is NaN; the reward model is '
                           f'failing (see its warnings above). Checkpoints in {out_dir} are '
                           'untouched.')
    if not valid.all():
        log(f'warning: iteration {iteration}: {int((~valid).sum())} of {valid.numel()} rewards '
            'are NaN; those clips are left out of their groups and of the loss')


# advantage = 'per_component' | 'taros' (train.py): each component judged within its group first.
# The two taros thresholds are fixed: our reading of an abstract that states none (docs/method.md
# 4.3), not a tuned or published value, so not settings
TAROS_DEADZONE = 0.5   # a member's standardised component counts only beyond +-this (sparsity)
TAROS_SATURATED = 0.5  # a component whose group spread is under this x the batch's: saturated
ADVANTAGES = ('grpo', 'per_component', 'taros')  # 'grpo': the composite in its group (the paper)
CHOICES = dict(advantage=ADVANTAGES)  # train.py's setting that picks one of these names


def component_advantages(c, weights, kind, clip=5.0, eps=1e-6):
    """Advantages (P, G) of component rewards c (P, G, K), the K components in DIMS order, one group
    a row (docs/method.md section 4.3 argues each choice; 'taros' is our reading of an abstract, not
    its code):
        z_k = (c_k - mean_k) / std_k        each component standardised within its group (population
                                            std over the group's valid members; a flat component: 0)
        'per_component': a = sum_k w_k z_k  (decoupled normalisation of multi-reward GRPO)
        'taros':  a = sum_k w_k f_k soft(z_k),  soft(z) = sign(z) max(|z| - TAROS_DEADZONE, 0): a
                  component moves only the members it clearly separates; f_k = min(1, std_k /
                  (TAROS_SATURATED * batch std_k)): a component whose spread within the group is
                  small against its spread over the whole batch is saturated there and counts less
        A = a / (batch std of a), clipped to [-clip, clip].
    A clip with a NaN component leaves its group (valid False, advantage 0), as group_advantages
    does, and a group with fewer than 2 valid members has advantage 0. Returns (adv, valid)."""
    w = torch.tensor(weights, dtype=c.dtype, device=c.device)  # (K,)
    valid = ~torch.isnan(c).any(-1)  # (P, G)
    m = valid.unsqueeze(-1)  # (P, G, 1)
    n = m.sum(1, keepdim=True).clamp(min=1)  # (P, 1, 1)
    mean = torch.where(m, c, 0.0).sum(1, keepdim=True) / n  # (P, 1, K)
    std = (torch.where(m, (c - mean) ** 2, 0.0).sum(1, keepdim=True) / n).sqrt()  # (P, 1, K)
    z = torch.where(m & (std > eps), (c - mean) / std.clamp(min=eps), 0.0)  # (P, G, K)
    if kind == 'taros':
        z = z.sign() * (z.abs() - TAROS_DEADZONE).clamp(min=0)
        # (K,) the spread over the whole batch
        spread = c[valid].std(0, unbiased=False) if valid.sum() > 1 else torch.zeros_like(w)
        z = z * (std / (TAROS_SATURATED * spread).clamp(min=eps)).clamp(max=1)
    elif kind != 'per_component':
        raise ValueError(f'unknown advantage {kind!r}')
    a = (z * w).sum(-1)  # (P, G)
    ok = valid & (valid.sum(1, keepdim=True) >= 2)
    scale = a[ok].std(unbiased=False) if ok.sum() > 1 else a.new_ones(())
    return torch.where(ok, a / scale.clamp(min=eps), 0.0).clamp(-clip, clip), valid


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
