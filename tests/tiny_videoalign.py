"""make_tiny_videoalign(root) -> (checkpoint_dir, qwen_dir): a tiny random VideoAlign, offline, ~1 s.

Same architecture as Qwen2-VL-2B-Instruct (text: 2 layers, hidden 64; vision: depth 2, embed 32,
patch 14, merge 2, temporal patch 2) saved in the layouts load_videoalign reads:
- qwen_dir: config.json in the flat pre-v5 layout of the real one, a byte-level BPE tokenizer with
  Qwen's special tokens and Qwen2-VL-Instruct's chat template (tokenizer.json, tokenizer_config.json).
- checkpoint_dir: model_config.json (data/model/peft_lora/inference configs with the released
  values) and checkpoint-1/model.pth, a PEFT-wrapped, UNMERGED state dict with transformers 4.45
  key names (base_model.model.model.layers.*, ...base_layer.weight, lora_A/lora_B.default.weight,
  visual.*, lm_head, rm_head), in bf16 like the released file. LoRA B is random and nonzero, so
  merging matters. Deterministic (seeded); the weights are rescaled so activations are O(1).
Imports models/videoalign.py (its TEMPLATE trains the BPE), so the repository root must be importable, as
pytest.ini's pythonpath makes it.
"""
import json
import os

import torch

SEED = 0  # everything random below derives from it
LORA_R = 4  # LoRA rank (released: 64)
LORA_ALPHA = 8  # LoRA alpha (released: 128), scale alpha/r = 2 as released
BPE_VOCAB = 1024  # byte-level BPE size, trained on the reward instruction so prompts stay short
EXTRA_VOCAB = 6  # config vocab exceeds the tokenizer, as 151936 > 151657 in the real Qwen2-VL
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
QWEN_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                "<|image_pad|>", "<|video_pad|>")
# Qwen2-VL's 14 special tokens in id order from 151643 (REAL_IDS: the BPE is padded up to there)
QWEN2VL_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                   "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                   "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")
FIRST_SPECIAL = 151643  # id of <|endoftext|> in Qwen2-VL's tokenizer
# every size in one dict: bench/rehearsal.py passes Qwen2-VL-2B's widths instead
TINY = dict(
    real_ids=False,  # True: pad the BPE so the special tokens (and the reward tokens after them) get real ids
    extra_vocab=EXTRA_VOCAB,  # config vocab_size - len(tokenizer) (151936 - 151657 = 279 real)
    text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, mrope_section=[2, 3, 3]),  # sums to head_dim/2
    vision=dict(depth=2, embed_dim=32, mlp_ratio=2, num_heads=2),
    lora_r=LORA_R, lora_alpha=LORA_ALPHA,
)
NORM = {"VQ_mean": 3.6757, "VQ_std": 2.2476, "MQ_mean": 1.1646, "MQ_std": 1.3811, "TA_mean": 2.8105, "TA_std": 2.5121}
# Qwen2-VL-2B-Instruct's chat template (data)
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in "
    "content or 'image_url' in content %}{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}"
    "Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] "
    "== 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}"
    "Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content %}"
    "{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% endif %}"
)


