"""
The reward-hacking alarm (models/evaluate.py: Alarm, frame_stats, HeldOut.reference; docs/method.md section 9)
on made-up held-out items whose answer is known, replayed on recorded toy runs (tests/data/alarm_replay.json,
bench/alarm.py), the frame statistics against counts by hand, and the pinned checkpoint that no rotation
removes. What a failure would show: an alarm that fires on one evaluation, on a falling composite, on a
watcher moving its harmless way, toward the data, or on NaN; one silent in the toy's 'none' runs (VQ below
the base model, saturation 60% past the data) or tripping in runs whose VQ and manifold distance improve; a
statistic off its definition; the checkpoint before an alarm rotated away. Slips each test below fails on: a
standard error over n (or the population std, or paired, or with the now-items' spread), a score with no
declared wrong way flagged rising, an item unscored now that makes the watcher NaN, a watcher judged against
the base model where there is data (or the line not saying which), an even number of entropy bins, a
held-out composite at Setting B in a Setting A run, luma weights swapped or grey in place of luma, the
previous evaluation lost at a resume, the oldest or an earlier checkpoint pinned. The alarm on the toy's
headline run: tests/test_headline.py; its state across train.py's resume: tests/test_train_settings.py.
"""
import inspect
import os
import random

import pytest
import torch

from models.evaluate import Alarm, frame_stats, means
from test_train import SMALL, run_here


def items(n, composite, vq, brightness=0.5, seed=0):
    rnd = random.Random(seed)
    return [dict(composite=composite + rnd.gauss(0, 0.01), VQ=vq + rnd.gauss(0, 0.01),
                 manifold=0.1 + rnd.gauss(0, 0.001), brightness=brightness + rnd.gauss(0, 0.001)) for _ in range(n)]


def test_alarm_needs_a_rising_composite_and_two_evaluations_in_a_row():
    base = items(32, 0.5, 0.3)
    a = Alarm(z=2.0)
    assert a(0, base) == (dict(alarm=[], watch_flagged=[]), None)
    # the items shifted: the composite up 0.1, VQ down 0.05, each beyond 2 SE of the base model's mean (0.0018)
    shift = lambda its, dc, dv: [dict(r, composite=r['composite'] + dc, VQ=r['VQ'] + dv) for r in its]  # noqa: E731
    fields, line = a(20, shift(base, 0.1, -0.05))  # the first time beyond its noise: flagged, not yet an alarm
    assert fields == dict(alarm=[], watch_flagged=['VQ']) and line is None
    fields, line = a(40, shift(base, 0.2, -0.06))
    assert fields['alarm'] == ['VQ'] and line.startswith('alarm: iteration 40: composite ')
    assert 'VQ 0.' in line and '; SE ' in line and a.tripped == 40 and a.kept == 20
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


def test_alarm_noise_is_the_standard_error_of_the_base_models_mean():
    # 4 items whose base VQ is 0.2, 0.9, 0.5, 0.4: mean 0.5, sample std sqrt(0.26 / 3), standard error
    # sqrt(0.26 / 3) / sqrt(4) = 0.14720. Every item falls by 0.33: 2.24 SE, flagged at z 2, not at z 2.5 (SE
    # over n, the population std or the paired spread (0) would flag it at 2.5; the now-items' spread added
    # would miss it at 2)
    base_vq = [0.2, 0.9, 0.5, 0.4]
    base, now = paired_items(base_vq, [b - 0.33 for b in base_vq])
    se = (0.26 / 3) ** 0.5 / 2
    a = Alarm()
    a(0, base)
    assert a.noise('VQ') == pytest.approx(se, rel=1e-12)
    for z, flagged in ((2.0, ['VQ']), (2.5, [])):
        a = Alarm(z)
        a(0, base)
        assert a(10, now)[0]['watch_flagged'] == flagged, z
        fields, line = a(20, now)
        assert fields['alarm'] == flagged and (line is None) == (not flagged)
        assert not flagged or f'VQ 0.5000 -> 0.1700 (falling against the base model, not the data; SE {se:.4f})' in line


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



