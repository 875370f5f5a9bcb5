"""
The phases of bench/gpu_check.py, each run in a process of its own by it:

    python -m bench.gpu_phases NAME '<the check's settings as JSON>'   # writes <out>/<i>_<NAME>.json

A phase fills a record and writes it (save()) whenever it has something to keep, so a phase killed at
its time limit still leaves what it measured; gpu_check adds its exit, status and time. Every model
is random, at the real width on a GPU (the tests' tiny sizes on a CPU), and constructed directly on
the device: under `with torch.device(dev)` each module runs its own initialisation there, as
diffusers' and transformers' constructors do, and nothing of 8.3B is ever built on the host.
Phases 0-2 here; 3-5 (the update, the reward models, train.py itself) in bench/gpu_phases_train.py.
Tested by: python -m pytest -m slow tests/test_gpu_check.py
"""
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the tests' tiny transformer (bench/fullsize_gpu.py's TINY): what a CPU runs in place of the 8.3B one
TINY = dict(in_channels=9, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=2,
            num_refiner_layers=1, text_embed_dim=16, text_embed_2_dim=8, image_embed_dim=12,
            rope_axes_dim=(2, 2, 4))
GiB = 2 ** 30


# ----------------------------------------------------------------------------- shared by the phases

def cuda(c):
    return c['device'] == 'cuda'


def sync(c):
    if cuda(c):
        torch.cuda.synchronize()


def peak_gib(c, reset=False):
    """(allocated, reserved) peaks in GiB since the last reset; on a CPU the process's peak RSS twice."""
    if not cuda(c):
        import resource
        r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GiB
        return round(r, 3), round(r, 3)
    out = (round(torch.cuda.max_memory_allocated() / GiB, 3), round(torch.cuda.max_memory_reserved() / GiB, 3))
    if reset:
        torch.cuda.reset_peak_memory_stats()
    return out


def clock(c):
    """now() in seconds after the device's queued work is done (a sync point)."""
    sync(c)
    return time.perf_counter()


def transformer_config(c, blocks=None):
    """The 8.3B transformer's config (assets/, the released one) on a GPU, the tiny one on a CPU."""
    if cuda(c):
        with open(os.path.join(ROOT, 'assets', 'hunyuanvideo15_480p_t2v_transformer.json')) as f:
            cfg = {k: v for k, v in json.load(f).items() if not k.startswith('_')}
    else:
        cfg = dict(TINY)
    return dict(cfg, num_layers=blocks or cfg['num_layers'])


def transformer(c, cfg, backend='native'):
    """HunyuanVideo15Transformer3DModel of cfg in float32 (the trainer's master weights), constructed on the
    device with diffusers' own initialisation; its blocks' attention as load_transformer sets it."""
    from diffusers import HunyuanVideo15Transformer3DModel as T
    from models.hunyuan15 import set_attention
    torch.manual_seed(0)
    with torch.device(c['device']):
        net = T.from_config(cfg)
    return set_attention(net, 'valid_tokens', backend)


def clip(c):
    """(frames, height, width) of phases 1 and 3: the settings' on a GPU, 9x64x96 on a CPU."""
    return (c['num_frames'], c['height'], c['width']) if cuda(c) else (9, 64, 96)


def latents(cfg, Fr, H, W):
    return cfg['out_channels'], (Fr - 1) // 4 + 1, H // 16, W // 16       # (C, F, h, w)


def text(cfg, B, n, dev, g):
    """batch_text's four tensors for B clips of one prompt of n = (Qwen, ByT5) valid tokens; ByT5 0: one
    masked token (a prompt without quoted text, as encode_prompts keeps it). Random embeddings."""
    (n1, n2), d1, d2 = n, cfg['text_embed_dim'], cfg['text_embed_2_dim']
    e1 = torch.randn(1, n1, d1, generator=g).to(dev).expand(B, -1, -1)
    e2 = torch.randn(1, max(n2, 1), d2, generator=g).to(dev).expand(B, -1, -1)
    return [e1, torch.ones(B, n1, device=dev), e2, torch.full((B, max(n2, 1)), float(n2 > 0), device=dev)]


def prompt_tokens(c):  # (Qwen, ByT5) of the prompt and of the negative prompt
    return ((256, 32), (8, 0)) if cuda(c) else ((8, 4), (3, 0))


# ----------------------------------------------------------------------------- 0. environment

