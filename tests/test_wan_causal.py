"""
Streaming Wan (streaming/__init__.py, streaming/wan_causal.py). python -m pytest tests/test_wan_causal.py
- generation block by block from the KV cache equals, block by block and step by step, one forward of
  diffusers' stock WanTransformer3DModel (its own WanAttnProcessor and RoPE) over the whole prefix with a
  block-causal mask written here, inside the window and past it (frames dropped, the sink kept); the
  released layout (blocks of 3, sink 3, window 12, 21 latent frames) and a 1-frame one, with fresh noise
  between steps (released) and with Euler steps of the ODE (the toy's);
- the teacher-forced sequence (clean frames, then noisy ones) the toy trains on equals the cache;
- the cache's save/restore and read/replace of chosen frames;
- original Wan key names (written by hand in tiny_wan_causal.py) convert to diffusers' and round-trip,
  a LoRA merges as W + B A; a corrupt, partial or mismatched checkpoint is one SystemExit naming it,
  before a directory is written or a weight is used;
- 2 FSDP2 ranks (gloo, torchrun, tests/wan_causal_fsdp_worker.py) generate what 1 process does.
"""
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from diffusers import WanTransformer3DModel
from diffusers.models.transformers.transformer_wan import WanAttnProcessor

from models import family
import streaming
from streaming import wan_causal

sys.path.insert(0, os.path.dirname(__file__))
from tiny_wan_causal import inputs, make_tiny_causal, original_name  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
              text_dim=16, freq_dim=16, ffn_dim=32, num_layers=3, rope_max_seq_len=32)
SMALL = dict(block=1, sink=1, window=3, timesteps=(1000, 750, 500, 250), shift=5.0)


def tiny_pair(layout, seed=0):
    """The same random weights as a causal model and as diffusers' stock model."""
    torch.manual_seed(seed)
    ref = WanTransformer3DModel(**CONFIG).eval()
    for p in ref.parameters():
        p.data += 0.05 * torch.randn_like(p)  # modulation tables and biases away from their init
    net = WanTransformer3DModel(**CONFIG).eval()
    net.load_state_dict(ref.state_dict())
    return streaming.install(net, layout), ref


class Masked(WanAttnProcessor):
    """diffusers' own processor, given a mask (its block never passes one to the self-attention)."""
    mask = None

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        return super().__call__(attn, hidden_states, encoder_hidden_states, self.mask, rotary_emb)


def brute_force(ref, noise, text, layout, seeds):
    """The reference sampler: each block's every step is one stock forward over frames [0, end) (earlier
    blocks' clean latents at timestep 0, this block's noisy ones) with query frame i seeing key frame j iff
    j's block <= i's block and j is a sink frame or among the window - sink frames up to i's block's end."""
    procs = [Masked() for _ in ref.blocks]
    for b, p in zip(ref.blocks, procs):
        b.attn1.processor = p
    B, F, T = noise.shape[0], noise.shape[2], noise.shape[3] // 2 * (noise.shape[4] // 2)
    s = torch.tensor(layout['timesteps'], dtype=torch.float64) / 1000
    sig = (layout['shift'] * s / (1 + (layout['shift'] - 1) * s)).tolist()
    gens = [torch.Generator().manual_seed(x) for x in seeds]
    done = []
    for start in range(0, F, layout['block']):
        end = start + layout['block']
        i = torch.arange(end)
        blk, blk_end = i // layout['block'], (i // layout['block'] + 1) * layout['block']
        sees = (blk[None] <= blk[:, None]) & ((i[None] < layout['sink']) |
                                              (i[None] >= blk_end[:, None] - (layout['window'] - layout['sink'])))
        for p in procs:
            p.mask = sees.repeat_interleave(T, 0).repeat_interleave(T, 1)[None, None]
        x = noise[:, :, start:end]
        for k, sk in enumerate(sig):
            t = torch.cat([torch.zeros(B, start * T), torch.full((B, (end - start) * T), 1000 * sk)], 1)
            with torch.no_grad():
                v = ref(hidden_states=torch.cat(done + [x], 2), timestep=t, encoder_hidden_states=text,
                        return_dict=False)[0][:, :, start:end]
            x0 = x - sk * v
            if k + 1 < len(sig):  # fresh noise (released), or the step's own noise x - x0 over sigma ('ode')
                z = torch.stack([torch.randn(x0.shape[1:], generator=g) for g in gens]) \
                    if layout.get('renoise', 'fresh') == 'fresh' else (x - (1 - sk) * x0) / sk
                x = (1 - sig[k + 1]) * x0 + sig[k + 1] * z
        done.append(x0)
    return torch.cat(done, 2)


