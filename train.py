"""
SAGE-GRPO: GRPO for text-to-video flow models with manifold-aware exploration (an exact-integral
SDE, a temporal gradient equalizer) and a dual trust region (moving anchor + previous policy).

    python train.py config/toy.py                            # the toy world on a CPU, minutes
    torchrun --nproc_per_node=2 train.py config/toy.py       # its FSDP path on CPU (gloo)
    torchrun --nproc_per_node=8 train.py                     # HunyuanVideo 1.5 480p + VideoAlign
    python train.py config/toy.py --sampler=flow --kl_strategy=none   # a baseline: one constant
    python train.py config/toy.py --credit=tvrl              # token-level credit (credit.py)

Settings are the constants below (the paper's released defaults, shared/SPEC.md section 4);
config files and --key=value override them (configurator.py). The loss is loss.py, SPEC section 4.

    python train.py config/toy.py --init_from=resume         # from out_dir's newest intact checkpoint
    kill -TERM <pid>                # checkpoint at the next forward, exit 0 (torchrun forwards it)

Checkpoints are sharded (checkpoint.py: each rank writes and reads its own shards, any world size
resumes any checkpoint); the final one is exported to out_dir/export as a diffusers transformer.

Where this code knowingly differs from the paper or its released code:
- lambda_KL is updated once per optimizer step on the all-rank mean KL (the paper's count);
  kl_update='backward' is the released cadence (after every backward, on the rank's local KL).
- rollouts start from fresh noise every iteration; prompt_noise='fixed' is the released seeding.
- a NaN reward drops its clip from its group; the released code scores it 0 and keeps it.
- config/released.py is the released run as far as these settings express it (with sources).
- CPS log-probabilities are the true Gaussian density (the reference drops its constants).
- SIGTERM stops at the next forward or micro-batch and saves the last finished iteration (the unit a
  checkpoint resumes from, bitwise; preemption.py): the grace period must cover a forward and a save.
- With one optimizer step per rollout batch (the default), theta == theta_old during the update:
  the ratio is exactly 1, the clip never acts, and the velocity KL term and its gradient are 0.
  updates_per_iter > 1 splits the batch into several optimizer steps, where both act.
- sde_window=w (not in the paper; Flow-GRPO-Fast's random window, sde.window): rollouts take ODE steps
  but for w consecutive stochastic ones, the only steps trained; S_t's median is over those.
- credit='tvrl' (not in the paper; TVRL on top): each clip's log-prob is a credit-weighted mean over its
  latent tokens (credit.py) instead of the plain mean, in both the old and the new log-prob.
"""
import gc
import hashlib
import json
import os
import resource
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from tqdm import tqdm

import checkpoint
import prompt_cache
import sde
import sp
import toy  # plugs the toy world (its text encoder, decoder, latent shape) into model.py
from configurator import configure
from credit import credit_map
from equalizer import scales
from loss import denominator, grpo_loss
from optimizer import build as build_optimizers, zero_grad
from preemption import Preemption
from model import PASS_KINDS, batch_text, count_passes, generators, latent_shape, load_decoder, load_policy, \
    noise, sample, save_mp4, velocity
from reward import combine, group_advantages, sample_indices, score_and_grad
from trust_region import Anchor, KLController

