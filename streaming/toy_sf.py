"""
The streaming toy, distilled as the released streaming models are (Self-Forcing's recipe): a block-causal student
(the architecture of streaming/toy_ar.py) that samples with the released 4-step x0 sampler and fresh re-noising.

    python -m streaming.toy_sf            # both stages into assets/toy_sf (ode_init/, transformer/, train.log): 39 min
                                          # (not committed: the story toy's student succeeded it, assets/toy_story)
    python -m streaming.toy_sf stage2     # stage 2 alone from assets/toy_sf/ode_init (the same run's second half)
    python -m bench.toy_sf             # held-out quality beside the bidirectional base -> results/toy_sf.*
    python sample.py --model=assets/toy_sf --beside=assets/toy --checkpoint=
    python -m pytest tests/test_toy_sf.py

The sampler (streaming.generate, LAYOUT; per 1-frame block, sigmas 1, .9375, .8333, .625 = timesteps
1000, 750, 500, 250 at shift 5):
    x0 = x - s_k v(x, s_k | cache),   x = (1 - s_{k+1}) x0 + s_{k+1} eps_k   (fresh eps_k),   cache <- v(x0, 0 | cache)
Stage 1, ODE pairs (Causal Forcing's causal variant of CausVid's initialisation): the AR teacher (assets/toy_ar,
guided at cfg 3) integrates its flow ODE frame by frame from its own cache, on its grid with the four sigmas added;
the student regresses each frame's endpoint from the frame's x at a random one of the four sigmas:
    L_ode = || x_{s_k} - s_k v(x_{s_k}, s_k | the teacher's clean earlier frames) - x0_ode ||^2,  k per frame
(PAIRS = 'bidirectional': CausVid's pairs, the bidirectional base's guided ODE over the whole clip.)
Stage 2, DMD (Self-Forcing): the student rolls its own clip out through its own cache with the sampler; in block b
only the forward of one exit step k_b ~ U{0..3} carries gradient, the block's output is that step's x0 (the steps
before it and the cache write run without gradient); then, x the clip, s a shifted uniform sigma, x_s = (1-s) x + s eps:
    real = teacher's guided x0(x_s),  fake = critic's x0(x_s),  g = (fake - real) / mean|x - real|  (per clip)
    L_gen = 0.5 mean (x - sg(x - g))^2          L_critic = || v_critic(x_s) - (eps - sg(x)) ||^2  (flow matching)
the critic a copy of the teacher, trained on the student's clips CRITIC_UPDATES times per generator update.

Where it differs from the released recipe, and why (docs/streaming.md section 7 has the figures):
- the init (PAIRS) is Causal Forcing's: pairs from the causal AR toy, not CausVid's from the bidirectional base. A
  frame's endpoint under the bidirectional ODE depends on the later frames' noise, which the causal student never
  sees: it regresses their average, and the 4-step sampler with fresh noise then collapses to grey (measured in
  docs/streaming.md section 7). The student's weights start from assets/toy_ar (teacher-forced diffusion: what
  Wan's weights are to Self-Forcing).
- the generator steps by SGD with momentum, not AdamW with betas (0, 0.999): at 8-16 clips an update Adam's
  per-parameter normalisation turns the noisy DMD gradient into equal-sized steps, and the composite fell in every
  AdamW run; the critic first fits the initial student (CRITIC_WARMUP), then learns at a toy rate, CRITIC_UPDATES
  times per generator update (Self-Forcing: 5), the first on the generator update's own clips (detached).
- fp32, one process, toy batch and learning rates (Self-Forcing: bf16 FSDP on 64 GPUs, lr 2e-6 / 4e-7).
Stage 2 as committed lowers the composite it starts from (docs/streaming.md section 7: the figures).
Tested by: python -m pytest tests/test_toy_sf.py
"""
import copy
import os
import sys
import time

import torch
import torch.nn.functional as F