def env(c, rec, save):
    """Versions, a bf16 matmul's TFLOP/s, and the kernel torch's SDPA runs for a block's attention."""
    import platform
    from torch.profiler import ProfilerActivity, profile
    rec['versions'] = dict(python=platform.python_version(), torch=torch.__version__, cuda=torch.version.cuda,
                           cudnn=torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None)
    for pkg in ('diffusers', 'transformers', 'peft', 'triton', 'flash_attn', 'flash_attn_interface'):
        try:
            rec['versions'][pkg] = getattr(__import__(pkg), '__version__', 'present')
        except ImportError:
            rec['versions'][pkg] = None
    dev, dt = c['device'], torch.bfloat16 if cuda(c) else torch.float32
    if cuda(c):
        p = torch.cuda.get_device_properties(0)
        rec['gpu'] = dict(name=p.name, sms=p.multi_processor_count, memory_gib=round(p.total_memory / GiB, 1),
                          capability=f'{p.major}.{p.minor}')
    save()
    n = 8192 if cuda(c) else 512
    a, b = torch.randn(n, n, device=dev, dtype=dt), torch.randn(n, n, device=dev, dtype=dt)
    for _ in range(3):
        a @ b
    reps, t = 10, clock(c)
    for _ in range(reps):
        a @ b
    rec['matmul'] = dict(n=n, dtype=str(dt), tflops=float(f'{2 * n ** 3 * reps / (clock(c) - t) / 1e12:.3g}'))
    save()
    # one call of a block's joint attention as valid_tokens makes it (one sample, no mask) at the rollout size
    cfg = transformer_config(c)
    Fr, H, W = clip(c)
    S = ((Fr - 1) // 4 + 1) * (H // 16) * (W // 16) + sum(prompt_tokens(c)[0])  # video + the prompt's text
    q = torch.randn(1, cfg['num_attention_heads'], S, cfg['attention_head_dim'], device=dev, dtype=dt)
    with profile(activities=[ProfilerActivity.CUDA if cuda(c) else ProfilerActivity.CPU]) as prof:
        torch.nn.functional.scaled_dot_product_attention(q, q, q)
        sync(c)
    # a GPU's kernels (device time), else the CPU's aten ops; the longest first
    ev = [(e.self_device_time_total if cuda(c) else e.cpu_time_total, e.key) for e in prof.key_averages()
          if (e.self_device_time_total > 0) == cuda(c) and (cuda(c) or 'attention' in e.key)]
    rec['sdpa'] = dict(shape=list(q.shape), dtype=str(dt), kernels=[k[:100] for _, k in sorted(ev, reverse=True)[:3]])


# ----------------------------------------------------------------------------- 1. ratio drift

def drift(c, rec, save):
    """The rollout-shaped forward (rollout_batch clips, no grad) against the update-shaped one (one clip,
    grad, gradient checkpointing) at the same weights and x_t, through policy.velocity and sde.step: the
    log-prob gap that the update's ratio sees at theta == theta_old, per step of sde.sigmas(20, 5)."""
    import sde
    from models.policy import velocity
    cfg = transformer_config(c)
    Fr, H, W = clip(c)
    dev, B, g = c['device'], c['rollout_batch'], torch.Generator().manual_seed(0)
    t = clock(c)
    net = transformer(c, cfg)
    net.enable_gradient_checkpointing()  # as train.py loads the policy; only a grad forward checkpoints
    rec.update(build_s=round(clock(c) - t, 1), params_b=round(sum(p.numel() for p in net.parameters()) / 1e9, 3),
               clip=[Fr, H, W], rollout_batch=B, train_batch=1, steps=[])
    shape = latents(cfg, Fr, H, W)
    (pos, neg), sig = prompt_tokens(c), sde.sigmas(20, 5.0)
    txt, txt_neg = text(cfg, B, pos, dev, g), text(cfg, B, neg, dev, g)
    one = lambda tx, i: [u[i:i + 1] for u in tx]  # noqa: E731  clip i's text
    for k in c['steps']:
        s, s_next = sig[k].item(), sig[k + 1].item()
        x = ((1 - s) * torch.randn(B, *shape, generator=g) + s * torch.randn(B, *shape, generator=g)).to(dev)
        peak_gib(c, reset=True)
        t = clock(c)
        with torch.no_grad():  # the rollout: B clips in one forward
            v = velocity(net, x, torch.full((B,), s, device=dev), txt, c['cfg'], txt_neg)   # (B, C, F, h, w)
            roll = sde.step(x, v, s, s_next, 'sage', 0.5, noise=torch.randn(x.shape, generator=g).to(dev))
        t_roll, peak = clock(c) - t, peak_gib(c, reset=True)
        dlogp, dv = [], []
        for i in range(B):  # the update: one clip a forward, with grad (and so checkpointing)
            vi = velocity(net, x[i:i + 1], torch.full((1,), s, device=dev), one(txt, i), c['cfg'], one(txt_neg, i))
            new = sde.step(x[i:i + 1], vi, s, s_next, 'sage', 0.5, x_next=roll.x_next[i:i + 1])
            dlogp.append((new.logp.detach() - roll.logp[i]).item())
            dv.append(((vi.detach() - v[i:i + 1]).norm() / v[i:i + 1].norm()).item())
            del vi, new  # the graph (checkpointed blocks: their inputs only)
        ratio = torch.tensor(dlogp, dtype=torch.float64).exp()
        rec['steps'].append(dict(step=k, sigma=round(s, 4), std=round(roll.std[0].item(), 4),
                                 max_abs_dlogp=max(abs(d) for d in dlogp), max_rel_dv=max(dv),
                                 frac_beyond_clip=((ratio - 1).abs() > c['clip_range']).double().mean().item(),
                                 rollout_s=round(t_roll, 3), rollout_peak_gib=peak[0], rollout_reserved_gib=peak[1]))
        save()


# ----------------------------------------------------------------------------- 2. attention backends

BACKENDS = ('native', '_native_flash', '_native_cudnn', '_native_efficient', 'flash', '_flash_3')


def attention(c, rec, save):
    """models.attention.attend (valid_tokens: each sample over its own valid tokens, no mask) of a CFG
    pair at each clip size on each backend: forward and forward + backward timed with CUDA events,
    TFLOP/s of the attention's own FLOPs (4 n^2 heads d a sample forward, 2.5x that backward)."""
    from models.attention import attend, backend as backend_of
    cfg = transformer_config(c)
    heads, d = cfg['num_attention_heads'], cfg['attention_head_dim']
    dev, dt = c['device'], torch.bfloat16 if cuda(c) else torch.float32
    sizes = [tuple(s) for s in c['video_sizes']] if cuda(c) else [(9, 64, 96)]
    rec['rows'] = []
    for Fr, H, W in sizes:
        V = ((Fr - 1) // 4 + 1) * (H // 16) * (W // 16)
        lengths = [V + sum(n) for n in prompt_tokens(c)]  # the prompt's branch, the negative's
        S = max(lengths) + 1  # + the masked image token
        torch.manual_seed(0)
        q, k, v = (torch.randn(2, S, heads, d, device=dev, dtype=dt, requires_grad=True) for _ in range(3))
        grad = torch.randn(2, S, heads, d, device=dev, dtype=dt)
        fwd_flops = sum(4 * n * n * heads * d for n in lengths)
        ref = None
        for name in BACKENDS:
            row = dict(size=f'{Fr}x{H}x{W}', tokens=lengths, backend=name)
            rec['rows'].append(row)
            try:
                b = backend_of(name)
            except SystemExit as e:
                row['skipped'] = str(e.code)[:160]
                continue
            try:
                with torch.no_grad():
                    out = attend(q, k, v, lengths, b)
                    ref = out if ref is None else ref  # native's, the first that ran
                    row['max_rel_diff'] = ((out - ref).abs().max() / ref.abs().max()).item()
                    row['fwd_ms'] = event_ms(c, lambda: attend(q, k, v, lengths, b))

                def both():
                    attend(q, k, v, lengths, b).backward(grad)
                both()  # warm-up
                row['fwd_bwd_ms'] = event_ms(c, both)
                row['fwd_tflops'] = float(f"{fwd_flops / row['fwd_ms'] / 1e9:.3g}")
                row['fwd_bwd_tflops'] = float(f"{3.5 * fwd_flops / row['fwd_bwd_ms'] / 1e9:.3g}")
            except Exception as e:  # a backend that fails on this device or shape: recorded
                row['error'] = f'{type(e).__name__}: {str(e).splitlines()[0][:160]}' if str(e) else type(e).__name__
            for t in (q, k, v):
                t.grad = None
            save()
        del q, k, v, grad, ref
    ran = [r for r in rec['rows'] if 'fwd_bwd_ms' in r and r['size'] == rec['rows'][-1]['size']]
    if ran:  # the fastest forward + backward at the largest clip: the backend to run on this GPU
        rec['fastest'] = min(ran, key=lambda r: r['fwd_bwd_ms'])['backend']


def event_ms(c, fn, reps=3):
    """Milliseconds of fn() (mean of reps after a warm-up), CUDA events on a GPU, perf_counter on a CPU."""
    fn()
    if not cuda(c):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        return round(1000 * (time.perf_counter() - t) / reps, 3)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return round(start.elapsed_time(end) / reps, 3)


# ----------------------------------------------------------------------------- the phase's process

def main(name, c):
    from bench import gpu_phases_train as T
    phases = dict(env=env, drift=drift, attention=attention, update=T.update, reward=T.reward, smoke=T.smoke)
    path = os.path.join(c['out'], c['files'][name])
    rec = dict(phase=name, device=c['device'], status='running')

    def save():  # atomically: a phase killed mid-write leaves the last whole record
        with open(path + '.tmp', 'w') as f:
            json.dump(rec, f, indent=1)
        os.replace(path + '.tmp', path)
    if not cuda(c):
        torch.set_num_threads(1)  # 2 shared cores
    save()
    phases[name](c, rec, save)
    rec['status'] = 'ok'
    save()


if __name__ == '__main__':
    sys.path.insert(0, ROOT)
    main(sys.argv[1], json.loads(sys.argv[2]))