# ----------------------------------------------------------------------------- settings
# I/O
out_dir = 'out'                 # checkpoints, metrics.jsonl, eval videos, prompt-embedding cache
init_from = 'scratch'           # 'scratch' or 'resume' (the newest checkpoint in out_dir)
eval_every = 25                 # iterations between held-out evaluations (also at start and end)
eval_samples = 1                # ODE samples (seeds) per held-out prompt
eval_videos = 4                 # mp4 files written per evaluation
save_every = 50                 # iterations between checkpoints (and one at the end, and on SIGTERM)
keep_checkpoints = 2            # newest checkpoints kept in out_dir
export_dtype = 'bfloat16'       # the final checkpoint is exported to out_dir/export (diffusers); '' for none
diag_every = 1                  # iterations between per-step gradient-norm diagnostics (0: never)
wandb_log = False               # also log to wandb (if it is installed)
wandb_project = 'sage-grpo'
# model and data
model = 'hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v'  # hub id or diffusers dir
train_prompts = 'prompts/train.txt'  # one prompt per line, or a CSV with a prompt (and seed) column
eval_prompts = 'prompts/eval.txt'    # held-out prompts, never trained on (same formats)
negative_prompt = ''            # the unconditional branch of classifier-free guidance
num_frames = 81                 # frames per clip
height = 352                    # rollout resolution (the paper trains at 352x624)
width = 624
fps = 24                        # frame rate of the decoded clips (the reward samples at 2 fps)
# reward
reward_model = 'videoalign'     # 'videoalign' (frozen, shared/SPEC.md 6) or 'toy'
videoalign_dir = 'weights/VideoReward'        # hf download KwaiVGI/VideoReward --local-dir weights/VideoReward
qwen_dir = 'weights/Qwen2-VL-2B-Instruct'     # hf download Qwen/Qwen2-VL-2B-Instruct --local-dir weights/Qwen2-VL-2B-Instruct
reward_weights = (0.5, 0.5, 1.0)  # (VQ, MQ, TA): Setting B, the paper's main one; A is (1, 1, 1)
eval_metrics = 'clipscore,pickscore'  # visual metrics at held-out evaluation (metrics.py); '' for none
clip_dir = 'weights/clip-vit-large-patch14'   # hf download openai/clip-vit-large-patch14 --local-dir ...
pickscore_dir = 'weights/PickScore_v1'        # hf download yuvalkirstain/PickScore_v1 --local-dir ...
credit = 'none'                 # 'none': a clip's tokens share its advantage (GRPO); 'tvrl': credit.py weights
credit_granularity = 'window'   # tvrl: 'window' (a weight per latent token) or 'frame' (one per latent frame)
credit_window = (1, 3, 3)       # tvrl: (t, h, w) latent tokens of the smoothing box (odd; (1, 1, 1): none)
# sampler
sampler = 'sage'                # SDE of the rollouts: 'sage' | 'flow' | 'dance' | 'cps'
eta = 0.5                       # exploration scale of the SDE noise
num_steps = 20                  # sampling steps of a rollout (and of the ODE evaluation)
eval_steps = 0                  # ODE steps of the held-out evaluation (0: num_steps)
shift = 5.0                     # sigma-schedule shift (480p: 5, 720p: 9)
cfg = 6.0                       # classifier-free guidance scale (1.0: one forward, distilled models)
# GRPO
prompts_per_iter = 8            # prompts per rollout batch, over all ranks
group_size = 4                  # G: rollouts per prompt, the group of the advantage
rollout_batch = 4               # clips per forward pass in rollouts and evaluation (per rank)
train_batch = 1                 # clips per forward+backward pass in the update (per rank)
timestep_fraction = 1.0         # fraction of the stochastic steps trained per clip
sde_window = 0                  # > 0: a random window of this many consecutive steps is stochastic and trained, ODE elsewhere
clip_range = 1e-4               # PPO ratio clip
adv_clip = 5.0                  # advantages are clipped to +-adv_clip
equalizer = True                # scale each step's policy loss by S_t (equalizer.py)
updates_per_iter = 1            # optimizer steps per rollout batch
prompt_noise = 'fresh'          # initial noise: 'fresh' per iteration | 'fixed' per (seed, prompt, member), released
median = 'mean_of_middle'       # equalizer median: 'mean_of_middle' (numpy, SPEC) | 'lower' (torch.median, released)
# trust region
kl_strategy = 'dual'            # 'none' | 'fixed' | 'stepwise' | 'moving' | 'dual'
anchor_every = 10               # optimizer steps between anchor refreshes (moving, dual)
beta_pos = 1.0                  # weight of the position term KL(theta || anchor)
beta_vel = 0.1                  # weight of the velocity term KL(theta || theta_old)
kl_max = 1e-5                   # upper bound (and warm-up end) of the adaptive lambda_KL
kl_target = 1e-5                # the controller's KL target
kl_direction = 1                # +1: the printed rule (relax when KL is high); -1: stabilising
kl_update = 'step'              # controller.update: 'step' (all-rank mean, per optimizer step) | 'backward' (released)
# optimisation
optimizer = 'muon'              # 'muon' (2-D matrices; AdamW for the rest: released default) | 'adamw' (optimizer.py)
max_iters = 300                 # rollout batches
learning_rate = 1e-5            # constant
weight_decay = 0.01
grad_clip = 1.0
lora_rank = 0                   # 0: full fine-tuning; > 0: LoRA adapters of this rank
gradient_checkpointing = True   # recompute block activations in backward
attention = 'masked_keys'       # blocks' attention: padding masked as keys only (attention.py); 'diffusers': its (S, S) mask
device = 'cuda'                 # 'cuda' or 'cpu'
sp_size = 1                     # ranks that share one clip's tokens (sequence parallel, sp.py); data parallel over world / sp_size
dist_timeout = 60               # minutes a collective waits (NCCL: 10) for rank 0's solo phases: 10,000 prompts cached (162 s
                                # written, results/checkpoint.md, + encoding), the 8.3B export (~5 min at its 320M DCP rates)
