"""
Self-Forcing's and CausVid's released cache holds 21 latent frames under global attention (streaming/__init__.py
LAYOUTS max_frames): a generation continued from a cache counts the frames already in it. 18 frames, then 3
more from the same cache (21) are sampled; then 6 more (24 in all), or 6 after 18, are refused in one line before
any forward, whatever the new call's own frames. (A fresh call of more than 21: tests/test_layouts.py.)

    python -m pytest tests/test_streaming_limit.py
"""
import os
import sys

import pytest
import torch

import streaming

sys.path.insert(0, os.path.dirname(__file__))
from test_wan_causal import tiny_pair  # noqa: E402


@pytest.mark.parametrize('name', ['self_forcing', 'causvid'])
def test_a_continued_cache_counts_toward_the_released_21_frames(name):
    net, _ = tiny_pair(streaming.LAYOUTS[name])
    g = torch.Generator().manual_seed(0)
    text = torch.randn(1, 5, 16, generator=g)
    noise = lambda f: torch.randn(1, 4, f, 2, 2, generator=g)  # noqa: E731
    cache = streaming.KVCache(net.layout)
    streaming.generate(net, noise(18), text, cache=cache)
    saved = cache.save()
    with pytest.raises(SystemExit, match='holds 21 latent frames with global attention, asked for 24') as e:
        streaming.generate(net, noise(6), text, cache=cache)
    assert '\n' not in str(e.value) and cache.end == 18  # refused before anything ran
    cache.restore(saved)
    streaming.generate(net, noise(3), text, cache=cache)  # 21: the cache's room exactly
    assert cache.end == 21
    with pytest.raises(SystemExit, match='asked for 24'):
        streaming.generate(net, noise(3), text, cache=cache)
