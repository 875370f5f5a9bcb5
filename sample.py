"""
Render base vs aligned with this repository's samplers: videos, a contact sheet, a table of their
scores.

    python sample.py                  # toy world: base vs out-toy's newest checkpoint
    python sample.py --prompts="a red circle moving left" --sampler=sage --eta=0.5
    python sample.py --model=weights/HunyuanVideo-1.5-480p_t2v --checkpoint=out --device=cuda \
        --prompts=prompts/eval.txt
    python sample.py --model=weights/Wan2.1-T2V-1.3B --checkpoint=out-wan --device=cuda \
        --prompts=prompts/eval.txt
    python sample.py --model=assets/toy_story --beside=assets/toy --checkpoint=
        # streaming (block by block from its KV cache) beside the bidirectional base

Settings left at None take the world's defaults (the toy's: config/toy.py's sampling, its 16
held-out prompts x 2 seeds, as train.py evaluates them but other seeds; or the model family's
DEFAULTS). Writes out_dir/<name>_<i>.mp4 (base, aligned; clip i: prompt i % P), contact_sheet.png
(per prompt, first seed: its text, then a row of frames per model) and metrics.json: scores (the
toy's exact reward and manifold distance, or VideoAlign's; --eval_metrics adds CLIPScore,
PickScore), mean over the clips, printed above train.py's held-out evaluation (its metrics.jsonl;
iteration 0: the base) and what got better and worse, each watcher judged by the way the alarm
calls wrong (models/evaluate.py WRONG). The sheet and the table are drawn by models/compare.py.
"""
import os

import torch

import sde
from reward import SETTING_B
from extras import metrics
from infra import checkpoint as checkpoint_lib
from infra.configurator import configure, list_of, number, one_of, prompt_or_file
from infra.versions import check as check_versions
from models import attention as attention_lib, compare, family
from models.evaluate import watched
from models.policy import encode_prompts, generators, guided_text, latent_shape, load_decoder, \
    load_policy, noise, sample, save_mp4
from models.videoalign import load_reward

# ----------------------------------------------------------------------------- settings
model = 'assets/toy'            # the base model: a diffusers directory, or the toy world's
checkpoint = 'out-toy'          # a train.py out_dir (its newest checkpoint), a ckpt_* dir; '' none
beside = ''                     # another model directory, sampled beside with its own defaults:
                                # --model=assets/toy_story --beside=assets/toy (streaming vs not)
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
clips = []  # (B, F, 3, H, W) a model, as decoded: the sheet shows, the table scores these
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
    clips.append(frames)
    print(f'{name}: {len(clip_prompts)} videos in {out_dir}/ ({ckpt or path})')
    del policy

names = [name for name, *_ in models]
compare.contact_sheet(clips, names, prompt_list, os.path.join(out_dir, 'contact_sheet.png'))
print(f'contact sheet: {out_dir}/contact_sheet.png (per prompt: its text, then '
      f'{" above ".join(names)})')

# ----------------------------------------------------------------------------- metrics table
# the clips above scored by the reward (the model's own exact one, the toy's; or VideoAlign) and the
# visual metrics, base vs aligned: the first look at reward hacking (a reward that rises while
# CLIPScore falls)
if metrics_table:
    try:
        kind = 'world' if hasattr(fam, 'reward') else 'videoalign'
        reward_fn, manifold_distance = load_reward(kind, videoalign_dir, qwen_dir, device, fam)
        visual = metrics.load_metrics(eval_metrics, clip_dir, pickscore_dir, device)
    except (OSError, ValueError) as e:  # the videos and the sheet are written: say what is missing
        print(f'no metrics table: {e}')
        reward_fn = None
    run = checkpoint_lib.read_loop(models[-1][1])['config'] if models[-1][1] else {}
    weights = tuple(run.get('reward_weights', SETTING_B))  # no checkpoint: Setting B, train.py's
    table, composite = {}, {}
    for name, frames in zip(names, clips if reward_fn else []):  # frames (B, F, 3, H, W)
        # what the held-out evaluation scores, the composite at the run's (VQ, MQ, TA) weights
        sc = watched(frames, clip_prompts, fps, reward_fn, weights, manifold_distance, visual)
        # the mean over the clips; and the composite per clip (B,), for the paired spread
        table[name] = {k: torch.as_tensor(v).float().nanmean().item() for k, v in sc.items()}
        composite[name] = torch.as_tensor(sc['composite']).float()
    if table:  # printed, with train.py's held-out evaluations below and what got better and worse
        compare.report(table, composite, prompt_list, samples, out_dir, models[-1][1])
