"""
The reward interface and GRPO's advantages (docs/method.md sections 4.1-4.2).

A reward is any reward_fn(frames, prompts, fps) -> {'VQ', 'MQ', 'TA', ...: (B,) float}: frames
(B, F, 3, H, W) in [0, 1], one prompt a clip, a clip it cannot score NaN. The paper's is VideoAlign,
frozen; the toy world brings its own exact one (models/toy.py). train.py loads one by name
(reward_model: models/videoalign.py REWARDS, where a new reward is a function and its line). Then:

    r = w_vq VQ + w_mq MQ + w_ta TA                 combine: Setting B (0.5, 0.5, 1), A (1, 1, 1)
    A = clip((r - mean_group) / std_group, +-clip)  group_advantages: a NaN reward leaves its group

Where this differs from the paper and the released code: a clip the reward cannot score (NaN, or a
non-finite frame: infra/finite.py FiniteFrames) leaves its group's mean and std and the update,
where the released loop scored it 0 (docs/method.md 6.2.5). The add-ons' advantages (per
component, TaRoS) are extras/variants.py's.

Tested by: python -m pytest tests/test_reward.py tests/test_advantage.py
"""
import torch

DIMS = ("VQ", "MQ", "TA")  # the components a reward returns, in the order of the weights
SETTING_A = (1.0, 1.0, 1.0)  # (w_vq, w_mq, w_ta): equal weights, VideoAlign's Overall
SETTING_B = (0.5, 0.5, 1.0)  # the paper's main setting (train.py's reward_weights)


def combine(scores, weights):
    """Composite reward (B,): w_vq*VQ + w_mq*MQ + w_ta*TA; a NaN score stays NaN."""
    return sum(w * scores[k] for w, k in zip(weights, DIMS))  # weights in DIMS order (VQ, MQ, TA)


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
