"""
KVPO's loop (kvpo/kvpo.py, docs/kvpo.md) on a streaming video model (streaming/__init__.py): per rank one
video an iteration (as released), its K routed branches and the anchor rolled out by the old policy,
scored, their advantages against the anchor, the TVE softmax policy updated by one AdamW step.

    python -m kvpo.train kvpo/config/toy.py                            # the AR toy, CPU, minutes
    torchrun --nproc_per_node=2 -m kvpo.train kvpo/config/toy.py       # 2 gloo ranks, the same run
    torchrun --nproc_per_node=8 -m kvpo.train kvpo/config/longlive.py  # LongLive 1.3B, one video a GPU

What the defaults make of the objective: the rollout is the old policy's, synced to the current one every
`old_every` (2) iterations, so the ratio is 1 and the clip inert at the first iteration after a sync and
can move only at the second; pi_init (the KL's reference) is the frozen initial model, KL 0 until the
weights move. Every rank holds the whole model and gradients are averaged (all-reduce), as released: each
rank's fork differs, so its number of forwards does (FSDP's per-forward collectives would not match).
A video switches prompt at `switch_frames` (kvpo/segments.py: its prompts one line of the prompt file; at a
switch the text keys replaced and the last window of frames re-cached under the new prompt; the global reward
one clip a segment); the update's learning rate follows diffusers' constant_with_warmup over steps of
old_every rollouts (kvpo/optim.py, lr 0 in the first). Where this differs from the released code: VideoAlign's
VQ/MQ/TA are the reward components (the released default is HPSv3, not ported); routing reads the planned
frames (`release_reads` reproduces the release's reads); docs/kvpo.md section 2 lists the rest. The
held-out evaluation is train.py's (models/evaluate.py: the family's generate, block by block; the alarm)
on the EMA weights. A SIGTERM stops at the next prompt's rollout or
replay (infra/preemption.py) and saves the last finished iteration.
Tested by: python -m pytest tests/test_kvpo_train.py
"""
import copy
import os
import time

import torch
import torch.distributed as dist

import reward
from infra import checkpoint, parallel, rundir
from infra.configurator import configure, number, one_of
from infra.preemption import Preemption
from infra.prompt_cache import read_prompts
from kvpo import kvpo, optim, segments
from models import family
from models.evaluate import Alarm, HeldOut
from models.videoalign import load_reward
from models.policy import seed_of

# ----------------------------------------------------------------------------- the method (released values)
group = 8                       # K: routed branches a prompt (plus one unrouted anchor)
m_nearest = 4                   # nearest frames a routed block sees, its own block included
perturb_blocks = 5              # P: consecutive routed blocks from the fork
frames = 147                    # latent frames a rollout generates (the long-video setting)
chunk_first = 21                # latent frames of the first chunk
chunk_then = 18                 # latent frames of each later chunk
within_chunks = 7               # a fork is drawn from the blocks of the first chunks
cache_frames = 33               # frames the KV cache holds: the window and 21 more (the routing pool)
release_reads = False           # True: read each routed older frame f from the slot of f + block once the cache
                                # has rolled, as the released code does (a bug: docs/kvpo.md section 2)
switch_frames = (39, 75, 111)   # latent frames where the prompt switches: 4 segments, text keys replaced; (): one
switch_recache = True           # at a switch also recompute the last window's (12) self-attention keys and values
                                # under the new prompt, as released (diversity_sampling.py); False: text keys only
prompt_story = True             # a train_prompts line holds a video's prompts, one a segment ('0,[p1],[p2],[p3],[p4]'),
                                # as released; False: each segment's prompt drawn from the lines independently
context_noise = 0.00498         # sigma of the cache's timestep-0 writes: the released add_noise(x0, eps, t=0) on its
                                # 1000-step shift-5 grid (5 x 0.001 / 1.004); 0: x0 itself
