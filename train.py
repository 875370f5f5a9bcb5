"""
SAGE-GRPO: GRPO for text-to-video flow models, with manifold-aware exploration (an exact-integral
SDE, sde.py; a temporal gradient equalizer, equalizer.py) and a dual trust region (a moving anchor
and the rollout policy, trust_region.py). The method: docs/method.md; its differences from the
paper and the released code, each with the switch that restores it: docs/method.md section 6.

    python train.py config/toy.py                          # the toy world on a CPU, minutes
    torchrun --nproc_per_node=2 train.py config/toy.py     # its FSDP path on CPU (gloo)
    torchrun --nproc_per_node=8 train.py                   # HunyuanVideo 1.5 480p + VideoAlign
    python train.py config/wan_1gpu.py                     # Wan 2.1 1.3B + VideoAlign on one GPU (models/wan.py)
    python train.py config/toy.py --sampler=flow --kl_strategy=none --out_dir=out-flow  # a baseline
    python train.py config/toy.py --max_iters=80           # again: out_dir's run continues to 80

One iteration: G rollouts of each prompt with the SDE, keeping every step's latent, mean and
log-prob; rewards of the decoded clips; advantages within each group; then every trained step of
every clip is one term of the objective (step_loss), one optimizer step per rollout batch; lambda_KL
moves after each optimizer step, the anchor every anchor_every of them. Settings are the constants
below (the paper's released defaults); config files and --key=value override them
(infra/configurator.py). The model families and the policy are in models/, the plumbing in infra/
(checkpoints that resume at any world size, the run directory that no start destroys, SIGTERM's
checkpoint at the next forward, process groups and sequence parallel), the optional add-ons in
extras/ (TVRL credit, CLIPScore/PickScore, gradient-norm diagnostics).
"""
import json
import math
import os
import time

import torch
from tqdm import tqdm

import sde
from equalizer import MEDIANS, scales
from reward import DIMS, combine, component_advantages, group_advantages, load as load_reward, sample_indices, \
    score_and_grad
from trust_region import STRATEGIES, Anchor, KLController, gaussian_kl, kl_weights
from extras import credit as tvrl, diagnostics, metrics
from infra import checkpoint, parallel, prompt_cache, rundir, sp
from infra.versions import check as check_versions
from infra.configurator import configure, list_of, one_of
from infra.optimizer import build as build_optimizers, zero_grad
from infra.preemption import Preemption
from models import attention as attention_lib, export, family
from models.evaluate import Alarm, HeldOut
from models.policy import PASS_KINDS, batch_text, count_passes, encode_prompts, generators, latent_shape, \
    load_decoder, load_policy, noise, sample, seed_of, transformer_config, velocity

# ----------------------------------------------------------------------------- settings
# I/O
out_dir = 'out'                 # checkpoints, metrics.jsonl, eval videos, prompt-embedding cache
init_from = 'auto'              # 'auto': continue out_dir's run, else a new one | 'scratch': a new
                                # run only | 'resume': continue only (infra/rundir.py)
eval_every = 25                 # iterations between held-out evaluations (also at start and end)
eval_samples = 1                # ODE samples (seeds) per held-out prompt
eval_videos = 4                 # mp4 files written per evaluation
alarm_z = 2.0                   # reward-hacking alarm: standard errors a watcher must move (models/evaluate.py)
hack_stop = False               # True: at the alarm, checkpoint and stop (False: say so and go on)
save_every = 50                 # iterations between checkpoints (also at the end and on SIGTERM)
keep_checkpoints = 2            # newest checkpoints kept in out_dir
export_dtype = 'bfloat16'       # the last checkpoint exported to out_dir/export; '' for none
diag_every = 0                  # iterations between gradient-norm diagnostics (0: never); each
                                # costs 4 forward+backward passes of a clip per rank: ~4% of an
                                # iteration's passes at the defaults, ~8% at config/released.py
wandb_log = False               # also log to wandb (if it is installed)
wandb_project = 'sage-grpo'
# model and data
model = 'hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v'  # a diffusers directory
train_prompts = 'prompts/train.txt'  # a prompt per line, or a CSV with prompt (and seed) columns
eval_prompts = 'prompts/eval.txt'    # held-out prompts, never trained on (same formats)
negative_prompt = ''            # the unconditional branch of classifier-free guidance
num_frames = 81                 # frames per clip
height = 352                    # rollout resolution (the paper trains at 352x624)
width = 624
fps = 24                        # frame rate of the decoded clips (the reward samples at 2 fps)
# reward
reward_model = 'videoalign'     # 'videoalign' (frozen, reward.py) | 'world': the model directory's own
                                # exact reward and manifold distance (the toy's, models/toy.py)