seed = 0
config = configure(globals())  # also checks each value against configurator.RULES
# -----------------------------------------------------------------------------

# distributed setup: torchrun's environment, or one plain process
ddp = 'RANK' in os.environ
if device == 'cuda' and not torch.cuda.is_available():
    raise SystemExit('no CUDA device: run with --device=cpu (the toy world: python train.py config/toy.py)')
if ddp:
    dist.init_process_group('nccl' if device == 'cuda' else 'gloo', timeout=timedelta(minutes=dist_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    if device == 'cuda':
        device = f'cuda:{int(os.environ["LOCAL_RANK"])}'
        torch.cuda.set_device(device)
else:
    rank, world = 0, 1
master = rank == 0
sp_mesh = sp.mesh(sp_size, device) if sp_size > 1 else None  # (dp, ring, ulysses); checks sp_size | world
dp_rank, dp_world = rank // sp_size, world // sp_size  # an sp group: sp_size consecutive ranks, the same clips
n_clips = prompts_per_iter * group_size
if n_clips % dp_world:
    raise SystemExit(f'prompts_per_iter * group_size = {n_clips} must be divisible by the world size {world} / sp_size {sp_size}')
n_local = n_clips // dp_world  # clips of this rank's group: global indices dp_rank * n_local + j

# preemption: the first SIGTERM stops at the next forward / micro-batch boundary (preemption.point())
# with a checkpoint of the last finished iteration, a second SIGTERM or a SIGINT exits at once (preemption.py)
preemption = Preemption(rank, device)


def mix(*parts):
    """A 63-bit seed from any tuple: rollouts are a function of (seed, iteration, clip index)."""
    return int(hashlib.sha256(repr(parts).encode()).hexdigest()[:15], 16)


def gather(t, group=sp_mesh['dp'].get_group() if sp_mesh else None):
    """(n, ...) on every rank -> (dp_world * n, ...) in clip order, from one rank per sp group (None: all)."""
    if not ddp:
        return t
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts)


def mean_all(x):
    """The mean of a float over ranks (every rank gets the same number)."""
    if not ddp:
        return float(x)
    t = torch.tensor([float(x)], device=device)
    dist.all_reduce(t)
    return t.item() / world


(train_list, prompt_seeds), (eval_list, _) = prompt_cache.read_prompts(train_prompts), prompt_cache.read_prompts(eval_prompts)
if master:
    try:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, '.write_test'), 'w') as f:
            f.write('ok')
        os.remove(os.path.join(out_dir, '.write_test'))
    except OSError as e:
        raise SystemExit(f'out_dir {out_dir!r} is not writable: {e}')
    print(json.dumps(config, indent=1))

# ----------------------------------------------------------------------------- models
# prompt embeddings: computed once by rank 0 with the pipeline's own encoders, written in chunks to
# out_dir/prompt_cache (prompt_cache.py), encoders freed before the policy is loaded; every rank
# memory-maps the cache and reads only the prompts it uses
text_cache = prompt_cache.shared(os.path.join(out_dir, 'prompt_cache'), model, set(train_list) | set(eval_list) | {negative_prompt},
                                  device, master, ddp)

# resume: the newest intact checkpoint (a damaged or missing one is named and skipped)
ckpts = checkpoint.candidates(out_dir, log=print if master else lambda m: None) if init_from == 'resume' else []
policy = load_policy(model, device, fsdp=ddp, lora_rank=lora_rank, checkpointing=gradient_checkpointing,
                     attention=attention)
if sp_mesh:  # every forward splits its tokens over the sp group (FSDP still shards over all ranks)
    sp.enable(policy, sp_mesh)
optimizers = build_optimizers(policy, optimizer, learning_rate, weight_decay)  # [Muon, AdamW] or [AdamW]
params = [p for o in optimizers for g in o.param_groups for p in g['params']]  # sharded under FSDP2 (optimizer.py)
anchor = Anchor(policy, strategy=kl_strategy, every=anchor_every)  # sharded like the policy
controller = KLController(lam_max=kl_max, target=kl_target, direction=kl_direction)
decode = load_decoder(model, device)
if reward_model == 'toy':
    reward_fn, manifold_distance = toy.reward, toy.manifold_distance
