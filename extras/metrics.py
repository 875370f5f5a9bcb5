"""The paper's visual metrics, which the reward does not optimise: CLIPScore and PickScore of each
frame against the prompt, averaged over every frame of a clip (Table 2). Frozen, read-only watchers
for reward hacking: a VideoAlign score that rises while these fall is the reward being gamed.

    hf download openai/clip-vit-large-patch14 --local-dir weights/clip-vit-large-patch14
    hf download yuvalkirstain/PickScore_v1 --local-dir weights/PickScore_v1
    fns = load_metrics('clipscore,pickscore', 'weights/clip-vit-large-patch14', 'weights/PickScore_v1', 'cuda')
    scores = {k: fn(frames, prompts) for k, fn in fns.items()}  # frames (B, F, 3, H, W) in [0, 1] -> (B,)

Definitions, per frame f of a clip with prompt c, e = the unit-normalised projected CLIP embeddings:
- clipscore = 2.5 * max(cos(e_img(f), e_txt(c)), 0) with openai/clip-vit-large-patch14: CLIPScore as
  Hessel et al. (2021) define it (w = 2.5). The paper's best Setting-B value 0.5484 fits this scale only:
  it is a mean cosine of 0.22, where ViT-L/14 cosines of matching pairs are typically 0.2-0.35; a raw
  cosine of 0.55 is far above what CLIP gives any caption, and torchmetrics' 100 x cos reads ~20-35.
- pickscore = exp(logit_scale) * cos(e_img(f), e_txt(c)) with yuvalkirstain/PickScore_v1 (CLIP-H/14),
  exactly the model card's score (exp(logit_scale) = 100; typically ~20 for generated images).
The clip's value is the mean over ALL its frames (no stride; 81 frames of 224x224 are cheap next to a
rollout). Preprocessing is CLIPImageProcessor's, in torch on in-memory frames, with the sizes, mean and
std read from the directory's preprocessor_config.json: frames quantised to 8 bits (as a saved video),
shortest side resized to 224 (bicubic, antialiased, as PIL), centre crop 224, mean/std normalised.
Prompts are truncated to CLIP's 77 tokens (HunyuanVideo prompts are often longer).

Where this differs and why:
- PickScore's tokenizer and image settings are read from the PickScore_v1 directory, which ships processor
  files uploaded by its author; the model card loads laion/CLIP-ViT-H-14-laion2B-s32B-b79K's (the CLIP-H
  processor it was trained with; not compared byte for byte here): load_pickscore(processor_dir=...) uses those.
- torch's antialiased bicubic is PIL's kernel in float, not PIL's fixed-point one: 6-16% of the pixels
  differ by one level of 255, none by more (tests/test_metrics.py, against CLIPImageProcessor).
tests/test_metrics.py: tiny random CLIP models in the released layout, against transformers' own
processor and get_*_features one frame at a time; the missing-weights message.
"""
import json
import os

import torch
import torch.nn.functional as F

from infra.configurator import list_of

NAMES = ('clipscore', 'pickscore')  # the metrics this file knows
RULES = dict(eval_metrics=list_of(*NAMES))  # train.py's setting: a comma list of them
CLIPSCORE_W = 2.5  # CLIPScore's rescaling weight w (Hessel et al. 2021)
FRAMES_PER_FORWARD = 64  # frames per image-tower forward (bounds activation memory)
GET_CLIP = 'hf download openai/clip-vit-large-patch14 --local-dir {}'  # how to obtain clip_dir
GET_PICK = 'hf download yuvalkirstain/PickScore_v1 --local-dir {}'  # how to obtain pickscore_dir