videoalign_dir = 'weights/VideoReward'     # hf download KwaiVGI/VideoReward --local-dir ...
qwen_dir = 'weights/Qwen2-VL-2B-Instruct'  # hf download Qwen/Qwen2-VL-2B-Instruct --local-dir ...
reward_weights = (0.5, 0.5, 1.0)  # (VQ, MQ, TA): Setting B, the paper's main one; A: (1, 1, 1)
eval_metrics = 'clipscore,pickscore'  # visual metrics at held-out evaluation (extras/metrics.py); '': none
clip_dir = 'weights/clip-vit-large-patch14'  # hf download openai/clip-vit-large-patch14 ...
pickscore_dir = 'weights/PickScore_v1'       # hf download yuvalkirstain/PickScore_v1 ...
credit = 'none'                 # 'none': a clip's tokens share its advantage; 'tvrl': extras/credit.py
credit_granularity = 'window'   # tvrl: 'window' (a weight a latent token) or 'frame' (a frame)
credit_window = (1, 3, 3)       # tvrl: (t, h, w) latent tokens of the smoothing box (odd)
# sampler
sampler = 'sage'                # SDE of the rollouts: 'sage' | 'flow' | 'dance' | 'cps'
eta = 0.5                       # exploration scale of the SDE noise
num_steps = 20                  # sampling steps of a rollout (and of the ODE evaluation)
eval_steps = 0                  # ODE steps of the held-out evaluation (0: num_steps)
shift = 5.0                     # sigma-schedule shift (480p: 5, 720p: 9)
cfg = 6.0                       # classifier-free guidance scale (1.0: one forward per step)
# GRPO
prompts_per_iter = 8            # prompts per rollout batch, over all ranks
group_size = 4                  # G: rollouts per prompt, the group of the advantage
rollout_batch = 4               # clips per forward pass in rollouts and evaluation (per rank)
train_batch = 1                 # clips per forward+backward pass in the update (per rank)
timestep_fraction = 1.0         # fraction of the stochastic steps trained per clip
sde_window = 0                  # > 0: only a random window of this many consecutive steps is
                                # stochastic and trained (docs/method.md section 6.3)
clip_range = 1e-4               # PPO ratio clip
adv_clip = 5.0                  # advantages are clipped to +-adv_clip
advantage = 'grpo'              # 'grpo': the composite standardised in its group (the paper) |
                                # 'per_component' | 'taros': each component first (reward.component_advantages)
equalizer = True                # scale each step's policy loss by S_t (equalizer.py)
updates_per_iter = 1            # optimizer steps per rollout batch
prompt_noise = 'fresh'          # initial noise: 'fresh' per iteration | 'fixed' per prompt (released)
median = 'mean_of_middle'       # S_t's median of an even count: numpy's | 'lower' (released)
# trust region
kl_strategy = 'dual'            # 'none' | 'fixed' | 'stepwise' | 'moving' | 'dual'
anchor_every = 10               # optimizer steps between anchor refreshes (moving, dual)
beta_pos = 1.0                  # weight of the position term KL(theta || anchor)
beta_vel = 0.1                  # weight of the velocity term KL(theta || theta_old)
kl_init = 1e-7                  # lambda_KL at the first optimizer step, the start of its warm-up
kl_min = 1e-7                   # lower clip of lambda_KL
kl_max = 1e-5                   # upper clip of lambda_KL, and the end of its warm-up
kl_warmup = 100                 # optimizer steps of linear warm-up kl_init -> kl_max (0: none)
kl_target = 1e-5                # the controller's KL target
kl_direction = 1                # +1: the printed rule (relax when KL is high); -1: stabilising
kl_estimator = 'exact'          # velocity term: 'exact' Gaussian KL to the rollout's mean | 'sample': log
                                # pi_old - log pi_theta at the rollout's own sample (released; docs/method.md 5.4)
kl_update = 'step'              # lambda_KL's update: each optimizer step on the all-rank KL |
                                # 'backward': each backward on the rank's own KL (released)
# optimisation
optimizer = 'muon'              # 'muon' (2-D matrices, AdamW the rest: released) | 'adamw'
max_iters = 300                 # rollout batches
learning_rate = 1e-5            # constant
weight_decay = 0.01
grad_clip = 1.0
nonfinite_stop = 3              # optimizer steps in a row skipped for a non-finite gradient norm that stop the run
lora_rank = 0                   # 0: full fine-tuning; > 0: LoRA adapters of this rank
experts = 'both'                # two-expert models (Wan 2.2 A14B): which train, 'both' | 'high' | 'low'
                                # (the other frozen: in no optimizer, anchor or checkpoint)
