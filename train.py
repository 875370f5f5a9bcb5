"""
SAGE-GRPO: GRPO for text-to-video flow models with manifold-aware exploration (sde.py, equalizer.py)
and a dual trust region (trust_region.py). What the defaults make of the objective: one optimizer
step per rollout batch, so theta == theta_old in the update, the ratio is 1, the PPO clip never acts
and the exact velocity KL (the policy's transition means vs the rollout policy's) is 0: REINFORCE
with each step's term weighted by the equalizer's S_t, plus lambda_KL times the position KL (vs a
moving anchor's means). lambda_KL holds the ratio of the KL term's summed gradient to the policy
term's at 1 (ours: at the paper's lambda_KL the region does not act; held where it acts it beats a
smaller step: docs/method.md 5.6), so each backward runs the two terms apart (GradientSplit);
kl_ratio_target=0 gives the paper's rule, which *relaxes* the penalty when the KL is high (4.6, 5.5).
One iteration is the loop at the bottom, each phase a function above it. The released code's switches
and the add-ons are off and act at named seams (extras/variants.py); the machinery (ranks,
checkpoints, evaluation, logs) is in the folders.

    python train.py config/toy.py             # the toy world on a CPU (torchrun: its FSDP path)
    torchrun --nproc_per_node=8 train.py      # HunyuanVideo 1.5 480p + VideoAlign
"""
import functools
import json
import os
import time

import torch
from tqdm import tqdm

import equalizer as eq
import reward
import sde
import trust_region as tr
from extras import credit as tvrl, diagnostics, metrics, preflight, variants
from infra import finite, parallel, prompt_cache, rundir, sp
from infra.anchor import Anchor
from infra.configurator import configure, rules
from infra.optimizer import build as build_optimizers, clip_grad_norm, zero_grad
from infra.preemption import Preemption
from models import attention as attention_lib, export, family, policy as policy_lib, videoalign
from models import evaluate as evaluation
from models.policy import PASS_KINDS, count_passes, encode_prompts, generators, guided_text, \
    latent_shape, load_decoder, load_policy, noise, seed_of, velocity

# ----------------------------------------------------------------------------- settings
# the method (docs/method.md sections 2-5; the released defaults and their sources: section 7)
sampler = 'sage'                # SDE of the rollouts: 'sage' | 'flow' | 'dance' | 'cps'
eta = 0.5                       # exploration scale of the SDE noise
num_steps = 20                  # sampling steps of a rollout (and of the ODE evaluation)
shift = 5.0                     # sigma-schedule shift (480p: 5, 720p: 9)
cfg = 6.0                       # classifier-free guidance scale (1.0: the conditional branch only)
group_size = 4                  # G: rollouts per prompt, the group of the advantage
reward_weights = (0.5, 0.5, 1.0)  # (VQ, MQ, TA): Setting B, the paper's main one; A: (1, 1, 1)
adv_clip = 5.0                  # advantages are clipped to +-adv_clip (|A| <= sqrt(G - 1) anyway)
equalizer = True                # scale each step's policy loss by S_t (equalizer.py)
timestep_fraction = 1.0         # fraction of the stochastic steps trained per video
clip_range = 1e-4               # PPO ratio clip
updates_per_iter = 1            # optimizer steps per rollout batch (1: theta == theta_old)
kl_strategy = 'dual'            # 'none' | 'fixed' | 'stepwise' | 'moving' | 'dual'
anchor_every = 10               # optimizer steps between anchor refreshes (after one: KL_pos 0)
beta_pos = 1.0                  # weight of the position term KL(theta || anchor)
beta_vel = 0.1                  # weight of the velocity term KL(theta || theta_old)
kl_init = 1e-7                  # lambda_KL at the first optimizer step, its warm-up's start
kl_min = 1e-7                   # lower clip of lambda_KL
kl_max = 1e-5                   # upper clip of lambda_KL, and the end of its warm-up
kl_warmup = 100                 # optimizer steps of linear warm-up kl_init -> kl_max (0: none)
kl_target = 1e-5                # the controller's KL target
kl_direction = 1                # +1: printed (KL high: lambda falls); -1: reversed (5.5)
kl_ratio_target = 1.0           # > 0 (ours): lambda_KL holds ||g_KL|| / ||g_policy|| here, from kl_init (5.6);
                                # 0: the paper's controller (kl_init..kl_direction), inert at its values
