"""
Each streaming model sampled as its own inference code samples it (streaming/__init__.py LAYOUTS,
streaming/wan_causal.py --layout). python -m pytest tests/test_layouts.py
- for LongLive, Self-Forcing and CausVid, generation from the KV cache (streaming.generate with the layout
  the conversion records) equals a brute-force sampler written here from the released code's rules: per block
  and step one forward of diffusers' stock WanTransformer3DModel over every frame so far, under a frame mask
  built here (LongLive: the sink 3 and the last 9 frames up to the block's end; Self-Forcing and CausVid:
  every frame of an earlier block), the model called at the released timestep and the block re-noised at
  the released sigma, both looked up on the released schedulers' 1000-point shifted grid (LongLive and
  Self-Forcing: the warp timesteps[1000 - t] at shift 5; CausVid: t itself, sigma the shift-8 grid's point
  nearest t); 21 latent frames, past LongLive's window;
- the converted directory records the layout (--layout, or recognised from the files' names) and the family
  samples with it; MemFlow is refused in one line and nothing is written; an unnamed file needs --layout;
- Self-Forcing and CausVid refuse more latent frames than their released cache holds (21);
- a Self-Forcing checkpoint holding 'generator' and 'generator_ema' (different) samples the EMA weights, as its
  inference.py --use_ema and demo.py do (LongLive and CausVid: 'generator'; --key overrides); without
  --num_frames LongLive makes its inference yaml's 120 latent frames, Self-Forcing and CausVid 21;
- kvpo refuses a global layout with one line (its routing needs a window).
"""
import json
import os
import shutil
import sys

import pytest
import torch

import streaming
from streaming import wan_causal

sys.path.insert(0, os.path.dirname(__file__))
from test_wan_causal import Masked, tiny_pair  # noqa: E402
from tiny_wan_causal import make_tiny_causal  # noqa: E402

FRAMES = 21  # latent frames: 7 blocks of 3; LongLive's window drops frames 3-5 from the fifth block on


def grid(shift):
    """The released schedulers' grid: sigmas linspace(1, 0, 1001)[:-1] shifted, timesteps 1000 sigma."""
    s = torch.linspace(1, 0, 1001, dtype=torch.float64)[:-1]
    s = shift * s / (1 + (shift - 1) * s)
    return s, 1000 * s


def released_steps(name):
    """[(the model's timestep, sigma)] as the released pipelines compute them (not as streaming.py does)."""
    if name == 'causvid':  # denoising_step_list used as is; add_noise / x0 look sigma up at the nearest timestep
        sig, ts = grid(8.0)
        return [(float(t), sig[(ts - t).abs().argmin()].item()) for t in (1000, 757, 522)]
    sig, ts = grid(5.0)  # warp_denoising_step: timesteps[1000 - t]
    return [(ts[1000 - t].item(), sig[(ts - ts[1000 - t]).abs().argmin()].item()) for t in (1000, 750, 500, 250)]


