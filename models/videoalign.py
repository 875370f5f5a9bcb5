"""VideoAlign (KwaiVGI/VideoReward), the frozen video reward model of the paper, loaded without peft:
one reward_fn of reward.py's interface.

Qwen2-VL-2B-Instruct tuned with LoRA (r=64, alpha=128) plus a bias-free head rm_head: 1536 -> 3. Three
added tokens <|VQ_reward|>, <|MQ_reward|>, <|TA_reward|> sit in a fixed instruction; the score of dimension
k is rm_head row k at the final hidden state of the k-th token. VQ and MQ precede the user prompt (causal
model), so only TA depends on the text. Normalised with the released mean/std; Overall = VQ + MQ + TA.

    hf download KwaiVGI/VideoReward --local-dir ckpt/VideoReward
    hf download Qwen/Qwen2-VL-2B-Instruct --local-dir ckpt/Qwen2-VL-2B-Instruct
    reward_fn = load_videoalign("ckpt/VideoReward", "ckpt/Qwen2-VL-2B-Instruct", device="cuda")
    scores = reward_fn(frames, prompts, fps=24)  # frames (B, F, 3, H, W) in [0, 1]; reward.combine weighs them
    python -m models.videoalign --check ckpt/VideoReward --qwen_dir=ckpt/Qwen2-VL-2B-Instruct  # one clip scored

Facts from github.com/KwaiVGI/VideoAlign 219ab9d (inference.py, train_reward.py, trainer.py, utils.py,
vision_process.py, prompt_template.py, train.sh; transformers 4.45.2). Knowing differences, and why:
- Frames are sampled, resized and patchified in torch from memory by the released rules, with no mp4
  round trip (its lossy codec is skipped, its 8-bit quantisation kept).
- LoRA is merged (W += alpha/r * B @ A in float32, then cast), not run as PEFT layers: same function.
- transformers 5, not 4.45: 4.45 names (model.*, visual.*) map to Qwen2VLModel's (language_model.*,
  visual.*) and lm_head is dropped. 1-D positions arange(L) are passed explicitly: the released
  forward skipped get_rope_index, so 4.45 used them, where 5.x would build 3-D M-RoPE positions.
  Vision RoPE angles are rounded to the model dtype as 4.45 did under bf16 (_vision_rope_445).
- A failing video scores NaN and the others are still scored (the released code raised).
- Only the released config is supported (fps sampling, 'detailed_special' template, 3 outputs).

Tested by: python -m pytest tests/test_reward.py   (a tiny random model saved in the released layout;
           --check: tests/test_preflight_room.py)
"""
import glob
import json
import math
import numbers
import os
import re
import types
import warnings

import torch
import torch.nn.functional as F

from infra.finite import FiniteFrames

