"""
Wan 2.2 T2V-A14B's two experts (models/wan.py: Experts) against diffusers' WanPipeline itself, on a tiny
random-weight two-expert pipeline (tests/tiny_wan.py TINY_A14B: Wan 2.1's parts twice, boundary_ratio 0.875):
- velocity: at every step of a schedule that crosses the boundary, model.velocity is the pipeline's own
  transformer calls of that step, from the expert it picks, guided with that expert's scale
  (guidance_scale 4.0 high noise = the run's cfg, guidance_scale_2 3.0 low noise); a batch that mixes
  steps of both experts gives each sample its own expert's velocity and guidance;
- sampling: the ODE sampler equals the pipeline's loop with FlowMatchEulerDiscreteScheduler (shift 12);
- train.py in 1 process, 3 iterations: both experts move; 2 FSDP ranks (whose clips route to different
  experts) and 2 ranks as one sp group reach the same weights within 1e-6, and so does 1 process resumed
  from the 2-rank run's iteration-2 checkpoint (another world size); an SDE window whose two steps straddle the
  boundary trains both experts; the export is transformer/ and transformer_2/, each loadable by
  WanTransformer3DModel.from_pretrained and the trained weights; with experts='high' the low-noise
  expert is in no checkpoint and stays bitwise the base (sample.py renders from that checkpoint), and held
  in bf16 (as on a GPU) it computes as in fp32 under bf16 autocast; LoRA on
  one expert exports merged weights and each expert's adapter.
python -m pytest tests/test_wan22.py
"""
import functools
import math
import os
import sys

import imageio.v3 as iio
import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel

from models import policy as model
import sde

sys.path.insert(0, os.path.dirname(__file__))
from test_train import run, run_here, weights  # noqa: E402
from tiny_videoalign import make_tiny_videoalign  # noqa: E402
from tiny_wan import TINY_A14B, make_tiny_wan  # noqa: E402

PROMPTS = ['a red car', 'a blue circle moving left on the ground']
HIGH, LOW = 4.0, 3.0  # Wan 2.2 A14B's recipe: guidance_scale, guidance_scale_2
SHAPE = (16, 3, 4, 4)  # latents of 9 frames at 32x32


@pytest.fixture(scope='module')
def root(tmp_path_factory):
    return make_tiny_wan(tmp_path_factory.mktemp('a14b'), TINY_A14B)


@pytest.fixture(scope='module')
def pipe(root):
    return WanPipeline.from_pretrained(root, torch_dtype=torch.float32)


@pytest.fixture(scope='module')
def encoded(root):
    pipe = WanPipeline.from_pretrained(root, transformer=None, transformer_2=None, vae=None,
                                       torch_dtype=torch.bfloat16)
    with torch.no_grad():
        return pipe.encode_prompt(PROMPTS, negative_prompt=None, max_sequence_length=512, device='cpu')


def cached_text(root, prompts, negative=''):
    cache = model.encode_prompts(root, prompts + [negative])
    return model.batch_text(cache, prompts, 'cpu'), model.batch_text(cache, [negative] * len(prompts), 'cpu')


def euler(pipe, N, shift):
    # FlowMatchEulerDiscreteScheduler(shift) on this project's sigmas (tests/test_wan.py)
    sched = FlowMatchEulerDiscreteScheduler(shift=shift)
    sched.set_timesteps = functools.partial(sched.set_timesteps, sigmas=np.linspace(1.0, 0.0, N + 1)[:-1])
    pipe.scheduler = sched
    return sde.sigmas(N, shift)


def test_loads_both_experts(root):
    net = model.load_transformer(root)
    assert model.family(root).PIPELINE == 'WanPipeline' and net.boundary == 0.875 and net.guidance_2 == LOW
    names = [n for n, _ in net.named_parameters()]
    assert names and all(n.startswith(('transformer.', 'transformer_2.')) for n in names)
    for sub, e in (('transformer', net.transformer), ('transformer_2', net.transformer_2)):
        ref = WanTransformer3DModel.from_pretrained(root, subfolder=sub).state_dict()
        assert all(torch.equal(t, ref[k]) for k, t in e.state_dict().items())
    assert not torch.equal(net.transformer.proj_out.weight, net.transformer_2.proj_out.weight)
    from models import wan
    assert len(wan.blocks(net)) == 4  # both experts' blocks: the FSDP units