tve_span = 'chunk'              # TVE records and replays from the fork to the end of its chunk | 'routed': P blocks
grad_steps = 2                  # of the 4 denoising steps, the first ones carry gradient in the replay
score_form = 'x0'               # TVE: 'x0' (weight 1 / 2 max(sigma, 1)^2) | 'velocity' (1 / 2)
reward_weights = (1.0, 0.05, 0.1)  # (VQ, MQ, TA): each component's advantage weight
train_local = True              # the fork chunk's reward (the short clip)
train_global = True             # the long video's reward (the mean over a clip centred in each prompt segment)
global_clip = 9                 # latent frames of each global clip (36 video frames)
local_weight = 1.0              # fused advantage: local_weight A_loc / std + global_weight A_glob / std
global_weight = 0.5
adv_clamp = 2.5                 # the fused advantage is clamped to +-adv_clamp
clip_low = 0.9                  # ratio clip: [clip_low, clip_high] (asymmetric)
clip_high = 1.2
kl_coef = 10.0                  # weight of KL(pi_theta || pi_init) on the branch simplex
branch_backward = True          # backprop one branch's replay at a time (exact, one more replay; released: all)
activation_checkpointing = True  # recompute a replay forward's activations in backward (released: on)
replay_routed = False           # True: TVE replays a branch under its own routing (not released: an experiment)
adv_shuffle = False             # a control, not the method: permute each video's K advantages at random (seeded)
fork_min = 0                    # an experiment: forks before this latent frame are not drawn (0: all eligible)
fuse_std = True                 # False (an experiment): the fused advantage not divided by each signal's std
gate = 'mechanism_2'            # unsafe prompt: 'mechanism_2' anchor slot (loss x 1/2) | 'mechanism_1' loss 0
old_every = 2                   # iterations between syncs of the old (rollout) policy
learning_rate = 1e-5            # AdamW, constant after the warm-up
warmup = 5                      # steps of linear learning-rate warm-up
lr_schedule = 'constant_with_warmup'  # diffusers' (lr 0 first), a step per old_every rollouts | 'per_rollout'
weight_decay = 0.01
grad_clip = 1.0                 # global gradient-norm clip
ema_decay = 0.999               # the evaluated weights: an exponential average of the trained ones
max_iters = 3000                # iterations: rollouts, one optimizer step each (released: 1500 steps of old_every)
prompts_per_iter = 8            # videos an iteration over all ranks, a prompt a segment (released: one a GPU)
# ----------------------------------------------------------------------------- model, data, plumbing
model = 'weights/LongLive'      # a streaming model directory (python -m streaming.wan_causal)
lora_rank = 256                 # LoRA rank (alpha = rank) on the generator; 0: full fine-tuning
adapter = 'checkpoint'          # the model's own LoRA trained on, every Linear | 'merged': a fresh one (kvpo/optim.py)
train_dtype = 'bfloat16'        # the trained weights and AdamW's state: 'bfloat16' (released) | 'float32'
reward_model = 'videoalign'     # 'videoalign' | 'world': the model's own (the toy's)
videoalign_dir = 'weights/VideoReward'
qwen_dir = 'weights/Qwen2-VL-2B-Instruct'
train_prompts = 'prompts/stories.txt'  # a video's 4 prompts a line (prompt_story), as KVPO's prompt file
eval_prompts = 'prompts/eval.txt'
eval_stories = ''               # held-out stories (a video's prompts a line), each scored as the global signal; '': none
eval_frames = 21                # latent frames of a held-out sample (one chunk)
eval_every = 2                  # iterations between held-out evaluations (and at start and end; 0: never)
eval_samples = 1                # seeds per held-out prompt
alarm_z = 2.0                   # reward-hacking alarm: standard errors a watcher must move
fps = 16
out_dir = 'out-kvpo'
init_from = 'auto'              # 'auto': continue out_dir's run, else new | 'scratch' | 'resume'
save_every = 2                  # iterations between checkpoints (and at the end and on SIGTERM)
keep_checkpoints = 2
device = 'cuda'
dist_timeout = 10.0             # minutes a collective waits
seed = 42
config = configure(globals(), rules=dict(
    gate=one_of('mechanism_2', 'mechanism_1'), score_form=one_of('x0', 'velocity'), tve_span=one_of('chunk', 'routed'),
    lr_schedule=one_of('constant_with_warmup', 'per_rollout'), adapter=one_of('checkpoint', 'merged'),
    train_dtype=one_of('bfloat16', 'float32'), context_noise=number(0, 1),
    switch_frames=((lambda v: list(v) == sorted(set(v)) and all(0 < s < frames for s in v)),
                   'increasing latent frames inside the video')))

# ----------------------------------------------------------------------------- setup
ddp, rank, world, device = parallel.init(device, dist_timeout)
master = rank == 0
assert prompts_per_iter % world == 0, f'prompts_per_iter={prompts_per_iter} must divide over {world} ranks'
torch.set_num_threads(1) if device == 'cpu' else None  # reproducible, and fair on a shared CPU
preemption = Preemption(rank, device)
ckpts, history = rundir.claim(config, master)
fam = family(model)
policy = optim.load_generator(model, device, lora_rank, adapter, train_dtype).train()  # a whole replica a rank
old, init, ema = (copy.deepcopy(policy).eval().requires_grad_(False) for _ in range(3))
trained = [(n, p) for n, p in policy.named_parameters() if p.requires_grad]
ema_p, old_p = dict(ema.named_parameters()), dict(old.named_parameters())
for n, _ in trained:  # the EMA in fp32 whatever train_dtype, as released (in bf16, 1e-3 of a step rounds away)
    ema_p[n].data = ema_p[n].data.float()
