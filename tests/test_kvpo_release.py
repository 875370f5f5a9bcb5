"""
KVPO's released choices beyond its method (issue 58; kvpo/segments.py, kvpo/optim.py, kvpo/kvpo.py), each
against a reference written here. python -m pytest tests/test_kvpo_release.py
- the global reward: for every eligible fork of kvpo/config/longlive.py's layout a scored global clip lies
  after it (one a prompt segment, at hand-computed frames, each scored with its segment's prompt, the local
  clip with the fork's); the one clip in the middle missed 5 of the 12;
- the prompt segments: a rollout switching prompt at a frame is streaming.generate continued from the same
  cache with its text keys dropped (recomputed from the new prompt), the frames before the switch untouched;
- the TVE span: from the fork to the end of its chunk records 6 blocks at fork 21 (the 5 routed ones the
  same); with segments switching inside the span and the cache written with context noise, a branch
  routed as the window replays to a TVE of 0 (the replay writes its cache and switches as the rollout did);
- the cache is written from (1 - s) x0 + s eps at timestep 0; s in longlive.py is the release's grid's
  sigma at timestep 0 (1000 steps, shift 5, computed here);
- the release's routing reads against a brute-force emulation of its ring buffer and slot arithmetic
  (fork 39 plans 21-25 and reads 24-28; forks 21 and 24 read what they plan);
- the schedule against diffusers' own get_constant_schedule_with_warmup stepped every 2 rollouts;
- LongLive's LoRA loaded into a rank-256 alpha-256 adapter on the 10 Linear layers of each block: exactly
  those trainable, the forward equal to peft's own LoRA loaded with peft's set_peft_model_state_dict and to
  the merged weights, and it keeps training; in bf16 AdamW's step of lr 1e-5 rounds away (8-bit mantissa);
- at a prompt switch the last window of frames' keys and values re-cached under the new prompt equal a brute-force
  forward of diffusers' stock model (the sink's old keys spliced in, the released window counted from the pass's
  end); a rollout re-caches at each switch as streaming.generate continued from caches re-cached by hand, and the
  replay as the rollout; a prompt file's line is a video's prompts (`0,[p1],[p2],...`, as KVPO's);
- the released choices together run the toy loop (lr 0 in the first step; a story a line, re-cached at its switch).
"""
import os
import runpy
import sys

import pytest
import torch

from kvpo import kvpo, optim, segments
import streaming
from streaming import toy_ar
from test_kvpo import SHAPE, text, tiny

LONGLIVE = os.path.join(os.path.dirname(__file__), '..', 'kvpo', 'config', 'longlive.py')


def longlive():
    """kvpo/config/longlive.py's settings."""
    out = {}
    exec(open(LONGLIVE).read(), {}, out)
    return out


# ----------------------------------------------------------------------------- the global reward, the segments
def test_every_eligible_fork_has_a_global_clip_after_it():
    c, L = longlive(), streaming.LAYOUT
    forks = kvpo.eligible_forks(c['frames'], L, c['m_nearest'], c['perturb_blocks'], c['cache_frames'],
                                c['chunk_first'], c['chunk_then'], c['within_chunks'])
    assert forks == [21, 24, 39, 42, 57, 60, 75, 78, 93, 96, 111, 114]
    clips = segments.global_clips(c['frames'], c['switch_frames'], c['global_clip'])
    # segments [0, 39), [39, 75), [75, 111), [111, 147): centres 19, 57, 93, 129, 9 frames around each
    assert clips == [(15, 24), (53, 62), (89, 98), (125, 134)]
    assert all(any(lo >= f for lo, hi in clips) for f in forks)
    one = segments.global_clips(c['frames'], (), c['global_clip'])  # one segment: the middle clip
    assert one == [(69, 78)] and [f for f in forks if f >= 69] == [75, 78, 93, 96, 111, 114]
    assert segments.bounds(147, (39, 75, 111)) == [(0, 39), (39, 75), (75, 111), (111, 147)]
    assert [segments.segment_of(f, (39, 75, 111)) for f in (0, 38, 39, 74, 75, 146)] == [0, 0, 1, 1, 2, 3]
    # what the loop scores: the fork's chunk with its segment's prompt, each segment's clip with its own
    got = segments.scored_clips(147, (39, 75, 111), 9, ['p0', 'p1', 'p2', 'p3'], 78, (75, 93))
    assert got == {'local': [(75, 93, 'p2')],
                   'global': [(15, 24, 'p0'), (53, 62, 'p1'), (89, 98, 'p2'), (125, 134, 'p3')]}


