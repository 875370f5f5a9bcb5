"""
The held-out evaluation of train.py: ODE samples of the evaluation prompts, each item (prompt i %
P, seed i) the same at every evaluation, scored by the reward, its composite, the visual metrics
(extras/metrics.py), the frame statistics below and, in the toy world, the distance to the data
manifold; the means over all items. And the reward-hacking alarm that watches them.

    evaluate = HeldOut(prompts, samples=2, ...)   # once, in train.py
    means = evaluate(policy, iter_num)             # {'VQ': ..., 'composite': ..., ...}; per item: evaluate.items
    alarm = Alarm(z=2.0)                           # once; its state travels in the checkpoints
    fields, line = alarm(iter_num, evaluate.items, evaluate.reference(fam))  # the data's watchers, or None
    # fields {'alarm': [...], 'watch_flagged': [...]} for metrics.jsonl, line 'alarm: ...' or None

The alarm (docs/method.md section 9) reads each evaluation's means, as metrics.jsonl logs them. A watcher
(each score and frame statistic) goes wrong by moving away from the data, where the world has some (`data`:
the toy's clean renders of the held-out items, scored as the items are): its distance to the data's value
grew from the base model's (iteration 0); a one-sided watcher (WRONG: colour entropy falling, say) only on its
wrong side of the data. Without data, it goes wrong by moving its WRONG way from the base model's, and its
alarm line says so. A move counts beyond `z` standard errors of the base model's mean over
the held-out items (its spread over the items / sqrt(n)): a shift that a fresh draw of items would tell,
not merely one that the same items show. At an evaluation where the composite rose beyond its noise, a
watcher that went wrong beyond its own is flagged; flagged at two evaluations in a row, it trips the alarm.

Every rank runs the same number of forward batches (FSDP's collectives): the items are padded to a
multiple of the data-parallel ranks, and the padding is dropped before the means; under sequence
parallel the first rank of each group scores its clips. The means are taken in item order, so they
do not depend on the world size.

Tested by: python -m pytest tests/test_alarm.py (the alarm's rule by hand, and replayed on recorded toy runs:
bench/alarm.py), tests/test_train_ranks.py (2 ranks vs 1 process, items that do not divide)
"""
import os

import torch
import torch.distributed as dist

import sde
from infra import checkpoint, parallel
from models import family_of
from models.policy import count_passes, generators, noise, sample, save_mp4, seed_of
from reward import combine

# ----------------------------------------------------------------------------- settings (train.py's, set as its own)
eval_steps = 0                  # ODE steps of the held-out evaluation (0: num_steps)
eval_samples = 1                # ODE samples (seeds) per held-out prompt
eval_videos = 4                 # mp4 files written per evaluation
eval_metrics = 'clipscore,pickscore'  # watchers at held-out evaluation (extras/metrics.py)
clip_dir = 'weights/clip-vit-large-patch14'  # hf download openai/clip-vit-large-patch14 ...
pickscore_dir = 'weights/PickScore_v1'       # hf download yuvalkirstain/PickScore_v1 ...
alarm_z = 2.0                   # reward-hacking alarm: standard errors a watcher must move
hack_stop = False               # at the reward-hacking alarm: checkpoint and stop
# -----------------------------------------------------------------------------


DARK = 0.1   # luma below this is a dark pixel
EDGE = 0.1   # a luma step to the next pixel above this is an edge
LEVELS = 5   # colour histogram bins per channel (125 colours) of the colour entropy: odd, so mid-grey falls
             # mid-bin (at an even count 0.5 is a bin edge: a grey of 0.5 +- 0.005 reads as 8 colours, 3 bits)
# the way each watcher goes wrong where there is no data to compare with: -1 falling, +1 rising, 0 either way;
# a score not named here goes wrong falling
WRONG = dict(manifold=+1, brightness=0, saturation=0, dark=+1, edges=-1, entropy=-1, flicker=+1)
WAY = {-1: 'falling', 1: 'rising', 0: 'either way'}  # WRONG's ways, as the alarm's line says them
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
    p = p / p.sum(1, keepdim=True)  # (B, LEVELS^3)
    per_frame = luma.mean((2, 3))  # (B, F)
    return dict(brightness=luma.mean((1, 2, 3)), saturation=(f.amax(2) - f.amin(2)).mean((1, 2, 3)),
                dark=(luma < DARK).float().mean((1, 2, 3)),
                edges=((gx ** 2 + gy ** 2).sqrt() > EDGE).float().mean((1, 2, 3)),
                entropy=-torch.where(p > 0, p * p.log2(), 0.0).sum(1),
                flicker=per_frame.diff(dim=1).abs().mean(1) if f.shape[1] > 1 else per_frame.new_zeros(len(f)))


def means(rows):
    """{name: mean over the items} of rows (one dict an item), an unscored item (NaN) left out: what
    metrics.jsonl logs of an evaluation and what the alarm compares."""
    return {k: torch.tensor([r[k] for r in rows]).nanmean().item() for k in rows[0]}


