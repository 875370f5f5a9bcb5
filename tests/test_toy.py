"""The toy world's invariants: exact renders, an exact autoencoder, rewards at their maximum on
clean clips that drop for each kind of defect, and a committed base model that is trained.

    python -m pytest tests/test_toy.py
"""
import os
import time

import pytest
import torch

from models import toy

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = ['a red circle moving left', 'a green square moving up', 'a blue triangle moving right',
           'a yellow cross moving down']


def clean(prompts, seed=0):
    return torch.stack([toy.render(p, seed + i) for i, p in enumerate(prompts)])  # (B, F, 3, H, W)


def test_render_is_deterministic_and_in_range():
    a, b, c = toy.render(PROMPTS[0], 7), toy.render(PROMPTS[0], 7), toy.render(PROMPTS[0], 8)
    assert a.shape == (toy.FRAMES, 3, toy.HEIGHT, toy.WIDTH)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert a.min() >= 0 and a.max() <= 1
    # the first frame is a red disc: red where covered, grey background elsewhere
    assert torch.allclose(a[0, :, 0, 0], torch.tensor([toy.BACKGROUND] * 3))
    assert (a[0, 0] - a[0, 1]).max() == 1.0  # some pixel fully red


def test_autoencoder_round_trip_is_exact():
    x = torch.rand(3, toy.FRAMES, 3, toy.HEIGHT, toy.WIDTH, generator=torch.Generator().manual_seed(0))
    z = toy.encode(x)
    assert z.shape == (3, *toy.LATENT_SHAPE)
    assert (toy.decode(z) - x).abs().max() < 1e-6
    assert torch.equal(toy.decode(toy.encode(clean(PROMPTS))), clean(PROMPTS))
    assert toy.decode(100 * z).min() >= 0 and toy.decode(100 * z).max() <= 1  # decode clamps
    assert 0.5 < toy.encode(clean(toy.all_prompts())).std() < 1.5  # unit-ish like a VAE's latents


def test_text_encoder_shapes_and_empty_prompt():
    e, m, e2, m2 = toy.encode_prompts(PROMPTS + [''])
    assert e.shape == (5, toy.TEXT_LEN, toy.TEXT_DIM) and m.shape == (5, toy.TEXT_LEN)
    assert e2.shape == (5, toy.TEXT_2_LEN, toy.TEXT_2_DIM) and m2.shape == (5, toy.TEXT_2_LEN)
    assert m[:4].sum(1).tolist() == [6] * 4 and m[4].sum() == 1  # "" keeps its <bos> token
    assert (e2 == 0).all() and (m2 == 0).all()  # no quoted text: ByT5 branch empty, as in the pipeline
    with pytest.raises(ValueError):
        toy.encode_prompts(['a purple circle moving left'])


def test_prompt_splits():
    read = lambda n: open(os.path.join(HERE, toy.DIR, n)).read().splitlines()
    train, held = read('train_prompts.txt'), read('eval_prompts.txt')
    assert len(train) == 48 and len(held) == 16 and not set(train) & set(held)
    assert sorted(train + held) == sorted(toy.all_prompts())


def test_reward_is_maximal_on_clean_renders():
    prompts = toy.all_prompts()
    r = toy.reward(clean(prompts), prompts, toy.FPS)
    for k in ('VQ', 'MQ', 'TA'):
        assert r[k].dtype == torch.float32 and r[k].shape == (64,)
        assert torch.all(r[k] == 1), k
    assert torch.allclose(r['Overall'], r['VQ'] + r['MQ'] + r['TA'])
    assert toy.manifold_distance(clean(prompts)).max() < 1e-3