encode, decode = fam.text_encoder(model, device), fam.load_decoder(model, device)
reward_fn, manifold_distance = load_reward(reward_model, videoalign_dir, qwen_dir, device, family=fam)
C, _, h, w = fam.latent_shape(model, fam.DEFAULTS['num_frames'], fam.DEFAULTS['height'], fam.DEFAULTS['width'])
opt = torch.optim.AdamW([p for _, p in trained], lr=learning_rate, weight_decay=weight_decay)
weights = dict(zip(reward.DIMS, reward_weights))
train_list, eval_list = read_prompts(train_prompts)[0], read_prompts(eval_prompts)[0]
if prompt_story:  # a file without a video's prompts on a line stops here, not at the first rollout
    segments.stories(train_list, len(switch_frames) + 1)
eval_story_list = segments.stories(read_prompts(eval_stories)[0], len(switch_frames) + 1) if eval_stories else []
story = getattr(fam, 'story_score', None) if switch_frames else None  # later prompts continue the first (toy_story)
if story and (chunk_first < frames or not prompt_story):
    raise SystemExit(f'{model}: its reward scores whole stories: chunk_first={frames} (the fork\'s chunk the whole '
                     'video) and prompt_story=True')
layout = policy.layout


class Copies:
    """The EMA and old-policy weights, saved and resumed with the checkpoints (checkpoint's 'anchor')."""
    def state_dict(self):
        return {f'{tag}.{n}': d[n].data for tag, d in (('ema', ema_p), ('old', old_p)) for n, _ in trained}


alarm = Alarm(alarm_z)
loop = checkpoint.resume(ckpts, policy, opt, Copies())
iter_num = loop['iter_num'] if loop else 0
if loop:
    alarm.load_state_dict(loop['alarm'])
held = HeldOut(eval_list, eval_samples, seed=seed, sigmas=None, cfg=1.0, shape=(C, eval_frames, h, w),
               text_for=lambda p: (encode(p), None), batch=1, decode=decode, reward_fn=reward_fn,
               reward_weights=reward_weights, manifold_distance=manifold_distance, visual={},
               move_visual=lambda *a: None, fps=fps, out_dir=out_dir, videos=0, dp_rank=rank, dp_world=world,
               leads=True, passes={'eval': 0}, preemption=preemption, device=device)  # train.py's evaluation
log = rundir.Log(out_dir, master)
log.line = lambda r: ' '.join(f'{k} {v:.4g}' if isinstance(v, float) else f'{k} {v}' for k, v in r.items())
if master:  # config.json's start; later rows go (a checkpoint precedes its iteration's evaluation: owed)
    rundir.record(out_dir, history, config, iter_num, world, eval_owed=True)


# ----------------------------------------------------------------------------- the phases
def my_prompts(it):
    """(index, prompts) of this rank's videos at iteration it, one prompt a segment: a seeded draw over all ranks
    (prompt_story: of one line each, its prompts in order; else of one line a segment)."""
    n = len(switch_frames) + 1  # prompt segments a video
    g = torch.Generator().manual_seed(seed_of(seed, 'prompts', it))  # seed_of: 60 bits
    if prompt_story:  # one segment: the same draw as below (a line is a one-prompt story)
        stories = segments.stories(train_list, n)
        pick = torch.randint(len(stories), (prompts_per_iter,), generator=g).tolist()
        return [(j, stories[pick[j]]) for j in range(rank, prompts_per_iter, world)]
    pick = torch.randint(len(train_list), (prompts_per_iter * n,), generator=g).tolist()
    return [(j, [train_list[i] for i in pick[j * n:(j + 1) * n]]) for j in range(rank, prompts_per_iter, world)]


def rollout(it, j, prompts):
    """One video's routing plan and its K branches + anchor from the old policy (kvpo.rollout); the text of
    each prompt segment [(first frame, text)], or one text if one segment."""
    texts = [fam.context(encode([p])).to(device) for p in prompts]
    ctx = texts[0] if len(texts) == 1 else [(a, t) for (a, _), t in zip(segments.bounds(frames, switch_frames), texts)]
    s = seed_of(seed, 'rollout', it, j) % 2 ** 31
    plan = kvpo.plan(frames, layout, group, m_nearest, perturb_blocks, cache_frames, s, chunk_first, chunk_then,
                     within_chunks, fork_min)
    chunk_end = next(b for a, b in kvpo.chunks(frames, chunk_first, chunk_then) if a <= plan['fork'] < b)
    with optim.precision(device, train_dtype):
        clips, traj, state = kvpo.rollout(old, ctx, frames, (C, h, w), plan, s, m_nearest, perturb_blocks,
                                          cache_frames, chunk_end if tve_span == 'chunk' else None, context_noise,
                                          release_reads, switch_recache)
    return dict(ctx=ctx, plan=plan, clips=clips, traj=traj, state=state, prompts=prompts, j=j)


