"""
extras/preflight.py's missing() on the settings as a user writes them: eval_metrics='clipscore, pickscore'
(a space after the comma) checks both watchers' folders, each missing one a line; names the run does not
use are not checked. (Every path before loading, with its download: tests/test_launch_second.py; a path one
rank misses stops every rank: tests/test_ranks_agree.py.)

    python -m pytest tests/test_preflight.py
"""
import os

import pytest

from extras import preflight

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def settings(**kw):
    return dict(dict(model='assets/toy', reward_model='world', videoalign_dir='/nope/va', qwen_dir='/nope/qwen',
                     eval_metrics='', clip_dir='/nope/clip', pickscore_dir='/nope/pick',
                     train_prompts='assets/toy/train_prompts.txt', eval_prompts='assets/toy/eval_prompts.txt'), **kw)


@pytest.mark.parametrize('metrics', ['clipscore, pickscore', ' pickscore ,clipscore', 'clipscore,pickscore'])
def test_each_watcher_named_is_checked_whatever_the_spaces(metrics, monkeypatch):
    monkeypatch.chdir(ROOT)
    lines = preflight.missing(settings(eval_metrics=metrics))
    assert sorted(l.split(' ')[0] for l in lines) == ['clip_dir', 'pickscore_dir'], lines
    assert preflight.missing(settings(eval_metrics='')) == []
    assert [l.split(' ')[0] for l in preflight.missing(settings(eval_metrics='pickscore '))] == ['pickscore_dir']