gradient_checkpointing = True   # recompute block activations in backward
attention = 'valid_tokens'      # the blocks' attention: padding left out, no mask (models/attention.py)
attention_backend = 'native'    # diffusers' attention backend: 'native' (torch SDPA), '_native_flash', 'flash', ...
device = 'cuda'                 # 'cuda' or 'cpu'
sp_size = 1                     # ranks of a node sharing one clip's tokens (infra/sp.py); data parallel the rest
shard_size = 0                  # ranks a weight is sharded over, replicated over the others (HSDP,
                                # infra/parallel.py); 0: the ranks of one node (one node: plain FSDP)
dist_timeout = 10.0             # minutes a collective waits: a rank that died or hangs ends the job
solo_timeout = 60.0             # minutes the ranks wait for rank 0 alone (prompt cache, export)
seed = 0
config = configure(globals(), rules={**dict(  # the names each setting picks from; the rest: configurator.RULES
    sampler=one_of(*sde.TRAINABLE), kl_strategy=one_of(*STRATEGIES), median=one_of(*MEDIANS),
    kl_estimator=one_of('exact', 'sample'), advantage=one_of('grpo', 'per_component', 'taros'),
    experts=one_of('both', 'high', 'low'),
    credit_granularity=one_of(*tvrl.GRANULARITIES), eval_metrics=list_of(*metrics.NAMES)), **attention_lib.RULES,
    ('kl_min', 'kl_init', 'kl_max'): (lambda lo, start, hi: None if lo <= start <= hi else
                                      f'lambda_KL needs kl_min <= kl_init <= kl_max, got {lo:g}, {start:g}, {hi:g}', '')})
# -----------------------------------------------------------------------------

# distributed setup: torchrun's environment, or one plain process (infra/parallel.py)
ddp, rank, world, device = parallel.init(device, dist_timeout)
master = rank == 0
sp_mesh = sp.mesh(sp_size, device) if sp_size > 1 else None  # (dp, ring, ulysses) of the world
# sp inside a node, the shards and the clips divide the ranks: else one line, and nothing starts
shard_size = parallel.check_layout(world, shard_size, sp_size, prompts_per_iter * group_size)
dp_rank, dp_world = rank // sp_size, world // sp_size  # an sp group: consecutive ranks, same clips
dp_group = sp_mesh['dp'].get_group() if sp_mesh else None  # one rank of each sp group
n_local = prompts_per_iter * group_size // dp_world  # this rank's clips: global indices clip_ids
clip_ids = list(range(dp_rank * n_local, (dp_rank + 1) * n_local))
preemption = Preemption(rank, device)  # the first SIGTERM: a checkpoint at the next forward, exit 0

train_list, prompt_seeds = prompt_cache.read_prompts(train_prompts)
eval_list, _ = prompt_cache.read_prompts(eval_prompts)
parallel.check_shared(out_dir, 'out_dir', master)  # every rank sees rank 0's out_dir, or all stop
quiet = print if master else lambda m: None
check_versions(quiet)  # one line if diffusers or transformers is outside requirements.txt's tested range
# out_dir locked for this run, and how it begins: from the checkpoints of the run it holds, or at 0
ckpts, history = rundir.claim(config, master, log=quiet)
quiet(json.dumps(config, indent=1))
if ddp:  # e.g. 'layout: 64 ranks; weights sharded over 8 and replicated 8x (HSDP); sp 2'
    quiet(parallel.describe(world, shard_size, sp_size))

# ----------------------------------------------------------------------------- models
shape = latent_shape(model, num_frames, height, width)  # (C, F, h, w): the family's, no weights read
if sp_size > 1:  # the heads and the video tokens split over sp, checked before anything loads
    sp.check(sp_size, transformer_config(model), shape)
# prompt embeddings: encoded once by rank 0 with the model's own text encoders into out_dir's
# cache (infra/prompt_cache.py), the encoders freed before the policy loads; every rank memory-maps it
text_cache = prompt_cache.shared(os.path.join(out_dir, 'prompt_cache'), model,
                                 set(train_list) | set(eval_list) | {negative_prompt}, encode_prompts, device,
                                 master, solo_timeout)
