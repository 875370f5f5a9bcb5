"""
Render base vs aligned with this repository's samplers: videos, a contact sheet, a table of their
scores.

    python sample.py                  # toy world: base vs out-toy's newest checkpoint
    python sample.py --prompts="a red circle moving left" --sampler=sage --eta=0.5
    python sample.py --model=weights/HunyuanVideo-1.5-480p_t2v --checkpoint=out --device=cuda \
        --prompts=prompts/eval.txt
    python sample.py --model=weights/Wan2.1-T2V-1.3B --checkpoint=out-wan --device=cuda \
        --prompts=prompts/eval.txt
    python sample.py --model=assets/toy_ar --beside=assets/toy --checkpoint=   # streaming (block by
        block from its KV cache, models/streaming.py) beside the bidirectional toy base

Settings left at None take the world's defaults (the toy's: config/toy.py's sampling, its 16
held-out prompts x 2 seeds, as train.py evaluates them but other seeds; or the model family's
DEFAULTS). Writes out_dir/<name>_<i>.mp4 (base, aligned; clip i: prompt i % P), contact_sheet.png
(per prompt, first seed: its text, then a row of frames per model) and metrics.json: scores (the
toy's exact reward and manifold distance, or VideoAlign's; --eval_metrics adds CLIPScore,
PickScore), mean over the clips, printed above train.py's held-out evaluation (its metrics.jsonl;
iteration 0: the base) and what got better and worse, each watcher judged by the way the alarm
calls wrong (models/evaluate.py WRONG).
"""
import json
import os

import torch

import sde
from reward import SETTING_B
from extras import metrics
from infra import checkpoint as checkpoint_lib
from infra.configurator import configure, list_of, number, one_of, prompt_or_file
from infra.versions import check as check_versions
from models import attention as attention_lib, family
from models.evaluate import WRONG, watched
from models.policy import encode_prompts, generators, guided_text, latent_shape, load_decoder, \
    load_policy, noise, sample, save_mp4
from models.videoalign import load_videoalign

# ----------------------------------------------------------------------------- settings
model = 'assets/toy'            # the base model: a diffusers directory, or the toy world's
checkpoint = 'out-toy'          # a train.py out_dir (its newest checkpoint), a ckpt_* dir; '' none
beside = ''                     # another model directory, sampled beside with its own defaults:
                                # --model=assets/toy_ar --beside=assets/toy (streaming vs not)
prompts = 'assets/toy/eval_prompts.txt'  # one prompt, or a file with one prompt per line
num_prompts = None              # prompts spread over the file (None: the toy's 16; else 4)
samples = None                  # seeds per prompt, the sheet shows the first (None: toy 2, else 1)
negative_prompt = ''            # unconditional branch of classifier-free guidance
num_steps = None                # sampling steps (None: toy 10 as config/toy.py, real models 50)
shift = None                    # schedule shift (None: toy 3.0, HunyuanVideo 480p 5.0, Wan 3.0)
cfg = None                      # guidance (None: toy 1.0 as trained, HunyuanVideo 6.0, Wan 5.0)
sampler = 'ode'                 # 'ode' | 'sage' | 'flow' | 'dance' | 'cps'
eta = 0.0                       # SDE noise scale (ignored by 'ode')
num_frames = None               # clip size (None: the model's: HunyuanVideo 1.5 480p 81 x 480 x
height = None                   # 848, Wan 81 x 480 x 832; the toy's is fixed)
width = None
fps = None                      # frame rate of the mp4 files (None: toy 8, HunyuanVideo 24, Wan 16)
seed = 0                        # the same seeds for every model: differences are the model's
device = 'cpu'
attention = 'valid_tokens'      # padding left out (models/attention.py); 'masked_keys', 'diffusers'
attention_backend = 'native'    # diffusers' backend: 'native' (SDPA), '_native_flash', 'flash', ...
out_dir = 'samples'
metrics_table = True            # base vs aligned scores: the model's own reward (toy's), VideoAlign
videoalign_dir = 'weights/VideoReward'        # (real model) VideoAlign, as in train.py
qwen_dir = 'weights/Qwen2-VL-2B-Instruct'
eval_metrics = ''               # visual metrics too: 'clipscore,pickscore' (extras/metrics.py)
clip_dir = 'weights/clip-vit-large-patch14'  # hf download openai/clip-vit-large-patch14
pickscore_dir = 'weights/PickScore_v1'       # hf download yuvalkirstain/PickScore_v1
# configurator.RULES, and what differs here: ODE sampling, eta 0
config = configure(globals(), rules={**dict(
    sampler=one_of(*sde.KINDS), eta=number(0),
    prompts=(prompt_or_file, 'a prompt, or a .txt/.csv file of prompts'),
    eval_metrics=list_of(*metrics.NAMES)), **attention_lib.RULES})
