"""
HunyuanVideo 1.5 (8.3B) at full size without a GPU: per-GPU memory by category and FLOPs of one
training micro-step and one rollout forward, measured by torch on fake tensors (real shapes and
dtypes, no storage), and a ready check for the day GPUs are at hand.

    python -m bench.fullsize                           # the estimate -> results/fullsize.{md,json}, README block
    python -m bench.fullsize --only=train & python -m bench.fullsize --only=rollout,lora; \
        python -m bench.fullsize --reuse=True          # the same in two parallel parts, then assembled
    python -m bench.fullsize --gpu                     # one GPU: LoRA micro-step, rollout forward, bf16 batch invariance
    torchrun --nproc_per_node=8 -m bench.fullsize --gpu   # all GPUs: a full fine-tune micro-step (FSDP2)
    python -m bench.fullsize --gpu --tiny --device=cpu    # the check at tiny size on a CPU (tests/test_fullsize.py)
    python -m bench.fullsize --only=wan,wansp --reuse=True  # the Wan 2.1 rows alone (the others read back),
    python -m bench.fullsize --reuse=True              # then the report and README block from every kept run

Wan 2.1 T2V 1.3B and 14B (wan.py; assets/wan21_t2v_*_transformer.json, the released configs) are
measured the same way at their own clip size, 81x480x832: a full fine-tune on 8 GPUs (FSDP2) and on
one GPU (no FSDP: fp32 master weights, bf16 autocast, as load_policy keeps them), and LoRA r64 on
one GPU; their own section of fullsize.md and rows of the README block. Wan's attention has no mask
(wan.py): on a GPU flash attention takes it, which allocates what the memory-efficient kernel does.

How the estimate measures: the transformer is built from its config (data:
assets/hunyuanvideo15_480p_t2v_transformer.json, the diffusers class defaults) on the meta device,
sharded with model.shard (the trainer's FSDP2 layout: every block, then the root; bf16 params, fp32
reduce) over a fake process group of 8 ranks played by this one process, and materialised as fake
tensors, its blocks' attention set by hunyuan15.set_attention as the load path sets it, with
MaskedKeysAttention (attention='masked_keys': the valid tokens' lengths would be data a fake tensor
does not hold; train.py's default, valid_tokens, computes at most these attention FLOPs and holds no
mask, bench/attention.py); --processor=diffusers for diffusers' own, whose runs are also measured
for the comparison as diffusers_*. One micro-step runs as train.py's step_losses does (the anchor's no-grad forward with its
weights swapped in, the policy's forward with both CFG branches and grad, backward with per-block
checkpointing, then clip + AdamW), under FSDPMemTracker (bytes by category: sharded / gathered
params, grads, optimizer state, activations, backward temporaries) and FlopCounterMode's per-op
formulas. Each full-size run takes 1.5-20 min on 2 busy shared cores (the trackers' per-op
bookkeeping), about 45 min in all; the parts can run in parallel (above).
tests/test_fullsize.py checks the method: the fake-tensor peak of a small config against the peak
resident memory of the same config run with real tensors.

Two artefacts of measuring this way, removed (each would have looked like a GPU cost):
- FlopCounterMode's module hooks keep every checkpointed block's recomputed activations alive until
  the step ends (+36% peak on the test config, seen in real resident memory too; 291 GB at full
  size): FlopCount below applies the same per-op formulas without module hooks.
- DTensor computes output shapes by running ops on global-shape fake tensors in the fake mode it
  finds active, and caches them: under our mode the trackers counted them as unsharded memory (the
  gradient clip alone: 8x the sharded gradients). They now run in a fake mode of their own.

Where it knowingly differs from a GPU run, and why:
- Attention: on a CPU, scaled_dot_product_attention would take the math path and materialise the
  (S, S) weights. A GPU runs bf16 attention with a boolean mask on the cuDNN or memory-efficient
  kernel (flash takes no mask); torch first turns the mask into an additive bf16 bias padded to a
  multiple of 16 columns: (B, 1, 1, S) for masked keys, (B, 1, S, S) for diffusers' mask.
  gpu_attention() does exactly that and calls the memory-efficient kernel's own op, whose fake
  kernel allocates what the CUDA kernel does (output + float32 logsumexp, bias saved for backward;
  cuDNN's the same); its FLOP formula counts 4*B*S^2*h forward, 2.5x that backward.
- The token reorder in diffusers' forward (boolean indexing, torch.all(image_embeds == 0)) has a
  data-dependent shape that fake tensors refuse; transformer() concatenates the same text tokens in
  another order instead: same shapes, bytes and FLOPs (tests check it gives diffusers' velocity).
- Autocast is CPU autocast (bf16) standing in for CUDA autocast; AdamW is forced to foreach, the
  GPU default (its temporaries are part of the optimizer-step peak).
- The PPO/KL loss is written inline (elementwise on latents, negligible bytes): sde.step's
  Python-side branch on the noise std is a data-dependent bool.
- What is not measured: the CUDA caching allocator's fragmentation, NCCL buffers, the CUDA context
  (~0.5-1 GB); the VAE decoder's and VideoAlign's activations (their weights are counted).
- What train.py keeps is counted as train.py keeps it: gradients freed after
  the optimizer step (absent from rollouts), the visual metrics (CLIP-L + PickScore) in bf16 during
  evaluation only (an evaluation row), the decoded frames freed before the update (stated beside
  the table: they live in the reward phase, which is not measured).
"""
import json
import os
import sys
import time
from contextlib import contextmanager, nullcontext
from functools import partial
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from bench import common as C
from bench.common import table
from configurator import configure, list_of, number
from hunyuan15 import IMAGE_TOKENS, LORA_TARGETS, cp_plan, set_attention
from model import _cat_text, shard
from trust_region import Anchor

# ----------------------------------------------------------------------------- settings
gpu = False                     # --gpu: the ready check on real devices instead of the estimate
report_only = False            # rewrite fullsize.md from fullsize.json (no measuring)
only = ''                       # measure only these runs (comma list of train, rollout, lora; '' = all)
reuse = False                   # take runs already measured from out_dir/fullsize_runs/ (parallel parts)
tiny = False                    # --tiny: the check with a small random transformer (tests)
device = 'cuda'                 # device of the check
out_dir = 'results'             # the estimate writes fullsize.md and fullsize.json here
model_config = 'assets/hunyuanvideo15_480p_t2v_transformer.json'  # the 8.3B transformer (class defaults)
gpus = 8                        # FSDP ranks of the full fine-tune
num_frames = 81                 # frames per clip -> 21 latent frames
sizes = ((352, 624), (480, 848))  # the paper's rollout resolution, and the model's native 480p
text_tokens = (1000, 256)       # Qwen and ByT5 tokens, the upper bound (model.velocity trims padding)
rollout_batch = 4               # clips per rollout forward and rank (train.py)
clips = 32                      # clips per iteration: 8 prompts x G = 4 (train.py)
num_steps = 20                  # rollout steps, all trained (train.py)
sp_sizes = (1, 2, 4)            # sequence parallel degrees measured (sp.py, train.py's sp_size), full FT on `gpus` GPUs
sp_clips = ((81, 480, 848), (121, 720, 1280))  # frames x H x W of the sp runs: 480p, and 720p's 121 frames
lora_rank = 64                  # config/lora_1gpu.py
lora_sizes = ((81, 352, 624), (61, 352, 624), (41, 352, 624), (81, 288, 512))  # tried in order until one fits
gpu_gb = 80.0                   # memory of one GPU (H100 80 GB; an H200 has 141)
tflops = 400.0                  # assumed sustained bf16 TFLOP/s per GPU, for time on paper (~40% of H100 dense peak)
videoalign_params = 2.2e9       # Qwen2-VL-2B + reward head (reward.py), resident in bf16
metrics_params = 1.414e9        # CLIP-L (428M) + PickScore (CLIP-H, 986M): bf16, resident during evaluation only
processor = 'masked_keys'       # the blocks' attention (hunyuan15.set_attention): 'masked_keys' | 'diffusers'
wan_models = ('1.3b', '14b')    # Wan 2.1 T2V rows (assets/wan21_t2v_<m>_transformer.json)
wan_clip = (81, 480, 832)       # Wan 2.1's frames x H x W: 21 x 30 x 52 = 32,760 video tokens
wan_clips_1gpu = 8              # clips an iteration on one GPU (config/wan_1gpu.py: 2 prompts x G 4)
wan_sp = 2                      # sp degree of one more 14B row, full FT on 8 GPUs (part 'wansp'; 0: none)
seed = 0
# bare --gpu / --tiny are flags; imported (tests), the settings keep their defaults
config = configure(globals(), [a + '=True' if a in ('--gpu', '--tiny') else a for a in sys.argv[1:]]
                   if __name__ == '__main__' else [],
                   rules=dict(only=list_of('train', 'rollout', 'lora', 'diffusers', 'sp', 'wan', 'wansp'),
                              wan_models=((lambda v: len(v) > 0 and all(m in ('1.3b', '14b') for m in v)),
                                          "some of '1.3b', '14b'"),
                              wan_clip=((lambda v: len(v) == 3 and v[0] % 4 == 1 and v[1] % 16 == 0 and v[2] % 16 == 0
                                         and min(v) >= 1), '(frames, height, width): 1 + 4k frames, sides '
                                                           'multiples of 16 (8x VAE, 2x2 patches)'),
                              wan_clips_1gpu=number(1), wan_sp=number(0, then=' (0 or 1: no sp row)')))
