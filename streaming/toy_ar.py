"""
The toy world, streaming: a tiny block-causal Wan (streaming/__init__.py, the machinery of streaming/wan_causal.py)
trained on the toy's clips (models/toy.py: the same world, captions, text table, exact autoencoder, reward
and manifold distance), so the streaming path runs end to end on a CPU.

    python -m streaming.toy_ar          # train it into assets/toy_ar (18 min on one CPU thread), evaluate
    python -m streaming.toy_ar eval     # evaluate it beside the bidirectional base (assets/toy)
    python sample.py --model=assets/toy_ar
    python -m pytest tests/test_toy_ar.py

The released layout scaled down (LAYOUT): the toy's autoencoder has no temporal compression (9 frames ->
9 latent frames of 6x6 tokens), so a block is 1 latent frame (released: 3), the sink 1 frame (3) and the
window 4 frames with the sink and the block (12): from frame 5 on the window drops frames (frame 8 sees
0, 6, 7, 8: frames 1..5 have left it), so a router (KVPO) has older frames to choose from. The sampler
is not the released one: the released models are distilled (DMD) to predict a sharp x0 from any step, so
x0-then-fresh-noise works for them; a model trained by regression predicts the posterior mean, and a first
frame (nothing before it) then collapses to the grey mean: trained at the 4 released timesteps, with fresh
noise or with 4 Euler steps, its x0's spread fell 0.11 -> 0.025 over the steps and the held-out composite
was 0.17-0.21. So the toy samples each frame with 8 Euler steps of its own flow ODE at shift 3 (timesteps
1000, 875, ..., 125; LAYOUT['renoise'] = 'ode'), as the bidirectional base samples a clip with 10; the cache,
the window and the timestep-0 write are the released ones.

Training is teacher forcing (CausVid's): a clip's clean frames followed by the same frames noised, under
streaming.teacher_mask (a noisy frame sees the clean frames of
its window and itself: exactly what the cache gives it), the loss flow matching's velocity error on the
noisy half, each noisy frame at its own sigma (logit-normal, shifted by 2, as the base trained); the toy's
captions (a quarter wrong) and 10% empty prompts, as the bidirectional base had.
Tested by: python -m pytest tests/test_toy_ar.py
"""
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

from models import toy, wan
import streaming
from models.attention import backend as dispatcher_backend
from streaming.wan_causal import CausalWanTransformer3DModel

# ----------------------------------------------------------------------------- settings
DIR = 'assets/toy_ar'           # its model directory (transformer/, the toy's text table and prompts): built,
                                # not committed (the story toy's student, assets/toy_story, succeeds it)
LAYOUT = dict(block=1, sink=1, window=4, timesteps=tuple(range(1000, 0, -125)), shift=3.0,
              renoise='ode')  # the docstring's scaling: 8 Euler steps of the flow ODE a frame, as the base's sampler
CONFIG = dict(patch_size=(1, 1, 1), num_attention_heads=3, attention_head_dim=32, in_channels=toy.LATENT_SHAPE[0],
              out_channels=toy.LATENT_SHAPE[0], text_dim=toy.TEXT_DIM, freq_dim=64, ffn_dim=256, num_layers=3,
              rope_max_seq_len=32)  # diffusers WanTransformer3DModel kwargs: 36 tokens a frame, hidden 96
SEED = 1337                     # model init and data stream
STEPS = 1500                    # optimizer steps
BATCH = 8                       # clips a step (9 noisy frames each: 72 training frames)
LR = 1e-3                       # AdamW peak learning rate (50 warm-up steps, cosine to 10%)
EMA = 0.99                      # decay of the saved weight average
EVAL_SEEDS = 4                  # samples per held-out prompt in evaluate()


class ToyARTransformer(CausalWanTransformer3DModel):
    """The toy's causal Wan: its own class so that models.family_of finds this family (its text context)."""



@torch.no_grad()
def ema_update(ema, net, step, decay):
    """The EMA copy's step toward net: decay warmed up as min(decay, (1 + step) / (10 + step))."""
    for pe, p in zip(ema.parameters(), net.parameters()):
        pe.lerp_(p, 1 - min(decay, (1 + step) / (10 + step)))