else:
    from reward import load_videoalign
    reward_fn, manifold_distance = load_videoalign(videoalign_dir, qwen_dir, device), None
try:  # frozen watchers for reward hacking, scored at held-out evaluation only
    from metrics import load_metrics, move as move_metrics  # on the CPU, on the GPU only in evaluate()
    visual = load_metrics(eval_metrics, clip_dir, pickscore_dir, 'cpu')  # {name: score_fn}
except (OSError, ValueError) as e:
    raise SystemExit(f'eval_metrics: {e} (--eval_metrics= switches them off)')

shape = latent_shape(model, num_frames, height, width)  # (C, F, h, w)
sigmas = sde.sigmas(num_steps, shift).to(device)        # (N + 1,) from 1.0 to 0.0
eval_sigmas = sde.sigmas(eval_steps or num_steps, shift).to(device)  # the held-out evaluation's ODE schedule
stochastic = [i for i in range(num_steps) if sde.variance(sampler, sigmas[i].item(), sigmas[i + 1].item(), eta) > 0]
n_train = max(1, round(timestep_fraction * min(sde_window or num_steps, len(stochastic))))
use_pos, use_vel = kl_strategy in ('fixed', 'moving', 'dual'), kl_strategy in ('stepwise', 'dual')
w_pos, w_vel = beta_pos * use_pos, beta_vel * use_vel  # 'moving' is the position term alone

iter_num, opt_steps, eval_owed = 0, 0, True  # a fresh run owes the base model's evaluation
passes = dict.fromkeys(PASS_KINDS, 0)  # transformer passes by kind, all ranks (model.count_passes)
for i, ckpt in enumerate(ckpts):  # each rank reads only its own slices, into the sharded policy
    try:
        loop = checkpoint.load(ckpt, policy, optimizers, anchor)
    except Exception as e:  # a damaged shard: the next intact checkpoint overwrites all of it
        if i + 1 == len(ckpts):
            raise SystemExit(f'cannot resume from {ckpt}: {type(e).__name__}: {str(e)[:300]}')
        if master:
            print(f'warning: checkpoint {ckpt} is damaged ({type(e).__name__}): falling back to {ckpts[i + 1]}')
        continue
    controller.load_state_dict(loop['controller'])
    iter_num, opt_steps, eval_owed = loop['iter_num'], loop['opt_steps'], loop.get('eval_owed', False)
    passes = loop.get('passes', passes)
    if master:
        print(f'resumed from {ckpt} at iteration {iter_num}' + (' (the newest intact checkpoint)' if i else ''))
    break


def text_for(prompts):
    return batch_text(text_cache, prompts, device), batch_text(text_cache, [negative_prompt] * len(prompts), device)


