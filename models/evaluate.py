"""
The held-out evaluation of train.py: ODE samples of the evaluation prompts, each item (prompt i %
P, seed i) the same at every evaluation, scored by the reward, its composite, the visual metrics
(extras/metrics.py), the frame statistics below and, in the toy world, the distance to the data
manifold; the means over all items. And the reward-hacking alarm that watches them.

    evaluate = HeldOut(prompts, samples=2, ...)   # once, in train.py
    means = evaluate(policy, iter_num)             # {'VQ': ..., 'composite': ..., ...}; per item: evaluate.items
    fields, line = alarm(iter_num, evaluate.items) # {'alarm': [...], 'watch_flagged': [...]}, 'alarm: ...' or None

The alarm (docs/method.md section 9): every watcher (each score and frame statistic) is compared with the
base model's (iteration 0) on the same items, paired, so its noise is the standard error of the per-item
differences. At an evaluation where the composite rose beyond its noise, a watcher that moved its wrong
way by more than `z` standard errors is flagged; flagged at two evaluations in a row, it trips the alarm.

Every rank runs the same number of forward batches (FSDP's collectives): the items are padded to a
multiple of the data-parallel ranks, and the padding is dropped before the means; under sequence
parallel the first rank of each group scores its clips. The means are taken in item order, so they
do not depend on the world size.

Tested by: python -m pytest tests/test_train_ranks.py (2 ranks vs 1 process, items that do not divide)
"""
import math
import os

import torch
import torch.distributed as dist

from infra import checkpoint
from models import family_of
from models.policy import count_passes, generators, noise, sample, save_mp4, seed_of
from reward import combine


DARK = 0.1   # luma below this is a dark pixel
EDGE = 0.1   # a luma step to the next pixel above this is an edge
LEVELS = 4   # colour histogram bins per channel (64 colours) of the colour entropy
# the way each watcher goes wrong: -1 falling, +1 rising, 0 either way; a score not named here goes wrong falling
WRONG = dict(manifold=+1, brightness=0, saturation=0, dark=+1, edges=-1, entropy=-1, flicker=+1)
NOT_WATCHED = ('composite',)  # what the alarm compares the watchers against


def frame_stats(frames):
    """Weight-free statistics (B,) of clips frames (B, F, 3, H, W) in [0, 1]: mean luma, mean chroma
    (max - min of the channels), the dark-pixel fraction, the edge density, the colour entropy (bits, of a
    LEVELS^3 histogram) and the temporal flicker (mean |change| of a frame's mean luma to the next)."""
    f = frames.float().clamp(0, 1)
    luma = 0.299 * f[:, :, 0] + 0.587 * f[:, :, 1] + 0.114 * f[:, :, 2]  # (B, F, H, W)
    gx, gy = luma[..., :-1, 1:] - luma[..., :-1, :-1], luma[..., 1:, :-1] - luma[..., :-1, :-1]
    codes = (f * LEVELS).long().clamp(max=LEVELS - 1)  # (B, F, 3, H, W) the bin of each channel
    codes = (codes[:, :, 0] * LEVELS + codes[:, :, 1]) * LEVELS + codes[:, :, 2]  # (B, F, H, W)
    p = torch.stack([torch.bincount(c.flatten(), minlength=LEVELS ** 3) for c in codes]).float()
    p = p / p.sum(1, keepdim=True)  # (B, 64)
    per_frame = luma.mean((2, 3))  # (B, F)
    return dict(brightness=luma.mean((1, 2, 3)), saturation=(f.amax(2) - f.amin(2)).mean((1, 2, 3)),
                dark=(luma < DARK).float().mean((1, 2, 3)),
                edges=((gx ** 2 + gy ** 2).sqrt() > EDGE).float().mean((1, 2, 3)),
                entropy=-torch.where(p > 0, p * p.log2(), 0.0).sum(1),
                flicker=per_frame.diff(dim=1).abs().mean(1) if f.shape[1] > 1 else per_frame.new_zeros(len(f)))


class Alarm:
    """The reward-hacking alarm (the module docstring); state_dict() travels in the checkpoints."""

    def __init__(self, z=2.0):
        self.z, self.base, self.flagged, self.tripped = z, None, [], None
        self.last = self.kept = None  # the previous evaluation's iteration; when tripped, the one to keep

    def paired(self, items, k):
        """(base mean, now mean, standard error of the mean per-item difference) of watcher k."""
        pairs = [(b[k], r[k]) for b, r in zip(self.base, items) if math.isfinite(b[k]) and math.isfinite(r[k])]
        if len(pairs) < 2:
            return float('nan'), float('nan'), float('nan')
        d = torch.tensor([r - b for b, r in pairs], dtype=torch.float64)
        return (sum(b for b, _ in pairs) / len(pairs), sum(r for _, r in pairs) / len(pairs),
                (d.std() / len(d) ** 0.5).item())

    def __call__(self, iter_num, items):
        """({'alarm': the watchers that trip it now, 'watch_flagged': those beyond their noise now}, the
        console line or None). The first call of a run that began at iteration 0 keeps the base model's."""
        last, self.last = self.last, iter_num
        if self.base is None:
            self.base = items if iter_num == 0 else None
            return dict(alarm=[], watch_flagged=[]), None
        stats = {k: self.paired(items, k) for k in items[0] if k in self.base[0]}
        before, now, se = stats['composite']
        flagged = []
        if now - before > self.z * se:  # the composite rose beyond its noise: did something pay for it?
            for k, (b, n, e) in stats.items():
                way = WRONG.get(k, -1)
                moved = (n - b) * way if way else abs(n - b)
                if k not in NOT_WATCHED and moved > self.z * e:  # NaN (unscored) compares False
                    flagged.append(k)
        tripped = [k for k in flagged if k in self.flagged]  # flagged at two evaluations in a row
        self.flagged = flagged
        if not tripped:
            return dict(alarm=[], watch_flagged=flagged), None
        self.tripped = self.tripped or iter_num
        self.kept = last
        line = (f'alarm: iteration {iter_num}: composite {before:.4f} -> {now:.4f} while '
                + ', '.join(f'{k} {stats[k][0]:.4f} -> {stats[k][1]:.4f} (SE {stats[k][2]:.4f})' for k in tripped)
                + ' (against the base model, paired over the held-out items, at two evaluations in a row)')
        return dict(alarm=tripped, watch_flagged=flagged), line

    def announce(self, iter_num, line, out_dir, hack_stop):
        """Rank 0: the alarm's line; the checkpoint of the last evaluation before it is pinned, so no
        rotation removes it."""
        kept = checkpoint.pin(out_dir, self.kept, f'the last evaluation before the alarm of {iter_num}')
        print(line + (f'; {kept} is kept' if kept else '') + ('; hack_stop: stopping' if hack_stop else ''))

    def summary(self, means):
        """'eval composite before <the base model's> -> after <means'>': the run's last line."""
        before = torch.tensor([r['composite'] for r in self.base]).nanmean().item()
        return f"eval composite before {before:.4f} -> after {means['composite']:.4f}"

    def state_dict(self):
        return dict(base=self.base, flagged=self.flagged, tripped=self.tripped, last=self.last)

    def load_state_dict(self, sd):
        self.base, self.flagged, self.tripped, self.last = sd['base'], sd['flagged'], sd['tripped'], sd['last']


