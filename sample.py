"""
Render videos from a policy with this repository's samplers, and a contact sheet that compares
the base model with an aligned checkpoint at a glance (one row of frames per model and prompt).

    python sample.py                                  # toy world: base vs out-toy's newest checkpoint
    python sample.py --prompts="a red circle moving left" --sampler=sage --eta=0.5
    python sample.py --model=weights/HunyuanVideo-1.5-480p_t2v --checkpoint=out --device=cuda \
        --prompts=prompts/eval.txt --num_frames=81 --height=480 --width=848 --cfg=6.0 --shift=5.0 --fps=24

Files: out_dir/<name>_<i>.mp4 for name in (base, aligned), and out_dir/contact_sheet.png.
"""
import os

import imageio
import torch

import checkpoint as checkpoint_lib
import sde
from configurator import configure
from model import batch_text, encode_prompts, generators, latent_shape, load_decoder, load_policy, noise, \
    sample, save_mp4

# ----------------------------------------------------------------------------- settings
model = 'assets/toy'            # the base model: a diffusers directory, or the toy world's
checkpoint = 'out-toy'          # a train.py out_dir (its newest checkpoint) or a ckpt_* dir; '' for none
prompts = 'assets/toy/eval_prompts.txt'  # one prompt, or a file with one prompt per line
num_prompts = 4                 # the first few prompts of the file
negative_prompt = ''            # unconditional branch of classifier-free guidance
num_steps = 10                  # sampling steps (config/toy.py's)
shift = 3.0                     # sigma-schedule shift
cfg = 1.0                       # classifier-free guidance scale (config/toy.py trains without)
sampler = 'ode'                 # 'ode' | 'sage' | 'flow' | 'dance' | 'cps'
eta = 0.0                       # SDE noise scale (ignored by 'ode')
num_frames = 81                 # HunyuanVideo only (the toy's clip size is fixed)
height = 480
width = 848
fps = 8                         # frame rate written to the mp4 files
seed = 0                        # the same seed per prompt for every model: differences are the model's
device = 'cpu'
out_dir = 'samples'
config = configure(globals())
# -----------------------------------------------------------------------------


prompt_list = [prompts]
if os.path.isfile(prompts):
    with open(prompts) as f:
        prompt_list = [l.strip() for l in f if l.strip()][:num_prompts]
if not prompt_list or not prompt_list[0]:
    raise SystemExit(f'no prompts in {prompts!r}')
os.makedirs(out_dir, exist_ok=True)
models = [('base', None)]
if checkpoint and os.path.isdir(checkpoint):
    models.append(('aligned', checkpoint_lib.resolve(checkpoint)))
elif checkpoint and checkpoint != 'out-toy':
    raise SystemExit(f'checkpoint {checkpoint!r} not found')
else:
    print(f'no checkpoint at {checkpoint!r} yet (python train.py config/toy.py writes one): base model only')

cache = encode_prompts(model, prompt_list + [negative_prompt], device)
text = batch_text(cache, prompt_list, device)
text_neg = batch_text(cache, [negative_prompt] * len(prompt_list), device)
decode = load_decoder(model, device)
shape = latent_shape(model, num_frames, height, width)
sigmas = sde.sigmas(num_steps, shift)
rows = []
for name, ckpt in models:
    lora_rank = checkpoint_lib.read_loop(ckpt)['config'].get('lora_rank', 0) if ckpt else 0
    policy = load_policy(model, device, lora_rank=lora_rank)
    if ckpt:  # the trained weights of a sharded (DCP) checkpoint, read into one plain model
        checkpoint_lib.load_weights(ckpt, policy)
    policy.eval()
    gens = generators([seed * 1000 + i for i in range(len(prompt_list))])
    x, _ = sample(policy, noise(shape, gens, device), sigmas, text, cfg, text_neg, sampler, eta, gens)
    frames = decode(x)                                         # (B, F, 3, H, W) in [0, 1]
    for i, clip in enumerate(frames):
        save_mp4(clip, os.path.join(out_dir, f'{name}_{i}.mp4'), fps)
    rows.append(frames)
    print(f'{name}: {len(prompt_list)} videos in {out_dir}/ ({ckpt or model})')
    del policy

# contact sheet: for each prompt, one row of frames per model (base above aligned), 2-pixel gaps;
# small frames (the toy's 24x24) are enlarged by an integer factor, nearest neighbour
zoom = max(1, 96 // rows[0].shape[-2])
rows = [f.repeat_interleave(zoom, -2).repeat_interleave(zoom, -1) for f in rows]
B, F, _, H, W = rows[0].shape
gap = 2
sheet = torch.ones(3, B * len(rows) * (H + gap), F * (W + gap))
for i in range(B):
    for m, frames in enumerate(rows):
        y = (i * len(rows) + m) * (H + gap)
        for f in range(F):
            sheet[:, y:y + H, f * (W + gap):f * (W + gap) + W] = frames[i, f].cpu()
png = (sheet.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
imageio.imwrite(os.path.join(out_dir, 'contact_sheet.png'), png)
print(f'contact sheet: {out_dir}/contact_sheet.png ({" above ".join(n for n, _ in models)}, one pair of rows per prompt)')