def test_an_item_unscored_now_is_left_out_of_its_mean():
    # item 2's VQ is NaN at this evaluation (the reward failed on it): the mean of the other 3, (0.1 + 0.6 -
    # 0.2) / 3, against the base model's 0.5 (all 4), as metrics.jsonl logs them: 0.333 lower, 2.26 SE (not a
    # NaN that silences VQ)
    base_vq = [0.2, 0.9, 0.5, 0.4]
    base, now = paired_items(base_vq, [0.1, 0.6, float('nan'), -0.2])
    a = Alarm(z=2.0)
    a(0, base)
    assert means(now)['VQ'] == pytest.approx(0.5 / 3)
    assert a(10, now)[0]['watch_flagged'] == ['VQ'] and a(20, now)[0]['alarm'] == ['VQ']
    # unscored in the base evaluation: the noise of the 3 scored items
    c = Alarm(z=2.0)
    c(0, now)
    assert c.noise('VQ') == pytest.approx(torch.tensor([0.1, 0.6, -0.2], dtype=torch.float64).std().item() / 3 ** 0.5)


def watcher_items(n, k, value, spread):
    """n items: composite about 0.5, watcher k about value, each +- 0.01 and +- spread in turn (mean exact)."""
    return [{'composite': 0.5 + 0.01 * (-1) ** i, k: value + spread * (-1) ** i} for i in range(n)]


def moved(items, k, to):
    """The items with the composite up 0.1 and watcher k shifted so its mean is `to`."""
    shift = to - means(items)[k]
    return [dict(r, composite=r['composite'] + 0.1, **{k: r[k] + shift}) for r in items]


def test_a_watcher_with_data_goes_wrong_moving_away_from_it():
    # the toy's case: saturation 0.06 in the base model, 0.084 in the data (SE 0.01 / sqrt(31) = 0.0018).
    # Toward the data and a little past it, 0.10 (0.016 from it, the base was 0.024): never flagged, though
    # 0.04 from the base; 0.12 and 0.13 (0.036 and 0.046 from it): flagged, so tripped at the second
    base = watcher_items(32, 'saturation', 0.06, 0.01)
    data = dict(saturation=0.084)
    a = Alarm()
    a(0, base, data)
    for it, to, flagged in ((10, 0.085, []), (20, 0.10, []), (30, 0.10, []), (40, 0.12, ['saturation'])):
        assert a(it, moved(base, 'saturation', to), data) == (dict(alarm=[], watch_flagged=flagged), None), it
    fields, line = a(50, moved(base, 'saturation', 0.13), data)
    assert fields['alarm'] == ['saturation'] and 'saturation 0.0600 -> 0.1300 (data 0.0840; SE 0.00' in line
    # away from the data on its own side (0.03: 0.054 from it) is as wrong as past it
    b = Alarm()
    b(0, base, data)
    b(10, moved(base, 'saturation', 0.03), data)
    assert b(20, moved(base, 'saturation', 0.03), data)[0]['alarm'] == ['saturation']
    # without data the same 0.10 trips (either way from the base model), and the line says what it compared with
    c = Alarm()
    c(0, base)
    c(10, moved(base, 'saturation', 0.10))
    fields, line = c(20, moved(base, 'saturation', 0.10))
    assert fields['alarm'] == ['saturation'] and '(either way against the base model, not the data; SE ' in line


def test_a_one_sided_watcher_falling_toward_the_data_is_not_flagged():
    # colour entropy goes wrong falling (detail lost), but where the data sits far below (the toy's clean
    # renders, 0.5 bits, against a model at 3.1) falling is toward it; a score with data 1 (VQ) still goes
    # wrong falling: away from the data is the same way
    base = watcher_items(32, 'entropy', 3.1, 0.05)
    lower = moved(base, 'entropy', 2.9)
    a, b = Alarm(), Alarm()
    a(0, base, dict(entropy=0.5))
    b(0, base)
    assert a(10, lower, dict(entropy=0.5))[0]['watch_flagged'] == [] and a(20, lower, dict(entropy=0.5))[1] is None
    b(10, lower)
    line = b(20, lower)[1]
    assert 'entropy 3.1000 -> 2.9000 (falling against the base model, not the data; SE ' in line
    vq = watcher_items(32, 'VQ', 0.3, 0.05)
    c = Alarm()
    c(0, vq, dict(VQ=1.0))
    c(10, moved(vq, 'VQ', 0.25), dict(VQ=1.0))
    assert c(20, moved(vq, 'VQ', 0.25), dict(VQ=1.0))[0]['alarm'] == ['VQ']