def sees(name, i, j):
    """Query frame i sees key frame j (blocks of 3): the released attention rule of each model."""
    if j // 3 > i // 3:
        return False
    if name == 'longlive':  # local_attn_size 12 with sink_size 3: the sink + the last 9 up to the block's end
        return j < 3 or j >= (i // 3 + 1) * 3 - 9
    return True  # Self-Forcing, CausVid: local_attn_size -1, every earlier frame


def brute_force(ref, noise, text, name, seeds):
    procs = [Masked() for _ in ref.blocks]
    for b, p in zip(ref.blocks, procs):
        b.attn1.processor = p
    B, F, T = noise.shape[0], noise.shape[2], noise.shape[3] // 2 * (noise.shape[4] // 2)
    steps, gens, done = released_steps(name), [torch.Generator().manual_seed(x) for x in seeds], []
    for start in range(0, F, 3):
        end = start + 3
        mask = torch.tensor([[sees(name, i, j) for j in range(end)] for i in range(end)])
        for p in procs:
            p.mask = mask.repeat_interleave(T, 0).repeat_interleave(T, 1)[None, None]
        x = noise[:, :, start:end]
        for k, (t, s) in enumerate(steps):
            tt = torch.cat([torch.zeros(B, start * T), torch.full((B, 3 * T), t)], 1)  # context at timestep 0
            with torch.no_grad():
                v = ref(hidden_states=torch.cat(done + [x], 2), timestep=tt, encoder_hidden_states=text,
                        return_dict=False)[0][:, :, start:end]
            x0 = x - s * v
            if k + 1 < len(steps):  # fresh noise at the next step's sigma
                z = torch.stack([torch.randn(x0.shape[1:], generator=g) for g in gens])
                x = (1 - steps[k + 1][1]) * x0 + steps[k + 1][1] * z
        done.append(x0)
    return torch.cat(done, 2)


@pytest.mark.parametrize('name', ['longlive', 'self_forcing', 'causvid'])
def test_layout_equals_masked_full_forward(name):
    layout = streaming.LAYOUTS[name]
    net, ref = tiny_pair(layout)
    noise = torch.randn(2, 4, FRAMES, 4, 4, generator=torch.Generator().manual_seed(1))
    text = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(2))
    seen = []
    x = streaming.generate(net, noise, text, [torch.Generator().manual_seed(s) for s in (7, 8)],
                           on_block=lambda start, x0, cache: seen.append(cache.frames))
    want = brute_force(ref, noise, text, name, (7, 8))
    assert (x - want).abs().max() < 1e-5 * want.abs().max(), (x - want).abs().max()
    held = [0, 1, 2] + list(range(15, 21)) if name == 'longlive' else list(range(21))
    assert seen[-1] == held  # LongLive: the sink and what the next block's window needs; the others: all
    # the masks of a whole clip (wan_causal.forward) and of teacher forcing (clean frames, then noisy) attend so
    n = FRAMES
    rule = torch.tensor([[sees(name, i, j) for j in range(n)] for i in range(n)])
    own = torch.arange(n)[:, None] // 3 == torch.arange(n)[None] // 3
    tm = streaming.teacher_mask(n, layout)
    assert torch.equal(streaming.frame_mask(n, layout), rule) and torch.equal(tm[:n, :n], rule)
    assert torch.equal(tm[n:, :n], rule & ~own) and torch.equal(tm[n:, n:], own) and not tm[:n, n:].any()
    for p in ref.blocks:  # brute_force left its Masked processors in place
        p.attn1.processor.mask = rule.repeat_interleave(4, 0).repeat_interleave(4, 1)[None, None]
    s, ctx = torch.tensor([0.3, 0.8]), wan_causal.context([text])
    with torch.no_grad():
        want = ref(hidden_states=noise, timestep=1000 * s, encoder_hidden_states=ctx, return_dict=False)[0]
        got = wan_causal.forward(net, noise, s, [text])
    assert (got - want).abs().max() < 1e-5 * want.abs().max()


def test_convert_records_layout_and_sampler_reads_it(tmp_path, capsys):
    root = str(tmp_path)
    _, sd = make_tiny_causal(root)
    wan, gen = os.path.join(root, 'wan'), os.path.join(root, 'generator.pt')
    named = os.path.join(root, 'self_forcing_dmd.pt')
    shutil.copy(gen, named)
    out = lambda n: os.path.join(root, n)
    wan_causal.main([out('sf'), f'--wan={wan}', f'--generator={named}'])  # recognised from its name
    wan_causal.main([out('cv'), f'--wan={wan}', f'--generator={gen}', '--layout=causvid'])
    wan_causal.main([out('ll'), f'--wan={wan}', f'--generator={named}', '--layout=longlive'])  # the flag wins
    assert 'with the layout of causvid' in capsys.readouterr().out
    for d, name in (('sf', 'self_forcing'), ('cv', 'causvid'), ('ll', 'longlive')):
        assert json.load(open(os.path.join(out(d), 'model_index.json')))['layout']['name'] == name
        assert wan_causal.load_transformer(out(d)).layout == {**streaming.LAYOUTS[name], 'timesteps':
                                                              tuple(streaming.LAYOUTS[name]['timesteps'])}
    # the family samples with the recorded layout: the same weights, other videos
    text = wan_causal.text_encoder(out('cv'), 'cpu')(['a red circle moving left'])
    noise = torch.randn(1, *wan_causal.latent_shape(out('cv'), 81, 16, 16))
    g = lambda: [torch.Generator().manual_seed(3)]
    cv, ll = (wan_causal.generate(wan_causal.load_transformer(out(d)), noise, text, g()) for d in ('cv', 'll'))
    assert not torch.allclose(cv, ll)
    # MemFlow: one line, nothing written; an unnamed file: the flag is required
    memflow = os.path.join(root, 'memflow_base.pt')
    shutil.copy(gen, memflow)
    for argv, said in (([f'--generator={memflow}'], 'MemFlow is not supported: its memory bank'),
                       ([f'--generator={gen}', '--layout=memflow'], 'MemFlow is not supported'),
                       ([f'--generator={gen}'], 'pass --layout=longlive|self_forcing|causvid')):
        with pytest.raises(SystemExit, match=said) as e:
            wan_causal.main([out('no'), f'--wan={wan}'] + argv)
        assert '\n' not in str(e.value) and not os.path.exists(out('no'))
    # global attention over the released 21-frame cache: more frames are refused, not sampled otherwise
    with pytest.raises(SystemExit, match='causvid samples at most 21'):
        wan_causal.latent_shape(out('cv'), 93, 16, 16)  # 24 latent frames
    with pytest.raises(SystemExit, match='holds 21 latent frames'):
        streaming.generate(wan_causal.load_transformer(out('sf')), torch.randn(1, 4, 24, 2, 2), text[0])


