"""
The toy world: nanoGPT's shakespeare_char for text-to-video RL. Everything the real pipeline has,
small enough that SAGE-GRPO runs end to end on a 2-core CPU in minutes, with rewards whose meaning
is exact because the world is rendered, not filmed.

    python -m models.toy            # pretrain the base model into assets/toy (21 min on a busy 2-core CPU), evaluate it
    python -m models.toy wide       # the same recipe at twice the width into assets/toy_wide (not committed; ~40 min)
    python -m models.toy eval       # evaluate the committed base model (the README's numbers)
    python -m pytest tests/test_toy.py

On a CPU shared with other jobs, torch.set_num_threads(1) is much faster than 2 threads fighting for
the cores (the reward of 64 clips: 0.07 s on one thread, 1 s on two oversubscribed ones).

- world: 9 frames of 24x24 pixels at 8 fps. One shape (circle, square, triangle, cross) of one colour
  (red, green, blue, yellow) on a grey background moves left, right, up or down at a constant speed of
  0.75-1.5 px/frame from a random start; the caption "a red circle moving left" is the prompt.
  Rendered exactly and anti-aliased (coverage of a 1-px ramp of a signed distance), deterministic in a seed.
- text encoder: a fixed random word-embedding table (assets/toy/text_embeddings.safetensors) over the
  15-word vocabulary plus a <bos> token every prompt starts with, so the empty prompt "" (classifier-free
  guidance) still has one valid token (an all-masked prompt makes the token refiner's pooling 0/0 = NaN).
  The ByT5 branch gets what HunyuanVideo15Pipeline gives a prompt without quoted text: zeros, all masked.
- autoencoder: exact and parameter-free: space-to-depth by 4 of LATENT_SCALE * (2 * frames - 1), giving
  latents (48, 9, 6, 6); decode inverts it and clamps to [0, 1].
- base model: the real diffusers HunyuanVideo15Transformer3DModel with a tiny config (324 tokens a clip),
  pretrained with rectified-flow matching on freshly rendered clips whose captions are deliberately
  wrong a quarter of the time (colour or direction), so the base model is measurably misaligned.
- reward: VQ, MQ, TA in [0, 1] from an exact fit of the clean-render manifold to every frame (see
  reward()); clean renders score exactly 1 on each, pure noise about 0.
- prompts: 64 captions; 16 held out (one direction per colour and shape) for evaluation, 48 to train on.
  Pretraining sees all 64 (it is the "internet"); the split is for the RL stage.

Where the toy differs from the real model: the ByT5 projection (context_embedder_2, 4.4M of the model's
5.3M parameters, hard-coded 2048 wide) only ever sees zeros whose outputs the transformer masks and
zeroes, so it is dead weight: it is zeroed and frozen, and stored in float8 (exact for zeros) to keep
assets/toy under 10 MB; every other weight is stored in float32, and from_pretrained loads all as float32.
"""
import math
import os
import random
import sys
import time

import torch
import torch.nn.functional as F

from models import hunyuan15  # the toy's transformer is a tiny HunyuanVideo 1.5 one: its loading and forward
from models import policy