@torch.no_grad()
def test_velocity_is_the_pipelines_expert_and_guidance_at_every_step(root, pipe, encoded):
    N, shift = 6, 5.0  # sigmas 1, 0.96, 0.91, 0.83, 0.71, 0.5: 3 steps of each expert
    sigmas = euler(pipe, N, shift)
    calls = []  # every transformer call the pipeline makes: (expert, timestep, latents, text, velocity)
    for name in ('transformer', 'transformer_2'):
        getattr(pipe, name).register_forward_hook(
            lambda m, a, kw, out, name=name: calls.append((name, kw['timestep'], kw['hidden_states'],
                                                           kw['encoder_hidden_states'], out[0])), with_kwargs=True)
    x = torch.randn(2, *SHAPE, generator=torch.Generator().manual_seed(0))
    pipe(prompt_embeds=encoded[0].float(), negative_prompt_embeds=encoded[1].float(), latents=x, num_frames=9,
         height=32, width=32, num_inference_steps=N, guidance_scale=HIGH, guidance_scale_2=LOW, output_type='latent')
    assert len(calls) == 2 * N  # cond, uncond each step
    experts = [calls[2 * i][0] for i in range(N)]
    assert experts == ['transformer'] * 3 + ['transformer_2'] * 3, experts  # the schedule crosses the boundary
    text, text_neg = cached_text(root, PROMPTS)
    net = model.load_transformer(root)
    got = {}
    for i in range(N):
        (name, t, xi, _, v_c), (name_u, _, _, _, v_u) = calls[2 * i], calls[2 * i + 1]
        assert name_u == name and torch.allclose(t, 1000 * sigmas[i].expand(2))
        ref = v_u + (HIGH if name == 'transformer' else LOW) * (v_c - v_u)
        got[i] = (xi, model.velocity(net, xi, sigmas[i].expand(2), text, HIGH, text_neg))
        torch.testing.assert_close(got[i][1], ref, atol=1e-5, rtol=1e-5)
        assert bool(net.high(sigmas[i:i + 1])) == (name == 'transformer')
    # a batch that mixes both experts' steps (the update's): each sample its own expert and guidance
    for i, j in ((0, 5), (4, 1)):
        xm = torch.stack([got[i][0][0], got[j][0][1]])
        sm = torch.stack([sigmas[i], sigmas[j]])
        vm = model.velocity(net, xm, sm, text, HIGH, text_neg)
        torch.testing.assert_close(vm, torch.stack([got[i][1][0], got[j][1][1]]), atol=1e-5, rtol=1e-5)
    # cfg 1 and guidance_2 1: one branch, the experts' conditional velocities
    net.guidance_2 = 1.0
    xm, sm = torch.stack([got[0][0][0], got[5][0][1]]), torch.stack([sigmas[0], sigmas[5]])
    v1 = model.velocity(net, xm, sm, text, 1.0, text_neg)
    torch.testing.assert_close(v1, torch.stack([calls[0][4][0], calls[10][4][1]]), atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_ode_sampling_is_the_pipeline_loop(root, pipe, encoded):
    N, shift = 4, 12.0  # the recipe's shift: sigmas 1, 0.97, 0.92 (high), 0.8 (low)
    sigmas = euler(pipe, N, shift)
    x = torch.randn(2, *SHAPE, generator=torch.Generator().manual_seed(1))
    ref = pipe(prompt_embeds=encoded[0].float(), negative_prompt_embeds=encoded[1].float(), latents=x.clone(),
               num_frames=9, height=32, width=32, num_inference_steps=N, guidance_scale=HIGH, guidance_scale_2=LOW,
               output_type='latent').frames
    assert torch.equal(pipe.scheduler.sigmas.float(), sigmas)
    text, text_neg = cached_text(root, PROMPTS)
    net = model.load_transformer(root)
    assert net.high(sigmas[:-1]).tolist() == [True, True, True, False]
    out, _ = model.sample(net, x, sigmas, text, HIGH, text_neg, 'ode', 0.0, model.generators([1, 2]))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)