def test_reward_drops_for_each_defect():
    x = clean(PROMPTS)
    # wrong colour: the prompt names another colour than the clip shows
    swap = lambda p, i, other: ' '.join(other[w] if k == i else w for k, w in enumerate(p.split()))
    wrong = [swap(p, 1, {'red': 'green', 'green': 'blue', 'blue': 'yellow', 'yellow': 'red'}) for p in PROMPTS]
    r = toy.reward(x, wrong)
    assert torch.all(r['colour'] == 0) and torch.all(r['TA'] < 0.7)
    assert torch.all(r['VQ'] == 1) and torch.all(r['MQ'] == 1)
    # wrong direction: left <-> right, up <-> down
    wrong = [swap(p, 4, {'left': 'right', 'right': 'left', 'up': 'down', 'down': 'up'}) for p in PROMPTS]
    r = toy.reward(x, wrong)
    assert torch.all(r['direction'] == 0) and torch.all(r['TA'] < 0.7)
    assert torch.all(r['VQ'] == 1) and torch.all(r['MQ'] == 1)
    # jittered motion: each frame's centre moved by up to 1 px; frames stay clean renders
    g = torch.Generator().manual_seed(0)
    ids = torch.tensor([toy.parse(p) for p in PROMPTS])  # (B, 3)
    centres = toy.trajectory(ids[:, 2], torch.rand(4, 3, generator=g))  # (B, F, 2)
    smooth = toy.paint(ids[:, 0], ids[:, 1], centres)
    jitter = toy.paint(ids[:, 0], ids[:, 1], centres + 2 * torch.rand(centres.shape, generator=g) - 1)
    r0, r = toy.reward(smooth, PROMPTS), toy.reward(jitter, PROMPTS)
    assert torch.all(r0['MQ'] == 1) and torch.all(r['MQ'] < 0.9)
    assert torch.all(r['VQ'] == 1)
    # noisy frames: off the manifold
    noisy = (x + 0.1 * torch.randn(x.shape, generator=g)).clamp(0, 1)
    r = toy.reward(noisy, PROMPTS)
    assert torch.all(r['VQ'] < 0.5) and torch.all(r['MQ'] < 1)
    assert torch.all(toy.manifold_distance(noisy) > 0.05)
    # pure noise (what the sampler starts from): no object, so low on every dimension
    r = toy.reward(toy.decode(torch.randn(4, *toy.LATENT_SHAPE, generator=g)), PROMPTS)
    assert torch.all(r['VQ'] < 0.1) and torch.all(r['MQ'] < 0.2) and r['TA'].mean() < 0.25
    # graded, not 0/1: more noise, lower VQ
    vq = [toy.reward((x + a * torch.randn(x.shape, generator=g)).clamp(0, 1), PROMPTS)['VQ'].mean()
          for a in (0.01, 0.03, 0.1)]
    assert 1 > vq[0] > vq[1] > vq[2] > 0


def test_reward_of_64_clips():
    prompts = toy.all_prompts()
    x = clean(prompts)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # on a shared CPU one thread beats two oversubscribed ones
    toy.reward(x, prompts)  # warm-up
    t = time.time()
    toy.reward(x, prompts)
    print(f'reward of 64 clips: {1000 * (time.time() - t):.0f} ms on one thread')
    torch.set_num_threads(threads)


def test_committed_base_model_is_trained():
    from diffusers import HunyuanVideo15Transformer3DModel
    torch.manual_seed(0)
    net = HunyuanVideo15Transformer3DModel.from_pretrained(os.path.join(HERE, toy.DIR, 'transformer'))
    assert next(net.parameters()).dtype == torch.float32  # stored in bf16, trained in float32
    held = [p for p in toy.all_prompts() if toy.is_eval_prompt(p)]  # 16 prompts, one seed each
    ta = toy.reward(toy.sample(net.eval(), held, range(16), steps=8), held)['TA'].mean()
    ta_random = toy.reward(toy.sample(toy.build_model().eval(), held, range(16), steps=8), held)['TA'].mean()
    print(f'held-out TA of ODE samples: trained {ta:.3f}, random init {ta_random:.3f}')
    assert ta > 0.35 and ta > ta_random + 0.25, (ta, ta_random)
