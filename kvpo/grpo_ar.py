"""
GRPO with an SDE on a streaming video model: the baseline KVPO's abstract sets itself against (noise
injected in the few-step sampler), on the same model, prompts, optimizer and held-out evaluation as
kvpo/train.py, so the two are compared seed for seed (bench/kvpo_verdicts.py). Per prompt G clips from
one initial noise, each with its own SDE noise (kvpo/sde_ar.py: the project's step, SAGE by default, in
every block's denoising steps), scored; train.py's objective on the recorded transitions:

    A = clip((r - mean_group) / std_group, +-adv_clip)                       (reward.group_advantages)
    L = mean_{clips, trained steps k} S_k max(-A rho, -A clip(rho, 1 +- eps)) + lambda KL(mean_theta || mean_init)
    rho = exp(log p_theta(x_{k+1} | x_k, cached clean frames) - log p_old),  S_k the equalizer's scale

    python -m kvpo.grpo_ar kvpo/config/grpo_toy.py                         # the AR toy, CPU, minutes
    torchrun --nproc_per_node=2 -m kvpo.grpo_ar kvpo/config/grpo_toy.py    # 2 gloo ranks

What the defaults make of the objective (as train.py's): one optimizer step per rollout batch, so
p_old is the update's own forward, detached: the ratio is 1, the clip inert, the loss REINFORCE scaled by
S_k. Where this differs from train.py: the KL is the position term to the initial model at a constant
lambda (train.py's 'fixed' strategy, no controller: its lambda_KL tops at 1e-5); the trained steps are
drawn per iteration for every clip (train.py: per clip), so a step is one batched masked forward; the
group shares its initial noise (KVPO's branches do: the variation is the SDE's alone). Every rank holds
the whole model and gradients are averaged, as kvpo/train.py.
Tested by: python -m pytest tests/test_kvpo_sde.py (2 ranks: -m slow)
"""
import copy
import os
import time

import torch
import torch.distributed as dist

import equalizer as eq
import reward
import sde
import trust_region as tr
from infra import checkpoint, parallel, rundir
from infra.configurator import configure, one_of
from infra.preemption import Preemption
from infra.prompt_cache import read_prompts
from kvpo import sde_ar, segments
from models import family
from models.evaluate import Alarm, HeldOut
from models.videoalign import load_reward
from models.policy import generators, load_policy, noise, seed_of

# ----------------------------------------------------------------------------- the method (train.py's values)
sampler = 'sage'                # SDE of the rollouts' denoising steps: 'sage' | 'flow' | 'dance' | 'cps'
eta = 0.5                       # exploration scale of the SDE noise
sde_window = 0                  # > 0: a random window of this many steps is stochastic; 0: every SDE step
train_steps = 4                 # of the stochastic steps, this many (drawn each iteration) carry the loss
group = 6                       # G: clips a prompt
shared_noise = True             # the group shares one initial noise: its variation is the SDE's alone
adv_clip = 5.0                  # advantages are clipped to +-adv_clip
equalizer = True                # scale each step's policy loss by S_t (equalizer.py)
adv_shuffle = False             # a control, not the method: permute each group's advantages at random (seeded)
ta_brightness = False           # a machinery check, not a reward: TA := the clips' mean pixel value (trained alone
                                # with reward_weights (0, 0, 1); the held-out evaluation keeps the real reward)
clip_range = 1e-4               # PPO ratio clip
kl_coef = 1e-5                  # lambda x beta_pos of KL(mean_theta || mean_init) (0: off, one forward less)
learning_rate = 1e-5            # AdamW, constant after the warm-up
warmup = 5                      # optimizer steps of linear learning-rate warm-up
weight_decay = 0.01
grad_clip = 1.0                 # global gradient-norm clip
ema_decay = 0.999               # the evaluated weights: an exponential average of the trained ones
max_iters = 1500                # iterations (one optimizer step each)
prompts_per_iter = 8            # prompts an iteration over all ranks
# ----------------------------------------------------------------------------- model, data, plumbing
model = 'weights/LongLive'      # a streaming model directory (python -m streaming.wan_causal)
lora_rank = 256                 # LoRA rank (alpha = rank) on the generator; 0: full fine-tuning
reward_model = 'videoalign'     # 'videoalign' | 'world': the model's own (the toy's)
reward_weights = (0.5, 0.5, 1.0)  # (VQ, MQ, TA) of the composite (Setting B)
videoalign_dir = 'weights/VideoReward'
qwen_dir = 'weights/Qwen2-VL-2B-Instruct'
train_prompts = 'prompts/train.txt'
eval_prompts = 'prompts/eval.txt'
eval_stories = ''               # held-out stories (a video's prompts a line), scored as the training reward; '': none
frames = 21                     # latent frames a rollout generates (one chunk)
switch_frames = ()              # latent frames where the prompt switches (kvpo/train.py's): a train_prompts line
                                # holds a video's prompts; the text keys replaced at each switch (no re-cache)
