"""
The phases of bench/gpu_check.py that run the training side (env, attention, drift and how a phase runs and
records: bench/gpu_phases.py; what both use: bench/gpu_common.py):

1. smoke: train.py itself with the tests' tiny models under torchrun (one GPU with NCCL; two CPU ranks
   with gloo): one iteration, then a resume that trains the next and exports; the export loaded back.
2. update: one micro-step of a full fine-tune as train.py's step_loss runs it, under FSDP2 at world 1, with
   K and 2K blocks, each part timed apart; per-block slopes give 54 blocks and a rank of 8: the time, MFU
   against bench.fullsize's FLOP table (results/fullsize.json), and the rank's memory peak with the
   reward models resident; with velocity()'s bf16 autocast and without it.
4. reward: VideoAlign's Qwen2-VL-2B at its real depth scoring four clips through models.videoalign.VideoAlign,
   and the VAE at its released widths decoding one clip of each size.
Tested by: python -m pytest tests/test_gpu_check.py
"""
import json
import os
import subprocess
import sys

import torch

from bench.gpu_common import GiB, ROOT, allocated_gib, clip, clock, cuda, latents, one_rank, peak_gib, text, \
    transformer, transformer_config

sys.path.insert(0, os.path.join(ROOT, 'tests'))  # the tests' tiny models (tiny_*.py)
PEAK_TFLOPS = 989.0  # dense bf16 of an H100/H200 SXM, the vendor's datasheet: the MFU's denominator
PARTS = ('anchor forward', 'forward', 'backward', 'clip', 'muon')  # 'muon': the optimizer step, Muon + AdamW
MICRO_STEPS = 32 // 8 * 20  # of a rank in an iteration at the defaults: 32 clips over 8 ranks x 20 trained steps


# ----------------------------------------------------------------------------- 2. the update

def guided(net, x, s, txt, txt_neg, amp, cfg=6.0):
    """policy.velocity with bf16 autocast on or off (off: FSDP2's bf16 parameters alone)."""
    from models import policy
    if amp:
        return policy.velocity(net, x, s, txt, cfg, txt_neg)
    from models.hunyuan15 import forward
    B = x.shape[0]
    v = forward(net, torch.cat([x, x]), torch.cat([s, s]), policy._cat_text(txt, txt_neg)).float()
    return v[B:] + cfg * (v[:B] - v[B:])


def micro_step(c, net, anchor, opts, x, x_next, mean_old, s, s_next, txt, txt_neg, amp):
    """train.py's step_loss for one clip at one step, its backward, the clip and the optimizer step:
    {part: (seconds, allocated peak GiB)}."""
    import sde
    from infra.optimizer import zero_grad
    from trust_region import gaussian_kl
    out, t = {}, [clock(c)]
    peak_gib(c, reset=True)

    def mark(part):
        now = clock(c)
        out[part] = (now - t[0], peak_gib(c, reset=True)[0])
        t[0] = clock(c)
    sv = torch.full((1,), s, device=x.device)
    with torch.no_grad(), anchor.applied(net):  # the anchor's forward first, as step_loss
        mean_anchor = sde.step(x, guided(net, x, sv, txt, txt_neg, amp), s, s_next, 'sage', 0.5, x_next=x_next).mean
    mark('anchor forward')
    new = sde.step(x, guided(net, x, sv, txt, txt_neg, amp), s, s_next, 'sage', 0.5, x_next=x_next)
    ratio = torch.exp(new.logp - new.logp.detach())  # theta == theta_old: 1
    A = 1.0
    policy_term = torch.maximum(-A * ratio, -A * ratio.clamp(1 - 1e-4, 1 + 1e-4))
    kl = gaussian_kl(new.mean, mean_anchor, new.std) + 0.1 * gaussian_kl(new.mean, mean_old, new.std)
    loss = (policy_term + 1e-5 * kl).sum()
    mark('forward')
    loss.backward()
    mark('backward')
    params = [p for o in opts for g in o.param_groups for p in g['params']]
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    mark('clip')
    for o in opts:
        o.step()
    zero_grad(opts)
    mark('muon')
    return out