# -----------------------------------------------------------------------------
GiB = 2 ** 30


def load_config(path=model_config):
    with open(path) as f:
        return {k: v for k, v in json.load(f).items() if not k.startswith('_')}


def build(cfg, lora=0, checkpointing=True, bf16_base=True, attn=None, cls=None):
    """The transformer on the meta device (no memory), its blocks' attention set as model.load_transformer
    sets it; LoRA adapters as model.load_policy adds them. cls: another family's transformer class
    (WanTransformer3DModel, with its own attention; its LORA_TARGETS have the same names)."""
    from diffusers import HunyuanVideo15Transformer3DModel as T
    with torch.device('meta'):
        model = set_attention(T.from_config(cfg), attn or processor) if cls is None else cls.from_config(cfg)
        if lora:
            from peft import LoraConfig
            model.requires_grad_(False)
            if bf16_base:  # the frozen base in bf16, as load_policy keeps it for LoRA on one GPU (CUDA)
                model.to(torch.bfloat16)
            model.add_adapter(LoraConfig(r=lora, lora_alpha=lora, target_modules=LORA_TARGETS))
            for p in model.parameters():  # the adapters (and so their AdamW state and anchor) in fp32
                if p.requires_grad:
                    p.data = p.data.float()
    if checkpointing:
        model.enable_gradient_checkpointing()  # non-reentrant torch.utils.checkpoint per block
    return model


# ----------------------------------------------------------------------------- forward

def transformer(model, hidden, timestep, e1, m1, e2, m2, image):
    """diffusers 0.42's HunyuanVideo15Transformer3DModel.forward for t2v, with the text tokens in a
    fixed order: [ByT5 (invalid zeroed), Qwen (invalid zeroed), image (masked out)]. Returns the
    velocity (B, C, F, H, W). hidden (B, 2C+1, F, H, W), e1 (B, L1, D1), e2 (B, L2, D2)."""
    B, _, Fr, H, W = hidden.shape
    assert model.config.patch_size == 1 and model.config.patch_size_t == 1
    rope = model.rope(hidden)                                            # (cos, sin), each (V, head_dim)
    temb = model.time_embed(timestep)                                    # (B, h)
    x = model.x_embedder(hidden)                                         # (B, V, h)
    cond = lambda t, k: t + model.cond_type_embed(torch.full_like(t[:, :, 0], k, dtype=torch.long))
    t1 = cond(model.context_embedder(e1, timestep, m1), 0)              # (B, L1, h)
    t2 = cond(model.context_embedder_2(e2), 1)                          # (B, L2, h)
    t3 = cond(model.image_embedder(image) * 0.0, 2)                     # (B, I, h) t2v: zeros, masked
    text = torch.cat([t2 * m2[..., None].to(t2.dtype), t1 * m1[..., None].to(t1.dtype), t3], 1)  # (B, T, h)
    mask = torch.cat([m2.bool(), m1.bool(), torch.zeros_like(t3[:, :, 0], dtype=torch.bool)], 1)  # (B, T)
    for block in model.transformer_blocks:
        if torch.is_grad_enabled() and model.gradient_checkpointing:
            x, text = model._gradient_checkpointing_func(block, x, text, temb, mask, rope)
        else:
            x, text = block(x, text, temb, mask, rope)
    x = model.proj_out(model.norm_out(x, temb))                          # (B, V, C)
    return x.view(B, Fr, H, W, -1).permute(0, 4, 1, 2, 3)               # (B, C, F, H, W)


def velocity(model, x, s, text, text_neg, bf16):
    """model.velocity with CFG (model.forward is transformer() above); x (B, C, F, h, w) float32."""
    B = x.shape[0]
    x, s = torch.cat([x, x]), torch.cat([s, s])                         # (2B, ...) both branches
    e1, m1, e2, m2 = _cat_text(text, text_neg)
    hidden = torch.cat([x, torch.zeros_like(x), x.new_zeros(2 * B, 1, *x.shape[2:])], 1)
    image = x.new_zeros(2 * B, IMAGE_TOKENS, model.config.image_embed_dim)
    with torch.autocast(x.device.type, torch.bfloat16, enabled=bf16):
        v = model(hidden, 1000 * s, e1, m1, e2, m2, image).float()     # (2B, C, F, h, w)
    return v[B:] + 6.0 * (v[:B] - v[B:])                                 # (B, ...) guided


def gpu_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **_):
    """torch's CUDA scaled_dot_product_attention for this call (bf16, boolean mask, head dim 128):
    the memory-efficient kernel, the mask converted to an additive bias of q's dtype (a where over
    the negated mask) and padded to 16-column alignment; q, k, v (B, heads, S, d). The cuDNN kernel,
    which torch prefers where it takes the call (sm90/sm100, cuDNN > 9.15), allocates the same:
    the output and a float32 logsumexp (B, heads, S)."""
    q, k, v = query, key, value
    if torch.is_autocast_enabled(q.device.type):  # CUDA autocast runs attention in bf16
        q, k, v = (t.to(torch.get_autocast_dtype(q.device.type)) for t in (q, k, v))
    bias = None
    if attn_mask is not None:
        bias = torch.zeros(attn_mask.shape, dtype=q.dtype, device=q.device)
        bias.masked_fill_(attn_mask.logical_not(), float('-inf'))       # (B, 1, 1, S) masked keys; diffusers': (B, 1, S, S)
        S = bias.shape[-1]
        if S % 16:  # the kernel wants aligned rows: a padded copy, sliced back
            bias = F.pad(bias, (0, 16 - S % 16))[..., :S]
        bias = bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    lse = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    return torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, bias, lse, dropout_p, is_causal, scale=scale)[0]      # (B, heads, S, d)


@contextmanager
def attention(kind):
    """'gpu': gpu_attention in place of F.scaled_dot_product_attention (diffusers' native backend
    calls it through the module); 'math': the math kernel, what a CPU runs (the validation test)."""
    if kind == 'math':
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel([SDPBackend.MATH]):
            yield
        return
    orig = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = gpu_attention
    try:
        yield
    finally:
        F.scaled_dot_product_attention = orig


# ----------------------------------------------------------------------------- the micro-step

def video_tokens(Fr, H, W):
    """The transformer's video tokens for Fr frames at H x W (VAE 4x in time, 16x in space; patch 1)."""
    return ((Fr - 1) // 4 + 1) * (H // 16) * (W // 16)


def inputs(cfg, n, Fr, H, W, L1, L2, dev):
    """One rank's stored rollout of n clips (xs, means) and the text of one micro-batch."""
    C, f, h, w = cfg['out_channels'], (Fr - 1) // 4 + 1, H // 16, W // 16
    store = dict(xs=torch.randn(n, num_steps + 1, C, f, h, w, device=dev),   # float32, as sample() keeps
                 means=torch.randn(n, num_steps, C, f, h, w, device=dev))
    text = lambda: [torch.randn(1, L1, cfg['text_embed_dim'], device=dev), torch.ones(1, L1, device=dev),
                    torch.randn(1, L2, cfg['text_embed_2_dim'], device=dev), torch.ones(1, L2, device=dev)]
    return store, text(), text()


def train_step(model, anchor, opt, store, text, text_neg, bf16, phase, velocity=velocity):
    """step_losses + backward for one clip at one step, then clip + AdamW; phase(name) is called
    after each part (the caller records peaks and FLOPs there). velocity: the family's (Wan: wan_velocity)."""
    x, x_next, mean_old = store['xs'][:1, 3], store['xs'][:1, 4], store['means'][:1, 3]  # (1, C, f, h, w)
    s = torch.full((1,), 0.9, device=x.device)
    dt, std, A, logp_old = -0.05, 0.1, 1.0, 0.0  # constants: fake tensors cannot branch on values
    with torch.no_grad(), anchor.applied(model):  # the anchor first, without grad (train.py's order)
        mean_anchor = x + dt * velocity(model, x, s, text, text_neg, bf16)
    phase('anchor forward')
    mean = x + dt * velocity(model, x, s, text, text_neg, bf16)         # (1, C, f, h, w) float32
    logp = (-(x_next - mean) ** 2 / (2 * std ** 2)).flatten(1).mean(1)
    ratio = torch.exp(logp - logp_old)
    policy = torch.maximum(-A * ratio, -A * ratio.clamp(1 - 1e-4, 1 + 1e-4))
    kl = ((mean - mean_anchor) ** 2 + 0.1 * (mean - mean_old) ** 2).flatten(1).mean(1) / (2 * std ** 2)
    loss = (policy + 1e-5 * kl).sum()
    phase('policy forward')
    loss.backward()
    phase('backward')
    torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0, foreach=True)
    phase('clip')
    opt.step()
    phase('optimizer step')