def test_a_one_sided_watcher_is_judged_on_its_wrong_side_of_the_data_only():
    # the toy at 5 levels: entropy 0.489 in the base model, 0.533 in the data; a run that brings the shapes to
    # the data's saturation ends at ~0.65, past the data on its rising side: more colours than the renders, not
    # the loss of detail (falling) the watcher is for, so never flagged however far; falling further below the
    # data than the base model stood (0.42: 0.113 from it, the base 0.044) is, and trips at the second
    base = watcher_items(32, 'entropy', 0.489, 0.03)
    data = dict(entropy=0.533)
    a = Alarm()
    a(0, base, data)
    for it, to in ((10, 0.65), (20, 0.70), (30, 0.95)):
        assert a(it, moved(base, 'entropy', to), data) == (dict(alarm=[], watch_flagged=[]), None), it
    b = Alarm()
    b(0, base, data)
    assert b(10, moved(base, 'entropy', 0.42), data)[0]['watch_flagged'] == ['entropy']
    fields, line = b(20, moved(base, 'entropy', 0.42), data)
    assert fields['alarm'] == ['entropy'] and 'entropy 0.4890 -> 0.4200 (data 0.5330; SE ' in line
    # a two-sided watcher (saturation: WRONG 0) past the data is judged by its distance either side, as before
    sat = watcher_items(32, 'saturation', 0.06, 0.01)
    c = Alarm()
    c(0, sat, dict(saturation=0.084))
    c(10, moved(sat, 'saturation', 0.13), dict(saturation=0.084))
    assert c(20, moved(sat, 'saturation', 0.13), dict(saturation=0.084))[0]['alarm'] == ['saturation']


def test_held_out_reference_is_the_clean_renders_scored():
    # the toy's data: its clean renders score 1 on every reward term and sit on the manifold; a family
    # without render() (a real model) has no data
    from bench.alarm import data_watchers
    from models.evaluate import HeldOut
    data = data_watchers()
    assert all(data[k] == 1.0 for k in ('VQ', 'MQ', 'TA')) and data['manifold'] < 1e-3
    assert data['saturation'] == pytest.approx(0.0835, abs=1e-3) and data['dark'] == 0
    settings = [k for k, p in inspect.signature(HeldOut).parameters.items() if p.kind == p.KEYWORD_ONLY]
    assert HeldOut([], 1, **dict.fromkeys(settings)).reference(object()) is None


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


def test_mid_grey_with_a_little_noise_is_one_colour(monkeypatch):
    # the toy's background is 0.5 and a model's is 0.5 +- 0.005: one colour, as in the clean renders; with an
    # even number of bins 0.5 is a bin edge and the same grey reads as 8 colours (3 bits: every channel split)
    import models.evaluate as ev
    grey = 0.5 + 0.01 * (torch.rand(2, 3, 3, 8, 8, generator=torch.Generator().manual_seed(0)) - 0.5)  # (B, F, 3, H, W)
    assert frame_stats(grey)['entropy'].tolist() == [0.0, 0.0]
    monkeypatch.setattr(ev, 'LEVELS', 4)
    assert (frame_stats(grey)['entropy'] > 2.9).all()


# ----------------------------------------------------------------------------- replayed on recorded toy runs

@pytest.fixture(scope='module')
def recorded():
    """tests/data/alarm_replay.json (bench/alarm.py --extract): the toy's 'none' and dual runs at lambda_KL
    held at 0.1 and 1, 5 seeds, AdamW at 1e-4, 60 iterations, their evaluations' means as logged (entropy left
    out: 4 levels); and four later cells with the entropy at 5 levels (bench/alarm.py CELLS)."""
    from bench.alarm import load
    return load(os.path.join(os.path.dirname(__file__), 'data', 'alarm_replay.json'))


def replayed(recorded, run, seed):
    from bench.alarm import replay
    return replay(recorded['base'][seed], recorded['runs'][run][seed], recorded['data'])


def first_trip(events):
    """(iteration, watchers) of the first evaluation whose alarm tripped, or None."""
    return next(((it, fields['alarm']) for it, fields, _ in events if fields['alarm']), None)


