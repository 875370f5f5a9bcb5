"""
The toy world told as a story across prompts (issue 69), and its teacher: a bidirectional toy of the streaming
family's architecture (the Wan toy of streaming/toy_ar.py, attention over the whole clip) that learns both the
base's clips and stories. KVPO's long setting has 4 prompt segments; here only the first names the object, so
its colour and shape must come from the history (the KV cache of a streaming student):

    segment 1 (frames 0-3):   "a red circle moving left"     segment 2 (4-7):   "it turns up"
    segment 3 (8-11):         "it turns right"               segment 4 (12-15): "it turns down"
    centre_t = centre_{t-1} + speed d_{segment(t)}   (one speed; every later segment turns: d_j != d_{j-1})

    python -m streaming.toy_story           # train the teacher into out-toy-story/teacher (checkpointed, resumes)
    python -m streaming.toy_story eval      # its held-out composite: the base's clips and the stories
    python -m streaming.toy_story publish   # the distilled student into assets/toy_story (the KVPO verdicts' model)
    python -m pytest tests/test_toy_story.py

The reward (story_reward) scores each segment against the whole story: segment j's frames, with the frame
before it (so a jump at the switch is a bend of the straight line MQ measures), under the caption of the story's
colour and shape and segment j's direction, by the toy's exact reward (models/toy.py); each component is the
mean over the 4 segments. A clean render scores 1 on every term.

The teacher sees one text per frame: a frame's tokens cross-attend to its own segment's text only (streaming's
cross-attention masked over the segments' texts side by side); one segment is the base's clip with its one
caption. A causal student's block reads the same text by the KV cache's text keys replaced at each switch
(generate_story: cache.text emptied, the next forward computes the new segment's), so the teacher's weights
run causally unchanged. Its data is the base's (models/toy.py data: a quarter of captions wrong, a tenth
empty) on alternate steps with stories (the first caption wrong as often; a tenth with every text empty, for
guidance). Its weights start from the teacher-forced streaming toy (assets/toy_ar), as Self-Forcing's start
from Wan's; two words ('it', 'turns') join the toy's text table, drawn from a seeded generator.
Results: results/toy_story.md (python -m bench.toy_story).
Tested by: python -m pytest tests/test_toy_story.py
"""
import copy
import math
import os
import random
import sys
import time

import torch
import torch.nn.functional as F

import sde
from models import family, toy
import streaming
from streaming import toy_ar
from streaming.wan_causal import CausalWanTransformer3DModel

# ----------------------------------------------------------------------------- settings
DIR = 'out-toy-story'           # where the teacher and the students train (teacher/, ode_init/, student/)
INIT = 'assets/toy_ar'          # the teacher's starting weights (the same Wan toy, teacher-forced causally;
                                # built by python -m streaming.toy_ar, 18 min: the student succeeded it in assets/)
SEGMENTS = 4                    # prompt segments a story (KVPO's long setting)
SEG_FRAMES = 4                  # latent frames a segment (the toy's autoencoder: a latent frame is a frame)
FRAMES = SEGMENTS * SEG_FRAMES  # 16 frames a story
SPEED = (0.75, 1.25)            # px/frame (the toy's 0.75-1.5, capped so every story fits the 12 px box)
WORDS = ('it', 'turns')         # the continuation prompt's words, added to the toy's vocabulary
VOCAB = toy.VOCAB + WORDS       # token ids = positions; the first rows are the toy's own table
TEXT_SEED = 69                  # seeds the new words' embedding rows
STUDENT = dict(block=1, sink=1, window=4, timesteps=(1000, 750, 500, 250), shift=5.0,
               renoise='fresh')  # the causal student's layout: the released 4-step sampler, toy_sf's scaling
SEED = 1337                     # data stream
STEPS = 3000                    # teacher optimizer steps (even: base clips, odd: stories)
CLIP_BATCH = 16                 # base clips a step
STORY_BATCH = 8                 # stories a step
LR = 5e-4                       # AdamW peak (50 warm-up steps, cosine to 10%): a fine-tune of toy_ar's weights
EMA = 0.995                     # decay of the saved weight average
SAVE_EVERY = 250                # steps between checkpoints (the run resumes from the newest)
SAMPLE_STEPS, SAMPLE_SHIFT = 10, 3.0  # the teacher's Euler sampler (sample.py's for the base)
EVAL_SEEDS = 4                  # samples per held-out prompt (story) in evaluate()