def rollout_step(model, store, text, text_neg, n, bf16, phase, velocity=velocity):
    """One sampling forward of n clips with CFG (2n in the batch), no grad."""
    x = store['xs'][:n, 0]                                               # (n, C, f, h, w)
    with torch.no_grad():
        velocity(model, x, torch.ones(n, device=x.device), [t.expand(n, *t.shape[1:]) for t in text],
                 [t.expand(n, *t.shape[1:]) for t in text_neg], bf16)
    phase('rollout forward')


def setup(model, dev, grads=True):
    """Steady state before a micro-step: AdamW state exists, gradients of earlier micro-steps are
    accumulated (train.py zeroes them only at the start of an optimizer step). Before a rollout
    (grads=False) they are freed: train.py frees them right after the optimizer step."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.01, foreach=True)  # foreach: the CUDA default
    for p in params:
        p.grad = torch.full_like(p, 1e-3)  # full, not zeros: written pages (the real-RSS test counts them)
    opt.step()
    if not grads:
        opt.zero_grad(set_to_none=True)
    return opt


# what measure() runs of a model family: HunyuanVideo 1.5's (the functions above), Wan's (WAN, below)
HUNYUAN = SimpleNamespace(build=build, forward=transformer, velocity=velocity, inputs=inputs, tokens=video_tokens,
                          blocks=lambda m: m.transformer_blocks, text=lambda L1, L2: L1 + L2 + IMAGE_TOKENS,
                          cp_plan=cp_plan)


class FlopCount(TorchDispatchMode):
    """FlopCounterMode's per-op formulas (matmuls, convolutions, attention) without its module
    hooks, which keep every checkpointed block's recomputed activations alive through backward
    (measured: +37% peak on the test config, real tensors, RSS); attn: the attention kernels' part."""
    total = attn = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is DTensor for t in types):
            return NotImplemented  # count the local ops DTensor runs
        out = func(*args, **(kwargs or {}))
        if func._overloadpacket in flop_registry:
            f = flop_registry[func._overloadpacket](*args, **(kwargs or {}), out_val=out)
            self.total += f
            self.attn += f * ('attention' in func._overloadpacket.__name__)  # SDPA kernels, forward and backward
        return out


def snap(tracker, kind='current'):
    s = tracker.get_tracker_snapshot(kind)  # {device: {category: bytes, 'Total': bytes}}, one device here
    return next(iter(s.values()), {})


def measure(cfg, what, Fr, H, W, world=gpus, lora=0, fake=True, attn='gpu', bf16=True, n_store=None, L=None,
            rollout_n=rollout_batch, proc=None, sp=1, fam=None):
    """Peak bytes per rank by category and FLOPs of one micro-step ('train') or one rollout forward
    ('rollout'). world > 0: FSDP2 over a fake process group of `world` ranks (fake=True only).
    proc: the blocks' attention (hunyuan15.set_attention; default the `processor` setting).
    sp > 1: sequence parallel as train.py sets it (sp.enable over a (dp, 1, sp) mesh of the same
    ranks; FSDP2 still over all of them): each rank runs the blocks on 1/sp of a clip's tokens.
    fam: the model family's functions (HUNYUAN, the default, or WAN)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch._subclasses.fake_tensor import FakeTensorMode
    t0 = time.time()
    torch.manual_seed(seed)
    L1, L2 = L or text_tokens
    f = fam or HUNYUAN
    n_store = n_store if n_store is not None else clips * sp // max(world, 1)  # an sp group shares its clips
    mesh = sp_mesh = None
    if sp > 1 and f.tokens(Fr, H, W) % sp:  # the family's check (hunyuan15.pad_for_sp), before anything is built
        raise ValueError(f'{f.tokens(Fr, H, W)} video tokens do not split over sp {sp}')
    if world:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.testing._internal.distributed.fake_pg import FakeStore
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group('fake', rank=0, world_size=world, store=FakeStore())
        mesh = init_device_mesh('cpu', (world,))  # before the fake mode: a mesh of real ranks
        if sp > 1:
            import sp as sp_mod
            sp_mesh = sp_mod.mesh(sp, 'cpu')
            if f is HUNYUAN:  # hunyuan15.pad_for_sp: the text split evenly too (Wan does not split its text)
                L1 += -(L1 + L2 + IMAGE_TOKENS) % sp
    proc = proc or processor
    model = f.build(cfg, lora, attn=proc)
    if f.forward:  # called as model(...): FSDP's root hooks gather its weights
        model.forward = partial(f.forward, model)
    P = sum(p.numel() for p in model.parameters())
    P_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if world:
        shard(model, f.blocks(model), cuda=bf16, mesh=mesh)  # cuda=bf16: the GPU's mixed precision
    if sp_mesh is not None:
        sp_mod.enable(model, sp_mesh, f.cp_plan(model))
    mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else nullcontext()
    if fake and world:
        # DTensor infers output shapes by running each op on global-shape fake tensors, in the fake
        # mode it finds active, and caches them: under ours the trackers would count those
        # (unsharded, never freed) tensors as memory. A mode of its own keeps them out, as on a GPU.
        import torch.distributed.tensor._sharding_prop as sharding_prop
        prop_mode = FakeTensorMode(allow_non_fake_inputs=True)
        sharding_prop.detect_fake_mode = lambda *a, **k: prop_mode
    res = dict(what=what, frames=Fr, height=H, width=W, world=world, sp=sp, lora=lora, attention=proc, P=P, P_trainable=P_train,
               tokens=f.tokens(Fr, H, W), text=f.text(L1, L2), phases={})
    with mode, attention(attn):
        model.to_empty(device='cpu')
        if not fake:  # real weights: small random values written to every page
            with torch.no_grad():
                for p in model.parameters():
                    p.normal_(0, 0.02)
        opt = setup(model, 'cpu', grads=what == 'train')
        tracker = FSDPMemTracker(model, opt) if world else MemTracker()
        if not world:
            tracker.track_external(model, opt)
        hooks = ('register_hook', 'register_post_accumulate_grad_hook')
        saved = {h: getattr(torch.Tensor, h) for h in hooks}
        for h in hooks * bool(lora):  # MemTracker hooks every parameter's gradient; frozen ones have none
            setattr(torch.Tensor, h, lambda t, fn, h=h: saved[h](t, fn) if t.requires_grad else
                    SimpleNamespace(remove=lambda: None))
        flops = FlopCount()
        with tracker, flops:
            base = snap(tracker).get('Total', 0)
            anchor = Anchor(model, 'dual')  # a frozen sharded fp32 copy of the trainable weights
            mid = snap(tracker)['Total']
            store, text, text_neg = f.inputs(cfg, max(n_store, rollout_n), Fr, H, W, L1, L2, 'cpu')
            resident = dict(anchor=mid - base, store=snap(tracker)['Total'] - mid)
            last = [0, 0]

            def phase(name):  # peak of this part by category, and its FLOPs
                f, fa = flops.total, flops.attn
                res['phases'][name] = dict(peak={k: v for k, v in snap(tracker, 'peak').items() if v}, flops=f - last[0],
                                           attn_flops=fa - last[1])
                last[:] = f, fa
                tracker._peak_mem_snap = tracker.get_tracker_snapshot()  # restart the peak (private API)
                tracker._peak_mem = {d: s['Total'] for d, s in tracker._peak_mem_snap.items()}
                if name == 'anchor forward':  # FSDPMemTracker's module stats allow one forward per module
                    tracker.reset_mod_stats()
            if what == 'train':
                train_step(model, anchor, opt, store, text, text_neg, bf16, phase, f.velocity)
            else:
                rollout_step(model, store, text, text_neg, rollout_n, bf16, phase, f.velocity)
    for h in hooks:
        setattr(torch.Tensor, h, saved[h])
    res['resident'] = resident
    top = max(res['phases'].values(), key=lambda r: r['peak']['Total'])
    res['peak'] = top['peak']
    res['peak_phase'] = next(k for k, r in res['phases'].items() if r is top)
    res['seconds'] = time.time() - t0
    if world:
        dist.destroy_process_group()
    return res


def rss_run(cfg, what, Fr, H, W, **kw):
    """measure() on real tensors (run it in a fresh process): the growth of the process's peak
    resident memory over the run, to compare with the fake-tensor peak (tests/test_fullsize.py)."""
    import resource
    with open('/proc/self/status') as f:
        base = next(int(l.split()[1]) * 1024 for l in f if l.startswith('VmRSS'))
    res = measure(cfg, what, Fr, H, W, fake=False, **kw)
    res['rss_growth'] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    return res


# ----------------------------------------------------------------------------- the estimate

def formula(P, P_blk, P_txt, L, h, V, T):
    """bench/toy.py section 5's former formulas (bytes per GPU of 8; F: FLOPs of one CFG branch of one
    clip), for the comparison; P_txt: a block's text-stream parameters."""
    S, P_img = V + T, P_blk - P_txt
    return dict(params=4 * P / 8, grads=4 * P / 8, optimizer=8 * P / 8, anchor=4 * P / 8, gathered=2 * 2 * P_blk,
                activations=2 * 2 * S * h * L + 2 * 2 * S * h * 16 + 2 * S * S,
                F=2 * L * (P_img * V + P_txt * T) + 2 * (P - L * P_blk) * V + 4 * L * S * S * h)