def _tokenizer(qwen_dir, real_ids=False):
    """Byte-level BPE with Qwen's special tokens appended after the BPE vocab; returns its length.
    real_ids: unreachable '<unused_i>' entries pad the vocabulary so that Qwen2-VL's 14 special tokens
    take their real ids 151643..151656 (len 151657, the reward tokens then get 151657..151659)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from models.videoalign import TEMPLATE  # training text only: any text works, this one keeps sequences short

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([TEMPLATE, "a cat walks on the grass, a dog runs in the park at night"], trainer)
    specials = QWEN_SPECIAL
    if real_ids:  # the same BPE rebuilt over a padded vocabulary (no merge ever produces '<unused_i>')
        trained = json.loads(tok.to_str())["model"]
        vocab = dict(trained["vocab"])
        vocab.update({f"<unused_{i}>": i for i in range(len(vocab), FIRST_SPECIAL)})
        merges = [tuple(m.split(" ") if isinstance(m, str) else m) for m in trained["merges"]]
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        specials = QWEN2VL_SPECIAL
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                 chat_template=CHAT_TEMPLATE)
    hf.save_pretrained(qwen_dir)
    return len(hf), {s: hf.convert_tokens_to_ids(s) for s in QWEN_SPECIAL}


def make_tiny_videoalign(root, sizes=TINY):
    from transformers import Qwen2VLConfig, Qwen2VLModel

    ckpt_dir, qwen_dir = os.path.join(root, "VideoReward"), os.path.join(root, "Qwen2-VL-tiny")
    os.makedirs(os.path.join(ckpt_dir, "checkpoint-1"), exist_ok=True)
    os.makedirs(qwen_dir, exist_ok=True)
    n_tok, ids = _tokenizer(qwen_dir, sizes["real_ids"])
    text = dict(sizes["text"])
    mrope, hidden, lora_r, lora_alpha = text.pop("mrope_section"), text["hidden_size"], sizes["lora_r"], sizes["lora_alpha"]

    # ---- config.json, flat like Qwen2-VL-2B-Instruct's (hidden 1536 -> 64, 28 layers -> 2, ...)
    config = {
        "architectures": ["Qwen2VLForConditionalGeneration"], "model_type": "qwen2_vl",
        **text, "hidden_act": "silu", "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "rope_scaling": {"type": "mrope", "mrope_section": mrope},
        "tie_word_embeddings": True, "use_sliding_window": False, "vocab_size": n_tok + sizes["extra_vocab"],
        "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"],
        "vision_start_token_id": ids["<|vision_start|>"], "vision_end_token_id": ids["<|vision_end|>"],
        "image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
        "vision_config": {**sizes["vision"], "in_chans": 3,
                          "hidden_size": hidden, "patch_size": 14, "spatial_merge_size": 2, "spatial_patch_size": 14,
                          "temporal_patch_size": 2},
        "torch_dtype": "bfloat16",
    }
    with open(os.path.join(qwen_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)

    # ---- random weights of the reward model: the text vocab grows by the 3 reward tokens
    cfg = Qwen2VLConfig.from_pretrained(qwen_dir)
    cfg.text_config.vocab_size = n_tok + 3
    gen = torch.Generator().manual_seed(SEED)
    model = Qwen2VLModel._from_config(cfg, dtype=torch.float32)
    sd = {}
    for k, v in model.state_dict().items():
        if "norm" in k or "ln_q" in k:  # RMSNorm / LayerNorm: weight ~ 1, bias ~ 0
            v = (1.0 if k.endswith("weight") else 0.0) + 0.1 * torch.randn(v.shape, generator=gen)
        else:  # scaled so activations stay O(1) and positions matter
            v = torch.randn(v.shape, generator=gen) * (0.05 if v.ndim == 1 else 1.0 / v[0].numel() ** 0.5)
        sd[k] = v

    # ---- released layout: transformers 4.45 names, wrapped by peft (base_model.model.), LoRA unmerged
    released = {}
    for k, v in sd.items():
        k = "model." + k.removeprefix("language_model.") if k.startswith("language_model.") else k
        module, _, leaf = k.rpartition(".")
        if module.startswith("model.layers.") and module.rpartition(".")[2] in LORA_TARGETS:
            released[f"{module}.base_layer.{leaf}"] = v
            if leaf == "weight":
                fan_in, fan_out = v.shape[1], v.shape[0]
                released[f"{module}.lora_A.default.weight"] = torch.randn(lora_r, fan_in, generator=gen) / fan_in**0.5
                released[f"{module}.lora_B.default.weight"] = torch.randn(fan_out, lora_r, generator=gen) * 0.1
        else:
            released[k] = v
    released["lm_head.weight"] = sd["language_model.embed_tokens.weight"].clone()  # tied in Qwen2-VL-2B
    released["rm_head.weight"] = torch.randn(3, hidden, generator=gen) / hidden**0.5
    released = {"base_model.model." + k: v.to(torch.bfloat16).contiguous() for k, v in released.items()}
    torch.save(released, os.path.join(ckpt_dir, "checkpoint-1", "model.pth"))

    # ---- model_config.json with the released values (train.sh + the released inference_config)
    model_config = {
        "data_config": {"meta_data": "", "data_dir": "", "meta_data_test": None, "max_frame_pixels": 200704,
                        "num_frames": None, "fps": 2.0, "p_shuffle_frames": 0.0, "p_color_jitter": 0.0,
                        "eval_dim": ["VQ", "MQ", "TA"], "prompt_template_type": "detailed_special",
                        "add_noise": False, "sample_type": "uniform", "use_tied_data": True},
        "training_args": {"output_dir": "rm_output", "bf16": True, "learning_rate": 2e-6},
        "model_config": {"model_name_or_path": "Qwen/Qwen2-VL-2B-Instruct", "model_revision": "main",
                         "output_dim": 3, "use_special_tokens": True, "freeze_vision_tower": False,
                         "freeze_llm": False, "tune_merger": True, "torch_dtype": "bfloat16",
                         "reward_token": "special", "loss_type": "btt"},
        "peft_lora_config": {"lora_enable": True, "vision_lora": False, "lora_r": lora_r, "lora_alpha": lora_alpha,
                             "lora_dropout": 0.05, "lora_target_modules": None,
                             "lora_namespan_exclude": ["lm_head", "rm_head", "embed_tokens", "visual"],
                             "lora_modules_to_save": None, "lora_task_type": "CAUSAL_LM", "use_rslora": False,
                             "num_lora_modules": -1},
        "inference_config": NORM,
    }
    with open(os.path.join(ckpt_dir, "model_config.json"), "w") as f:
        json.dump(model_config, f, indent=4)
    return ckpt_dir, qwen_dir