fam = family(model)  # the model family's file (models/hunyuan15.py, ...): the interface in models/__init__.py
fsdp_mesh = parallel.fsdp_mesh(world, shard_size, device) if ddp else None  # None: flat; 2-D: HSDP
policy = load_policy(model, device, fsdp=ddp, lora_rank=lora_rank, checkpointing=gradient_checkpointing,
                     attention=attention, backend=attention_backend, mesh=fsdp_mesh, experts=experts)
if sp_mesh:  # every forward splits its tokens over the sp group (FSDP shards over its own mesh)
    sp.enable(policy, sp_mesh, fam.cp_plan(policy))
optimizers = build_optimizers(policy, optimizer, learning_rate, weight_decay)  # [Muon, AdamW]
params = [p for o in optimizers for g in o.param_groups for p in g['params']]  # FSDP2 shards
anchor = Anchor(policy, strategy=kl_strategy, every=anchor_every)  # sharded like the policy
controller = KLController(lam_init=kl_init, lam_min=kl_min, lam_max=kl_max, target=kl_target, warmup=kl_warmup,
                          direction=kl_direction)
kl_pos_weight, kl_vel_weight = kl_weights(kl_strategy, beta_pos, beta_vel)  # 0 where a term is off
decode = load_decoder(model, device)
reward_fn, manifold_distance = load_reward(reward_model, videoalign_dir, qwen_dir, device,  # frozen
                                           (getattr(fam, 'reward', None), getattr(fam, 'manifold_distance', None)))
try:  # frozen watchers for reward hacking, scored at held-out evaluation only, on the CPU till then
    visual = metrics.load_metrics(eval_metrics, clip_dir, pickscore_dir, 'cpu')  # {name: score_fn}
except (OSError, ValueError) as e:
    raise SystemExit(f'eval_metrics: {e} (--eval_metrics= switches them off)')

sigmas = sde.sigmas(num_steps, shift).to(device)        # (N + 1,) from 1.0 to 0.0
stochastic = [i for i in range(num_steps)
              if sde.variance(sampler, sigmas[i].item(), sigmas[i + 1].item(), eta) > 0]
n_train = max(1, round(timestep_fraction * min(sde_window or num_steps, len(stochastic))))
on_policy = updates_per_iter == 1  # every micro-batch's forward is at theta_old (step_loss)


def text_for(prompts):
    """The transformer's text inputs of the prompts, and of as many negative prompts."""
    negative = [negative_prompt] * len(prompts)
    return batch_text(text_cache, prompts, device), batch_text(text_cache, negative, device)


