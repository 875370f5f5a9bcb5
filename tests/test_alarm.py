"""
The reward-hacking alarm (models/evaluate.py: Alarm, frame_stats; docs/method.md section 9) on made-up
held-out items whose answer is known, the frame statistics against counts by hand, and the pinned
checkpoint that no rotation removes. What a failure would show: an alarm that fires on one evaluation, on
a falling composite, on a watcher moving its harmless way or on NaN; a statistic off its definition; the
checkpoint before an alarm rotated away. Slips each test below fails on: a standard error over n (or the
population std, or unpaired), a score with no declared wrong way flagged rising, an item unscored now
that makes the watcher NaN, a held-out composite at Setting B in a Setting A run, luma weights swapped or
grey in place of luma, the previous evaluation lost at a resume, the oldest or an earlier checkpoint
pinned. The alarm on the toy's headline run: tests/test_headline.py; its state across train.py's resume:
tests/test_train_settings.py.
"""
import os
import random

import pytest
import torch

from models.evaluate import Alarm, frame_stats
from test_train import SMALL, run_here


def items(n, composite, vq, brightness=0.5, seed=0):
    rnd = random.Random(seed)
    return [dict(composite=composite + rnd.gauss(0, 0.01), VQ=vq + rnd.gauss(0, 0.01),
                 manifold=0.1 + rnd.gauss(0, 0.001), brightness=brightness + rnd.gauss(0, 0.001)) for _ in range(n)]


def test_alarm_needs_a_rising_composite_and_two_evaluations_in_a_row():
    base = items(32, 0.5, 0.3)
    a = Alarm(z=2.0)
    assert a(0, base) == (dict(alarm=[], watch_flagged=[]), None)
    # the paired noise: the same items shifted, so the SE is that of the per-item differences
    shift = lambda its, dc, dv: [dict(r, composite=r['composite'] + dc, VQ=r['VQ'] + dv) for r in its]  # noqa: E731
    fields, line = a(20, shift(base, 0.1, -0.05))  # the first time beyond its noise: flagged, not yet an alarm
    assert fields == dict(alarm=[], watch_flagged=['VQ']) and line is None
    fields, line = a(40, shift(base, 0.2, -0.06))
    assert fields['alarm'] == ['VQ'] and line.startswith('alarm: iteration 40: composite ')
    assert 'VQ 0.' in line and '(SE ' in line and a.tripped == 40 and a.kept == 20
    # a falling composite flags nothing, nor does a watcher moving its harmless way (manifold down)
    b = Alarm()
    b(0, base)
    assert b(10, shift(base, -0.1, -0.05))[0]['watch_flagged'] == []
    lower = [dict(r, composite=r['composite'] + 0.1, manifold=r['manifold'] - 0.01) for r in base]
    assert b(20, lower)[0]['watch_flagged'] == [] and b(30, lower)[0]['alarm'] == []
    # brightness goes wrong either way; a broken evaluation (NaN) is no evidence
    brighter = [dict(r, composite=r['composite'] + 0.1, brightness=r['brightness'] - 0.05) for r in base]
    c = Alarm()
    c(0, base)
    c(10, brighter)
    assert c(20, brighter)[0]['alarm'] == ['brightness']
    nan = [dict(r, VQ=float('nan'), composite=r['composite'] + 0.1) for r in base]
    d = Alarm()
    d(0, base)
    assert d(10, nan)[0]['watch_flagged'] == [] and d(20, nan)[0]['alarm'] == []
    # a run that did not start at iteration 0 has no base: the alarm stays silent
    e = Alarm()
    assert e(20, base) == (dict(alarm=[], watch_flagged=[]), None) and e.base is None
    # its state goes through a checkpoint (JSON) and comes back the same
    f = Alarm()
    f.load_state_dict(__import__('json').loads(__import__('json').dumps(a.state_dict())))
    assert f.state_dict() == a.state_dict()


def test_frame_stats_against_hand_counts():
    frames = torch.zeros(2, 3, 3, 4, 4)  # (B, F, 3, H, W)
    frames[0] = 0.5  # clip 0: flat grey
    frames[1, :, :, :, 2:] = 1.0  # clip 1: black left half, white right half: one vertical edge per row
    frames[1, 1] *= 0.5  # ... its middle frame half as bright: flicker
    s = frame_stats(frames)
    assert torch.allclose(s['brightness'], torch.tensor([0.5, (0.5 + 0.25 + 0.5) / 3]))
    assert torch.allclose(s['saturation'], torch.zeros(2))  # grey: no chroma
    assert torch.allclose(s['dark'], torch.tensor([0.0, 0.5]))
    assert s['edges'][0] == 0 and torch.isclose(s['edges'][1], torch.tensor(1 / 3))  # 3 of the 3x3 differences
    p = torch.tensor([1 / 2, 1 / 3, 1 / 6])  # black, white, grey: the colours of clip 1's pixels
    assert s['entropy'][0] == 0 and torch.isclose(s['entropy'][1], -(p * p.log2()).sum())
    assert s['flicker'][0] == 0 and torch.isclose(s['flicker'][1], torch.tensor(0.25))


