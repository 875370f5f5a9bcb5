"""
What streaming/__init__.py's and kvpo's docstrings promise of guidance and of the noise, against references
written here on a tiny random streaming model (toy_ar's transformer). python -m pytest tests/test_streaming_promises.py
- streaming.generate with cfg != 1: classifier-free guidance against context_neg, each branch with its own
  cache rows: a reference that runs the two branches with two caches of their own (the negative one
  written with the negative text), v = v_neg + cfg (v_pos - v_neg), equals it; cfg 1 is the unguided clip;
- the re-noising draws ('fresh' layout): one generator a sample, one (C, f, h, w) draw a block and step
  in that order (written out in the reference), so a sample is the same alone or in a batch;
- a cache given, generation continues it (streaming.generate, sde_ar.generate): two calls of 3 frames
  equal one of 6, the generators continuing;
- kvpo.noise_at is a function of (seed, frame, step): a frame's noise is the same whichever frames are
  drawn beside it, and differs between steps and seeds; a KVPO branch re-noises (the released 'fresh' way)
  with the draws of its frames and steps, and writes its cache from x0 noised by the draw of step S.
"""
import torch

from kvpo import kvpo
import streaming
from streaming import toy_ar

FRESH = dict(toy_ar.LAYOUT, renoise='fresh')  # block 1, sink 1, window 4; fresh noise between steps
FRAMES = 6  # past the window


def tiny(layout, seed=0):
    torch.manual_seed(seed)
    cfg = dict(toy_ar.CONFIG, in_channels=4, out_channels=4, num_layers=2, num_attention_heads=2,
               attention_head_dim=8, ffn_dim=32, rope_max_seq_len=64)
    return streaming.install(toy_ar.ToyARTransformer(**cfg), layout).eval()


def text(seed, n=2):
    return torch.randn(n, 4, toy_ar.CONFIG['text_dim'], generator=torch.Generator().manual_seed(seed))


def gens(*seeds):
    return [torch.Generator().manual_seed(s) for s in seeds]


@torch.no_grad()
def reference(net, noise, ctx, ctx_neg, cfg, generators):
    """Block by block, each branch from its own cache; the re-noising z of a block and step: one draw of
    each sample's generator."""
    L, sig = net.layout, streaming.sigmas(net.layout)
    B = noise.shape[0]
    caches = [streaming.KVCache(L), streaming.KVCache(L)]  # positive, negative
    out = []
    for start in range(0, noise.shape[2], L['block']):
        x = noise[:, :, start:start + L['block']]
        for k, s in enumerate(sig):
            vs = [streaming.forward_block(net, x, torch.full((B,), s), c, cache, start).float()
                  for c, cache in zip((ctx, ctx_neg), caches)]
            v = vs[1] + cfg * (vs[0] - vs[1]) if cfg != 1 else vs[0]
            x0 = x - s * v
            if k + 1 < len(sig):
                z = x0 + v if L.get('renoise') == 'ode' else \
                    torch.stack([torch.randn(x0.shape[1:], generator=g) for g in generators])
                x = (1 - sig[k + 1]) * x0 + sig[k + 1] * z
        for c, cache in zip((ctx, ctx_neg), caches):
            streaming.forward_block(net, x0, torch.zeros(B), c, cache, start, write=True)
        out.append(x0)
    return torch.cat(out, 2)


def test_guidance_each_branch_with_its_own_cache():
    for layout in (toy_ar.LAYOUT, FRESH):
        net = tiny(layout)
        noise = torch.randn(2, 4, FRAMES, 2, 2, generator=torch.Generator().manual_seed(3))
        ctx, neg = text(1), text(2)
        for cfg in (1.0, 3.0):
            got = streaming.generate(net, noise, ctx, gens(11, 12), cfg=cfg, context_neg=neg)
            want = reference(net, noise, ctx, neg, cfg, gens(11, 12))
            assert (got - want).abs().max() < 1e-5, (layout, cfg)
        unguided = streaming.generate(net, noise, ctx, gens(11, 12))
        assert (unguided - got).abs().max() > 1e-3  # cfg 3 moved it
        assert (streaming.generate(net, noise, ctx, gens(11, 12), cfg=1.0, context_neg=neg) - unguided).abs().max() == 0