def update_steps(c, blocks, backend, amp, reps):
    """A transformer of `blocks` blocks on attention `backend`, wrapped as train.py wraps the policy (FSDP2,
    gradient checkpointing, Muon + AdamW, the dual anchor), and `reps` micro-steps of it at clip(c) (in a
    process group: one_rank): the last one's {part: (seconds, peak GiB)}, the state at rest, the weights'
    count, and whether every weight is finite after the optimizer steps."""
    import sde
    from infra.optimizer import build
    from models.policy import shard
    from infra.anchor import Anchor
    dev = c['device']
    Fr, H, W = clip(c)
    n = (1000, 256) if cuda(c) else (8, 4)  # both branches fully valid: bench.fullsize's text (its FLOPs)
    sig, k = sde.sigmas(20, 5.0), 10
    cfg = transformer_config(c, blocks)
    net = transformer(c, cfg, backend)
    net.enable_gradient_checkpointing()
    shard(net, net.transformer_blocks, cuda=cuda(c))  # fp32 master, bf16 compute on a GPU
    opts, anchor = build(net, 'muon', 1e-5, 0.01), Anchor(net, 'dual', every=10)
    g = torch.Generator().manual_seed(0)
    shape = latents(cfg, Fr, H, W)
    x, x_next, mean_old = (torch.randn(1, *shape, generator=g).to(dev) for _ in range(3))
    txt, txt_neg = text(cfg, 1, n, dev, g), text(cfg, 1, n, dev, g)
    for rep in range(reps):  # on a GPU the first warms up (kernels, allocator)
        parts = micro_step(c, net, anchor, opts, x, x_next, mean_old, sig[k].item(), sig[k + 1].item(), txt,
                           txt_neg, amp)
    # at rest between micro-steps: the weights, the optimizer's state, the anchor (no gradient)
    finite = all(bool(torch.isfinite(p.detach().to_local() if hasattr(p, 'to_local') else p.detach()).all())
                 for p in net.parameters())
    return dict(parts=parts, state_gib=allocated_gib(c), params=sum(p.numel() for p in net.parameters()),
                finite=finite)


def update(c, rec, save):
    """Micro-steps at K and 2K blocks, autocast on and off; slopes to 54 blocks and 8 ranks: time, MFU
    and the rank's memory peak with the reward models resident (extrapolate)."""
    import torch.distributed as dist
    if cuda(c):
        from infra.parallel import expandable_segments
        expandable_segments()  # train.py's allocator setting, before CUDA starts
    one_rank(c)
    K, depth = c['blocks'], 54
    Fr, H, W = clip(c)
    rec.update(clip=[Fr, H, W], text=(1000, 256) if cuda(c) else (8, 4), blocks=[K, 2 * K], step=10, runs=[])
    backend = c.get('backend') or 'native'  # train.py's default (the attention phase runs after this one)
    rec['attention_backend'] = backend
    rec['reward_resident_gib'] = reward_resident_gib(c)  # VideoAlign and the VAE's decoder, bf16, on the GPU
    for amp in (True, False):
        for blocks in (K, 2 * K):
            run = dict(autocast=amp, blocks=blocks)
            rec['runs'].append(run)
            try:
                r = update_steps(c, blocks, backend, amp, reps=2 if cuda(c) else 1)
                run.update({p: dict(s=round(t, 4), peak_gib=m) for p, (t, m) in r['parts'].items()})
                run.update(state_gib=r['state_gib'], params=r['params'])
            except Exception as e:
                run['error'] = f'{type(e).__name__}: {str(e).splitlines()[0][:200]}' if str(e) else type(e).__name__
            if cuda(c):
                torch.cuda.empty_cache()
            rec['at_54_blocks_8_ranks'] = extrapolate(c, rec, K, depth, Fr, H, W)  # once both depths ran
            save()
    dist.destroy_process_group()