# ----------------------------------------------------------------------------- settings
DIR = 'assets/toy'              # committed base model directory (transformer/, text table, prompts)
FRAMES = 9                      # frames per clip
HEIGHT = 24                     # frame height in pixels
WIDTH = 24                      # frame width in pixels
FPS = 8                         # frame rate of the clips (9 frames: 1.1 s)
BACKGROUND = 0.5                # grey level of the plain background
COLOURS = {'red': (1., 0., 0.), 'green': (0., 1., 0.), 'blue': (0., 0., 1.), 'yellow': (1., 1., 0.)}
SHAPES = ('circle', 'square', 'triangle', 'cross')  # all of area ~45-50 px
DIRECTIONS = {'left': (-1., 0.), 'right': (1., 0.), 'up': (0., -1.), 'down': (0., 1.)}  # image y points down
SPEED = (0.75, 1.5)             # px/frame, uniform per clip
MARGIN = 6.0                    # centres stay this far from the border (the triangle's apex is 6 px up)
PATCH = 4                       # autoencoder space-to-depth factor
LATENT_SCALE = 3.0              # latents = LATENT_SCALE * (2x - 1): std ~0.9 on clips (a VAE's unit-ish)
LATENT_SHAPE = (3 * PATCH * PATCH, FRAMES, HEIGHT // PATCH, WIDTH // PATCH)  # (C, F, h, w) = (48, 9, 6, 6)
VOCAB = ('<bos>', 'a', 'moving') + tuple(COLOURS) + SHAPES + tuple(DIRECTIONS)  # token ids = positions
TEXT_LEN = 6                    # <bos> + the five caption words
TEXT_DIM = 32                   # word-embedding width (= text_embed_dim)
TEXT_2_LEN = 1                  # ByT5 tokens (all masked; 256 in the pipeline, 1 is cheapest)
TEXT_2_DIM = 8                  # ByT5 width (= text_embed_2_dim)
# the base model (diffusers HunyuanVideo15Transformer3DModel kwargs); rope axes sum to the head dim
CONFIG = dict(in_channels=2 * LATENT_SHAPE[0] + 1, out_channels=LATENT_SHAPE[0], num_attention_heads=3,
              attention_head_dim=32, num_layers=2, num_refiner_layers=1, mlp_ratio=4.0, patch_size=1,
              patch_size_t=1, text_embed_dim=TEXT_DIM, text_embed_2_dim=TEXT_2_DIM, image_embed_dim=12,
              rope_axes_dim=(8, 12, 12), target_size=HEIGHT, task_type='t2v')
# the second scale (bench/trust_region_wide.py): twice the width (6 heads of 32: 192), everything else the same
WIDE_DIR = 'assets/toy_wide'
WIDE = dict(num_attention_heads=6)
BUILT_DIRS = {WIDE_DIR: 'python -m models.toy wide'}  # models.family names the command when one is missing
# pretraining (python -m models.toy)
SEED = 1337                     # seeds the text table, the model init and the data stream
STEPS = 4000                    # optimizer steps
BATCH = 16                      # clips per step
LR = 1e-3                       # AdamW peak learning rate (100 warm-up steps, cosine to 10%)
EMA = 0.995                     # decay of the weight average that is saved (~200 steps)
THREADS = 1                     # CPU threads: one is reproducible anywhere and holds up on a busy machine
TRAIN_SHIFT = 2.0               # shift of the logit-normal training sigmas (as the sampling schedule's)
WRONG = 0.25                    # fraction of captions naming a wrong colour (half) or direction (half)
DROP = 0.1                      # fraction of captions replaced by "" (unconditional, for CFG)
# evaluation of the base model (python -m models.toy eval): ODE samples of the held-out prompts
EVAL_SEEDS = 4                  # samples per held-out prompt
EVAL_STEPS = 16                 # Euler steps
EVAL_SHIFT = 3.0                # sigma-schedule shift
EVAL_CFG = 3.0                  # classifier-free guidance scale
# reward: every term is exp(-max(0, err - tol) / tau), so exactly 1 on clean renders and graded
VQ_TOL, VQ_TAU = 0.005, 0.05    # per-frame RMS distance (pixels in [0, 1]) to the best clean render
MOTION_TOL, MOTION_TAU = 0.05, 0.5  # RMS deviation (px) of the centres from a constant-velocity line
SHAPE_TOL, SHAPE_TAU = 0.005, 0.02  # extra RMS distance when one shape must explain every frame
FIT_ITERS = 2                   # Gauss-Newton refinements of each frame's shape position
V_MIN = 0.6                     # px/frame along the prompt's direction that counts as moving that way

_U = torch.tensor(list(COLOURS.values())) - BACKGROUND  # (4, 3) colour offsets from the background
_U2 = 0.75                      # |colour - background|^2, the same for every colour


# ----------------------------------------------------------------------------- world

def parse(prompt):
    """'a red circle moving left' -> (colour, shape, direction) indices."""
    w = prompt.split()
    if len(w) != 5 or w[0] != 'a' or w[3] != 'moving':
        raise ValueError(f'not a toy prompt: {prompt!r}')
    return list(COLOURS).index(w[1]), SHAPES.index(w[2]), list(DIRECTIONS).index(w[4])


def caption(colour, shape, direction):
    return f'a {list(COLOURS)[colour]} {SHAPES[shape]} moving {list(DIRECTIONS)[direction]}'


def all_prompts():
    return [caption(c, s, d) for c in range(4) for s in range(4) for d in range(4)]


def is_eval_prompt(prompt):
    # held out: one direction per (colour, shape), a Latin square, so each (colour, direction) and
    # (shape, direction) pair is held out exactly once; 16 eval prompts, 48 train prompts
    c, s, d = parse(prompt)
    return d == (c + s) % 4


def _sdf(j, x, y):
    # signed distance (px, negative inside) of shape j centred at the origin; x, y broadcast
    if j == 0:  # circle of radius 4
        return torch.sqrt(x * x + y * y) - 4.0
    if j == 1:  # square of side 7
        return torch.maximum(x.abs(), y.abs()) - 3.5
    if j == 2:  # equilateral triangle pointing up, inradius 3 (apex 6 px above the centroid)
        return torch.maximum(y, 0.5 * math.sqrt(3) * x.abs() - 0.5 * y) - 3.0
    ax, ay = x.abs(), y.abs()  # plus sign: arms 9 px long, 3 px wide
    return torch.minimum(torch.maximum(ax - 4.5, ay - 1.5), torch.maximum(ax - 1.5, ay - 4.5))


def coverage(cx, cy):
    """Anti-aliased coverage of all four shapes: centres cx, cy (..., 4) in px -> (..., 4, H, W)."""
    x = torch.arange(WIDTH) + 0.5 - cx[..., None, None]  # (..., 4, 1, W) pixel centres
    y = torch.arange(HEIGHT)[:, None] + 0.5 - cy[..., None, None]  # (..., 4, H, 1)
    sdf = torch.stack([_sdf(j, x[..., j, :, :], y[..., j, :, :]) for j in range(4)], -3)
    return (0.5 - sdf).clamp(0, 1)  # a 1-px linear ramp across the edge


def trajectory(direction, u):
    """Centres (B, F, 2) of clips: direction (B,) ids, u (B, 3) uniforms in [0, 1): speed,
    start on the motion axis, position on the other axis."""
    d = torch.tensor(list(DIRECTIONS.values()))[direction]  # (B, 2) unit step
    speed = SPEED[0] + (SPEED[1] - SPEED[0]) * u[:, 0]  # (B,) px/frame
    travel = (FRAMES - 1) * speed  # (B,)
    free = WIDTH - 2 * MARGIN - travel  # (B,) room left on the motion axis (square frames)
    along = MARGIN + free * u[:, 1] + travel * (d.sum(1) < 0)  # (B,) start coordinate on the motion axis
    across = MARGIN + (WIDTH - 2 * MARGIN) * u[:, 2]  # (B,) the other coordinate
    start = torch.where(d[:, :1] != 0, torch.stack([along, across], 1), torch.stack([across, along], 1))
    t = torch.arange(FRAMES, dtype=torch.float32)[None, :, None]  # (1, F, 1)
    return start[:, None] + t * speed[:, None, None] * d[:, None]  # (B, F, 2)


def paint(colour, shape, centres):
    """Frames (B, F, 3, H, W) in [0, 1]: colour, shape (B,) ids, centres (B, F, 2)."""
    cov = coverage(centres[..., :1].expand(-1, -1, 4), centres[..., 1:].expand(-1, -1, 4))  # (B, F, 4, H, W)
    alpha = cov[torch.arange(len(shape)), :, shape]  # (B, F, H, W)
    return BACKGROUND + alpha[:, :, None] * _U[colour][:, None, :, None, None]


def render(prompt, seed):
    """The clean clip (F, 3, H, W) of a prompt; the seed sets speed and start (random.Random: stable)."""
    c, s, d = parse(prompt)
    rng = random.Random(seed)
    u = torch.tensor([[rng.random() for _ in range(3)]])  # (1, 3) speed, start, cross position
    return paint(torch.tensor([c]), torch.tensor([s]), trajectory(torch.tensor([d]), u))[0]


# ----------------------------------------------------------------------------- text encoder

_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository's root
_table = None  # (len(VOCAB), TEXT_DIM) word embeddings, loaded lazily from DIR


def make_table():
    # fixed random words (the token refiner learns what they mean); stored, not re-drawn, so the
    # committed model never depends on torch's random number stream
    return torch.randn(len(VOCAB), TEXT_DIM, generator=torch.Generator().manual_seed(SEED))


def tokenize(prompts):
    """ids (B, TEXT_LEN) and mask (B, TEXT_LEN), right-padded; every row starts with <bos>."""
    ids = torch.zeros(len(prompts), TEXT_LEN, dtype=torch.long)
    mask = torch.zeros(len(prompts), TEXT_LEN)
    for i, p in enumerate(prompts):
        words = ['<bos>'] + p.split()
        unknown = [w for w in words if w not in VOCAB]
        if unknown:
            raise ValueError(f'toy prompt {p!r}: {", ".join(map(repr, unknown))} not in the toy vocabulary '
                             f'({" ".join(VOCAB[1:])})')
        if len(words) > TEXT_LEN:
            raise ValueError(f'toy prompt {p!r} has {len(words) - 1} words, at most {TEXT_LEN - 1} fit')
        ids[i, :len(words)] = torch.tensor([VOCAB.index(w) for w in words])
        mask[i, :len(words)] = 1
    return ids, mask


def encode_prompts(prompts, table=None):
    """What HunyuanVideo15Pipeline.encode_prompt returns, in its order: embeds (B, L, TEXT_DIM),
    mask (B, L), embeds_2 (B, L2, TEXT_2_DIM), mask_2 (B, L2); masks float32 like the pipeline's."""
    global _table
    if table is None:
        if _table is None:
            from safetensors.torch import load_file
            _table = load_file(os.path.join(_HERE, DIR, 'text_embeddings.safetensors'))['embeddings']
        table = _table
    ids, mask = tokenize(prompts)
    embeds = table[ids] * mask[..., None]  # (B, L, D) padding rows are zero
    B = len(prompts)
    # no quoted text in a toy prompt: the pipeline gives ByT5 zeros and an all-zero mask
    return embeds, mask, torch.zeros(B, TEXT_2_LEN, TEXT_2_DIM), torch.zeros(B, TEXT_2_LEN)


# ----------------------------------------------------------------------------- autoencoder

def encode(frames):
    """frames (B, F, 3, H, W) in [0, 1] -> latents (B, C, F, h, w): space-to-depth, exact."""
    B, P, (C, Fr, h, w) = frames.shape[0], PATCH, LATENT_SHAPE
    x = LATENT_SCALE * (2 * frames - 1)  # grey background -> 0
    x = x.reshape(B, Fr, 3, h, P, w, P).permute(0, 2, 4, 6, 1, 3, 5)  # (B, 3, P, P, F, h, w)
    return x.reshape(B, C, Fr, h, w)


def decode(latents):
    """latents (B, C, F, h, w) -> frames (B, F, 3, H, W) clamped to [0, 1]."""
    B, P, (_, Fr, h, w) = latents.shape[0], PATCH, LATENT_SHAPE  # C = 3 * P * P
    x = latents.float().reshape(B, 3, P, P, Fr, h, w).permute(0, 4, 1, 5, 2, 6, 3)  # (B, F, 3, h, P, w, P)
    return ((x.reshape(B, Fr, 3, HEIGHT, WIDTH) / LATENT_SCALE + 1) / 2).clamp(0, 1)


# ----------------------------------------------------------------------------- reward

def fit(frames):
    """The best clean render of every frame, for each of the four shapes.
    frames (B, F, 3, H, W) -> mse (B, F, 4) to the fitted render, centres (B, F, 4, 2) px,
    colour direction (B, F, 3) (magnitude-weighted mean offset from the background),
    empty (B, F) the mse to the bare background (the frame's total deviation from it)."""
    B, Fr = frames.shape[:2]
    N, HW = B * Fr, HEIGHT * WIDTH
    d = frames.to(torch.promote_types(frames.dtype, torch.float32)).reshape(N, 3, HW) - BACKGROUND  # (N, 3, HW), float64 kept
    m = (d.square().sum(1, keepdim=True).sqrt() * d).sum(2)  # (N, 3) parallel to a clean frame's colour
    k = (F.normalize(m, dim=1) @ F.normalize(_U.to(m.dtype), dim=1).T).argmax(1)  # (N,) colour of the frame
    ud = (d * _U[k][:, :, None]).sum(1)  # (N, HW) projection on the colour: coverage * |u|^2 if clean
    alpha = (ud / _U2).clamp(0, 1)  # (N, HW)
    mass = alpha.sum(1).clamp(min=1e-6)  # (N,)
    cx = (alpha.view(N, HEIGHT, WIDTH).sum(1) * (torch.arange(WIDTH) + 0.5)).sum(1) / mass  # (N,) centroid
    cy = (alpha.view(N, HEIGHT, WIDTH).sum(2) * (torch.arange(HEIGHT) + 0.5)).sum(1) / mass
    cx, cy = cx[:, None].repeat(1, 4), cy[:, None].repeat(1, 4)  # (N, 4) start every shape there
    eps = 1e-2  # px, finite-difference step of the Jacobian
    for _ in range(FIT_ITERS):  # Gauss-Newton on sum (coverage - alpha)^2 over the centre (2 params)
        T = coverage(torch.stack([cx, cx + eps, cx]), torch.stack([cy, cy, cy + eps])).view(3, N, 4, HW)
        J = torch.stack([T[1] - T[0], T[2] - T[0]], 2) / eps  # (N, 4, 2, HW) d coverage / d centre
        JJ = J @ J.transpose(2, 3)  # (N, 4, 2, 2) normal matrix
        g = (J @ (alpha[:, None, :, None] - T[0, ..., None]))[..., 0]  # (N, 4, 2) J^T residual
        a, b, c = JJ[..., 0, 0], JJ[..., 0, 1], JJ[..., 1, 1]
        det = a * c - b * b + 1e-6  # the 2x2 system solved in closed form
        cx = cx + ((c * g[..., 0] - b * g[..., 1]) / det).clamp(-2, 2)  # a bounded step: far from the
        cy = cy + ((a * g[..., 1] - b * g[..., 0]) / det).clamp(-2, 2)  # shape the linearisation is poor
    T = coverage(cx, cy).view(N, 4, HW)
    # |d - T u|^2 summed over pixels and channels, expanded so no (N, 4, 3, HW) tensor is built
    sq = (d * d).sum((1, 2))[:, None] - 2 * (T @ ud[:, :, None])[..., 0] + _U2 * (T * T).sum(2)  # (N, 4)
    mse = (sq / (3 * HW)).clamp(min=0)
    empty = (d * d).sum((1, 2)) / (3 * HW)  # (N,)
    return mse.view(B, Fr, 4), torch.stack([cx, cy], -1).view(B, Fr, 4, 2), m.view(B, Fr, 3), empty.view(B, Fr)


def manifold_distance(frames):
    """(B,) mean over frames of the RMS distance (pixel units, [0, 1]) to the nearest clean render."""
    mse = fit(frames)[0]  # (B, F, 4)
    return mse.min(-1).values.sqrt().mean(1)


def _soft(err, tol, tau):
    return torch.exp(-(err - tol).clamp(min=0) / tau)  # 1 up to tol, then decays smoothly


def reward(frames, prompts, fps=FPS):
    """frames (B, F, 3, H, W) in [0, 1] -> dict of (B,) float32 in [0, 1] (Overall in [0, 3]):
    VQ  mean over frames of soft(RMS distance to the frame's best clean render): on-manifold quality
    MQ  mean of soft(deviation of the centres from constant velocity) and soft(extra distance when
        one shape must explain every frame), times the share of the clip the moving object explains
        (no object, e.g. pure noise, has no motion quality): smooth motion, stable shape
    TA  mean of the colour, shape and direction matches (graded margins, 1 = unambiguous match)
    fps is unused: speeds are measured in px/frame."""
    B, Fr = frames.shape[:2]
    mse, centres, m, empty = fit(frames)  # (B, F, 4), (B, F, 4, 2), (B, F, 3), (B, F)
    best = mse.min(-1).values  # (B, F) per-frame best shape
    vq = _soft(best.sqrt(), VQ_TOL, VQ_TAU).mean(1)  # (B,)
    R = mse.mean(1)  # (B, 4) how well each shape explains the whole clip
    j = R.argmin(1)  # (B,) the clip's shape
    p = centres[torch.arange(B), :, j]  # (B, F, 2) its centres
    t = torch.arange(Fr, dtype=torch.float32) - (Fr - 1) / 2  # (F,) centred frame index
    vel = (t[None, :, None] * p).sum(1) / t.square().sum()  # (B, 2) least-squares px/frame
    line = p.mean(1, keepdim=True) + t[None, :, None] * vel[:, None]  # (B, F, 2)
    wobble = (p - line).square().sum(-1).mean(1).sqrt()  # (B,) RMS px off the straight line
    gap = R.min(1).values.sqrt() - best.mean(1).sqrt()  # (B,) >= 0: cost of one shape for all frames
    explained = 1 - best.sum(1) / empty.sum(1).clamp(min=1e-8)  # (B,) 1 for a clean clip, ~0 for noise
    presence = (explained / 0.9).clamp(0, 1)  # explaining 90% of the deviation counts as a clear object
    mq = presence * 0.5 * (_soft(wobble, MOTION_TOL, MOTION_TAU) + _soft(gap, SHAPE_TOL, SHAPE_TAU))
    target = torch.tensor([parse(q) for q in prompts])  # (B, 3) colour, shape, direction ids
    # colour: cosine of the clip's mean colour with the prompt's minus the best other one; clean
    # renders have margin 1 - 1/3 (yellow vs red, the closest pair), scaled so that counts as 1
    cos = F.normalize(m.sum(1), dim=1) @ F.normalize(_U.to(m.dtype), dim=1).T  # (B, 4)
    own = cos.gather(1, target[:, :1])[:, 0]
    colour = ((own - cos.scatter(1, target[:, :1], -2).max(1).values) / 0.6).clamp(0, 1)
    # shape: relative margin of the prompt's shape over the best other one in explaining the clip
    r_own = R.gather(1, target[:, 1:2])[:, 0]
    r_other = R.scatter(1, target[:, 1:2], float('inf')).min(1).values
    shape = ((r_other - r_own) / (r_other + r_own + 1e-8) / 0.9).clamp(0, 1)
    # direction: speed along the prompt's direction minus speed across it, V_MIN of it counts as 1
    e = torch.tensor(list(DIRECTIONS.values()))[target[:, 2]]  # (B, 2)
    along = (vel * e).sum(1)
    across = (vel[:, 0] * e[:, 1] - vel[:, 1] * e[:, 0]).abs()
    direction = ((along - across) / V_MIN).clamp(0, 1)
    ta = (colour + shape + direction) / 3
    return {'VQ': vq, 'MQ': mq, 'TA': ta, 'Overall': vq + mq + ta,
            'colour': colour, 'shape': shape, 'direction': direction}


# ----------------------------------------------------------------------------- base model

def build_model(**overrides):
    """A randomly initialised base model (seeded), its dead ByT5 branch zeroed and frozen."""
    from diffusers import HunyuanVideo15Transformer3DModel
    torch.manual_seed(SEED)
    net = HunyuanVideo15Transformer3DModel(**dict(CONFIG, **overrides))
    for name, p in net.context_embedder_2.named_parameters():
        # its input is always zeros and its output is masked and zeroed by the transformer:
        # zero weights change nothing, save optimizer work, and compress to nothing in git
        if not name.startswith('norm'):
            p.data.zero_()
        p.requires_grad_(False)
    return net


def load_model(path=DIR):
    """The committed base model through the loader train.py uses (float32, also the float8 branch)."""
    from diffusers import HunyuanVideo15Transformer3DModel
    return HunyuanVideo15Transformer3DModel.from_pretrained(os.path.join(path, 'transformer'),
                                                            torch_dtype=torch.float32).eval()


def data(gen, n):
    """n random clean clips (n, F, 3, H, W) and their imperfect captions: a quarter name a wrong
    colour or a wrong direction (never both), a tenth are dropped to "" for classifier-free guidance."""
    colour, shape, direction = torch.randint(4, (3, n), generator=gen)
    frames = paint(colour, shape, trajectory(direction, torch.rand(n, 3, generator=gen)))
    r, off = torch.rand(n, generator=gen), torch.randint(1, 4, (n,), generator=gen)  # off: another value
    colour = torch.where(r < WRONG / 2, (colour + off) % 4, colour)
    direction = torch.where((r >= WRONG / 2) & (r < WRONG), (direction + off) % 4, direction)
    drop = torch.rand(n, generator=gen) < DROP
    return frames, ['' if drop[i] else caption(colour[i], shape[i], direction[i]) for i in range(n)]


def pretrain(path=DIR, **overrides):
    """Rectified-flow matching: x_s = (1 - s) x0 + s noise, the model predicts v = noise - x0.
    overrides: CONFIG's (the second scale's WIDE); a new directory gets the toy's model_index.json."""
    import shutil
    from safetensors.torch import save_file
    velocity = policy.velocity  # the same guided forward train.py uses
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(THREADS)  # a fixed count: float sums, hence the weights, depend on it
    out = os.path.join(_HERE, path)
    os.makedirs(out, exist_ok=True)
    if out != os.path.join(_HERE, DIR):
        shutil.copy(os.path.join(_HERE, DIR, 'model_index.json'), out)
    for name, keep in (('train_prompts.txt', False), ('eval_prompts.txt', True)):
        with open(os.path.join(out, name), 'w') as f:
            f.writelines(p + '\n' for p in all_prompts() if is_eval_prompt(p) == keep)
    table = make_table()  # (V, TEXT_DIM)
    save_file({'embeddings': table}, os.path.join(out, 'text_embeddings.safetensors'))
    net = build_model(**overrides).train()
    ema = build_model(**overrides).eval().requires_grad_(False)
    ema.load_state_dict(net.state_dict())
    params = [p for p in net.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.99), weight_decay=0.0)
    gen = torch.Generator().manual_seed(SEED)
    log, t0, smooth = open(os.path.join(out, 'pretrain.log'), 'w'), time.time(), None
    for step in range(STEPS):
        lr = LR * min(1, (step + 1) / 100) * (0.55 + 0.45 * math.cos(math.pi * step / STEPS))  # to 10%
        for g in opt.param_groups:
            g['lr'] = lr
        frames, captions = data(gen, BATCH)
        x0 = encode(frames)  # (B, C, F, h, w)
        # (B,) logit-normal sigmas, shifted like the sampler's schedule: a clip's layout and motion
        # are decided at high noise, so train there more
        s = torch.sigmoid(torch.randn(BATCH, generator=gen))
        s = TRAIN_SHIFT * s / (1 + (TRAIN_SHIFT - 1) * s)
        noise = torch.randn(x0.shape, generator=gen)
        sb = s.view(-1, 1, 1, 1, 1)
        v = velocity(net, (1 - sb) * x0 + sb * noise, s, encode_prompts(captions, table))
        loss = (v - (noise - x0)).square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        with torch.no_grad():  # the weight average is what gets saved
            decay = min(EMA, (1 + step) / (10 + step))
            for pe, p in zip(ema.parameters(), net.parameters()):
                pe.lerp_(p, 1 - decay)
        smooth = loss.item() if smooth is None else 0.98 * smooth + 0.02 * loss.item()
        if step % 100 == 0 or step == STEPS - 1:
            line = f'step {step:5d}  loss {loss.item():.4f}  smoothed {smooth:.4f}  lr {lr:.2e}  {time.time() - t0:6.0f}s'
            print(line, flush=True)
            log.write(line + '\n')
            log.flush()
    line = f'done: {STEPS} steps of {BATCH} clips in {time.time() - t0:.0f}s, final smoothed loss {smooth:.4f}'
    print(line)
    log.write(line + '\n')
    log.close()
    # the dead ByT5 branch is all zeros, which float8 stores exactly in a quarter of the space (17 MB
    # of float32 -> 4 MB); from_pretrained casts every tensor back to float32
    ema.context_embedder_2.to(torch.float8_e4m3fn)
    ema.save_pretrained(os.path.join(out, 'transformer'))
    return net