def test_a_pinned_checkpoint_outlives_rotation(tmp_path, monkeypatch):
    from infra import checkpoint
    out = str(tmp_path / 'run')
    args = SMALL + [f'--out_dir={out}', '--save_every=1', '--keep_checkpoints=1', '--diag_every=0', '--export_dtype=']
    run_here(monkeypatch, args + ['--max_iters=1'])
    assert checkpoint.pin(out, 1, 'kept by the test') == 'ckpt_000001'
    assert checkpoint.pin(out, 0, 'none so early') is None
    run_here(monkeypatch, args + ['--max_iters=3'])  # saves 2 and 3; keep 1 rotates 2 away, not the pinned 1
    assert checkpoint.found(out) == ['ckpt_000001', 'ckpt_000003']
    assert open(os.path.join(out, 'ckpt_000001', checkpoint.PINNED)).read() == 'kept by the test\n'
    assert checkpoint.damage(os.path.join(out, 'ckpt_000001'), collective=False) is None  # still intact


def test_hack_stop_checkpoints_and_stops_at_the_alarm(tmp_path, monkeypatch):
    """hack_stop=True: the run stops at the evaluation whose alarm trips, with a checkpoint of that
    iteration and no export (an evaluation every iteration; alarm_z tiny, so any move counts)."""
    from test_train import metrics
    out = str(tmp_path / 'hack')
    said = run_here(monkeypatch, SMALL + [f'--out_dir={out}', '--max_iters=8', '--eval_every=1', '--save_every=0',
                                          '--diag_every=0', '--alarm_z=1e-9', '--hack_stop=True'])
    rows = metrics(out)
    tripped = [r['iter'] for r in rows if r.get('alarm')]
    assert tripped and tripped[0] < 8, [(r['iter'], r.get('watch_flagged')) for r in rows if 'eval_composite' in r]
    assert max(r['iter'] for r in rows) == tripped[0]  # nothing after the alarm's iteration
    assert open(os.path.join(out, 'latest')).read().strip() == f'ckpt_{tripped[0]:06d}'
    assert not os.path.exists(os.path.join(out, 'export')) and 'hack_stop: stopping' in said


# ----------------------------------------------------------------------------- slips, each against a hand count

def paired_items(base_vq, now_vq, d_composite=0.5):
    """Items of a base and a later evaluation: composite up by d_composite (with a little spread), VQ as given."""
    base = [dict(composite=0.5, VQ=v) for v in base_vq]
    now = [dict(composite=0.5 + d_composite + 0.01 * i, VQ=v) for i, v in enumerate(now_vq)]
    return base, now


def test_alarm_noise_is_the_standard_error_of_the_paired_differences():
    # 4 items whose VQ falls by 0.1, 0.3, 0.2, 0.6 (their base values far apart): mean -0.3, sample std
    # sqrt(0.14 / 3), standard error sqrt(0.14 / 3) / sqrt(4) = 0.10801. VQ moved 2.78 SE: flagged at z 2.5,
    # not at z 3 (SE over n, or the population std, or the unpaired spread would flag it at 3 or miss it at 2.5)
    base_vq = [0.2, 0.9, 0.5, 0.4]
    base, now = paired_items(base_vq, [b - d for b, d in zip(base_vq, (0.1, 0.3, 0.2, 0.6))])
    se = (0.14 / 3) ** 0.5 / 2
    a = Alarm()
    a(0, base)
    b, n, e = a.paired(now, 'VQ')
    assert (b, n) == pytest.approx((0.5, 0.2)) and e == pytest.approx(se, rel=1e-12)
    for z, flagged in ((2.5, ['VQ']), (3.0, [])):
        a = Alarm(z)
        a(0, base)
        assert a(10, now)[0]['watch_flagged'] == flagged, z
        fields, line = a(20, now)
        assert fields['alarm'] == flagged and (line is None) == (not flagged)
        assert not flagged or f'VQ 0.5000 -> 0.2000 (SE {se:.4f})' in line


WATCHED = ['VQ', 'MQ', 'TA', 'clipscore', 'pickscore']  # no entry in evaluate.WRONG: they go wrong falling


def test_a_score_with_no_wrong_direction_rising_with_the_composite_is_never_flagged():
    # VQ, MQ, TA, CLIPScore, PickScore go wrong falling: rising far beyond their noise with the composite,
    # at every evaluation, is what training is for; falling, the same distance, trips the alarm
    rnd = random.Random(1)
    base = [dict(composite=0.5 + rnd.gauss(0, 0.01), **{k: 0.3 + rnd.gauss(0, 0.01) for k in WATCHED}) for _ in range(16)]
    for way, tripped in ((+1, []), (-1, WATCHED)):
        a = Alarm()
        a(0, base)
        for it in (10, 20, 30):
            moved = [dict(r, composite=r['composite'] + 0.2, **{k: r[k] + way * 0.2 for k in WATCHED}) for r in base]
            fields, line = a(it, moved)
        assert fields['alarm'] == tripped and fields['watch_flagged'] == tripped, (way, fields)