def categories(r):
    """Peak bytes by category, in this report's words (anchor and stored rollout split off the
    tracker's 'Activation', where tensors made inside the tracked region land)."""
    p, res = {str(getattr(k, 'value', k)): v for k, v in r['peak'].items()}, r['resident']
    out = {'params (fp32 master)': p.get('Sharded Param', p.get('Parameter', 0)),
           'gathered params (bf16)': p.get('Unsharded Param', 0) + p.get('All Gather', 0),
           'grads (fp32)': p.get('Sharded Grad', p.get('Gradient', 0)) + p.get('Unsharded Grad', 0),
           'reduce-scatter buffers': p.get('Reduce Scatter', 0),
           'optimizer (AdamW)': p.get('OptState', p.get('Optstate', 0)),
           'anchor (fp32)': res['anchor'], 'stored rollout (fp32)': res['store'],
           'activations': p.get('Activation', 0) - res['anchor'] - res['store'],
           'backward temporaries': p.get('Temp', 0)}
    out['total'] = p['Total']
    return out


def estimate():
    from diffusers import AutoencoderKLHunyuanVideo15
    cfg, t0 = load_config(), time.time()
    with torch.device('meta'):  # the class defaults are the published VAE
        vae_P = sum(p.numel() for p in AutoencoderKLHunyuanVideo15().parameters())
    extras = {'VAE (bf16)': 2 * vae_P, 'VideoAlign (bf16)': 2 * videoalign_params}
    os.makedirs(os.path.join(out_dir, 'fullsize_runs'), exist_ok=True)

    def run(key, *args, model_cfg=None, **kw):  # one measurement, kept in fullsize_runs/ (--reuse: read back)
        path = os.path.join(out_dir, 'fullsize_runs', key + '.json')
        if reuse and os.path.exists(path):
            with open(path) as f:
                return json.load(f)
        if only and key.split('_')[0].rstrip('0123456789') not in only.split(','):  # sp2_... is part 'sp'
            return None
        r = measure(model_cfg or cfg, *args, **kw)
        with open(path, 'w') as f:
            json.dump(r, f, indent=1, default=str)
        print(f'[{time.time() - t0:5.0f}s] {key}: peak {r["peak"]["Total"] / GiB:.1f} GiB', flush=True)
        return r
    sfx = '' if processor == 'masked_keys' else '_' + processor
    runs = [run(f'{what}_{H}x{W}{sfx}', what, num_frames, H, W) for H, W in sizes for what in ('train', 'rollout')]
    for Fr, H, W in lora_sizes:  # config/lora_1gpu.py: 2 prompts x G 4 = 8 clips, rollout_batch 1
        r = run(f'lora_train_{Fr}x{H}x{W}{sfx}', 'train', Fr, H, W, world=0, lora=lora_rank, n_store=8, rollout_n=1)
        runs.append(r)
        if r is None or (r['peak']['Total'] + sum(extras.values())) / GiB <= gpu_gb:
            runs.append(run(f'lora_rollout_{Fr}x{H}x{W}{sfx}', 'rollout', Fr, H, W, world=0, lora=lora_rank, n_store=8,
                            rollout_n=1))
            break
    runs = [r for r in runs if r is not None]
    # the same full fine-tune runs with diffusers' own attention processor: what masked keys replace
    reference = [] if sfx else [run(f'diffusers_{what}_{H}x{W}', what, num_frames, H, W, proc='diffusers')
                                for H, W in sizes for what in ('train', 'rollout')]
    reference = [r for r in reference if r is not None]
    seq = []  # sequence parallel: the same full fine-tune with a clip's tokens split over sp ranks
    for Fr, H, W in sp_clips:
        V = video_tokens(Fr, H, W)
        for n in sp_sizes:
            for what in ('train', 'rollout'):
                if V % n or cfg['num_attention_heads'] % n:  # hunyuan15.pad_for_sp's check: no run, the reason instead
                    seq.append(dict(what=what, frames=Fr, height=H, width=W, world=gpus, sp=n, tokens=V, skipped=
                                    f'{V:,} video tokens do not split over {n} ranks'))
                    continue
                same = n == 1 and Fr == num_frames and (H, W) in sizes and not sfx  # measured above already
                r = run(f'{what}_{H}x{W}' if same else f'sp{n}_{what}_{Fr}x{H}x{W}{sfx}', what, Fr, H, W, sp=n)
                if r is not None:
                    seq.append(dict(r, sp=n))  # (runs measured before sp was recorded are sp 1)
    wan_rows = wan_runs(run)  # Wan 2.1 1.3B and 14B (their section below)
    for r in wan_rows:
        r['categories'] = categories(r)
    blk = build(cfg, checkpointing=False).transformer_blocks[0]
    P_blk = sum(p.numel() for p in blk.parameters())
    P_txt = sum(p.numel() for n, p in blk.named_parameters() if 'context' in n or 'add_' in n)
    for r in runs + reference + [r for r in seq if 'skipped' not in r]:
        r['categories'] = categories(r)
        r['formula'] = formula(r['P'], P_blk, P_txt, cfg['num_layers'], cfg['num_attention_heads'] *
                               cfg['attention_head_dim'], r['tokens'], r['text'])
    out = dict(config=config, extras=extras, eval_extras={'CLIP-L + PickScore (bf16)': 2 * metrics_params},
               runs=runs, reference=reference, sp=seq, wan=wan_rows, wan_extras=wan_extras(),
               seconds=time.time() - t0, torch=torch.__version__)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, 'fullsize.json'), 'w') as f:
        json.dump(out, f, indent=1, default=str)
    md = report(out)  # before the file is opened: a failing report leaves the old one whole
    with open(os.path.join(out_dir, 'fullsize.md'), 'w') as f:
        f.write(md + '\n')
    if not only:
        update_readme(out)
    print(f'wrote {out_dir}/fullsize.md and fullsize.json in {time.time() - t0:.0f}s')


FWD_BWD = ('update', 'diag')  # the kinds of train.py's pass count (model.PASS_KINDS) with a backward


def flops_per_pass(size=(352, 624), path=os.path.join('results', 'fullsize.json')):
    """FLOPs of one transformer pass at full size (one clip, one CFG branch, 81 frames at `size`),
    measured by this bench (full fine-tune, 8 GPUs): a forward as in rollouts and evaluation, the
    anchor's forward, and a forward + backward of the update (its block recompute included)."""
    with open(path) as f:
        out = json.load(f)
    run = lambda what: next(r for r in out['runs'] if r['world'] and r['what'] == what and
                            (r['height'], r['width']) == tuple(size))
    tr, ro = run('train')['phases'], run('rollout')['phases']
    n = 2 * out['config']['rollout_batch']  # clips x CFG branches of the measured rollout forward
    return dict(forward=ro['rollout forward']['flops'] / n, anchor=tr['anchor forward']['flops'] / 2,  # 1 clip, 2 branches
                train=(tr['policy forward']['flops'] + tr['backward']['flops']) / 2)