def test_self_forcing_samples_its_ema_and_longlive_its_length(tmp_path, capsys):
    # a training checkpoint holding both weights, different ({'generator', 'generator_ema', 'critic', 'step'},
    # the EMA's keys under FSDP's prefix as Self-Forcing saves them): each model samples what its release loads
    from tiny_wan_causal import original_name, random_generator
    from diffusers import WanTransformer3DModel
    root = str(tmp_path)
    _, sd = make_tiny_causal(root)
    wan = os.path.join(root, 'wan')
    ema = random_generator(WanTransformer3DModel.load_config(wan, subfolder='transformer'), seed=1)
    file = os.path.join(root, 'self_forcing_dmd.pt')
    torch.save({'generator': {'model.' + original_name(k): v for k, v in sd.items()},
                'generator_ema': {'model._fsdp_wrapped_module.' + original_name(k): v for k, v in ema.items()},
                'critic': {'model.x': torch.zeros(1)}, 'step': torch.tensor(600)}, file)
    out = lambda n: os.path.join(root, n)
    wan_causal.main([out('sf'), f'--wan={wan}', f'--generator={file}'])  # Self-Forcing: recognised from the name
    assert 'sampling generator_ema' in capsys.readouterr().out
    wan_causal.main([out('sf_plain'), f'--wan={wan}', f'--generator={file}', '--key=generator'])
    wan_causal.main([out('ll'), f'--wan={wan}', f'--generator={file}', '--layout=longlive'])
    keys = {d: json.load(open(os.path.join(out(d), 'model_index.json')))['generator_key']
            for d in ('sf', 'sf_plain', 'll')}
    assert keys == dict(sf='generator_ema', sf_plain='generator', ll='generator')
    index = os.path.join(out('sf'), 'model_index.json')  # an index that names no entry: the layout's choice
    json.dump({**json.load(open(index)), 'generator_key': None}, open(index, 'w'))
    net = wan_causal.load_transformer(out('sf'))
    assert all(torch.equal(net.state_dict()[k], v.float()) for k, v in ema.items())
    from kvpo import optim
    unmerged = optim.load_unmerged(out('sf')).state_dict()  # kvpo's loading, the same weights
    assert all(torch.equal(unmerged[k], v.float()) for k, v in ema.items())
    # its videos are the EMA's: the same as a model holding the EMA weights, not the trained ones
    text = wan_causal.text_encoder(out('sf'), 'cpu')(['a red circle moving left'])
    noise = torch.randn(1, *wan_causal.latent_shape(out('sf'), 9, 16, 16), generator=torch.Generator().manual_seed(0))
    g = lambda: [torch.Generator().manual_seed(3)]
    ref_ema, ref_plain = (wan_causal.build(net.config, streaming.LAYOUTS['self_forcing']) for _ in range(2))
    ref_ema.load_state_dict(ema, assign=True)
    ref_plain.load_state_dict(sd, assign=True)
    x, want, other = (wan_causal.generate(n, noise, text, g()) for n in (net, ref_ema, ref_plain))
    assert torch.equal(x, want) and not torch.allclose(x, other, atol=1e-3)
    assert torch.equal(wan_causal.generate(wan_causal.load_transformer(out('sf_plain')), noise, text, g()), other)
    # the length each release's inference makes when none is asked (sample.py's num_frames None): LongLive's
    # yaml num_output_frames 120 latent frames (477 video frames), Self-Forcing's and CausVid's 21 (81)
    assert wan_causal.DEFAULTS['num_frames'] is None
    assert [wan_causal.latent_shape(out(d), None, 16, 16)[1] for d in ('ll', 'sf')] == [120, 21]
    assert streaming.LAYOUTS['causvid']['frames'] == 21
    assert wan_causal.video_frames(streaming.LAYOUTS['longlive']) == 477
    assert wan_causal.latent_shape(out('ll'), 81, 16, 16)[1] == 21  # asked for: as asked
    index = os.path.join(out('ll'), 'model_index.json')  # an index written before the layouts had 'frames'
    d = json.load(open(index))
    json.dump({**d, 'layout': {k: v for k, v in d['layout'].items() if k != 'frames'}}, open(index, 'w'))
    assert wan_causal.latent_shape(out('ll'), None, 16, 16)[1] == 120


def test_kvpo_refuses_global_attention():
    from kvpo import kvpo
    args = (3, 2, 2, 33, 0, 21, 18, 2)  # K, m, P, keep, seed, chunk_first, chunk_then, within
    assert kvpo.plan(60, streaming.LAYOUTS['longlive'], *args)['fork'] >= 12
    for name in ('self_forcing', 'causvid'):
        with pytest.raises(SystemExit, match=f'{name} attends globally'):
            kvpo.plan(60, streaming.LAYOUTS[name], *args)