SAMPLE_FPS = 2.0  # frames per second shown to the model (data_config.fps in model_config.json)
MIN_FRAMES = 4  # fewest sampled frames (qwen-vl-utils FPS_MIN_FRAMES)
MAX_FRAMES = 768  # most sampled frames (FPS_MAX_FRAMES)
MIN_PIXELS = 128 * 28 * 28  # 100352: smallest resized frame area (VIDEO_MIN_PIXELS)
MAX_PIXELS = 256 * 28 * 28  # 200704: largest resized frame area (train.sh --max_frame_pixels)
MAX_RATIO = 200  # largest aspect ratio smart resize accepts
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # Qwen2-VL image_mean (OPENAI_CLIP_MEAN)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)  # Qwen2-VL image_std (OPENAI_CLIP_STD)
# (mean, std) of the raw scores: the released inference_config in model_config.json
NORM = {"VQ": (3.6757, 2.2476), "MQ": (1.1646, 1.3811), "TA": (2.8105, 2.5121)}
DIMS = ("VQ", "MQ", "TA")  # rm_head rows, in order: the score keys (reward.DIMS)
REWARD_TOKENS = ("<|VQ_reward|>", "<|MQ_reward|>", "<|TA_reward|>")  # added tokens, one per dimension
GET_CKPT = "hf download KwaiVGI/VideoReward --local-dir {}"  # how to obtain checkpoint_dir
GET_QWEN = "hf download Qwen/Qwen2-VL-2B-Instruct --local-dir {}"  # how to obtain qwen_dir
# Qwen2-VL-2B-Instruct's chat template rendered for one user turn [video, text] + generation prompt
CHAT_HEAD = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n<|vision_start|>"
CHAT_TAIL = "<|vision_end|>{}<|im_end|>\n<|im_start|>assistant\n"
# prompt_template.py DETAILED_PROMPT_WITH_SPECIAL_TOKEN, character for character (trailing spaces too)
TEMPLATE = """
You are tasked with evaluating a generated video based on three distinct criteria: Visual Quality, Motion Quality, and Text Alignment. Please provide a rating from 0 to 10 for each of the three categories, with 0 being the worst and 10 being the best. Each evaluation should be independent of the others.

**Visual Quality:**  
Evaluate the overall visual quality of the video, with a focus on static factors. The following sub-dimensions should be considered:
- **Reasonableness:** The video should not contain any significant biological or logical errors, such as abnormal body structures or nonsensical environmental setups.
- **Clarity:** Evaluate the sharpness and visibility of the video. The image should be clear and easy to interpret, with no blurring or indistinct areas.
- **Detail Richness:** Consider the level of detail in textures, materials, lighting, and other visual elements (e.g., hair, clothing, shadows).
- **Aesthetic and Creativity:** Assess the artistic aspects of the video, including the color scheme, composition, atmosphere, depth of field, and the overall creative appeal. The scene should convey a sense of harmony and balance.
- **Safety:** The video should not contain harmful or inappropriate content, such as political, violent, or adult material. If such content is present, the image quality and satisfaction score should be the lowest possible. 

Please provide the ratings of Visual Quality: <|VQ_reward|>
END

**Motion Quality:**  
Assess the dynamic aspects of the video, with a focus on dynamic factors. Consider the following sub-dimensions:
- **Stability:** Evaluate the continuity and stability between frames. There should be no sudden, unnatural jumps, and the video should maintain stable attributes (e.g., no fluctuating colors, textures, or missing body parts).
- **Naturalness:** The movement should align with physical laws and be realistic. For example, clothing should flow naturally with motion, and facial expressions should change appropriately (e.g., blinking, mouth movements).
- **Aesthetic Quality:** The movement should be smooth and fluid. The transitions between different motions or camera angles should be seamless, and the overall dynamic feel should be visually pleasing.
- **Fusion:** Ensure that elements in motion (e.g., edges of the subject, hair, clothing) blend naturally with the background, without obvious artifacts or the feeling of cut-and-paste effects.
- **Clarity of Motion:** The video should be clear and smooth in motion. Pay attention to any areas where the video might have blurry or unsteady sections that hinder visual continuity.
- **Amplitude:** If the video is largely static or has little movement, assign a low score for motion quality.

Please provide the ratings of Motion Quality: <|MQ_reward|>
END

**Text Alignment:**  
Assess how well the video matches the textual prompt across the following sub-dimensions:
- **Subject Relevance** Evaluate how accurately the subject(s) in the video (e.g., person, animal, object) align with the textual description. The subject should match the description in terms of number, appearance, and behavior.
- **Motion Relevance:** Evaluate if the dynamic actions (e.g., gestures, posture, facial expressions like talking or blinking) align with the described prompt. The motion should match the prompt in terms of type, scale, and direction.
- **Environment Relevance:** Assess whether the background and scene fit the prompt. This includes checking if real-world locations or scenes are accurately represented, though some stylistic adaptation is acceptable.  
- **Style Relevance:** If the prompt specifies a particular artistic or stylistic style, evaluate how well the video adheres to this style.
- **Camera Movement Relevance:** Check if the camera movements (e.g., following the subject, focus shifts) are consistent with the expected behavior from the prompt.

Textual prompt - {text_prompt}
Please provide the ratings of Text Alignment: <|TA_reward|>
END
"""