@torch.no_grad()
def test_a_step_at_the_boundary_goes_to_the_high_noise_expert(root, pipe, encoded):
    # 8 steps at shift 1: sigma 0.875 at step 1 is the boundary exactly (timestep 875 = boundary_ratio *
    # num_train_timesteps), and WanPipeline gives it to `transformer` (t >= boundary_timestep); so must Experts
    N = 8
    sigmas = euler(pipe, N, 1.0)
    assert sigmas[1].item() == 0.875
    calls = []
    hooks = [getattr(pipe, name).register_forward_hook(lambda m, a, kw, out, name=name: calls.append(name),
                                                       with_kwargs=True) for name in ('transformer', 'transformer_2')]
    try:
        x = torch.randn(1, *SHAPE, generator=torch.Generator().manual_seed(0))
        pipe(prompt_embeds=encoded[0][:1].float(), negative_prompt_embeds=encoded[1][:1].float(), latents=x,
             num_frames=9, height=32, width=32, num_inference_steps=N, guidance_scale=HIGH, guidance_scale_2=LOW,
             output_type='latent')
    finally:
        for h in hooks:
            h.remove()
    experts = calls[::2]  # cond, uncond each step
    assert experts == ['transformer'] * 2 + ['transformer_2'] * 6, experts
    net = model.load_transformer(root)
    assert net.high(sigmas[:-1]).tolist() == [e == 'transformer' for e in experts]
    assert net.high(torch.tensor([0.875, 0.87499994, 0.8750001])).tolist() == [True, False, True]  # float32 neighbours


class Frozen(Exception):
    """Raised where the loader holds a frozen expert or base: the dtype it chose is known."""


@pytest.mark.parametrize('device,dtype', [('cpu', torch.float32), ('cuda', torch.bfloat16), ('cuda:3', torch.bfloat16)])
def test_frozen_expert_dtype_follows_the_device_type(root, monkeypatch, device, dtype):
    # any CUDA device name holds the frozen expert (and a LoRA run's frozen base) in bf16, 'cuda:3' as 'cuda';
    # no GPU needed: the loader stops where it freezes, before anything moves to the device
    from models import wan
    chosen = []

    def freeze(self, experts, dt=torch.float32):
        chosen.append(dt)
        raise Frozen

    def hold(module, dt, buffers=False):
        chosen.append(dt)
        raise Frozen
    monkeypatch.setattr(wan.Experts, 'freeze', freeze)
    with pytest.raises(Frozen):
        model.load_policy(root, device, experts='high')
    monkeypatch.setattr(model, 'hold_frozen', hold)
    with pytest.raises(Frozen):
        model.load_policy(root, device, lora_rank=4)
    assert chosen == [dtype, dtype], (device, chosen)

def test_one_expert_setting_needs_two(root, tmp_path):
    one = make_tiny_wan(tmp_path / 'wan21')
    with pytest.raises(SystemExit, match='has one transformer'):
        model.load_policy(one, 'cpu', experts='high')
    net = model.load_policy(root, 'cpu', experts='low')
    assert not any(p.requires_grad for p in net.transformer.parameters())
    assert all(p.requires_grad for p in net.transformer_2.parameters())


# ----------------------------------------------------------------------------- train.py

def train_args(root, tmp_path):
    ckpt_dir, qwen_dir = make_tiny_videoalign(str(tmp_path / 'va'))
    (tmp_path / 'train.txt').write_text('a red car moving left\na blue circle moving up\n'
                                        'a green cat on the ground\n')
    (tmp_path / 'eval.txt').write_text('a red fox runs through deep snow\na sign reads number\n')
    # shift 3, 4 steps: sigmas 1, 0.9 (high noise), 0.75, 0.5 (low): clips train steps of both experts, and
    # train_batch 2 mixes them in one micro-batch
    return ['train.py', f'--model={root}', '--reward_model=videoalign', f'--videoalign_dir={ckpt_dir}',
            f'--qwen_dir={qwen_dir}', '--eval_metrics=', '--device=cpu', '--num_frames=9', '--height=32',
            '--width=32', '--fps=8', '--num_steps=4', '--shift=3.0', '--cfg=4.0', '--prompts_per_iter=2',
            '--group_size=2', '--rollout_batch=2', '--train_batch=2', '--timestep_fraction=0.5',
            '--eval_every=0', '--eval_videos=0', '--save_every=2', '--optimizer=adamw', '--learning_rate=1e-4',
            f'--train_prompts={tmp_path / "train.txt"}', f'--eval_prompts={tmp_path / "eval.txt"}']