def test_one_generator_a_sample_one_draw_a_block_and_step():
    net = tiny(FRESH)
    noise = torch.randn(2, 4, FRAMES, 2, 2, generator=torch.Generator().manual_seed(3))
    ctx = text(1)
    both = streaming.generate(net, noise, ctx, gens(11, 12))
    alone = [streaming.generate(net, noise[i:i + 1], ctx[i:i + 1], gens(s)) for i, s in enumerate((11, 12))]
    assert all((both[i:i + 1] - alone[i]).abs().max() < 1e-5 for i in range(2))
    used = gens(11, 12)
    streaming.generate(net, noise, ctx, used)
    draws = FRAMES * (len(FRESH['timesteps']) - 1)  # blocks x re-noisings, none after a block's last step
    for g, s in zip(used, (11, 12)):
        fresh = torch.Generator().manual_seed(s)
        for _ in range(draws):
            torch.randn(4, 1, 2, 2, generator=fresh)
        assert torch.equal(torch.randn(3, generator=g), torch.randn(3, generator=fresh))  # as many draws, no more
    assert (both - reference(net, noise, ctx, ctx, 1.0, gens(11, 12))).abs().max() < 1e-5


def test_kvpo_noise_is_a_function_of_seed_frame_and_step():
    shape = (4, 2, 2)
    wide = kvpo.noise_at(7, [3, 4, 5, 8], 2, shape)  # (1, C, 4, h, w)
    assert wide.shape == (1, 4, 4, 2, 2)
    for i, f in enumerate((3, 4, 5, 8)):
        assert torch.equal(wide[:, :, i], kvpo.noise_at(7, [f], 2, shape)[:, :, 0])
    one = kvpo.noise_at(7, [4], 2, shape)
    assert not torch.equal(one, kvpo.noise_at(7, [4], 3, shape)) and not torch.equal(one, kvpo.noise_at(8, [4], 2, shape))
    assert not torch.equal(one, kvpo.noise_at(7, [5], 2, shape))


def test_generation_continues_a_cache():
    # a cache given: noise's frames follow its newest (absolute positions, the window's frames read from it);
    # 6 frames in two calls of 3 equal 6 at once, the generators continuing, and so does GRPO-SDE's rollout
    from kvpo import sde_ar
    net = tiny(FRESH)
    noise = torch.randn(2, 4, FRAMES, 2, 2, generator=torch.Generator().manual_seed(3))
    ctx = text(1)
    whole = streaming.generate(net, noise, ctx, gens(11, 12))
    cache, g = streaming.KVCache(net.layout), gens(11, 12)
    parts = [streaming.generate(net, noise[:, :, a:a + 3], ctx, g, cache=cache) for a in (0, 3)]
    assert cache.end == FRAMES and (torch.cat(parts, 2) - whole).abs().max() < 1e-5
    whole, rec = sde_ar.generate(net, noise, ctx, [1, 4], 'sage', 0.5, gens(5, 6))
    cache, g = streaming.KVCache(net.layout), gens(5, 6)
    parts = [sde_ar.generate(net, noise[:, :, a:a + 3], ctx, [1, 4], 'sage', 0.5, g, cache=cache) for a in (0, 3)]
    assert (torch.cat([p[0] for p in parts], 2) - whole).abs().max() < 1e-5
    assert (torch.cat([p[1]['logps'] for p in parts], 2) - rec['logps']).abs().max() < 1e-4


def test_kvpo_renoises_with_the_frame_and_step_draws(monkeypatch):
    # released re-noising (fresh): every recorded step of every branch is x_0 = noise_at(seed, frame, 0) and
    # x_k = (1 - s_k) x0_{k-1} + s_k noise_at(seed, frame, k); the cache is written from (1 - c) x0 + c eps,
    # eps the draw of step S (after every denoising step's)
    net, shape, seed = tiny(FRESH), (4, 2, 2), 3
    sig, S = streaming.sigmas(FRESH), len(FRESH['timesteps'])
    ctx = text(1, n=1)
    _, traj, _ = kvpo.rollout(net, ctx, 9, shape, dict(fork=5, older=[[1, 3], [2, 4]]), seed, 1, 2, 9)
    x, x0 = traj['x'], traj['x0']  # (K, P, S, C, f, h, w)
    assert x.shape[:3] == (2, 2, S)
    for g in range(2):
        for b in range(2):
            frame = [5 + b]
            assert torch.equal(x[g, b, 0], kvpo.noise_at(seed, frame, 0, shape)[0])
            for k in range(1, S):
                want = (1 - sig[k]) * x0[g, b, k - 1] + sig[k] * kvpo.noise_at(seed, frame, k, shape)[0]
                assert (x[g, b, k] - want).abs().max() < 1e-6, (g, b, k)
    written, real = [], streaming.forward_block
    monkeypatch.setattr(streaming, 'forward_block',
                        lambda net, x, s, c, cache, start, write=False: written.append(x) or real(net, x, s, c, cache,
                                                                                                 start, write))
    clean = torch.randn(1, 4, 1, 2, 2)
    kvpo.write_block(net, clean, ctx, streaming.KVCache(FRESH), 6, seed, context_noise=0.1)
    assert torch.allclose(written[0], 0.9 * clean + 0.1 * kvpo.noise_at(seed, [6], S, shape), atol=1e-7)