def build_model():
    torch.manual_seed(SEED)
    return streaming.install(ToyARTransformer(**CONFIG), LAYOUT)


def context(text):
    """The toy's word embeddings (B, TEXT_LEN, D), zeros after the prompt, as training saw them."""
    return F.pad(text[0].float(), (0, 0, 0, toy.TEXT_LEN - text[0].shape[1]))


def train_loss(net, frames, captions, gen, table=None):
    """Teacher-forced flow-matching loss of a batch of clips (module docstring)."""
    x0 = toy.encode(frames)  # (B, C, F, h, w)
    B, n = x0.shape[0], x0.shape[2]
    s = torch.sigmoid(torch.randn(B, n, generator=gen))  # (B, F) each frame at its own sigma: logit-normal,
    s = toy.TRAIN_SHIFT * s / (1 + (toy.TRAIN_SHIFT - 1) * s)  # shifted as the bidirectional base trained
    noise = torch.randn(x0.shape, generator=gen)
    sb = s[:, None, :, None, None]
    xt = (1 - sb) * x0 + sb * noise
    seq, s_seq = torch.cat([x0, xt], 2), torch.cat([torch.zeros(B, n), s], 1)  # clean frames at timestep 0
    v = streaming.forward_masked(net, seq, s_seq, toy.encode_prompts(captions, table)[0], list(range(n)) * 2,
                                 streaming.teacher_mask(n, LAYOUT))
    return (v[:, :, n:] - (noise - x0)).square().mean()


def train(steps=STEPS, out=None):
    """`steps` optimizer steps into out (DIR by default): the EMA weights, the log and the toy's text files."""
    from safetensors.torch import load_file
    import shutil
    torch.set_num_threads(toy.THREADS)  # one thread: reproducible, and fast on a busy CPU
    out = os.path.join(toy._HERE, out or DIR)
    os.makedirs(out, exist_ok=True)
    for f in ('text_embeddings.safetensors', 'train_prompts.txt', 'eval_prompts.txt'):  # the toy's own
        shutil.copy(os.path.join(toy._HERE, toy.DIR, f), out)
    table = load_file(os.path.join(out, 'text_embeddings.safetensors'))['embeddings']
    net, ema = build_model().train(), build_model().eval().requires_grad_(False)
    opt = torch.optim.AdamW(net.parameters(), lr=LR, betas=(0.9, 0.99), weight_decay=0.0)
    gen = torch.Generator().manual_seed(SEED)
    log, t0, smooth = open(os.path.join(out, 'train.log'), 'w'), time.time(), None
    for step in range(steps):
        lr = LR * min(1, (step + 1) / 50) * (0.55 + 0.45 * math.cos(math.pi * step / steps))
        for g in opt.param_groups:
            g['lr'] = lr
        loss = train_loss(net, *toy.data(gen, BATCH), gen, table)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        ema_update(ema, net, step, EMA)
        smooth = loss.item() if smooth is None else 0.98 * smooth + 0.02 * loss.item()
        if step % 100 == 0 or step == steps - 1:
            line = f'step {step:5d}  loss {loss.item():.4f}  smoothed {smooth:.4f}  lr {lr:.2e}  {time.time() - t0:6.0f}s'
            print(line, flush=True)
            log.write(line + '\n')
    log.write(f'done: {steps} steps of {BATCH} clips in {time.time() - t0:.0f}s on one thread\n')
    log.close()
    ema.save_pretrained(os.path.join(out, 'transformer'))
    with open(os.path.join(out, 'model_index.json'), 'w') as f:
        f.write('{\n "_class_name": "ToyWorldAR",\n "_comment": "the streaming toy of streaming/toy_ar.py: a tiny '
                'block-causal WanTransformer3DModel in transformer/, the toy world\'s text table"\n}\n')


