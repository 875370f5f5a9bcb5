"""
The measurement behind bench/fullsize.py: one training micro-step or one rollout forward of a
transformer at full size (HunyuanVideo 1.5 here, Wan 2.1's functions in bench/fullsize_wan.py), per-GPU
peak bytes by category and FLOPs, measured by torch on fake tensors (real shapes and dtypes, no
storage); the same micro-step on real tensors for the GPU check (bench/fullsize_gpu.py). Also used by
bench/hsdp.py (measure) and bench/attention.py (FlopCount, the GPU attention stand-in).

Not a script: its settings are set from the command line of the script that runs it, e.g.

    python -m bench.fullsize --gpus=8 --text_tokens="(1000, 256)"   # the estimate
    python -m bench.fullsize_gpu --lora_rank=64                      # the check

Tested by: python -m pytest tests/test_fullsize.py

How it measures: the transformer is built from its config (data:
assets/hunyuanvideo15_480p_t2v_transformer.json, the diffusers class defaults) on the meta device,
sharded with model.shard (the trainer's FSDP2 layout: every block, then the root; bf16 params, fp32
reduce) over a fake process group of 8 ranks played by this one process, and materialised as fake
tensors, its blocks' attention set by hunyuan15.set_attention as the load path sets it, with
MaskedKeysAttention (attention='masked_keys': the valid tokens' lengths would be data a fake tensor
does not hold; train.py's default, valid_tokens, computes at most these attention FLOPs and holds no
mask, bench/attention.py); --processor=diffusers for diffusers' own, whose runs are also measured
for the comparison as diffusers_*. One micro-step runs as train.py's step_loss does (the anchor's no-grad forward with its
weights swapped in, the policy's forward with both CFG branches and grad, backward with per-block
checkpointing, then clip + AdamW), under FSDPMemTracker (bytes by category: sharded / gathered
params, grads, optimizer state, activations, backward temporaries) and FlopCounterMode's per-op
formulas.
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

from infra.configurator import one_of
from models.attention import ATTENTIONS
from models.hunyuan15 import IMAGE_TOKENS, LORA_TARGETS, cp_plan, set_attention
from models.policy import _cat_text, shard
from infra.anchor import Anchor

# ----------------------------------------------------------------------------- settings
# set from the command line of the script that runs the measurement (bench.fullsize, bench.fullsize_gpu
# import those they use and hand the values back: bench/common.py's share); imported elsewhere, the defaults
model_config = 'assets/hunyuanvideo15_480p_t2v_transformer.json'  # the 8.3B transformer (class defaults)
gpus = 8                        # FSDP ranks of the full fine-tune
num_frames = 81                 # frames per clip -> 21 latent frames
sizes = ((352, 624), (480, 848))  # the paper's rollout resolution, and the model's native 480p
text_tokens = (1000, 256)       # Qwen and ByT5 tokens, the upper bound (model.velocity trims padding)
rollout_batch = 4               # clips per rollout forward and rank (train.py)
clips = 32                      # clips per iteration: 8 prompts x G = 4 (train.py)
num_steps = 20                  # rollout steps, all trained (train.py)
lora_rank = 64                  # config/lora_1gpu.py
processor = 'masked_keys'       # the blocks' attention (hunyuan15.set_attention): 'masked_keys' | 'diffusers'
seed = 0
RULES = dict(processor=one_of(*ATTENTIONS))  # the scripts' configure() checks these settings with them too
# -----------------------------------------------------------------------------
GiB = 2 ** 30


def load_config(path=None):
    with open(path or model_config) as f:
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


def train_step(model, anchor, opt, store, text, text_neg, bf16, phase, velocity=velocity, split=False):
    """step_loss + backward for one clip at one step, then clip + AdamW; phase(name) is called
    after each part (the caller records peaks and FLOPs there). velocity: the family's (Wan: wan_velocity).
    split: the backward as train.py's default runs it, the KL and policy terms apart (extras/diagnostics.py
    GradientSplit: two backward passes of one forward, the KL gradients in a second sum until the step)."""
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
    if split:
        from extras.diagnostics import GradientSplit
        gs = GradientSplit([opt], 0, always=True)
        gs.backward(loss, dict(policy=policy, valid=torch.ones_like(policy)), 1.0)
        phase('backward')
        # GradientSplit.measure's work without its .item() (a value a fake tensor lacks): the two norms, the
        # KL sum added back into the gradients
        torch.nn.utils.get_total_norm([p.grad for p in gs.params if p.grad is not None])
        torch.nn.utils.get_total_norm([g for g in gs.kl if g is not None])
        gs.add_back()
        phase('ratio')
    else:
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


# what measure() runs of a model family: HunyuanVideo 1.5's (the functions above), Wan's (bench/fullsize_wan.py's WAN)
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


def measure(cfg, what, Fr, H, W, world=None, lora=0, fake=True, attn='gpu', bf16=True, n_store=None, L=None,
            rollout_n=None, proc=None, sp=1, fam=None, split=False):
    """Peak bytes per rank by category and FLOPs of one micro-step ('train') or one rollout forward
    ('rollout'). world > 0 (default: the gpus setting): FSDP2 over a fake process group of `world`
    ranks (fake=True only); rollout_n: clips of a rollout forward (default: rollout_batch).
    proc: the blocks' attention (hunyuan15.set_attention; default the `processor` setting).
    sp > 1: sequence parallel as train.py sets it (sp.enable over a (dp, 1, sp) mesh of the same
    ranks; FSDP2 still over all of them): each rank runs the blocks on 1/sp of a clip's tokens.
    fam: the model family's functions (HUNYUAN, the default, or bench/fullsize_wan.py's WAN).
    split: the micro-step's backward with the two terms apart (train_step; train.py's default)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch._subclasses.fake_tensor import FakeTensorMode
    t0 = time.time()
    world = gpus if world is None else world
    rollout_n = rollout_batch if rollout_n is None else rollout_n
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
            from infra import sp as sp_mod
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
    res = dict(what=what, frames=Fr, height=H, width=W, world=world, sp=sp, lora=lora, attention=proc, P=P, P_trainable=P_train, split=split,
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
            anchor = Anchor(model, 'dual', every=10)  # a frozen sharded fp32 copy of the trainable weights
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
                train_step(model, anchor, opt, store, text, text_neg, bf16, phase, f.velocity, split)
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


def categories(r):
    """Peak bytes by category, in results/fullsize.md's words (anchor and stored rollout split off the
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
