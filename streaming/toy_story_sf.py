"""
The story toy's streaming student (issue 69 item 1): the bidirectional story teacher (streaming/toy_story.py) made
causal and distilled as the releases do it (CausVid's ODE pairs, then Self-Forcing's DMD), sampled with the
released 4-step sampler (sigmas 1, .9375, .8333, .625, fresh re-noising; block 1, sink 1, window 4 as toy_sf's).

    python -m streaming.toy_story_sf stage1   # ODE pairs from the teacher, x0 regression -> out-toy-story/ode_init
    python -m streaming.toy_story_sf stage2   # DMD from ode_init -> out-toy-story/student (the probe's best)
    python -m pytest tests/test_toy_story.py

Stage 1 (CausVid): the teacher, guided at cfg 3, integrates its ODE over whole clips (16 Euler steps at shift 3,
the four sigmas added); the student, starting from the teacher's own weights, regresses each frame's endpoint from
the frame at one of the four sigmas with the endpoint's earlier frames as clean context (streaming.teacher_mask):
    L_ode = || x_{s_k} - s_k v(x_{s_k}, s_k | clean earlier frames of the window) - x0_ode ||^2,  k per frame
Stage 2 (Self-Forcing's DMD, its optimizer settings): the student rolls a clip out through its own cache; one exit
step k ~ U{0..3}, shared by every block of the update, is the only forward with gradient; x the clip, s a shifted
uniform sigma, x_s = (1 - s) x + s eps:
    g = (fake_x0(x_s) - real_x0(x_s)) / mean|x - real_x0|,   L_gen = 0.5 mean (x - sg(x - g))^2
real: the teacher at cfg 3; fake: a critic (a copy of the teacher) trained by flow matching on the student's clips
CRITIC_UPDATES times per generator update; both optimizers AdamW with betas (0, 0.999). Early stopping: the saved
student is the weight average at the held-out probe's best (16 held-out stories and 16 held-out clips, one seed).
Updates alternate the base's clips (9 frames, one caption) and stories (16 frames, 4 segments).
Where it differs from the releases: fp32, one process, toy batch (8 clips), toy learning rates, at most 200 updates.
Results: results/toy_story.md (python -m bench.toy_story).
Tested by: python -m pytest tests/test_toy_story.py
"""
import copy
import os
import sys
import time

import torch

import sde
from models import toy
import streaming
from streaming import toy_ar, toy_sf, toy_story as ts

# ----------------------------------------------------------------------------- settings
TEACHER_CFG = 3.0               # guidance of the teacher: its ODE pairs and DMD's real score
TEACHER_STEPS = 16              # its Euler steps at shift 3 (the four sigmas added to the grid)
ODE_CLIPS = 128                 # ODE pairs of each kind (stories, base clips), the train captions
ODE_ITERS = 400                 # stage 1 optimizer steps (alternating kinds)
ODE_BATCH = 8                   # clips a stage-1 step
ODE_LR = 3e-4                   # AdamW, stage 1 (20 warm-up steps, then constant)
DMD_ITERS = 200                 # stage 2 generator updates at most (the saved student: the probe's best)
DMD_BATCH = 8                   # clips a rollout
GEN_LR = 2e-5                   # AdamW betas (0, 0.999), the student (Self-Forcing's optimizer)
CRITIC_LR = 5e-5                # AdamW betas (0, 0.999), the critic
CRITIC_UPDATES = 5              # critic updates a generator update (Self-Forcing's)
CRITIC_WARMUP = 20              # critic updates on the initial student's clips before the first generator update
DMD_SHIFT, DMD_MIN, DMD_MAX = 5.0, 0.02, 0.98  # the DMD sigma: U(min, max) warped at the sampler's shift
EMA = 0.9                       # decay of the student's weight average (tens of updates)
PROBE_EVERY = 10                # generator updates between held-out probes (the early stop)
SEED = 1337


def train_captions():
    return [p for p in toy.all_prompts() if not toy.is_eval_prompt(p)]