def extrapolate(c, rec, K, depth, Fr, H, W):
    """Per-block slopes of each part, to `depth` blocks on a rank of 8: each rank runs its own clip's
    forward and backward (as measured), Muon orthogonalises every whole matrix on every rank (as
    measured), the clip reads 1/8 of the gradients; the collectives are not measured at world 1. MFU:
    the micro-step's FLOPs from bench.fullsize's table (a rank of 8 at this clip) over its time.
    The rank's peak: at world 1 a part's peak holds every weight's state (fp32 weights, Muon/AdamW
    state, the anchor: state_gib, measured at rest) and every fp32 gradient (4 bytes a weight) besides
    what the pass itself holds (activations, a block's all-gathered bf16 weights, Muon's temporaries);
    on 8 ranks FSDP2 keeps 1/8 of the state and of the gradients on each, the rest as measured, and the
    reward models stay resident beside them (train.py loads VideoAlign and the decoder on every rank):
    peak = (state + grads) / 8 + (peak - state - grads) + reward, each term slope-extrapolated to 54."""
    flops, table = None, os.path.join(ROOT, 'results', 'fullsize.json')
    if cuda(c) and os.path.exists(table):
        with open(table) as f:
            runs = json.load(f)['runs']
        r = next((r for r in runs if r['what'] == 'train' and r['world'] == 8 and r['lora'] == 0
                  and (r['frames'], r['height'], r['width']) == (Fr, H, W)), None)
        flops = r and sum(r['phases'][p]['flops'] for p in ('anchor forward', 'policy forward', 'backward'))
    env = os.path.join(c['out'], c['files']['env'])
    matmul = json.load(open(env)).get('matmul', {}).get('tflops') if os.path.exists(env) else None
    out = {}
    for amp in (True, False):
        a, b = (next((r for r in rec['runs'] if r['autocast'] == amp and r['blocks'] == n and 'error' not in r
                      and 'muon' in r), None) for n in (K, 2 * K))
        if not (a and b):
            continue
        row = {}
        for p in PARTS:
            slope = (b[p]['s'] - a[p]['s']) / K
            share = 8 if p == 'clip' else 1  # a rank clips its 1/8 of the gradients
            row[p] = dict(s_per_block=round(slope, 5), s=round((a[p]['s'] + (depth - K) * slope) / share, 3),
                          peak_gib_per_block=round((b[p]['peak_gib'] - a[p]['peak_gib']) / K, 3))
        at = lambda key: a[key] + (depth - K) * (b[key] - a[key]) / K  # noqa: E731  to `depth` blocks
        grads = at('params') * 4 / GiB  # fp32 gradients of every weight
        top = {n: max(r[p]['peak_gib'] for p in PARTS) for n, r in ((K, a), (2 * K, b))}
        transient = top[K] + (depth - K) * (top[2 * K] - top[K]) / K - at('state_gib') - grads
        row['peak_gib_per_rank'] = dict(state=round(at('state_gib') / 8, 2), grads=round(grads / 8, 2),
                                        transient=round(transient, 2), reward=rec['reward_resident_gib'],
                                        total=round((at('state_gib') + grads) / 8 + transient
                                                    + rec['reward_resident_gib'], 2))
        micro = sum(row[p]['s'] for p in PARTS[:3])
        step = row['clip']['s'] + row['muon']['s']
        row.update(micro_step_s=round(micro, 3), update_of_iteration_s=round(MICRO_STEPS * micro + step, 1),
                   flops=flops, mfu=flops and round(flops / micro / (PEAK_TFLOPS * 1e12), 3),
                   mfu_of_measured_matmul=flops and matmul and round(flops / micro / (matmul * 1e12), 3))
        out['autocast' if amp else 'no_autocast'] = row
    return out


# ----------------------------------------------------------------------------- 4. the reward side

