"""
Token-level credit (TVRL): route a clip's advantage to the latent tokens the frozen reward depends on.

    g        = dR/d video (B, F, 3, H, W),  R = w_vq VQ + w_mq MQ + w_ta TA   (score_and_grad below)
    m[t,i,j] = sum of |g| over the channels and pixels that latent token (t, i, j) decodes to:
               video frame f -> latent frame 0 if f == 0 else (f - 1) // T + 1 (causal VAE),
               pixel (y, x)  -> position (y // P, x // P)
    credit   = smooth(m) / mean(smooth(m)),  detached, mean 1 per clip
    logp     = sum_k credit_k logp_k / sum_k credit_k   (sde.log_prob; credit = 1 is GRPO's plain mean)
Geometry: HunyuanVideo 1.5's VAE T = 4, P = 16 (81 frames -> 21 latent frames); the toy's
space-to-depth T = 1, P = 4. Both are read off the shapes: T = (F - 1) / (Fl - 1), P = H / h.

Where this differs from TVRL and why:
- TVRL takes |dR/d pixel_values| on the vision tower's patch rows, undoes Qwen's merge packing
  [t, h/m, w/m, m, m] to a (T/2, H/14, W/14) grid and interpolates that onto latent tokens. We take
  dR/d video instead: by the chain rule it is the patch-row gradient pulled back through the exact
  transposes of patchify (the unpacking), the normalisation, the bicubic resize and the 2 fps frame
  sampling, so the packing and the resize are undone by autograd, not re-derived by hand, and the
  latent geometry is then exact pixel bookkeeping. One difference: |.| is taken after the pull-back,
  not per 14x14 patch (gradients that cancel across resize taps count less).
- Latent frames holding no frame the reward saw (VideoAlign sees 2 fps: 6 of 81 frames, so 6 of 21
  latent frames) still decode into the video between them; their map is linearly interpolated in
  latent-frame index from the seen ones (nearest at the ends), as TVRL interpolates frame importance.
- A clip whose gradient is all zero or non-finite gets credit 1 everywhere: plain GRPO for it.

Tested by: python -m pytest tests/test_credit.py   (a hot pixel and a hot VideoAlign patch land on
hand-computed latent tokens; interpolation, smoothing, normalisation)
"""
import torch
import torch.nn.functional as F

import reward
import sde
from models.videoalign import sample_indices

GRANULARITIES = ('window', 'frame')  # a weight per latent token, or one per latent frame
CHOICES = dict(credit_granularity=GRANULARITIES)  # train.py's setting that picks one of these


def geometry(num_frames, height, width, latent_shape):
    """(T, P): video frames per latent frame after the first, pixels per latent position side."""
    Fl, h, w = latent_shape[-3:]
    T = (num_frames - 1) // (Fl - 1) if Fl > 1 else 1
    P = height // h
    if (Fl - 1) * T + 1 != num_frames or h * P != height or w * P != width:
        raise ValueError(f'video (F={num_frames}, H={height}, W={width}) does not decode from latents '
                         f'(F={Fl}, h={h}, w={w}) by a causal 1 + T(F-1) frames, P x P pixels layout')
    return T, P


def latent_frame(f, T):
    """Latent frame of video frame(s) f under the causal VAE: frame 0 alone, then T frames each."""
    f = torch.as_tensor(f)
    return torch.where(f == 0, 0, (f - 1).div(T, rounding_mode='floor') + 1)


def pool(g, latent_shape):
    """|g| (B, F, 3, H, W) summed onto latent tokens -> (B, Fl, h, w), float32."""
    B, Fr, _, H, W = g.shape
    Fl, h, w = latent_shape[-3:]
    T, P = geometry(Fr, H, W, latent_shape)
    a = g.detach().float().abs().sum(2)  # (B, F, H, W)
    a = a.reshape(B, Fr, h, P, w, P).sum((3, 5))  # (B, F, h, w) each P x P block onto its position
    out = a.new_zeros(B, Fl, h, w)
    return out.index_add_(1, latent_frame(torch.arange(Fr), T).to(g.device), a)  # frames onto latent frames


def fill(m, seen):
    """m (B, Fl, h, w) with only the latent frames `seen` (sorted list) measured -> every latent frame:
    linear interpolation in latent-frame index between seen ones, nearest beyond the ends."""
    Fl = m.shape[1]
    if not seen:
        return m
    out = m.clone()
    for k in range(Fl):
        if k in seen:
            continue
        lo, hi = max((s for s in seen if s < k), default=None), min((s for s in seen if s > k), default=None)
        if lo is None or hi is None:
            out[:, k] = m[:, hi if lo is None else lo]
        else:
            a = (k - lo) / (hi - lo)
            out[:, k] = (1 - a) * m[:, lo] + a * m[:, hi]
    return out