optimizer = 'muon'              # 'muon' (2-D matrices, AdamW the rest: released) | 'adamw'
learning_rate = 1e-5            # constant
weight_decay = 0.01             # decoupled weight decay of both optimizers
grad_clip = 1.0                 # global gradient-norm clip
# model, data and reward
model = 'hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v'  # a diffusers directory
train_prompts = 'prompts/train.txt'  # a prompt a line, or a CSV with prompt (and seed) columns
eval_prompts = 'prompts/eval.txt'    # held-out prompts, never trained on (same formats)
negative_prompt = ''            # the unconditional branch of classifier-free guidance
num_frames = 81                 # frames per video
height = 352                    # rollout resolution (the paper trains at 352x624)
width = 624
fps = 24                        # frame rate of the decoded videos (the reward samples at 2 fps)
reward_model = 'videoalign'     # models/videoalign.py REWARDS: 'videoalign' | 'world' (the toy's)
videoalign_dir = 'weights/VideoReward'     # hf download KwaiVGI/VideoReward --local-dir ...
qwen_dir = 'weights/Qwen2-VL-2B-Instruct'  # hf download Qwen/Qwen2-VL-2B-Instruct ...
lora_rank = 0                   # 0: full fine-tuning; > 0: LoRA adapters of this rank
eval_every = 25                 # iterations between held-out evaluations (and at start and end)
# scale (the kernels' and plumbing's settings: models/policy.py, infra/parallel.py, infra/rundir.py)
out_dir = 'out'                 # checkpoints, metrics.jsonl, eval videos, prompt cache
init_from = 'auto'              # 'auto': continue out_dir's run, else new | 'scratch' | 'resume'
max_iters = 300                 # rollout batches
prompts_per_iter = 8            # prompts per rollout batch, over all ranks
rollout_batch = 4               # videos per forward in rollouts and evaluation (per rank)
train_batch = 1                 # videos per forward+backward in the update (per rank)
save_every = 50                 # iterations between checkpoints (also: after the first, at the end)
device = 'cuda'                 # 'cuda' or 'cpu'
sp_size = 1                     # ranks of a node sharing one video's tokens (infra/sp.py)
seed = 0
config = configure(globals(), rules=rules(sde, eq, tr, tvrl, metrics, attention_lib, videoalign),
                   sections=(variants, evaluation, policy_lib, parallel, rundir, diagnostics))
ratio_held = kl_ratio_target > 0 and kl_strategy != 'none'  # lambda_KL: RatioHold, else the paper's
variants.check(ratio_held)
# -----------------------------------------------------------------------------

# distributed setup: torchrun's environment, or one plain process (infra/parallel.py)
ddp, rank, world, device = parallel.init(device, parallel.dist_timeout)  # before CUDA starts
master = rank == 0
quiet = print if master else lambda m: None
quiet(json.dumps(config, indent=1) + '\n' + parallel.allocator_line(device))
sp_mesh = sp.mesh(sp_size, device) if sp_size > 1 else None  # (dp, ring, ulysses) of the world
# this rank's videos (global indices video_ids, the same over an sp group), its data-parallel place
shard_size, dp_rank, dp_world, dp_group, video_ids = parallel.layout(
    rank, world, parallel.shard_size, sp_size, sp_mesh, prompts_per_iter * group_size, log=quiet)
n_local = len(video_ids)
preemption = Preemption(rank, device)  # the first SIGTERM: a checkpoint at the next forward
train_list, prompt_seeds = prompt_cache.read_prompts(train_prompts)
eval_list, _ = prompt_cache.read_prompts(eval_prompts)
ckpts, history = preflight.start(config, master, quiet)  # out_dir claimed; paths, disk, sp

# the models: the reward first (seconds, not the policy's load), the prompts' embeddings, the policy
fam = family(model)  # the model family's file: the interface in models/__init__.py
shape = latent_shape(model, num_frames, height, width)  # (C, F, h, w): no weights read
decode = load_decoder(model, device)
reward_fn, manifold_distance = preflight.reward_first(config, device, fam, decode)  # a clip scored
text_cache = prompt_cache.shared(os.path.join(out_dir, 'prompt_cache'), model,
                                 set(train_list) | set(eval_list) | {negative_prompt},
                                 encode_prompts, device, master, parallel.solo_timeout)
