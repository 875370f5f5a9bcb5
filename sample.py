"""
Render videos from a policy with this repository's samplers, and a contact sheet that compares
the base model with an aligned checkpoint at a glance (one row of frames per model and prompt).

    python sample.py                                  # toy world: base vs out-toy's newest checkpoint
    python sample.py --prompts="a red circle moving left" --sampler=sage --eta=0.5
    python sample.py --model=weights/HunyuanVideo-1.5-480p_t2v --checkpoint=out --device=cuda --prompts=prompts/eval.txt

Settings left at None take the world's own defaults: the toy's sampling (config/toy.py: 10 steps,
shift 3, no guidance, 8 fps), or HunyuanVideo 1.5 480p's inference defaults (50 steps, shift 5,
cfg 6, 81 frames at 480x848, 24 fps).

Files: out_dir/<name>_<i>.mp4 for name in (base, aligned), and out_dir/contact_sheet.png: per prompt
a title line with the prompt, then one labelled row of frames per model (base above aligned).
Then a table of every metric, mean over the prompts, base vs aligned (also out_dir/metrics.json): the
toy's exact reward and manifold distance, or VideoAlign's VQ/MQ/TA, plus CLIPScore and PickScore with
--eval_metrics=clipscore,pickscore (metrics.py). Missing weights skip the table with the download command.
"""
import json
import os

import torch

import checkpoint as checkpoint_lib
import sde
from configurator import configure
from model import batch_text, encode_prompts, generators, is_toy, latent_shape, load_decoder, load_policy, noise, \
    sample, save_mp4

# ----------------------------------------------------------------------------- settings
model = 'assets/toy'            # the base model: a diffusers directory, or the toy world's
checkpoint = 'out-toy'          # a train.py out_dir (its newest checkpoint) or a ckpt_* dir; '' for none
prompts = 'assets/toy/eval_prompts.txt'  # one prompt, or a file with one prompt per line
num_prompts = 4                 # the first few prompts of the file
negative_prompt = ''            # unconditional branch of classifier-free guidance
num_steps = None                # sampling steps (None: toy 10 as config/toy.py, HunyuanVideo 480p 50)
shift = None                    # sigma-schedule shift (None: toy 3.0, HunyuanVideo 480p 5.0)
cfg = None                      # classifier-free guidance scale (None: toy 1.0 as trained, HunyuanVideo 6.0)
sampler = 'ode'                 # 'ode' | 'sage' | 'flow' | 'dance' | 'cps'
eta = 0.0                       # SDE noise scale (ignored by 'ode')
num_frames = 81                 # HunyuanVideo only (the toy's clip size is fixed)
height = 480
width = 848
fps = None                      # frame rate written to the mp4 files (None: toy 8, HunyuanVideo 24)
seed = 0                        # the same seed per prompt for every model: differences are the model's
device = 'cpu'
attention = 'masked_keys'       # blocks' attention: padding masked as keys only (model.py); 'diffusers': its (S, S) mask
out_dir = 'samples'
metrics_table = True            # print base vs aligned scores: the toy's reward, or VideoAlign's
videoalign_dir = 'weights/VideoReward'        # (real model) VideoAlign, as in train.py
qwen_dir = 'weights/Qwen2-VL-2B-Instruct'
eval_metrics = ''               # visual metrics in the table too: 'clipscore,pickscore' (metrics.py)
clip_dir = 'weights/clip-vit-large-patch14'   # hf download openai/clip-vit-large-patch14 --local-dir ...
pickscore_dir = 'weights/PickScore_v1'        # hf download yuvalkirstain/PickScore_v1 --local-dir ...
config = configure(globals())
# -----------------------------------------------------------------------------
# the world's own defaults for what was left at None: the toy's (config/toy.py) or HunyuanVideo 480p's
toy_world = is_toy(model)
if toy_world:
    import toy  # noqa: F401  plugs the toy's text encoder, decoder and latent shape into model.py