def test_an_item_unscored_now_leaves_the_pairs():
    # item 2's VQ is NaN at this evaluation (the reward failed on it): the other 3 pairs decide, by hand
    # differences -0.1, -0.3, -0.6: mean -1/3, squares about it summing to 0.38 / 3, so SE sqrt(0.38 / 3 / 2 / 3)
    # (not a NaN that silences VQ)
    base_vq = [0.2, 0.9, 0.5, 0.4]
    base, now = paired_items(base_vq, [0.1, 0.6, float('nan'), -0.2])
    a = Alarm(z=2.0)
    a(0, base)
    b, n, e = a.paired(now, 'VQ')
    assert (b, n, e) == pytest.approx(((0.2 + 0.9 + 0.4) / 3, (0.1 + 0.6 - 0.2) / 3, (0.38 / 18) ** 0.5), rel=1e-12)
    assert a(10, now)[0]['watch_flagged'] == ['VQ'] and a(20, now)[0]['alarm'] == ['VQ']
    # unscored in the base evaluation, the same
    c = Alarm(z=2.0)
    c(0, now)
    assert c.paired(base, 'VQ')[2] == pytest.approx(e, rel=1e-12)


def test_held_out_composite_uses_the_runs_weights():
    # Setting A (1, 1, 1): an item's composite is VQ + MQ + TA, which the alarm then compares (Setting B's
    # 0.5 VQ + 0.5 MQ + TA would be another number)
    from models.evaluate import HeldOut
    from reward import SETTING_A
    scores = dict(VQ=torch.tensor([0.2, -0.4]), MQ=torch.tensor([0.6, 0.1]), TA=torch.tensor([0.3, 0.9]))
    held_out = HeldOut(['a', 'b'], 1, seed=0, sigmas=None, cfg=1.0, shape=None, text_for=None, batch=2,
                       decode=lambda x: x, reward_fn=lambda frames, prompts, fps: dict(scores),
                       reward_weights=SETTING_A, manifold_distance=None, visual={}, move_visual=None, fps=8,
                       out_dir=None, videos=0, dp_rank=0, dp_world=1, leads=True, passes=None, preemption=None,
                       device='cpu')
    rows = held_out.score(torch.full((2, 2, 3, 4, 4), 0.5), ['a', 'b'])
    assert [r['composite'] for r in rows] == pytest.approx([1.1, 0.6])


def test_frame_stats_of_coloured_clips():
    # pure red and pure blue at 0.8 on a black left half: luma 0.299 * 0.8 = 0.2392 and 0.114 * 0.8 =
    # 0.0912. Brightness: half of each. Dark (luma < 0.1): the black half, and blue's half too. Edges
    # (a luma step > 0.1): red's black-to-colour column (1 of 3 differences per row), none for blue
    frames = torch.zeros(2, 2, 3, 4, 4)  # (B, F, 3, H, W)
    frames[0, :, 0, :, 2:] = 0.8  # red
    frames[1, :, 2, :, 2:] = 0.8  # blue
    s = frame_stats(frames)
    assert torch.allclose(s['brightness'], torch.tensor([0.299 * 0.8 / 2, 0.114 * 0.8 / 2]))
    assert torch.allclose(s['saturation'], torch.tensor([0.4, 0.4]))  # chroma max - min: 0.8 on half
    assert s['dark'].tolist() == [0.5, 1.0]
    assert torch.allclose(s['edges'], torch.tensor([1 / 3, 0.0]))


def test_after_a_resume_the_alarm_pins_the_evaluation_before_it():
    # evaluations at 0, 10 (VQ flagged), a checkpoint, a resume, then 20 (VQ flagged again): the alarm
    # trips at 20 and keeps 10, the evaluation before it, which only the checkpoint can have told it
    import json
    base = items(32, 0.5, 0.3)
    worse = [dict(r, composite=r['composite'] + 0.1, VQ=r['VQ'] - 0.05) for r in base]
    a = Alarm()
    a(0, base)
    assert a(10, worse)[0]['watch_flagged'] == ['VQ']
    b = Alarm()
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    fields, line = b(20, worse)
    assert fields['alarm'] == ['VQ'] and b.tripped == 20 and b.kept == 10, (fields, b.kept)


def test_pin_keeps_the_newest_checkpoint_at_or_before_the_evaluation(tmp_path):
    from infra import checkpoint
    for it in (2, 4, 6, 8, 10, 999999, 1000000):
        os.makedirs(tmp_path / f'ckpt_{it:06d}')
    os.makedirs(tmp_path / 'ckpt_000005.tmp')  # a save in progress is no checkpoint
    for at, kept in ((6, 'ckpt_000006'), (7, 'ckpt_000006'), (5, 'ckpt_000004'), (2, 'ckpt_000002'), (1, None),
                     (999999, 'ckpt_999999'), (1000001, 'ckpt_1000000')):
        assert checkpoint.pin(str(tmp_path), at, f'at {at}') == kept, at
        if kept:
            assert (tmp_path / kept / checkpoint.PINNED).read_text() == f'at {at}\n'
