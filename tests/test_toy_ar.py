"""
The streaming toy (streaming/toy_ar.py). python -m pytest tests/test_toy_ar.py
The model is no longer committed (the story toy's student, assets/toy_story, succeeds it; python -m
streaming.toy_ar builds it in 18 min): these tests build one of two steps here, which is all they need:
- the training script writes a directory this family loads; an unbuilt toy's error names the command that
  builds it, and so does the story teacher's, which starts from it;
- generation streams block by block with frames leaving the window (the sink kept), the family's generate;
- forward() of the interface is the clip's velocity under the block-causal mask: a frame's velocity does
  not depend on later frames (the window's own test is tests/test_wan_causal.py's);
- train.py's held-out evaluation of a streaming model is its block-by-block generation;
- assets/ (what git carries) stays under 10 MB.
"""
import os

import pytest
import torch

from models import family, family_of, toy
import streaming
from streaming import toy_ar

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope='module')
def built(tmp_path_factory):
    """A toy_ar model directory of 2 training steps, made by the script itself."""
    torch.set_num_threads(1)
    d = str(tmp_path_factory.mktemp('toy_ar') / 'toy_ar')
    toy_ar.train(steps=2, out=d)
    return d


def held_out(seeds=1):
    return [p for p in toy.all_prompts() if toy.is_eval_prompt(p) for _ in range(seeds)]


def test_model_streams_the_toy_world(built):
    torch.set_num_threads(1)
    fam = family(built)
    net = fam.load_transformer(built)
    assert fam is toy_ar and family_of(net) is toy_ar and net.layout['window'] == 4
    prompts = held_out()
    text = fam.text_encoder(built, 'cpu')(prompts)
    noise = torch.stack([torch.randn(toy.LATENT_SHAPE, generator=torch.Generator().manual_seed(i)) for i in range(16)])
    seen = []
    x = streaming.generate(net, noise, toy_ar.context(text), [torch.Generator().manual_seed(i) for i in range(16)],
                           on_block=lambda start, x0, cache: seen.append(cache.frames))
    assert seen[-1] == [0, 7, 8] and seen[4] == [0, 3, 4]  # the sink kept, frames 1..6 dropped in turn
    assert torch.equal(x, fam.generate(net, noise, text, [torch.Generator().manual_seed(i) for i in range(16)]))
    r = fam.reward(fam.load_decoder(built, 'cpu')(x), prompts)  # scored by the toy's exact reward (2 steps: noise)
    assert all(torch.isfinite(v).all() and v.shape == (16,) for v in r.values())


def test_training_script_writes_a_loadable_model(built):
    fam = family(built)
    net = fam.load_transformer(built)
    assert fam is toy_ar and 'done: 2 steps' in open(os.path.join(built, 'train.log')).read()
    x = fam.generate(net, torch.randn(1, *toy.LATENT_SHAPE), fam.text_encoder(built, 'cpu')(['']))
    assert x.shape == (1, *toy.LATENT_SHAPE) and torch.isfinite(x).all()


def test_an_unbuilt_toy_names_the_command_that_builds_it(tmp_path, monkeypatch):
    from streaming import toy_story
    missing = str(tmp_path / 'toy_ar')
    monkeypatch.setattr(toy_ar, 'DIR', missing)
    with pytest.raises(SystemExit, match='python -m streaming.toy_ar'):
        family(missing)
    monkeypatch.setattr(toy_ar, 'DIR', 'assets/toy_ar_never_built')  # DIR from the repo's root, the path absolute
    with pytest.raises(SystemExit, match='python -m streaming.toy_ar'):
        family(os.path.join(ROOT, 'assets/toy_ar_never_built'))
    monkeypatch.setattr(toy_ar, 'DIR', missing)
    monkeypatch.setattr(toy_story, 'INIT', missing)  # the story teacher starts from it
    with pytest.raises(SystemExit, match='python -m streaming.toy_ar'):
        toy_story.train(steps=1, out=str(tmp_path / 'story'))


def test_assets_stay_under_10_mb():
    # what git carries in assets/ (the built toys, .gitignored, excluded): issue 69's budget, 10,000,000 bytes
    ignored = [l.strip().rstrip('/') for l in open(os.path.join(ROOT, '.gitignore')) if l.startswith('assets/')]
    size = 0
    for d, dirs, files in os.walk(os.path.join(ROOT, 'assets')):
        dirs[:] = [x for x in dirs if os.path.relpath(os.path.join(d, x), ROOT) not in ignored]
        size += sum(os.path.getsize(os.path.join(d, f)) for f in files)
    assert 'assets/toy_ar' in ignored and size < 10_000_000, size


def test_forward_is_block_causal(built):
    net = toy_ar.load_transformer(built)
    prompts = held_out()[:2]
    text = toy_ar.text_encoder(built, 'cpu')(prompts)
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


def test_held_out_evaluation_streams_block_by_block(built, tmp_path):
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
    cache = prompt_cache.PromptCache(prompt_cache.build(str(tmp_path / 'pc'), built, prompts + [''], M.encode_prompts))
    text_for = lambda ps: (M.batch_text(cache, ps, 'cpu'), M.batch_text(cache, [''] * len(ps), 'cpu'))  # noqa: E731
    weights = (0.5, 0.5, 1.0)
    run = evaluate.HeldOut(
        prompts, 1, seed=0, sigmas=sde.sigmas(4, 3.0), cfg=1.0, shape=toy.LATENT_SHAPE, text_for=text_for, batch=2,
        decode=M.load_decoder(built, 'cpu'), reward_fn=toy.reward, reward_weights=weights,
        manifold_distance=toy.manifold_distance, visual={}, move_visual=lambda *a: None, fps=toy.FPS,
        out_dir=str(tmp_path), videos=0, dp_rank=0, dp_world=1, leads=True, passes=dict.fromkeys(M.PASS_KINDS, 0),
        preemption=NoPreemption(), device='cpu')
    policy = M.load_policy(built, 'cpu')
    run(policy, 0, lambda: None)
    gens = M.generators([M.seed_of(0, 'eval', i) for i in range(3)])  # item i: prompt i, seed seed_of(0, 'eval', i)
    x = toy_ar.generate(policy, M.noise(toy.LATENT_SHAPE, gens, 'cpu'), text_for(prompts)[0], gens)
    scores = toy.reward(toy.decode(x), prompts, toy.FPS)
    expected = combine(scores, weights)
    got = torch.tensor([item['composite'] for item in run.items])
    torch.testing.assert_close(got, expected.float(), atol=1e-5, rtol=0)