def evaluate(path=DIR, seeds=EVAL_SEEDS):
    """The held-out prompts x seeds, block by block, beside the bidirectional base (assets/toy) sampled as
    sample.py and train.py's evaluation do (10 Euler steps, shift 3, cfg 1) and as models.toy evaluates it
    (16 steps, cfg 3), the streaming model without guidance (as sample.py runs it) and with cfg 3:
    {name: toy.summary}, and the frames."""
    torch.set_num_threads(toy.THREADS)
    prompts = [p for p in toy.all_prompts() if toy.is_eval_prompt(p) for _ in range(seeds)]
    net = load_transformer(os.path.join(toy._HERE, path))
    noise = torch.stack([torch.randn(toy.LATENT_SHAPE, generator=torch.Generator().manual_seed(i))
                         for i in range(len(prompts))])
    gens = [torch.Generator().manual_seed(10 ** 6 + i) for i in range(len(prompts))]
    text, empty = toy.encode_prompts(prompts), toy.encode_prompts([''] * len(prompts))
    frames = {'streaming': toy.decode(generate(net, noise, text, gens)),
              'streaming cfg 3': toy.decode(generate(net, noise, text, gens, 3.0, empty))}
    base = toy.load_model()
    frames['bidirectional'] = toy.sample(base, prompts, range(len(prompts)), steps=10, shift=3.0, cfg=1.0)
    frames['bidirectional cfg 3'] = toy.sample(base, prompts, range(len(prompts)))
    return {k: toy.summary(f, prompts) for k, f in frames.items()}, frames


# ----------------------------------------------------------------------------- the model interface
PIPELINE = 'ToyWorldAR'
TRANSFORMER = 'ToyARTransformer'
HUB_ID = None  # built into assets/toy_ar by python -m streaming.toy_ar (not committed)
DEFAULTS = dict(sample_steps=len(LAYOUT['timesteps']), shift=LAYOUT['shift'], cfg=1.0, fps=toy.FPS,
                negative_prompt='', num_frames=toy.FRAMES, height=toy.HEIGHT, width=toy.WIDTH,
                sample_prompts=16, sample_seeds=2)
LORA_TARGETS = wan.LORA_TARGETS
reward, manifold_distance, text_encoder = toy.reward, toy.manifold_distance, toy.text_encoder


def load_transformer(path, meta=False, attention=None, backend='native', cls=None, layout=None):
    # cls, layout: another streaming toy's (streaming/toy_sf.py), the same loading
    cls, layout, sub = cls or ToyARTransformer, layout or LAYOUT, os.path.join(path, 'transformer')
    if meta:
        with torch.device('meta'):
            net = cls.from_config(cls.load_config(sub))
    else:
        net = cls.from_pretrained(sub, torch_dtype=torch.float32).eval()
    for b in net.blocks:
        b.attn1.processor._attention_backend = b.attn2.processor._attention_backend = dispatcher_backend(backend)
    return streaming.install(net, layout)


def blocks(net):
    return net.blocks


def forward(net, x, s, text):
    """The velocity of a whole clip at sigmas s (B,), every block seeing its window (wan_causal.forward)."""
    n = x.shape[2]
    mask = streaming.teacher_mask(n, net.layout)[n:, n:]
    return streaming.forward_masked(net, x, s[:, None].expand(-1, n), context(text), range(n), mask)


def generate(net, noise, text, gens=None, cfg=1.0, text_neg=None):
    """Latents block by block from the KV cache; cfg != 1: guided against text_neg (the empty prompt)."""
    neg = None if text_neg is None else context(text_neg)
    return streaming.generate(net, noise, context(text), gens, cfg=cfg, context_neg=neg)


def load_decoder(path, device):
    return toy.decode


def latent_shape(path, num_frames, height, width):
    return toy.LATENT_SHAPE


def cp_plan(net):
    raise SystemExit('sequence parallel does not split a streaming model: sp_size=1')


if __name__ == '__main__':
    if sys.argv[1:] != ['eval']:
        train()
    table, _ = evaluate()
    keys = ('composite', 'VQ', 'MQ', 'TA', 'colour', 'direction', 'manifold', 'colour+direction right')
    lines = [f'{"":22}' + ''.join(f'{k[:10]:>11}' for k in keys)]
    lines += [f'{name:22}' + ''.join(f'{row[k]:11.4f}' for k in keys) for name, row in table.items()]
    print('\n'.join(lines))
    with open(os.path.join(toy._HERE, DIR, 'eval.log'), 'w') as f:
        f.write(f'held-out prompts x {EVAL_SEEDS} seeds (python -m streaming.toy_ar eval)\n' + '\n'.join(lines) + '\n')
