"""
KVPO: GRPO for a streaming (block-causal, few-step) video generator whose exploration is the KV cache,
not injected noise (docs/kvpo.md section 1). For one prompt, one initial noise and the same
re-noising draws in every branch; in four lines:

    fork f, drawn among eligible blocks; branch g's blocks [f, f + P block) attend to the sink, n_random
      older frames of its own (a shifted window of one permutation of the pool) and the m nearest frames
    s_g = sum_{b, k} -mean((x0_g[b,k] - x0_theta(x_g[b,k], t_k))^2) / (2 max(sigma_k, 1)^2)   (TVE, replayed)
    log pi(g) = log_softmax_g(s_g);  A_g = (r_g - r_anchor) / std(r_1..r_G, r_anchor), fused, clamped
    L = -mean_g min(rho_g A_g, clip(rho_g, 0.9, 1.2) A_g) + 10 KL(pi_theta || pi_init)  (x gate)

The replay (tve) starts from the KV state saved before the fork (the rollout's keys, text keys included,
as released: the gradient flows through the replayed blocks only), routing off; between blocks the cache
takes the replaying model's own last x0 (detached); only the first `grad_steps` of the 4 steps carry
gradient. As released the branch logits are log-softmaxed before the anchor slot (logit 0) joins them,
so an unsafe prompt has pi_anchor = 1/2 exactly and mechanism_2 halves its loss (no gradient flows
through the scale); mechanism_1 zeroes it. Where this differs from the released code: noise is drawn
per (seed, frame, step) (explicit, and the same in every branch whatever its start); frames are routed
by their absolute index from a cache that keeps them (streaming/__init__.py KVCache.route), the planned ones
(router's release_reads: the release's reads, one block off once its cache has rolled: docs/kvpo.md 2).
Tested by: python -m pytest tests/test_kvpo.py tests/test_kvpo_release.py
"""
import math

import torch
import torch.nn.functional as F

from kvpo import segments
import streaming


# ----------------------------------------------------------------------------- routing (CHR)
def n_random(layout, m):
    """Older frames a routed block sees: its window less the sink and the m nearest frames (12-3-4 = 5)."""
    return layout['window'] - layout['sink'] - m


def pool(fork, layout, m, P, keep):
    """The older frames a branch may route to: resident in a cache of `keep` frames when the P-th routed
    block starts, after the sink, before fork - m (released: [3, fork - 4) while it fits in 33 frames)."""
    last = fork + (P - 1) * layout['block']
    return list(range(max(layout['sink'], last - (keep - layout['sink'])), fork - m))


def chunks(frames, first, then):
    """The video's chunks [(start, end)]: `first` frames, then `then` more each (released: 21, +18 to 147)."""
    out, start = [], 0
    while start < frames:
        end = min(frames, start + (first if not out else then))
        out.append((start, end))
        start = end
    return out


def eligible_forks(frames, layout, m, P, keep, first, then, within):
    """Block starts a fork may take, in the first `within` chunks: at or past the window, its P blocks
    inside one chunk, enough older frames in the pool for n_random."""
    return [f for a, b in chunks(frames, first, then)[:within] for f in range(a, b, layout['block'])
            if f >= layout['window'] and f + P * layout['block'] <= b
            and len(pool(f, layout, m, P, keep)) >= n_random(layout, m)]