from models import family, policy, toy
import streaming
from streaming import toy_ar
from streaming.wan_causal import CausalWanTransformer3DModel

# ----------------------------------------------------------------------------- settings
DIR = 'assets/toy_sf'           # committed model directory (transformer/, ode_init/, the toy's text table, prompts)
INIT = 'assets/toy_ar'          # the student's starting weights: the teacher-forced streaming toy (built:
                                # python -m streaming.toy_ar)
LAYOUT = dict(block=1, sink=1, window=4, timesteps=(1000, 750, 500, 250), shift=5.0,
              renoise='fresh')  # the released 4-step sampler; block, sink, window scaled as toy_ar's
SEED = 1337                     # data stream, noise, exit steps
PAIRS = 'causal'                # ODE pairs from: 'causal' (Causal Forcing: the AR toy's ODE, frame by frame from
                                # its own cache) or 'bidirectional' (CausVid: the base's ODE over the clip)
TEACHER_CFG = 3.0               # guidance of the bidirectional teacher: its ODE pairs and DMD's real score
TEACHER_STEPS = 16              # Euler steps of its ODE at shift 3 (the four sigmas added to the grid)
AR_CFG = 3.0                    # guidance of the AR teacher's ODE (its 8 steps at shift 3, the four sigmas added)
ODE_CLIPS = 384                 # ODE pairs: train prompts x seeds
ODE_ITERS = 300                 # stage 1 optimizer steps
ODE_BATCH = 8                   # clips a stage-1 step
ODE_LR = 3e-4                   # AdamW, stage 1 (20 warm-up steps, then constant)
DMD_ITERS = 220                 # stage 2 generator updates
DMD_BATCH = 16                  # clips a rollout
GEN_LR = 3e-4                   # SGD, the student in stage 2
GEN_MOMENTUM = 0.9              # its momentum
CRITIC_LR = 5e-5                # AdamW, the critic (betas (0, 0.999), as Self-Forcing's)
CRITIC_UPDATES = 3              # critic updates a generator update (Self-Forcing: 5)
CRITIC_WARMUP = 40              # critic updates on the initial student's clips before the first generator update
DMD_SHIFT = 5.0                 # warp of the DMD sigma, U(DMD_MIN, DMD_MAX) before it (the sampler's)
DMD_MIN, DMD_MAX = 0.02, 0.98
EMA = 0.99                      # decay of the saved student average in stage 2
LOG_EVERY = 25                  # log a fixed set of 16 train prompts' composite every this many updates


class ToySFTransformer(CausalWanTransformer3DModel):
    """The distilled toy's causal Wan: its own class so that models.family_of finds this family."""


def train_prompts():
    return [p for p in toy.all_prompts() if not toy.is_eval_prompt(p)]


def load_student(path):
    net = ToySFTransformer.from_pretrained(os.path.join(path, 'transformer'), torch_dtype=torch.float32)
    return streaming.install(net, LAYOUT)


# ----------------------------------------------------------------------------- stage 1: ODE pairs

def ode_grid():
    """The teacher's Euler grid: TEACHER_STEPS at shift 3 with the sampler's four sigmas added; their indices."""
    s = sorted(set(sde_sigmas(TEACHER_STEPS, 3.0)) | set(streaming.sigmas(LAYOUT))
               | {0.0}, reverse=True)
    return s, [s.index(x) for x in streaming.sigmas(LAYOUT)] + [len(s) - 1]


def sde_sigmas(n, shift):
    import sde
    return [float(x) for x in sde.sigmas(n, shift)]


@torch.no_grad()
def ode_pairs(teacher, prompts, noise):
    """CausVid's pairs: the bidirectional teacher's guided ODE from noise (B, C, F, h, w) over the whole clip;
    x at the four sigmas and at 0, (B, 5, C, F, h, w)."""
    grid, keep = ode_grid()
    text, neg = toy.encode_prompts(prompts), toy.encode_prompts([''] * len(prompts))
    x, out = noise, [noise]
    for i in range(len(grid) - 1):
        v = policy.velocity(teacher, x, torch.full((len(x),), grid[i]), text, TEACHER_CFG, neg)
        x = x + (grid[i + 1] - grid[i]) * v  # Euler
        if i + 1 in keep:
            out.append(x)
    return torch.stack(out, 1)