@torch.no_grad()
def score(g):
    """{signal: {component: (K + 1,)}}: the fork chunk's clip with its segment's prompt (local), and the mean
    over a clip centred in each prompt segment, each with its own prompt (global)."""
    fork = g['plan']['fork']
    chunk = next((a, b) for a, b in kvpo.chunks(frames, chunk_first, chunk_then) if a <= fork < b)
    clips = segments.scored_clips(frames, switch_frames, global_clip, g['prompts'], fork, chunk)
    out = {}
    for name, on in (('local', train_local), ('global', train_global)):
        if on and (story or name == 'global'):  # segments' global clips, or the whole video against its story
            out[name] = segments.score_video(g['clips'], g['prompts'], switch_frames, global_clip, decode, reward_fn,
                                             fps, story)
        elif on:  # the fork's chunk with its segment's prompt
            sc = [reward_fn(decode(g['clips'][:, :, lo:hi]), [p] * (group + 1), fps) for lo, hi, p in clips[name]]
            out[name] = {k: torch.stack([c[k].float().cpu() for c in sc]).mean(0) for k in reward.DIMS}
    return out


def advantages(sc, it, j):
    """(fused advantage (K,), safe): per signal sum_c w_c (r_c - r_c anchor) / std, fused, clamped. With
    adv_shuffle (the control of bench/kvpo_verdicts.py) the K advantages are permuted, a draw seeded by (iteration,
    video): the same values, gate and update size, no assignment of reward to branches."""
    adv = {s: kvpo.component_advantage({c: r[:-1] for c, r in v.items()}, {c: r[-1] for c, r in v.items()}, weights)
           for s, v in sc.items()}
    total = {s: reward.combine(v, reward_weights) for s, v in sc.items()}  # (K + 1,) composite a signal
    safe = kvpo.safe([(r[:-1], r[-1]) for r in total.values()])  # any branch beats the anchor on any signal
    adv = kvpo.fuse(adv.get('local'), adv.get('global'), local_weight, global_weight, adv_clamp, fuse_std)
    if adv_shuffle:
        adv = adv[torch.randperm(len(adv), generator=torch.Generator().manual_seed(seed_of(seed, 'shuffle', it, j)))]
    return adv, safe


def update(groups, it):
    """One AdamW step on the mean loss of all ranks' prompts: old and initial replays without grad, the
    current one through the first grad_steps steps; gradients averaged over the ranks."""
    opt.zero_grad(set_to_none=False)
    stats = []
    for g in preemption.points(groups):  # a stop here drops these gradients: the weights have not moved
        args = (g['ctx'], g['state'], g['plan']['fork'])
        routes = [kvpo.router(g['plan']['fork'], o, layout, m_nearest, perturb_blocks, cache_frames, release_reads)
                  for o in g['plan']['older']] if replay_routed else None  # None: the replay's routing off, as released
        with torch.no_grad(), optim.precision(device, train_dtype):
            s_old, s_init = (kvpo.scores(net, *args, g['traj'], cache_frames, 0, score_form, routes=routes)
                             for net in (old, init))
        objective = lambda s: kvpo.loss(s, s_old, s_init, g['adv'], g['safe'], (clip_low, clip_high), kl_coef, gate)
        with optim.precision(device, train_dtype):
            if branch_backward:  # one branch's replay graph at a time (exact: kvpo.backward)
                loss, st = kvpo.backward(policy, *args, g['traj'], cache_frames, objective, grad_steps, score_form,
                                         scale=1 / len(groups), checkpoint=activation_checkpointing, routes=routes)
            else:  # every branch's graph at once, as released (which checkpoints activations)
                loss, st = objective(kvpo.scores(policy, *args, g['traj'], cache_frames, grad_steps, score_form,
                                                 activation_checkpointing, routes))
                (loss / len(groups)).backward()
        stats.append(dict(st, loss=loss.item()))
    for _, p in trained:  # the mean over ranks (each rank's prompts already averaged)
        p.grad = torch.zeros_like(p) if p.grad is None else p.grad
        if ddp:
            dist.all_reduce(p.grad)
            p.grad /= world
    any_safe = torch.tensor([float(any(g['safe'] for g in groups))], device=device)
    if ddp:
        dist.all_reduce(any_safe, op=dist.ReduceOp.MAX)
    gnorm = torch.nn.utils.clip_grad_norm_([p for _, p in trained], grad_clip).item()
    if gate == 'mechanism_2' or any_safe.item() > 0:  # mechanism_1: a step no rank finds safe is skipped
        for grp in opt.param_groups:  # released: diffusers' constant_with_warmup, a step per old_every rollouts
            grp['lr'] = optim.lr_at(it, learning_rate, warmup, old_every, lr_schedule)
        opt.step()
        preemption.stepped()
        with torch.no_grad():
            for n, p in trained:
                ema_p[n].lerp_(p.float(), 1 - ema_decay)
    if (it + 1) % old_every == 0:  # the rollout policy catches up
        with torch.no_grad():
            for n, p in trained:
                old_p[n].copy_(p)
    return {k: sum(s[k] for s in stats) / len(stats) for k in stats[0]} | dict(grad_norm=gnorm,
                                                                            lr=opt.param_groups[0]['lr'])


