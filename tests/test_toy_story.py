"""
The story world and its streaming machinery (streaming/toy_story.py, streaming/toy_story_sf.py).
python -m pytest tests/test_toy_story.py
- the world: a story's centres move by speed x its segment's direction, every later segment turns, every frame
  stays in the toy's box; clean renders score exactly 1 on every reward term (composite 2); the training texts
  parse, their first caption is wrong about as often as the base's;
- the reward reads the whole story: a later segment in another colour, a jump at a switch, a segment moving the
  wrong way each lower exactly the term that should fall, and only in that segment;
- the model: per-segment text by a masked cross-attention equals one text when the texts are equal, and a frame
  under a causal mask equals the same frames run alone with their own text (an independent forward);
- a causal student's story from its KV cache, text keys replaced at each switch, equals the brute-force masked
  forward of diffusers' model over the clean earlier frames (streaming.frame_mask), block by block and step by step;
- DMD's training rollout with the exit at the last step is the sampler's clip.
"""
import random

import pytest
import torch

from models import toy
import streaming
from streaming import toy_ar, toy_story as ts, toy_story_sf as sf


def tiny():
    torch.manual_seed(0)
    cfg = dict(toy_ar.CONFIG, num_layers=2)
    return ts.install(ts.ToyStoryTransformer(**cfg).eval())


