"""
The phases of bench/gpu_check.py, each run in a process of its own by it:

    python -m bench.gpu_phases NAME '<the check's settings as JSON>'   # writes <out>/<i>_<NAME>.json

A phase fills a record and writes it (save()) whenever it has something to keep, so a phase killed at
its time limit still leaves what it measured; gpu_check adds its exit, status and time. Every model
is random, at the real width on a GPU (the tests' tiny sizes on a CPU), and constructed directly on
the device: under `with torch.device(dev)` each module runs its own initialisation there, as
diffusers' and transformers' constructors do, and nothing of 8.3B is ever built on the host.
Here: env, attention, drift and the phase's process (main); smoke, update and reward (train.py
itself, the update, the reward models) in bench/gpu_phases_train.py; what they share in
bench/gpu_common.py. Imports run one way: this file -> gpu_phases_train -> gpu_common.
Tested by: python -m pytest tests/test_gpu_check.py (the slow tier runs every phase on a CPU)
"""
import json
import os
import sys

import torch

from bench import gpu_phases_train as train_phases
from bench.gpu_common import GiB, ROOT, clock, cuda, event_ms, latents, one_rank, peak_gib, prompt_tokens, \
    sync, text, transformer, transformer_config, video_tokens, clip

OFFLINE = ('HF_HUB_OFFLINE', 'TRANSFORMERS_OFFLINE')  # the hub's switches: '1' where no network is
WHEELS = ('diffusers', 'transformers', 'peft')  # the carried wheels' roots (bench/gpu_image.ROOTS, gpu_wheels.sh)


# ----------------------------------------------------------------------------- 0. environment

def env(c, rec, save):
    """What the other phases need, failing fast with one line (rec['error']): the carried wheels import,
    the hub is switched offline, a one-rank process group all-reduces on the device (NCCL on a GPU).
    Then versions, a bf16 matmul's TFLOP/s, and the kernel torch's SDPA runs for a block's attention."""
    import platform
    from torch.profiler import ProfilerActivity, profile

    def stop(line):
        rec['error'] = line
        save()
        raise SystemExit(line)
    rec['versions'] = dict(python=platform.python_version(), torch=torch.__version__, cuda=torch.version.cuda,
                           cudnn=torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None)
    for pkg in WHEELS + ('triton', 'flash_attn', 'flash_attn_interface'):
        try:
            rec['versions'][pkg] = getattr(__import__(pkg), '__version__', 'present')
        except ImportError as e:
            rec['versions'][pkg] = None
            if pkg in WHEELS:
                stop(f'env: {pkg} does not import ({e}): bash bench/gpu_wheels.sh fetches the wheels into '
                     '.whl/, which the check carries and installs')
    if off := [k for k in OFFLINE if os.environ.get(k) != '1']:
        stop(f'env: {", ".join(off)} not 1: a hub lookup would wait for a network this machine lacks')
    t = clock(c)
    one_rank(c)
    import torch.distributed as dist
    x = torch.ones(1, device=c['device'])
    dist.all_reduce(x)
    sync(c)
    rec['all_reduce'] = dict(backend=dist.get_backend(), ok=x.item() == 1.0, s=round(clock(c) - t, 2))
    dist.destroy_process_group()
    if not rec['all_reduce']['ok']:
        stop(f'env: a one-rank all-reduce of 1 gave {x.item()}')
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
    S = video_tokens(*clip(c)) + sum(prompt_tokens(c)[0])  # video + the prompt's text
    q = torch.randn(1, cfg['num_attention_heads'], S, cfg['attention_head_dim'], device=dev, dtype=dt)
    with profile(activities=[ProfilerActivity.CUDA if cuda(c) else ProfilerActivity.CPU]) as prof:
        torch.nn.functional.scaled_dot_product_attention(q, q, q)
        sync(c)
    # a GPU's kernels (device time), else the CPU's aten ops; the longest first
    ev = [(e.self_device_time_total if cuda(c) else e.cpu_time_total, e.key) for e in prof.key_averages()
          if (e.self_device_time_total > 0) == cuda(c) and (cuda(c) or 'attention' in e.key)]
    rec['sdpa'] = dict(shape=list(q.shape), dtype=str(dt), kernels=[k[:100] for _, k in sorted(ev, reverse=True)[:3]])


# ----------------------------------------------------------------------------- 3. attention backends

BACKENDS = ('native', '_native_flash', '_native_cudnn', '_native_efficient', 'flash', '_flash_3')
REF_HEADS = 2  # heads of the fp32 reference at a time: an fp32 path without a fused kernel holds the
               # (B, h, S, S) scores, 2.7 GB a head at 18306 tokens and B = 2, several copies in its backward