global_clip = 9                 # with switches: the reward is the mean over a clip centred in each segment
eval_frames = 21                # latent frames of a held-out sample
eval_every = 2                  # iterations between held-out evaluations (and at start and end; 0: never)
eval_samples = 1                # seeds per held-out prompt
alarm_z = 2.0                   # reward-hacking alarm: standard errors a watcher must move
fps = 16
out_dir = 'out-grpo-ar'
init_from = 'auto'              # 'auto': continue out_dir's run, else new | 'scratch' | 'resume'
save_every = 2                  # iterations between checkpoints (and at the end and on SIGTERM)
keep_checkpoints = 2
device = 'cuda'
dist_timeout = 10.0             # minutes a collective waits
seed = 42
config = configure(globals(), rules=dict(sampler=one_of(*sde.TRAINABLE)))

# ----------------------------------------------------------------------------- setup
ddp, rank, world, device = parallel.init(device, dist_timeout)
master = rank == 0
assert prompts_per_iter % world == 0, f'prompts_per_iter={prompts_per_iter} must divide over {world} ranks'
torch.set_num_threads(1) if device == 'cpu' else None  # reproducible, and fair on a shared CPU
preemption = Preemption(rank, device)
ckpts, history = rundir.claim(config, master)
fam = family(model)
policy = load_policy(model, device, lora_rank=lora_rank).train()  # a whole replica on every rank
init, ema = (copy.deepcopy(policy).eval().requires_grad_(False) for _ in range(2))
trained = [(n, p) for n, p in policy.named_parameters() if p.requires_grad]
ema_p = dict(ema.named_parameters())
encode, decode = fam.text_encoder(model, device), fam.load_decoder(model, device)
reward_fn, manifold_distance = load_reward(reward_model, videoalign_dir, qwen_dir, device, family=fam)
C, _, h, w = fam.latent_shape(model, fam.DEFAULTS['num_frames'], fam.DEFAULTS['height'], fam.DEFAULTS['width'])
opt = torch.optim.AdamW([p for _, p in trained], lr=learning_rate, weight_decay=weight_decay)
train_list, eval_list = read_prompts(train_prompts)[0], read_prompts(eval_prompts)[0]
if switch_frames:  # a line is a video's prompts (kvpo/train.py's prompt_story): the same draws as KVPO's
    train_list = segments.stories(train_list, len(switch_frames) + 1)
eval_story_list = segments.stories(read_prompts(eval_stories)[0], len(switch_frames) + 1) if eval_stories else []
story = getattr(fam, 'story_score', None) if switch_frames else None  # later prompts continue the first (toy_story)
sigmas = torch.tensor(sde_ar.schedule(policy.layout))  # (S + 1,) the layout's steps and a terminal 0
stochastic = sde.stochastic_steps(sampler, sigmas, eta)  # the steps that have noise: the only ones trained


class Copies:
    """The EMA weights, saved and resumed with the checkpoints (checkpoint's 'anchor')."""
    def state_dict(self):
        return {f'ema.{n}': ema_p[n].data for n, _ in trained}


alarm = Alarm(alarm_z)
loop = checkpoint.resume(ckpts, policy, opt, Copies())
iter_num = loop['iter_num'] if loop else 0
if loop:
    alarm.load_state_dict(loop['alarm'])
held = HeldOut(eval_list, eval_samples, seed=seed, sigmas=None, cfg=1.0, shape=(C, eval_frames, h, w),
               text_for=lambda p: (encode(p), None), batch=1, decode=decode, reward_fn=reward_fn,
               reward_weights=reward_weights, manifold_distance=manifold_distance, visual={},
               move_visual=lambda *a: None, fps=fps, out_dir=out_dir, videos=0, dp_rank=rank, dp_world=world,
               leads=True, passes={'eval': 0}, preemption=preemption, device=device)  # kvpo/train.py's