def norm(d):
    return math.sqrt(sum((t.double() ** 2).sum().item() for t in d.values()))


def base_weights(root):
    return {f'{sub}.{k}': t for sub in ('transformer', 'transformer_2')
            for k, t in WanTransformer3DModel.from_pretrained(root, subfolder=sub).state_dict().items()}


@pytest.mark.slow  # torchrun twice and a resume (~40 s alone): .ci/run's slow tier keeps the README command < 10 min
def test_train_ranks_sp_resume_and_export(root, tmp_path, monkeypatch):
    # 2 FSDP ranks: each rank's clips route to their own experts (every rank gathers both, in one order)
    args = train_args(root, tmp_path)
    one, two, sp2, back = (str(tmp_path / d) for d in ('one', 'two', 'sp2', 'back'))
    run_here(monkeypatch, args + [f'--out_dir={one}', '--max_iters=3', '--export_dtype=float32'])
    run(args + [f'--out_dir={two}', '--max_iters=3', '--export_dtype='], torchrun=True)
    run(args + [f'--out_dir={sp2}', '--max_iters=3', '--export_dtype=', '--sp_size=2'], torchrun=True)
    os.makedirs(back)  # the 2-rank run's iteration-2 checkpoint, resumed in 1 process for iteration 3
    os.rename(os.path.join(two, 'ckpt_000002'), os.path.join(back, 'ckpt_000002'))
    with open(os.path.join(back, 'latest'), 'w') as f:
        f.write('ckpt_000002')
    run_here(monkeypatch, args + [f'--out_dir={back}', '--max_iters=3', '--export_dtype=', '--init_from=resume'])
    w, wb, base = weights(one), weights(back), base_weights(root)
    assert w.keys() == wb.keys() == base.keys()
    for sub in ('transformer.', 'transformer_2.'):  # both experts trained
        moved = norm({k: w[k] - base[k] for k in w if k.startswith(sub)})
        assert moved > 1e-4 * norm({k: base[k] for k in w if k.startswith(sub)}), sub
    for d in (two, sp2):
        wd = weights(d)
        assert wd.keys() == w.keys()
        rel = norm({k: wd[k] - w[k] for k in w}) / norm(w)
        assert rel <= 1e-6, (d, rel)
    rel = norm({k: wb[k] - w[k] for k in w}) / norm(w)
    assert rel <= 1e-6, rel
    # the export (float32): the pipeline's transformer/ and transformer_2/, each the trained expert
    for sub in ('transformer', 'transformer_2'):
        exported = WanTransformer3DModel.from_pretrained(os.path.join(one, 'export'), subfolder=sub).state_dict()
        for k, t in exported.items():
            if f'{sub}.{k}' in w:
                assert torch.equal(t, w[f'{sub}.{k}']), (sub, k)


def test_sde_window_across_the_boundary_trains_both_experts(root, tmp_path, monkeypatch):
    # sigmas 1, 0.9 (high) | 0.75, 0.5 (low): a window of 2 steps is the only stochastic and trained part of a
    # rollout, each step scaled by its S_t over the window. Starting at step 1 it spans the boundary and both
    # experts move; at step 2 it lies below it and the high-noise expert gets a zero gradient (its token pass),
    # so without weight decay it stays bitwise the base
    def trained(start):
        seed = next(s for s in range(1000) if sde.window([0, 1, 2, 3], 2, model.seed_of(s, 'window', 0))[0] == start)
        out = str(tmp_path / f'window{start}')
        run_here(monkeypatch, train_args(root, tmp_path) + [
            f'--out_dir={out}', '--max_iters=1', '--sde_window=2', '--timestep_fraction=1.0', f'--seed={seed}',
            '--weight_decay=0', '--export_dtype='])
        w = weights(out)
        return {sub: norm({k: w[k] - base[k] for k in w if k.startswith(sub)}) for sub in ('transformer.', 'transformer_2.')}
    base = base_weights(root)
    across, below = trained(1), trained(2)
    assert across['transformer.'] > 0 and across['transformer_2.'] > 0, across
    assert below['transformer.'] == 0 and below['transformer_2.'] > 0, below


