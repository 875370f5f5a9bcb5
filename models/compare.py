"""
Models side by side, as sample.py shows them: a contact sheet of their frames, and a table of their
scores with train.py's own held-out evaluations below it and what got better and worse, each watcher
judged by the way the reward-hacking alarm calls wrong (models/evaluate.py WRONG).

    contact_sheet(frames, names, prompts, 'samples/contact_sheet.png')  # frames: (B, F, 3, H, W) a model
    report(table, composite, prompts, samples, 'samples', ckpt)        # prints; writes metrics.json

Tested by: python -m pytest tests/test_sample.py
"""
import json
import os

import torch

from infra import checkpoint as checkpoint_lib
from models.evaluate import WRONG


def contact_sheet(frames, names, prompts, path):
    """Per prompt (its first seed: clip i < len(prompts)) a title line, then a row of frames per model
    (in the order of names) named at the left; 2-pixel gaps; small frames (the toy's 24x24) enlarged
    by an integer factor. frames: one (B, F, 3, H, W) in [0, 1] a model. Written as a png to path."""
    from PIL import Image, ImageDraw  # pillow comes with matplotlib and imageio
    zoom = max(1, 96 // frames[0].shape[-2])
    rows = [f[:len(prompts)].repeat_interleave(zoom, -2).repeat_interleave(zoom, -1) for f in frames]
    B, F, _, H, W = rows[0].shape
    gap, label_w, title_h = 2, 64, 14  # pixels: between frames, the row-name column, the prompt line
    block = title_h + len(rows) * (H + gap)  # one prompt
    sheet = torch.ones(3, B * block, label_w + F * (W + gap))
    for i in range(B):
        for m, clip in enumerate(rows):
            y = i * block + title_h + m * (H + gap)
            for f in range(F):
                x = label_w + f * (W + gap)
                sheet[:, y:y + H, x:x + W] = clip[i, f].cpu()
    img = Image.fromarray((sheet.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy())
    draw = ImageDraw.Draw(img)
    for i, p in enumerate(prompts):
        draw.text((2, i * block + 1), f'{i}: {p}'[:(label_w + F * (W + gap)) // 6], fill=(0, 0, 0))  # ~6 px a character
        for m, name in enumerate(names):
            draw.text((2, i * block + title_h + m * (H + gap) + H // 2 - 5), name, fill=(0, 0, 0))
    img.save(path)


def report(table, composite, prompts, samples, out_dir, ckpt):
    """Print table {model: {metric: mean over the clips}} (its first model the base), write it to
    out_dir/metrics.json; below, train.py's held-out evaluations of checkpoint ckpt's run (its first,
    the base, and the checkpoint's own); then, with an 'aligned' model, what got better and worse and
    the standard error of the composite's paired difference (composite: {model: (B,)} per clip)."""
    keys = list(table['base'])
    line = lambda label, get: print(f'{label:<10}' + ''.join(f'{get(k):>10.4f}' for k in keys))  # noqa: E731
    print(f'metrics, mean over {len(prompts)} prompts x {samples} seeds:\n' + ''.join(f'{k:>10}' for k in [''] + keys))
    for name, row in table.items():
        line(name, row.get)
    with open(os.path.join(out_dir, 'metrics.json'), 'w') as f:
        json.dump(table, f, indent=1)
    log = os.path.join(os.path.dirname(ckpt or '.'), 'metrics.jsonl')
    last = checkpoint_lib.read_loop(ckpt)['iter_num'] if ckpt else None
    evals = [r for r in map(json.loads, open(log).read().splitlines()) if 'eval_composite' in r and r['iter'] <= last] \
        if ckpt and os.path.isfile(log) else []
    if len(evals) > 1:
        print(f"train.py's held-out evaluation ({log}):")
        for r in (evals[0], evals[-1]):
            line(f'iter {r["iter"]}', lambda k: r.get('eval_' + k, float('nan')))
    if 'aligned' not in table:
        return
    # wrong > 0: moved its wrong way (WRONG -1: falling is wrong, a score's default; +1: rising, the
    # manifold distance's; 0: either way, say brightness), < 0 its right way; a two-way one is never better
    d = {k: table['aligned'][k] - table['base'][k] for k in keys}
    wrong = {k: d[k] * WRONG.get(k, -1) if WRONG.get(k, -1) else abs(d[k]) for k in keys}
    on = lambda sign: ', '.join(f'{k} {d[k]:+.4f}' for k in keys if wrong[k] * sign > 0)  # noqa: E731
    # the composite's spread over the clips, paired (same prompt and seed) base vs aligned
    n = len(composite['base'])
    se = (composite['aligned'] - composite['base']).std().item() / n ** 0.5
    print(f'aligned vs base: better on {on(-1) or "nothing"}; worse on {on(+1) or "nothing"}; '
          f"the composite's standard error over these {n} paired clips: {se:.4f}")