def credit_map(g, latent_shape, seen=None, window=(1, 3, 3), granularity='window'):
    """The detached credit (B, 1, Fl, h, w), mean 1 per clip, broadcast over latent channels.

    g (B, F, 3, H, W): gradient of the combined reward w.r.t. the decoded video;
    seen: indices of the video frames the reward looked at (None: all of them);
    window (t, h, w): odd box sizes of the smoothing average over latent tokens ((1, 1, 1): none);
    granularity: 'window' (a weight per token) or 'frame' (the mean over each latent frame)."""
    if granularity not in GRANULARITIES:
        raise ValueError(f'credit granularity must be one of {GRANULARITIES}, got {granularity!r}')
    if any(k % 2 == 0 or k < 1 for k in window):
        raise ValueError(f'credit window sizes must be odd and positive, got {window}')
    B, Fr = g.shape[:2]
    T, _ = geometry(Fr, g.shape[3], g.shape[4], latent_shape)
    m = pool(g, latent_shape)  # (B, Fl, h, w)
    if seen is not None:
        m = fill(m, sorted(set(latent_frame(torch.as_tensor(seen), T).tolist())))
    if tuple(window) != (1, 1, 1):  # box average; at the edges, of the tokens that exist
        box = lambda a: F.conv3d(a[:, None], a.new_ones(1, 1, *window), padding=[k // 2 for k in window])[:, 0]
        m = box(m) / box(torch.ones_like(m[:1]))  # (B, Fl, h, w) window sums / window counts
    if granularity == 'frame':
        m = m.mean((2, 3), keepdim=True).expand_as(m)  # (B, Fl, h, w), constant per latent frame
    total = m.flatten(1).mean(1)  # (B,)
    ok = torch.isfinite(total) & (total > 0)
    w = torch.where(ok.view(B, 1, 1, 1), m / torch.where(ok, total, 1.0).view(B, 1, 1, 1), 1.0)
    return w[:, None].contiguous()  # (B, 1, Fl, h, w)


def score(reward_fn, frames, prompts, fps, weights, latent_shape, window, granularity):
    """train.py's scores of decoded clips frames (B, F, 3, H, W) with credit='tvrl': reward_fn's, and
    each clip's credit map (B, 1, F, h, w) from g = d composite / d frames. A reward that samples
    frames (VideoAlign at 2 fps: its sample_fps) sees some of them: the others are interpolated."""
    scores, g = score_and_grad(reward_fn, frames, prompts, fps, weights)  # g (B, F, 3, H, W)
    rate = getattr(reward_fn, 'sample_fps', None)
    seen = sample_indices(frames.shape[1], fps, rate) if rate else None  # VideoAlign's frames
    return dict(scores, credit=credit_map(g, latent_shape, seen, window, granularity))


def scorer(reward_fn, weights, latent_shape, window, granularity):
    """score() as a reward_fn(frames, prompts, fps): train.py's score_fn with credit='tvrl'."""
    def score_fn(frames, prompts, fps):
        return score(reward_fn, frames, prompts, fps, weights, latent_shape, window, granularity)
    return score_fn


def reweight(clips, credit, steps):
    """The rollout's log-probs of the trained steps in the credit-weighted mean (sde.log_prob), the
    reduction the update computes them in: the ratio is 1 at theta_old. Returns credit (n, 1, F, h,
    w) on the clips' device and each clip's largest credit (n,), for the log."""
    credit = credit.to(clips['xs'].device)
    for t in steps:
        clips['logps'][:, t] = sde.log_prob(clips['xs'][:, t + 1], clips['means'][:, t],
                                            clips['stds'][:, t], credit)
    return credit, credit.flatten(1).amax(1)


def score_and_grad(reward_fn, frames, prompts, fps, weights):
    """Scores (as reward_fn) and g = d combine(scores, weights) / d frames (B, F, 3, H, W) float32,
    the gradient of each clip's composite w.r.t. its own pixels, the reward's parameters held fixed
    (they never receive gradients: VideoAlign's are frozen, the toy has none). VideoAlign
    differentiates through its torch preprocessing (resize, patchify; 8-bit rounding
    straight-through). A clip whose score is NaN gets g = 0. One backward of the sum: clips do not
    interact in the reward."""
    x = frames.detach().float().requires_grad_(True)
    with torch.enable_grad():
        scores = getattr(reward_fn, "score", reward_fn)(x, prompts, fps)
        r = reward.combine(scores, weights)  # (B,)
        ok = torch.isfinite(r.detach())
        if ok.any():
            torch.where(ok.to(r.device), r, 0.0).sum().backward()
    g = x.grad if x.grad is not None else torch.zeros_like(x)
    g = torch.where(torch.isfinite(g), g, 0.0)  # (B, F, 3, H, W)
    return {k: v.detach() for k, v in scores.items()}, g