GATE = 2.0     # a backend passes if each of its four errors is within GATE x native's own
FLOOR = 1e-5   # the least tolerance: where the compute is fp32 (a CPU), native's error is ~0


def reference(q, k, v, grad, lengths):
    """(out, dq, dk, dv) of attend in fp32 from the same inputs (bf16 on a GPU, upcast exactly), REF_HEADS
    heads at a time: what every backend, native included, is measured against."""
    from models.attention import attend, backend as backend_of
    ref = [torch.empty(q.shape, dtype=torch.float32, device=q.device) for _ in range(4)]
    for h in range(0, q.shape[2], REF_HEADS):
        hs = slice(h, h + REF_HEADS)
        q32, k32, v32 = (t.detach()[:, :, hs].float().requires_grad_() for t in (q, k, v))  # (B, S, h, d)
        out = attend(q32, k32, v32, lengths, backend_of('native'))
        out.backward(grad[:, :, hs].float())
        for r, x in zip(ref, (out.detach(), q32.grad, k32.grad, v32.grad)):
            r[:, :, hs] = x
    return ref


def errors(got, ref):
    """Each of (out, dq, dk, dv)'s relative error |x - r| / |r| (norms over the whole tensor). The norm, not
    the largest element: a wrong scale or mask moves every element, while the largest of bf16's roundings is
    one element's luck (measured on a CPU, bf16 vs fp32: largest 2.4-6.7e-3, norm 2.2-3.4e-3)."""
    return [((g.float() - r).norm() / r.norm()).item() for g, r in zip(got, ref)]


def gate(err, native_err):
    """(passes, tolerances): each error within GATE x native's own against the same reference (FLOOR at
    least): a kernel as exact as the one train.py runs by default, tensor by tensor, gradients included."""
    tol = [max(GATE * e, FLOOR) for e in native_err]
    return all(e <= t for e, t in zip(err, tol)), tol


def attention(c, rec, save):
    """models.attention.attend (valid_tokens: each sample over its own valid tokens, no mask) of a CFG
    pair at the training size (attention_size; a CPU: 9x64x96) on each backend: its output and q, k, v
    gradients against an fp32 reference (reference()), gated at GATE x native's own errors (gate());
    forward and forward + backward timed with CUDA events, TFLOP/s of the attention's own FLOPs (4 n^2 heads
    d a sample forward, 2.5x that backward). The fastest forward + backward that passes, and then runs one
    update micro-step of a one-block transformer on it (train.py's path: FSDP2, checkpointing, Muon), is
    the one to make train.py's attention_backend on this GPU (the update phase has already run on native)."""
    from models.attention import attend, backend as backend_of
    cfg = transformer_config(c)
    heads, d = cfg['num_attention_heads'], cfg['attention_head_dim']
    dev, dt = c['device'], torch.bfloat16 if cuda(c) else torch.float32
    Fr, H, W = c['attention_size'] if cuda(c) else (9, 64, 96)
    V = video_tokens(Fr, H, W)
    lengths = [V + sum(n) for n in prompt_tokens(c)]  # the prompt's branch, the negative's
    S = max(lengths) + 1  # + the masked image token
    rec.update(size=f'{Fr}x{H}x{W}', tokens=dict(video=V, prompt=lengths[0], negative=lengths[1], padded=S),
               heads=heads, head_dim=d, gate=f'each error <= {GATE} x native\'s (>= {FLOOR})', rows=[])
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, S, heads, d, device=dev, dtype=dt, requires_grad=True) for _ in range(3))
    grad = torch.randn(2, S, heads, d, device=dev, dtype=dt)
    fwd_flops = sum(4 * n * n * heads * d for n in lengths)
    ref, native_err = reference(q, k, v, grad, lengths), None
    for name in BACKENDS:
        row = dict(backend=name)
        rec['rows'].append(row)
        try:
            b = backend_of(name)
        except SystemExit as e:
            row['skipped'] = str(e.code)[:160]
            continue
        try:
            for t in (q, k, v):
                t.grad = None
            out = attend(q, k, v, lengths, b)
            out.backward(grad)
            err = errors([out.detach()] + [t.grad for t in (q, k, v)], ref)  # out, dq, dk, dv
            native_err = native_err or err  # native's, the first that ran
            row['errors'] = dict(zip(('out', 'dq', 'dk', 'dv'), (float(f'{e:.3g}') for e in err)))
            row['passes'], tol = gate(err, native_err)
            row['tolerance'] = [float(f'{t:.3g}') for t in tol]
            del out
            with torch.no_grad():
                row['fwd_ms'] = event_ms(c, lambda: attend(q, k, v, lengths, b))

            def both():
                attend(q, k, v, lengths, b).backward(grad)
            row['fwd_bwd_ms'] = event_ms(c, both)
            row['fwd_tflops'] = float(f"{fwd_flops / row['fwd_ms'] / 1e9:.3g}")
            row['fwd_bwd_tflops'] = float(f"{3.5 * fwd_flops / row['fwd_bwd_ms'] / 1e9:.3g}")
        except Exception as e:  # a backend that fails on this device or shape: recorded
            row['error'] = f'{type(e).__name__}: {str(e).splitlines()[0][:160]}' if str(e) else type(e).__name__
        save()
    del q, k, v, grad, ref
    import torch.distributed as dist
    one_rank(c)  # the micro-step's FSDP2 wraps over a world of 1
    for row in sorted(passing(rec['rows']), key=lambda r: r['fwd_bwd_ms']):  # the fastest first
        try:
            r = train_phases.update_steps(c, 1, row['backend'], amp=True, reps=1)
            row['micro_step'] = dict(s=round(sum(t for t, _ in r['parts'].values()), 3), finite=r['finite'])
        except Exception as e:
            row['micro_step'] = dict(error=f'{type(e).__name__}: {str(e).splitlines()[0][:160]}')
        save()
        if row['micro_step'].get('finite'):  # found: the slower ones need no micro-step
            break
    dist.destroy_process_group()
    rec['fastest'] = fastest_correct(rec['rows'])