policy = load_policy(model, device, fsdp=ddp, lora_rank=lora_rank, **policy_lib.kernels(),
                     mesh=parallel.fsdp_mesh(world, shard_size, device) if ddp else None,
                     sp_mesh=sp_mesh, solo_timeout=parallel.solo_timeout)  # sharded, kernels set
optimizers = build_optimizers(policy, optimizer, learning_rate, weight_decay)  # [Muon, AdamW]
anchor = Anchor(policy, strategy=kl_strategy, every=anchor_every)  # infra/anchor.py: sharded
controller = tr.RatioHold(kl_init, kl_ratio_target) if ratio_held else \
    tr.KLController(kl_init, kl_min, kl_max, kl_target, kl_warmup, direction=kl_direction)  # lambda_KL
kl_pos_weight, kl_vel_weight = tr.kl_weights(kl_strategy, beta_pos, beta_vel)  # 0: a term off
score_fn = variants.scorer(reward_fn, reward_weights, shape)  # reward_fn (tvrl: and its credit)
sigmas = sde.sigmas(num_steps, shift).to(device)  # (N + 1,) from 1.0 to 0.0
stochastic_steps = sde.stochastic_steps(sampler, sigmas, eta)  # only they have noise and train
n_train = max(1, round(timestep_fraction * variants.window_size(stochastic_steps)))  # a video's
on_policy = updates_per_iter == 1  # every micro-batch's forward is at theta_old (step_loss)
nonfinite = diagnostics.NonFinite(rundir.nonfinite_stop, out_dir)  # skips NaN steps; a row stops

# the run's state: new, or out_dir's newest intact checkpoint (each rank reads its shards)
alarm = evaluation.Alarm(evaluation.alarm_z)  # reward hacking: against the data, or the base model
run = rundir.Run(out_dir, rundir.keep_checkpoints, policy, optimizers, anchor, PASS_KINDS,
                 dict(world=world, config=config), controller=controller, alarm=alarm)
run.resume(ckpts, log=quiet)  # run.iter_num, .opt_steps, .passes (all ranks'), .eval_owed
text_for = functools.partial(guided_text, text_cache, negative=negative_prompt, device=device)
evaluate = evaluation.HeldOut.of_config(  # the held-out ODE samples, scored and watched
    dict(config, device=device), eval_list, shape=shape, text_for=text_for, decode=decode,
    reward_fn=reward_fn, manifold_distance=manifold_distance, passes=run.passes,
    visual=metrics.watchers_of(config),
    move_visual=metrics.move, dp_rank=dp_rank, dp_world=dp_world, leads=rank % sp_size == 0,
    preemption=preemption)

# ----------------------------------------------------------------------------- the phases
def trained_steps(it):
    """This iteration's stochastic steps (each video trains n_train of them), and S_t (N,)."""
    steps = variants.window(stochastic_steps, seed_of(seed, 'window', it))  # sde_window: a window
    s_t = eq.scales(sampler, sigmas, eta, variants.median, steps)  # (N,)
    return steps, (s_t if equalizer else torch.ones(num_steps)).to(device)  # equalizer off: 1