def test_story_track_turns_and_stays_in_the_box():
    for seed in range(50):
        rng = random.Random(seed)
        dirs = ts.turns(rng, rng.randrange(4))
        assert all(a != b for a, b in zip(dirs, dirs[1:]))
        u = [rng.random() for _ in range(3)]
        c = ts.track(dirs, u)  # (F, 2)
        assert c.min() >= toy.MARGIN - 1e-5 and c.max() <= toy.WIDTH - toy.MARGIN + 1e-5
        speed = ts.SPEED[0] + (ts.SPEED[1] - ts.SPEED[0]) * u[0]
        for t in range(1, ts.FRAMES):
            d = torch.tensor(list(toy.DIRECTIONS.values())[dirs[t // ts.SEG_FRAMES]])
            assert torch.allclose(c[t] - c[t - 1], speed * d, atol=1e-5)


def test_clean_stories_score_one_on_every_term():
    st = ts.stories('eval', 2)[:12] + ts.stories('train', 1)[:12]
    frames = torch.stack([ts.render_story(p, i) for i, p in enumerate(st)])
    r = ts.story_reward(frames, st)
    for k in ('VQ', 'MQ', 'TA', 'colour', 'shape', 'direction'):
        assert torch.allclose(r[k], torch.ones(len(st)), atol=1e-4), k
    assert torch.allclose(r['composite'], torch.full((len(st),), 2.0), atol=1e-4)


def test_training_stories_parse_and_lie_like_the_base():
    frames, texts = ts.story_data(torch.Generator().manual_seed(0), 300)
    assert frames.shape == (300, ts.FRAMES, 3, toy.HEIGHT, toy.WIDTH)
    told = [t for t in texts if t[0]]
    assert 0.8 < len(told) / 300 < 0.97  # a tenth dropped to ""
    for t in told:
        ts.parse_story(t)  # raises if not a story
        ts.encode(t)


def _story(prompts, seed, colours=None, shift=None):
    """A clean story with segment j painted in colours[j] (default: the story's) and shifted by shift (j, dx)."""
    c, s, dirs = ts.parse_story(prompts)
    rng = random.Random(seed)
    centres = ts.track(dirs, [rng.random() for _ in range(3)])
    if shift:
        j, dx = shift
        centres[j * ts.SEG_FRAMES:, 0] += dx
    cols = colours or [c] * ts.SEGMENTS
    per = [toy.paint(torch.tensor([cols[t // ts.SEG_FRAMES]]), torch.tensor([s]), centres[None, t:t + 1])[0]
           for t in range(ts.FRAMES)]
    return torch.cat(per)


def test_the_reward_reads_the_whole_story():
    st = ['a red circle moving left', 'it turns up', 'it turns right', 'it turns down']
    clean = ts.story_reward(_story(st, 3)[None], [st])
    recoloured = ts.story_reward(_story(st, 3, colours=[0, 0, 2, 0])[None], [st])  # segment 3 blue
    assert recoloured['colour'].item() < 0.8 and recoloured['segments'][0, 2] < clean['segments'][0, 2] - 0.2
    assert torch.allclose(recoloured['segments'][0, :2], clean['segments'][0, :2], atol=1e-4)
    jumped = ts.story_reward(_story(st, 3, shift=(2, 2.0))[None], [st])  # a 2 px jump at the third switch
    assert jumped['MQ'].item() < clean['MQ'].item() - 0.05 and jumped['TA'].item() > 0.99
    wrong = [st[0], 'it turns down', st[2], st[3]]  # the clip turns up where the story says down
    r = ts.story_reward(_story(st, 3)[None], [wrong])
    assert r['segments'][0, 1] < clean['segments'][0, 1] - 0.2
    assert torch.allclose(r['segments'][0, [0, 2, 3]], clean['segments'][0, [0, 2, 3]], atol=1e-4)


@torch.no_grad()
def test_segment_text_is_masked_cross_attention():
    net, g = tiny(), torch.Generator().manual_seed(1)
    x = torch.randn(2, 48, ts.FRAMES, 6, 6, generator=g)
    s = torch.rand(2, ts.FRAMES, generator=g)
    one = ts.encode(['a red circle moving left', 'a blue cross moving up'])[:, None]  # (2, 1, L, D)
    same = ts.forward_frames(net, x, s, one.expand(-1, ts.SEGMENTS, -1, -1), ts.segs_of(ts.FRAMES))
    assert torch.allclose(same, ts.forward_frames(net, x, s, one, [0] * ts.FRAMES), atol=1e-5)
    texts = ts.encode_stories([ts.story_of('a red circle moving left', 0), ts.story_of('a blue cross moving up', 1)])
    causal = streaming.frame_mask(ts.FRAMES, dict(block=1, sink=0, window=None))
    v = ts.forward_frames(net, x, s, texts, ts.segs_of(ts.FRAMES), mask=causal)
    n = ts.SEG_FRAMES  # the first segment alone, with its own text: what the causal story computes there
    alone = ts.forward_frames(net, x[:, :, :n], s[:, :n], texts[:, :1], [0] * n, mask=causal[:n, :n])
    assert torch.allclose(v[:, :, :n], alone, atol=1e-5)
    assert not torch.allclose(v[:, :, n:2 * n], same[:, :, n:2 * n], atol=1e-3)  # the second reads 'it turns'


@torch.no_grad()
def test_story_from_the_cache_equals_the_masked_forward():
    net, B = tiny(), 2
    g = torch.Generator().manual_seed(2)
    noise = torch.randn(B, 48, ts.FRAMES, 6, 6, generator=g)
    texts = ts.encode_stories([ts.story_of('a green square moving down', 5), ts.story_of('a yellow circle moving right', 6)])
    got = ts.generate_story(net, noise, texts, [torch.Generator().manual_seed(i) for i in range(B)])
    gens, sig, done = [torch.Generator().manual_seed(i) for i in range(B)], streaming.sigmas(ts.STUDENT), []
    mask = streaming.frame_mask(ts.FRAMES, ts.STUDENT)
    segs = ts.segs_of(ts.FRAMES)
    for b in range(ts.FRAMES):  # every block: one masked forward over [clean frames 0..b-1, the noisy block]
        x = noise[:, :, b:b + 1]
        for k, s in enumerate(sig):
            seq = torch.cat(done + [x], 2)
            sb = torch.cat([torch.zeros(B, b), torch.full((B, 1), s)], 1)
            v = ts.forward_frames(net, seq, sb, texts, segs[:b + 1], mask=mask[:b + 1, :b + 1])[:, :, -1:]
            x0 = x - s * v
            if k + 1 < len(sig):
                z = torch.stack([torch.randn(x0.shape[1:], generator=q) for q in gens])
                x = (1 - sig[k + 1]) * x0 + sig[k + 1] * z
        done.append(x0)
    assert torch.allclose(got, torch.cat(done, 2), atol=2e-4)


@torch.no_grad()
def test_dmd_rollout_with_the_last_exit_is_the_sampler():
    net = tiny()
    noise = torch.randn(2, 48, ts.FRAMES, 6, 6, generator=torch.Generator().manual_seed(3))
    texts = ts.encode_stories([ts.story_of('a red cross moving up', 0)] * 2)
    torch.manual_seed(7)
    a = sf.rollout(net, noise, texts, len(sf.sigmas()) - 1)
    torch.manual_seed(7)
    b = ts.generate_story(net, noise, texts)
    assert torch.allclose(a, b, atol=1e-5)