log = rundir.Log(out_dir, master)
log.line = lambda r: ' '.join(f'{k} {v:.4g}' if isinstance(v, float) else f'{k} {v}' for k, v in r.items())
if master:  # config.json's start; later rows go (a checkpoint precedes its iteration's evaluation: owed)
    rundir.record(out_dir, history, config, iter_num, world, eval_owed=True)


# ----------------------------------------------------------------------------- the phases
def my_prompts(it):
    """(index, prompt) of this rank's prompts at iteration it: kvpo/train.py's seeded draw (the same prompts)."""
    g = torch.Generator().manual_seed(seed_of(seed, 'prompts', it))
    pick = torch.randint(len(train_list), (prompts_per_iter,), generator=g).tolist()
    return [(j, train_list[pick[j]]) for j in range(rank, prompts_per_iter, world)]


def trained_steps(it):
    """This iteration's stochastic steps (all, or an SDE window), the trained ones among them, S_t (S,)."""
    steps = sde.window(stochastic, sde_window, seed_of(seed, 'window', it))
    g = torch.Generator().manual_seed(seed_of(seed, 'order', it) % 2 ** 63)
    train = sorted(steps[i] for i in torch.randperm(len(steps), generator=g)[:train_steps].tolist())
    s_t = eq.scales(sampler, sigmas, eta, steps=train) if equalizer else torch.ones(len(sigmas) - 1)
    return steps, train, s_t


@torch.no_grad()
def rollout(it, j, prompt, steps):
    """G clips of one prompt (a story: one a segment) from the current policy, the SDE at `steps`
    (kvpo/sde_ar.py): the clips and what training needs of them ({'xs' (G, S + 1, C, F, h, w), 'logps'
    (G, S, blocks)})."""
    text = lambda p: fam.context(encode([p] * group)).to(device)  # noqa: E731  (G, L, D)
    ctx = [(a, text(p)) for (a, _), p in zip(segments.bounds(frames, switch_frames), prompt)] if switch_frames \
        else text(prompt)
    ids = [0] * group if shared_noise else range(group)
    x1 = noise((C, frames, h, w), generators([seed_of(seed, 'noise', it, j, g) for g in ids]), device)
    gens = generators([seed_of(seed, 'rollout', it, j, g) for g in range(group)])  # the SDE's noise
    clips, rec = sde_ar.generate(policy, x1, ctx, steps, sampler, eta, gens)
    return dict(rec, ctx=ctx, clips=clips, prompt=prompt, j=j)


@torch.no_grad()
def score(g):
    """{'VQ', 'MQ', 'TA': (G,)} of the group's clips (ta_brightness: TA their mean pixel value); a story's:
    kvpo/train.py's global signal (segments.score_video)."""
    if switch_frames:
        return segments.score_video(g['clips'], g['prompt'], switch_frames, global_clip, decode, reward_fn, fps, story)
    frames = decode(g['clips'])  # (G, F, 3, H, W)
    sc = {k: v.float().cpu() for k, v in reward_fn(frames, [g['prompt']] * group, fps).items() if k in reward.DIMS}
    return sc | dict(TA=frames.float().flatten(1).mean(1).cpu()) if ta_brightness else sc


def advantages(sc, it, j):
    """GRPO's group-normalised advantages (G,), which clips count (G,), the group's reward std. With
    adv_shuffle (bench/kvpo_diagnosis.py's control) the advantages are permuted within the group, a draw
    seeded by (iteration, prompt): the same update size and statistics, no assignment to the clips."""
    adv, valid, std = reward.group_advantages(reward.combine(sc, reward_weights)[None], adv_clip)
    if adv_shuffle:
        adv = adv[:, torch.randperm(group, generator=torch.Generator().manual_seed(seed_of(seed, 'shuffle', it, j)))]
    return adv[0].to(device), valid[0].to(device), std.item()