def qwen2vl_2b(c, qwen_dir):
    """VideoAlign's model as load_videoalign builds it, random: Qwen2-VL-2B at its real depth on a GPU
    (tests/tiny_videoalign.py's sizes on a CPU), its tokenizer the tests' BPE with the special tokens
    at their real ids, the reward tokens added, and a 3-row head."""
    import types
    from transformers import AutoTokenizer, Qwen2VLConfig, Qwen2VLModel
    import tiny_videoalign as tv
    from models.videoalign import REWARD_TOKENS, VideoAlign, _vision_rope_445
    sizes = dict(real_ids=True, extra_vocab=151936 - 151657, lora_r=64, lora_alpha=128,
                 text=dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                           num_key_value_heads=2, mrope_section=[16, 24, 24]),
                 vision=dict(depth=32, embed_dim=1280, mlp_ratio=4, num_heads=16)) if cuda(c) else tv.TINY
    _, ids = tv._tokenizer(qwen_dir, sizes['real_ids'])
    txt = dict(sizes['text'])
    mrope = txt.pop('mrope_section')
    config = Qwen2VLConfig(**txt, hidden_act='silu', max_position_embeddings=32768, rms_norm_eps=1e-6,
                           rope_theta=1e6, rope_scaling={'type': 'mrope', 'mrope_section': mrope},
                           tie_word_embeddings=True, vision_start_token_id=ids['<|vision_start|>'],
                           vision_end_token_id=ids['<|vision_end|>'], image_token_id=ids['<|image_pad|>'],
                           video_token_id=ids['<|video_pad|>'], vision_config=dict(
                               **sizes['vision'], in_chans=3, hidden_size=txt['hidden_size'], patch_size=14,
                               spatial_merge_size=2, spatial_patch_size=14, temporal_patch_size=2))
    tok = AutoTokenizer.from_pretrained(qwen_dir)
    tok.add_tokens(list(REWARD_TOKENS), special_tokens=True)
    config.text_config.vocab_size = len(tok)
    torch.manual_seed(0)
    with torch.device(c['device']):
        model = Qwen2VLModel._from_config(config, dtype=torch.bfloat16, attn_implementation='sdpa')
        head = torch.nn.Linear(txt['hidden_size'], 3, bias=False).to(torch.bfloat16)
    model.to(torch.bfloat16).eval().requires_grad_(False)  # the RoPE buffers in bf16 too, as load_videoalign
    model.visual.rotary_pos_emb.forward = types.MethodType(_vision_rope_445, model.visual.rotary_pos_emb)
    return VideoAlign(model, head.requires_grad_(False), tok), sum(p.numel() for p in model.parameters())


def reward_resident_gib(c):
    """GiB that the reward models hold on a rank all through training: VideoAlign (Qwen2-VL-2B at its real
    sizes on a GPU) and the VAE without its encoder, in bf16, counted on the meta device (nothing built)."""
    from diffusers import AutoencoderKLHunyuanVideo15
    import tiny_hunyuan
    _, P = qwen2vl_2b(dict(c, device='meta'), os.path.join(c['work_dir'], 'qwen_tokenizer'))
    with torch.device('meta'):
        vae = AutoencoderKLHunyuanVideo15(**(dict(latent_channels=32) if cuda(c) else tiny_hunyuan.TINY['vae']))
    decoder = sum(p.numel() for n, p in vae.named_parameters() if not n.startswith('encoder.'))  # load_decoder
    return round((P + decoder) * 2 / GiB, 2)