@torch.no_grad()
def sample(net, prompts, seeds, steps=EVAL_STEPS, shift=EVAL_SHIFT, cfg=EVAL_CFG):
    """ODE (Euler) samples of the prompts, one noise seed each -> frames (B, F, 3, H, W)."""
    import sde
    velocity = policy.velocity
    text, neg = encode_prompts(prompts), encode_prompts([''] * len(prompts))
    x = torch.stack([torch.randn(LATENT_SHAPE, generator=torch.Generator().manual_seed(s)) for s in seeds])
    sig = sde.sigmas(steps, shift)  # (steps + 1,) 1 .. 0
    for i in range(steps):
        v = velocity(net, x, sig[i].expand(len(x)), text, cfg, neg)
        x = sde.step(x, v, sig[i].item(), sig[i + 1].item(), 'ode', 0.0)[0]
    return decode(x)


def evaluate(net, steps=EVAL_STEPS, shift=EVAL_SHIFT, cfg=EVAL_CFG, seeds=EVAL_SEEDS, split='eval'):
    """Mean rewards of ODE samples of the held-out (or train) prompts, `seeds` samples each; the
    noise seed of a sample is its index, so the numbers are reproducible."""
    prompts = [p for p in all_prompts() if is_eval_prompt(p) == (split == 'eval')]
    prompts = [p for p in prompts for _ in range(seeds)]
    frames = torch.cat([sample(net, prompts[i:i + 32], range(i, i + len(prompts[i:i + 32])), steps, shift, cfg)
                        for i in range(0, len(prompts), 32)])
    return summary(frames, prompts)