def watched(frames, prompts, fps, reward_fn, weights, manifold_distance, visual):
    """What the alarm watches of clips frames (B, F, 3, H, W), {name: (B,)}: the reward's scores, their
    composite at the run's weights, the manifold distance (a world that has one), the visual metrics
    (per-frame means) and the frame statistics. The held-out evaluation's and sample.py's table."""
    sc = reward_fn(frames, prompts, fps)
    sc['composite'] = combine(sc, weights)
    if manifold_distance is not None:
        sc['manifold'] = manifold_distance(frames)
    sc.update({k: fn(frames, prompts) for k, fn in visual.items()})
    sc.update(frame_stats(frames))
    return sc


class HeldOut:
    def __init__(self, prompts, samples, *, seed, sigmas, cfg, shape, text_for, batch, decode, reward_fn,
                 reward_weights, manifold_distance, visual, move_visual, fps, out_dir, videos, dp_rank, dp_world,
                 leads, passes, preemption, device):
        self.__dict__.update(locals())
        del self.__dict__['self']

    def __call__(self, policy, iter_num, save_on_stop):
        """Mean scores of the current policy; save_on_stop: preemption's checkpoint for a stop meanwhile."""
        self.preemption.begin(save_on_stop)  # a stop: this evaluation runs again on resume
        policy.eval()
        self.move_visual(self.visual, self.device)
        items = len(self.prompts) * self.samples  # item i: prompt i % P, seed seed_of(seed, 'eval', i)
        mine = list(range(self.dp_rank, -(-items // self.dp_world) * self.dp_world, self.dp_world))
        rows = []
        for c in range(0, len(mine), self.batch):
            idx = mine[c:c + self.batch]
            prompts = [self.prompts[i % len(self.prompts)] for i in idx]
            gens = generators([seed_of(self.seed, 'eval', i) for i in idx])
            text, text_neg = self.text_for(prompts)
            x1, fam = noise(self.shape, gens, self.device), family_of(policy)
            if hasattr(fam, 'generate'):  # streaming: block by block from its KV cache, its own steps
                self.preemption.point()
                x = fam.generate(policy, x1, text, gens, self.cfg, text_neg)
            else:
                x, _ = sample(policy, x1, self.sigmas, text, self.cfg, text_neg, 'ode', 0.0, gens,
                              boundary=self.preemption.point)
            if not self.leads:  # an sp group's other ranks computed the same clips
                continue
            rows += [(i, r) for i, r in zip(idx, self.score(x, prompts)) if i < items]
            self.write_videos(idx, items, iter_num)
        if dist.is_initialized():
            parts = [None] * dist.get_world_size()
            dist.all_gather_object(parts, rows)
            rows = [r for p in parts for r in p]
        rows = [r for _, r in sorted(rows, key=lambda r: r[0])]  # item order: the same means on any world size
        self.items = rows  # one dict a held-out item (the alarm's)
        count_passes(self.passes, ('eval',), self.device)
        policy.train()
        self.move_visual(self.visual, 'cpu')
        return {k: torch.tensor([r[k] for r in rows]).nanmean().item() for k in rows[0]}  # NaN: unscored video

    def score(self, x, prompts):
        """One dict of floats per clip of latents x (B, C, F, h, w)."""
        self.frames = frames = self.decode(x)
        sc = watched(frames, prompts, self.fps, self.reward_fn, self.reward_weights, self.manifold_distance,
                     self.visual)
        return [{k: float(v[j]) for k, v in sc.items()} for j in range(len(prompts))]

    def write_videos(self, idx, items, iter_num):
        """The first `videos` clips of each rank, rank 0's only, as out_dir/eval/iterNNNNNN_i.mp4."""
        for j, i in enumerate(idx):
            if self.dp_rank == 0 and self.leads and i < min(items, self.videos * self.dp_world):
                os.makedirs(os.path.join(self.out_dir, 'eval'), exist_ok=True)
                save_mp4(self.frames[j], os.path.join(self.out_dir, 'eval', f'iter{iter_num:06d}_{i}.mp4'), self.fps)
        self.frames = None