def update(groups, it, train, s_t):
    """One AdamW step on the mean over valid clips x trained steps of all ranks: per group and step one
    masked forward (sde_ar.step_at), the initial model's first and without grad; gradients averaged."""
    opt.zero_grad(set_to_none=False)
    n_valid = parallel.mean(sum(g['valid'].sum().item() for g in groups), device) * world  # over all ranks
    denom = max(1.0, n_valid) * len(train)  # each rank's share: their sum (the all-reduce below) is the mean
    stats = dict(loss=0.0, kl=0.0, ratio_max=0.0, drift=0.0)
    for g in preemption.points(groups):  # a stop here drops these gradients: the weights have not moved
        for k in train:
            mean_init = None
            if kl_coef:
                with torch.no_grad():
                    mean_init = sde_ar.step_at(init, g['ctx'], g['xs'], k, sampler, eta).mean
            new = sde_ar.step_at(policy, g['ctx'], g['xs'], k, sampler, eta)  # mean, std, logp (G,)
            ratio = torch.exp(new.logp - new.logp.detach())  # theta == theta_old: p_old is this forward's
            clipped = ratio.clamp(1 - clip_range, 1 + clip_range)
            policy_term = s_t[k] * torch.maximum(-g['adv'] * ratio, -g['adv'] * clipped)  # (G,)
            kl = tr.gaussian_kl(new.mean, mean_init, new.std) if kl_coef else torch.zeros_like(policy_term)
            per_clip = policy_term + kl_coef * kl
            loss = torch.where(g['valid'], per_clip, 0.0).sum() / denom  # where(): 0 * NaN would leak
            loss.backward()
            stats['loss'] += loss.item() * world  # this rank's share x world: the ranks' mean is the loss
            stats['kl'] += kl.mean().item() / len(train) / len(groups)
            stats['ratio_max'] = max(stats['ratio_max'], ratio.max().item())
            rolled = g['logps'][:, k].mean(-1)  # the rollout's log-prob of the clip's step k (G,)
            stats['drift'] = max(stats['drift'], (new.logp.detach() - rolled).abs().max().item())
    for _, p in trained:  # the sum over ranks (each rank's share already divided)
        p.grad = torch.zeros_like(p) if p.grad is None else p.grad
        if ddp:
            dist.all_reduce(p.grad)
    gnorm = torch.nn.utils.clip_grad_norm_([p for _, p in trained], grad_clip).item()
    for grp in opt.param_groups:
        grp['lr'] = learning_rate * min(1.0, (it + 1) / warmup)
    opt.step()
    preemption.stepped()
    with torch.no_grad():
        for n, p in trained:
            ema_p[n].lerp_(p, 1 - ema_decay)
    return dict(stats, grad_norm=gnorm)


def log_iteration(it, groups, st, times):
    """The iteration's row: the clips' mean reward components and composite, the mean within-group std of
    the composite (the exploration), the loss's figures, the times; means over all ranks."""
    mean = lambda f: parallel.mean(sum(f(g) for g in groups) / len(groups), device)  # noqa: E731
    row = dict(iter=it, reward=mean(lambda g: reward.combine(g['scores'], reward_weights).mean().item()))
    row.update({k: mean(lambda g: g['scores'][k].mean().item()) for k in reward.DIMS})
    row.update(group_std=mean(lambda g: g['std']), **{k: parallel.mean(v, device) for k, v in st.items()}, **times)
    log(row)


@torch.no_grad()
def held_out(it):
    """The EMA weights on the held-out prompts, block by block, scored and watched (kvpo/train.py's)."""
    means = held(ema, it, save_checkpoint)
    if eval_story_list:  # whole videos of the held-out stories (ODE), scored as the training reward: kvpo/train.py's
        score_fn = lambda x, ps: segments.score_video(x, ps, switch_frames, global_clip, decode, reward_fn, fps, story)  # noqa: E731
        means |= segments.evaluate(ema, eval_story_list, lambda p: fam.context(encode([p])).to(device),
                                   (C, frames, h, w), switch_frames, score_fn, reward_weights, manifold_distance,
                                   decode, seed, rank, world, device)
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
        save_checkpoint()
        break
    preemption.begin(save_checkpoint)  # a SIGTERM from here saves the last finished iteration
    t0 = time.time()
    steps, train, s_t = trained_steps(iter_num)
    groups = [rollout(iter_num, j, p, steps) for j, p in preemption.points(my_prompts(iter_num))]
    for g in groups:
        g['scores'] = score(g)
        g['adv'], g['valid'], g['std'] = advantages(g['scores'], iter_num, g['j'])
    t1 = time.time()
    st = update(groups, iter_num, train, s_t)
    iter_num += 1
    log_iteration(iter_num, groups, st, dict(t_rollout=t1 - t0, t_update=time.time() - t1))
parallel.close()