def summary(frames, prompts):
    """Mean of every reward key, the Setting-B composite, the manifold distance and the fraction of
    clips whose colour and direction are both (mostly) right."""
    r = reward(frames, prompts)
    out = {k: v.mean().item() for k, v in r.items()}
    out['composite'] = (0.5 * r['VQ'] + 0.5 * r['MQ'] + r['TA']).mean().item()  # Setting B weights
    out['manifold'] = manifold_distance(frames).mean().item()
    out['colour+direction right'] = ((r['colour'] > 0.5) & (r['direction'] > 0.5)).float().mean().item()
    return out


# ----------------------------------------------------------------------------- the model interface
# (models/__init__.py): assets/toy/model_index.json names this file ('ToyWorld'), so
# --model=assets/toy runs the toy world through the same train.py and sample.py as the real models
PIPELINE = 'ToyWorld'
TRANSFORMER = hunyuan15.TRANSFORMER
HUB_ID = None  # committed in assets/toy: nothing to download
DEFAULTS = dict(sample_steps=10, shift=3.0, cfg=1.0, fps=FPS, negative_prompt='', num_frames=FRAMES, height=HEIGHT, width=WIDTH,
                sample_prompts=16, sample_seeds=2)  # sample.py: every colour x direction held out, 2 seeds
LORA_TARGETS = hunyuan15.LORA_TARGETS
blocks, forward, cp_plan = hunyuan15.blocks, hunyuan15.forward, hunyuan15.cp_plan


def load_transformer(path, meta=False, **kw):
    net = hunyuan15.load_transformer(path, meta=meta, **kw)
    net.context_embedder_2.requires_grad_(False)  # sees only masked zeros: its gradient is exactly 0
    return net


def text_encoder(path, device):
    from safetensors.torch import load_file
    table = load_file(os.path.join(path, 'text_embeddings.safetensors'))['embeddings']

    def encode(prompts):
        try:
            return encode_prompts(prompts, table)
        except ValueError as e:  # a word the text table has no row for: one line, no traceback
            raise SystemExit(str(e))
    return encode


def load_decoder(path, device):
    return decode


def latent_shape(path, num_frames, height, width):
    return LATENT_SHAPE  # the toy's clip size is fixed


if __name__ == '__main__':
    wide = 'wide' in sys.argv[1:]
    path = WIDE_DIR if wide else DIR
    if 'eval' not in sys.argv[1:]:
        pretrain(path, **(WIDE if wide else {}))
    print({k: round(v, 4) for k, v in evaluate(load_model(path)).items()})
