"""models/videoalign.py (VideoAlign) on a tiny random model saved in the released layout, and
reward.py's combine and group advantages; offline, CPU, seconds.

Run: python -m pytest tests/test_reward.py
"""
import hashlib
import json
import math
import os
import shutil

import pytest
import torch
from tiny_videoalign import make_tiny_videoalign

import reward
from models import videoalign

FPS = 8  # test clips: 8 frames at 8 fps -> 4 sampled frames, 32x48 -> 280x392, grid (2, 20, 28)
PROMPTS = ["a cat", "a dog runs across a wide green park at night", "x"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_videoalign(str(tmp_path_factory.mktemp("videoalign")))


@pytest.fixture(scope="module")
def scorer(tiny):
    return videoalign.load_videoalign(*tiny, dtype=torch.float32)


def clips(b, seed=0):
    return torch.rand(b, 8, 3, 32, 48, generator=torch.Generator().manual_seed(seed))  # (B, F, 3, H, W)


def close(a, b, atol=1e-5):
    return all(torch.allclose(a[k], b[k], atol=atol, rtol=0) for k in ("VQ", "MQ", "TA", "Overall"))


# ---- the prompt -------------------------------------------------------------------------------


def test_template_is_verbatim():
    # sha256 of prompt_template.py DETAILED_PROMPT_WITH_SPECIAL_TOKEN at KwaiVGI/VideoAlign 219ab9d
    assert hashlib.sha256(videoalign.TEMPLATE.encode()).hexdigest() == (
        "fdb6309bac618dd0c8b1b589d3a0970a974f7856eecbb355a190b2dce54af700")
    where = [videoalign.TEMPLATE.index(t) for t in ("<|VQ_reward|>", "<|MQ_reward|>", "{text_prompt}", "<|TA_reward|>")]
    assert where == sorted(where)  # VQ and MQ precede the prompt, TA follows it


def test_chat_layout_and_tokens_match_qwen_template(scorer):
    tok = scorer.tokenizer
    messages = [{"role": "user", "content": [{"type": "video", "video": "v.mp4"}, {"type": "text", "text": "HI"}]}]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == videoalign.CHAT_HEAD + "<|video_pad|>" + videoalign.CHAT_TAIL.format("HI")
    # the pieces tokenised separately equal the processor's whole string, pads expanded
    pixels, grid, ids, pos = scorer.prepare(clips(1)[0], PROMPTS[1], FPS)
    n = int(grid.prod()) // 4
    instruction = videoalign.TEMPLATE.format(text_prompt=PROMPTS[1])
    text = videoalign.CHAT_HEAD + "<|video_pad|>" * n + videoalign.CHAT_TAIL.format(instruction)
    assert ids.tolist() == tok(text, add_special_tokens=False).input_ids
    assert ids[pos].tolist() == tok.convert_tokens_to_ids(list(videoalign.REWARD_TOKENS))


# ---- loading ------------------------------------------------------------------------------------


def test_load_strict_frozen_and_merge_matches_unmerged(tiny, scorer, monkeypatch):
    from transformers import Qwen2VLModel

    assert not scorer.model.training and not scorer.rm_head.training
    assert not any(p.requires_grad for p in [*scorer.model.parameters(), *scorer.rm_head.parameters()])
    # independent reference: unmerged base weights, LoRA applied as separate matmuls by hooks
    ckpt_dir = tiny[0]
    lora = json.load(open(os.path.join(ckpt_dir, "model_config.json")))["peft_lora_config"]
    scale = lora["lora_alpha"] / lora["lora_r"]
    raw = torch.load(os.path.join(ckpt_dir, "checkpoint-1", "model.pth"), weights_only=True)
    raw = {k.removeprefix("base_model.model."): v.float() for k, v in raw.items()}
    base = {}
    for k, v in raw.items():
        if ".lora_" not in k and k not in ("lm_head.weight", "rm_head.weight"):
            k = k.replace(".base_layer.", ".")
            base["language_model." + k[len("model."):] if k.startswith("model.") else k] = v
    ref = Qwen2VLModel._from_config(scorer.model.config, dtype=torch.float32).eval()
    ref.load_state_dict(base, strict=True)
    hooks = []
    for name, module in ref.named_modules():
        a = raw.get("model." + name.removeprefix("language_model.") + ".lora_A.default.weight")
        if a is not None:
            b = raw["model." + name.removeprefix("language_model.") + ".lora_B.default.weight"]
            hooks.append(module.register_forward_hook(lambda m, i, o, a=a, b=b: o + scale * (i[0] @ a.T) @ b.T))
    assert len(hooks) == 2 * 7  # q, k, v, o, gate, up, down in both layers
    assert torch.equal(scorer.rm_head.weight, raw["rm_head.weight"])

    frames = clips(3)
    merged = scorer(frames, PROMPTS, FPS)
    monkeypatch.setattr(scorer, "model", ref)
    assert close(merged, scorer(frames, PROMPTS, FPS), atol=1e-5)
    for h in hooks:
        h.remove()
    assert not close(merged, scorer(frames, PROMPTS, FPS), atol=1e-3)  # the merge matters


def test_missing_and_unexpected_keys_are_reported(tiny, tmp_path):
    ckpt_dir = shutil.copytree(tiny[0], tmp_path / "ckpt")
    path = ckpt_dir / "checkpoint-1" / "model.pth"
    sd = torch.load(path, weights_only=True)
    sd["base_model.model.model.extra.weight"] = torch.zeros(1)
    del sd["base_model.model.visual.merger.ln_q.weight"]
    torch.save(sd, path)
    with pytest.raises(RuntimeError, match=r"1 missing keys \['visual.merger.ln_q.weight'\], 1 unexpected"):
        videoalign.load_videoalign(str(ckpt_dir), tiny[1], dtype=torch.float32)


def test_missing_files_say_how_to_get_them(tiny, tmp_path):
    with pytest.raises(FileNotFoundError, match="hf download KwaiVGI/VideoReward"):
        videoalign.load_videoalign(str(tmp_path / "none"), tiny[1])
    with pytest.raises(FileNotFoundError, match="hf download Qwen/Qwen2-VL-2B-Instruct"):
        videoalign.load_videoalign(tiny[0], str(tmp_path / "none"))
    os.makedirs(tmp_path / "empty")
    shutil.copy(os.path.join(tiny[0], "model_config.json"), tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="model.pth not found.*KwaiVGI/VideoReward"):
        videoalign.load_videoalign(str(tmp_path / "empty"), tiny[1])


def test_newest_checkpoint_by_step_number(tmp_path):
    for step in ("2", "9", "10", "10-old"):  # 10 > 9 numerically, not as text; junk names ignored
        os.makedirs(tmp_path / f"checkpoint-{step}")
        (tmp_path / f"checkpoint-{step}" / "model.pth").touch()
    assert videoalign.find_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-10" / "model.pth")


# ---- scoring ------------------------------------------------------------------------------------


def test_batch_equals_one_at_a_time_and_normalisation(scorer):
    frames = clips(3, seed=1)
    batch = scorer(frames, PROMPTS, FPS)
    single = [scorer(frames[i : i + 1], [p], FPS) for i, p in enumerate(PROMPTS)]
    assert close(batch, {k: torch.cat([s[k] for s in single]) for k in batch})
    assert all(v.shape == (3,) and v.dtype == torch.float32 and v.device.type == "cpu" for v in batch.values())
    assert torch.allclose(batch["Overall"], batch["VQ"] + batch["MQ"] + batch["TA"])
    raw = scorer.forward([scorer.prepare(frames[0], PROMPTS[0], FPS)])[0]  # un-normalised (VQ, MQ, TA)
    norm = [(3.6757, 2.2476), (1.1646, 1.3811), (2.8105, 2.5121)]  # the released inference_config
    want = [(r - m) / s for r, (m, s) in zip(raw.tolist(), norm)]
    assert [batch[k][0].item() for k in videoalign.DIMS] == pytest.approx(want, abs=1e-5)


def test_prompt_changes_ta_only(scorer):
    frames = clips(1, seed=2)
    a = scorer(frames, ["a cat"], FPS)
    b = scorer(frames, ["a red sports car drifting through a neon city at night"], FPS)
    assert torch.allclose(a["VQ"], b["VQ"], atol=1e-6, rtol=0) and torch.allclose(a["MQ"], b["MQ"], atol=1e-6, rtol=0)
    assert (a["TA"] - b["TA"]).abs().item() > 1e-4


def test_one_d_positions_are_used(scorer):
    item = scorer.prepare(clips(1, seed=3)[0], PROMPTS[0], FPS)
    pixels, grid, ids, pos = item

    def raw(position_ids, **extra):
        h = scorer.model(input_ids=ids[None], pixel_values_videos=pixels, video_grid_thw=grid[None],
                         position_ids=position_ids, **extra).last_hidden_state[0, pos]  # (3, D)
        return scorer.rm_head(h).diagonal().double()

    mine = scorer.forward([item])[0]
    assert torch.allclose(mine, raw(torch.arange(len(ids)).expand(3, 1, -1)), atol=1e-6)
    # transformers 5's default: 3-D M-RoPE positions from the video grid
    mrope = raw(None, mm_token_type_ids=(ids == scorer.video_id).long()[None] * 2)
    assert (mine - mrope).abs().max() > 1e-2


def test_failing_video_scores_nan_and_others_still_scored(scorer, monkeypatch):
    frames = clips(3, seed=4)
    good = scorer(frames, PROMPTS, FPS)
    bad_ids = scorer.prepare(frames[1], PROMPTS[1], FPS)[2]
    forward = scorer.forward

    def flaky(items):  # the model raises whenever video 1 is in the batch
        if any(torch.equal(it[2], bad_ids) for it in items):
            raise RuntimeError("boom")
        return forward(items)

    monkeypatch.setattr(scorer, "forward", flaky)
    with pytest.warns(UserWarning) as caught:
        out = scorer(frames, PROMPTS, FPS)
    assert [str(w.message)[:26] for w in caught] == ["VideoAlign: batch failed (", "VideoAlign: video 1 failed"]
    for k in out:
        assert math.isnan(out[k][1]) and torch.allclose(out[k][[0, 2]], good[k][[0, 2]], atol=1e-5)
    r = reward.combine(out, reward.SETTING_B)
    assert math.isnan(r[1]) and not r[[0, 2]].isnan().any()

    monkeypatch.setattr(scorer, "forward", forward)
    prepare = scorer.prepare
    monkeypatch.setattr(scorer, "prepare", lambda v, p, f: prepare(v, p, f) if p != "x" else 1 / 0)
    with pytest.warns(UserWarning, match="video 2 failed in preprocessing"):
        out = scorer(frames, PROMPTS, FPS)
    assert math.isnan(out["TA"][2]) and torch.allclose(out["TA"][:2], good["TA"][:2], atol=1e-5)


@pytest.mark.parametrize("frames, prompts, fps, match", [
    (torch.rand(0, 8, 3, 32, 48), [], FPS, "B >= 1"),
    (torch.rand(8, 3, 32, 48), ["a"], FPS, r"\(B, F, 3, H, W\)"),
    (torch.rand(1, 8, 4, 32, 48), ["a"], FPS, r"\(B, F, 3, H, W\)"),
    (torch.rand(1, 1, 3, 32, 48), ["a"], FPS, "F >= 2"),
    (torch.randint(0, 255, (1, 8, 3, 32, 48), dtype=torch.uint8), ["a"], FPS, "floating-point"),
    (torch.rand(1, 8, 3, 32, 48) * 2, ["a"], FPS, r"values in \[0, 1\]"),
    (torch.rand(1, 8, 3, 32, 48) - 0.5, ["a"], FPS, r"values in \[0, 1\]"),
    (torch.full((1, 8, 3, 32, 48), float("nan")), ["a"], FPS, "min nan"),
    (torch.rand(2, 8, 3, 32, 48), ["a"], FPS, "list of 2 strings"),
    (torch.rand(1, 8, 3, 32, 48), "a", FPS, "list of 1 strings"),
    (torch.rand(1, 8, 3, 32, 48), [None], FPS, "list of 1 strings"),
    (torch.rand(1, 8, 3, 32, 48), ["a"], 0, "positive frame rate"),
    (torch.rand(1, 8, 3, 32, 48), ["a"], float("nan"), "positive frame rate"),
    (torch.rand(1, 8, 3, 32, 48), ["a"], "24", "positive frame rate"),
])
def test_bad_inputs_raise(scorer, frames, prompts, fps, match):
    with pytest.raises(ValueError, match=match):
        scorer(frames, prompts, fps)


def test_combine_settings():
    s = {"VQ": torch.tensor([1.0, -2.0]), "MQ": torch.tensor([3.0, 0.5]), "TA": torch.tensor([-1.0, 4.0])}
    assert reward.SETTING_A == (1.0, 1.0, 1.0) and reward.SETTING_B == (0.5, 0.5, 1.0)
    assert torch.equal(reward.combine(s, reward.SETTING_A), torch.tensor([3.0, 2.5]))  # VQ + MQ + TA
    assert torch.equal(reward.combine(s, reward.SETTING_B), torch.tensor([1.0, 3.25]))  # 0.5 VQ + 0.5 MQ + TA


def slow_advantages(rows, clip):
    """Per-group reference in plain Python: statistics.pstdev over the finite rewards of each group."""
    import statistics
    out = []
    for row in rows:
        ok = [x for x in row if not math.isnan(x)]
        if len(ok) < 2 or statistics.pstdev(ok) <= 1e-6:
            out.append([0.0] * len(row))
            continue
        m, s = statistics.fmean(ok), statistics.pstdev(ok)
        out.append([0.0 if math.isnan(x) else max(-clip, min(clip, (x - m) / s)) for x in row])
    return out


def test_group_advantages_with_nan_and_degenerate_groups():
    nan = float("nan")
    rows = [[1.0, 2.0, 4.0, 7.0],        # plain group
            [0.3, nan, 0.9, 0.1],        # one unscored video: left out of mean and std
            [nan, nan, 5.0, nan],        # one finite member: nothing to compare against
            [nan, nan, nan, nan],        # nothing scored
            [2.0, 2.0, nan, 2.0],        # equal rewards: exactly 0, not 0/eps
            [0.0, 0.0, 0.0, 100.0]]      # an outlier: (100 - 25) / 43.3 = 1.73, clip 1.6 applies
    r = torch.tensor(rows)
    adv, valid, std = reward.group_advantages(r, clip=1.6)
    assert torch.allclose(adv, torch.tensor(slow_advantages(rows, 1.6)), atol=1e-6)
    assert torch.isfinite(adv).all() and adv[1, 1] == 0 and abs(adv[5, 3] - 1.6) < 1e-6
    assert torch.equal(valid, ~torch.isnan(r))
    assert abs(std[1, 0].item() - math.sqrt(((0.3 - 13 / 30) ** 2 + (0.9 - 13 / 30) ** 2 + (0.1 - 13 / 30) ** 2) / 3)) < 1e-6
    assert adv[0].sum().abs() < 1e-6 and abs(adv[0].pow(2).mean().item() - 1) < 1e-5  # zero mean, unit variance



def test_group_advantages_rounding_noise_is_no_signal():
    # rewards 1e-8 apart (std 5e-9 <= eps 1e-6): rounding noise of the reward model, not a ranking.
    # (r - mean) / max(std, eps) alone would give +-0.005 (and +-1 without the floor); the std <= eps
    # rule gives exactly 0. A group 1e-5 apart (std 5e-6 > eps) is a real signal: +-1.
    lo = 1e-3
    r = torch.tensor([[lo, lo + 1e-8, lo, lo + 1e-8],
                      [0.7, 0.7 + 6e-8, 0.7, 0.7],          # a float32 step apart at 0.7
                      [lo, lo + 1e-5, lo, lo + 1e-5]])
    assert r[0, 1] != r[0, 0] and r[1, 1] != r[1, 0]  # the noise is really there, in float32
    adv, valid, std = reward.group_advantages(r)
    assert 0 < std[0].item() < 1e-6 and 0 < std[1].item() < 1e-6 and std[2].item() > 1e-6
    assert torch.equal(adv[:2], torch.zeros(2, 4)), adv
    assert torch.allclose(adv[2], torch.tensor([-1.0, 1.0, -1.0, 1.0]), atol=1e-3), adv


# ---- preprocessing ------------------------------------------------------------------------------


def test_preprocess_81_frames_24fps_480x848_by_hand():
    # frames: 81 / 24 fps * 2 fps = 6.75, within [4, min(768, 81) floored to even = 80];
    #   round(6.75 / 2) * 2 = round(3.375) * 2 = 6 frames; linspace(0, 80, 6) = 0, 16, 32, 48, 64, 80
    assert videoalign.sample_indices(81, 24).tolist() == [0, 16, 32, 48, 64, 80]
    # size: round(480 / 28) * 28 = 17 * 28 = 476, round(848 / 28) * 28 = 30 * 28 = 840;
    #   476 * 840 = 399840 > 200704, so beta = sqrt(480 * 848 / 200704) = sqrt(2.02808) = 1.42411;
    #   floor(480 / 1.42411 / 28) * 28 = floor(12.04) * 28 = 336, floor(848 / 1.42411 / 28) * 28 = 21 * 28 = 588
    assert videoalign.smart_resize(480, 848) == (336, 588) and 336 * 588 == 197568 <= 200704
    # grid: (6 / 2, 336 / 14, 588 / 14) = (3, 24, 42) -> 3024 patches of 3*2*14*14 = 1176 values, 756 tokens
    level = torch.linspace(0, 1, 81).view(81, 1, 1, 1).expand(81, 3, 480, 848)  # frame k is flat k/80
    pixels, grid = videoalign.preprocess_video(level, 24)
    assert grid.tolist() == [3, 24, 42] and pixels.shape == (3024, 1176)
    # first row: channel 0 of frame 0 (196 values), then channel 0 of frame 16: temporal order kept
    mean, std = videoalign.CLIP_MEAN[0], videoalign.CLIP_STD[0]
    want = [(round(k / 80 * 255) / 255 - mean) / std for k in (0, 16)]
    assert torch.allclose(pixels[0, :392], torch.tensor(want).repeat_interleave(196), atol=1e-5)


def test_smart_resize_small_and_extreme():
    # 32 x 48: 28 * 56 = 1568 < 100352, beta = sqrt(100352 / 1536) = 8.0829;
    #   ceil(32 * 8.0829 / 28) * 28 = ceil(9.24) * 28 = 280, ceil(48 * 8.0829 / 28) * 28 = ceil(13.86) * 28 = 392
    assert videoalign.smart_resize(32, 48) == (280, 392)
    with pytest.raises(ValueError, match="aspect ratio"):
        videoalign.smart_resize(2, 1000)
    # few frames: 8 at 8 fps -> 2 -> raised to 4; 3 frames -> at most 2; 1000 frames at 1 fps -> capped at 768
    assert len(videoalign.sample_indices(8, 8)) == 4 and len(videoalign.sample_indices(3, 24)) == 2
    assert len(videoalign.sample_indices(1000, 1.0)) == 768


def test_patchify_matches_slow_loop():
    x = torch.randn(4, 3, 56, 84, generator=torch.Generator().manual_seed(5))  # (T, C, H, W)
    rows, grid = videoalign.patchify(x, patch=14, temporal=2, merge=2)
    assert grid.tolist() == [2, 4, 6]
    want = []
    for t in range(2):  # row order: t, h-block, w-block, h-in-block, w-in-block
        for hb in range(2):
            for wb in range(3):
                for mh in range(2):
                    for mw in range(2):
                        y0, x0 = (hb * 2 + mh) * 14, (wb * 2 + mw) * 14
                        patch = x[2 * t : 2 * t + 2, :, y0 : y0 + 14, x0 : x0 + 14]  # (t, C, 14, 14)
                        want.append(patch.permute(1, 0, 2, 3).reshape(-1))  # columns: C, t, y, x
    assert torch.equal(rows, torch.stack(want))


def test_bf16_vision_rope_matches_transformers_445(tiny, scorer):
    model = videoalign.load_videoalign(*tiny)  # the default dtype, bfloat16
    rope = model.model.visual.rotary_pos_emb
    pos = torch.tensor([[0, 41], [255, 3], [17, 100]])  # (N, 2) h, w
    cos, _ = rope(torch.zeros(1), pos)
    # 4.45 under model.to(bf16): inv_freq in bf16, torch.outer in bf16, cos of the bf16 angles
    inv = (1.0 / 10000 ** (torch.arange(0, 8, 2, dtype=torch.float) / 8)).to(torch.bfloat16)
    assert torch.equal(rope.inv_freq, inv)
    hw = torch.cat([torch.outer(pos[:, 0].to(torch.bfloat16), inv), torch.outer(pos[:, 1].to(torch.bfloat16), inv)], 1)
    assert torch.equal(cos, hw.cos().float().repeat(1, 2))
    # float32: identical to transformers 5
    rope32 = scorer.model.visual.rotary_pos_emb
    stock = type(rope32).forward(rope32, torch.zeros(1), pos)  # transformers 5's own rotary embedding
    assert all(torch.equal(a, b) for a, b in zip(rope32(torch.zeros(1), pos), stock))
    # the bf16 model scores like the fp32 one, up to bf16 rounding
    frames = clips(2, seed=6)
    assert close(model(frames, PROMPTS[:2], FPS), scorer(frames, PROMPTS[:2], FPS), atol=0.05)


# ---- against independent references: transformers, qwen-vl-utils' rule, the released file ------


def test_clip_mean_std_are_transformers_constants():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.utils.constants import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

    # exact: the processor normalises with these floats, a changed digit is a different model input
    assert list(videoalign.CLIP_MEAN) == list(OPENAI_CLIP_MEAN) and list(videoalign.CLIP_STD) == list(OPENAI_CLIP_STD)
    assert list(videoalign.CLIP_MEAN) == list(Qwen2VLImageProcessorPil.image_mean)  # Qwen2-VL's own defaults
    assert list(videoalign.CLIP_STD) == list(Qwen2VLImageProcessorPil.image_std)


def _hf_smart_resize():
    # transformers' Qwen2-VL smart_resize; its torchvision module needs torchvision (not a dependency
    # here), the PIL processor's copy is the same function ("Copied from", kept equal by transformers' CI)
    try:
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize
    except ImportError:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize
    return smart_resize


SIDES = sorted({*range(15, 3000, 37), 352, 480, 544, 624, 720, 848, 960, 1080, 1280, 1920})  # pixels


def test_smart_resize_matches_transformers_over_a_grid():
    hf = _hf_smart_resize()
    # (min, max) pixels: the reward's video bounds, and transformers' image defaults (sides >= 28:
    # below, transformers' first rounding can give 0 where qwen-vl-utils' and reward's clamp to 28)
    bounds = [(videoalign.MIN_PIXELS, videoalign.MAX_PIXELS, 15), (56 * 56, 28 * 28 * 1280, 28)]
    over_cap_round_differs = 0  # over-cap cases where round() instead of floor() gives another size
    for lo, hi, smallest in bounds:
        for h in SIDES:
            for w in SIDES:
                if min(h, w) < smallest or max(h, w) / min(h, w) > videoalign.MAX_RATIO:
                    continue
                assert videoalign.smart_resize(h, w, 28, lo, hi) == hf(h, w, 28, lo, hi), (h, w, lo, hi)
                if round(h / 28) * round(w / 28) * 28 * 28 > hi:
                    beta = math.sqrt(h * w / hi)
                    over_cap_round_differs += any(round(s / beta / 28) != math.floor(s / beta / 28) for s in (h, w))
    assert over_cap_round_differs > 1000  # the grid can tell floor from round above the pixel cap
    for h, w in [(2, 1000), (1000, 3)]:  # aspect ratio > 200: both refuse
        with pytest.raises(ValueError):
            hf(h, w, 28, videoalign.MIN_PIXELS, videoalign.MAX_PIXELS)
        with pytest.raises(ValueError):
            videoalign.smart_resize(h, w)


def qwen_frame_indices(total_frames, video_fps):
    """Independent rewrite of the frame rule of qwen-vl-utils as VideoAlign's vision_process.py has it:
    smart_nframes with fps sampling (FPS 2, FPS_MIN_FRAMES 4, FPS_MAX_FRAMES 768, FRAME_FACTOR 2, the
    count rounded to the factor; qwen-vl-utils 0.0.14 floors it instead), then torchvision's uniform
    indices linspace(0, total - 1, n) rounded to the nearest frame (half to even, as torch rounds)."""
    factor = 2
    lo = math.ceil(4 / factor) * factor  # ceil_by_factor(FPS_MIN_FRAMES)
    hi = math.floor(min(768, total_frames) / factor) * factor  # floor_by_factor(min(FPS_MAX_FRAMES, total))
    n = min(max(total_frames / video_fps * 2.0, lo), hi)
    n = round(n / factor) * factor  # round_by_factor: Python's round, half to even
    if not factor <= n <= total_frames:
        raise ValueError(n)
    return torch.linspace(0, total_frames - 1, n).round().long().tolist()


FRAME_COUNTS = [2, 3, 4, 5, 8, 16, 17, 33, 45, 49, 55, 61, 81, 97, 121, 129, 241, 500, 1000, 2000, 5000]
VIDEO_FPS = [0.5, 1, 2, 7.5, 8, 10, 12, 15, 16, 18, 23.976, 24, 25, 29.97, 30, 50, 60, 120]


def test_sample_indices_match_qwen_vl_utils_rule():
    truncation_differs = 0  # pairs where .long() without .round() would pick other frames
    for total in FRAME_COUNTS:
        for fps in VIDEO_FPS:
            want = qwen_frame_indices(total, fps)
            got = videoalign.sample_indices(total, fps)
            assert got.dtype == torch.long and got.tolist() == want, (total, fps)
            truncation_differs += torch.linspace(0, total - 1, len(want)).long().tolist() != want
    assert truncation_differs > 100
    # half-way frame counts: 81 frames at 18 fps -> 9 -> round(4.5) = 4 -> 8 frames (half to even), 55 at 10 -> 12
    assert len(videoalign.sample_indices(81, 18)) == 8 and len(videoalign.sample_indices(55, 10)) == 12
    with pytest.raises(ValueError):  # one frame: the rule has nothing to sample
        qwen_frame_indices(1, 24)
    with pytest.raises(ValueError):
        videoalign.sample_indices(1, 24)


def test_norm_is_the_released_inference_config():
    # inference_config of KwaiVGI/VideoReward's model_config.json, typed here from the released file
    released = {"VQ_mean": 3.6757, "VQ_std": 2.2476, "MQ_mean": 1.1646, "MQ_std": 1.3811,
                "TA_mean": 2.8105, "TA_std": 2.5121}
    assert videoalign.NORM == {k: (released[f"{k}_mean"], released[f"{k}_std"]) for k in ("VQ", "MQ", "TA")}
    assert videoalign.DIMS == reward.DIMS == ("VQ", "MQ", "TA")  # the head's rows are the interface's keys


def test_missing_inference_config_falls_back_to_the_released_norm(tiny, scorer, tmp_path):
    ckpt_dir = shutil.copytree(tiny[0], tmp_path / "ckpt")
    cfg = json.load(open(ckpt_dir / "model_config.json"))
    assert cfg.pop("inference_config")["VQ_mean"] == 3.6757  # the fixture's explicit config
    json.dump(cfg, open(ckpt_dir / "model_config.json", "w"))
    fallback = videoalign.load_videoalign(str(ckpt_dir), tiny[1], dtype=torch.float32)
    released = {"VQ": (3.6757, 2.2476), "MQ": (1.1646, 1.3811), "TA": (2.8105, 2.5121)}
    assert fallback.norm == scorer.norm == released
    frames = clips(2, seed=7)
    assert close(fallback(frames, PROMPTS[:2], FPS), scorer(frames, PROMPTS[:2], FPS), atol=1e-6)
    # and an explicit config is read, not ignored: another normalisation, other scores
    cfg["inference_config"] = {f"{k}_{s}": v for k in videoalign.DIMS for s, v in (("mean", 0.0), ("std", 1.0))}
    json.dump(cfg, open(ckpt_dir / "model_config.json", "w"))
    unit = videoalign.load_videoalign(str(ckpt_dir), tiny[1], dtype=torch.float32)
    raw = unit.forward([unit.prepare(frames[0], PROMPTS[0], FPS)])[0]  # (3,) un-normalised
    assert [unit(frames[:1], PROMPTS[:1], FPS)[k].item() for k in videoalign.DIMS] == pytest.approx(raw.tolist(), abs=1e-5)
