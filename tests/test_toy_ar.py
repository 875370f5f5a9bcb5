"""
The streaming toy (streaming/toy_ar.py). python -m pytest tests/test_toy_ar.py
- the committed model (assets/toy_ar) is this family's, loads through the family table, and generates the
  held-out prompts block by block with frames leaving the window (the sink kept), scored by the toy's exact
  reward and manifold distance above what a collapsed model scores (assets/toy_ar/eval.log: it is weaker
  than the bidirectional base);
- the training script runs end to end (two steps) and writes a directory the family loads;
- forward() of the interface is the clip's velocity under the block-causal mask: a frame's velocity does
  not depend on later frames (the window's own test is tests/test_wan_causal.py's).
"""
import os

import torch

from models import family, family_of, toy
import streaming
from streaming import toy_ar

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATH = os.path.join(ROOT, toy_ar.DIR)


def held_out(seeds=1):
    return [p for p in toy.all_prompts() if toy.is_eval_prompt(p) for _ in range(seeds)]


def test_committed_model_streams_the_toy_world():
    torch.set_num_threads(1)
    fam = family(PATH)
    net = fam.load_transformer(PATH)
    assert fam is toy_ar and family_of(net) is toy_ar and net.layout['window'] == 4
    prompts = held_out()
    text = fam.text_encoder(PATH, 'cpu')(prompts)
    noise = torch.stack([torch.randn(toy.LATENT_SHAPE, generator=torch.Generator().manual_seed(i)) for i in range(16)])
    seen = []
    x = streaming.generate(net, noise, toy_ar.context(text), [torch.Generator().manual_seed(i) for i in range(16)],
                           on_block=lambda start, x0, cache: seen.append(cache.frames))
    assert seen[-1] == [0, 7, 8] and seen[4] == [0, 3, 4]  # the sink kept, frames 1..6 dropped in turn
    assert torch.equal(x, fam.generate(net, noise, text, [torch.Generator().manual_seed(i) for i in range(16)]))
    frames = fam.load_decoder(PATH, 'cpu')(x)
    r = fam.reward(frames, prompts)
    composite = (0.5 * r['VQ'] + 0.5 * r['MQ'] + r['TA']).mean().item()
    # assets/toy_ar/eval.log: 0.335 on 16 x 4 (the bidirectional base 0.666); a model that collapses to the
    # grey mean scored 0.17-0.21 (streaming/toy_ar.py), pure noise about 0
    assert composite > 0.28 and r['colour'].mean() > 0.45, (composite, {k: v.mean().item() for k, v in r.items()})
    assert fam.manifold_distance(frames).mean() < 0.13


def test_training_script_writes_a_loadable_model(tmp_path, monkeypatch):
    torch.set_num_threads(1)
    monkeypatch.setattr(toy_ar, 'DIR', str(tmp_path / 'toy_ar'))
    monkeypatch.setattr(toy_ar, 'STEPS', 2)
    toy_ar.train()
    fam = family(str(tmp_path / 'toy_ar'))
    net = fam.load_transformer(str(tmp_path / 'toy_ar'))
    assert fam is toy_ar and 'done: 2 steps' in open(tmp_path / 'toy_ar' / 'train.log').read()
    x = fam.generate(net, torch.randn(1, *toy.LATENT_SHAPE), fam.text_encoder(str(tmp_path / 'toy_ar'), 'cpu')(['']))
    assert x.shape == (1, *toy.LATENT_SHAPE) and torch.isfinite(x).all()


def test_forward_is_block_causal():
    net = toy_ar.load_transformer(PATH)
    prompts = held_out()[:2]
    text = toy_ar.text_encoder(PATH, 'cpu')(prompts)
    x = torch.randn(2, *toy.LATENT_SHAPE, generator=torch.Generator().manual_seed(0))
    s = torch.full((2,), 0.5)
    with torch.no_grad():
        v = toy_ar.forward(net, x, s, text)
        later = x.clone()
        later[:, :, 6:] += 1  # frames 6.. changed: frames 0..5 are unchanged
        outside = x.clone()
        outside[:, :, 1:3] += 1  # frames 1, 2 changed
        v_later, v_out = toy_ar.forward(net, later, s, text), toy_ar.forward(net, outside, s, text)
    assert torch.allclose(v_later[:, :, :6], v[:, :, :6], atol=1e-5) and not torch.allclose(v_later[:, :, 6:], v[:, :, 6:])
    assert not torch.allclose(v_out[:, :, 1:3], v[:, :, 1:3]) and torch.allclose(v_out[:, :, 0], v[:, :, 0], atol=1e-5)


def test_held_out_evaluation_streams_block_by_block(tmp_path):
    """train.py's held-out evaluation (models/evaluate.py HeldOut) of the streaming toy: each item is the family's
    block-by-block generation from its own seed (not the bidirectional ODE sampler), scored by the toy's reward:
    the items equal generate() called here with the same noise, scored here."""
    import sde
    from infra import prompt_cache
    from models import evaluate, policy as M
    from reward import combine
    from test_train import NoPreemption
    torch.set_num_threads(1)
    prompts = held_out()[:3]
    cache = prompt_cache.PromptCache(prompt_cache.build(str(tmp_path / 'pc'), PATH, prompts + [''], M.encode_prompts))
    text_for = lambda ps: (M.batch_text(cache, ps, 'cpu'), M.batch_text(cache, [''] * len(ps), 'cpu'))  # noqa: E731
    weights = (0.5, 0.5, 1.0)
    run = evaluate.HeldOut(
        prompts, 1, seed=0, sigmas=sde.sigmas(4, 3.0), cfg=1.0, shape=toy.LATENT_SHAPE, text_for=text_for, batch=2,
        decode=M.load_decoder(PATH, 'cpu'), reward_fn=toy.reward, reward_weights=weights,
        manifold_distance=toy.manifold_distance, visual={}, move_visual=lambda *a: None, fps=toy.FPS,
        out_dir=str(tmp_path), videos=0, dp_rank=0, dp_world=1, leads=True, passes=dict.fromkeys(M.PASS_KINDS, 0),
        preemption=NoPreemption(), device='cpu')
    policy = M.load_policy(PATH, 'cpu')
    run(policy, 0, lambda: None)
    gens = M.generators([M.seed_of(0, 'eval', i) for i in range(3)])  # item i: prompt i, seed seed_of(0, 'eval', i)
    x = toy_ar.generate(policy, M.noise(toy.LATENT_SHAPE, gens, 'cpu'), text_for(prompts)[0], gens)
    scores = toy.reward(toy.decode(x), prompts, toy.FPS)
    expected = combine(scores, weights)
    got = torch.tensor([item['composite'] for item in run.items])
    torch.testing.assert_close(got, expected.float(), atol=1e-5, rtol=0)