def prompts_of(iter_num):
    """The prompts of this rank's clips: P prompts drawn for the iteration, G clips each."""
    g = torch.Generator().manual_seed(seed_of(seed, 'prompts', iter_num))
    n = len(train_list)
    chosen = (torch.randperm(n, generator=g)[:prompts_per_iter] if prompts_per_iter <= n
              else torch.randint(n, (prompts_per_iter,), generator=g)).tolist()
    return [train_list[chosen[i // group_size]] for i in clip_ids]


def initial_noise(prompts, ids, gens):
    """x_1 (n, C, F, h, w) of clips ids, from their own generators; prompt_noise='fixed' (released):
    the same for member i % G of a prompt every time the prompt is drawn."""
    if prompt_noise == 'fresh':
        return noise(shape, gens, device)
    return noise(shape, generators([prompt_seeds[p] + i % group_size if p in prompt_seeds else
                                    seed_of(seed, 'noise', p, i % group_size)
                                    for p, i in zip(prompts, ids)]), device)


iter_num, opt_steps, eval_owed = 0, 0, True  # a fresh run owes the base model's evaluation
skipped_in_row = 0  # optimizer steps skipped in a row for a non-finite gradient norm
passes = dict.fromkeys(PASS_KINDS, 0)  # transformer passes by kind, all ranks (model.count_passes)
alarm = Alarm(alarm_z)  # compares each evaluation with the base model's (iteration 0)
loop = checkpoint.resume(ckpts, policy, optimizers, anchor, log=quiet)  # each rank: its own slices
if loop:
    controller.load_state_dict(loop['controller'])
    iter_num, opt_steps, passes = loop['iter_num'], loop['opt_steps'], loop.get('passes', passes)
    eval_owed = loop.get('eval_owed', False)
    alarm.load_state_dict(loop.get('alarm', alarm.state_dict()))  # a checkpoint from before it: no base
evaluate = HeldOut(eval_list, eval_samples, seed=seed, sigmas=sde.sigmas(eval_steps or num_steps, shift).to(device),
                   cfg=cfg, shape=shape, text_for=text_for, batch=rollout_batch, decode=decode,
                   reward_fn=reward_fn, reward_weights=reward_weights, manifold_distance=manifold_distance,
                   visual=visual, move_visual=metrics.move, fps=fps, out_dir=out_dir, videos=eval_videos,
                   dp_rank=dp_rank, dp_world=dp_world, leads=rank % sp_size == 0, passes=passes,
                   preemption=preemption, device=device)


def save_checkpoint(eval_owed=False):
    """Collective: each rank writes its shards (infra/checkpoint.py), rank 0 publishes atomically."""
    loop = dict(iter_num=iter_num, opt_steps=opt_steps, world=world, passes=passes,
                controller=controller.state_dict(), config=config, eval_owed=eval_owed, alarm=alarm.state_dict())
    path = os.path.join(out_dir, f'{checkpoint.PREFIX}{iter_num:06d}')
    return checkpoint.save(path, policy, optimizers, anchor.state_dict(), loop, keep=keep_checkpoints)


def step_loss(clips, b, t, eq_scale, lam, denom):
    """The objective of local clips b (a list) at their trained steps t (n,), docs/method.md
    sections 4 and 5: the loss to backward, and its per-clip terms (n,) for the log."""
    x, x_next = clips['xs'][b, t], clips['xs'][b, t + 1]          # (n, C, F, h, w)
    s, s_next = sigmas[t], sigmas[t + 1]                         # (n,)
    text, text_neg = text_for([clips['prompts'][i] for i in b])
    weight = clips['credit'][b] if credit == 'tvrl' else None     # tvrl: credit-weighted log-prob
    kl_pos = kl_vel = torch.zeros(len(b), device=device)
    if kl_pos_weight:  # the anchor's forward first and without grad: its in-place weight swap must
        with torch.no_grad(), anchor.applied(policy):  # not fall between a forward and its backward
            v_anchor = velocity(policy, x, s, text, cfg, text_neg)
            mean_anchor = sde.step(x, v_anchor, s, s_next, sampler, eta, x_next=x_next).mean
    # both CFG branches carry gradients: the rollout policy is the guided velocity
    v = velocity(policy, x, s, text, cfg, text_neg)
    new = sde.step(x, v, s, s_next, sampler, eta, x_next=x_next, weight=weight)  # mean, std, logp
    drift = (new.logp.detach() - clips['logps'][b, t]).abs()  # the rollout's forward vs this one (n,)
    # one optimizer step per rollout batch: theta == theta_old, so the old log-prob and mean are this
    # forward's own, detached. The rollout's differ by the rounding of another batch shape (bf16 on a GPU:
    # |d logp| beyond clip_range at the late steps), which would clip away every losing clip's gradient
    # (docs/method.md 4.6); with updates_per_iter > 1 they are recomputed in this shape (recompute_old)
    logp_old, mean_old = (new.logp.detach(), new.mean.detach()) if on_policy else \
        (clips['logps'][b, t], clips['means'][b, t])
    ratio = torch.exp(new.logp - logp_old)                                      # (n,)
    adv = clips['adv'][b]                                                        # (n,)
    # PPO's pessimistic clip: the unclipped term's gradient flows only where clipping would not make the
    # objective more optimistic; scaled by the equalizer's S_t of each clip's step
    policy_term = eq_scale[t] * torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip_range, 1 + clip_range))
    if kl_pos_weight:
        kl_pos = gaussian_kl(new.mean, mean_anchor, new.std)          # position: to the anchor
    if kl_vel_weight:  # velocity: to the rollout policy, exact, or the released one-sample estimate
        kl_vel = gaussian_kl(new.mean, mean_old, new.std) if kl_estimator == 'exact' \
            else logp_old - new.logp  # (n,) 0 in expectation at theta_old, its gradient not
    per_clip = policy_term + lam * (kl_pos_weight * kl_pos + kl_vel_weight * kl_vel)  # (n,)
    terms = dict(policy=policy_term, kl_pos=kl_pos, kl_vel=kl_vel, ratio=ratio, adv=adv, valid=clips['valid'][b],
                 drift=drift if on_policy else None)
    # a NaN-reward clip drops out whole; where(), not a product: 0 * NaN would leak in
    return torch.where(clips['valid'][b] > 0, per_clip, 0.0).sum() / denom, terms


@torch.no_grad()
def recompute_old(clips, micro, order, stats):
    """updates_per_iter > 1: the old log-probs and means of the trained steps recomputed at theta_old in
    the update's own batch shape (train_batch clips a forward) before its first optimizer step, so that
    the ratio measures the policy's move, not the rounding of the rollout's other batch shape."""
    for b, k in preemption.points(micro):
        t = order[b, k]
        x, x_next, s, s_next = clips['xs'][b, t], clips['xs'][b, t + 1], sigmas[t], sigmas[t + 1]
        text, text_neg = text_for([clips['prompts'][i] for i in b])
        weight = clips['credit'][b] if credit == 'tvrl' else None
        old = sde.step(x, velocity(policy, x, s, text, cfg, text_neg), s, s_next, sampler, eta, x_next=x_next,
                       weight=weight)
        stats.drifted((old.logp - clips['logps'][b, t]).abs())
        clips['logps'][b, t], clips['means'][b, t] = old.logp, old.mean


def gradient_norms(clips, steps, eq_scale, lam):
    """diagnostics.gradient_norms of the first sp group's clip 0 (counted world x: FSDP averages ranks)."""
    terms_at = lambda t: step_loss(clips, [0], torch.tensor([t]), eq_scale, lam, 1.0)[1]  # noqa: E731
    return diagnostics.gradient_norms(terms_at, steps, eq_scale, lam, (kl_pos_weight, kl_vel_weight),
                                      optimizers, world if dp_rank == 0 else 0, preemption.point)


def score(latents, prompts):
    """Decode and score clips in memory: {'VQ', 'MQ', 'TA', ...: (n,)}, with tvrl also 'credit'."""
    frames = torch.cat([decode(x) for x in latents.split(rollout_batch)])  # (n, F, 3, H, W) in [0, 1]
    if credit == 'none':
        return reward_fn(frames, prompts, fps)
    # TVRL: |d composite / d pixels| pooled onto the latent tokens (extras/credit.py)
    sc, g = score_and_grad(reward_fn, frames, prompts, fps, reward_weights)  # g (n, F, 3, H, W)
    seen = sample_indices(frames.shape[1], fps, reward_fn.sample_fps) \
        if reward_model == 'videoalign' else None  # its 2 fps frames: tvrl interpolates the rest
    return dict(sc, credit=tvrl.credit_map(g, shape, seen, credit_window, credit_granularity))  # (n, 1, F, h, w)


def held_out(iter_num):
    """Evaluate, watch and log; a stop meanwhile checkpoints and owes this evaluation on resume. When
    the alarm trips, the checkpoint of the evaluation before it is pinned: no rotation removes it."""
    ev = evaluate(policy, iter_num, lambda: save_checkpoint(eval_owed=True))
    watch, line = alarm(iter_num, evaluate.items)  # the same on every rank: the items are gathered
    log({'iter': iter_num, **{f'eval_{k}': v for k, v in ev.items()}, **watch})
    if line and master:
        kept = checkpoint.pin(out_dir, alarm.kept, f'the last evaluation before the alarm of iteration {iter_num}')
        print(line + (f'; {kept} is kept' if kept else '') + ('; hack_stop: stopping' if hack_stop else ''))
    return ev


# ----------------------------------------------------------------------------- training loop
if master:  # written once everything has loaded: a run that fails to start leaves out_dir as it was
    rundir.record(out_dir, history, config, iter_num, world)  # config.json: what changed at which start
    checkpoint.forget_after(out_dir, iter_num, eval_owed)  # a crash leaves each iteration logged once
log = rundir.Log(out_dir, master, wandb_project if wandb_log else '', config)  # metrics.jsonl, wandb
first_eval = held_out(iter_num) if eval_owed else None  # the base model, or an evaluation cut short
first_eval = first_eval if iter_num == 0 else None
policy.train()
# At the defaults (one optimizer step per rollout batch) theta == theta_old throughout the update: the
# ratio is 1 up to the rounding of a recomputed forward (inside clip_range 1e-4: the clip does not act),
# and the exact velocity KL and its gradient are 0. updates_per_iter > 1 makes them act (docs/method.md
# section 4.6).
while iter_num < max_iters:
    t0 = time.time()
    preemption.begin(save_checkpoint, controller, passes)  # a stop saves iteration iter_num's state
    # ---- rollout: G clips a prompt from the current policy, keeping every step's latent, mean, logp
    steps = sde.window(stochastic, sde_window, seed_of(seed, 'window', iter_num))  # trained steps
    eq_scale = scales(sampler, sigmas.cpu(), eta, median, steps) if equalizer else torch.ones(num_steps)
    eq_scale = eq_scale.to(device)  # (N,) S_t
    prompts = prompts_of(iter_num)
    records = []
    for c in tqdm(range(0, n_local, rollout_batch), desc='rollout', disable=not master, leave=False):
        ids, ps = clip_ids[c:c + rollout_batch], prompts[c:c + rollout_batch]
        gens = generators([seed_of(seed, 'rollout', iter_num, i) for i in ids])  # the SDE's noise
        text, text_neg = text_for(ps)
        _, trajectory = sample(policy, initial_noise(ps, ids, gens), sigmas, text, cfg, text_neg, sampler, eta,
                               gens, keep=True, window=steps, boundary=preemption.point)  # final latents unused
        records.append(trajectory)  # {xs, means, logps, stds} of every step
    clips = {k: torch.cat([r[k] for r in records]) for k in records[0]}  # xs (n, N+1, C, F, h, w), ...
    clips['prompts'] = prompts
    del records, trajectory  # torch.cat copied them: one copy of the rollout lives through the update
    count_passes(passes, ('rollout',), device)
    t1 = time.time()

    # ---- reward: decode and score in memory, each clip once (an sp group divides its clips)
    scores = sp.divide_work(lambda idx: score(clips['xs'][idx, -1], [prompts[i] for i in idx]),
                            n_local, sp_mesh)
    if credit == 'tvrl':  # old log-probs in the same credit-weighted mean: ratio 1 at theta_old
        clips['credit'] = scores.pop('credit').to(device)
        for t in steps:
            clips['logps'][:, t] = sde.log_prob(clips['xs'][:, t + 1], clips['means'][:, t],
                                                clips['stds'][:, t], clips['credit'])
    t2 = time.time()

    # ---- advantage: over each whole group, even when it spans ranks; a NaN reward drops that clip
    r = parallel.gather(combine(scores, reward_weights).float().to(device), dp_group)
    adv, valid, std = group_advantages(r.view(prompts_per_iter, group_size), adv_clip)  # (P, G)
    if advantage != 'grpo':  # each component judged within its group, then weighed
        c = parallel.gather(torch.stack([scores[k] for k in DIMS], 1).float().to(device), dp_group)  # (P*G, 3)
        adv, valid = component_advantages(c.view(prompts_per_iter, group_size, -1), reward_weights, advantage,
                                          adv_clip)
    if not valid.any():  # a broken reward model, not a bad clip: stop before it touches the weights
        raise RuntimeError(f'iteration {iter_num + 1}: every reward is NaN; the reward model is '
                           f'failing (see its warnings above). Checkpoints in {out_dir} are untouched.')
    if master and not valid.all():
        print(f'warning: iteration {iter_num + 1}: {int((~valid).sum())} of {valid.numel()} rewards '
              'are NaN; those clips are left out of their groups and of the loss')
    clips['adv'] = adv.flatten()[clip_ids]
    clips['valid'] = valid.flatten()[clip_ids].float()
    diag = {} if credit == 'none' else \
        {'credit_peak': parallel.mean(clips['credit'].flatten(1).amax(1).mean(), device)}
    if diag_every and iter_num % diag_every == 0:  # gradient norms of clip 0's terms: 4 more passes
        diag.update(gradient_norms(clips, steps, eq_scale, controller.value))
    count_passes(passes, ('diag_anchor', 'diag'), device)

    # ---- update: every trained step of every clip, in a random order per clip
    order = torch.stack([torch.tensor(steps)[torch.randperm(len(steps), generator=torch.Generator()
                         .manual_seed(seed_of(seed, 'order', iter_num, i)))[:n_train]]
                         for i in clip_ids])  # (n, n_train) the trained steps of each clip
    stats = diagnostics.UpdateStats(n_local * n_train, clip_range)  # what the log shows of it
    chunks = [list(range(n_local))[k::updates_per_iter] for k in range(updates_per_iter)]
    if not on_policy:
        recompute_old(clips, [(list(range(n_local))[i:i + train_batch], k) for i in range(0, n_local, train_batch)
                              for k in range(n_train)], order, stats)
        count_passes(passes, ('old',), device)
    bar = tqdm(total=n_local * n_train, desc='update', disable=not master, leave=False)
    for chunk in chunks:  # one optimizer step each
        zero_grad(optimizers)  # never policy.zero_grad() under FSDP2 (infra/optimizer.py)
        # the divisor that makes the sum of every micro-batch's, step's and rank's loss, after FSDP's
        # average over ranks, the mean over valid clips x trained steps (this chunk's share of them)
        denom = max(1.0, valid.sum().item()) * n_train / world / len(chunks)
        micro = [(chunk[i:i + train_batch], k) for i in range(0, len(chunk), train_batch)
                 for k in range(n_train)]
        kls = []
        # FSDP reduce-scatters after every backward, so gradients stay sharded (accumulating
        # without sync would hold the whole unsharded gradient: 16 GB at 8.3B in bf16)
        for b, k in preemption.points(micro):  # a stop drops these gradients: no weight moved yet
            loss, terms = step_loss(clips, b, order[b, k], eq_scale, controller.value, denom)
            loss.backward()
            stats.add(loss, terms)
            kls.append((kl_pos_weight * terms['kl_pos'] + kl_vel_weight * terms['kl_vel']).mean().item())
            if kl_update == 'backward' and math.isfinite(kls[-1]):  # released: this rank's KL of this
                controller.update(kls[-1])  # backward (the ranks' lambdas differ; a checkpoint keeps rank 0's)
            bar.update(len(b))
        norm = diagnostics.whole(torch.nn.utils.clip_grad_norm_(params, grad_clip))  # global: every rank alike
        stats.stepped(norm, len(chunks))
        if not math.isfinite(norm):  # a NaN or inf gradient would make every weight NaN: no step
            skipped_in_row += 1
            zero_grad(optimizers)
            if skipped_in_row >= nonfinite_stop:
                raise SystemExit(f'iteration {iter_num + 1}: {skipped_in_row} optimizer steps in a row had a '
                                 f'non-finite gradient norm ({norm}); none was taken, and the newest checkpoint in '
                                 f'{out_dir} is the last good one')
            continue
        skipped_in_row = 0
        for o in optimizers:
            o.step()
        zero_grad(optimizers)  # freed now: gradients do not live through the next rollout and eval
        opt_steps += 1
        preemption.stepped()  # the weights moved: the iteration runs to its end, then a checkpoint
        # ---- lambda_KL after each optimizer step, from the KL observed over all ranks; the anchor
        # every anchor_every optimizer steps (moving, dual)
        if kl_update == 'step':
            controller.update(parallel.mean(sum(kls) / len(kls), device))
        anchor.maybe_refresh(policy, opt_steps)
    bar.close()
    count_passes(passes, ('anchor', 'update'), device)
    t3 = time.time()
    iter_num += 1

    # ---- log
    means = {k: torch.nanmean(parallel.gather(scores[k].float().to(device), dp_group)).item()
             for k in ('VQ', 'MQ', 'TA')}  # NaN: a clip left out
    mem = parallel.peak_memory_gb(device)  # (world,)
    row = dict(iter=iter_num, reward=torch.nanmean(r).item(), **means, group_std=std.mean().item(),
               zero_adv_frac=(std.flatten() <= 1e-6).float().mean().item(), nan_rewards=int((~valid).sum()),
               lambda_kl=controller.value, **stats.row(device, sp_size, dp_group), **diag,
               **{f'passes_{k}': n for k, n in passes.items()}, t_rollout=t1 - t0, t_reward=t2 - t1,
               t_update=t3 - t2, peak_mem_gb=mem.max().item(), peak_mem_gb_ranks=mem.tolist())
    log(row)  # a line on the console, metrics.jsonl (and wandb)

    # ---- eval and checkpoint, every K iterations and at the end
    last = iter_num == max_iters
    if (eval_every and iter_num % eval_every == 0) or last:
        ev = held_out(iter_num)
        if master and last and first_eval is not None:
            print(f"eval composite before {first_eval['composite']:.4f} -> after {ev['composite']:.4f}")
    stop = preemption.requested(device)  # every rank, once per iteration: a checkpoint resumes here
    halt = hack_stop and alarm.tripped is not None
    if (save_every and iter_num % save_every == 0) or last or stop or halt:
        save_checkpoint()
    if halt:
        break
    if stop:
        if master:
            print(f'preempted: checkpoint of iteration {iter_num} written; the same command continues')
        break

if export_dtype and iter_num == max_iters:  # the aligned model, in the ecosystem's format, by rank 0
    # alone: the others wait on the c10d store (solo_timeout), not in a collective (dist_timeout)
    dest = os.path.join(out_dir, 'export')
    parallel.solo(lambda: export.export(out_dir, dest, getattr(torch, export_dtype)), 'export',
                  solo_timeout)
    if master:
        print(f'exported to {out_dir}/export: diffusers {fam.TRANSFORMER}.from_pretrained() loads it')

del policy, anchor  # their FSDP state holds the process group: freed before it is destroyed
parallel.close()