def sigmas():
    return streaming.sigmas(ts.STUDENT)  # 1, .9375, .8333, .625


def texts_of(kind, n, gen):
    """n training texts (B lists of S prompts) of a kind: 'stories' (4 segments) or 'clips' (one caption)."""
    caps = train_captions()
    pick = torch.randint(len(caps), (n,), generator=gen).tolist()
    if kind == 'clips':
        return [[caps[i]] for i in pick]
    return [ts.story_of(caps[i], torch.randint(2 ** 31, (1,), generator=gen).item()) for i in pick]


def frames_of(kind):
    return ts.FRAMES if kind == 'stories' else toy.FRAMES


# ----------------------------------------------------------------------------- stage 1: ODE pairs

@torch.no_grad()
def ode_pairs(teacher, texts, noise):
    """The teacher's guided ODE from noise (B, C, F, h, w): x at the four sigmas and at 0, (B, 5, C, F, h, w)."""
    grid = sorted(set(float(v) for v in streaming.sigmas(ts.STUDENT))
                  | set(float(v) for v in sde.sigmas(TEACHER_STEPS, 3.0)), reverse=True)
    rec = []
    ts.sample_teacher(teacher, noise, ts.encode_stories(texts), cfg=TEACHER_CFG, sigmas=grid, record=rec)
    keep = [grid.index(s) for s in sigmas()] + [len(grid) - 1]
    return torch.stack([rec[i] for i in keep], 1)


def ode_loss(net, traj, texts, gen):
    """x0 regression on pairs traj (B, 5, C, F, h, w), each frame at its own sampler step, the endpoint's frames
    as clean context (what the cache gives a frame); each frame reads its own segment's text."""
    B, n = traj.shape[0], traj.shape[3]
    sig = torch.tensor(sigmas())
    k = torch.randint(len(sig), (B, n), generator=gen)  # (B, F) step of each frame
    x0 = traj[:, -1]  # (B, C, F, h, w)
    xt = traj[torch.arange(B)[:, None], k, :, torch.arange(n)[None]].permute(0, 2, 1, 3, 4)  # (B, C, F, h, w)
    s = sig[k]
    segs = ts.segs_of(n) if len(texts[0]) > 1 else [0] * n
    v = ts.forward_frames(net, torch.cat([x0, xt], 2), torch.cat([torch.zeros(B, n), s], 1), ts.encode_stories(texts),
                          segs * 2, list(range(n)) * 2, streaming.teacher_mask(n, net.layout))[:, :, n:]
    return (xt - s[:, None, :, None, None] * v - x0).square().mean()