@pytest.mark.parametrize('layout,frames', [(streaming.LAYOUT, 21), (SMALL, 7), ({**SMALL, 'renoise': 'ode'}, 7)],
                         ids=['released', 'one_frame_blocks', 'ode_steps'])
def test_stream_equals_masked_full_forward(layout, frames):
    net, ref = tiny_pair(layout)
    noise = torch.randn(2, 4, frames, 4, 4, generator=torch.Generator().manual_seed(1))
    text = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(2))
    seen = []
    x = streaming.generate(net, noise, text, [torch.Generator().manual_seed(s) for s in (7, 8)],
                           on_block=lambda start, x0, cache: seen.append(cache.frames))
    want = brute_force(ref, noise, text, layout, (7, 8))
    assert (x - want).abs().max() < 1e-5 * want.abs().max(), (x - want).abs().max()
    # past the window: the cache dropped frames between the sink and the window, kept the sink
    assert seen[-1][:layout['sink']] == list(range(layout['sink']))
    assert seen[-1][layout['sink']] > layout['sink'] and len(seen[-1]) == layout['window'] - layout['block']


def test_rope_at_is_diffusers_rope():
    net, _ = tiny_pair(SMALL)
    x = torch.zeros(1, 4, 6, 4, 6)
    cos, sin = net.rope(x)
    cos2, sin2 = streaming.rope_at(net.rope, range(6), 2, 3)
    assert torch.equal(cos, cos2) and torch.equal(sin, sin2)


def test_teacher_forcing_equals_cache():
    net, _ = tiny_pair(SMALL)
    B, n = 2, 7
    x0, noise = torch.randn(2, B, 4, n, 4, 4, generator=torch.Generator().manual_seed(3))
    s = torch.rand(B, n, generator=torch.Generator().manual_seed(4))
    xt = (1 - s[:, None, :, None, None]) * x0 + s[:, None, :, None, None] * noise
    text = torch.randn(B, 5, 16)
    with torch.no_grad():
        v = streaming.forward_masked(net, torch.cat([x0, xt], 2), torch.cat([torch.zeros(B, n), s], 1), text,
                                     list(range(n)) * 2, streaming.teacher_mask(n, SMALL))
        cache = streaming.KVCache(SMALL)
        for b in range(n):
            vb = streaming.forward_block(net, xt[:, :, b:b + 1], s[:, b], text, cache, b)
            vc = streaming.forward_block(net, x0[:, :, b:b + 1], torch.zeros(B), text, cache, b, write=True)
            assert (vb - v[:, :, n + b:n + b + 1]).abs().max() < 1e-5 and (vc - v[:, :, b:b + 1]).abs().max() < 1e-5


def test_cache_save_restore_read_replace():
    net, _ = tiny_pair(SMALL)
    text, noise = torch.randn(1, 5, 16), torch.randn(1, 4, 7, 4, 4)
    cache = streaming.KVCache(SMALL, keep=6)  # keeps older frames than the window (a router's pool)
    streaming.generate(net, noise[:, :, :4], text, cache=cache)
    assert cache.frames == [0, 1, 2, 3] and cache.select(4, 5) == [0, 3]  # sink + the window's recent frame
    state = cache.save()
    g = lambda: [torch.Generator().manual_seed(0)]  # the re-noising draws
    nxt = streaming.generate(net, noise[:, :, 4:5], text, g(), cache=cache)  # writes frame 4
    kv = cache.read_frames([1, 2])
    cache.replace_frames([1, 2], {l: (k * 0, v * 0) for l, (k, v) in kv.items()})
    assert all((cache.read_frames([1])[l][0] == 0).all() for l in kv) and cache.frames == [0, 1, 2, 3, 4]
    cache.restore(state)
    assert cache.frames == [0, 1, 2, 3] and all(torch.equal(cache.read_frames([1, 2])[l][0], kv[l][0]) for l in kv)
    assert torch.equal(streaming.generate(net, noise[:, :, 4:5], text, g(), cache=cache), nxt)  # as before
    cache.restore(state)
    cache.route = lambda c, start, end: [0, 1]  # attend to frame 1, out of the window: another block
    assert not torch.allclose(streaming.generate(net, noise[:, :, 4:5], text, g(), cache=cache), nxt)