def log_iteration(it, groups, st, times):
    """The iteration's row: the branches' and the anchor's mean composite per signal over all ranks (reward:
    the first signal's), the loss's figures, the safe fraction, rank 0's first fork, the times."""
    mean = lambda f: parallel.mean(sum(f(g) for g in groups) / len(groups), device)  # noqa: E731
    row = dict(iter=it)
    for s in groups[0]['scores']:
        row[f'reward_{s}'] = mean(lambda g: reward.combine(g['scores'][s], reward_weights)[:-1].mean().item())
        row[f'anchor_{s}'] = mean(lambda g: reward.combine(g['scores'][s], reward_weights)[-1].item())
    row['reward'] = row[f'reward_{next(iter(groups[0]["scores"]))}']
    row.update({k: parallel.mean(v, device) for k, v in st.items()}, safe=mean(lambda g: float(g['safe'])),
               fork=groups[0]['plan']['fork'], **times)
    log(row)


@torch.no_grad()
def held_out(it):
    """The EMA weights on the held-out prompts x eval_samples, block by block (the family's generate), scored
    and watched by the alarm as train.py's (models/evaluate.py)."""
    with torch.autocast('cpu', torch.bfloat16, enabled=train_dtype == 'bfloat16'):  # bf16 weights on a CPU
        means = held(ema, it, save_checkpoint)  # (a GPU's generate autocasts itself)
        if eval_story_list:  # whole videos of the held-out stories, unrouted, scored as the global signal
            score_fn = lambda x, ps: segments.score_video(x, ps, switch_frames, global_clip, decode, reward_fn, fps,  # noqa: E731
                                                          story)
            means |= segments.evaluate(ema, eval_story_list, lambda p: fam.context(encode([p])).to(device),
                                       (C, frames, h, w), switch_frames, score_fn, reward_weights, manifold_distance,
                                       decode, seed, rank, world, device, switch_recache)
    watch, line = alarm(it, held.items)
    if line and master:
        print(line)
    return {f'eval_{k}': v for k, v in means.items()} | watch


def save_checkpoint():
    path = os.path.join(out_dir, f'{checkpoint.PREFIX}{iter_num:06d}')
    loop = dict(iter_num=iter_num, config=config, alarm=alarm.state_dict())
    return checkpoint.save(path, policy, opt, Copies().state_dict(), loop, keep_checkpoints)


# ----------------------------------------------------------------------------- the loop
while True:
    if iter_num == max_iters or (save_every and iter_num % save_every == 0 and iter_num):
        save_checkpoint()  # before the evaluation: a run resumed here evaluates this iteration again
    if eval_every and (iter_num % eval_every == 0 or iter_num == max_iters):
        log(dict(iter=iter_num) | held_out(iter_num))
    if iter_num == max_iters or preemption.requested(device):
        save_checkpoint()  # nothing to write if this iteration's is published
        break
    preemption.begin(save_checkpoint)  # a SIGTERM from here saves the last finished iteration
    t0 = time.time()
    groups = [rollout(iter_num, j, p) for j, p in preemption.points(my_prompts(iter_num))]  # one a rank, released
    for g in groups:
        g['scores'] = score(g)
        g['adv'], g['safe'] = advantages(g['scores'], iter_num, g['j'])
    t1 = time.time()
    st = update(groups, iter_num)
    iter_num += 1
    log_iteration(iter_num, groups, st, dict(t_rollout=t1 - t0, t_update=time.time() - t1))
parallel.close()
