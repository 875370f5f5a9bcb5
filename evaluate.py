"""
The held-out evaluation of train.py: ODE samples of the evaluation prompts, each item (prompt i %
P, seed i) the same at every evaluation, scored by the reward, its composite, the visual metrics
(metrics.py) and, in the toy world, the distance to the data manifold; the means over all items.

    evaluate = HeldOut(prompts, samples=2, ...)   # once, in train.py
    means = evaluate(policy, iter_num)             # {'VQ': ..., 'composite': ..., ...}

Every rank runs the same number of forward batches (FSDP's collectives): the items are padded to a
multiple of the data-parallel ranks, and the padding is dropped before the means; under sequence
parallel the first rank of each group scores its clips. The means are taken in item order, so they
do not depend on the world size.

Tested by: python -m pytest tests/test_train_ranks.py (2 ranks vs 1 process, items that do not divide)
"""
import os

import torch
import torch.distributed as dist

from model import count_passes, generators, noise, sample, save_mp4, seed_of
from reward import combine


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
            x, _ = sample(policy, noise(self.shape, gens, self.device), self.sigmas, text, self.cfg, text_neg,
                          'ode', 0.0, gens, boundary=self.preemption.point)
            if not self.leads:  # an sp group's other ranks computed the same clips
                continue
            rows += [(i, r) for i, r in zip(idx, self.score(x, prompts)) if i < items]
            self.write_videos(idx, items, iter_num)
        if dist.is_initialized():
            parts = [None] * dist.get_world_size()
            dist.all_gather_object(parts, rows)
            rows = [r for p in parts for r in p]
        rows = [r for _, r in sorted(rows, key=lambda r: r[0])]  # item order: the same means on any world size
        count_passes(self.passes, ('eval',), self.device)
        policy.train()
        self.move_visual(self.visual, 'cpu')
        return {k: torch.tensor([r[k] for r in rows]).nanmean().item() for k in rows[0]}  # NaN: unscored video

    def score(self, x, prompts):
        """One dict of floats per clip of latents x (B, C, F, h, w)."""
        self.frames = frames = self.decode(x)
        sc = self.reward_fn(frames, prompts, self.fps)
        sc['composite'] = combine(sc, self.reward_weights)
        if self.manifold_distance is not None:
            sc['manifold'] = self.manifold_distance(frames)
        sc.update({k: fn(frames, prompts) for k, fn in self.visual.items()})  # per-frame mean, (B,) each
        return [{k: float(v[j]) for k, v in sc.items()} for j in range(len(prompts))]

    def write_videos(self, idx, items, iter_num):
        """The first `videos` clips of each rank, rank 0's only, as out_dir/eval/iterNNNNNN_i.mp4."""
        for j, i in enumerate(idx):
            if self.dp_rank == 0 and self.leads and i < min(items, self.videos * self.dp_world):
                os.makedirs(os.path.join(self.out_dir, 'eval'), exist_ok=True)
                save_mp4(self.frames[j], os.path.join(self.out_dir, 'eval', f'iter{iter_num:06d}_{i}.mp4'), self.fps)
        self.frames = None
