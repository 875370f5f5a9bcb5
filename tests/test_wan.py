"""
wan.py against diffusers' WanPipeline itself, on tiny random-weight pipelines of the real classes
(tests/tiny_wan.py: Wan 2.1's layout, and Wan 2.2 TI2V-5B's: 48 latent channels, a 16x VAE,
per-token timesteps), then train.py and sample.py end to end on the Wan 2.1 one:
- text: the cached prompt tensors are encode_prompt's (UMT5, 512 tokens), trimmed to the valid tokens;
- velocity: model.velocity through the cache round trip equals the pipeline's own transformer calls
  with its own text (both CFG branches, its timestep layout), and the cached text must be padded back;
- attention: every `attention` value runs Wan's own processor (no mask to drop) on attention_backend's
  kernel, the pipeline transformer's velocity; sp refuses a backend without diffusers' Ulysses;
- sampling: the ODE sampler equals the pipeline's denoising loop run with FlowMatchEulerDiscreteScheduler
  (shift 3 / 5) on the same sigmas; decode equals the pipeline's decode and postprocessing; the latent
  shape is the VAE's;
- sequence parallel on 2 gloo ranks (Wan 2.2: the per-token timesteps split with the video tokens):
  the velocity and gradient of 1 process;
- train.py: 1 process, 2 FSDP ranks and 2 ranks as one sp group agree within 1e-6 after 3 iterations;
  1 process resumed from the 2-rank iteration-2 checkpoint continues to the same weights; the export
  loads with WanTransformer3DModel.from_pretrained and is the trained policy; sample.py renders mp4s.
python -m pytest tests/test_wan.py     (2 torchrun launches; the one-process runs and sample.py in this process)
"""
import functools
import math
import os
import subprocess
import sys

import imageio.v3 as iio
import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
from transformers import AutoTokenizer

from models import policy as model
import sde

sys.path.insert(0, os.path.dirname(__file__))
from test_train import ROOT, run, run_here, weights  # noqa: E402
from tiny_videoalign import make_tiny_videoalign  # noqa: E402
from tiny_wan import TINY, TINY_22, make_tiny_wan  # noqa: E402

PROMPTS = ['a red car', 'a blue circle moving left on the ground']
CFG = 5.0  # WanPipeline's default guidance
SIZES = {'2.1': (16, 3, 4, 4), '2.2': (48, 3, 4, 2)}  # latents of 9 frames at 32x32 (8x VAE) and 64x32 (16x)


@pytest.fixture(scope='module')
def roots(tmp_path_factory):
    return {'2.1': make_tiny_wan(tmp_path_factory.mktemp('wan21'), TINY),
            '2.2': make_tiny_wan(tmp_path_factory.mktemp('wan22'), TINY_22)}


@pytest.fixture(scope='module')
def pipes(roots):
    return {k: WanPipeline.from_pretrained(r, torch_dtype=torch.float32) for k, r in roots.items()}  # references


@pytest.fixture(scope='module')
def encoded(roots):
    # the pipeline's own text, as its __call__ makes it: 512 tokens, zero after each prompt, bf16
    # encoder (the trainer's); no_grad as in __call__ (UMT5 in bf16 rounds differently with grad on)
    pipe = WanPipeline.from_pretrained(roots['2.1'], transformer=None, vae=None, torch_dtype=torch.bfloat16)
    with torch.no_grad():
        return pipe.encode_prompt(PROMPTS, negative_prompt=None, max_sequence_length=512, device='cpu')


def cached_text(root, prompts, negative):
    cache = model.encode_prompts(root, prompts + [negative])
    return model.batch_text(cache, prompts, 'cpu'), model.batch_text(cache, [negative] * len(prompts), 'cpu')


# ----------------------------------------------------------------------------- text

def test_text_is_encode_prompt(roots, encoded):
    cache = model.encode_prompts(roots['2.1'], PROMPTS + [''])
    pos, neg = encoded
    tok = AutoTokenizer.from_pretrained(roots['2.1'], subfolder='tokenizer')
    for p, full in [*zip(PROMPTS, pos), ('', neg[0])]:
        n = len(tok(p).input_ids)  # the prompt's tokens with its </s>, counted independently
        embeds, mask = cache[p]
        assert embeds.shape == (n, 16) and mask.shape == (n,) and mask.bool().all()
        assert torch.equal(embeds, full[:n]) and not full[n:].any()  # the pipeline's, and zeros after


# ----------------------------------------------------------------------------- velocity