class ToyStoryTransformer(CausalWanTransformer3DModel):
    """The story toy's Wan: its own class so a model directory names its family."""


# ----------------------------------------------------------------------------- the story world

def continuation(direction):
    return f'it turns {list(toy.DIRECTIONS)[direction]}'


def parse_story(prompts):
    """[first caption, 'it turns ...' x 3] -> colour, shape, [direction of each segment]."""
    c, s, d = toy.parse(prompts[0])
    dirs = [d]
    for p in prompts[1:]:
        w = p.split()
        if len(w) != 3 or w[:2] != ['it', 'turns'] or w[2] not in toy.DIRECTIONS:
            raise ValueError(f'not a continuation: {p!r}')
        dirs.append(list(toy.DIRECTIONS).index(w[2]))
    return c, s, dirs


def turns(rng, first):
    """Directions of the 4 segments from the first: each later one differs from the one before (a turn)."""
    dirs = [first]
    for _ in range(SEGMENTS - 1):
        dirs.append(rng.choice([d for d in range(4) if d != dirs[-1]]))
    return dirs


def track(dirs, u):
    """Centres (F, 2) of a story: dirs its segments' direction ids, u 3 uniforms (speed, start x, start y).
    Consecutive directions differ, so one axis moves at most 7 steps: <= 8.75 px, inside the 12 px box."""
    step = torch.tensor(list(toy.DIRECTIONS.values()))[[dirs[t // SEG_FRAMES] for t in range(1, FRAMES)]]  # (F-1, 2)
    speed = SPEED[0] + (SPEED[1] - SPEED[0]) * u[0]
    off = torch.cat([torch.zeros(1, 2), torch.cumsum(speed * step, 0)])  # (F, 2) from the start
    lo, hi = toy.MARGIN - off.min(0).values, toy.WIDTH - toy.MARGIN - off.max(0).values  # the start's room
    return off + lo + (hi - lo) * torch.tensor([u[1], u[2]])


def render_story(prompts, seed):
    """The clean story (F, 3, H, W) of [caption, continuations]; the seed sets speed and start."""
    c, s, dirs = parse_story(prompts)
    rng = random.Random(seed)
    centres = track(dirs, [rng.random() for _ in range(3)])
    return toy.paint(torch.tensor([c]), torch.tensor([s]), centres[None])[0]


def story_of(caption, seed):
    """A story that opens with the toy caption: the turns drawn from the seed."""
    c, s, d = toy.parse(caption)
    return [caption] + [continuation(x) for x in turns(random.Random(seed), d)[1:]]


def stories(split, seeds=1):
    """Stories of the held-out ('eval') or train toy captions, `seeds` each (the turns seeded by caption and seed)."""
    caps = [p for p in toy.all_prompts() if toy.is_eval_prompt(p) == (split == 'eval')]
    return [story_of(p, 1000 * i + k) for i, p in enumerate(caps) for k in range(seeds)]


def story_data(gen, n):
    """n random clean stories (n, F, 3, H, W) and their texts (n lists of 4): the first caption wrong a quarter
    of the time (colour or first direction, as the base's data), a tenth of stories with every text empty."""
    colour, shape, first = torch.randint(4, (3, n), generator=gen)
    frames, texts = [], []
    for i in range(n):
        rng = random.Random(torch.randint(2 ** 31, (1,), generator=gen).item())
        dirs = turns(rng, first[i].item())
        frames.append(toy.paint(colour[i:i + 1], shape[i:i + 1], track(dirs, torch.rand(3, generator=gen))[None])[0])
        c, d = colour[i].item(), dirs[0]
        r, off = torch.rand(1, generator=gen).item(), torch.randint(1, 4, (1,), generator=gen).item()
        c, d = ((c + off) % 4, d) if r < toy.WRONG / 2 else (c, (d + off) % 4) if r < toy.WRONG else (c, d)
        texts.append([toy.caption(c, shape[i].item(), d)] + [continuation(x) for x in dirs[1:]])
    drop = torch.rand(n, generator=gen) < toy.DROP
    return torch.stack(frames), [[''] * SEGMENTS if drop[i] else t for i, t in enumerate(texts)]


def segment_frames(j):
    """Frames segment j is scored on: its own, and the one before it (j > 0): a straight line across the switch."""
    return slice(max(0, j * SEG_FRAMES - 1), (j + 1) * SEG_FRAMES)


def story_reward(frames, story_prompts):
    """frames (B, F, 3, H, W), story_prompts B lists of 4 -> {component: (B,)}, each the mean over the segments
    of the toy's reward of segment_frames(j) under caption(the story's colour and shape, segment j's direction),
    'composite' = 0.5 VQ + 0.5 MQ + TA, and 'segments' (B, 4) the composite of each segment."""
    parsed = [parse_story(p) for p in story_prompts]
    per = []
    for j in range(SEGMENTS):
        caps = [toy.caption(c, s, dirs[j]) for c, s, dirs in parsed]
        per.append(toy.reward(frames[:, segment_frames(j)], caps))
    out = {k: torch.stack([r[k] for r in per], 1).mean(1) for k in per[0]}
    seg = torch.stack([0.5 * r['VQ'] + 0.5 * r['MQ'] + r['TA'] for r in per], 1)  # (B, 4)
    out['composite'], out['segments'] = seg.mean(1), seg
    return out


# ----------------------------------------------------------------------------- text

def make_table():
    """(len(VOCAB), TEXT_DIM): the toy's committed word table, then the new words' rows (seeded)."""
    from safetensors.torch import load_file
    base = load_file(os.path.join(toy._HERE, toy.DIR, 'text_embeddings.safetensors'))['embeddings']
    return torch.cat([base, torch.randn(len(WORDS), toy.TEXT_DIM, generator=torch.Generator().manual_seed(TEXT_SEED))])


_table = None


def encode(prompts):
    """(B, TEXT_LEN, TEXT_DIM) word embeddings of prompts, zeros after the words: toy_ar.context's form."""
    global _table
    _table = make_table() if _table is None else _table
    out = torch.zeros(len(prompts), toy.TEXT_LEN, toy.TEXT_DIM)
    for i, p in enumerate(prompts):
        words = ['<bos>'] + p.split()
        if any(w not in VOCAB for w in words) or len(words) > toy.TEXT_LEN:
            raise ValueError(f'story prompt {p!r}: words outside {VOCAB[1:]} or more than {toy.TEXT_LEN - 1}')
        out[i, :len(words)] = _table[[VOCAB.index(w) for w in words]]
    return out


def encode_stories(texts):
    """(B, S, TEXT_LEN, TEXT_DIM): every segment's text of B stories (lists of S prompts)."""
    return torch.stack([encode(list(t)) for t in texts])


# ----------------------------------------------------------------------------- the model

def install(net, layout=STUDENT):
    """Streaming's processors (its cross-attention reads each frame's own segment's text, given ctx.text_mask)."""
    return streaming.install(net, layout)


def load(path, layout=STUDENT):
    """A ToyStoryTransformer (or toy_ar's weights) from path/transformer, float32, installed with layout."""
    net = ToyStoryTransformer.from_pretrained(os.path.join(path, 'transformer'), torch_dtype=torch.float32)
    return install(net.eval(), layout)


def forward_frames(net, x, s, texts, segs, positions=None, mask=None):
    """The velocity of frames x (B, C, N, h, w) at sigmas s (B, N), frame i reading the text of segment segs[i]
    of texts (B, S, L, D), attention by the frame mask (N, N) (None: every frame sees every frame, the teacher)."""
    n, S, L = x.shape[2], texts.shape[1], texts.shape[2]
    T = x.shape[3] * x.shape[4]  # tokens a frame (patch 1)
    positions = list(range(n)) if positions is None else positions
    mask = torch.ones(n, n, dtype=torch.bool) if mask is None else mask
    seg = torch.as_tensor(segs).repeat_interleave(T)  # (N T,) the segment of each token
    net.stream_ctx.text_mask = seg[:, None] == torch.arange(S).repeat_interleave(L)[None]  # (N T, S L)
    try:
        return streaming.forward_masked(net, x, s, texts.flatten(1, 2), positions, mask)
    finally:
        net.stream_ctx.text_mask = None


def segs_of(n):
    """The segment of each of n frames (a 9-frame base clip: one segment)."""
    return [min(t // SEG_FRAMES, SEGMENTS - 1) for t in range(n)] if n == FRAMES else [0] * n


@torch.no_grad()
def sample_teacher(net, noise, texts, steps=SAMPLE_STEPS, shift=SAMPLE_SHIFT, cfg=1.0, sigmas=None, record=None):
    """The teacher's Euler ODE from noise (B, C, F, h, w) under texts (B, S, L, D) (S = 1: one caption for every
    frame); cfg != 1: guided against the empty texts; sigmas: the grid (default sde.sigmas(steps, shift));
    record: a list that gets x at each grid point."""
    sig = [float(v) for v in (sde.sigmas(steps, shift) if sigmas is None else sigmas)]
    segs, B = segs_of(noise.shape[2]) if texts.shape[1] > 1 else [0] * noise.shape[2], len(noise)
    neg = encode([''] * B)[:, None].expand_as(texts)
    x = noise
    for i in range(len(sig) - 1):
        if record is not None:
            record.append(x)
        s = torch.full((B, x.shape[2]), sig[i])
        if cfg == 1.0:
            v = forward_frames(net, x, s, texts, segs)
        else:
            vv = forward_frames(net, torch.cat([x, x]), torch.cat([s, s]), torch.cat([texts, neg]), segs)
            v = vv[B:] + cfg * (vv[:B] - vv[B:])
        x = x + (sig[i + 1] - sig[i]) * v
    if record is not None:
        record.append(x)
    return x


@torch.no_grad()
def generate_story(net, noise, texts, gens=None):
    """A causal student's latents (B, C, F, h, w), block by block from its KV cache (streaming.generate), the
    text keys replaced at each segment's first frame: the cache's text emptied, the next forward computes them."""
    cache, out = streaming.KVCache(net.layout), []
    n = noise.shape[2] // texts.shape[1]  # frames a segment (one segment: the whole clip)
    for j in range(texts.shape[1]):
        cache.text = {}
        out.append(streaming.generate(net, noise[:, :, j * n:(j + 1) * n], texts[:, j], gens, cache=cache))
    return torch.cat(out, 2)


# ----------------------------------------------------------------------------- training the teacher

def flow_loss(net, frames, texts, gen):
    """Flow matching of a batch (B, F, 3, H, W) with texts (B lists of S), one sigma a clip (the base's)."""
    x0 = encode_frames(frames)  # (B, C, F, h, w)
    B, n = x0.shape[0], x0.shape[2]
    s = torch.sigmoid(torch.randn(B, generator=gen))
    s = toy.TRAIN_SHIFT * s / (1 + (toy.TRAIN_SHIFT - 1) * s)  # (B,) logit-normal, shifted as the base's
    eps = torch.randn(x0.shape, generator=gen)
    sb = s.view(-1, 1, 1, 1, 1)
    v = forward_frames(net, (1 - sb) * x0 + sb * eps, s[:, None].expand(B, n), encode_stories(texts), segs_of(n)
                       if len(texts[0]) > 1 else [0] * n)
    return (v - (eps - x0)).square().mean()


def save(net, out, name):
    """net (its weight average) into out/name/transformer by rename, the story text table beside it."""
    import shutil
    from safetensors.torch import save_file
    d = os.path.join(out, name)
    os.makedirs(d, exist_ok=True)
    net.save_pretrained(os.path.join(d, 'transformer.tmp'))
    shutil.rmtree(os.path.join(d, 'transformer'), ignore_errors=True)
    os.replace(os.path.join(d, 'transformer.tmp'), os.path.join(d, 'transformer'))
    save_file({'embeddings': make_table()}, os.path.join(d, 'text_embeddings.safetensors'))


def train(steps=STEPS, out=None):
    """The teacher, resuming from out/teacher_state.pt (weights, average, optimizer, step)."""
    torch.set_num_threads(1)
    out = out or os.path.join(toy._HERE, DIR)
    os.makedirs(out, exist_ok=True)
    state_path = os.path.join(out, 'teacher_state.pt')
    family(os.path.join(toy._HERE, INIT))  # an unbuilt INIT: the command that builds it
    net = ToyStoryTransformer.from_pretrained(os.path.join(toy._HERE, INIT, 'transformer'), torch_dtype=torch.float32)
    net = install(net.train())
    ema = copy.deepcopy(net).eval().requires_grad_(False)
    opt = torch.optim.AdamW(net.parameters(), lr=LR, betas=(0.9, 0.99), weight_decay=0.0)
    start = 0
    if os.path.exists(state_path):
        st = torch.load(state_path, weights_only=True)
        net.load_state_dict(st['net']), ema.load_state_dict(st['ema']), opt.load_state_dict(st['opt'])
        start = st['step']
    log, t0, smooth = open(os.path.join(out, 'teacher.log'), 'a'), time.time(), None
    for step in range(start, steps):
        gen = torch.Generator().manual_seed(SEED * 100_003 + step)  # a function of the step: resumes identically
        lr = LR * min(1, (step + 1) / 50) * (0.55 + 0.45 * math.cos(math.pi * step / steps))
        for g in opt.param_groups:
            g['lr'] = lr
        if step % 2 == 0:
            frames, caps = toy.data(gen, CLIP_BATCH)
            loss = flow_loss(net, frames, [[c] for c in caps], gen)
        else:
            loss = flow_loss(net, *story_data(gen, STORY_BATCH), gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        toy_ar.ema_update(ema, net, step, EMA)
        smooth = loss.item() if smooth is None else 0.98 * smooth + 0.02 * loss.item()
        if (step + 1) % SAVE_EVERY == 0 or step + 1 == steps:
            torch.save(dict(net=net.state_dict(), ema=ema.state_dict(), opt=opt.state_dict(), step=step + 1),
                       state_path + '.tmp')
            os.replace(state_path + '.tmp', state_path)
            save(ema, out, 'teacher')
            line = (f'step {step + 1:5d}  loss {loss.item():.4f}  smoothed {smooth:.4f}  lr {lr:.2e}  '
                    f'probe clips {probe(ema, "clips"):.4f} stories {probe(ema, "stories"):.4f}  {time.time() - t0:6.0f}s')
            print(line, flush=True)
            log.write(line + '\n')
            log.flush()
    log.close()


@torch.no_grad()
def probe(net, kind, n=16, cfg=1.0):
    """Held-out composite of n clips ('clips': the base's captions, 9 frames) or stories, one seed each."""
    if kind == 'clips':
        caps = [p for p in toy.all_prompts() if toy.is_eval_prompt(p)][:n]
        x = sample_teacher(net, _noise(n, toy.FRAMES), encode(caps)[:, None], cfg=cfg)
        return toy.summary(toy.decode(x), caps)['composite']
    st = stories('eval')[:n]
    x = sample_teacher(net, _noise(n, FRAMES), encode_stories(st), cfg=cfg)
    return story_reward(decode(x), st)['composite'].mean().item()


def _noise(n, frames, base=0):
    C, _, h, w = toy.LATENT_SHAPE
    return torch.stack([torch.randn(C, frames, h, w, generator=torch.Generator().manual_seed(base + i)) for i in range(n)])


def encode_frames(frames):
    """frames (B, F, 3, H, W) of any frame count -> latents (B, C, F, h, w): the toy's exact encoder, per 9 frames."""
    n = frames.shape[1]
    pad = (-n) % toy.FRAMES
    x = F.pad(frames, (0, 0, 0, 0, 0, 0, 0, pad), value=toy.BACKGROUND)
    return torch.cat([toy.encode(x[:, i:i + toy.FRAMES]) for i in range(0, n + pad, toy.FRAMES)], 2)[:, :, :n]


def decode(latents):
    """Latents (B, C, F, h, w) of any frame count -> frames (B, F, 3, H, W): the toy's exact decoder, per 9 frames."""
    n = latents.shape[2]
    pad = (-n) % toy.FRAMES
    x = F.pad(latents, (0, 0, 0, 0, 0, pad))
    return torch.cat([toy.decode(x[:, :, i:i + toy.FRAMES]) for i in range(0, n + pad, toy.FRAMES)], 1)[:, :n]


# ----------------------------------------------------------------------------- the model interface
PIPELINE = 'ToyWorldStory'
TRANSFORMER = 'ToyStoryTransformer'
HUB_ID = None  # committed in assets/toy_story (the distilled student of streaming/toy_story_sf.py)
DEFAULTS = dict(toy_ar.DEFAULTS, sample_steps=len(STUDENT['timesteps']), shift=STUDENT['shift'], cfg=1.0)
LORA_TARGETS = toy_ar.LORA_TARGETS
reward, manifold_distance = toy.reward, toy.manifold_distance
blocks, forward, generate, latent_shape, cp_plan, context = (toy_ar.blocks, toy_ar.forward, toy_ar.generate,
                                                             toy_ar.latent_shape, toy_ar.cp_plan, toy_ar.context)


def load_transformer(path, meta=False, attention=None, backend='native'):
    return toy_ar.load_transformer(path, meta, attention, backend, cls=ToyStoryTransformer, layout=STUDENT)


def text_encoder(path, device):
    """encode(prompts) -> [embeds (B, TEXT_LEN, TEXT_DIM)]: the toy's words and the story's ('it', 'turns')."""
    def enc(prompts):
        try:
            return [encode(prompts).to(device)]
        except ValueError as e:
            raise SystemExit(str(e))
    return enc


def load_decoder(path, device):
    return decode  # any frame count: a 16-frame story


def story_score(frames, stories, fps=toy.FPS):
    """kvpo's story reward (kvpo/segments.py score_video): {'VQ', 'MQ', 'TA': (B,)}, each segment scored against
    the whole story (story_reward)."""
    r = story_reward(frames, stories)
    return {k: r[k] for k in ('VQ', 'MQ', 'TA')}


ASSET = 'assets/toy_story'        # the committed student (python -m streaming.toy_story publish)
STORIES = ('prompts/toy_stories.txt', 'prompts/toy_stories_eval.txt')  # its train and held-out stories
TRAIN_SEEDS = 4                  # stories a train caption in STORIES[0]


def publish(src=os.path.join(DIR, 'student'), dst=ASSET):
    """The student in src made a model directory of this family: its weights and text table, model_index.json,
    and the stories as KVPO's prompt file reads them into STORIES ('i,[p1],[p2],[p3],[p4]': TRAIN_SEEDS a train
    caption, one a held-out caption); the held-out captions are the base's (assets/toy/eval_prompts.txt)."""
    import shutil
    src, dst = os.path.join(toy._HERE, src), os.path.join(toy._HERE, dst)
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(os.path.join(src, 'transformer'), os.path.join(dst, 'transformer'))
    shutil.copy(os.path.join(src, 'text_embeddings.safetensors'), dst)
    for name, split, n in ((STORIES[0], 'train', TRAIN_SEEDS), (STORIES[1], 'eval', 1)):
        with open(os.path.join(toy._HERE, name), 'w') as f:
            f.write(''.join(f'{i},' + ','.join(f'[{p}]' for p in st) + '\n' for i, st in enumerate(stories(split, n))))
    with open(os.path.join(dst, 'model_index.json'), 'w') as f:
        f.write('{\n "_class_name": "ToyWorldStory",\n "_comment": "the story toy\'s streaming student of '
                'streaming/toy_story_sf.py: a tiny block-causal WanTransformer3DModel in transformer/, sampled in 4 '
                'steps, its text table with the story words"\n}\n')


if __name__ == '__main__':
    if sys.argv[1:] == ['publish']:
        publish()
    elif sys.argv[1:] == ['eval']:
        net = load(os.path.join(toy._HERE, DIR, 'teacher'))
        print({k: round(probe(net, k, 16), 4) for k in ('clips', 'stories')})
    else:
        train(int(sys.argv[1]) if sys.argv[1:] else STEPS)