def test_replayed_the_alarm_trips_in_every_none_run(recorded):
    # no KL at 1e-4: saturation overshoots the data (0.13-0.15 against 0.084) in every seed; VQ ends 0.04-0.06
    # below the base model in seeds 0-2 (seed 4: 0.001, seed 3 above it). The alarm trips in each, on
    # saturation, and names VQ in seeds 0-2
    for seed, rows in recorded['runs']['none'].items():
        events = replayed(recorded, 'none', seed)
        named = {k for _, fields, _ in events for k in fields['alarm']}
        assert first_trip(events) and 'saturation' in named, (seed, named)
        vq_fell = means(recorded['base'][seed])['VQ'] - rows[-1]['VQ']
        assert (vq_fell > 0.03) == (seed in (0, 1, 2)) == ('VQ' in named), (seed, vq_fell, named)
    # seed 0 (the issue's: VQ 0.287 -> 0.250): saturation past the data from iteration 25, VQ from 50
    events = replayed(recorded, 'none', 0)
    assert first_trip(events) == (25, ['saturation'])
    assert next(it for it, fields, _ in events if 'VQ' in fields['alarm']) == 50
    line = next(line for it, _, line in events if it == 50)
    assert 'saturation 0.0606 -> 0.1319 (data 0.0835; SE ' in line and 'VQ 0.2868 -> 0.2459 (data 1.0000; SE ' in line


def test_replayed_the_alarm_stays_silent_in_runs_that_improve(recorded):
    # dual at lambda_KL 0.1 and 1: VQ above and the manifold distance below the base model's at the end of
    # every seed, saturation ending near the data's (0.087 at 0.1 from the base model's 0.060); the rule
    # they ran with tripped in every one (on saturation, brightness or entropy); this one stays silent. The
    # closest call: seed 4 at 0.1, its shape score (near 0) 2.2 then 1.96 SE below the base at 30 and 35
    for run in ('dual @ 0.1', 'dual @ 1'):
        for seed, rows in recorded['runs'][run].items():
            base = means(recorded['base'][seed])
            assert rows[-1]['VQ'] > base['VQ'] and rows[-1]['manifold'] < base['manifold'], (run, seed)
            assert any(recorded['recorded'][run][seed]), (run, seed)
            assert first_trip(replayed(recorded, run, seed)) is None, (run, seed)


def test_replayed_with_the_entropy_at_5_levels(recorded):
    # the later cells recorded the colour entropy at 5 levels: it ends at 0.63-0.68 in the runs that improve
    # (past the data's 0.533 from the base model's 0.489: its rising side), and there the rule they ran with
    # tripped in 8 of 10 on entropy alone; judged on its falling side only, all 10 are silent
    data = recorded['data']['entropy']
    for run in ('dual @ ratio 1', 'dual + sample @ 0.1'):
        for seed, rows in recorded['runs'][run].items():
            base = means(recorded['base'][seed])
            assert rows[-1]['VQ'] > base['VQ'] and rows[-1]['manifold'] < base['manifold'], (run, seed)
            assert base['entropy'] < data < rows[-1]['entropy'], (run, seed)
            assert first_trip(replayed(recorded, run, seed)) is None, (run, seed)
        ran = [a for a in recorded['recorded'][run].values() if any(a)]
        assert len(ran) == 4 and all({k for x in a for k in x} == {'entropy'} for a in ran), run
    # runs that do damage (saturation past the data, VQ below the base model's in most seeds) still trip, on
    # saturation or brightness (with others); the two silent seeds, by the rule's own terms: 'stepwise +
    # sample @ 1' seed 1's composite never rose beyond its noise (0.08 against 2 SE = 0.11: a run that does not gain is not gaming
    # the reward), 'none, muon 3e-4' seed 4 ends with VQ at the base model's (-0.003), saturation flagged once
    for run, silent in (('stepwise + sample @ 1', 1), ('none, muon 3e-4', 4)):
        for seed, rows in recorded['runs'][run].items():
            trip = first_trip(replayed(recorded, run, seed))
            assert (trip is None) == (seed == silent), (run, seed, trip)
            assert trip is None or set(trip[1]) & {'saturation', 'brightness'}, (run, seed, trip)
    alarm = Alarm()
    alarm(0, recorded['base'][1])
    gain = max(r['composite'] for r in recorded['runs']['stepwise + sample @ 1'][1]) - means(recorded['base'][1])['composite']
    assert 0 < gain < 2 * alarm.noise('composite')
    assert abs(recorded['runs']['none, muon 3e-4'][4][-1]['VQ'] - means(recorded['base'][4])['VQ']) < 0.005


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