def pipeline_timestep(pipe, s, shape):
    # WanPipeline.__call__'s timestep for one sigma per clip: (B,), or with expand_timesteps (Wan 2.2
    # TI2V) one per video token, written as the pipeline writes it (a mask of ones, every 2nd row/column)
    t = 1000 * s
    if not pipe.config.expand_timesteps:
        return t
    mask = torch.ones(shape)  # (C, F, h, w)
    return torch.stack([(mask[0][:, ::2, ::2] * ti).flatten() for ti in t])  # (B, F * h/2 * w/2)


@pytest.mark.parametrize('version', ['2.1', '2.2'])
@torch.no_grad()
def test_velocity_is_the_pipeline_transformer_call(roots, pipes, encoded, version):
    root, pipe = roots[version], pipes[version]
    x = torch.randn(2, *SIZES[version], generator=torch.Generator().manual_seed(0))
    s = torch.tensor([0.9, 0.35])  # a sigma per clip, as the update's steps have
    call = lambda text: pipe.transformer(hidden_states=x, timestep=pipeline_timestep(pipe, s, x.shape[1:]),
                                         encoder_hidden_states=text.float(), return_dict=False)[0]
    v_c, v_u = call(encoded[0]), call(encoded[1])
    ref = v_u + CFG * (v_c - v_u)
    assert (v_c - v_u).abs().max() > 1e-3  # the prompt matters, so the check has teeth
    text, text_neg = cached_text(root, PROMPTS, '')
    assert text[0].shape[1] < 20  # trimmed (the pipeline pads to 512): forward pads it back
    net = model.load_transformer(root)  # through the family, as train.py loads it
    assert model.family(root).PIPELINE == 'WanPipeline' and net.expand_timesteps == (version == '2.2')
    torch.testing.assert_close(model.velocity(net, x, s, text, CFG, text_neg), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(model.velocity(net, x, s, text), v_c, atol=1e-5, rtol=1e-5)  # cfg 1
    # what the padding is for: Wan attends to the 512 zero-padded tokens, unmasked
    unpadded = net(hidden_states=x, timestep=pipeline_timestep(pipe, s, x.shape[1:]),
                   encoder_hidden_states=text[0], return_dict=False)[0]
    assert (unpadded - v_c).abs().max() > 1e-3



@torch.no_grad()
def test_attention_settings_run_wans_processor_on_their_backend(roots, pipes):
    # Wan's processor has no mask to drop: every `attention` value gives the pipeline transformer's
    # velocity; attention_backend reaches every self- and cross-attention (a backend left unset
    # would run torch's default kernel); sequence parallel refuses a backend without diffusers'
    # Ulysses (each rank would attend within its own tokens, silently); a bad value is one line
    from models import wan
    root, pipe = roots['2.1'], pipes['2.1']
    g = torch.Generator().manual_seed(1)
    x, s = torch.randn(2, *SIZES['2.1'], generator=g), torch.tensor([0.8, 0.2])
    text = [torch.randn(2, 512, 16, generator=g), torch.ones(2, 512)]  # full length: nothing to pad
    ref = pipe.transformer(hidden_states=x, timestep=1000 * s, encoder_hidden_states=text[0],
                           return_dict=False)[0]
    for kind in ('valid_tokens', 'masked_keys', 'diffusers'):
        net = model.load_transformer(root, attention=kind, backend='_native_math')
        procs = [p for blk in net.blocks for p in (blk.attn1.processor, blk.attn2.processor)]
        assert {p._attention_backend.value for p in procs} == {'_native_math'}
        torch.testing.assert_close(model.velocity(net, x, s, text), ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(SystemExit, match="Ulysses for Wan, which attention_backend '_native_math' lacks"):
        wan.cp_plan(net)
    assert wan.cp_plan(model.load_transformer(root))  # 'native' (the default) has it
    with pytest.raises(SystemExit, match='attention must be one of'):
        model.load_transformer(root, attention='sparse')

def test_lora_base_in_bf16_has_diffusers_dtypes(roots):
    # LoRA on one GPU keeps the frozen base in bf16: every tensor gets the dtype diffusers' own bf16
    # loading gives it (the rope tables, time embedding, modulation tables and norms stay float32)
    net = model.load_policy(roots['2.1'], 'cpu', lora_rank=4, base_dtype=torch.bfloat16)
    ref = WanTransformer3DModel.from_pretrained(roots['2.1'], subfolder='transformer', torch_dtype=torch.bfloat16)
    ours = {n.replace('.base_layer', ''): t.dtype for n, t in [*net.named_parameters(), *net.named_buffers()]
            if 'lora_' not in n}
    theirs = {n: t.dtype for n, t in [*ref.named_parameters(), *ref.named_buffers()]}
    assert ours == theirs and {torch.float32, torch.bfloat16} <= set(theirs.values())
    assert net.rope.freqs_cos.dtype == torch.float32


# ----------------------------------------------------------------------------- sampling, frames

@pytest.mark.parametrize('version,shift', [('2.1', 3.0), ('2.2', 5.0)])
@torch.no_grad()
def test_ode_sampling_and_decode_are_the_pipeline_loop(roots, pipes, encoded, version, shift):
    root, pipe, N = roots[version], pipes[version], 3
    H, W = (32, 32) if version == '2.1' else (64, 32)
    x = torch.randn(2, *SIZES[version], generator=torch.Generator().manual_seed(1))
    # the pipeline's own loop, with FlowMatchEulerDiscreteScheduler(shift) in place of its UniPC, on
    # this project's sigmas: the linear grid, shifted by the scheduler itself (the pipeline passes none)
    sched = FlowMatchEulerDiscreteScheduler(shift=shift)
    sched.set_timesteps = functools.partial(sched.set_timesteps, sigmas=np.linspace(1.0, 0.0, N + 1)[:-1])
    pipe.scheduler = sched
    args = dict(prompt_embeds=encoded[0].float(), negative_prompt_embeds=encoded[1].float(), latents=x.clone(),
                num_frames=9, height=H, width=W, num_inference_steps=N, guidance_scale=CFG)
    ref = pipe(**args, output_type='latent').frames  # (B, C, F, h, w)
    sigmas = sde.sigmas(N, shift)
    assert torch.equal(sched.sigmas.float(), sigmas)
    text, text_neg = cached_text(root, PROMPTS, '')
    out, traj = model.sample(model.load_transformer(root), x, sigmas, text, CFG, text_neg, 'ode', 0.0,
                             model.generators([1, 2]), keep=('stds',))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert not traj['stds'].any()  # ODE steps: no noise
    # decode: latents * latents_std + latents_mean per channel, the VAE, frames in [0, 1]
    frames = model.load_decoder(root, 'cpu')(out)
    video = pipe(**args, output_type='pt').frames  # (B, F, 3, H, W): the pipeline's decode and postprocessing
    assert frames.shape == video.shape == (2, 9, 3, H, W)
    torch.testing.assert_close(frames, video, atol=1e-4, rtol=1e-4)
    # the latent shape is what the VAE encodes such a clip to, and what the pipeline prepares
    assert model.latent_shape(root, 9, H, W) == SIZES[version] == \
        tuple(pipe.vae.encode(torch.zeros(1, 3, 9, H, W)).latent_dist.mean.shape[1:]) == \
        pipe.prepare_latents(1, SIZES[version][0], H, W, 9).shape[1:]
    if version == '2.2':  # 16x VAE and 2x2 patches: a side must be a multiple of 32
        with pytest.raises(SystemExit, match='multiples of 32 x 32'):
            model.latent_shape(root, 9, 48, 32)


# ----------------------------------------------------------------------------- sequence parallel

def test_sp2_velocity_and_gradient_equal_one_process(roots, tmp_path):
    # Wan 2.2 TI2V: diffusers' _cp_plan splits the per-token timesteps with the video tokens
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 48, 3, 4, 2, generator=g)  # 3 x 2 x 1 = 6 video tokens, 3 a rank
    mask = lambda lengths: torch.stack([torch.arange(5) < n for n in lengths]).float()  # (B, 5)
    text = [torch.randn(2, 5, 16, generator=g) * mask([5, 2])[..., None], mask([5, 2])]
    text_neg = [torch.randn(2, 5, 16, generator=g) * mask([1, 1])[..., None], mask([1, 1])]
    inputs = dict(x=x, s=torch.tensor([0.9, 0.4]), cfg=CFG, text=text, text_neg=text_neg,
                  w=torch.randn(x.shape, generator=g))
    torch.save(inputs, tmp_path / 'inputs.pt')
    cmd = [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2',
           os.path.join(ROOT, 'tests', 'sp_worker.py'), roots['2.2'], str(tmp_path / 'inputs.pt'),
           str(tmp_path / 'out.pt')]
    p = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS='1', PYTHONPATH=ROOT), cwd=ROOT,
                       capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, f'rc {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}'
    assert 'Expected input tensor' not in p.stderr  # every split of the plan applied (none skipped)
    got = torch.load(tmp_path / 'out.pt')
    assert got['seen'] == [3] * 2, got['seen']  # each rank's self-attention saw half the video tokens
    net = model.load_transformer(roots['2.2'])
    v = model.velocity(net, x, inputs['s'], text, CFG, text_neg)
    (v * inputs['w']).sum().backward()
    assert (got['v'] - v.detach()).abs().max() <= 1e-5 * v.abs().max()
    # the gradient: all of it within float32 rounding; each parameter's within 1%, which a missing or
    # doubled contribution breaks. Tighter per parameter is noise: the cross-attention over 512 nearly
    # identical padded text tokens makes some gradients ill-conditioned (in one process, float32 and
    # float64 already differ by up to 7e-4 on attn2's query weights)
    grads = {n: p.grad for n, p in net.named_parameters() if p.grad is not None}
    flat = lambda g: torch.cat([g[n].flatten() for n in grads])
    assert (flat(got['grads']) - flat(grads)).norm() <= 2e-5 * flat(grads).norm()
    for n, g in grads.items():
        assert (got['grads'][n] - g).norm() <= 1e-2 * g.norm(), n