def gpu_hours(passes, size=(352, 624), tflops=tflops, path=os.path.join('results', 'fullsize.json')):
    """GPU-hours at full size of transformer passes counted by kind ({kind: passes}, train.py's
    passes_* in metrics.jsonl, or bench/compute.py's count of a setting): each pass costs what
    flops_per_pass measured, at `tflops` sustained TFLOP/s per GPU (an assumption, not a measurement)."""
    f = flops_per_pass(size, path)
    cost = lambda k: f['train'] if k in FWD_BWD else f['anchor'] if 'anchor' in k else f['forward']
    return sum(n * cost(k) for k, n in passes.items()) / (tflops * 1e12) / 3600


def twin(out, r):
    """r's run with diffusers' own attention processor (out['reference']), or None."""
    return next((q for q in out.get('reference', []) if (q['what'], q['world'], q['lora'], q['frames'], q['height'],
                                                          q['width']) == (r['what'], r['world'], r['lora'], r['frames'],
                                                                          r['height'], r['width'])), None)


def readme_summary(out):
    """The README's block: per model and clip size, the per-GPU peak of an iteration (the larger of the
    training micro-step and the rollout forward, VAE and VideoAlign resident) of each setup measured,
    HunyuanVideo with masked-key attention (train.py's valid_tokens computes at most that); every run,
    phase and category are in results/fullsize.md."""
    peaks = {}  # (model, clip) -> {setup: GiB}

    def add(model, setup, r, extras):
        d = peaks.setdefault((model, f'{r["frames"]}x{r["height"]}x{r["width"]}'), {})
        d[setup] = max(d.get(setup, 0.0), (r['categories']['total'] + extras) / GiB)
    hv, extras = 'HunyuanVideo 1.5 (8.3B)', sum(out['extras'].values())
    full = lambda r: f'full FT, {r["world"]} GPUs' if r['world'] else f'LoRA r{r["lora"]}, 1 GPU'  # noqa: E731
    for r in out['runs']:
        if r.get('attention') == out['config'].get('processor', 'masked_keys'):
            add(hv, full(r), r, extras)
    for r in out.get('sp', []):
        if 'skipped' not in r:
            add(hv, full(r) + (f', sp {r["sp"]}' if r['sp'] > 1 else ''), r, extras)
    for r in out.get('wan', []):
        add(r['model'].replace('Wan 2.1 1.3B', 'Wan 2.1 (1.3B)').replace('Wan 2.1 14B', 'Wan 2.1 (14B)'),
            r['setup'], r, sum(out['wan_extras'].values()))
    gb = out['config'].get('gpu_gb', gpu_gb)
    rows = [[m, clip, '; '.join(f'{s} **{v:.1f}**' if v <= gb else f'{s} {v:.1f} (over {gb:.0f} GB)'
                                for s, v in d.items())] for (m, clip), d in peaks.items()]
    return table(['model', 'frames x H x W', f'peak GiB per GPU of an iteration (**bold**: fits {gb:.0f} GB)'], rows)


def update_readme(out, path='README.md'):
    C.put_block(path, 'bench.fullsize', [readme_summary(out)])