def test_key_conversion_round_trip(tmp_path):
    path, sd = make_tiny_causal(str(tmp_path), layout=SMALL)
    fam = family(path)
    assert fam is wan_causal
    net = fam.load_transformer(path)
    assert set(net.state_dict()) == set(sd) and all(torch.equal(net.state_dict()[k], sd[k]) for k in sd)
    from models import family_of
    assert family_of(net) is wan_causal and net.layout == SMALL
    # a LoRA as LongLive saves it (peft names over the original modules), merged as W + alpha / r B A
    A, B = torch.randn(4, 24), torch.randn(24, 4)
    lora = os.path.join(str(tmp_path), 'lora.pt')
    torch.save({'generator_lora': {'base_model.model.blocks.1.self_attn.q.lora_A.weight': A,
                                   'base_model.model.blocks.1.self_attn.q.lora_B.weight': B}}, lora)
    index = os.path.join(path, 'model_index.json')
    json.dump({**json.load(open(index)), 'lora': os.path.abspath(lora), 'lora_alpha': 8}, open(index, 'w'))
    merged = fam.load_transformer(path).state_dict()
    assert torch.allclose(merged['blocks.1.attn1.to_q.weight'], sd['blocks.1.attn1.to_q.weight'] + 2 * B @ A, atol=1e-6)
    assert torch.equal(merged['blocks.1.attn1.to_k.weight'], sd['blocks.1.attn1.to_k.weight'])
    # the family end to end: text encoder, generation, decoder
    text = fam.text_encoder(path, 'cpu')(['a red circle moving left'])
    shape = fam.latent_shape(path, 9, 16, 16)
    x = fam.generate(net, torch.randn(1, *shape), text)
    assert fam.load_decoder(path, 'cpu')(x).shape == (1, 9, 3, 16, 16)


def test_refuses_corrupt_or_partial(tmp_path):
    path, sd = make_tiny_causal(str(tmp_path))
    wan = os.path.join(str(tmp_path), 'wan')
    good = {'model.' + original_name(k): v for k, v in sd.items()}
    cases = {'truncated': None, 'partial': dict(list(good.items())[1:]),
             'shape': {**good, 'model.blocks.0.ffn.0.weight': torch.zeros(3, 3)},
             'extra': {**good, 'model.blocks.9.self_attn.q.weight': torch.zeros(24, 24)}}
    said = {'truncated': 'not a readable checkpoint', 'partial': f'1 keys missing .* e.g. {list(sd)[0]}',
            'shape': re.escape('blocks.0.ffn.net.0.proj.weight (3, 3)'), 'extra': '1 keys unexpected .* blocks.9.attn1.to_q'}
    for name, state in cases.items():
        file = os.path.join(str(tmp_path), f'{name}.pt')
        if state is None:
            torch.save({'generator': good}, file)
            open(file, 'r+b').truncate(os.path.getsize(file) // 2)
        else:
            torch.save({'generator': state}, file)
        out = os.path.join(str(tmp_path), f'out_{name}')
        with pytest.raises(SystemExit, match=said[name]):
            wan_causal.make(out, wan, file)
        assert not os.path.exists(out)  # refused before anything was written
        index = os.path.join(path, 'model_index.json')  # and at load, before any weight is used
        json.dump({**json.load(open(index)), 'generator': file}, open(index, 'w'))
        with pytest.raises(SystemExit, match=said[name]):
            wan_causal.load_transformer(path)


@pytest.mark.slow  # ~35 s: torchrun, 2 processes importing diffusers
def test_fsdp_two_ranks_equal_one_process(tmp_path):
    path, _ = make_tiny_causal(str(tmp_path), layout=SMALL)
    env = dict(os.environ, OMP_NUM_THREADS='1', PYTHONPATH=ROOT)
    cmd = [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2',
           os.path.join(ROOT, 'tests', 'wan_causal_fsdp_worker.py'), path, str(tmp_path)]
    run = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f'rc {run.returncode}\n{run.stdout[-2000:]}\n{run.stderr[-3000:]}'
    from models.policy import load_policy
    net = load_policy(path, 'cpu')
    x = wan_causal.generate(net, *inputs(path))
    for r in range(2):
        got = torch.load(os.path.join(str(tmp_path), f'rank{r}.pt'))
        assert (got - x).abs().max() < 1e-5, (r, (got - x).abs().max())