# ----------------------------------------------------------------------------- train.py, sample.py

@pytest.mark.slow  # .ci/run's slow tier: the README's command stays under 10 minutes
def test_train_ranks_sp_resume_export_and_sample(roots, tmp_path, monkeypatch):
    ckpt_dir, qwen_dir = make_tiny_videoalign(str(tmp_path / 'va'))
    (tmp_path / 'train.txt').write_text('a red car moving left\na blue circle moving up\n'
                                        'a green cat on the ground\n')
    (tmp_path / 'eval.txt').write_text('a red fox runs through deep snow\na sign reads number\n')
    args = ['train.py', f'--model={roots["2.1"]}', '--reward_model=videoalign', f'--videoalign_dir={ckpt_dir}',
            f'--qwen_dir={qwen_dir}', '--eval_metrics=', '--device=cpu', '--num_frames=9', '--height=32',
            '--width=32', '--fps=8', '--num_steps=2', '--prompts_per_iter=2', '--group_size=2', '--rollout_batch=2',
            '--train_batch=1', '--max_iters=3', '--eval_every=0', '--eval_videos=0', '--save_every=2',
            '--optimizer=adamw', '--learning_rate=1e-4', f'--train_prompts={tmp_path / "train.txt"}',
            f'--eval_prompts={tmp_path / "eval.txt"}']
    one, two, sp2, back = (str(tmp_path / d) for d in ('one', 'two', 'sp2', 'back'))
    run_here(monkeypatch, args + [f'--out_dir={one}', '--export_dtype=float32'])  # 1 process, in this one
    run(args + [f'--out_dir={two}', '--export_dtype='], torchrun=True)               # 2 FSDP ranks
    run(args + [f'--out_dir={sp2}', '--export_dtype=', '--sp_size=2'], torchrun=True)  # one sp group of 2
    os.makedirs(back)  # the 2-rank iteration-2 checkpoint, resumed by 1 process for iteration 3
    os.rename(os.path.join(two, 'ckpt_000002'), os.path.join(back, 'ckpt_000002'))
    with open(os.path.join(back, 'latest'), 'w') as f:
        f.write('ckpt_000002')
    run_here(monkeypatch, args + [f'--out_dir={back}', '--export_dtype=', '--init_from=resume'])

    w = {d: weights(d) for d in (one, two, sp2, back)}
    norm = lambda d: math.sqrt(sum((t.double() ** 2).sum().item() for t in d.values()))
    base = WanTransformer3DModel.from_pretrained(roots['2.1'], subfolder='transformer').state_dict()
    moved = norm({k: w[one][k] - base[k] for k in w[one]}) / norm(w[one])
    for d in (two, sp2, back):
        assert w[d].keys() == w[one].keys()
        rel = norm({k: w[d][k] - w[one][k] for k in w[one]}) / norm(w[one])
        assert rel <= 1e-6 and moved > 100 * rel, (d, rel, moved)  # measured: 2e-8 (dp, resume), 3e-7 (sp)
    # the export (float32) is a plain diffusers transformer, and it is the trained policy
    exported = WanTransformer3DModel.from_pretrained(os.path.join(one, 'export'))
    for k, t in exported.state_dict().items():
        if k in w[one]:
            assert torch.equal(t, w[one][k]), k
    assert set(w[one]) <= set(exported.state_dict())
    # sample.py renders base and aligned (the resumed run's checkpoint) videos from the directory
    out = str(tmp_path / 'samples')
    run_here(monkeypatch, ['sample.py', f'--model={roots["2.1"]}', f'--checkpoint={back}',
                           f'--prompts={tmp_path / "eval.txt"}', '--num_prompts=2', '--num_steps=2', '--num_frames=9',
                           '--height=32', '--width=32', f'--out_dir={out}', '--metrics_table=False'])
    for name in ('base', 'aligned'):
        for i in range(2):
            assert iio.imread(os.path.join(out, f'{name}_{i}.mp4')).shape == (9, 32, 32, 3)