@torch.no_grad()
def test_frozen_expert_in_bf16_computes_as_the_fp32_one_under_bf16_autocast(root):
    # on a GPU the loader keeps the frozen expert in bf16 (half its memory): its forward is the one the
    # fp32 expert has there, where compute is bf16 (FSDP's param_dtype or autocast round each weight to
    # bf16 alike). Here: CPU autocast, both experts' steps, against the same model frozen in fp32.
    text, text_neg = cached_text(root, PROMPTS)
    x = torch.randn(2, *SHAPE, generator=torch.Generator().manual_seed(3))
    s = torch.tensor([0.95, 0.4])  # one sample per expert
    nets = [model.load_transformer(root).freeze('high', dt) for dt in (torch.float32, torch.bfloat16)]
    low = nets[1].transformer_2
    keep = [n for n, p in low.named_parameters() if p.dtype == torch.float32]
    assert keep and all(any(k in n for k in low._keep_in_fp32_modules) for n in keep)  # norms, time embedding
    assert low.proj_out.weight.dtype == torch.bfloat16 and nets[1].transformer.proj_out.weight.dtype == torch.float32
    assert not any(p.requires_grad for p in low.parameters())
    with torch.autocast('cpu', torch.bfloat16):
        v32, v16 = (model.velocity(n, x, s, text, HIGH, text_neg) for n in nets)
    assert torch.equal(v32, v16)


def test_train_high_expert_only_keeps_low_bitwise(root, tmp_path, monkeypatch):
    out = str(tmp_path / 'high')
    run_here(monkeypatch, train_args(root, tmp_path) + [f'--out_dir={out}', '--max_iters=2', '--experts=high',
                                                        '--export_dtype=float32'])
    w, base = weights(out), base_weights(root)
    assert w and all(k.startswith('transformer.') for k in w)  # the frozen expert: in no checkpoint
    assert norm({k: w[k] - base[k] for k in w}) > 0
    low = WanTransformer3DModel.from_pretrained(os.path.join(out, 'export'), subfolder='transformer_2').state_dict()
    for k, t in low.items():
        assert torch.equal(t, base[f'transformer_2.{k}']), k
    # sample.py reads the run's experts setting with its checkpoint, and renders both experts' steps
    samples = str(tmp_path / 'samples')
    run_here(monkeypatch, ['sample.py', f'--model={root}', f'--checkpoint={out}', f'--prompts={tmp_path / "eval.txt"}',
                           '--num_prompts=2', '--num_steps=4', '--shift=3.0', '--cfg=4.0', '--num_frames=9',
                           '--height=32', '--width=32', f'--out_dir={samples}', '--metrics_table=False'])
    for name in ('base', 'aligned'):
        for i in range(2):
            assert iio.imread(os.path.join(samples, f'{name}_{i}.mp4')).shape == (9, 32, 32, 3)


def test_lora_on_one_expert_exports_merged(root, tmp_path, monkeypatch):
    # LoRA adapters in both experts, only the high-noise expert's trained; the export merges them
    # (transformer/) and writes each expert's adapter (lora/transformer, lora/transformer_2)
    out = str(tmp_path / 'lora')
    run_here(monkeypatch, train_args(root, tmp_path) + [f'--out_dir={out}', '--max_iters=1', '--lora_rank=4',
                                                        '--experts=high', '--export_dtype=float32'])
    w, base = weights(out), base_weights(root)
    assert w and all(k.startswith('transformer.') and 'lora_' in k for k in w)
    dest = os.path.join(out, 'export')
    assert os.path.isdir(os.path.join(dest, 'lora', 'transformer'))
    high = WanTransformer3DModel.from_pretrained(dest, subfolder='transformer').state_dict()
    low = WanTransformer3DModel.from_pretrained(dest, subfolder='transformer_2').state_dict()
    assert high.keys() == low.keys() and not any('lora' in k for k in high)
    assert any(not torch.equal(t, base[f'transformer.{k}']) for k, t in high.items())
    for k, t in low.items():  # the frozen expert's adapter is B = 0: merged, the base bitwise
        assert torch.equal(t, base[f'transformer_2.{k}']), k