def _need(path, how):
    """path, or a FileNotFoundError naming it and how to obtain it."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f'{path} not found; get it with: {how}')
    return path


def image_settings(processor_dir, how):
    """(shortest side, (crop h, crop w), mean (3,), std (3,)) from preprocessor_config.json."""
    with open(_need(os.path.join(processor_dir, 'preprocessor_config.json'), how)) as f:
        c = json.load(f)
    size, crop = c.get('size', 224), c.get('crop_size', 224)
    size = size['shortest_edge'] if isinstance(size, dict) else size  # old configs: a bare int
    crop = (crop['height'], crop['width']) if isinstance(crop, dict) else (crop, crop)
    if c.get('resample', 3) != 3 or not c.get('do_center_crop', True) or max(crop) > size:
        raise ValueError(f'{processor_dir}: only CLIP preprocessing (bicubic, centre crop <= size) is supported')
    return size, crop, c['image_mean'], c['image_std']


def preprocess(frames, size, crop, mean, std):
    """(N, 3, H, W) in [0, 1] -> (N, 3, crop h, crop w) normalised, as CLIPImageProcessor does."""
    H, W = frames.shape[-2:]
    # shortest side -> size, the other scaled and truncated (transformers' get_resize_output_image_size)
    h, w = (size, int(size * W / H)) if H <= W else (int(size * H / W), size)
    x = (frames.float() * 255).round()  # 8-bit levels, as the frames of a saved video
    x = F.interpolate(x, size=(h, w), mode='bicubic', align_corners=False, antialias=True)  # PIL's kernel
    x = x.clamp(0, 255).round() / 255  # PIL returns uint8; then the processor's rescale
    top, left = (h - crop[0]) // 2, (w - crop[1]) // 2
    x = x[:, :, top:top + crop[0], left:left + crop[1]]
    mean, std = (torch.tensor(v, device=x.device).view(1, 3, 1, 1) for v in (mean, std))
    return (x - mean) / std


class FrameScorer:
    """score_fn(frames, prompts) -> (B,) float32 CPU: scale(cos) averaged over every frame of each clip."""

    def __init__(self, model, tokenizer, image, scale):
        self.model, self.tokenizer, self.image, self.scale = model, tokenizer, image, scale
        self.max_len = model.config.text_config.max_position_embeddings  # 77

    @torch.no_grad()
    def __call__(self, frames, prompts):
        B, n_frames = frames.shape[:2]
        p = next(self.model.parameters())
        tok = self.tokenizer(list(prompts), padding=True, truncation=True, max_length=self.max_len, return_tensors='pt')
        # pooled at each prompt's end token; padding after it is causally masked anyway
        t = self.model.get_text_features(input_ids=tok.input_ids.to(p.device),
                                         attention_mask=tok.attention_mask.to(p.device)).pooler_output
        t = F.normalize(t.float(), dim=-1)  # (B, D)
        flat = frames.flatten(0, 1)  # (B * F, 3, H, W)
        e = torch.cat([self.model.get_image_features(pixel_values=preprocess(
            flat[i:i + FRAMES_PER_FORWARD].to(p.device), *self.image).to(p.dtype)).pooler_output
            for i in range(0, len(flat), FRAMES_PER_FORWARD)])
        e = F.normalize(e.float(), dim=-1).view(B, n_frames, -1)  # (B, F, D)
        cos = (e * t[:, None]).sum(-1)  # (B, F)
        return self.scale(cos).mean(1).cpu()  # (B,) mean over frames


def _load(model_dir, processor_dir, how, device, dtype):
    from transformers import AutoTokenizer, CLIPModel  # heavy import, only when used

    _need(os.path.join(model_dir, 'config.json'), how)
    image = image_settings(processor_dir, how)
    tokenizer = AutoTokenizer.from_pretrained(processor_dir)
    try:
        model = CLIPModel.from_pretrained(model_dir, dtype=dtype)
    except OSError as e:  # config.json but no weights file: an interrupted download
        raise FileNotFoundError(f'{model_dir}: {e}; get it with: {how}') from e
    model.to(device).eval().requires_grad_(False)
    return model, tokenizer, image


def load_clipscore(clip_dir, device='cpu', dtype=torch.float32):
    """CLIPScore = 2.5 * max(cos, 0), per frame, averaged (openai/clip-vit-large-patch14)."""
    model, tokenizer, image = _load(clip_dir, clip_dir, GET_CLIP.format(clip_dir), device, dtype)
    return FrameScorer(model, tokenizer, image, lambda cos: CLIPSCORE_W * cos.clamp(min=0))


def load_pickscore(pickscore_dir, device='cpu', dtype=torch.float32, processor_dir=None):
    """PickScore = exp(logit_scale) * cos, per frame, averaged (yuvalkirstain/PickScore_v1)."""
    model, tokenizer, image = _load(pickscore_dir, processor_dir or pickscore_dir, GET_PICK.format(pickscore_dir),
                                    device, dtype)
    scale = model.logit_scale.exp().float().item()  # 100 in the released weights
    return FrameScorer(model, tokenizer, image, lambda cos: scale * cos)


def move(fns, device):
    """The scorers' models to device: train.py keeps them on the CPU and on the GPU only while it
    evaluates (CLIP-L and PickScore are ~5.7 GB in fp32, which the update's peak need not carry), there
    in bf16 (2.6 GB beside the evaluation's rollouts; they stay bf16 when moved back, so every
    evaluation of a run scores with the same weights)."""
    on_gpu = torch.device(device).type == 'cuda'
    for fn in fns.values():
        fn.model.to(device, torch.bfloat16 if on_gpu else None)
    if fns and torch.device(device).type == 'cpu' and torch.cuda.is_available():
        torch.cuda.empty_cache()  # their blocks back to the driver, not kept cached beside the update


def load_metrics(names, clip_dir, pickscore_dir, device='cpu', dtype=torch.float32):
    """'clipscore,pickscore' (or a subset, '' for none) -> {name: score_fn}."""
    names = [n.strip() for n in names.split(',') if n.strip()] if isinstance(names, str) else list(names)
    if unknown := [n for n in names if n not in NAMES]:
        raise ValueError(f'unknown visual metric {unknown}: choose from {NAMES}')
    load = {'clipscore': lambda: load_clipscore(clip_dir, device, dtype),
            'pickscore': lambda: load_pickscore(pickscore_dir, device, dtype)}
    return {n: load[n]() for n in names}


def watchers_of(config):
    """load_watchers() of a run's settings: eval_metrics, clip_dir, pickscore_dir."""
    return load_watchers(config['eval_metrics'], config['clip_dir'], config['pickscore_dir'])


def load_watchers(names, clip_dir, pickscore_dir):
    """train.py's watchers, on the CPU until an evaluation moves them (move): load_metrics, and a
    failure to load them one line that says how to switch them off."""
    try:
        return load_metrics(names, clip_dir, pickscore_dir, 'cpu')
    except (OSError, ValueError) as e:
        raise SystemExit(f'eval_metrics: {e} (--eval_metrics= switches them off)')