defaults = dict(num_steps=10, shift=3.0, cfg=1.0, fps=8) if toy_world else dict(num_steps=50, shift=5.0, cfg=6.0, fps=24)
for k, v in defaults.items():
    if globals()[k] is None:
        globals()[k] = config[k] = v


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
    policy = load_policy(model, device, lora_rank=lora_rank, attention=attention)
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

# contact sheet: for each prompt, a title line (the prompt), then one row of frames per model
# (base above aligned) with its name at the left; 2-pixel gaps; small frames (the toy's 24x24) are
# enlarged by an integer factor, nearest neighbour
zoom = max(1, 96 // rows[0].shape[-2])
clips = rows  # (B, F, 3, H, W) per model, as decoded: the metrics table scores these
rows = [f.repeat_interleave(zoom, -2).repeat_interleave(zoom, -1) for f in rows]
B, F, _, H, W = rows[0].shape
gap, label_w, title_h = 2, 64, 14  # pixels: between frames, the row-name column, the prompt line
block = title_h + len(rows) * (H + gap)  # one prompt
sheet = torch.ones(3, B * block, label_w + F * (W + gap))
for i in range(B):
    for m, frames in enumerate(rows):
        y = i * block + title_h + m * (H + gap)
        for f in range(F):
            x = label_w + f * (W + gap)
            sheet[:, y:y + H, x:x + W] = frames[i, f].cpu()
png = (sheet.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
from PIL import Image, ImageDraw  # pillow comes with matplotlib and imageio
img = Image.fromarray(png)
draw = ImageDraw.Draw(img)
for i, p in enumerate(prompt_list):
    draw.text((2, i * block + 1), f'{i}: {p}'[:(label_w + F * (W + gap)) // 6], fill=(0, 0, 0))  # ~6 px a character
    for m, (name, _) in enumerate(models):
        draw.text((2, i * block + title_h + m * (H + gap) + H // 2 - 5), name, fill=(0, 0, 0))
img.save(os.path.join(out_dir, 'contact_sheet.png'))
print(f'contact sheet: {out_dir}/contact_sheet.png (per prompt: its text, then {" above ".join(n for n, _ in models)})')

# ----------------------------------------------------------------------------- metrics table
# the clips above scored by the reward (the toy's exact one, or VideoAlign) and the visual metrics,
# base vs aligned: the first look at reward hacking (a reward that rises while CLIPScore falls)
if metrics_table:
    from metrics import load_metrics
    from reward import SETTING_B, combine
    try:
        if toy_world:
            reward_fn, manifold_distance = toy.reward, toy.manifold_distance
        else:
            from reward import load_videoalign
            reward_fn, manifold_distance = load_videoalign(videoalign_dir, qwen_dir, device), None
        visual = load_metrics(eval_metrics, clip_dir, pickscore_dir, device)
    except (OSError, ValueError) as e:  # the videos and the sheet are written: say what is missing
        print(f'no metrics table: {e}')
        reward_fn = None
    table = {}
    for (name, _), frames in zip(models, clips if reward_fn else []):  # frames (B, F, 3, H, W)
        sc = reward_fn(frames, prompt_list, fps)
        sc['composite'] = combine(sc, SETTING_B)  # (0.5, 0.5, 1) x (VQ, MQ, TA), train.py's default
        if manifold_distance is not None:
            sc['manifold'] = manifold_distance(frames)
        sc.update({k: fn(frames, prompt_list) for k, fn in visual.items()})  # per-frame mean, (B,) each
        table[name] = {k: torch.as_tensor(v).float().nanmean().item() for k, v in sc.items()}  # over prompts
    if table:
        keys = list(table['base'])
        print(f'metrics, mean over {len(prompt_list)} prompts:\n' + ' ' * 8 + ''.join(f'{k:>11}' for k in keys))
        for name, row in table.items():
            print(f'{name:<8}' + ''.join(f'{row[k]:>11.4f}' for k in keys))
        with open(os.path.join(out_dir, 'metrics.json'), 'w') as f:
            json.dump(table, f, indent=1)