# -----------------------------------------------------------------------------
# the model family's own defaults for what was left at None (the toy's as config/toy.py trains it)
check_versions(print)  # one line if diffusers or transformers is outside the tested range
fam = family(model)
defaults = dict(num_steps=fam.DEFAULTS['sample_steps'], num_prompts=fam.DEFAULTS['sample_prompts'],
                samples=fam.DEFAULTS['sample_seeds'],
                **{k: fam.DEFAULTS[k] for k in ('shift', 'cfg', 'fps', 'num_frames', 'height',
                                                'width')})
for k, v in defaults.items():
    if globals()[k] is None:
        globals()[k] = config[k] = v

lines = [l.strip() for l in open(prompts).read().splitlines() if l.strip()] \
    if os.path.isfile(prompts) else [prompts]
# spread evenly over the file
prompt_list = [lines[i * len(lines) // num_prompts] for i in range(min(num_prompts, len(lines)))]
if not prompt_list or not prompt_list[0]:
    raise SystemExit(f'no prompts in {prompts!r}')
clip_prompts = prompt_list * samples  # clip i: prompt i % P, seed seed * 1000 + i (first P: seed 0)
os.makedirs(out_dir, exist_ok=True)
models = [('base', None, model)]  # (name, checkpoint, model directory)
models += [(family(beside).PIPELINE, None, beside)] if beside else []
if checkpoint and os.path.isdir(checkpoint):
    models.append(('aligned', checkpoint_lib.resolve(checkpoint), model))
elif checkpoint and checkpoint != 'out-toy':
    raise SystemExit(f'checkpoint {checkpoint!r} not found')
else:
    print(f'no checkpoint at {checkpoint!r} yet (python train.py config/toy.py writes one): '
          'base model only')

decode = load_decoder(model, device)
shape = latent_shape(model, num_frames, height, width)
rows = []
for name, ckpt, path in models:
    fam_m = family(path)  # a beside model samples with its own family's steps, shift and guidance
    own = fam_m.DEFAULTS if path != model else dict(sample_steps=num_steps, shift=shift, cfg=cfg)
    cache = encode_prompts(path, prompt_list + [negative_prompt], device)
    text, text_neg = guided_text(cache, clip_prompts, negative_prompt, device)
    trained = checkpoint_lib.read_loop(ckpt)['config'] if ckpt else {}  # the run's weights' layout
    policy = load_policy(path, device, lora_rank=trained.get('lora_rank', 0), attention=attention,
                         backend=attention_backend, experts=trained.get('experts', 'both'))
    if ckpt:  # the trained weights of a sharded (DCP) checkpoint, read into one plain model
        checkpoint_lib.load_weights(ckpt, policy)
    policy.eval()
    gens = generators([seed * 1000 + i for i in range(len(clip_prompts))])
    if hasattr(fam_m, 'generate'):  # streaming: block by block from its KV cache, its own few steps
        x = fam_m.generate(policy, noise(shape, gens, device), text, gens, own['cfg'], text_neg)
    else:
        sigmas = sde.sigmas(own['sample_steps'], own['shift'])
        x, _ = sample(policy, noise(shape, gens, device), sigmas, text, own['cfg'], text_neg,
                      sampler, eta, gens)
    frames = decode(x)                                         # (B, F, 3, H, W) in [0, 1]
    for i, clip in enumerate(frames):
        save_mp4(clip, os.path.join(out_dir, f'{name}_{i}.mp4'), fps)
    rows.append(frames)
    print(f'{name}: {len(clip_prompts)} videos in {out_dir}/ ({ckpt or path})')
    del policy

# contact sheet: per prompt (its first seed) a title line, then a row of frames per model (base
# above aligned) named at the left; 2-pixel gaps; small frames (the toy's 24x24) enlarged by an
# integer factor
zoom = max(1, 96 // rows[0].shape[-2])
clips = rows  # (B, F, 3, H, W) per model, as decoded: the metrics table scores these
# seed 0 of each prompt
rows = [f[:len(prompt_list)].repeat_interleave(zoom, -2).repeat_interleave(zoom, -1) for f in rows]
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
    # ~6 px a character
    draw.text((2, i * block + 1), f'{i}: {p}'[:(label_w + F * (W + gap)) // 6], fill=(0, 0, 0))
    for m, (name, *_) in enumerate(models):
        draw.text((2, i * block + title_h + m * (H + gap) + H // 2 - 5), name, fill=(0, 0, 0))
img.save(os.path.join(out_dir, 'contact_sheet.png'))
print(f'contact sheet: {out_dir}/contact_sheet.png '
      f'(per prompt: its text, then {" above ".join(n for n, *_ in models)})')

# ----------------------------------------------------------------------------- metrics table
# the clips above scored by the reward (the model's own exact one, the toy's; or VideoAlign) and the
# visual metrics, base vs aligned: the first look at reward hacking (a reward that rises while
# CLIPScore falls)
if metrics_table:
    try:
        if hasattr(fam, 'reward'):
            reward_fn, manifold_distance = fam.reward, fam.manifold_distance
        else:
            reward_fn, manifold_distance = load_videoalign(videoalign_dir, qwen_dir, device), None
        visual = metrics.load_metrics(eval_metrics, clip_dir, pickscore_dir, device)
    except (OSError, ValueError) as e:  # the videos and the sheet are written: say what is missing
        print(f'no metrics table: {e}')
        reward_fn = None
    run = checkpoint_lib.read_loop(models[-1][1])['config'] if models[-1][1] else {}
    weights = tuple(run.get('reward_weights', SETTING_B))  # no checkpoint: Setting B, train.py's
    table, composite = {}, {}
    for (name, *_), frames in zip(models, clips if reward_fn else []):  # frames (B, F, 3, H, W)
        # what the held-out evaluation scores, the composite at the run's (VQ, MQ, TA) weights
        sc = watched(frames, clip_prompts, fps, reward_fn, weights, manifold_distance, visual)
        # the mean over the clips; and the composite per clip (B,), for the spread below
        table[name] = {k: torch.as_tensor(v).float().nanmean().item() for k, v in sc.items()}
        composite[name] = torch.as_tensor(sc['composite']).float()
    if table:
        keys = list(table['base'])
        line = lambda label, get: print(f'{label:<10}' + ''.join(f'{get(k):>10.4f}' for k in keys))
        print(f'metrics, mean over {len(prompt_list)} prompts x {samples} seeds:\n'
              + ''.join(f'{k:>10}' for k in [''] + keys))
        for name, row in table.items():
            line(name, row.get)
        with open(os.path.join(out_dir, 'metrics.json'), 'w') as f:
            json.dump(table, f, indent=1)
        # below: train.py's evaluations in its out_dir, the first (the base) and the checkpoint's
        ckpt = models[-1][1]
        log = os.path.join(os.path.dirname(ckpt or '.'), 'metrics.jsonl')
        last = checkpoint_lib.read_loop(ckpt)['iter_num'] if ckpt else None
        evals = [r for r in map(json.loads, open(log).read().splitlines())
                 if 'eval_composite' in r and r['iter'] <= last] \
            if ckpt and os.path.isfile(log) else []
        if len(evals) > 1:
            print(f"train.py's held-out evaluation ({log}):")
            for r in (evals[0], evals[-1]):
                line(f'iter {r["iter"]}', lambda k: r.get('eval_' + k, float('nan')))
        if 'aligned' in table:
            # each metric judged as the alarm judges it (models/evaluate.py WRONG: -1 falling is
            # wrong, a score's default; +1 rising, the manifold distance's; 0 either way, say
            # brightness): wrong > 0 moved its wrong way, < 0 its right way; a two-way one is never
            # better
            d = {k: table['aligned'][k] - table['base'][k] for k in keys}
            wrong = {k: d[k] * WRONG.get(k, -1) if WRONG.get(k, -1) else abs(d[k]) for k in keys}
            on = lambda sign: ', '.join(f'{k} {d[k]:+.4f}' for k in keys if wrong[k] * sign > 0)
            # the composite's spread over the clips, paired (same prompt and seed) base vs aligned
            se = (composite['aligned'] - composite['base']).std().item() / len(clip_prompts) ** 0.5
            print(f'aligned vs base: better on {on(-1) or "nothing"}; '
                  f'worse on {on(+1) or "nothing"}; the composite\'s standard error over these '
                  f'{len(clip_prompts)} paired clips: {se:.4f}')