def sample_indices(num_frames, fps, sample_fps=SAMPLE_FPS):
    """Indices of the frames shown to the model: qwen-vl-utils smart_nframes, 'uniform' sampling."""
    lo, hi = math.ceil(MIN_FRAMES / 2) * 2, math.floor(min(MAX_FRAMES, num_frames) / 2) * 2  # even bounds
    n = round(min(max(num_frames / fps * sample_fps, lo), hi) / 2) * 2  # Python round: half to even
    if not 2 <= n <= num_frames:
        raise ValueError(f"need at least 2 frames to sample, got {num_frames}")
    return torch.linspace(0, num_frames - 1, n).round().long()  # torch rounds half to even too


def smart_resize(height, width, factor=28, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS):
    """Qwen's rule: both sides divisible by factor, area within [min, max], aspect ratio kept."""
    if max(height, width) / min(height, width) > MAX_RATIO:
        raise ValueError(f"aspect ratio must be at most {MAX_RATIO}, got {height}x{width}")
    h, w = (max(factor, round(side / factor) * factor) for side in (height, width))
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h, w = math.floor(height / beta / factor) * factor, math.floor(width / beta / factor) * factor
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def patchify(x, patch=14, temporal=2, merge=2):
    """(T, C, H, W) normalised frames -> pixel rows (T/t * H/p * W/p, C*t*p*p) and grid (3,)."""
    T, C, H, W = x.shape
    gt, gh, gw = T // temporal, H // patch, W // patch
    x = x.reshape(gt, temporal, C, gh // merge, merge, patch, gw // merge, merge, patch)
    # rows: (t, h-block, w-block, h-in-block, w-in-block), so each merge x merge block is contiguous;
    # columns: (channel, frame-in-pair, y, x), the layout the vision tower's Conv3d patch embed reads
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(gt * gh * gw, C * temporal * patch * patch), torch.tensor([gt, gh, gw])


def _round(x):
    """round(x); with a gradient, straight-through (identity backward): the 8-bit quantisation has a zero
    gradient almost everywhere, which would hide the reward's dependence on the pixels. The forward value
    is bitwise round(x) for |x| < 2**22: r - x is exact (Sterbenz) and x + (r - x) rounds to r."""
    return x + (x.round() - x).detach() if x.requires_grad else x.round()


def preprocess_video(video, fps, sample_fps=SAMPLE_FPS, max_pixels=MAX_PIXELS, patch=14, temporal=2, merge=2):
    """One video (F, 3, H, W) in [0, 1] -> (pixel rows, video_grid_thw), as the released pipeline."""
    idx = sample_indices(video.shape[0], fps, sample_fps)
    h, w = smart_resize(video.shape[2], video.shape[3], patch * merge, MIN_PIXELS, max_pixels)
    x = _round(video[idx].float() * 255)  # (T, 3, H, W) 8-bit levels, as decoded from an mp4
    # torchvision's resize of a uint8 video: bicubic with antialias, then clamp and round to uint8
    x = F.interpolate(x, size=(h, w), mode="bicubic", align_corners=False, antialias=True)
    x = _round(x.clamp(0, 255)) / 255  # the processor's rescale (do_rescale=True)
    mean, std = (torch.tensor(c, device=x.device).view(1, 3, 1, 1) for c in (CLIP_MEAN, CLIP_STD))
    return patchify((x - mean) / std, patch, temporal, merge)


def check_inputs(frames, prompts, fps):
    """ValueError saying what was expected, for anything reward_fn cannot score."""
    if not torch.is_tensor(frames) or frames.ndim != 5 or frames.shape[2] != 3:
        raise ValueError(f"frames: expected a tensor (B, F, 3, H, W), got {getattr(frames, 'shape', type(frames))}")
    if not frames.is_floating_point():
        raise ValueError(f"frames: expected a floating-point tensor in [0, 1], got {frames.dtype}")
    if frames.shape[0] == 0 or frames.shape[1] < 2 or 0 in frames.shape[3:]:
        raise ValueError(f"frames: expected B >= 1 videos of F >= 2 non-empty frames, got {tuple(frames.shape)}")
    lo, hi = frames.aminmax()  # a NaN anywhere makes both NaN, which fails the test below
    if not (0 <= lo and hi <= 1):
        raise ValueError(f"frames: expected values in [0, 1], got min {lo.item():.4g}, max {hi.item():.4g}")
    if not isinstance(prompts, (list, tuple)) or len(prompts) != len(frames) or \
            not all(isinstance(p, str) for p in prompts):
        raise ValueError(f"prompts: expected a list of {len(frames)} strings, got {prompts!r:.200}")
    if isinstance(fps, bool) or not isinstance(fps, numbers.Real) or not math.isfinite(fps) or fps <= 0:
        raise ValueError(f"fps: expected a positive frame rate, got {fps!r}")


class VideoAlign:
    """reward_fn(frames, prompts, fps) -> {'VQ', 'MQ', 'TA', 'Overall'}: (B,) float32 CPU tensors."""

    def __init__(self, model, rm_head, tokenizer, norm=NORM, sample_fps=SAMPLE_FPS, max_pixels=MAX_PIXELS):
        self.model, self.rm_head, self.tokenizer = model, rm_head, tokenizer
        self.norm, self.sample_fps, self.max_pixels = norm, sample_fps, max_pixels
        vision = model.config.vision_config
        self.sizes = vision.patch_size, vision.temporal_patch_size, vision.spatial_merge_size
        self.video_id = tokenizer.convert_tokens_to_ids("<|video_pad|>")
        if self.video_id != model.config.video_token_id:
            raise ValueError(f"tokenizer's <|video_pad|> is {self.video_id}, config's {model.config.video_token_id}")
        self.reward_ids = tokenizer.convert_tokens_to_ids(list(REWARD_TOKENS))
        self.pad_id = tokenizer.pad_token_id or 0  # never attended to
        self.head_ids = tokenizer(CHAT_HEAD, add_special_tokens=False).input_ids

    def prepare(self, video, prompt, fps):
        """One video and its prompt -> (pixel rows, grid (3,), token ids (L,), reward token positions (3,))."""
        pixels, grid = preprocess_video(video, fps, self.sample_fps, self.max_pixels, *self.sizes)
        n_video = int(grid.prod()) // self.sizes[2] ** 2  # one <|video_pad|> per merged block
        # special tokens split the text before BPE: tokenising the pieces equals tokenising the whole
        tail = self.tokenizer(CHAT_TAIL.format(TEMPLATE.format(text_prompt=prompt)), add_special_tokens=False).input_ids
        ids = torch.tensor(self.head_ids + [self.video_id] * n_video + tail)  # (L,)
        hits = [(ids == t).nonzero().flatten() for t in self.reward_ids]
        # VQ, MQ precede the prompt and TA follows it: the first, first, last hits are the template's
        # own tokens even if the prompt contains one (the released code takes every hit: with one video
        # it silently returns wrong scores for such a prompt, and it crashes only with two or more)
        return pixels, grid, ids, torch.stack([hits[0][0], hits[1][0], hits[2][-1]])

    def forward(self, items):
        """Raw scores (n, 3) float64 CPU of prepared videos, as one batch with right padding."""
        n, L = len(items), max(len(it[2]) for it in items)
        ids, mask = torch.full((n, L), self.pad_id), torch.zeros((n, L), dtype=torch.long)
        for i, (_, _, t, _) in enumerate(items):
            ids[i, : len(t)], mask[i, : len(t)] = t, 1
        # plain 1-D positions for every token (the video's too), as the released model was trained;
        # one arange for all rows: right padding leaves every video's positions unchanged
        batch = dict(input_ids=ids, attention_mask=mask, position_ids=torch.arange(L).expand(3, n, L),
                     pixel_values_videos=torch.cat([it[0] for it in items]),  # (sum of patches, 1176)
                     video_grid_thw=torch.stack([it[1] for it in items]))  # (n, 3)
        device = self.rm_head.weight.device
        h = self.model(**{k: v.to(device) for k, v in batch.items()}).last_hidden_state  # (n, L, D)
        where = torch.stack([it[3] for it in items]).to(device)  # (n, 3)
        h = h.gather(1, where[..., None].expand(-1, -1, h.shape[-1]))  # (n, 3, D) at the reward tokens
        # the head in the model dtype like the released rm_head; row k at token k is the diagonal
        return self.rm_head(h).diagonal(dim1=1, dim2=2).double().cpu()

    @torch.no_grad()
    def __call__(self, frames, prompts, fps):
        return self.score(frames, prompts, fps)

    def score(self, frames, prompts, fps):
        """__call__ in the caller's grad mode: differentiable in frames (the weights are frozen)."""
        check_inputs(frames, prompts, fps)
        raw = torch.full((len(frames), 3), float("nan"), dtype=torch.float64)  # NaN: not scored
        items = {}
        for i in range(len(frames)):
            try:
                items[i] = self.prepare(frames[i], prompts[i], fps)
            except Exception as e:  # one bad video must not cost the others their scores
                warnings.warn(f"VideoAlign: video {i} failed in preprocessing, scored NaN: {e!r}")
        try:
            if items:
                raw[list(items)] = self.forward(list(items.values()))
        except Exception as e:  # retry one at a time, so that only the failing video gets NaN
            warnings.warn(f"VideoAlign: batch failed ({e!r}); scoring videos one at a time")
            for i, item in items.items():
                try:
                    raw[i] = self.forward([item])[0]
                except Exception as e:
                    warnings.warn(f"VideoAlign: video {i} failed, scored NaN: {e!r}")
        scores = {k: ((raw[:, j] - self.norm[k][0]) / self.norm[k][1]).float() for j, k in enumerate(DIMS)}
        scores["Overall"] = scores["VQ"] + scores["MQ"] + scores["TA"]
        return scores


def _need(path, how):  # path, or a FileNotFoundError naming it and how to obtain it
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found; get it with: {how}")
    return path


def find_checkpoint(checkpoint_dir):
    """checkpoint_dir/checkpoint-<step>/model.pth with the largest step, as the released loader picks."""
    steps = [(int(m[1]), p) for p in glob.glob(os.path.join(checkpoint_dir, "checkpoint-*"))
             if (m := re.fullmatch(r"checkpoint-(\d+)", os.path.basename(p)))]
    newest = max(steps)[1] if steps else os.path.join(checkpoint_dir, "checkpoint-*")
    return _need(os.path.join(newest, "model.pth"), GET_CKPT.format(checkpoint_dir))


def convert_state_dict(sd, alpha, r, use_rslora=False, dtype=torch.float32):
    """Released PEFT-wrapped 4.45 state dict -> (Qwen2VLModel state dict with LoRA merged, rm_head weight).
    base_model.model.X -> X; X.base_layer.W + X.lora_{A,B}.default.weight -> X.W merged;
    model.* (the 4.45 text model) -> language_model.*; visual.* kept; lm_head dropped."""
    scale = alpha / math.sqrt(r) if use_rslora else alpha / r  # peft's LoRA scaling
    sd = {k.removeprefix("base_model.model."): v for k, v in sd.items()}
    out, head, merged = {}, None, set()
    for k, v in sd.items():
        if ".lora_" in k or ".original_module." in k or k == "lm_head.weight":
            continue  # LoRA factors are merged below; lm_head is never used by the reward
        a, b = (k.replace(".base_layer.weight", f".lora_{x}.default.weight") for x in "AB")
        if k.endswith(".base_layer.weight") and a in sd:
            v = v.float() + scale * (sd[b].float() @ sd[a].float())  # W += (alpha/r) B @ A, float32
            merged |= {a, b}
        k = k.replace(".base_layer.", ".").replace(".modules_to_save.default.", ".")
        k = re.sub(r"^model\.(?!visual\.|language_model\.)", "language_model.", k)  # the 4.45 text model
        out[k.removeprefix("model.")] = v.to(dtype)  # checkpoints from transformers >= 4.50 nest both
    head = out.pop("rm_head.weight", None)  # (3, hidden), not part of Qwen2VLModel
    if unused := sorted(k for k in sd if ".lora_" in k and k not in merged):
        raise ValueError(f"unsupported LoRA keys (only lora_A/lora_B of Linear layers merge): {unused[:5]}")
    if head is None:
        raise ValueError("checkpoint has no rm_head.weight: not a VideoAlign checkpoint")
    return out, head


def _vision_rope_445(self, x, position_ids):
    """Vision RoPE as 4.45 computed it after model.to(bf16): angles, cos, sin in the buffer dtype."""
    freqs = position_ids[..., None].to(self.inv_freq.dtype) * self.inv_freq  # (N, 2, head_dim/4)
    cos, sin = freqs.cos().float(), freqs.sin().float()  # cos of bf16 angles is rounded to bf16 too
    return self.recomposition_frequencies(cos), self.recomposition_frequencies(sin)


def load_videoalign(checkpoint_dir, qwen_dir, device="cpu", dtype=torch.bfloat16):
    """The released VideoAlign as a frozen callable reward_fn(frames, prompts, fps), see VideoAlign."""
    from transformers import AutoTokenizer, Qwen2VLConfig, Qwen2VLModel  # heavy import, only when used

    _need(os.path.join(qwen_dir, "config.json"), GET_QWEN.format(qwen_dir))  # tokenizer and Qwen config
    with open(_need(os.path.join(checkpoint_dir, "model_config.json"), GET_CKPT.format(checkpoint_dir))) as f:
        cfg = json.load(f)
    data, mcfg, lora = cfg["data_config"], cfg["model_config"], cfg["peft_lora_config"]
    got = (data.get("prompt_template_type"), data.get("sample_type"), data.get("num_frames"), mcfg.get("output_dim"))
    if got != ("detailed_special", "uniform", None, 3):  # the released config; nothing else is implemented
        raise ValueError(f"unsupported VideoAlign config (template, sampling, num_frames, outputs): {got}")
    path = find_checkpoint(checkpoint_dir)
    tokenizer = AutoTokenizer.from_pretrained(qwen_dir)
    tokenizer.add_tokens(list(REWARD_TOKENS), special_tokens=True)  # appended in order, as train_reward.py
    config = Qwen2VLConfig.from_pretrained(qwen_dir)
    config.text_config.vocab_size = len(tokenizer)  # train_reward.py: resize_token_embeddings(len(tokenizer))
    model = Qwen2VLModel._from_config(config, dtype=dtype, attn_implementation="sdpa")  # no lm_head
    sd = torch.load(path, map_location="cpu", weights_only=True)
    weights, head = convert_state_dict(sd, lora["lora_alpha"], lora["lora_r"], lora.get("use_rslora", False), dtype)
    missing, unexpected = model.load_state_dict(weights, strict=False)  # strict, with a clearer error:
    if missing or unexpected:
        raise RuntimeError(f"{path}: {len(missing)} missing keys {sorted(missing)[:5]}, "
                           f"{len(unexpected)} unexpected {sorted(unexpected)[:5]}")
    rm_head = torch.nn.Linear(head.shape[1], head.shape[0], bias=False)  # (3, hidden)
    rm_head.weight.data = head
    # .to(dtype) also casts the RoPE inv_freq buffers, exactly what 4.45's model.to(bf16) did
    model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    rm_head.to(device=device, dtype=dtype).eval().requires_grad_(False)
    model.visual.rotary_pos_emb.forward = types.MethodType(_vision_rope_445, model.visual.rotary_pos_emb)
    inference = cfg.get("inference_config") or {}  # the released normalisation; NORM holds the same values
    norm = {k: (inference.get(f"{k}_mean", NORM[k][0]), inference.get(f"{k}_std", NORM[k][1])) for k in DIMS}
    sample_fps, max_pixels = data.get("fps", SAMPLE_FPS), data.get("max_frame_pixels", MAX_PIXELS)
    return VideoAlign(model, rm_head, tokenizer, norm, sample_fps, max_pixels)


def world_reward(videoalign_dir, qwen_dir, device, family):
    """reward_model='world': the model family's own exact reward and manifold distance (the toy's;
    models/__init__.py OPTIONAL), which a real model does not have."""
    if getattr(family, "reward", None) is None:
        raise SystemExit("reward_model='world': this model has no reward of its own; "
                         "use reward_model='videoalign'")
    return family.reward, getattr(family, "manifold_distance", None)


def videoalign_reward(videoalign_dir, qwen_dir, device, family):
    """reward_model='videoalign': the paper's, frozen; no manifold distance."""
    return load_videoalign(videoalign_dir, qwen_dir, device), None


# train.py's reward_model -> (videoalign_dir, qwen_dir, device, family) -> (reward_fn, manifold_distance
# or None). A new reward is a function and its line here (reward.py: the interface it returns)
REWARDS = {"videoalign": videoalign_reward, "world": world_reward}
CHOICES = dict(reward_model=tuple(REWARDS))  # the configurator's rule for train.py's setting


def load_reward(kind, videoalign_dir, qwen_dir, device, family=None):
    """(reward_fn, manifold_distance) of REWARDS[kind]; reward_fn scores a clip with a non-finite frame
    NaN (infra/finite.py FiniteFrames)."""
    if kind not in REWARDS:
        raise SystemExit(f"reward_model={kind!r}: one of {', '.join(REWARDS)} (models/videoalign.py REWARDS)")
    reward_fn, manifold_distance = REWARDS[kind](videoalign_dir, qwen_dir, device, family)
    return FiniteFrames(reward_fn), manifold_distance


def check(checkpoint_dir, qwen_dir, device, size=(81, 352, 624), fps=24):
    """A downloaded VideoReward folder loaded (the released weight format through torch.load's weights_only,
    the key conversion, the strict load) and one clip of `size` (random frames) scored, in one process:
    a broken download or format is found here in a minute, not by a training run's 8 ranks.
    Returns the scores {dim: float}; raises if one is not finite."""
    import time
    t = time.time()
    reward_fn = load_videoalign(checkpoint_dir, qwen_dir, device)
    loaded = time.time() - t
    frames = torch.rand(1, size[0], 3, size[1], size[2], generator=torch.Generator().manual_seed(0))
    scores = {k: v.item() for k, v in reward_fn(frames.to(device), ["a cat walks on the grass"], fps).items()}
    print(f"{checkpoint_dir} (qwen {qwen_dir}) on {device}: loaded in {loaded:.1f} s, one {size[0]}x{size[1]}x"
          f"{size[2]} clip scored in {time.time() - t - loaded:.1f} s: "
          + ", ".join(f"{k} {v:.3f}" for k, v in scores.items()))
    if not all(math.isfinite(v) for v in scores.values()):
        raise SystemExit(f"{checkpoint_dir}: a score is not finite: {scores}")
    return scores


if __name__ == "__main__":
    # python -m models.videoalign --check weights/VideoReward [--qwen_dir=DIR] [--device=cpu]
    import argparse
    ap = argparse.ArgumentParser(prog="python -m models.videoalign", description=check.__doc__.split("\n")[0])
    ap.add_argument("--check", required=True, metavar="VIDEOREWARD_DIR", help="the downloaded VideoReward folder")
    ap.add_argument("--qwen_dir", default="weights/Qwen2-VL-2B-Instruct", help="Qwen2-VL-2B-Instruct (train.py's)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--size", default="81x352x624", help="frames x height x width of the clip (train.py's)")
    a = ap.parse_args()
    check(a.check, a.qwen_dir, a.device, tuple(int(n) for n in a.size.split("x")))
