"""
Token-level credit (credit.py): what the extra reward backward costs, and what the credit maps look like.

    python -m bench.credit        # ~2 min on one busy CPU core: results/credit_cost.md, results/credit_maps.png

1. cost: the reward alone (no grad, as train.py's credit='none') vs credit.score_and_grad (forward with
   grad + one backward to the pixels, credit='tvrl'), wall time (median of `repeats`) and the memory
   the backward needs: bytes of the tensors autograd saves for it (unique storages, counted with
   saved_tensors_hooks) plus the pixel gradient itself. Toy reward on one rank's 64 clips; the tiny
   VideoAlign (random weights, hidden 64) at the test size and at the real rollout geometry (81 frames
   of 352x624 at 24 fps: 6 sampled frames, the real token count, tiny weights). The real 2B model's
   numbers need a GPU run: its saved activations grow with width and depth (1536 x 28 layers vs 64 x 2).
2. picture: for four toy prompts, ODE samples of the base model and their credit maps ('window'),
   a latent token's weight drawn over the 4x4 pixels it decodes to.
What it does not measure: the real 2B reward model's cost (it needs a GPU).
"""
import json
import os
import statistics
import sys
import time

import torch

from extras import credit
import reward
from models import toy
from models.videoalign import load_videoalign
from infra.configurator import configure

out = 'results'  # output folder
repeats = 3      # timing repeats (the median is reported)
config = configure(globals(), sys.argv[1:] if __name__ == '__main__' else [])
torch.set_num_threads(1)


def saved_bytes(fn):
    """fn() run with grad; bytes of the distinct storages autograd saved for the backward."""
    seen = {}

    def pack(t):
        try:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        except (RuntimeError, NotImplementedError):
            pass
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def timed(fn):
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def cost_row(name, reward_fn, frames, prompts, fps):
    plain = lambda: reward_fn(frames, prompts, fps)
    both = lambda: credit.score_and_grad(reward_fn, frames, prompts, fps, reward.SETTING_B)
    t0, t1 = timed(plain), timed(both)

    def forward_with_grad():
        x = frames.detach().float().requires_grad_(True)
        reward.combine(getattr(reward_fn, 'score', reward_fn)(x, prompts, fps), reward.SETTING_B)
    mem = saved_bytes(forward_with_grad) + frames.numel() * 4  # + the float32 pixel gradient
    return dict(name=name, clips=len(frames), video=list(frames.shape[1:]), reward_s=t0, with_grad_s=t1,
                ratio=t1 / t0, backward_mib=mem / 2**20, frames_mib=frames.numel() * 4 / 2**20)


def cost():
    rows = []
    prompts = toy.all_prompts()[:64]
    g = torch.Generator().manual_seed(0)
    clips = torch.stack([toy.render(p, i) for i, p in enumerate(prompts)])
    clips = (clips + 0.04 * torch.randn(clips.shape, generator=g)).clamp(0, 1)
    rows.append(cost_row('toy reward', toy.reward, clips, prompts, toy.FPS))
    import tempfile
    sys.path.insert(0, 'tests')
    from tiny_videoalign import make_tiny_videoalign
    with tempfile.TemporaryDirectory() as d:
        va = load_videoalign(*make_tiny_videoalign(d), dtype=torch.float32)
        for F_, H, W, fps in ((9, 32, 32, 8), (81, 352, 624, 24)):
            frames = torch.rand(2, F_, 3, H, W, generator=g)
            rows.append(cost_row(f'tiny VideoAlign {F_}x{H}x{W} @{fps}fps', va, frames, ['a cat walks'] * 2, fps))
    md = ['| reward | clips | video (F, 3, H, W) | reward only (s) | scores + pixel gradient (s) | ratio | '
          'backward memory (MiB) | of which the video itself (MiB) |', '|' + '---|' * 8]
    md += [f"| {r['name']} | {r['clips']} | {tuple(r['video'])} | {r['reward_s']:.3f} | {r['with_grad_s']:.3f} | "
           f"{r['ratio']:.1f}x | {r['backward_mib']:.0f} | {r['frames_mib']:.0f} |" for r in rows]
    return rows, md


def picture():
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    prompts = ['a red circle moving left', 'a blue square moving up', 'a green cross moving right',
               'a yellow triangle moving down']
    frames = toy.sample(toy.load_model(), prompts, range(len(prompts)))  # (4, F, 3, H, W) base model, ODE
    scores, g = credit.score_and_grad(toy.reward, frames, prompts, toy.FPS, reward.SETTING_B)
    c = credit.credit_map(g, toy.LATENT_SHAPE)[:, 0]  # (4, F, 6, 6)
    up = c.repeat_interleave(toy.PATCH, 2).repeat_interleave(toy.PATCH, 3)  # (4, F, 24, 24)
    Fr = frames.shape[1]
    fig, axes = plt.subplots(2 * len(prompts), Fr, figsize=(Fr * 0.95, 2 * len(prompts) * 1.25))
    for i, p in enumerate(prompts):
        for f in range(Fr):
            a, b = axes[2 * i, f], axes[2 * i + 1, f]
            a.imshow(frames[i, f].permute(1, 2, 0).numpy())
            b.imshow(frames[i, f].mean(0).numpy(), cmap='gray', vmin=0, vmax=1)
            b.imshow(up[i, f].numpy(), cmap='magma', alpha=0.7, vmin=0, vmax=up[i].max().item())
            for ax in (a, b):
                ax.set_xticks([])
                ax.set_yticks([])
            if f == 0:
                a.set_ylabel('clip', fontsize=6)
                b.set_ylabel('credit', fontsize=6)
            b.set_xlabel(f'frame {f}: {c[i, f].mean():.2f}', fontsize=5, labelpad=1)
        axes[2 * i, 0].set_title(f'"{p}"  VQ {scores["VQ"][i]:.2f} MQ {scores["MQ"][i]:.2f} '
                                 f'TA {scores["TA"][i]:.2f}  (base model, ODE)', fontsize=7, loc='left')
    fig.suptitle('credit maps (credit.py, window (1, 3, 3), mean 1 per clip; under each frame: its mean)',
                 fontsize=8)
    fig.subplots_adjust(left=0.04, right=0.99, bottom=0.03, top=0.93, hspace=0.55, wspace=0.08)
    fig.savefig(os.path.join(out, 'credit_maps.png'), dpi=120)
    plt.close(fig)


if __name__ == '__main__':
    os.makedirs(out, exist_ok=True)
    picture()
    rows, md = cost()
    head = ['## Token-level credit: cost of the pixel gradient', '',
            f'Written by `python -m bench.credit` ({time.strftime("%Y-%m-%d %H:%M")}, torch {torch.__version__}, '
            '1 CPU thread on a shared 2-core machine; median of 3). Backward memory = tensors autograd saves '
            'for the backward + the float32 pixel gradient.', '']
    with open(os.path.join(out, 'credit_cost.md'), 'w') as f:
        f.write('\n'.join(head + md) + '\n')
    with open(os.path.join(out, 'credit_cost.json'), 'w') as f:
        json.dump(rows, f, indent=1)
    print('\n'.join(md))