def report(out):
    """results/fullsize.md: what the README and bench/toy.py's section 5 quote."""
    runs, extras, c = out['runs'], out['extras'], out['config']
    name = lambda r: (f'{"full FT, " + str(r["world"]) + " GPUs" if r["world"] else "LoRA r" + str(r["lora"]) + ", 1 GPU"}: '
                      f'{r["what"]} {r["frames"]}x{r["height"]}x{r["width"]}'
                      + ('' if r.get('attention') == c.get('processor', 'masked_keys') else
                         f" ({r.get('attention', 'diffusers')}' attention)"))
    g = lambda b: f'{b / GiB:.1f}'
    P = runs[0]['P']
    md = ['## HunyuanVideo 1.5 at full size: per-GPU memory and FLOPs, measured by torch', '',
          f'Written by `python -m bench.fullsize` (torch {out["torch"]}, {sum(r["seconds"] for r in runs) / 60:.0f} min '
          'of measuring on 2 shared CPU cores); raw numbers: '
          f'fullsize.json. Transformer: {P / 1e9:.3f} B parameters (`{c["model_config"]}`, the diffusers class defaults). '
          'Each run executes one training micro-step as train.py does (anchor forward without grad, policy forward with '
          'both CFG branches, backward with per-block checkpointing, clip + AdamW) or one rollout forward '
          f'({c["rollout_batch"]} clips x 2 CFG branches for FSDP, 1 clip for LoRA), on fake tensors, with FSDP2 applied by '
          'model.shard over a fake process group, bf16 compute; memory by FSDPMemTracker / MemTracker, FLOPs by '
          "FlopCounterMode's formulas. The blocks' attention: hunyuan15.MaskedKeysAttention "
          f'(`attention = \'{c.get("processor", "masked_keys")}\'`; train.py\'s default, valid_tokens, attends over the '
          'valid tokens alone, at most these FLOPs: results/attention_flops.md), padded text and image tokens masked as keys only, '
          'a (B, S) key mask that SDPA takes as a broadcast bias; it runs as on a GPU (the memory-efficient kernel, '
          'the mask as a padded bf16 bias; cuDNN allocates the same). What train.py keeps '
          '(as train.py does): AdamW state and accumulated gradients exist during the training step; the gradients '
          'are freed right after the optimizer step, so no rollout or evaluation holds them; one copy of the stored '
          'rollout. '
          f'Text {sum(c["text_tokens"])} + 1 tokens (upper bound). Not included: CUDA context, allocator fragmentation, '
          'NCCL buffers, VAE/VideoAlign activations (their weights are: the VAE counted from its class, VideoAlign '
          f'taken as {c["videoalign_params"] / 1e9:.1f} B parameters). The method is checked against a real CPU run of '
          'a small config (tests/test_fullsize.py: peak resident memory within 25%). No GPU has confirmed these '
          'numbers yet: `bench/fullsize.py --gpu` prints the measured values beside them.', '',
          '### Peak memory per GPU (GiB), by category, at the peak of each run', '']
    cats = list(runs[0]['categories'])
    rows = [[k] + [g(r['categories'][k]) for r in runs] for k in cats]
    rows.append(['peak phase'] + [r['peak_phase'] for r in runs])
    for k, v in extras.items():
        rows.append([f'+ resident {k}'] + [g(v)] * len(runs))
    rows.append(['**total with resident extras**'] + [f'**{g(r["categories"]["total"] + sum(extras.values()))}**' for r in runs])
    ev = out.get('eval_extras', {})
    for k, v in ev.items():  # evaluation: ODE rollouts of the same batch, the visual metrics loaded for it
        rows.append([f'+ during evaluation only: {k}'] + [g(v) if r['what'] == 'rollout' else '' for r in runs])
    if ev:
        rows.append(['**evaluation peak**'] + [f'**{g(r["categories"]["total"] + sum(extras.values()) + sum(ev.values()))}**'
                                               if r['what'] == 'rollout' else '' for r in runs])
    md += [table(['GiB'] + [name(r) for r in runs], rows), '']
    frames = lambda r: (c['clips'] // max(r['world'], 1) if r['world'] else 8) * r['frames'] * 3 * r['height'] * r['width'] * 4
    md += ['Also kept by train.py, outside these peaks: the decoded frames of the rank\'s clips (float32, '
           + ', '.join(f'{g(frames(r))} GiB at {r["height"]}x{r["width"]}' for r in runs if r['world'] and r['what'] == 'rollout')
           + '), alive from the decode through reward scoring and freed before the update, so in neither '
           'the rollout forward nor the training step; the reward phase (VAE decode, VideoAlign forward: activations '
           'not measured) holds them. The evaluation peak above is a bound: the last rollout stays stored through it.', '']
    ref = [(r, twin(out, r)) for r in runs if twin(out, r)]
    if ref:
        md += ["### Attention: diffusers' processor against masked keys (full fine-tune, 8 GPUs)", '',
               "diffusers 0.42's HunyuanVideo15AttnProcessor2_0 builds a (B, 1, S, S) boolean mask per block (key mask "
               'AND query mask, S = video + text + image tokens) that SDPA turns into a bf16 bias; hunyuan15.MaskedKeysAttention '
               'gives SDPA the (B, S) key mask alone (a padded query row is never read: the token is masked as a key in '
               'every later block and dropped at the end; tests/test_attention.py: every valid token and the velocity '
               "equal diffusers' to float32 rounding). Same runs, same accounting, only the processor differs.", '']
        rows = []
        for r, q in ref:
            tot = lambda x: x['categories']['total']
            fl = [k for k in r['phases'] if r['phases'][k].get('attn_flops') is not None]
            af, ff = sum(r['phases'][k]['attn_flops'] for k in fl), sum(r['phases'][k]['flops'] for k in fl)
            rows.append([name(r), g(tot(q)), g(tot(r)), g(tot(q) + sum(extras.values())), g(tot(r) + sum(extras.values())),
                         q['peak_phase'], f'{100 * af / ff:.0f}%' if ff else ''])
        md += [table(['run', 'peak, diffusers', 'peak, masked keys', '+ VAE, VideoAlign, diffusers',
                      '+ VAE, VideoAlign, masked keys', 'peak phase (diffusers)', 'attention share of FLOPs'], rows), '',
               'Which kernel SDPA takes on a GPU (torch\'s dispatch rules, aten/src/ATen/native/transformers/cuda/'
               'sdp_utils.cpp; bf16, head dim 128, no dropout): flash never takes a mask, so neither path gets it. '
               "With diffusers' mask: cuDNN where torch prefers it (sm90/sm100 with cuDNN > 9.15; it accepts a (B, 1, S, S) "
               'mask), else the memory-efficient kernel; either reads a materialised (B, S, S) bf16 bias (plus the two '
               '(B, S, S) boolean masks diffusers builds). With masked keys: the same two kernels with a (B, 1, 1, S) '
               'bias, broadcast over heads and query rows: O(B S) memory. A batch without any padding could take flash, '
               'but t2v always has its masked image token.',
               '', "train.py's default attention, valid_tokens (attention.py), takes no mask at all: each sample "
               'attends over its own valid tokens, one backend call per run of equal lengths, so SDPA may run flash; '
               'its FLOPs against masked keys: results/attention_flops.md; its time on a GPU, per processor and backend: '
               '`python -m bench.attention --gpu` (results/attention_gpu.md).', '']
    if out.get('sp'):
        md += sp_report(out, g)
    if out.get('wan'):
        md += wan_report(out, g)
    md += ['### Against bench/toy.py section 5\'s formulas (full fine-tune, 8 GPUs, training micro-step)', '']
    for r in [r for r in runs if r['world'] and r['what'] == 'train']:
        m, f = r['categories'], r['formula']
        rows = [['params fp32', g(m['params (fp32 master)']), g(f['params'])],
                ['grads fp32', g(m['grads (fp32)']), g(f['grads'])],
                ['AdamW', g(m['optimizer (AdamW)']), g(f['optimizer'])],
                ['anchor fp32', g(m['anchor (fp32)']), g(f['anchor'])],
                ['gathered bf16 blocks (+ all-gather / reduce-scatter buffers)',
                 g(m['gathered params (bf16)'] + m['reduce-scatter buffers']), g(f['gathered'])],
                ['activations + backward temporaries', g(m['activations'] + m['backward temporaries']), g(f['activations'])],
                ['total (without the stored rollout and extras)', g(m['total'] - m['stored rollout (fp32)']),
                 g(sum(v for k, v in f.items() if k != 'F'))]]
        md += [f'{name(r)} (peak in the {r["peak_phase"]}):', '', table(['GiB per GPU', 'measured', 'formula'], rows), '']
    md += ['### FLOPs (TFLOP per micro-step or forward, per GPU)', '']
    rows = []
    for r in runs:
        ph, F = r['phases'], r['formula']['F']
        if r['what'] == 'train':
            rows.append([name(r), f'{ph["anchor forward"]["flops"] / 1e12:.0f}', f'{ph["policy forward"]["flops"] / 1e12:.0f}',
                         f'{ph["backward"]["flops"] / 1e12:.0f}', f'{2 * F / 1e12:.0f} / {6 * F / 1e12:.0f}'])
        else:
            n = 2 * (c['rollout_batch'] if r['world'] else 1)
            rows.append([name(r), '', f'{ph["rollout forward"]["flops"] / 1e12:.0f}', '', f'{n * F / 1e12:.0f}'])
    md += [table(['run', 'anchor fwd', 'forward', 'backward (+ recompute)', 'formula fwd / bwd'], rows), '']
    md += [f'### One iteration on paper ({c["clips"]} clips, {c["num_steps"]} steps all trained, at an assumed '
           f'{c["tflops"]:.0f} TFLOP/s sustained per GPU)', '']
    rows = []
    for H, W in c['sizes']:
        tr = next((r for r in runs if r['world'] and r['what'] == 'train' and (r['height'], r['width']) == (H, W)), None)
        ro = next((r for r in runs if r['world'] and r['what'] == 'rollout' and (r['height'], r['width']) == (H, W)), None)
        if not (tr and ro):
            continue
        per_rank = c['clips'] // tr['world']
        f_roll = per_rank / c['rollout_batch'] * c['num_steps'] * ro['phases']['rollout forward']['flops']
        f_upd = per_rank * c['num_steps'] * sum(tr['phases'][k]['flops'] for k in ('anchor forward', 'policy forward', 'backward'))
        rows.append([f'{H}x{W}', f'{f_roll / 1e15:.0f}', f'{f_upd / 1e15:.0f}', f'{f_upd / f_roll:.1f}',
                     f'{(f_roll + f_upd) / (c["tflops"] * 1e12) / 3600:.2f}'])
    md += [table(['size', 'rollout PFLOP/GPU', 'update PFLOP/GPU', 'update/rollout', 'hours/iteration'], rows), '']
    md += ['### What the measurement corrects in the formulas', '']
    tr = next((r for r in runs if r['world'] and r['what'] == 'train'), None)
    if tr:
        m, f, ph = tr['categories'], tr['formula'], tr['phases']
        md += [f'- FLOPs: one CFG branch of one clip is {ph["policy forward"]["flops"] / 2e12:.0f} TFLOP measured, '
               f'{f["F"] / 1e12:.0f} by the formula, which multiplied every block parameter by the tokens; the '
               'adaLN modulation linears (6h x h per stream, a third of a block) act on the timestep embedding '
               'only. The backward with its recompute is '
               f'{ph["backward"]["flops"] / ph["policy forward"]["flops"]:.2f}x the forward (formula: 3x).',
               '- Sharded state (params, grads, AdamW, anchor): ' + '/'.join(g(m[k]) for k in (
                   'params (fp32 master)', 'grads (fp32)', 'optimizer (AdamW)', 'anchor (fp32)')) + ' GiB, formula '
               + '/'.join(g(f[k]) for k in ('params', 'grads', 'optimizer', 'anchor')) + ' (4/4/8/4 bytes a parameter / 8).',
               f'- Communication buffers: FSDP2 also holds the fp32 reduce-scatter input of a block and the '
               f'all-gather buffer: {g(m["gathered params (bf16)"] + m["reduce-scatter buffers"])} GiB, not '
               f'{g(f["gathered"])}.',
               f'- Activations: {g(m["activations"] + m["backward temporaries"])} GiB at the backward peak, not '
               f'{g(f["activations"])}; the anchor forward adds a second sharded copy of the weights for the '
               f'swap (Anchor.applied saves the policy\'s): peak {g(ph["anchor forward"]["peak"]["Total"])} GiB there.']
    ro = [r for r in runs if r['world'] and r['what'] == 'rollout']
    if ro:
        tr = {(r['height'], r['width']): r['peak']['Total'] for r in runs if r['world'] and r['what'] == 'train'}
        md += ['- The rollout forward, absent from the formulas: '
               + ', '.join(f'{g(r["peak"]["Total"])} GiB at {r["height"]}x{r["width"]} (training step: '
                           f'{g(tr.get((r["height"], r["width"]), 0))})' for r in ro)
               + f' ({c["rollout_batch"]} clips x 2 branches in one batch, gradients freed), with masked-key '
               "attention; with diffusers' (B, 1, S, S) mask it was the peak of an iteration (table above)."]
    for r in [r for r in runs if r['lora'] and r['what'] == 'train']:
        tot = (r['peak']['Total'] + sum(extras.values())) / GiB
        md += [f'- LoRA r{r["lora"]} on one GPU, {r["frames"]}x{r["height"]}x{r["width"]}: {tot:.1f} GiB with the VAE and '
               f'VideoAlign resident: {"fits" if tot <= c["gpu_gb"] else "does not fit"} in {c["gpu_gb"]:.0f} GB '
               f'(the frozen base stays fp32, {g(r["categories"]["params (fp32 master)"])} GiB, as load_policy keeps it).']
    return '\n'.join(md)


def sp_report(out, g):
    """results/fullsize.md's sequence-parallel section."""
    seq, extras, c = out['sp'], sum(out['extras'].values()), out['config']
    md = ['### Sequence parallel: per-GPU peaks at sp 1 / 2 / 4 (full fine-tune, 8 GPUs)', '',
          f'The same micro-step and rollout forward with `sp_size` n as train.py runs it (sp.enable: diffusers\' '
          'context parallelism, Ulysses all-to-all over the fake process group, FSDP2 still over all 8 ranks): each '
          f'rank runs the blocks on 1/n of a clip\'s video and text tokens, and holds its sp group\'s {c["clips"]} x n / 8 '
          f'clips\' stored rollout (an sp group shares its clips). Rollout forwards batch {c["rollout_batch"]} clips x 2 CFG '
          'branches. FLOPs are per rank (an sp group does a clip\'s work once, split n ways), train: one micro-step '
          '(anchor forward, policy forward, backward with its recompute).', '']
    rows = []
    for r in seq:
        clip = f'{r["frames"]}x{r["height"]}x{r["width"]}'
        if 'skipped' in r:  # one row for the pair
            rows += [[clip, r['sp'], 'train, rollout', '', '', '', '', r['skipped']]] * (r['what'] == 'train')
            continue
        fl = sum(v['flops'] for v in r['phases'].values())
        rows.append([clip, r['sp'], r['what'], f'{r["tokens"] // r["sp"]:,}', g(r['categories']['total']),
                     g(r['categories']['total'] + extras), f'{fl / 1e12:.0f}',
                     f'peak in the {r["peak_phase"]}; stored rollout {g(r["categories"]["stored rollout (fp32)"])}'])
    md += [table(['clip', 'sp', 'run', 'video tokens a rank', 'peak GiB/GPU', '+ VAE, VideoAlign', 'TFLOP a rank', ''],
                 rows), '']
    over = [r for r in seq if 'skipped' not in r and (r['categories']['total'] + extras) / GiB > c['gpu_gb']]
    md += [f'Above {c["gpu_gb"]:.0f} GB (an H100): ' + (', '.join(f'{r["what"]} {r["frames"]}x{r["height"]}x{r["width"]} '
                                                               f'at sp {r["sp"]}' for r in over) or 'none') + '. '
           'An sp degree must divide the 16 heads and the clip\'s video tokens (hunyuan15.pad_for_sp pads the text, not the '
           'video): 81 frames at 480x848 are 21 x 30 x 53 = 33,390 tokens, which split over 2 but not over 4, and '
           "diffusers' uneven Ulysses split has no backward pass, so it cannot train.", '']
    tr = {(r['frames'], r['height'], r['width'], r['sp']): r for r in seq if r['what'] == 'train' and 'skipped' not in r}
    pairs = [(a, b) for k, a in tr.items() for k2, b in tr.items() if k[:3] == k2[:3] and k[3] == 1 and k2[3] > 1]
    if pairs:
        ratio = lambda a, b, ph: b['phases'][ph]['flops'] * b['sp'] / a['phases'][ph]['flops']
        md += ['What sequence parallel costs in FLOPs: a rollout or policy forward at sp n is 1/n of sp 1\'s per rank, '
               'but the backward is ' + ', '.join(f'{ratio(a, b, "backward"):.2f}x ({b["frames"]}x{b["height"]}x{b["width"]}, '
                                                  f'sp {b["sp"]})' for a, b in pairs) + ' of 1/n '
               '(n x its FLOPs over sp 1\'s): diffusers\' NATIVE attention backend, which the masked-key processor '
               'dispatches to, runs Ulysses through an autograd function that saves only q, k, v and recomputes the '
               'attention forward in its backward (_native_attention_backward_op), one more attention forward per '
               "block on top of the checkpointing recompute. train.py's default attention, valid_tokens, does the "
               'all-to-all itself around the backend\'s own differentiable kernel: no recompute (attention.py).', '']
    return md


# ----------------------------------------------------------------------------- Wan 2.1 (wan.py)

WAN_SETUPS = (('full FT, 8 GPUs', 'fsdp8'), ('full FT, 1 GPU', 'full1'), ('LoRA r64, 1 GPU', 'lora1'))


def wan_tokens(Fr, H, W):
    """Wan 2.1's video tokens for Fr frames at H x W (VAE 4x in time, 8x in space; 2x2 patches)."""
    return ((Fr - 1) // 4 + 1) * (H // 16) * (W // 16)


def wan_inputs(cfg, n, Fr, H, W, L1, L2, dev):
    """inputs() for Wan: the stored rollout of n clips (16 latent channels, 8x spatial), and one
    text tensor of wan.TEXT_TOKENS (512) UMT5 tokens with its mask (L1, L2 unused: Wan pads to 512)."""
    import wan
    C, f, h, w = cfg['out_channels'], (Fr - 1) // 4 + 1, H // 8, W // 8
    store = dict(xs=torch.randn(n, num_steps + 1, C, f, h, w, device=dev),   # float32, as sample() keeps
                 means=torch.randn(n, num_steps, C, f, h, w, device=dev))
    text = lambda: [torch.randn(1, wan.TEXT_TOKENS, cfg['text_dim'], device=dev), torch.ones(1, wan.TEXT_TOKENS, device=dev)]
    return store, text(), text()


def wan_velocity(model, x, s, text, text_neg, bf16):
    """model.velocity for Wan with CFG (wan.forward, diffusers' own transformer forward), both
    branches in one batch; CPU autocast stands in for CUDA's."""
    import wan
    B = x.shape[0]
    with torch.autocast(x.device.type, torch.bfloat16, enabled=bf16):
        v = wan.forward(model, torch.cat([x, x]), torch.cat([s, s]), _cat_text(text, text_neg)).float()
    return v[B:] + 5.0 * (v[:B] - v[B:])                                 # (B, ...) guided


def wan_build(cfg, lora=0, checkpointing=True, bf16_base=True, attn=None):
    from diffusers import WanTransformer3DModel
    return build(cfg, lora, checkpointing, bf16_base, cls=WanTransformer3DModel)


def wan_cp_plan(model):
    import wan
    return wan.cp_plan(model)


WAN = SimpleNamespace(build=wan_build, forward=None, velocity=wan_velocity, inputs=wan_inputs, tokens=wan_tokens,
                      blocks=lambda m: m.blocks, text=lambda L1, L2: 512, cp_plan=wan_cp_plan)


def wan_runs(run):
    """The Wan 2.1 rows: each model of wan_models at wan_clip, a training micro-step and a rollout
    forward for every setup of WAN_SETUPS (one GPU: wan_clips_1gpu clips stored, one per rollout forward),
    and for 14B the full fine-tune on 8 GPUs at sp wan_sp too (keys 'wansp<n>_...': part 'wansp')."""
    out, (Fr, H, W) = [], wan_clip
    for m in wan_models:
        cfg = load_config(f'assets/wan21_t2v_{m}_transformer.json')
        setups = WAN_SETUPS + (((f'full FT, 8 GPUs, sp {wan_sp}', 'fsdp8'),) if m == '14b' and wan_sp > 1 else ())
        for name, key in setups:
            kw = dict(world=gpus) if key == 'fsdp8' else dict(world=0, n_store=wan_clips_1gpu, rollout_n=1)
            n = wan_sp if 'sp' in name else 1
            for what in ('train', 'rollout'):
                r = run(f'wan{"sp" + str(n) if n > 1 else ""}_{m}_{key}_{what}_{Fr}x{H}x{W}', what, Fr, H, W,
                        model_cfg=cfg, fam=WAN, lora=lora_rank if key == 'lora1' else 0, sp=n, **kw)
                if r is not None:
                    out.append(dict(r, model=f'Wan 2.1 {m.upper()}', setup=name,
                                    attention='WanAttnProcessor (no mask)'))  # whatever `processor` says
    return out


def wan_extras():
    """Bytes resident beside the transformer in a Wan run: the VAE in float32 (wan.load_decoder; the
    class defaults are Wan 2.1's VAE) and VideoAlign in bf16; UMT5 is freed before training."""
    from diffusers import AutoencoderKLWan
    with torch.device('meta'):
        vae_P = sum(p.numel() for p in AutoencoderKLWan().parameters())
    return {'VAE (fp32)': 4 * vae_P, 'VideoAlign (bf16)': 2 * videoalign_params}


def wan_flops(r):
    """TFLOP of one pass (one clip, one CFG branch; at sp n, all n ranks of its group): a forward, or a
    forward + backward (with the block recompute) of the update."""
    ph, n = r['phases'], r.get('sp', 1)
    if r['what'] == 'rollout':
        return n * ph['rollout forward']['flops'] / (2 * (rollout_batch if r['world'] else 1)) / 1e12
    return n * (ph['policy forward']['flops'] + ph['backward']['flops']) / 2 / 1e12


def wan_report(out, g):
    """results/fullsize.md's Wan 2.1 section."""
    runs, extras, c = out['wan'], out['wan_extras'], out['config']
    Fr, H, W = c.get('wan_clip', wan_clip)
    md = [f'### Wan 2.1 T2V 1.3B and 14B at {Fr}x{H}x{W} (wan.py)', '',
          f'The same micro-step and rollout forward as above, with WanTransformer3DModel built from the released configs '
          f'(assets/wan21_t2v_*_transformer.json) and called through wan.forward: {wan_tokens(Fr, H, W):,} video tokens '
          '(VAE 4x in time, 8x in space, 2x2 patches), 512 UMT5 text tokens of width 4096 attended by every block\'s '
          'cross-attention without a mask, CFG 2 branches. Full fine-tune on 8 GPUs: FSDP2 as above, '
          f'{c["clips"] // gpus} clips stored a rank, {c["rollout_batch"]} per rollout forward. On one GPU (train.py '
          'without torchrun): no FSDP, the full fine-tune keeps fp32 master weights, AdamW state, gradients and the fp32 '
          f'anchor on the device, bf16 autocast; LoRA r{c["lora_rank"]} keeps the frozen base in bf16 and adapters, AdamW '
          f'and anchor in fp32; {c.get("wan_clips_1gpu", wan_clips_1gpu)} clips stored, one per rollout forward. '
          f'14B also at sp {c.get("wan_sp", wan_sp)} (sp.py over the same 8 ranks, diffusers\' own _cp_plan: a rank '
          'runs the blocks on its share of the video tokens and the whole text), its sp group\'s clips stored. '
          'The optimizer state is AdamW\'s (8 bytes a trained parameter); train.py\'s default Muon keeps 4 on its 2-D '
          'matrices, so the full fine-tune\'s optimizer row is an upper bound. Resident beside the transformer: '
          + ', '.join(f'{k} {g(v)} GiB' for k, v in extras.items()) + ' (the UMT5-XXL text encoder is freed once the '
          'prompts are cached).', '']
    cats = list(runs[0]['categories'])
    name = lambda r: f'{r["model"]}, {r["setup"]}: {r["what"]}'
    rows = [[k] + [g(r['categories'][k]) for r in runs] for k in cats]
    rows.append(['peak phase'] + [r['peak_phase'] for r in runs])
    rows.append(['**total with VAE and VideoAlign**'] + [f'**{g(r["categories"]["total"] + sum(extras.values()))}**'
                                                          for r in runs])
    rows.append([f'fits {c["gpu_gb"]:.0f} GB'] + ['yes' if (r['categories']['total'] + sum(extras.values())) / GiB
                                                  <= c['gpu_gb'] else 'no' for r in runs])
    rows.append(['TFLOP a pass (one clip, one CFG branch; all ranks of an sp group)'] + [f'{wan_flops(r):.1f}' for r in runs])
    md += [table(['GiB per GPU'] + [name(r) for r in runs], rows), '']
    P = {r['model']: r['P'] for r in runs}
    md += ['Parameters: ' + ', '.join(f'{m} {p / 1e9:.3f} B' for m, p in P.items()) + '. A pass is one clip through '
           'the transformer for one CFG branch: a forward (rollout, evaluation) or a forward and a backward with its '
           'block recompute (update); the anchor\'s forward costs a forward. An iteration of G clips a prompt and N '
           'steps, all trained, costs about G x N x 2 x (forward + anchor forward + forward-backward) per prompt.', '']
    return md


# ----------------------------------------------------------------------------- the GPU check

TINY = dict(in_channels=9, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=2,
            num_refiner_layers=1, text_embed_dim=16, text_embed_2_dim=8, image_embed_dim=12,
            rope_axes_dim=(2, 2, 4))  # docs/method.md section 7's tiny transformer: builds in milliseconds


def check():
    """Real tensors, random weights of the real size (no download): under torchrun a full
    fine-tune micro-step with FSDP2 on every rank, else a LoRA micro-step on one device; a rollout
    forward; the PPO ratio of clips rolled out in a batch and recomputed one at a time (the blocks'
    attention is timed by bench/attention.py --gpu)."""
    import resource
    import sde
    ddp = 'RANK' in os.environ
    dev = device
    if ddp:
        dist.init_process_group('nccl' if device == 'cuda' else 'gloo')
        if device == 'cuda':
            dev = f'cuda:{int(os.environ["LOCAL_RANK"])}'
            torch.cuda.set_device(dev)
    cuda = dev.startswith('cuda')
    master = not ddp or dist.get_rank() == 0
    cfg = TINY if tiny else load_config()
    Fr, H, W = (9, 64, 96) if tiny else (num_frames, *sizes[0])
    L1, L2 = (8, 4) if tiny else text_tokens
    torch.manual_seed(seed)
    model = build(cfg, lora=0 if ddp else lora_rank, bf16_base=cuda)
    model.forward = partial(transformer, model)
    if ddp:
        shard(model, model.transformer_blocks, cuda=cuda)
    model.to_empty(device=dev)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)  # random weights: the cost does not depend on their values
    opt, anchor = setup(model, dev), Anchor(model, 'dual')
    store, text, text_neg = inputs(cfg, rollout_batch, Fr, H, W, L1, L2, dev)
    res, t = {}, [time.time()]

    def peak():  # bytes: the CUDA allocator's peak, or the process's peak RSS on a CPU
        return torch.cuda.max_memory_allocated(dev) if cuda else \
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def phase(name):
        if cuda:
            torch.cuda.synchronize(dev)
        res[name] = dict(seconds=time.time() - t[0], peak_gib=peak() / GiB)
        t[0] = time.time()
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    t[0] = time.time()
    train_step(model, anchor, opt, store, text, text_neg, cuda, phase)
    opt.zero_grad(set_to_none=True)  # train.py frees the gradients after the optimizer step
    rollout_step(model, store, text, text_neg, rollout_batch, cuda, phase)
    # batch invariance: logp of each clip's step from the batched rollout forward, then recomputed
    # alone (as the update does); exp(difference) is the PPO ratio at theta == theta_old
    x, s, s_next = store['xs'][:, 0], 0.9, 0.85
    expand = lambda tx: [u.expand(rollout_batch, *u.shape[1:]) for u in tx]
    with torch.no_grad():
        v = velocity(model, x, torch.full((rollout_batch,), s, device=dev), expand(text), expand(text_neg), cuda)
        st = sde.step(x, v, s, s_next, 'sage', 0.5, noise=torch.randn_like(x))
        one = [sde.step(x[i:i + 1], velocity(model, x[i:i + 1], torch.full((1,), s, device=dev), text, text_neg,
                                              cuda), s, s_next, 'sage', 0.5, x_next=st.x_next[i:i + 1]).logp
               for i in range(rollout_batch)]
    ratio = torch.exp(torch.cat(one) - st.logp)                         # (n,) exactly 1 if batch-invariant
    res['ratio_distance'] = (ratio - 1).abs().max().item()
    P = sum(p.numel() for p in model.parameters())  # a DTensor's numel is the global one
    est = {}
    path = os.path.join(out_dir, 'fullsize.json')
    if not tiny and os.path.exists(path):
        with open(path) as f:
            runs = json.load(f)['runs']
        pick = lambda what, world: next((r for r in runs if r['what'] == what and r['world'] == world
                                         and (r['height'], r['width']) == (H, W)), None)
        est = {k: pick(w, dist.get_world_size() if ddp else 0) for k, w in (('train', 'train'), ('rollout', 'rollout'))}
    if master:
        print(f'check on {dev} x{dist.get_world_size() if ddp else 1}: {"full fine-tune, FSDP2" if ddp else f"LoRA r{lora_rank}"}, '
              f'~{P / 1e9:.3f}B params, {Fr}x{H}x{W}')
        for name, r in res.items():
            if name == 'ratio_distance':
                continue
            e = est.get('rollout' if 'rollout' in name else 'train')
            e = e and e['phases'].get(name)
            print(f'  {name:16s} {r["seconds"]:8.2f} s   peak {r["peak_gib"]:7.2f} GiB' +
                  (f'   (estimate {e["peak"]["Total"] / GiB:.2f} GiB)' if e else ''))
        d = res['ratio_distance']
        print(f'  PPO ratio, batched rollout vs one clip at a time: max |ratio - 1| = {d:.2e} '
              f'({"above" if d > 1e-4 else "within"} the clip range 1e-4)')
        print('CHECK_JSON ' + json.dumps(res))
    if ddp:
        dist.destroy_process_group()


if __name__ == '__main__':
    if gpu:
        check()
    elif report_only:
        with open(os.path.join(out_dir, 'fullsize.json')) as f:
            out = json.load(f)
        with open(os.path.join(out_dir, 'fullsize.md'), 'w') as f:
            f.write(report(out) + '\n')
        update_readme(out)
    else:
        estimate()
