"""
sample.py end to end, from its command line (run in this test process: test_train.run_here), from
a train.py checkpoint of the toy (one iteration with the dance sampler, so dance also runs through
the loop): the mp4 files read back
with the right shape, the labelled contact sheet's layout, the metrics table (the toy's reward,
CLIPScore and PickScore of tiny random CLIP models), train.py's own held-out evaluations below it and
what got better and worse; with a metric's weights missing, the videos and sheet are still written
and the table is skipped naming the download.

    python -m pytest tests/test_sample.py
"""
import json
import math
import os

import imageio.v3 as iio

from test_train import ROOT, SMALL, check_sampler, run_here


def test_sample_writes_videos_and_contact_sheet(tmp_path, monkeypatch):
    ckpt = str(tmp_path / 'ck')
    run_here(monkeypatch, SMALL + [f'--out_dir={ckpt}', '--max_iters=1', '--sampler=dance'])  # dance through the loop too
    check_sampler(ckpt, 'dance', 2)  # the toy's timestep_fraction 0.5 of 4 stochastic steps
    from tiny_clip import make_tiny_clip
    clip_dir, pick_dir = make_tiny_clip(str(tmp_path / 'clip'), 'clip'), make_tiny_clip(str(tmp_path / 'clip'), 'pickscore')
    out = str(tmp_path / 'samples')
    said = run_here(monkeypatch, ['sample.py', f'--checkpoint={ckpt}', f'--out_dir={out}', '--num_steps=4',
                                  '--eval_metrics=clipscore,pickscore', f'--clip_dir={clip_dir}',
                                  f'--pickscore_dir={pick_dir}'])  # the toy's 16 prompts x 2 seeds
    from models import toy
    with open(os.path.join(ROOT, toy.DIR, 'eval_prompts.txt')) as f:
        pairs = sorted(toy.parse(l)[::2] for l in f if l.strip())  # (colour, direction) of each default prompt
    assert pairs == [(c, d) for c in range(4) for d in range(4)]  # every pair once: the first look spans them
    for name in ('base', 'aligned'):
        for i in range(2):
            v = iio.imread(os.path.join(out, f'{name}_{i}.mp4'))  # (F, H, W, 3)
            assert v.shape[0] == toy.FRAMES and v.shape[3] == 3
            assert v.shape[1] >= toy.HEIGHT and v.shape[2] >= toy.WIDTH
    sheet = iio.imread(os.path.join(out, 'contact_sheet.png'))
    zoom = max(1, 96 // toy.HEIGHT)  # small frames are enlarged on the sheet
    label_w, title_h = 64, 14  # sample.py's row-name column and prompt line, in pixels
    assert sheet.shape[0] == 16 * (title_h + 2 * (zoom * toy.HEIGHT + 2))  # a block per prompt, its first seed
    assert sheet.shape[1] == label_w + toy.FRAMES * (zoom * toy.WIDTH + 2)
    assert (sheet[:title_h, :label_w] < 128).any() and (sheet[title_h:, :label_w] < 128).any()  # text drawn
    assert 'contact sheet' in said
    # the metrics table: every metric of the toy's reward plus the visual ones, base and aligned
    with open(os.path.join(out, 'metrics.json')) as f:
        table = json.load(f)
    keys = ('VQ', 'MQ', 'TA', 'composite', 'manifold', 'clipscore', 'pickscore')
    assert list(table) == ['base', 'aligned'] and all(math.isfinite(table[m][k]) for m in table for k in keys)
    assert 'metrics, mean over 16 prompts x 2 seeds' in said and all(k in said for k in keys)
    # below it, train.py's own held-out evaluations (iteration 0 and the checkpoint's), read from its log
    with open(os.path.join(ckpt, 'metrics.jsonl')) as f:
        ev = [json.loads(l) for l in f if 'eval_composite' in l]
    below = said.split("train.py's held-out evaluation")[1]
    for r in (ev[0], ev[-1]):
        assert f'iter {r["iter"]} ' in below and f'{r["eval_composite"]:.4f}' in below
    # and what got better and worse, as metrics.json says (manifold distance: lower is better)
    better = said.split('aligned vs base: better on ')[1].split('; worse on')[0]
    for k in ('composite', 'manifold'):
        d = table['aligned'][k] - table['base'][k]
        assert (f'{k} {d:+.4f}' in better) == (d * (-1 if k == 'manifold' else 1) > 0), (k, d, better)
    assert 'standard error over these 32 paired clips' in said
    # missing weights: the videos and the sheet are written, the table is skipped naming the download
    said = run_here(monkeypatch, ['sample.py', '--checkpoint=', f'--out_dir={tmp_path / "s2"}', '--num_prompts=1',
                                  '--num_steps=2', '--eval_metrics=pickscore', '--pickscore_dir=/nonexistent/pick'])
    assert 'no metrics table' in said and 'hf download yuvalkirstain/PickScore_v1 --local-dir /nonexistent/pick' in said


def test_better_and_worse_judge_each_watcher_by_its_wrong_way(tmp_path, monkeypatch):
    # the alarm's declaration (models/evaluate.py WRONG): brightness and saturation go wrong moving either
    # way, dark and flicker rising, edges and entropy falling, every score falling. Frame statistics planted
    # here: aligned vs base, saturation +0.08 (wrong: it moved), edges up and dark down (their right ways),
    # entropy down and flicker up (their wrong ways), brightness unchanged (neither)
    import torch
    from models import evaluate
    ckpt = str(tmp_path / 'ck')
    run_here(monkeypatch, SMALL + [f'--out_dir={ckpt}', '--max_iters=1'])
    planted = [dict(brightness=0.5, saturation=0.30, dark=0.20, edges=0.10, entropy=3.0, flicker=0.01),  # base
               dict(brightness=0.5, saturation=0.38, dark=0.10, edges=0.20, entropy=2.5, flicker=0.02)]  # aligned
    monkeypatch.setattr(evaluate, 'frame_stats', lambda frames: {k: torch.full((len(frames),), v)
                                                                 for k, v in planted.pop(0).items()})
    out = str(tmp_path / 'samples')
    said = run_here(monkeypatch, ['sample.py', f'--checkpoint={ckpt}', f'--out_dir={out}', '--num_prompts=2',
                                  '--samples=1', '--num_steps=2'])
    assert planted == []  # base, then aligned
    summary = said.split('aligned vs base: better on ')[1]
    names = lambda s: set() if s == 'nothing' else {item.split(' ')[0] for item in s.split(', ')}
    better, worse = names(summary.split('; worse on ')[0]), names(summary.split('; worse on ')[1].split('; ')[0])
    assert {'edges', 'dark'} <= better and {'saturation', 'entropy', 'flicker'} <= worse
    assert 'brightness' not in better | worse
    # the rest (the toy's scores, the composite, the manifold distance) by hand from the table: a score
    # rising is better, the manifold distance falling
    with open(os.path.join(out, 'metrics.json')) as f:
        table = json.load(f)
    for k in ('VQ', 'MQ', 'TA', 'composite', 'manifold'):
        d = (table['aligned'][k] - table['base'][k]) * (-1 if k == 'manifold' else 1)
        assert (k in better, k in worse) == (d > 0, d < 0), (k, d, better, worse)


def test_the_composite_is_the_runs_own(tmp_path, monkeypatch):
    # a Setting A run (weights 1, 1, 1): sample.py's composite of both models is VQ + MQ + TA, the weights the
    # checkpoint was trained with, not train.py's default Setting B (0.5 VQ + 0.5 MQ + TA)
    ckpt = str(tmp_path / 'ck')
    run_here(monkeypatch, SMALL + [f'--out_dir={ckpt}', '--max_iters=1', '--reward_weights=(1.0, 1.0, 1.0)'])
    out = str(tmp_path / 'samples')
    run_here(monkeypatch, ['sample.py', f'--checkpoint={ckpt}', f'--out_dir={out}', '--num_prompts=2', '--samples=1',
                           '--num_steps=2'])
    with open(os.path.join(out, 'metrics.json')) as f:
        table = json.load(f)
    for m in ('base', 'aligned'):
        r = table[m]
        assert math.isclose(r['composite'], r['VQ'] + r['MQ'] + r['TA'], rel_tol=1e-5), r
        assert not math.isclose(r['composite'], 0.5 * r['VQ'] + 0.5 * r['MQ'] + r['TA'], rel_tol=1e-3), r