def reward(c, rec, save):
    """VideoAlign scoring four clips, then the VAE decoding a clip of each size: time, allocated and reserved peaks."""
    dev = c['device']
    sizes = [tuple(s) for s in c['video_sizes']] if cuda(c) else [(9, 64, 96)]
    t = clock(c)
    fn, P = qwen2vl_2b(c, os.path.join(c['work_dir'], 'qwen_tokenizer'))
    rec['videoalign'] = dict(params_b=round(P / 1e9, 3), build_s=round(clock(c) - t, 1))
    Fr, H, W = sizes[0]  # the rollout size
    frames = torch.rand(4, Fr, 3, H, W, device=dev)  # four clips in [0, 1] at the rollout size
    for rep in ('first', 'second'):  # the first includes kernel selection
        peak_gib(c, reset=True)
        t = clock(c)
        scores = fn(frames, ['a red fox runs through deep snow in a pine forest at dawn'] * 4, 24.0)
        sec, (alloc, res) = clock(c) - t, peak_gib(c, reset=True)
        rec['videoalign'][rep] = dict(clips=4, clip=f'{Fr}x{H}x{W}', s=round(sec, 2), peak_gib=alloc, reserved_gib=res,
                                      finite=bool(all(torch.isfinite(v).all() for v in scores.values())))
        save()
    del fn, frames, scores
    if cuda(c):
        torch.cuda.empty_cache()
    from diffusers import AutoencoderKLHunyuanVideo15
    import tiny_hunyuan
    vae_cfg = dict(latent_channels=32) if cuda(c) else tiny_hunyuan.TINY['vae']  # the rest: the released defaults
    torch.manual_seed(0)
    with torch.device(dev):
        vae = AutoencoderKLHunyuanVideo15(**vae_cfg).to(torch.bfloat16)
    vae.requires_grad_(False).eval()
    vae.enable_tiling()  # as hunyuan15.load_decoder
    vae.enable_slicing()
    rec['vae'] = dict(params_m=round(sum(p.numel() for p in vae.parameters()) / 1e6, 1), decode=[])
    for Fr, H, W in sizes:
        z = torch.randn(1, vae_cfg['latent_channels'], (Fr - 1) // 4 + 1, H // 16, W // 16, device=dev)
        peak_gib(c, reset=True)
        t = clock(c)
        with torch.no_grad():  # hunyuan15.load_decoder's decode
            frames = vae.decode(z.to(vae.dtype) / vae.config.scaling_factor, return_dict=False)[0]
        sec, (alloc, res) = clock(c) - t, peak_gib(c, reset=True)
        rec['vae']['decode'].append(dict(clip=f'{Fr}x{H}x{W}', s=round(sec, 2), peak_gib=alloc, reserved_gib=res,
                                         frames=list(frames.shape)))
        del frames
        save()


# ----------------------------------------------------------------------------- 1. train.py itself

def smoke(c, rec, save):
    """train.py on the tests' tiny models: an iteration, a resume that trains the next and exports."""
    from tiny_hunyuan import make_tiny_hunyuan
    from tiny_videoalign import make_tiny_videoalign
    work = os.path.join(c['work_dir'], 'smoke')
    root = make_tiny_hunyuan(os.path.join(work, 'hv'))
    ckpt, qwen = make_tiny_videoalign(os.path.join(work, 'va'))
    prompts, out = os.path.join(work, 'prompts.txt'), os.path.join(work, 'out')
    with open(prompts, 'w') as f:
        f.write('a red car drives at night\na cat walks on the grass\na dog runs in the park\na boat on a lake\n')
    args = ['train.py', f'--model={root}', '--reward_model=videoalign', f'--videoalign_dir={ckpt}',
            f'--qwen_dir={qwen}', '--eval_metrics=', f'--device={c["device"]}', '--num_frames=9', '--height=32',
            '--width=32', '--fps=8', '--num_steps=2', '--prompts_per_iter=2', '--group_size=2', '--rollout_batch=2',
            '--train_batch=1', '--eval_every=0', '--eval_videos=0', '--save_every=1', f'--train_prompts={prompts}',
            f'--eval_prompts={prompts}', f'--out_dir={out}']  # train.py's own attention backend: the program as shipped
    torchrun = lambda n: [sys.executable, '-m', 'torch.distributed.run', '--standalone',  # noqa: E731
                          f'--nproc_per_node={n}']
    # a GPU: one rank with NCCL both times; a CPU: 2 gloo ranks, then the resume in one plain process (another
    # world size, as a checkpoint allows)
    runs = (('train', torchrun(1 if cuda(c) else 2), ['--max_iters=1', '--export_dtype=']),
            ('resume', torchrun(1) if cuda(c) else [sys.executable], ['--max_iters=2', '--init_from=resume']))
    rec.update(backend='nccl' if cuda(c) else 'gloo', runs=[])
    env = dict(os.environ, OMP_NUM_THREADS='1', TOKENIZERS_PARALLELISM='false')
    for name, launch, extra in runs:
        t = clock(c)
        sys.stdout.flush()
        # train.py's output into this phase's own (its log, whose tail gpu_check copies to <out> as it runs)
        p = subprocess.run(launch + args + extra, cwd=ROOT, env=env, stderr=subprocess.STDOUT)
        how = f"torchrun x{launch[-1].split('=')[1]}" if len(launch) > 1 else 'python'
        rec['runs'].append(dict(name=name, how=how, rc=p.returncode, s=round(clock(c) - t, 1)))
        save()
        if p.returncode:
            raise RuntimeError(f'train.py ({name}) exited {p.returncode}')
    with open(os.path.join(out, 'metrics.jsonl')) as f:
        rows = [json.loads(line) for line in f if 'reward' in line]
    rec['iterations'] = [dict(iter=r['iter'], ratio_max=r.get('ratio_max'), clipfrac=r.get('clipfrac'),
                              peak_mem_gb=r.get('peak_mem_gb'), t_update=round(r['t_update'], 2)) for r in rows
                         if 'reward' in r]
    from diffusers import HunyuanVideo15Transformer3DModel
    exported = HunyuanVideo15Transformer3DModel.from_pretrained(os.path.join(out, 'export'))
    rec['export'] = dict(loaded=True, params_m=round(sum(p.numel() for p in exported.parameters()) / 1e6, 2))
    assert [r['iter'] for r in rec['iterations']] == [1, 2], rec['iterations']