def test_a_prompt_switch_replaces_the_text_keys():
    L = toy_ar.LAYOUT  # ODE re-noising: the anchor is streaming.generate's clip from the same noise
    net, c0, c1 = tiny(L, 1), text(1), text(2)
    noise = kvpo.noise_at(1, range(9), 0, SHAPE)
    for switch, fork in ((3, 5), (5, 5), (7, 5)):  # before the fork, at it, inside the routed blocks
        clips, _, _ = kvpo.rollout(net, [(0, c0), (switch, c1)], 9, SHAPE, dict(fork=fork, older=[[1, 2]]), 1, 1, 2, 9)
        cache = streaming.KVCache(L, keep=9)
        a = streaming.generate(net, noise[:, :, :switch], c0, cache=cache)
        cache.text = {}  # LongLive's switch: the cross-attention cache emptied, refilled from the new prompt
        b = streaming.generate(net, noise[:, :, switch:], c1, cache=cache)
        assert torch.allclose(clips[-1:], torch.cat([a, b], 2), atol=1e-6)
        one, _, _ = kvpo.rollout(net, c0, 9, SHAPE, dict(fork=fork, older=[[1, 2]]), 1, 1, 2, 9)
        assert torch.equal(one[:, :, :switch], clips[:, :, :switch])
        assert not torch.allclose(one[:, :, switch:], clips[:, :, switch:], atol=1e-3)