def rollout(it, steps):
    """G videos a prompt, x_1 ~ N(0, I) to x_0: every step's latent 'xs' (n, N+1, C, F, h, w)
    and log-prob 'logps' (n, N) (the log's drift figure only at the defaults: 4.6)."""
    chosen = prompt_cache.choose(len(train_list), prompts_per_iter, seed_of(seed, 'prompts', it))
    prompts, records = [train_list[chosen[i // group_size]] for i in video_ids], []
    keep = ('xs', 'logps') + variants.rollout_keeps(on_policy)
    for c in tqdm(range(0, n_local, rollout_batch), 'rollout', disable=not master, leave=False):
        ids, ps = video_ids[c:c + rollout_batch], prompts[c:c + rollout_batch]
        gens = generators([seed_of(seed, 'rollout', it, i) for i in ids])  # each video's own noise
        gens_x1 = variants.initial_noise(gens, ps, ids, prompt_seeds, seed, group_size)  # gens; off
        x1 = noise(shape, gens_x1, device)  # (n, C, F, h, w): x_1 ~ N(0, I), then each step's z
        text, text_neg = text_for(ps)
        def v(x, s):  # the guided velocity: classifier-free guidance's two branches in one forward
            return velocity(policy, x, s, text, cfg, text_neg)
        _, trajectory = sde.rollout(v, x1, sigmas, sampler, eta, gens, steps=steps, keep=keep,
                                    boundary=preemption.point)  # the SDE at `steps`, ODE elsewhere
        records.append(trajectory)
    count_passes(run.passes, ('rollout',), device)
    return dict({k: torch.cat([r[k] for r in records]) for k in records[0]}, prompts=prompts)

def score(videos, steps):
    """Decode and score the videos, each once (an sp group divides them): {'VQ', 'MQ', 'TA': (n,)}.
    A video whose rollout went NaN or inf scores NaN and leaves the update (infra/finite.py)."""
    def scored(idx):  # frames (n, F, 3, H, W) in [0, 1]
        frames = torch.cat([decode(x) for x in videos['xs'][idx, -1].split(rollout_batch)])
        return score_fn(frames, [videos['prompts'][i] for i in idx], fps)
    scores = sp.divide_work(scored, n_local, sp_mesh)
    videos['finite'] = finite.mark(videos, scores)  # [bool] (n,); the others' latents set to 0
    variants.credit_maps(videos, scores, steps)  # tvrl: each video's credit map; off
    return scores

def advantages(scores):
    """GRPO advantages of this rank's videos (n,), each over its whole group (groups may span
    ranks), and which videos count (n,): a NaN reward drops its video; the batch's rewards."""
    c = torch.stack([scores[k] for k in reward.DIMS], 1).float().to(device)  # (n, 3)
    c = parallel.gather(c, dp_group).view(prompts_per_iter, group_size, -1)  # (P, G, 3) all ranks'
    r = reward.combine(dict(zip(reward.DIMS, c.unbind(-1))), reward_weights)  # (P, G)
    adv, valid, std = reward.group_advantages(r, adv_clip)
    adv, valid = variants.advantages(adv, valid, c, reward_weights, adv_clip)  # per component: off
    reward.check_valid(valid, run.iter_num + 1, out_dir, quiet)  # all NaN: stop; some: say so
    batch = dict(r=r, c=c, std=std, valid=valid)  # (P, G), (P, G, 3), (P, 1), (P, G)
    return adv.flatten()[video_ids], valid.flatten()[video_ids].float(), batch

def policy_step(videos, b, t):
    """One forward: the policy's SDE step from x_t of videos b at steps t (n,); x_{t+1}'s logp."""
    x_t, x_next = videos['xs'][b, t], videos['xs'][b, t + 1]          # (n, C, F, h, w)
    text, text_neg = text_for([videos['prompts'][i] for i in b])
    v = velocity(policy, x_t, sigmas[t], text, cfg, text_neg)  # guided: CFG's two branches
    return sde.step(x_t, v, sigmas[t], sigmas[t + 1], sampler, eta, x_next=x_next,
                    weight=variants.credit_of(videos, b))  # tvrl's per-token weights; off: the mean

def step_loss(videos, b, t, s_t, lam, denom):
    """The objective of local videos b (a list) at their trained steps t (n,), docs/method.md
    sections 4 and 5: the loss to backward, and its per-video terms (n,)."""
    kl_pos = kl_vel = torch.zeros(len(b), device=device)
    if kl_pos_weight:  # the anchor's forward first and without grad: its in-place weight swap must
        with torch.no_grad(), anchor.applied(policy):  # not fall between a forward and its backward
            mean_anchor = policy_step(videos, b, t).mean
    new = policy_step(videos, b, t)  # both CFG branches carry gradients: the policy is guided
    # theta == theta_old at one optimizer step per rollout batch: the old log-prob and mean are this
    # forward's own, detached, not the rollout's, which another batch shape rounds differently
    # (bf16: |d logp| > clip_range at the late steps, and the clip would drop every loser: 4.6)
    logp_old, mean_old = (new.logp.detach(), new.mean.detach()) if on_policy else \
        (videos['logps'][b, t], videos['means'][b, t])  # else recomputed by update in this shape
    ratio = torch.exp(new.logp - logp_old)                                      # (n,)
    adv = videos['adv'][b]                                                        # (n,)
    # PPO's pessimistic clip: the unclipped term's gradient flows only where clipping would not
    # make the objective more optimistic; scaled by the equalizer's S_t of each video's step
    clipped = ratio.clamp(1 - clip_range, 1 + clip_range)
    policy_term = s_t[t] * torch.maximum(-adv * ratio, -adv * clipped)          # (n,)
    if kl_pos_weight:
        kl_pos = tr.gaussian_kl(new.mean, mean_anchor, new.std)          # position: to the anchor
    if kl_vel_weight:  # velocity: to the rollout policy (kl_estimator='sample': the released one)
        kl_vel = tr.velocity_kl(new, mean_old, logp_old, variants.kl_estimator)
    kl = kl_pos_weight * kl_pos + kl_vel_weight * kl_vel                      # (n,) the strategy's
    valid = videos['valid'][b]  # a NaN-reward video drops out whole: where(), 0 * NaN would leak in
    loss = torch.where(valid > 0, policy_term + lam * kl, 0.0).sum() / denom
    return loss, dict(policy=policy_term, kl=kl, kl_pos=kl_pos, kl_vel=kl_vel, ratio=ratio,
                      adv=adv, valid=valid, logp=new.logp)

def update(videos, batch, steps, s_t):
    """Every trained step of every video (a random order each) in updates_per_iter optimizer steps:
    the losses' backward, the gradient clip, the step, lambda_KL, the anchor; the log's figures."""
    order = torch.stack([torch.tensor(steps)[torch.randperm(len(steps), generator=torch.Generator()
                         .manual_seed(seed_of(seed, 'order', run.iter_num, i)))[:n_train]]
                         for i in video_ids])  # (n, n_train) the trained steps of each video
    def terms_at(t):  # a fresh forward of video 0 at step t, for the diagnostics
        return step_loss(videos, [0], torch.tensor([t]), s_t, controller.value, 1.0)[1]
    diag = diagnostics.gradient_norms_due(  # every diag_every, one clip's 4-pass norms first; off
        run.iter_num, terms_at, steps, s_t, controller.value, (kl_pos_weight, kl_vel_weight),
        optimizers, world * (dp_rank == 0), preemption.point, run.passes, device)  # x world: FSDP
    stats = diagnostics.UpdateStats(max(1, sum(videos['finite'])) * n_train, clip_range, on_policy)
    split = diagnostics.GradientSplit(optimizers, run.iter_num, always=ratio_held)  # the ratio
    def micro_batches(ids):  # (train_batch videos, one of their steps); every rank runs every pass
        batches = finite.micro_batches(ids, videos['finite'], train_batch, n_train)
        return preemption.points(tqdm(batches, 'update', disable=not master, leave=False))
    if not on_policy:  # several steps a batch: the old log-probs and means at theta_old, in the
        with torch.no_grad():  # update's batch shape: the ratio measures the move, not the rounding
            for b, k in micro_batches(list(range(n_local))):
                old, t = policy_step(videos, b, order[b, k]), order[b, k]
                if any(videos['finite'][i] for i in b):  # else a stand-in: it joins FSDP's passes
                    stats.drifted((old.logp - videos['logps'][b, t]).abs())
                    videos['logps'][b, t], videos['means'][b, t] = old.logp, old.mean
        count_passes(run.passes, ('old',), device)
    for chunk in [list(range(n_local))[k::updates_per_iter] for k in range(updates_per_iter)]:
        # the loss is the mean over the batch's valid videos x trained steps, this optimizer step's
        # share: summed over micro-batches and steps here, and over ranks by FSDP's gradient average
        denom = max(1.0, batch['valid'].sum().item()) * n_train / world / updates_per_iter
        kls = []  # the mean KL of each micro-batch's training videos: lambda_KL's input
        # FSDP reduce-scatters after every backward, so gradients stay sharded (accumulating
        # without sync would hold the whole unsharded gradient: 16 GB at 8.3B in bf16)
        for b, j in micro_batches(chunk):  # a stop drops these gradients: no step taken yet
            loss, terms = step_loss(videos, b, order[b, j], s_t, controller.value, denom)
            split.backward(loss, terms, denom)  # loss.backward(); the ratio held: the terms apart
            kl = terms['kl'][terms['valid'] > 0].mean().item() if terms['valid'].any() else None
            kls += [kl] if kl is not None else []  # a stand-in's videos are not valid: none
            stats.add(loss, terms, videos['logps'][b, order[b, j]])
            variants.lambda_after_backward(controller, kl)  # kl_update='backward' (released): off
        r1 = split.measure(controller.value)  # ||KL term's gradient|| / ||policy's|| at lambda 1
        norm = clip_grad_norm(optimizers, grad_clip)  # in place; the norm of all ranks' shards
        stats.stepped(norm, updates_per_iter, split.logged)
        skipped = nonfinite(norm, run.iter_num + 1)  # NaN or inf: no step, so no NaN weight
        for o in optimizers if not skipped else []:
            o.step()
        zero_grad(optimizers)  # never policy.zero_grad() under FSDP2 (infra/optimizer.py)
        if not skipped:
            run.opt_steps += 1
            preemption.stepped()  # the weights moved: the iteration runs to its end, then saves
            if variants.kl_update == 'step':  # lambda_KL after each optimizer step, all ranks' KL
                controller.update(parallel.mean_of(kls, device), r1)
            anchor.maybe_refresh(policy, run.opt_steps)  # every anchor_every steps (moving, dual)
    count_passes(run.passes, ('anchor', 'update'), device)
    return dict(lambda_kl=controller.value, **stats.row(device, sp_size, dp_group), **diag,
                nonfinite_clips=finite.count(videos['finite'], device, dp_group))

def held_out(it):
    """Evaluate, watch, log; a stop meanwhile checkpoints, and this evaluation is owed on resume."""
    ev = evaluate(policy, it, lambda: run.save(eval_owed=True))  # its peak memory, logged below
    watch, line = alarm(it, evaluate.items, evaluate.reference(fam))  # the same on every rank
    log({'iter': it, **{f'eval_{k}': v for k, v in ev.items()}, **watch,
         'peak_mem_gb': parallel.peak_memory_gb(device).max().item()})
    if master:  # the alarm's line (its evaluation's checkpoint kept); at the end, base vs now
        alarm.say(it, line, ev, out_dir, evaluation.hack_stop, last=max_iters)

# ----------------------------------------------------------------------------- training loop
if master:  # once everything has loaded: a run that fails to start leaves out_dir as it was
    rundir.record(out_dir, history, config, run.iter_num, world, run.eval_owed)  # config.json
log = rundir.Log(out_dir, master, rundir.wandb_project, config)  # metrics.jsonl, console, wandb
if run.eval_owed:  # the base model's, or an evaluation a stop cut short
    held_out(run.iter_num)
policy.train()
cadence = rundir.Cadence(save_every, rundir.save_every_min, device)  # the clock starts, each rank's
while run.iter_num < max_iters:
    it, t0 = run.iter_num, time.time()
    parallel.reset_peak_memory(device)  # the logged peaks are this iteration's
    preemption.begin(run.save, controller, run.passes)  # a stop saves iteration `it`
    steps, s_t = trained_steps(it)                  # the SDE's (stochastic) steps; S_t (N,)
    videos = rollout(it, steps)                      # G videos a prompt: each step's x_t and logp
    t1 = time.time()
    scores = score(videos, steps)                    # {'VQ', 'MQ', 'TA'}: (n,) each
    t2 = time.time()
    videos['adv'], videos['valid'], batch = advantages(scores)  # within each group; NaN: left out
    row = update(videos, batch, steps, s_t)          # the objective, the step, lambda_KL, anchor
    run.iter_num = it = it + 1                       # metrics.jsonl's row, the console's line:
    log(dict(iter=it, **diagnostics.reward_row(batch, reward.DIMS), **row,
             t_rollout=t1 - t0, t_reward=t2 - t1, t_update=time.time() - t2,
             **variants.credit_row(scores, device), **parallel.peak_memory(device),
             **{f'passes_{k}': n for k, n in run.passes.items()}))
    if (eval_every and it % eval_every == 0) or it == max_iters:
        held_out(it)                                # held-out ODE samples, watchers, the alarm
    if run.save_if_due(it, cadence, preemption, max_iters, alarm.halts(evaluation.hack_stop)):
        break  # a stop request (SIGTERM) or a tripped alarm with hack_stop: checkpointed
export.final(out_dir, rundir.export_dtype, parallel.solo_timeout, master, fam.TRANSFORMER,
             done=run.iter_num == max_iters)  # the aligned model, a diffusers directory
preemption.stepped()  # drops its run.save: nothing may hold the FSDP modules past here
del policy, anchor, run  # their FSDP state holds the process group: freed before it is destroyed
parallel.close()