def stage1(out, say):
    gen = torch.Generator().manual_seed(SEED)
    teacher = ts.load(os.path.join(out, 'teacher')).requires_grad_(False)
    data = {}
    for kind in ('stories', 'clips'):
        texts = texts_of(kind, ODE_CLIPS, gen)
        C, _, h, w = toy.LATENT_SHAPE
        noise = torch.randn(ODE_CLIPS, C, frames_of(kind), h, w, generator=gen)
        traj = torch.cat([ode_pairs(teacher, texts[i:i + 32], noise[i:i + 32]) for i in range(0, ODE_CLIPS, 32)])
        data[kind] = (traj, texts)
        say(f'stage 1: {ODE_CLIPS} ODE pairs of {kind} from the teacher (cfg {TEACHER_CFG})')
    net = ts.load(os.path.join(out, 'teacher')).train()  # the student starts from the teacher's own weights
    say(f'init (the teacher made causal, 4 steps): probe {probe(net)}')
    opt = torch.optim.AdamW(net.parameters(), lr=ODE_LR, betas=(0.9, 0.99), weight_decay=0.0)
    for it in range(ODE_ITERS):
        for g in opt.param_groups:
            g['lr'] = ODE_LR * min(1, (it + 1) / 20)
        traj, texts = data['stories' if it % 2 else 'clips']
        idx = torch.randint(len(traj), (ODE_BATCH,), generator=gen)
        loss = ode_loss(net, traj[idx], [texts[i] for i in idx], gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        if it % 100 == 0 or it == ODE_ITERS - 1:
            say(f'ode {it:4d}  loss {loss.item():.4f}' + (f'  probe {probe(net)}' if it == ODE_ITERS - 1 else ''))
    ts.save(net, out, 'ode_init')


# ----------------------------------------------------------------------------- stage 2: DMD

def rollout(net, noise, texts, exit_step):
    """The sampler in Self-Forcing's training form: clip (B, C, F, h, w) from noise, every block stopping at step
    exit_step, whose forward alone carries gradient; the text keys replaced at each segment's first frame."""
    sig, n_seg = sigmas(), texts.shape[1]
    cache, out, per = streaming.KVCache(net.layout), [], noise.shape[2] // n_seg
    for b in range(noise.shape[2]):
        if b % per == 0:
            cache.text = {}  # a new segment: its text keys at the next forward
        ctx, x = texts[:, b // per], noise[:, :, b:b + 1]
        for k, s in enumerate(sig[:exit_step + 1]):
            if k == exit_step:
                cache.text = {}  # the text's keys again, inside this forward's graph
            with torch.set_grad_enabled(torch.is_grad_enabled() and k == exit_step):
                x0 = x - s * streaming.forward_block(net, x, torch.full((len(x),), s), ctx, cache, b)
            if k < exit_step:  # fresh noise, no gradient: the exit step's input is detached
                x = ((1 - sig[k + 1]) * x0 + sig[k + 1] * torch.randn_like(x0)).detach()
        with torch.no_grad():  # the finished block into the cache at timestep 0
            streaming.forward_block(net, x0.detach(), torch.zeros(len(x0)), ctx, cache, b, write=True)
        out.append(x0)
    return torch.cat(out, 2)


def dmd_sigma(n, gen):
    u = DMD_MIN + (DMD_MAX - DMD_MIN) * torch.rand(n, generator=gen)
    return DMD_SHIFT * u / (1 + (DMD_SHIFT - 1) * u)


def x0_of(net, xs, s, texts, cfg=1.0):
    """A bidirectional model's x0 = x_s - s v at clips xs, sigmas s (B,), per-segment texts, guided at cfg."""
    B, n = xs.shape[0], xs.shape[2]
    segs, sf = ts.segs_of(n) if texts.shape[1] > 1 else [0] * n, s[:, None].expand(B, n)
    if cfg == 1.0:
        v = ts.forward_frames(net, xs, sf, texts, segs)
    else:
        neg = ts.encode([''] * B)[:, None].expand_as(texts)
        vv = ts.forward_frames(net, torch.cat([xs, xs]), torch.cat([sf, sf]), torch.cat([texts, neg]), segs)
        v = vv[B:] + cfg * (vv[:B] - vv[B:])
    return xs - s.view(-1, 1, 1, 1, 1) * v


def critic_loss(critic, x, texts, gen):
    s, eps = dmd_sigma(len(x), gen), torch.randn(x.shape, generator=gen)
    sb, n = s.view(-1, 1, 1, 1, 1), x.shape[2]
    v = ts.forward_frames(critic, (1 - sb) * x + sb * eps, s[:, None].expand(-1, n), texts,
                          ts.segs_of(n) if texts.shape[1] > 1 else [0] * n)
    return (v - (eps - x)).square().mean()


def stage2(out, say):
    gen = torch.Generator().manual_seed(SEED + 1)
    torch.manual_seed(SEED + 2)  # the rollouts' re-noising draws (torch.randn_like)
    teacher = ts.load(os.path.join(out, 'teacher')).requires_grad_(False)
    critic = ts.load(os.path.join(out, 'teacher')).train()
    net = ts.load(os.path.join(out, 'ode_init')).train()
    ema = copy.deepcopy(net).eval().requires_grad_(False)
    opt_g = torch.optim.AdamW(net.parameters(), lr=GEN_LR, betas=(0.0, 0.999), weight_decay=0.0)
    opt_c = torch.optim.AdamW(critic.parameters(), lr=CRITIC_LR, betas=(0.0, 0.999), weight_decay=0.0)
    C, _, h, w = toy.LATENT_SHAPE
    best = probe(net)
    say(f'stage 2 from ode_init: probe {best}')
    best = sum(best.values())
    for it in range(-CRITIC_WARMUP, DMD_ITERS):
        kind = 'stories' if it % 2 else 'clips'
        exit_step = torch.randint(len(sigmas()), (1,), generator=gen).item()  # one exit step, shared by the blocks
        for u in range(CRITIC_UPDATES if it >= 0 else 1):
            texts = ts.encode_stories(texts_of(kind, DMD_BATCH, gen))
            eps = torch.randn(DMD_BATCH, C, frames_of(kind), h, w, generator=gen)
            update = u == 0 and it >= 0  # the first rollout of an update also trains the generator
            with torch.set_grad_enabled(update):
                x = rollout(net, eps, texts, exit_step)
            if update:
                s, e = dmd_sigma(DMD_BATCH, gen), torch.randn(x.shape, generator=gen)
                with torch.no_grad():
                    xs = (1 - s.view(-1, 1, 1, 1, 1)) * x + s.view(-1, 1, 1, 1, 1) * e
                    real = x0_of(teacher, xs, s, texts, TEACHER_CFG)
                    g = toy_sf.dmd_grad(x, real, x0_of(critic, xs, s, texts))  # fake: the critic's x0
                loss_g = toy_sf.dmd_loss(x, g)
                opt_g.zero_grad(set_to_none=True)
                loss_g.backward()
                gnorm = torch.nn.utils.clip_grad_norm_(net.parameters(), 10.0)
                opt_g.step()
            loss_c = critic_loss(critic, x.detach(), texts, gen)
            opt_c.zero_grad(set_to_none=True)
            loss_c.backward()
            torch.nn.utils.clip_grad_norm_(critic.parameters(), 1.0)
            opt_c.step()
        if it < 0:
            continue
        toy_ar.ema_update(ema, net, it, EMA)
        if (it + 1) % PROBE_EVERY == 0:
            pr = probe(ema)
            say(f'dmd {it + 1:4d}  loss {loss_g.item():.4f}  |grad| {gnorm:.3f}  critic {loss_c.item():.4f}  probe {pr}')
            if sum(pr.values()) > best:  # early stopping: keep the probe's best
                best = sum(pr.values())
                ts.save(ema, out, 'student')
                say(f'  saved as the best so far (sum {best:.4f})')


@torch.no_grad()
def probe(net, n=16):
    """Held-out composite with the 4-step sampler: 16 held-out stories and 16 held-out clips, one seed each."""
    caps = [p for p in toy.all_prompts() if toy.is_eval_prompt(p)][:n]
    gens = [torch.Generator().manual_seed(10 ** 6 + i) for i in range(n)]
    x = ts.generate_story(net, ts._noise(n, toy.FRAMES), ts.encode(caps)[:, None], gens)
    clips = toy.summary(toy.decode(x), caps)['composite']
    st = ts.stories('eval')[:n]
    gens = [torch.Generator().manual_seed(10 ** 6 + i) for i in range(n)]
    x = ts.generate_story(net, ts._noise(n, ts.FRAMES), ts.encode_stories(st), gens)
    return dict(clips=round(clips, 4), stories=round(ts.story_reward(ts.decode(x), st)['composite'].mean().item(), 4))


def main(stage):
    torch.set_num_threads(1)
    out = os.path.join(toy._HERE, ts.DIR)
    t0, log = time.time(), open(os.path.join(out, 'student.log'), 'a')

    def say(line):
        line = f'{line}  {(time.time() - t0) / 60:5.1f} min'
        print(line, flush=True)
        log.write(line + '\n')
        log.flush()
    (stage1 if stage == 'stage1' else stage2)(out, say)


if __name__ == '__main__':
    if sys.argv[1:] not in (['stage1'], ['stage2']):
        raise SystemExit('usage: python -m streaming.toy_story_sf stage1|stage2')
    main(sys.argv[1])