@torch.no_grad()
def causal_pairs(ar, prompts, noise):
    """Causal Forcing's pairs: the AR teacher (assets/toy_ar), guided, integrates its flow ODE frame by frame from
    its own cache (its x0 written at timestep 0) on its grid with the four sigmas added; x at the sigmas and the
    frame's x0 (its last step's prediction), (B, 5, C, F, h, w). Each frame's pair depends only on what the
    causal student sees: its own noise and the earlier frames."""
    sig = streaming.sigmas(LAYOUT)
    grid = sorted(set(streaming.sigmas(ar.layout)) | set(sig), reverse=True)
    B = len(prompts)
    ctx = torch.cat([toy_ar.context(toy.encode_prompts(prompts)), toy_ar.context(toy.encode_prompts([''] * B))])
    cache, frames = streaming.KVCache(ar.layout), []
    for b in range(noise.shape[2]):  # 1-frame blocks
        x, rec = noise[:, :, b:b + 1], []  # (B, C, 1, h, w)
        for i, s in enumerate(grid):
            if s in sig:
                rec.append(x)
            v = streaming.forward_block(ar, torch.cat([x, x]), torch.full((2 * B,), s), ctx, cache, b)
            v = v[B:] + AR_CFG * (v[:B] - v[B:])  # guided: conditional rows first
            x0 = x - s * v
            if i + 1 < len(grid):
                x = x + (grid[i + 1] - s) * v  # Euler
        streaming.forward_block(ar, torch.cat([x0, x0]), torch.zeros(2 * B), ctx, cache, b, write=True)
        frames.append(torch.stack(rec + [x0], 1))  # (B, 5, C, 1, h, w)
    return torch.cat(frames, 3)


def ode_loss(net, traj, prompts, gen):
    """x0 regression on a batch of ODE pairs traj (B, 5, C, F, h, w), each frame at its own sampler step, the
    endpoint's clean frames as context (streaming.teacher_mask: what the cache gives a frame)."""
    B, n = traj.shape[0], traj.shape[3]
    sig = torch.tensor(streaming.sigmas(LAYOUT))
    k = torch.randint(len(sig), (B, n), generator=gen)  # (B, F) step of each frame
    x0 = traj[:, -1]  # (B, C, F, h, w)
    xt = traj[torch.arange(B)[:, None], k, :, torch.arange(n)[None]].permute(0, 2, 1, 3, 4)  # (B, C, F, h, w)
    s = sig[k]  # (B, F)
    seq, s_seq = torch.cat([x0, xt], 2), torch.cat([torch.zeros(B, n), s], 1)
    v = streaming.forward_masked(net, seq, s_seq, toy_ar.context(toy.encode_prompts(prompts)), list(range(n)) * 2,
                                 streaming.teacher_mask(n, LAYOUT))[:, :, n:]
    return (xt - s[:, None, :, None, None] * v - x0).square().mean()


# ----------------------------------------------------------------------------- stage 2: DMD

