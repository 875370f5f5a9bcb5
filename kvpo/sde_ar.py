"""
The SDE on a streaming (block-causal) generator: the exploration of GRPO with noise injected in the
few-step sampler, the baseline KVPO's abstract sets itself against. Each block is denoised from the KV
cache with the project's SDE step (sde.step: SAGE by default) over the layout's sigmas and a terminal 0,
at the steps in `steps` (ODE steps elsewhere), then written to the cache at timestep 0; in four lines:

    x_{k+1} = mean_theta(x_k, s_k -> s_{k+1} | cached clean frames of its window) + std_k z,  z ~ N(0, I)
    log p_k = mean over the clip's elements of log N(x_{k+1}; mean_theta, std_k^2)   (sde.log_prob)
    recompute: one masked forward per step over [the clean clip, every block at step k]
               (streaming.teacher_mask: a noisy block sees the clean frames of its window and itself,
               what the rollout's cache held), so log p_k is a function of theta, context included

With `steps` empty the rollout is streaming.generate's ODE ('ode' re-noising) up to float rounding. A
clip's step k is the transitions of all its blocks at step k (every block has the same s_k, s_{k+1},
std_k): its log-prob is the mean of the blocks' (equal sizes). Where this differs from a rollout from the
cache: the recompute's context keys are the current model's of the same clean frames (the gradient
flows through them, as teacher forcing trains the model), where the rollout read the old model's.
Tested by: python -m pytest tests/test_kvpo_sde.py
"""
import torch

import sde
import streaming
from kvpo import segments


def schedule(layout):
    """The layout's sigmas and the terminal 0 (S + 1,): the toy's 8 steps, 1.0 ... 0.3, 0."""
    return streaming.sigmas(layout) + [0.0]


@torch.no_grad()
def generate(net, noise, context, steps, kind, eta, gens, cache=None):
    """Latents (B, C, F, h, w) from initial noise (B, C, F, h, w), block by block from the KV cache, the
    SDE at `steps` (indices into schedule()); gens: one generator a clip, one z draw per block and step
    (drawn at ODE steps too: the stream stays aligned whatever `steps` is); cache: a KVCache to continue
    (noise's frames follow its newest); context: one text, or prompt segments [(first frame, text), ...] whose
    text keys replace the cache's at each switch. Returns (clip, record): record 'xs' (B, S + 1, C, F, h, w) the
    state before each step and the clean clip, 'logps' (B, S, n_blocks) each block's log-prob (0 at an
    ODE step), 'stds' (S,)."""
    layout, sig = net.layout, schedule(net.layout)
    cache = streaming.KVCache(layout) if cache is None else cache
    B, F, first = noise.shape[0], noise.shape[2], cache.end
    xs, logps, stds = [], [], [0.0] * (len(sig) - 1)
    for i in range(0, F, layout['block']):
        start, x = first + i, noise[:, :, i:i + layout['block']].float()  # (B, C, f, h, w)
        text, switch = segments.text_at(context, start)
        if switch:  # a new prompt segment: its text keys from here on
            segments.recache_text(net, cache, text)
        traj, lp = [x], []
        for k in range(len(sig) - 1):
            v = streaming.forward_block(net, x, torch.full((B,), sig[k], device=x.device), text, cache,
                                        start).float()
            z = torch.stack([torch.randn(x.shape[1:], generator=g) for g in gens]).to(x.device)
            st = sde.step(x, v, sig[k], sig[k + 1], kind if k in steps else 'ode', eta, noise=z)
            x, stds[k] = st.x_next, st.std[0].item()
            traj.append(x)
            lp.append(st.logp if st.logp is not None else x.new_zeros(B))
        streaming.forward_block(net, x, torch.zeros(B, device=x.device), text, cache, start,
                                write=True)  # the finished block, context_noise 0
        xs.append(torch.stack(traj, 1))  # (B, S + 1, C, f, h, w)
        logps.append(torch.stack(lp, 1))  # (B, S)
    xs = torch.cat(xs, 3)  # (B, S + 1, C, F, h, w)
    return xs[:, -1], dict(xs=xs, logps=torch.stack(logps, 2), stds=torch.tensor(stds))


def step_at(net, context, xs, k, kind, eta):
    """sde.Step of the clip's step k under net (mean differentiable in its weights): the transitions
    xs[:, k] -> xs[:, k + 1] (B, C, F, h, w) of every block, their velocity from one masked forward of
    [the clean clip xs[:, -1] at timestep 0, every block at s_k] (the module docstring); context: one text or
    prompt segments (each frame reads its segment's text: streaming.forward_masked)."""
    sig, x0, x = schedule(net.layout), xs[:, -1], xs[:, k]
    B, F = x.shape[0], x.shape[2]
    s = torch.cat([torch.zeros(B, F), torch.full((B, F), sig[k])], 1).to(x.device)  # (B, 2F)
    v = streaming.forward_masked(net, torch.cat([x0, x], 2), s, context, list(range(F)) * 2,
                                 streaming.teacher_mask(F, net.layout))[:, :, F:].float()  # (B, C, F, h, w)
    return sde.step(x, v, sig[k], sig[k + 1], kind, eta, x_next=xs[:, k + 1])