def passing(rows):
    """The rows whose backend ran and passed the gate."""
    return [r for r in rows if r.get('passes') and 'fwd_bwd_ms' in r]


def fastest_correct(rows):
    """The backend of the fastest forward + backward among rows that passed the gate and then ran an update
    micro-step of the transformer with finite weights (None: none did)."""
    ok = [r for r in passing(rows) if r.get('micro_step', {}).get('finite')]
    return min(ok, key=lambda r: r['fwd_bwd_ms'])['backend'] if ok else None


# ----------------------------------------------------------------------------- 5. ratio drift

def drift(c, rec, save):
    """The rollout-shaped forward (rollout_batch clips, no grad) against the update-shaped one (one clip,
    grad, gradient checkpointing) at the same weights and x_t, through the training run's path: the
    transformer wrapped by models.policy.shard (FSDP2 over one rank, fp32 master weights, bf16 compute on
    a GPU), policy.velocity and sde.step: the log-prob gap that the update's ratio sees at theta ==
    theta_old, at `steps` of sde.sigmas(20, 5) (a late one and a middle one); the peaks are a rank's of
    that path at world 1 (every weight its own: 8 ranks hold an eighth of them)."""
    import torch.distributed as dist
    import sde
    from models.policy import shard, velocity
    cfg = transformer_config(c)
    Fr, H, W = clip(c)
    dev, B, g = c['device'], c['rollout_batch'], torch.Generator().manual_seed(0)
    one_rank(c)
    t = clock(c)
    net = transformer(c, cfg)
    net.enable_gradient_checkpointing()  # as train.py loads the policy; only a grad forward checkpoints
    shard(net, net.transformer_blocks, cuda=cuda(c))  # load_policy's wrapping
    rec.update(build_s=round(clock(c) - t, 1), params_b=round(sum(p.numel() for p in net.parameters()) / 1e9, 3),
               clip=[Fr, H, W], rollout_batch=B, train_batch=1, path='models.policy.shard (FSDP2, 1 rank)',
               steps=[])
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
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- the phase's process

PHASES = dict(env=env, smoke=train_phases.smoke, update=train_phases.update, attention=attention,
              reward=train_phases.reward, drift=drift)


def main(name, c):
    path = os.path.join(c['out'], c['files'][name])
    rec = dict(phase=name, device=c['device'], status='running')

    def save():  # atomically: a phase killed mid-write leaves the last whole record
        with open(path + '.tmp', 'w') as f:
            json.dump(rec, f, indent=1)
        os.replace(path + '.tmp', path)
    if not cuda(c):
        torch.set_num_threads(1)  # 2 shared cores
    save()
    PHASES[name](c, rec, save)
    rec['status'] = 'ok'
    save()


if __name__ == '__main__':
    sys.path.insert(0, ROOT)
    main(sys.argv[1], json.loads(sys.argv[2]))
