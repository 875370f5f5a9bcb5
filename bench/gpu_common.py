"""
What the phases of bench/gpu_check.py share (bench/gpu_phases.py: env, attention, drift and the phase's
process; bench/gpu_phases_train.py: smoke, update, reward): the device's clock and memory peaks, the
transformer at the real width (random, constructed on the device) or the tests' tiny one on a CPU, the
inputs of a clip, and a process group of one rank. Imports run one way: gpu_phases -> gpu_phases_train
-> gpu_common, and gpu_phases -> gpu_common.
Tested by: python -m pytest tests/test_gpu_check.py
"""
import json
import os
import socket
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the tests' tiny transformer (bench/fullsize_gpu.py's TINY): what a CPU runs in place of the 8.3B one
TINY = dict(in_channels=9, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=2,
            num_refiner_layers=1, text_embed_dim=16, text_embed_2_dim=8, image_embed_dim=12,
            rope_axes_dim=(2, 2, 4))
GiB = 2 ** 30


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


def allocated_gib(c):
    """What tensors hold now, GiB (a CPU: the process's peak RSS, which is all it can say)."""
    return round(torch.cuda.memory_allocated() / GiB, 3) if cuda(c) else peak_gib(c)[0]


def clock(c):
    """now() in seconds after the device's queued work is done (a sync point)."""
    sync(c)
    return time.perf_counter()


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
    """(frames, height, width) of the drift and update phases: the settings' on a GPU, 9x64x96 on a CPU."""
    return (c['num_frames'], c['height'], c['width']) if cuda(c) else (9, 64, 96)


def latents(cfg, Fr, H, W):
    return cfg['out_channels'], (Fr - 1) // 4 + 1, H // 16, W // 16       # (C, F, h, w)


def video_tokens(Fr, H, W):
    """The transformer's video tokens of a clip: latent frames x (H / 16) x (W / 16) (VAE 4x16x16, patch 1)."""
    return ((Fr - 1) // 4 + 1) * (H // 16) * (W // 16)


def text(cfg, B, n, dev, g):
    """batch_text's four tensors for B clips of one prompt of n = (Qwen, ByT5) valid tokens; ByT5 0: one
    masked token (a prompt without quoted text, as encode_prompts keeps it). Random embeddings."""
    (n1, n2), d1, d2 = n, cfg['text_embed_dim'], cfg['text_embed_2_dim']
    e1 = torch.randn(1, n1, d1, generator=g).to(dev).expand(B, -1, -1)
    e2 = torch.randn(1, max(n2, 1), d2, generator=g).to(dev).expand(B, -1, -1)
    return [e1, torch.ones(B, n1, device=dev), e2, torch.full((B, max(n2, 1)), float(n2 > 0), device=dev)]


def prompt_tokens(c):  # (Qwen, ByT5) of the prompt and of the negative prompt
    return ((256, 32), (8, 0)) if cuda(c) else ((8, 4), (3, 0))


def one_rank(c):
    """A process group of one rank (NCCL on a GPU, gloo on a CPU): FSDP2 over a world of 1, as
    models.policy.shard wraps the policy in train.py."""
    import torch.distributed as dist
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        port = s.getsockname()[1]
    if cuda(c):
        torch.cuda.set_device(0)
    dist.init_process_group('nccl' if cuda(c) else 'gloo', init_method=f'tcp://127.0.0.1:{port}', rank=0,
                            world_size=1)