# ----------------------------------------------------------------------------- the re-cache at a switch
def rotate(x, cos, sin):
    """RoPE as diffusers' WanAttnProcessor applies it (interleaved pairs), on x (B, S, H, D)."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[..., 0::2], sin[..., 1::2]
    return torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], -1).flatten(-2)


def brute_recache(ref, x0, text_old, text_new, switch, window=12, sink=3):
    """The re-cached keys and values of the frames [switch - window, switch) as the release computes them
    (recache_after_switch with a global sink), by diffusers' stock model: {layer: (k (B, n, T, H, D), v)}.
    First the sink alone at timestep 0 under the old prompt (what its block wrote: it saw itself); then one
    forward over frames [0, switch) at timestep 0 under the new prompt, each recached frame seeing the sink and
    the last window - sink frames (the released window counts from the pass's end), the sink's keys and values
    spliced in from the first forward at every layer (hooks on each self-attention's norm_k and to_v)."""
    from test_wan_causal import Masked
    B, C, F, h, w = x0.shape
    T, lo = h // 2 * (w // 2), switch - window
    captured, hooks = {}, []

    def run(x, text, splice):
        outs = {}
        for i, b in enumerate(ref.blocks):
            for name in ('norm_k', 'to_v'):
                def hook(mod, args, out, i=i, name=name):
                    if splice is not None:  # the sink's rows as the first forward computed them
                        out = torch.cat([splice[i, name], out[:, sink * T:]], 1)
                    outs[i, name] = out
                    return out
                hooks.append(getattr(b.attn1, name).register_forward_hook(hook))
        with torch.no_grad():
            ref(hidden_states=x, timestep=torch.zeros(B, x.shape[2] * T), encoder_hidden_states=text, return_dict=False)
        for hk in hooks:
            hk.remove()
        hooks.clear()
        return outs

    for b in ref.blocks:
        b.attn1.processor = Masked()
    sees = torch.ones(sink, sink, dtype=torch.bool)
    for b in ref.blocks:
        b.attn1.processor.mask = sees.repeat_interleave(T, 0).repeat_interleave(T, 1)[None, None]
    first = run(x0[:, :, :sink], text_old, None)  # the sink block at timestep 0, old prompt
    i = torch.arange(switch)
    rows = (i >= lo)[:, None]
    sees = (rows & ((i[None] < sink) | (i[None] >= switch - (window - sink)))) | (~rows & (i[None] == i[:, None]))
    for b in ref.blocks:
        b.attn1.processor.mask = sees.repeat_interleave(T, 0).repeat_interleave(T, 1)[None, None]
    x = torch.cat([x0[:, :, :sink], torch.zeros(B, C, lo - sink, h, w), x0[:, :, lo:switch]], 2)  # between: unseen
    second = run(x, text_new, first)
    cos, sin = ref.rope(x)
    for layer in range(len(ref.blocks)):
        k, v = (second[layer, n].unflatten(2, (ref.blocks[layer].attn1.heads, -1)) for n in ('norm_k', 'to_v'))
        k = rotate(k, cos, sin)
        captured[layer] = tuple(t[:, lo * T:].unflatten(1, (window, T)) for t in (k, v))
    return captured


def test_recache_equals_a_brute_force_forward_under_the_new_prompt():
    from test_wan_causal import tiny_pair
    L = streaming.LAYOUT  # LongLive's: blocks of 3, sink 3, window 12
    net, ref = tiny_pair(L)
    g = torch.Generator().manual_seed(3)
    noise, old, new = torch.randn(1, 4, 24, 4, 4, generator=g), torch.randn(1, 5, 16, generator=g), \
        torch.randn(1, 5, 16, generator=g)
    cache = streaming.KVCache(L, keep=33)  # KVPO's cache: every frame of 24
    gens = lambda: [torch.Generator().manual_seed(7)]  # the re-noising draws
    x0 = streaming.generate(net, noise, old, gens(), cache=cache)
    before = cache.read_frames(list(range(24)))
    segments.switch(net, cache, new, 24, x0)
    want, got = brute_recache(ref, x0, old, new, 24), cache.read_frames(list(range(12, 24)))
    for layer, (k, v) in want.items():
        scale = k.abs().max()
        assert (got[layer][0] - k).abs().max() < 1e-5 * scale and (got[layer][1] - v).abs().max() < 1e-5 * v.abs().max()
        # the first layer's keys come before any cross-attention: the prompt and the pass change the later ones
        assert torch.allclose(got[layer][0], before[layer][0][:, 12:], atol=1e-6) == (layer == 0)
        for f in range(12):  # the sink (global: the first prompt's) and the frames before the window: untouched
            assert torch.equal(cache.read_frames([f])[layer][0], before[layer][0][:, f:f + 1])
    # the text keys are the new prompt's either way; without the re-cache (switch_recache=False) only they change
    again = streaming.KVCache(L, keep=33)
    streaming.generate(net, noise, old, gens(), cache=again)
    segments.switch(net, again, new, 24, None)  # the text keys only (switch_recache=False)
    assert all(torch.equal(a, b) for l in cache.text for a, b in zip(cache.text[l], again.text[l]))
    assert all(torch.equal(again.read_frames([f])[l][0], before[l][0][:, f:f + 1]) for l in before for f in range(24))


def test_rollout_and_replay_recache_at_each_switch():
    # the toy's layout (sink 1, window 4): a rollout with recache is streaming.generate continued from caches
    # re-cached by segments.switch from its own frames; a branch routed as the window replays to a TVE of 0
    L = toy_ar.LAYOUT
    net, c0, c1, c2 = tiny(L, 1), text(1), text(2), text(3)
    ctx, noise = [(0, c0), (5, c1), (7, c2)], kvpo.noise_at(1, range(9), 0, SHAPE)
    routing = dict(fork=5, older=[[3, 4], [1, 2]])
    clips, traj, state = kvpo.rollout(net, ctx, 9, SHAPE, routing, 1, 1, 1, 9, span_end=9, recache=True)
    cache = streaming.KVCache(L, keep=9)
    a = streaming.generate(net, noise[:, :, :5], c0, cache=cache)
    segments.switch(net, cache, c1, 5, a)
    b = streaming.generate(net, noise[:, :, 5:7], c1, cache=cache)
    segments.switch(net, cache, c2, 7, torch.cat([a, b], 2))
    c = streaming.generate(net, noise[:, :, 7:], c2, cache=cache)
    assert torch.allclose(clips[-1:], torch.cat([a, b, c], 2), atol=1e-6)
    plain, _, _ = kvpo.rollout(net, ctx, 9, SHAPE, routing, 1, 1, 1, 9, span_end=9)  # the text keys only
    assert torch.equal(plain[:, :, :5], clips[:, :, :5])
    assert not torch.allclose(plain[:, :, 5:], clips[:, :, 5:], atol=1e-4)
    assert torch.equal(traj['past'], clips[-1:, :, 1:5])  # the last window before the fork
    s = kvpo.scores(net, ctx, state, 5, traj, 9, grad_steps=0)  # the replay re-caches as the rollout did
    assert torch.equal(clips[0], clips[2]) and abs(s[0].item()) < 1e-10 and s[1].item() < -1e-6
    no = kvpo.tve(net, ctx, state, 5, traj['x'][0], traj['x0'][0], 9)  # replayed without the re-cache
    assert no.item() < -1e-8


def test_prompt_lines_are_stories():
    lines = ['0,[a red ball rolls],[it stops],[it turns blue],[it rises]', '[one],[two]',
             '7,[p1],[p2],[p3],[p4],[p5]', 'a plain prompt, with a comma']
    assert segments.stories(lines, 4) == [['a red ball rolls', 'it stops', 'it turns blue', 'it rises'],
                                          ['p1', 'p2', 'p3', 'p4']]  # fewer skipped, more truncated
    assert segments.stories(lines, 1)[-1] == ['a plain prompt, with a comma']  # one segment: a line is a prompt
    with pytest.raises(SystemExit, match='no prompt line holds 4 prompts'):
        segments.stories(['x', '[a],[b]'], 4)


# ----------------------------------------------------------------------------- TVE span, context noise
def test_tve_span_to_the_end_of_the_chunk():
    L = dict(streaming.LAYOUT)
    net, ctx = tiny(L), text()
    routing = dict(fork=21, older=[[3, 5, 7, 9, 11], [4, 6, 8, 10, 12]])  # pool [3, 17) at fork 21
    clips, chunk, _ = kvpo.rollout(net, ctx, 39, SHAPE, routing, 0, 4, 5, 33, span_end=39)
    _, routed, _ = kvpo.rollout(net, ctx, 39, SHAPE, routing, 0, 4, 5, 33)
    assert chunk['x'].shape[:3] == (2, 6, 4) and routed['x'].shape[:3] == (2, 5, 4)  # chunk [21, 39): 6 blocks
    assert torch.equal(chunk['x'][:, :5], routed['x']) and torch.equal(chunk['x0'][:, :5], routed['x0'])
    assert torch.equal(chunk['x0'][:, 5, -1], clips[:2, :, 36:39])  # the 6th block: the branch's own frames


def test_replay_switches_and_writes_as_the_rollout():
    # a branch routed as the window is the anchor; replayed over 4 blocks (to the chunk's end) with a switch
    # inside them and the cache written with context noise, its TVE is 0 (the replay's cache is the rollout's)
    net, c0, c1 = tiny(toy_ar.LAYOUT, 1), text(1), text(2)
    ctx, routing = [(0, c0), (7, c1)], dict(fork=5, older=[[3, 4], [1, 2]])
    clips, traj, state = kvpo.rollout(net, ctx, 9, SHAPE, routing, 1, 1, 1, 9, span_end=9, context_noise=0.05)
    assert torch.equal(clips[0], clips[2]) and traj['x'].shape[1] == 4
    s = kvpo.scores(net, ctx, state, 5, traj, 9, grad_steps=0)
    assert abs(s[0].item()) < 1e-10 and s[1].item() < -1e-6
    wrong = [kvpo.tve(net, ctx, state, 5, traj['x'][0], traj['x0'][0], 9),  # the cache written from x0
             kvpo.tve(net, c0, state, 5, traj['x'][0], traj['x0'][0], 9, context_noise=0.05, seed=1)]  # no switch
    assert all(w.item() < -1e-8 for w in wrong)


def test_cache_written_from_add_noise_at_timestep_0():
    net, ctx = tiny(toy_ar.LAYOUT, 1), text(1)
    writes, real = [], streaming.forward_block

    def spy(net_, x, s, context, cache, start, write=False):
        if write:
            writes.append((start, x.clone(), s.clone()))
        return real(net_, x, s, context, cache, start, write)
    streaming.forward_block = spy
    try:
        clips, _, _ = kvpo.rollout(net, ctx, 6, SHAPE, dict(fork=5, older=[[1, 2]]), 3, 1, 1, 6, context_noise=0.1)
    finally:
        streaming.forward_block = real
    S = len(toy_ar.LAYOUT['timesteps'])
    for start, x, s in writes[:5]:  # the prefix's blocks 0..4
        eps = kvpo.noise_at(3, [start], S, SHAPE)
        assert torch.allclose(x, 0.9 * clips[-1:, :, start:start + 1] + 0.1 * eps, atol=1e-6) and s.item() == 0
    # longlive.py's sigma: the release's FlowMatchScheduler(shift 5, sigma_min 0, extra_one_step) at
    # 1000 steps, its add_noise at timestep 0 taking the grid's nearest (last) sigma
    grid = torch.linspace(1.0, 0.0, 1001, dtype=torch.float64)[:-1]
    grid = 5 * grid / (1 + 4 * grid)
    assert longlive()['context_noise'] == pytest.approx(grid[torch.argmin((grid * 1000).abs())].item(), rel=1e-3)


# ----------------------------------------------------------------------------- the release's routing reads
class Frames:
    def __init__(self, frames):
        self.frames = frames


def release_reads(fork, older, keep=33, sink=3, block=3, m=4):
    """What the released code reads for planned frames `older` at the fork block: its ring buffer of keep
    frames (the sink pinned, then the newest keep - sink, the block itself inserted before attention),
    each frame's slot computed as sink + (f - visible start), visible start = max(sink, the block's start -
    the non-sink frames up to the buffer's end); the frame that slot holds."""
    end = fork + block
    slots = list(range(sink)) + list(range(max(sink, end - (keep - sink)), end))  # slot -> frame
    local_end = len(slots)
    start = max(sink, fork - (local_end - sink))
    return [slots[sink + f - start] for f in older if start <= f < fork - m]


def test_release_reads_against_its_ring_buffer():
    L = streaming.LAYOUT
    cached = lambda f: Frames(list(range(3)) + list(range(max(3, f + 3 - 30), f)))  # at the fork block
    planned = [21, 22, 23, 24, 25]
    assert kvpo.router(39, planned, L, 4, 5, 33, False)(cached(39), 39, 42)[3:8] == planned
    assert kvpo.router(39, planned, L, 4, 5, 33, True)(cached(39), 39, 42)[3:8] == [24, 25, 26, 27, 28]
    c = longlive()
    forks = kvpo.eligible_forks(c['frames'], L, 4, 5, 33, 21, 18, 7)
    for seed in range(12):
        p = kvpo.plan(c['frames'], L, 8, 4, 5, 33, seed, 21, 18, 7)
        f = p['fork']
        for older in p['older']:
            got = kvpo.router(f, older, L, 4, 5, 33, True)(cached(f), f, f + 3)[3:8]
            assert got == release_reads(f, older) and (got == older) == (f in (21, 24))
    assert [f for f in forks if release_reads(f, [f - 5]) == [f - 5]] == [21, 24]  # forks 21 and 24 escape


# ----------------------------------------------------------------------------- the schedule
def test_schedule_is_diffusers_constant_with_warmup_per_two_rollouts():
    from diffusers.optimization import get_constant_schedule_with_warmup
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-5)
    sched = get_constant_schedule_with_warmup(opt, num_warmup_steps=5)
    for it in range(30):
        assert optim.lr_at(it, 1e-5, 5, 2) == pytest.approx(opt.param_groups[0]['lr'], abs=1e-20)
        if it % 2 == 1:  # an accumulation boundary: the released trainer steps its scheduler
            opt.step()  # (no gradient: nothing moves) before the scheduler's step, as torch wants
            sched.step()
    assert [optim.lr_at(it, 1e-5, 5, 2) for it in (0, 1, 9, 10)] == [0, 0, pytest.approx(8e-6), 1e-5]
    assert [optim.lr_at(it, 1e-4, 5, 2, 'per_rollout') for it in (0, 4, 9)] == [pytest.approx(2e-5), 1e-4, 1e-4]


# ----------------------------------------------------------------------------- the adapter, bf16
@pytest.fixture(scope='module')
def lora_model(tmp_path_factory):
    """A tiny causal Wan directory with a LoRA of rank 256 on all 10 Linear of each block, written as
    LongLive writes it ({'generator_lora': peft keys in the original Wan names}); its pairs by diffusers name."""
    import json
    from tiny_wan_causal import make_tiny_causal, original_name
    root = str(tmp_path_factory.mktemp('lora'))
    path, sd = make_tiny_causal(root)
    g, pairs, file = torch.Generator().manual_seed(0), {}, {}
    for k, w in sd.items():
        if k.endswith('.weight') and w.dim() == 2 and k.startswith('blocks.'):  # the blocks' Linear layers
            mod = k[:-len('.weight')]
            A, B = 0.05 * torch.randn(256, w.shape[1], generator=g), 0.05 * torch.randn(w.shape[0], 256, generator=g)
            pairs[mod] = (A, B)
            for part, t in (('lora_A', A), ('lora_B', B)):
                file[f'base_model.model.{original_name(k)[:-len(".weight")]}.{part}.weight'] = t
    torch.save({'generator_lora': file, 'step': 0}, os.path.join(root, 'lora.pt'))
    index = os.path.join(path, 'model_index.json')
    json.dump({**json.load(open(index)), 'lora': os.path.join(root, 'lora.pt')}, open(index, 'w'))
    return path, sd, pairs


def forward(net, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, ctx = torch.randn(1, 16, 3, 4, 4, generator=g), torch.randn(1, 5, 16, generator=g)
    return streaming.forward_masked(net, x, torch.full((1, 3), 0.7), ctx, range(3), torch.ones(3, 3, dtype=torch.bool))


def test_checkpoint_lora_is_peft_lora_on_every_linear_and_trains(lora_model):
    from peft import LoraConfig, inject_adapter_in_model, set_peft_model_state_dict
    from diffusers import WanTransformer3DModel
    from streaming import wan_causal
    path, sd, pairs = lora_model
    assert len(pairs) == 10 * 3  # 10 Linear a block, 3 blocks
    net = optim.load_generator(path, 'cpu', 256, 'checkpoint', 'float32')
    trained = {n for n, p in net.named_parameters() if p.requires_grad}
    assert trained == {f'{m}.{ab}.default.weight' for m in pairs for ab in ('lora_A', 'lora_B')}
    # peft's own: the base weights, an adapter injected on the same modules, the pairs set by peft
    index = wan_causal._index(path)
    ref = wan_causal.build(WanTransformer3DModel.load_config(index['wan'], subfolder='transformer'), net.layout)
    ref.load_state_dict(sd, assign=True)
    with torch.no_grad():
        v_base = forward(ref)  # no adapter
    inject_adapter_in_model(LoraConfig(r=256, lora_alpha=256, target_modules=list(pairs)), ref)
    set_peft_model_state_dict(ref, {f'{m}.{ab}.weight': t for m, (A, B) in pairs.items()
                                    for ab, t in (('lora_A', A), ('lora_B', B))})
    merged = wan_causal.load_transformer(path)  # the LoRA merged: W + B A
    with torch.no_grad():
        v, v_ref, v_merged = forward(net), forward(ref), forward(merged)
    assert torch.allclose(v, v_ref, atol=1e-5) and torch.allclose(v, v_merged, atol=1e-4)
    assert not torch.allclose(v, v_base, atol=1e-3)  # the adapter acts
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-3)
    forward(net).square().mean().backward()
    opt.step()
    moved = {n for n, p in net.named_parameters() if not torch.equal(p, before[n])}
    assert moved == trained


def test_bf16_training_rounds_away_small_steps(lora_model):
    path, _, _ = lora_model
    for dtype in ('bfloat16', 'float32'):
        net = optim.load_generator(path, 'cpu', 256, 'checkpoint', dtype)
        trained = [p for p in net.parameters() if p.requires_grad]
        assert all(p.dtype == getattr(torch, dtype) for p in trained)
        with optim.precision('cpu', dtype):  # the loop's forwards: fp32 inputs, bf16 weights under autocast
            forward(net).float().square().mean().backward()
        assert all(p.grad is not None and p.grad.dtype == p.dtype and p.grad.abs().sum() > 0 for p in trained)
        opt = torch.optim.AdamW(trained, lr=1e-5, weight_decay=0.0)
        before = [p.detach().clone() for p in trained]
        for p in trained:
            p.grad = torch.ones_like(p)
        opt.step()  # Adam's first step: each weight moves by lr (m / sqrt(v) = 1)
        assert all(s.dtype == getattr(torch, dtype) for st in opt.state.values() for s in (st['exp_avg'],))
        w = torch.cat([p.detach().float().flatten() for p in trained])
        b = torch.cat([p.float().flatten() for p in before])
        big = b.abs() >= 2 ** -6  # a bf16 ulp there is >= 2^-13 = 1.2e-4: a step of 1e-5 rounds back
        if dtype == 'bfloat16':
            assert torch.equal(w[big], b[big]) and big.sum() > 1000
        else:
            assert torch.allclose(b - w, torch.full_like(w, 1e-5), rtol=1e-2, atol=1e-9)


# ----------------------------------------------------------------------------- the loop
@pytest.mark.slow  # the whole loop with every released choice on (~40 s): each choice has its own fast test above
def test_released_choices_run_the_toy_loop(tmp_path, monkeypatch):
    from test_train import metrics
    out, held, story = str(tmp_path / 'run'), str(tmp_path / 'eval.txt'), str(tmp_path / 'story.txt')
    with open('assets/toy/eval_prompts.txt') as f:  # one held-out prompt: an evaluation in seconds
        open(held, 'w').write(f.readline())
    open(story, 'w').write(''.join(open('prompts/toy_stories.txt').readlines()[:3]))  # the story toy's 4 segments
    monkeypatch.setattr(sys, 'argv', [
        'kvpo.train', 'kvpo/config/toy.py', 'kvpo/config/toy_story.py', '--prompts_per_iter=2', '--group=3',
        '--max_iters=1', '--eval_every=1', '--save_every=0', f'--out_dir={out}', f'--eval_prompts={held}',
        '--eval_stories=', '--tve_span=chunk', '--switch_recache=True',
        f'--train_prompts={story}',  # a story a line, re-cached at each switch: kvpo/train.py's defaults
        '--context_noise=0.005', '--lr_schedule=constant_with_warmup', '--train_dtype=bfloat16',
        '--release_reads=True'])
    g = runpy.run_module('kvpo.train', run_name='__main__')
    rows = metrics(out)
    (row,) = [r for r in rows if 'loss' in r]
    assert row['lr'] == 0 and row['grad_norm'] > 0 and row['loss'] == row['loss']
    assert [r['iter'] for r in rows if 'eval_composite' in r] == [0, 1]  # the bf16 weights evaluated
    assert g['switch_recache'] and all(p in segments.stories(open(story).readlines(), 4) for _, p in g['my_prompts'](0))
    # the trained weights in bf16 (but diffusers' fp32 modules: the norms, the time embedding), their EMA in fp32
    keep = toy_ar.ToyARTransformer._keep_in_fp32_modules
    assert all((p.dtype == torch.float32) == any(k in n for k in keep) for n, p in g['trained'])
    assert all(g['ema_p'][n].dtype == torch.float32 for n, _ in g['trained'])  # as released