def evaluate():
    """ODE samples of the held-out prompts with fixed seeds; mean rewards over all ranks."""
    preemption.begin(lambda: save_checkpoint(eval_owed=True))  # a stop: this evaluation runs on resume
    policy.eval()
    move_metrics(visual, device)
    items = len(eval_list) * eval_samples  # item i: prompt i % len(eval_list), seed mix(seed, 'eval', i)
    # every rank runs as many batches (FSDP): items padded to a multiple of dp_world (an sp group's first rank scores)
    mine = list(range(dp_rank, -(-items // dp_world) * dp_world, dp_world))
    rows = []
    for c in range(0, len(mine), rollout_batch):
        idx = mine[c:c + rollout_batch]
        prompts = [eval_list[i % len(eval_list)] for i in idx]
        gens = generators([mix(seed, 'eval', i) for i in idx])
        text, text_neg = text_for(prompts)
        x, _ = sample(policy, noise(shape, gens, device), eval_sigmas, text, cfg, text_neg, 'ode', 0.0, gens,
                      boundary=preemption.point)
        if rank % sp_size:
            continue
        frames = decode(x)
        sc = reward_fn(frames, prompts, fps)
        sc['composite'] = combine(sc, reward_weights)
        if manifold_distance is not None:
            sc['manifold'] = manifold_distance(frames)
        sc.update({k: fn(frames, prompts) for k, fn in visual.items()})  # per-frame mean, (B,) each
        rows += [(i, {k: float(v[j]) for k, v in sc.items()}) for j, i in enumerate(idx) if i < items]
        for j, i in enumerate(idx):
            if master and i < min(items, eval_videos * dp_world):
                os.makedirs(os.path.join(out_dir, 'eval'), exist_ok=True)
                save_mp4(frames[j], os.path.join(out_dir, 'eval', f'iter{iter_num:06d}_{i}.mp4'), fps)
    if ddp:
        parts = [None] * world
        dist.all_gather_object(parts, rows)
        rows = [r for p in parts for r in p]
    rows = [r for _, r in sorted(rows, key=lambda r: r[0])]  # item order: the same means on any world size
    count_passes(passes, ('eval',), device)
    policy.train()
    move_metrics(visual, 'cpu')
    return {k: torch.tensor([r[k] for r in rows]).nanmean().item() for k in rows[0]}  # NaN: unscored video


def save_checkpoint(eval_owed=False):
    """Collective: each rank writes its shards (checkpoint.py), rank 0 publishes atomically."""
    return checkpoint.save(os.path.join(out_dir, f'{checkpoint.PREFIX}{iter_num:06d}'), policy, optimizers,
                           anchor.state_dict(), dict(iter_num=iter_num, opt_steps=opt_steps, world=world, passes=passes,
                                                     controller=controller.state_dict(), config=config, eval_owed=eval_owed),
                           keep=keep_checkpoints)


def step_loss(b, t, clips, denom=1.0):
    """The loss of local clips b (list) at their trained steps t (n,) and its terms: loss.py, SPEC 4."""
    x, prev = clips['xs'][b, t], clips['xs'][b, t + 1]           # (n, C, F, h, w)
    s, s_next = sigmas[t], sigmas[t + 1]                          # (n,)
    text, text_neg = text_for([clips['prompts'][i] for i in b])
    mean_anchor = None
    if use_pos:  # the anchor's forward comes first and without grad: its in-place weight swap
        with torch.no_grad(), anchor.applied(policy):  # must not happen between a forward and its backward
            v_anchor = velocity(policy, x, s, text, cfg, text_neg)
        mean_anchor = sde.step(x, v_anchor, s, s_next, sampler, eta, prev=prev).mean
    # both CFG branches carry gradients: the rollout policy is the guided velocity, so the exact
    # gradient of its log-prob flows through the conditional and the unconditional forward alike
    v = velocity(policy, x, s, text, cfg, text_neg)
    new = sde.step(x, v, s, s_next, sampler, eta, prev=prev, weight=clips['credit'][b] if credit == 'tvrl' else None)
    return grpo_loss(new.logp, clips['logps'][b, t], clips['adv'][b], new.mean, mean_anchor,
                     clips['means'][b, t] if use_vel else None, new.std, scale=S[t], lam=controller.value,
                     beta_pos=w_pos, beta_vel=w_vel, clip_range=clip_range, valid=clips['valid'][b], denom=denom)


def score(latents, prompts):
    """Decode and score clips in memory: {'VQ', 'MQ', 'TA', ...: (n,)}, with tvrl also 'credit'."""
    frames = torch.cat([decode(x) for x in latents.split(rollout_batch)])  # (n, F, 3, H, W) in [0, 1]
    if credit == 'none':
        return reward_fn(frames, prompts, fps)
    # TVRL: |d composite / d pixels| pooled onto the latent tokens (credit.py)
    sc, g = score_and_grad(reward_fn, frames, prompts, fps, reward_weights)  # g (n, F, 3, H, W)
    seen = sample_indices(frames.shape[1], fps, reward_fn.sample_fps) if reward_model == 'videoalign' else None
    return dict(sc, credit=credit_map(g, shape, seen, credit_window, credit_granularity))  # (n, 1, F, h, w)


def grad_norm():
    n = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    return (n.full_tensor() if isinstance(n, DTensor) else n).item()


def grad_norm_of(loss):
    """Backward the first sp group's loss alone and return its gradient's global norm (leaves .grad empty).
    Every rank runs the backward (FSDP's collectives), which averages over ranks: that group's counts world times."""
    zero_grad(optimizers)
    (loss * (world if dp_rank == 0 else 0)).backward()
    n = grad_norm()
    zero_grad(optimizers)
    return n


# ----------------------------------------------------------------------------- training loop
if master:  # written once everything has loaded: a run that fails to start leaves out_dir as it was
    with open(os.path.join(out_dir, 'config.json'), 'w') as f:
        json.dump(config, f, indent=1)
    checkpoint.forget_after(out_dir, iter_num, eval_owed)  # a crash leaves a clean log: lost iterations run again
if wandb_log and master:
    try:
        import wandb
        wandb.init(project=wandb_project, config=config)
    except ImportError:
        wandb_log = False
        print('wandb is not installed: logging to metrics.jsonl only')
first_eval = None
if eval_owed:  # the base model's scores, or the evaluation a preemption cut short
    first_eval = evaluate()
    if master:
        print(f'eval iter {iter_num}: ' + ' '.join(f'{k} {v:.4f}' for k, v in first_eval.items()))
        with open(os.path.join(out_dir, 'metrics.jsonl'), 'a') as f:
            f.write(json.dumps({'iter': iter_num, **{f'eval_{k}': v for k, v in first_eval.items()}}) + '\n')
    first_eval = first_eval if iter_num == 0 else None
policy.train()
while iter_num < max_iters:
    t0 = time.time()
    preemption.begin(save_checkpoint, controller, passes)  # until the first optimizer step: weights of iteration iter_num
    # ---- rollout: G clips per prompt, keeping per step what training needs
    trained_steps = sde.window(stochastic, sde_window, mix(seed, 'window', iter_num))  # stochastic and trained
    S = (scales(sampler, sigmas.cpu(), eta, median, trained_steps) if equalizer else torch.ones(num_steps)).to(device)  # (N,)
    g = torch.Generator().manual_seed(mix(seed, 'prompts', iter_num))
    chosen = (torch.randperm(len(train_list), generator=g)[:prompts_per_iter] if prompts_per_iter <= len(train_list)
              else torch.randint(len(train_list), (prompts_per_iter,), generator=g)).tolist()
    gids = list(range(dp_rank * n_local, (dp_rank + 1) * n_local))  # global clip indices of this rank's group
    prompts = [train_list[chosen[i // group_size]] for i in gids]
    traj, latents = [], []
    for c in tqdm(range(0, n_local, rollout_batch), desc='rollout', disable=not master, leave=False):
        idx = gids[c:c + rollout_batch]
        gens = generators([mix(seed, 'rollout', iter_num, i) for i in idx])  # the SDE's noise (and 'fresh' x_1)
        x1 = noise(shape, gens if prompt_noise == 'fresh' else generators(  # 'fixed': member i % G of its prompt
            [prompt_seeds[p] + i % group_size if p in prompt_seeds else mix(seed, 'noise', p, i % group_size)
             for p, i in zip(prompts[c:c + rollout_batch], idx)]), device)
        text, text_neg = text_for(prompts[c:c + rollout_batch])
        x, rec = sample(policy, x1, sigmas, text, cfg, text_neg, sampler, eta, gens, keep=True, window=trained_steps,
                        boundary=preemption.point)
        traj.append(rec)
        latents.append(x)
    clips = {k: torch.cat([r[k] for r in traj]) for k in traj[0]}  # xs (n, N+1, C, F, h, w), ...
    clips['prompts'] = prompts
    del traj, rec, x  # torch.cat copied them: one copy of the rollout tensors lives through the update
    count_passes(passes, ('rollout',), device)
    t1 = time.time()

    # ---- reward: decode and score in memory, each clip once (sp.spread shares them over an sp group)
    scores = sp.spread(lambda idx: score(torch.cat(latents)[idx], [prompts[i] for i in idx]), n_local, sp_mesh)
    if credit == 'tvrl':
        clips['credit'] = scores.pop('credit').to(device)
        for t in trained_steps:  # old log-probs in the same credit-weighted mean: ratio 1 at theta = theta_old
            clips['logps'][:, t] = sde.log_prob(clips['xs'][:, t + 1], clips['means'][:, t], clips['stds'][:, t],
                                                clips['credit'])
    r_local = combine(scores, reward_weights).float().to(device)   # (n,)
    del latents  # the update does not need them (the final latents are clips["xs"][:, -1])
    t2 = time.time()

    # ---- advantage: over each whole group, even when it spans ranks; a NaN reward drops that member
    r = gather(r_local).view(prompts_per_iter, group_size)          # (P, G)
    adv, valid, std = group_advantages(r, adv_clip)
    if not valid.any():  # a broken reward model, not a bad clip: stop before it touches the weights
        raise RuntimeError(f'iteration {iter_num + 1}: every reward is NaN; the reward model is failing '
                           f'(see its warnings above). Checkpoints in {out_dir} are untouched.')
    if master and not valid.all():
        print(f'warning: iteration {iter_num + 1}: {int((~valid).sum())} of {valid.numel()} rewards are NaN; '
              'those clips are left out of their groups and of the loss')
    clips['adv'] = adv.flatten()[dp_rank * n_local:(dp_rank + 1) * n_local]
    clips['valid'] = valid.flatten()[dp_rank * n_local:(dp_rank + 1) * n_local].float()

    # ---- diagnostics: gradient norm of one clip's policy loss at the first and last trained step
    diag = {} if credit == 'none' else {'credit_peak': mean_all(clips['credit'].flatten(1).amax(1).mean())}  # mean max weight
    if diag_every and iter_num % diag_every == 0:
        b = [0]
        for name, t in (('first', trained_steps[0]), ('last', trained_steps[-1])):
            preemption.point()  # a boundary before each forward + backward
            _, terms = step_loss(b, torch.tensor([t]), clips)
            diag[f'gnorm_{name}'] = grad_norm_of(terms.policy.sum() / S[t])  # without the equalizer
            diag[f'gnorm_{name}_eq'] = diag[f'gnorm_{name}'] * S[t].item()  # with it (S_t is a constant)
        if kl_strategy != 'none':
            preemption.point()
            t = trained_steps[len(trained_steps) // 2]
            _, terms = step_loss(b, torch.tensor([t]), clips)
            g_pg = grad_norm_of(terms.policy.sum())
            _, terms = step_loss(b, torch.tensor([t]), clips)
            g_kl = grad_norm_of(controller.value * (w_pos * terms.kl_pos + w_vel * terms.kl_vel).sum())
            diag['kl_grad_ratio'] = g_kl / max(g_pg, 1e-30)
    count_passes(passes, ('diag_anchor', 'diag'), device)

    # ---- update: every trained step of every clip, in a random order per clip
    order = torch.stack([torch.tensor(trained_steps)[torch.randperm(len(trained_steps), generator=torch.Generator()
                         .manual_seed(mix(seed, 'order', iter_num, i)))[:n_train]] for i in gids])  # (n, n_train)
    stats = dict(loss=0.0, kl_pos=0.0, kl_vel=0.0, clipfrac=0.0, grad_norm=0.0, ratio_max=0.0)
    chunks = [list(range(n_local))[k::updates_per_iter] for k in range(updates_per_iter)]
    bar = tqdm(total=n_local * n_train, desc='update', disable=not master, leave=False)
    for chunk in chunks:
        zero_grad(optimizers)  # never policy.zero_grad() under FSDP2 (optimizer.py)
        mbs = [chunk[i:i + train_batch] for i in range(0, len(chunk), train_batch)]
        denom = denominator(valid.sum().item(), n_train, world, len(chunks))  # FSDP averages over ranks
        kl_chunk = []
        for b in mbs:
            for k in range(n_train):
                preemption.point()  # the gradients so far are dropped: the weights have not moved yet
                # FSDP reduce-scatters after every backward, so gradients stay sharded (accumulating
                # without sync would hold the whole unsharded gradient: 16 GB at 8.3B in bf16)
                loss, terms = step_loss(b, order[b, k], clips, denom)
                loss.backward()
                stats['loss'] += loss.item()
                stats['kl_pos'] += terms.kl_pos.sum().item() / (n_local * n_train)
                stats['kl_vel'] += terms.kl_vel.sum().item() / (n_local * n_train)
                stats['clipfrac'] += ((terms.ratio - 1).abs() > clip_range).float().sum().item() / (n_local * n_train)
                stats['ratio_max'] = max(stats['ratio_max'], (terms.ratio - 1).abs().max().item())  # vs clip_range
                kl_chunk.append((w_pos * terms.kl_pos + w_vel * terms.kl_vel).mean().item())
                if kl_update == 'backward':  # the released cadence: this rank's KL of this backward, so
                    controller.update(kl_chunk[-1])  # ranks' lambdas differ (a checkpoint keeps rank 0's)
                bar.update(len(b))
        gn = torch.nn.utils.clip_grad_norm_(params, grad_clip)
        stats['grad_norm'] += float(gn.full_tensor() if isinstance(gn, DTensor) else gn) / len(chunks)
        for o in optimizers:
            o.step()
        zero_grad(optimizers)  # freed now: gradients do not live through the next rollout and eval
        opt_steps += 1
        preemption.stepped()  # updates_per_iter > 1: the rest of the iteration runs, then its checkpoint
        # ---- anchor and lambda_KL: once per optimizer step, from the KL observed over all ranks
        if kl_update == 'step':
            controller.update(mean_all(sum(kl_chunk) / len(kl_chunk)))
        anchor.maybe_refresh(policy, opt_steps)
    bar.close()
    count_passes(passes, ('anchor', 'update'), device)
    t3 = time.time()
    iter_num += 1

    # ---- log
    rs = torch.cat([gather(scores[k].float().to(device)) for k in ('VQ', 'MQ', 'TA')]).view(3, -1)
    mem = gather(torch.tensor([torch.cuda.max_memory_allocated() if 'cuda' in str(device) else  # bytes, per rank
                               resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0], device=device), None) / 2 ** 30
    row = dict(iter=iter_num, loss=mean_all(stats['loss']) / sp_size, reward=torch.nanmean(r).item(), VQ=torch.nanmean(rs[0]).item(),
               MQ=torch.nanmean(rs[1]).item(), TA=torch.nanmean(rs[2]).item(),
               group_std=std.mean().item(), zero_adv_frac=(std.flatten() <= 1e-6).float().mean().item(),
               nan_rewards=int((~valid).sum()), kl_pos=mean_all(stats['kl_pos']), kl_vel=mean_all(stats['kl_vel']),
               lambda_kl=controller.value, clipfrac=mean_all(stats['clipfrac']), grad_norm=stats['grad_norm'],
               ratio_max=gather(torch.tensor([stats['ratio_max']], device=device)).max().item(),  # max |ratio - 1|
               **diag, **{f'passes_{k}': n for k, n in passes.items()}, t_rollout=t1 - t0, t_reward=t2 - t1, t_update=t3 - t2,
               peak_mem_gb=mem.max().item(), peak_mem_gb_ranks=mem.tolist())  # the worst rank, and each
    if master:
        print(f"iter {iter_num}: reward {row['reward']:.4f} (VQ {row['VQ']:.3f} MQ {row['MQ']:.3f} "
              f"TA {row['TA']:.3f}) std {row['group_std']:.3f} kl {row['kl_pos']:.2e}/{row['kl_vel']:.2e} "
              f"lam {row['lambda_kl']:.1e} gnorm {row['grad_norm']:.3f} "
              f"time {row['t_rollout']:.1f}/{row['t_reward']:.1f}/{row['t_update']:.1f}s")
        with open(os.path.join(out_dir, 'metrics.jsonl'), 'a') as f:
            f.write(json.dumps(row) + '\n')
        if wandb_log:
            wandb.log(row, step=iter_num)

    # ---- eval and checkpoint, every K iterations and at the end
    last = iter_num == max_iters
    if (eval_every and iter_num % eval_every == 0) or last:
        ev = evaluate()
        if master:
            print(f'eval iter {iter_num}: ' + ' '.join(f'{k} {v:.4f}' for k, v in ev.items()))
            with open(os.path.join(out_dir, 'metrics.jsonl'), 'a') as f:
                f.write(json.dumps({'iter': iter_num, **{f'eval_{k}': v for k, v in ev.items()}}) + '\n')
        if last and first_eval is not None and master:
            print(f"eval composite before {first_eval['composite']:.4f} -> after {ev['composite']:.4f}")
    stop = preemption.requested(device)  # every rank, once per iteration: a checkpoint resumes from here
    if (save_every and iter_num % save_every == 0) or last or stop:
        save_checkpoint()
    if stop:
        if master:
            print(f'preempted: checkpoint of iteration {iter_num} written; resume with --init_from=resume')
        break

if master and export_dtype and iter_num == max_iters:  # the aligned model, in the ecosystem's format, renamed
    checkpoint.export(out_dir, os.path.join(out_dir, 'export'), getattr(torch, export_dtype))  # into place
    print(f'exported to {out_dir}/export: diffusers HunyuanVideo15Transformer3DModel.from_pretrained() loads it')

if ddp:
    dist.barrier()  # every rank waits for the export (dist_timeout), and none tears gloo down early
    del policy, anchor  # their FSDP state holds the process group: one freed after destroy_process_group
    gc.collect()        # can abort the process on exit ('terminate called without an active exception')
    dist.destroy_process_group()
