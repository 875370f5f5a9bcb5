"""
The reward-hacking alarm (models/evaluate.py: Alarm, frame_stats; docs/method.md section 9) on made-up
held-out items whose answer is known, the frame statistics against counts by hand, and the pinned
checkpoint that no rotation removes. What a failure would show: an alarm that fires on one evaluation, on
a falling composite, on a watcher moving its harmless way or on NaN; a statistic off its definition; the
checkpoint before an alarm rotated away. The alarm on the toy's headline run: tests/test_headline.py.
"""
import os
import random

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