def rollout(net, noise, ctx, exits, gens=None):
    """The sampler, Self-Forcing's training form: clip (B, C, F, h, w) from noise, block b stopping at step exits[b],
    whose forward alone carries gradient (when grad is enabled); with exits all 3, streaming.generate's clip."""
    layout, sig = net.layout, streaming.sigmas(net.layout)
    cache, out, bl = streaming.KVCache(layout), [], layout['block']
    for b, i in enumerate(range(0, noise.shape[2], bl)):
        x = noise[:, :, i:i + bl]  # (B, C, block, h, w)
        for k, s in enumerate(sig[:exits[b] + 1]):
            if k == exits[b]:
                cache.text = {}  # the text's keys again, in this forward's graph (they are cached at the first)
            with torch.set_grad_enabled(torch.is_grad_enabled() and k == exits[b]):
                x0 = x - s * streaming.forward_block(net, x, torch.full((len(x),), s), ctx, cache, i)
            if k < exits[b]:  # re-noise with fresh noise, without gradient (the exit step's input is detached)
                z = torch.randn_like(x0) if gens is None else torch.stack([torch.randn(x0.shape[1:], generator=g)
                                                                            for g in gens])
                x = ((1 - sig[k + 1]) * x0 + sig[k + 1] * z).detach()
        with torch.no_grad():  # the finished block into the cache: one more forward at timestep 0
            streaming.forward_block(net, x0.detach(), torch.zeros(len(x0)), ctx, cache, i, write=True)
        out.append(x0)
    return torch.cat(out, 2)


def dmd_sigma(n, gen):
    u = DMD_MIN + (DMD_MAX - DMD_MIN) * torch.rand(n, generator=gen)
    return DMD_SHIFT * u / (1 + (DMD_SHIFT - 1) * u)  # (n,)


def x0_of(net, xs, s, text, cfg=1.0, neg=None):
    """A flow model's x0 = x_s - s v at x_s (B, C, F, h, w), sigmas s (B,); guided at cfg against neg."""
    return xs - s.view(-1, 1, 1, 1, 1) * policy.velocity(net, xs, s, text, cfg, neg)


def dmd_grad(x, real, fake):
    """DMD's normalised gradient at the clips x: (fake - real) / mean|x - real|, the mean per clip."""
    return (fake - real) / (x - real).abs().mean((1, 2, 3, 4), keepdim=True)


def dmd_loss(x, grad):
    """0.5 mean (x - sg(x - grad))^2: its gradient at x is grad / x.numel() (the DMD step, as a loss)."""
    return 0.5 * F.mse_loss(x, (x - grad).detach())


def critic_loss(critic, x, text, gen):
    """Flow matching of the critic on the student's clips x (detached)."""
    s, eps = dmd_sigma(len(x), gen), torch.randn(x.shape, generator=gen)
    sb = s.view(-1, 1, 1, 1, 1)
    return (policy.velocity(critic, (1 - sb) * x + sb * eps, s, text) - (eps - x)).square().mean()


# ----------------------------------------------------------------------------- the run

def probe(net, gen_seed=0):
    """Composite of 16 fixed train prompts, one seed each (the training log's yardstick; the bench is held out)."""
    prompts = train_prompts()[::3]
    noise = torch.stack([torch.randn(toy.LATENT_SHAPE, generator=torch.Generator().manual_seed(gen_seed + i))
                         for i in range(len(prompts))])
    gens = [torch.Generator().manual_seed(10 ** 6 + gen_seed + i) for i in range(len(prompts))]
    x = streaming.generate(net, noise, toy_ar.context(toy.encode_prompts(prompts)), gens)
    return toy.summary(toy.decode(x), prompts)['composite']


def batch(gen, n):
    p = train_prompts()
    return [p[i] for i in torch.randint(len(p), (n,), generator=gen)], torch.randn(n, *toy.LATENT_SHAPE, generator=gen)


