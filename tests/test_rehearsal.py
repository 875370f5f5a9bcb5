"""
The fast slice of bench/rehearsal.py (the rehearsal itself takes minutes and ~10 GB: not in the suite):
- its size dicts are the released architectures: the transformer's text widths and head split agree
  with the released config (assets/hunyuanvideo15_480p_t2v_transformer.json), rope sections fill the
  head dims, and the transformer built from them on the meta device at 54 blocks has HunyuanVideo
  1.5's 8.3B parameters; Wan 2.1's at 30 blocks has its 1.42B (the 1.3B model), and the UMT5 encoder
  its width 4096 and vocabulary 256384;
- the padded tokenizers put the special tokens at their released ids (Qwen2.5 151643.., Qwen2-VL's
  vision tokens 151652..151656 and the reward tokens after them, CLIP 49406/49407), and a prompt still
  tokenises to the same ids as without the padding;
- build() with the tiny sizes writes every model (both video models) through the same functions and
  reuses them.
"""
import json
import os

import torch

from bench import rehearsal as R


def test_sizes_are_the_released_architectures():
    with open('assets/hunyuanvideo15_480p_t2v_transformer.json') as f:
        released = json.load(f)
    t = R.HUNYUAN['transformer']
    assert R.HUNYUAN['text']['hidden_size'] == released['text_embed_dim'] == 3584
    assert R.HUNYUAN['byt5']['d_model'] == released['text_embed_2_dim'] == 1472
    assert t['num_attention_heads'] * t['attention_head_dim'] == 2048 and sum(t['rope_axes_dim']) == t['attention_head_dim']
    for text in (R.HUNYUAN['text'], R.VIDEOALIGN['text']):  # M-RoPE sections cover head_dim / 2 frequencies
        assert 2 * sum(text['mrope_section']) == text['hidden_size'] // text['num_attention_heads'] == 128
    from diffusers import HunyuanVideo15Transformer3DModel as T
    C = R.HUNYUAN['vae']['latent_channels']
    with torch.device('meta'):
        m = T(**dict(t, num_layers=54), in_channels=2 * C + 1, out_channels=C,
              text_embed_dim=3584, text_embed_2_dim=1472)
    n = sum(p.numel() for p in m.parameters())
    assert 8.2e9 < n < 8.4e9, n  # "8.3B"
    from diffusers import WanTransformer3DModel as W
    with torch.device('meta'):
        w = W(**dict(R.WAN['transformer'], num_layers=30), in_channels=16, out_channels=16,
              text_dim=R.WAN['text']['d_model'])
    assert 1.41e9 < sum(p.numel() for p in w.parameters()) < 1.43e9  # Wan2.1-T2V-1.3B's 1.42B
    assert (R.WAN['vocab_size'], R.WAN['text']['d_model'], R.WAN['text']['num_heads'] * R.WAN['text']['d_kv']) == \
        (256384, 4096, 4096)


def test_padded_tokenizers_have_the_released_special_ids(tmp_path):
    from tiny_clip import tiny_tokenizer
    from tiny_hunyuan import make_tokenizer
    from tiny_videoalign import _tokenizer
    q, q0 = make_tokenizer(real_ids=True), make_tokenizer()
    assert len(q) == 151665 and q.convert_tokens_to_ids(['<|endoftext|>', '<|im_start|>', '<|im_end|>']) == \
        [151643, 151644, 151645] and q.pad_token_id == 151643
    text = 'a cat walks on the grass'
    assert q(text).input_ids == q0(text).input_ids  # padding adds ids, never changes a tokenisation
    n, ids = _tokenizer(str(tmp_path / 'qwen2vl'), real_ids=True)
    assert n == 151657 and ids['<|vision_start|>'] == 151652 and ids['<|video_pad|>'] == 151656
    from transformers import AutoTokenizer

    from models.videoalign import REWARD_TOKENS
    tok = AutoTokenizer.from_pretrained(str(tmp_path / 'qwen2vl'))
    tok.add_tokens(list(REWARD_TOKENS), special_tokens=True)  # as load_videoalign does
    assert tok.convert_tokens_to_ids(list(REWARD_TOKENS)) == [151657, 151658, 151659]
    c = tiny_tokenizer(49408)
    assert len(c) == 49408 and (c.bos_token_id, c.eos_token_id) == (49406, 49407)
    plain = tiny_tokenizer()(text).input_ids  # the same BPE without the padding
    assert c(text).input_ids == [49406] + plain[1:-1] + [49407]


def test_build_with_tiny_sizes_writes_every_model_once(tmp_path):
    import tiny_clip
    import tiny_hunyuan
    import tiny_videoalign
    import tiny_wan
    sizes = (tiny_hunyuan.TINY, tiny_videoalign.TINY, {k: tiny_clip.TINY for k in R.CLIP})
    d = R.build(str(tmp_path), 2, sizes, tiny_wan.TINY)
    for k in ('hunyuan', 'wan'):
        assert os.path.isfile(os.path.join(d[k], 'model_index.json')), k
    assert os.path.isfile(os.path.join(d['videoalign'], 'checkpoint-1', 'model.pth'))
    for k in ('qwen', 'clip', 'pickscore'):
        assert os.path.isfile(os.path.join(d[k], 'config.json')), k
    stamp = {k: os.path.getmtime(v) for k, v in d.items()}
    assert R.build(str(tmp_path), 2, sizes, tiny_wan.TINY) == d and {k: os.path.getmtime(v) for k, v in d.items()} == stamp