def plan(frames, layout, K, m, P, keep, seed, first, then, within, earliest=0):
    """The routing of one prompt: {'fork', 'older': K sorted frame lists}. The fork is uniform over the
    eligible blocks (from frame `earliest` on: an experiment's switch, 0 as released); branch k takes positions (k shift + i) mod |pool|, i < n_random, of one seeded
    permutation of the pool, shift = max(1, |pool| // K), so branches overlap little."""
    if layout.get('window') is None:  # KVPO routes the frames a window dropped: a global cache drops none
        raise SystemExit(f"kvpo routes a windowed cache (LongLive's); {layout.get('name')} attends globally: nothing to route")
    forks = [f for f in eligible_forks(frames, layout, m, P, keep, first, then, within) if f >= earliest]
    assert forks, f'no eligible fork in {frames} frames for P={P}, m={m} (a fork needs >= window and a pool)'
    gen = torch.Generator().manual_seed(seed)
    fork = forks[torch.randint(len(forks), (1,), generator=gen).item()]
    older = pool(fork, layout, m, P, keep)
    perm = torch.randperm(len(older), generator=gen).tolist()
    shift, n = max(1, len(older) // K), n_random(layout, m)
    return dict(fork=fork, older=[sorted(older[perm[(k * shift + i) % len(older)]] for i in range(n))
                                  for k in range(K)])


def router(fork, older, layout, m, P, keep=None, release_reads=False):
    """KVCache.route of a branch: a block in [fork, fork + P block) sees the sink, `older`, and the cached
    ones of its m nearest frames (the m frames up to its end: its own block and m - block before it);
    any other block its window as usual. release_reads: read as the released code does once its cache of
    `keep` frames has rolled at the fork (fork + block > keep): each planned frame f from the slot of
    f + block (its visible range starts at the block's start while its end includes the block; a bug, kept
    as a switch: docs/kvpo.md section 2)."""
    if release_reads and fork + layout['block'] > keep:
        older = [f + layout['block'] for f in older]  # what the release reads: fork 39 plans 21-25, reads 24-28

    def route(cache, start, end):
        if not fork <= start < fork + P * layout['block']:
            return streaming.visible_frames(cache.frames, start, end, layout)
        sink = [f for f in cache.frames if f < layout['sink']]
        return sink + list(older) + [f for f in cache.frames if end - m <= f < start]
    return route


# ----------------------------------------------------------------------------- rollout
def noise_at(seed, frames, step, shape):
    """The noise (1, C, len(frames), h, w) of absolute frames at a step (0: the initial noise, k: the
    re-noising to step k): a function of (seed, frame, step), so every branch and the anchor share it."""
    return torch.stack([torch.randn(shape, generator=torch.Generator().manual_seed(
        seed * 1_000_003 + f * 131 + step)) for f in frames], 1)[None]


def write_block(net, x0, text, cache, start, seed, context_noise=0.0):
    """The finished block x0 (1, C, f, h, w) written to the cache: one forward at timestep 0 of
    (1 - s) x0 + s eps, s = context_noise, eps the (seed, frame) draw of step S (after the S denoising
    steps' draws: shared by every branch and every replay); released: add_noise(x0, eps, t=0), s ~0.005."""
    if context_noise:
        eps = noise_at(seed, range(start, start + x0.shape[2]), len(net.layout['timesteps']),
                       (x0.shape[1],) + tuple(x0.shape[3:]))
        x0 = (1 - context_noise) * x0 + context_noise * eps.to(x0.device)
    streaming.forward_block(net, x0, torch.zeros(1, device=x0.device), text, cache, start, write=True)


def denoise_block(net, context, cache, start, seed, shape, record=None, context_noise=0.0, past=None):
    """One block from its noise to its clean x0, written to the cache (write_block); record: a list that
    gets the block's per-step (x_t, x0) pairs, each (1, C, f, h, w), for the replay. context: the text, or
    the prompt segments [(first frame, text), ...] (a new segment's text keys replace the cache's); past: the
    clean blocks before `start` (a list, oldest first), whose last window a switch re-caches (None: not)."""
    sig, frames = streaming.sigmas(net.layout), list(range(start, start + net.layout['block']))
    text, switch = segments.text_at(context, start)
    if switch:  # a prompt switch, as LongLive's interactive mode: the new prompt's text keys from here on, and
        segments.switch(net, cache, text, start, None if past is None else torch.cat(past, 2))  # the window re-cached
    x = noise_at(seed, frames, 0, shape).to(text.device)
    for k, s in enumerate(sig):
        v = streaming.forward_block(net, x, torch.full((1,), s, device=x.device), text, cache, start).float()
        x0 = x - s * v  # the step's prediction of the clean block
        if record is not None:
            record.append((x, x0))
        if k + 1 < len(sig):  # re-noised as the layout says: fresh noise (released) or the step's own, x0 + v
            z = x0 + v if net.layout.get('renoise', 'fresh') == 'ode' else noise_at(seed, frames, k + 1, shape)
            x = (1 - sig[k + 1]) * x0 + sig[k + 1] * z.to(x0.device)
    write_block(net, x0, text, cache, start, seed, context_noise)
    return x0


@torch.no_grad()
def rollout(net, context, frames, shape, routing, seed, m, P, keep, span_end=None, context_noise=0.0,
            release_reads=False, recache=False):
    """One prompt's group: the prefix up to the fork once, its KV state saved, then K routed branches and
    the unrouted anchor from that state with the same noise. shape: a frame's latent (C, h, w); context:
    the text or the prompt segments (denoise_block). span_end: the frame the recorded trajectory stops at
    (None: the P routed blocks; released: the end of the fork's chunk). release_reads: router's. recache: a
    prompt switch also re-caches the last window of frames under the new prompt (released; segments.switch).
    Returns latents (K + 1, C, F, h, w) (the anchor last), the trajectories {'x': (K, n, S, C, f, h, w),
    'x0': same, n the recorded blocks, and the seed, context noise and latents before the fork (recache) the
    replay writes and re-caches its cache with},
    and the state before the fork."""
    layout, fork = net.layout, routing['fork']
    span_end = fork + P * layout['block'] if span_end is None else span_end
    cache = streaming.KVCache(layout, keep=keep)
    prefix = []  # the clean blocks before the fork, shared by every branch
    for b in range(0, fork, layout['block']):
        prefix.append(denoise_block(net, context, cache, b, seed, shape, None, context_noise,
                                    prefix if recache else None))
    state, clips, traj = cache.save(), [], []
    for older in routing['older'] + [None]:  # the anchor: the plain model
        cache.restore(state)
        cache.route = None if older is None else router(fork, older, layout, m, P, keep, release_reads)
        rec, tail = [], []
        for b in range(fork, frames, layout['block']):
            tail.append(denoise_block(net, context, cache, b, seed, shape, rec if b < span_end else None,
                                      context_noise, prefix + tail if recache else None))
        clips.append(torch.cat(prefix + tail, 2))
        if older is not None:
            traj.append(rec)
    S, n = len(layout['timesteps']), (span_end - fork) // layout['block']
    x, x0 = (torch.stack([torch.cat([r[i] for r in rec]) for rec in traj]).unflatten(1, (n, S))
             for i in (0, 1))  # (K, n, S, C, f, h, w)
    clips = torch.cat(clips)
    past = clips[-1:, :, max(0, fork - (layout['window'] or fork)):fork] if recache else None  # what a re-cache reads
    return clips, dict(x=x, x0=x0, seed=seed, context_noise=context_noise, past=past), state


# ----------------------------------------------------------------------------- TVE, the branch's score
def _forward(net, x, s, context, cache, start, checkpoint):
    """forward_block; checkpoint: keep only its inputs for backward and recompute it there, from the cache
    as it was (a snapshot of references: the replay goes on writing to the cache meanwhile)."""
    if not (checkpoint and torch.is_grad_enabled()):
        return streaming.forward_block(net, x, s, context, cache, start)
    snap, layout, keep, route = cache.save(), cache.layout, cache.keep, cache.route

    def run(x):
        c = streaming.KVCache(layout, keep=keep)
        c.restore(snap)
        c.route = route
        return streaming.forward_block(net, x, s, context, c, start)
    return torch.utils.checkpoint.checkpoint(run, x, use_reentrant=False)


def tve(net, context, state, fork, x, x0, keep, grad_steps=2, form='x0', floor=1.0, checkpoint=False, route=None,
        context_noise=0.0, seed=0, past=None):
    """s = sum_{b,k} -mean((x0[b,k] - x0_net(x[b,k], t_k))^2) / (2 max(sigma_k, floor)^2) of one branch's
    trajectory x, x0 (n, S, C, f, h, w), replayed by `net` from the state before the fork, routing off;
    between blocks the cache takes net's own last x0 (detached), written as the rollout wrote (write_block:
    context_noise, seed); a new prompt segment's text keys replace the cache's as in the rollout (context:
    the text or the segments), and with past (the clean latents before the fork, (1, C, n, h, w)) the last
    window is re-cached from them and the replay's own x0s, as the rollout's; steps >= grad_steps run without grad.
    form 'velocity': -mean((v_branch - v_net)^2) / 2, v_branch = (x - x0) / sigma. checkpoint: activations
    recomputed in backward (a grad forward of the 1.3B model holds ~10-20 GiB: results/kvpo_memory.md).
    route: the branch's router (kvpo.router), the replay seeing the context the branch was made under (not
    released: an experiment, docs/kvpo.md section 3); None: routing off, as released."""
    layout, sig = net.layout, streaming.sigmas(net.layout)
    cache = streaming.KVCache(layout, keep=keep)
    cache.restore(state)  # references: the replay's writes replace, never touch, the rollout's tensors
    cache.route = route
    score, done = torch.zeros((), device=x.device), None if past is None else [past]  # clean frames so far
    for b in range(x.shape[0]):
        start = fork + b * layout['block']
        text, switch = segments.text_at(context, start)
        if switch:  # without grad, as the rollout's: the text keys (and a re-cache) carry no gradient
            segments.switch(net, cache, text, start, None if done is None else torch.cat(done, 2))
        for k, s in enumerate(sig):
            with torch.set_grad_enabled(torch.is_grad_enabled() and k < grad_steps):
                v = _forward(net, x[b, k][None], torch.full((1,), s, device=x.device), text, cache, start,
                             checkpoint).float()
            pred = x[b, k][None] - s * v  # (1, C, f, h, w)
            if form == 'x0':
                score = score - (x0[b, k][None] - pred).square().mean() / (2 * max(s, floor) ** 2)
            else:
                score = score - ((x[b, k] - x0[b, k])[None] / s - v).square().mean() / 2
        if b + 1 < x.shape[0]:
            with torch.no_grad():  # the block at timestep 0 joins the cache, as in the rollout
                write_block(net, pred.detach(), text, cache, start, seed, context_noise)
                done = None if done is None else done + [pred.detach()]
    return score


def scores(net, context, state, fork, traj, keep, grad_steps=2, form='x0', checkpoint=False, routes=None):
    """(K,) TVE of every branch under `net`; routes: each branch's router (tve's route), None: routing off."""
    return torch.stack([tve(net, context, state, fork, traj['x'][g], traj['x0'][g], keep, grad_steps, form,
                            checkpoint=checkpoint, route=None if routes is None else routes[g], **_written(traj))
                        for g in range(traj['x'].shape[0])])


def _written(traj):
    """How the rollout wrote its cache (write_block): the replay writes its own the same way."""
    return dict(context_noise=traj.get('context_noise', 0.0), seed=traj.get('seed', 0), past=traj.get('past'))


def backward(net, context, state, fork, traj, keep, objective, grad_steps=2, form='x0', scale=1.0, checkpoint=False,
             routes=None):
    """Backpropagate scale x objective(s) -> (loss, stats), s the branches' scores (K,) under net, into net's
    gradients holding one branch's replay graph at a time: dL/dtheta = sum_g dL/ds_g ds_g/dtheta, exactly
    (one more replay without grad: the scores first). Returns (loss, stats), the loss unscaled."""
    with torch.no_grad():
        s = scores(net, context, state, fork, traj, keep, 0, form, routes=routes)
    s.requires_grad_()
    total, stats = objective(s)
    (d,) = torch.autograd.grad(total * scale, s)  # (K,) dL/ds_g
    for g in range(len(s)):
        if d[g] != 0:  # a gated prompt (mechanism_1) costs no replay
            (d[g] * tve(net, context, state, fork, traj['x'][g], traj['x0'][g], keep, grad_steps, form,
                        checkpoint=checkpoint, route=None if routes is None else routes[g],
                        **_written(traj))).backward()
    return total.detach(), stats


# ----------------------------------------------------------------------------- advantages
def anchor_advantage(r, r_anchor):
    """(K,): (r_g - r_anchor) / (std(r_1..r_K, r_anchor) + 1e-8), Bessel's std as released."""
    return (r - r_anchor) / (torch.cat([r, r_anchor.view(1)]).std() + 1e-8)


def component_advantage(rewards, anchor, weights):
    """sum_c w_c anchor_advantage of each reward component: rewards {c: (K,)}, anchor {c: ()}."""
    return sum(w * anchor_advantage(rewards[c].float(), anchor[c].float()) for c, w in weights.items())


def fuse(a_local, a_global, w_local=1.0, w_global=0.5, clamp=2.5, normalise=True):
    """w_l A_l / std(A_l) + w_g A_g / std(A_g) (population std; no mean removed: the sign against the
    anchor stays; a std <= 1e-8 divides nothing), clamped to +-clamp. Either may be None (off).
    normalise=False (an experiment, not released): w_l A_l + w_g A_g, the second division left out."""
    out = 0
    for a, w in ((a_local, w_local), (a_global, w_global)):
        if a is not None:
            std = a.std(unbiased=False)
            out = out + w * (a if std <= 1e-8 or not normalise else a / (std + 1e-8))
    return out.clamp(-clamp, clamp)


def safe(signals):
    """A prompt is safe if any branch beats the anchor on any signal: signals [(r (K,), r_anchor ()), ...]."""
    return any(bool((r > a).any()) for r, a in signals)


# ----------------------------------------------------------------------------- the loss
def kl_simplex(logp, logp_ref):
    """KL(pi || pi_ref) on the K-simplex: sum_g pi_g (log(pi_g + 1e-10) - log pi_ref_g)."""
    p = logp.exp()
    return (p * (torch.log(p + 1e-10) - logp_ref)).sum()


def loss(s, s_old, s_init, adv, is_safe, clip=(0.9, 1.2), kl=10.0, gate='mechanism_2'):
    """The policy loss of one prompt from the branches' scores (K,) under the current, old and initial
    models; returns (loss, stats)."""
    logp, logp_old = F.log_softmax(s, 0), F.log_softmax(s_old.detach(), 0)
    ratio = torch.exp(torch.clamp(logp - logp_old, -20.0, 20.0))  # the clamp keeps exp finite
    surrogate = torch.minimum(ratio * adv, ratio.clamp(*clip) * adv)
    kl_term = kl_simplex(logp, F.log_softmax(s_init.detach(), 0))
    total = -surrogate.mean() + kl * kl_term
    if gate == 'mechanism_2':  # an anchor slot joins the softmax: logit 0 if unsafe, -inf (no mass) if safe
        anchor = torch.tensor(-math.inf if is_safe else 0.0)
        pi_anchor = F.softmax(torch.cat([logp, anchor.view(1)]), 0)[-1]  # 1/2 when unsafe: sum_g pi_g = 1
        total = (1 - pi_anchor) * total
    else:  # mechanism_1: an unsafe prompt contributes nothing (a step no rank finds safe is skipped)
        pi_anchor = torch.zeros(())
        total = total * float(is_safe)
    clipped = ((ratio - ratio.clamp(*clip)).abs() > 1e-6).float().mean()
    return total, dict(kl=kl_term.item(), ratio_max=ratio.max().item(), clip_frac=clipped.item(),
                       pi_anchor=pi_anchor.item(), entropy=-(logp.exp() * logp).sum().item())