def stage1(net, teacher, gen, say):
    """ODE pairs (PAIRS), then x0 regression of the student on them (in place)."""
    prompts = [p for _ in range(ODE_CLIPS // len(train_prompts()) + 1) for p in train_prompts()][:ODE_CLIPS]
    noise = torch.randn(ODE_CLIPS, *toy.LATENT_SHAPE, generator=gen)
    if PAIRS == 'causal':
        ar = toy_ar.load_transformer(os.path.join(toy._HERE, toy_ar.DIR))
        traj = torch.cat([causal_pairs(ar, prompts[i:i + 32], noise[i:i + 32]) for i in range(0, ODE_CLIPS, 32)])
    else:
        traj = torch.cat([ode_pairs(teacher, prompts[i:i + 32], noise[i:i + 32]) for i in range(0, ODE_CLIPS, 32)])
    say(f'stage 1: {ODE_CLIPS} ODE pairs ({PAIRS} teacher)')
    opt = torch.optim.AdamW(net.parameters(), lr=ODE_LR, betas=(0.9, 0.99), weight_decay=0.0)
    for it in range(ODE_ITERS):
        for g in opt.param_groups:
            g['lr'] = ODE_LR * min(1, (it + 1) / 20)
        idx = torch.randint(ODE_CLIPS, (ODE_BATCH,), generator=gen)
        loss = ode_loss(net, traj[idx], [prompts[i] for i in idx], gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        if it % 100 == 0 or it == ODE_ITERS - 1:
            say(f'ode {it:4d}  loss {loss.item():.4f}' + (f'  probe {probe(net):.4f}' if it == ODE_ITERS - 1 else ''))


def stage2(net, teacher, gen, say):
    """DMD: the student trained in place; returns its weight average (what is saved)."""
    critic = copy.deepcopy(teacher).train().requires_grad_(True)  # the fake score starts as the teacher
    critic.context_embedder_2.requires_grad_(False)  # sees only masked zeros (models/toy.py)
    ema = copy.deepcopy(net).eval().requires_grad_(False)
    opt_g = torch.optim.SGD(net.parameters(), lr=GEN_LR, momentum=GEN_MOMENTUM)  # not AdamW: see the docstring
    opt_c = torch.optim.AdamW([p for p in critic.parameters() if p.requires_grad], lr=CRITIC_LR,
                              betas=(0.0, 0.999), weight_decay=0.0)
    n, neg = toy.LATENT_SHAPE[1] // LAYOUT['block'], toy.encode_prompts([''] * DMD_BATCH)  # blocks a clip
    for it in range(-CRITIC_WARMUP, DMD_ITERS):  # it < 0: the critic alone learns the initial student's clips
        for u in range(CRITIC_UPDATES if it >= 0 else 1):
            caps, eps = batch(gen, DMD_BATCH)
            text = toy.encode_prompts(caps)
            exits = torch.randint(len(LAYOUT['timesteps']), (n,), generator=gen).tolist()  # one exit step per block
            update = u == 0 and it >= 0  # the first rollout of an iteration also makes the generator's update
            with torch.set_grad_enabled(update):
                x = rollout(net, eps, toy_ar.context(text), exits)  # (B, C, F, h, w)
            if update:
                s, e = dmd_sigma(DMD_BATCH, gen), torch.randn(x.shape, generator=gen)
                with torch.no_grad():
                    xs = (1 - s.view(-1, 1, 1, 1, 1)) * x + s.view(-1, 1, 1, 1, 1) * e  # the clip noised to s
                    real = x0_of(teacher, xs, s, text, TEACHER_CFG, neg)  # the teacher's guided x0
                    g = dmd_grad(x, real, x0_of(critic, xs, s, text))  # fake: the critic's x0, unguided
                loss_g = dmd_loss(x, g)
                opt_g.zero_grad(set_to_none=True)
                loss_g.backward()
                gnorm = torch.nn.utils.clip_grad_norm_(net.parameters(), 10.0)
                opt_g.step()
            loss_c = critic_loss(critic, x.detach(), text, gen)
            opt_c.zero_grad(set_to_none=True)
            loss_c.backward()
            torch.nn.utils.clip_grad_norm_(critic.parameters(), 1.0)
            opt_c.step()
        if it < 0:
            continue
        toy_ar.ema_update(ema, net, it, EMA)
        if it % LOG_EVERY == 0 or it == DMD_ITERS - 1:
            say(f'dmd {it:4d}  loss {loss_g.item():.4f}  |grad| {gnorm:.3f}  critic {loss_c.item():.4f}  '
                f'probe {probe(net):.4f}  ema {probe(ema):.4f}')
    return ema


def save(net, out):
    """net into out/transformer (published whole: a temporary directory, then a rename) and out's index."""
    import shutil
    tmp = os.path.join(out, 'transformer.tmp')
    net.save_pretrained(tmp)
    shutil.rmtree(os.path.join(out, 'transformer'), ignore_errors=True)
    os.replace(tmp, os.path.join(out, 'transformer'))
    for f in ('text_embeddings.safetensors', 'train_prompts.txt', 'eval_prompts.txt'):  # the toy's own
        shutil.copy(os.path.join(toy._HERE, toy.DIR, f), out)
    with open(os.path.join(out, 'model_index.json'), 'w') as f:
        f.write('{\n "_class_name": "ToyWorldSF",\n "_comment": "the distilled streaming toy of streaming/toy_sf.py: '
                'a tiny block-causal WanTransformer3DModel in transformer/, sampled in 4 steps"\n}\n')


def train(init=None):
    """Both stages into DIR; init: a stage-1 directory (DIR/ode_init) to run stage 2 alone from. Each stage draws
    from its own seeded generator, so stage 2 alone from the saved stage 1 is the same run as both in one."""
    torch.set_num_threads(toy.THREADS)
    out = os.path.join(toy._HERE, DIR)
    os.makedirs(out, exist_ok=True)
    t0 = time.time()
    log = open(os.path.join(out, 'train.log'), 'a' if init else 'w')

    def say(line):
        line = f'{line}  {(time.time() - t0) / 60:5.1f} min'
        print(line, flush=True)
        log.write(line + '\n')
        log.flush()

    teacher = toy.load_model().requires_grad_(False)
    family(init or os.path.join(toy._HERE, INIT))  # an unbuilt INIT (assets/toy_ar): the command that builds it
    net = load_student(init or os.path.join(toy._HERE, INIT)).train()
    say(f'init ({init or INIT}, 4-step sampler): probe composite {probe(net):.4f}')
    if init is None:
        stage1(net, teacher, torch.Generator().manual_seed(SEED), say)
        save(net, os.path.join(out, 'ode_init'))
    ema = stage2(net, teacher, torch.Generator().manual_seed(SEED + 1), say)
    say(f'done: stage 1 {ODE_CLIPS} {PAIRS} pairs + {ODE_ITERS} steps of {ODE_BATCH}; stage 2 {DMD_ITERS} updates '
        f'of {DMD_BATCH} clips, {CRITIC_UPDATES} critic updates each; one thread')
    log.close()
    save(ema, out)


# ----------------------------------------------------------------------------- the model interface
PIPELINE = 'ToyWorldSF'
TRANSFORMER = 'ToySFTransformer'
HUB_ID = None  # built into assets/toy_sf by python -m streaming.toy_sf (not committed)
DEFAULTS = dict(toy_ar.DEFAULTS, sample_steps=len(LAYOUT['timesteps']), shift=LAYOUT['shift'], cfg=1.0)
LORA_TARGETS = toy_ar.LORA_TARGETS
reward, manifold_distance, text_encoder = toy.reward, toy.manifold_distance, toy.text_encoder
blocks, forward, generate, load_decoder, latent_shape, cp_plan, context = (toy_ar.blocks, toy_ar.forward, toy_ar.generate,
    toy_ar.load_decoder, toy_ar.latent_shape, toy_ar.cp_plan, toy_ar.context)


def load_transformer(path, meta=False, attention=None, backend='native'):
    return toy_ar.load_transformer(path, meta, attention, backend, cls=ToySFTransformer, layout=LAYOUT)


if __name__ == '__main__':
    if sys.argv[1:] not in ([], ['stage2']):
        raise SystemExit('usage: python -m streaming.toy_sf [stage2]   (stage2: stage 2 alone from DIR/ode_init)')
    train(os.path.join(toy._HERE, DIR, 'ode_init') if sys.argv[1:] == ['stage2'] else None)
