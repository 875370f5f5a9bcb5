"""
extras/preflight.py before a run loads anything: the disk must hold keep_checkpoints checkpoints and the one
being written, at the model's size (16 bytes a trained parameter, counted on the meta device); a run on a
file system with less (a small quota: shutil.disk_usage replaced) stops with one line naming out_dir, the
need and what is free, before the reward or the policy loads (train.py itself, in this process). The reward
loaded and one clip scored before the policy (reward_first: a broken reward stops every rank in one line),
and `python -m models.videoalign --check DIR` on the tests' tiny random VideoAlign.

    python -m pytest tests/test_preflight_room.py
"""
import collections
import os
import shutil
import subprocess
import sys

import pytest
import torch

from extras import preflight
from models import videoalign

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, 'tests'))
from test_train import SMALL, run_here  # noqa: E402

Usage = collections.namedtuple('Usage', 'total used free')


def toy(out_dir, **kw):
    return dict(dict(model='assets/toy', lora_rank=0, out_dir=str(out_dir), keep_checkpoints=2), **kw)


def quota(monkeypatch, free):
    monkeypatch.setattr(shutil, 'disk_usage', lambda path: Usage(10 ** 15, 10 ** 15 - free, free))


def test_the_checkpoints_size_is_the_trained_parameters(monkeypatch):
    monkeypatch.chdir(ROOT)
    from models.policy import load_policy
    for r in (0, 8):  # what the policy train.py loads trains (LoRA: the adapters; the toy's ByT5 embedder frozen)
        net = load_policy('assets/toy', 'cpu', lora_rank=r)
        trained = sum(p.numel() for p in net.parameters() if p.requires_grad)
        assert preflight.trained_params(toy('out', lora_rank=r)) == trained < sum(p.numel() for p in net.parameters())


def test_a_disk_without_room_for_the_checkpoints_is_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    size = preflight.BYTES_A_PARAM * preflight.trained_params(toy('out'))
    out = tmp_path / 'not_made_yet' / 'out'  # measured on the file system it will be made on
    quota(monkeypatch, 3 * size)  # 2 kept + 1 being written: just fits
    assert preflight.disk(toy(out)) == []
    quota(monkeypatch, 3 * size - 1)
    [line] = preflight.disk(toy(out))
    assert line.startswith(f"out_dir '{out}': 2 kept checkpoints + 1 being written") and 'free' in line, line
    assert f'need {preflight.human(3 * size)} more; {preflight.human(3 * size - 1)} free' in line
    # a resumed run's checkpoints are on the disk already: one more fits in a third of the room
    for it in (4, 8):
        (out / f'ckpt_{it:06d}').mkdir(parents=True)
    quota(monkeypatch, size)
    assert preflight.disk(toy(out)) == []


def test_train_stops_on_a_full_disk_before_anything_loads(tmp_path, monkeypatch):
    """train.py itself: the quota's line, and neither the reward nor the policy loaded."""
    from models import policy
    loaded = []
    monkeypatch.setattr(policy, 'load_policy', lambda *a, **k: loaded.append('policy'))
    monkeypatch.setattr(videoalign, 'load_reward', lambda *a, **k: loaded.append('reward'))
    quota(monkeypatch, 10 ** 6)  # 1 MB
    message, printed = run_here(monkeypatch, SMALL + [f'--out_dir={tmp_path / "out"}'], check=False)
    assert 'before anything loaded' in message and 'out_dir' in message and 'MB free' in message, message
    assert loaded == []


def test_the_reward_is_loaded_and_scored_first(monkeypatch, capsys):
    """reward_first: the toy's reward scores one clip and is returned; a reward that fails to score stops
    the run in one line that names it (its traceback printed above it)."""
    monkeypatch.chdir(ROOT)
    from models import family
    fam = family('assets/toy')
    # train.py's default size (81x352x624): the toy's family decodes its own clip size from it, and the
    # clip scored is decoded as the run's are (a clip of the settings' pixel size fails the toy's reward)
    c = dict(reward_model='world', videoalign_dir='', qwen_dir='', num_frames=81, height=352, width=624, fps=8,
             train_prompts='assets/toy/train_prompts.txt', model='assets/toy')
    reward_fn, distance = preflight.reward_first(c, 'cpu', fam)
    assert callable(reward_fn) and callable(distance)

    class Broken:  # a family whose reward fails on the first clip (a weight format, a dtype)
        manifold_distance = None

        @staticmethod
        def reward(frames, prompts, fps):
            raise RuntimeError('expected scalar type BFloat16 but found Float')
    with pytest.raises(SystemExit) as e:
        preflight.reward_first(c, 'cpu', Broken)
    assert str(e.value.code).startswith('stopped before the policy loaded:\n  ') and str(e.value.code).count('\n') == 1
    assert "reward_model 'world'" in str(e.value.code) and 'BFloat16' in str(e.value.code)

    class NaN(Broken):
        reward = staticmethod(lambda frames, prompts, fps: {'VQ': torch.tensor([float('nan')])})
    preflight.reward_first(c, 'cpu', NaN)  # a clip scored NaN: one warning, not a stop (reward.check_valid's)
    assert 'non-finite' in capsys.readouterr().out


def test_videoalign_check_scores_a_downloaded_folder(tmp_path):
    """python -m models.videoalign --check on a folder in the released layout (tiny, random): it loads and
    scores one clip; a folder without its checkpoint stops with the download that fixes it."""
    from tiny_videoalign import make_tiny_videoalign
    ckpt, qwen = make_tiny_videoalign(str(tmp_path))
    run = lambda d: subprocess.run([sys.executable, '-m', 'models.videoalign', '--check', d, f'--qwen_dir={qwen}',  # noqa: E731
                                    '--device=cpu', '--size=9x64x96'], cwd=ROOT, capture_output=True, text=True,
                                   timeout=300, env=dict(os.environ, OMP_NUM_THREADS='1'))
    p = run(ckpt)
    assert p.returncode == 0 and 'one 9x64x96 clip scored' in p.stdout and 'Overall' in p.stdout, p.stderr[-2000:]
    p = run(str(tmp_path / 'nope'))
    assert p.returncode != 0 and 'hf download KwaiVGI/VideoReward' in p.stderr, p.stderr[-2000:]