class Alarm:
    """The reward-hacking alarm (the module docstring); state_dict() travels in the checkpoints."""

    def __init__(self, z=2.0):
        self.z, self.base, self.flagged, self.tripped = z, None, [], None  # base: the base model's items
        self.last = self.kept = None  # the previous evaluation's iteration; when tripped, the one to keep

    def halts(self, hack_stop):
        """Whether the run stops here: the alarm has tripped and hack_stop is set."""
        return bool(hack_stop) and self.tripped is not None

    def noise(self, k):
        """The standard error of the base model's mean of watcher k over its scored items."""
        v = torch.tensor([r[k] for r in self.base], dtype=torch.float64)
        v = v[v.isfinite()]
        return (v.std() / len(v) ** 0.5).item() if len(v) > 1 else float('nan')

    def __call__(self, iter_num, items, data=None):
        """({'alarm': the watchers that trip it now, 'watch_flagged': those beyond their noise now}, the
        console line or None). data: the watchers' values on the data ({name: value}), or None. The first
        call of a run that began at iteration 0 keeps the base model's items."""
        if self.base is None:
            self.base, self.last = (items if iter_num == 0 else None), iter_num
            return dict(alarm=[], watch_flagged=[]), None
        return self.look(iter_num, means(items), data)

    def look(self, iter_num, now, data=None):
        """__call__'s answer at an evaluation whose means are now ({name: mean}, as logged): a recorded
        run's evaluations replay through it (bench/alarm.py)."""
        last, self.last = self.last, iter_num
        base, data = means(self.base), data or {}
        away = {}  # how far each watcher went its wrong way since the base model's evaluation
        for k in [k for k in base if k in now and k not in NOT_WATCHED]:
            way = WRONG.get(k, -1)
            if k in data:  # further from the data than the base model was: past it, or away on its own side;
                # a one-sided watcher only on its WRONG side of the data (past it the other way is not its failure)
                wrong_side = not way or (now[k] - data[k]) * way >= 0
                away[k] = abs(now[k] - data[k]) - abs(base[k] - data[k]) if wrong_side else float('-inf')
            else:  # no data: WRONG's way from the base model
                away[k] = (now[k] - base[k]) * way if way else abs(now[k] - base[k])
        flagged = []
        if now['composite'] - base['composite'] > self.z * self.noise('composite'):  # did something pay for it?
            flagged = [k for k in away if away[k] > self.z * self.noise(k)]  # NaN (unscored) compares False
        tripped = [k for k in flagged if k in self.flagged]  # flagged at two evaluations in a row
        self.flagged = flagged
        if not tripped:
            return dict(alarm=[], watch_flagged=flagged), None
        self.tripped = self.tripped or iter_num
        self.kept = last

        def said(k):  # base -> now, what it was judged against, its noise
            ref = (f'data {data[k]:.4f}' if k in data
                   else f'{WAY[WRONG.get(k, -1)]} against the base model, not the data')
            return f'{k} {base[k]:.4f} -> {now[k]:.4f} ({ref}; SE {self.noise(k):.4f})'
        line = (f"alarm: iteration {iter_num}: composite {base['composite']:.4f} -> {now['composite']:.4f} while "
                + ', '.join(said(k) for k in tripped)
                + f" (beyond {self.z:g} SE of the base model's mean, at two evaluations in a row)")
        return dict(alarm=tripped, watch_flagged=flagged), line

    def announce(self, iter_num, line, out_dir, hack_stop):
        """Rank 0: the alarm's line; the checkpoint of the last evaluation before it is pinned, so no
        rotation removes it."""
        kept = checkpoint.pin(out_dir, self.kept, f'the last evaluation before the alarm of {iter_num}')
        print(line + (f'; {kept} is kept' if kept else '') + ('; hack_stop: stopping' if hack_stop else ''))

    def say(self, iter_num, line, now, out_dir, hack_stop, last):
        """Rank 0, after an evaluation: the alarm's line if it tripped (announce), and after the run's
        last evaluation the base model against now (summary)."""
        if line:
            self.announce(iter_num, line, out_dir, hack_stop)
        if iter_num == last and self.base:
            print(self.summary(now))

    def summary(self, now):
        """'eval composite before <the base model's> -> after <now's>': the run's last line."""
        return f"eval composite before {means(self.base)['composite']:.4f} -> after {now['composite']:.4f}"

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
        self.data = None  # the watchers on the data (reference()), once computed

    @classmethod
    def of_config(cls, config, prompts, **kw):
        """train.py's: its settings (config) and this module's: the items' seeds, ODE steps, videos."""
        c = config
        sigmas = sde.sigmas(eval_steps or c['num_steps'], c['shift']).to(c['device'])
        return cls(prompts, eval_samples, sigmas=sigmas, videos=eval_videos, seed=c['seed'], cfg=c['cfg'],
                   fps=c['fps'], batch=c['rollout_batch'], reward_weights=c['reward_weights'],
                   out_dir=c['out_dir'], device=c['device'], **kw)

    def __call__(self, policy, iter_num, save_on_stop):
        """Mean scores of the current policy; save_on_stop: preemption's checkpoint for a stop meanwhile."""
        parallel.reset_peak_memory(self.device)  # the peak train.py logs is the evaluation's
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
        return means(rows)  # NaN: unscored video

    def reference(self, fam):
        """The watchers on the data, {name: mean over the items}, for the alarm: each held-out item's prompt
        rendered clean by a family that can (models/__init__.py OPTIONAL: the toy's render(prompt, i)) and
        scored as the items are; None for a world without data (a real model's). Computed once, whole on
        every rank: it is small where it exists."""
        if self.data is None and hasattr(fam, 'render'):
            prompts = [self.prompts[i % len(self.prompts)] for i in range(len(self.prompts) * self.samples)]
            frames = torch.stack([fam.render(p, i) for i, p in enumerate(prompts)])  # (items, F, 3, H, W)
            sc = watched(frames, prompts, self.fps, self.reward_fn, self.reward_weights, self.manifold_distance,
                         self.visual)
            self.data = means([{k: float(v[j]) for k, v in sc.items()} for j in range(len(prompts))])
        return self.data

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
