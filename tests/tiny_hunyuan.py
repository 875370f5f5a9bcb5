"""
A tiny HunyuanVideo 1.5 pipeline with random weights, built offline in a few seconds, for tests:
every component is the real class (the diffusers transformer and VAE, the transformers Qwen2.5-VL
text model and T5 encoder, Qwen2 and ByT5 tokenizers, the flow-match scheduler, the CFG guider),
only small. Saved in diffusers layout, so anything that loads the real 480p pipeline from a
directory loads this one the same way.

    from tiny_hunyuan import make_tiny_hunyuan
    root = make_tiny_hunyuan(tmp_path)  # -> str, a HunyuanVideo15Pipeline.from_pretrained() dir

The transformer's qk-norm gains (norm_q, norm_k, norm_added_q, norm_added_k of every block) are
random, not RMSNorm's initial ones: a processor that normalises the text keys with the query's norm,
or applies rope before the qk-norm, then differs from diffusers' (tests/test_attention.py).
Deterministic: the same weights and tokenizer on every call. Not a test file itself (no test_ prefix).
"""
import inspect
import os

import torch

# ----------------------------------------------------------------------------- sizes

LATENT_CHANNELS = 4  # C (32 in the real VAE)
VAE_CHANNELS = (8, 8, 16, 16, 16)  # encoder block widths; 5 blocks as in the real VAE, which keeps
                                   # its 16x spatial / 4x temporal compression (latent = (C, (F-1)//4+1, H//16, W//16))
TEXT_HIDDEN = 16  # Qwen2.5-VL hidden size (3584 real) = the transformer's text_embed_dim
BYT5_DIM = 8  # ByT5 d_model (1472 real) = the transformer's text_embed_2_dim
IMAGE_EMBED_DIM = 12  # SigLIP width (1152 real); t2v feeds zeros of this width
SEED = 0  # every component is seeded, so two builds are bitwise identical
# every size of the pipeline in one dict: bench/rehearsal.py passes the real widths instead
TINY = dict(
    vocab_size=None,  # Qwen text vocabulary (None: the trained BPE's own size; 152064 real)
    text=dict(hidden_size=TEXT_HIDDEN, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2,
              num_key_value_heads=1, mrope_section=[1, 1, 2]),  # the sections split head_dim / 2 over (t, h, w)
    byt5=dict(d_model=BYT5_DIM, d_kv=4, d_ff=16, num_layers=1, num_heads=2),
    vae=dict(latent_channels=LATENT_CHANNELS, block_out_channels=VAE_CHANNELS, layers_per_block=1),
    transformer=dict(num_layers=2, num_refiner_layers=1, num_attention_heads=2, attention_head_dim=8,
                     image_embed_dim=IMAGE_EMBED_DIM, rope_axes_dim=(2, 2, 4), task_type='t2v'),
    dtype=torch.float32,  # of the text encoders and the VAE as built and saved (the trainer loads them in bf16)
    transformer_dtype=torch.float32,  # of the saved transformer (the trainer loads it in fp32)
)

# a Qwen-style chat template (written for this test; the pipeline only needs the ChatML layout)
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def _system_message():
    # the pipeline's own system prompt (a default argument of its encoder), so the tokenizer can be
    # fitted to it
    from diffusers import HunyuanVideo15Pipeline
    sig = inspect.signature(HunyuanVideo15Pipeline._get_mllm_prompt_embeds)
    return sig.parameters['system_message'].default


# Qwen2.5's special tokens, from id 151643 on in the real tokenizer (vocab_size pads up to there)
QWEN25_SPECIAL = ('<|endoftext|>', '<|im_start|>', '<|im_end|>', '<|object_ref_start|>', '<|object_ref_end|>',
                  '<|box_start|>', '<|box_end|>', '<|quad_start|>', '<|quad_end|>', '<|vision_start|>',
                  '<|vision_end|>', '<|vision_pad|>', '<|image_pad|>', '<|video_pad|>', '<tool_call>',
                  '</tool_call>', '<|fim_prefix|>', '<|fim_middle|>', '<|fim_suffix|>', '<|fim_pad|>',
                  '<|repo_name|>', '<|file_sep|>')
QWEN25_FIRST_SPECIAL = 151643  # id of <|endoftext|> in Qwen2.5's tokenizer


def make_tokenizer(real_ids=False):
    """A byte-level BPE Qwen2Tokenizer with ChatML special tokens. Its merges are trained on the
    pipeline's system prompt, so the chat prefix "<|im_start|>system\\n{system}<|im_end|>\\n
    <|im_start|>user\\n" is exactly 108 tokens, as with the real Qwen tokenizer: the pipeline's
    crop_start=108 then cuts exactly the template, as it does for the real model. Any other text
    falls back to the 256 byte tokens.
    real_ids: the BPE vocabulary is padded with unreachable entries ('<unused_i>', never produced by a
    merge) so that Qwen2.5's 22 special tokens sit at their real ids 151643..151664 (len 151665)."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX
    bpe = Tokenizer(models.BPE())  # the same normalizer and pre-tokenizer Qwen2Tokenizer builds
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior='isolated'),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())  # the 256 byte symbols
    trainer = trainers.BpeTrainer(vocab_size=1000, min_frequency=1, initial_alphabet=alphabet,
                                  show_progress=False)  # 1000 > what the corpus allows: merge everything
    bpe.train_from_iterator([_system_message(), 'system\n', 'user\n', 'assistant\n'], trainer)
    vocab, specials = bpe.get_vocab(), ['<|im_start|>', '<|im_end|>']
    if real_ids:
        vocab.update({f'<unused_{i}>': i for i in range(len(vocab), QWEN25_FIRST_SPECIAL)})
        vocab.update({t: QWEN25_FIRST_SPECIAL + i for i, t in enumerate(QWEN25_SPECIAL)})
        specials = list(QWEN25_SPECIAL[1:])
    tok = Qwen2Tokenizer(vocab=vocab, merges=_merges(bpe), errors='replace', unk_token=None,
                         bos_token=None, eos_token='<|im_end|>', pad_token='<|endoftext|>',
                         additional_special_tokens=specials,
                         model_max_length=131072, padding_side='right')  # valid tokens first
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _merges(bpe):
    # the trained merges in rank order as (left, right) pairs, read back from the tokenizer's JSON
    import json
    merges = json.loads(bpe.to_str())['model']['merges']  # ['a b', ...] or [['a', 'b'], ...]
    return [tuple(m.split(' ') if isinstance(m, str) else m) for m in merges]


def _cast(model, dtype):  # diffusers warns on any .to(dtype) of a model: cast only when it changes something
    return model if dtype == torch.float32 else model.to(dtype)


def make_tiny_pipeline(sizes=TINY):
    """The tiny HunyuanVideo15Pipeline in memory (CPU; float32 unless sizes['dtype'] says otherwise).
    sizes: TINY, or the same keys with other values (bench/rehearsal.py: the real widths)."""
    from diffusers import (AutoencoderKLHunyuanVideo15, FlowMatchEulerDiscreteScheduler,
                           HunyuanVideo15Pipeline, HunyuanVideo15Transformer3DModel)
    from diffusers.guiders import ClassifierFreeGuidance
    from transformers import (ByT5Tokenizer, Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel, T5Config,
                              T5EncoderModel)

    tokenizer = make_tokenizer(real_ids=sizes['vocab_size'] is not None)
    tokenizer_2 = ByT5Tokenizer()  # bytes + 3 specials + 125 extra ids = 384, no vocab file needed
    text = dict(sizes['text'])
    mrope = text.pop('mrope_section')
    dtype = sizes['dtype']

    torch.manual_seed(SEED)
    text_encoder = Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(
        vocab_size=sizes['vocab_size'] or len(tokenizer), **text, max_position_embeddings=2048,
        # multimodal rope: the sections split head_dim / 2 frequencies over (t, h, w)
        rope_parameters={'rope_type': 'default', 'rope_theta': 1e6, 'mrope_section': mrope},
        bos_token_id=None, eos_token_id=tokenizer.convert_tokens_to_ids('<|im_end|>'),
        pad_token_id=tokenizer.pad_token_id)).to(dtype).eval()  # >= 3 layers: the pipeline reads hidden_states[-3]

    torch.manual_seed(SEED + 1)
    text_encoder_2 = T5EncoderModel(T5Config(
        vocab_size=len(tokenizer_2), **sizes['byt5'],
        feed_forward_proj='gated-gelu', dropout_rate=0.0)).to(dtype).eval()  # ByT5 is a gated-gelu T5

    torch.manual_seed(SEED + 2)
    vae = _cast(AutoencoderKLHunyuanVideo15(**sizes['vae']), dtype).eval()  # bf16 at real width: half the load

    torch.manual_seed(SEED + 3)
    C = sizes['vae']['latent_channels']
    transformer = _cast(HunyuanVideo15Transformer3DModel(
        in_channels=2 * C + 1, out_channels=C,  # [latents, condition latents, condition mask]
        text_embed_dim=text['hidden_size'], text_embed_2_dim=sizes['byt5']['d_model'],
        **sizes['transformer']), sizes['transformer_dtype']).eval()  # rope axes sum to the head dim

    random_norm_gains(transformer)
    return HunyuanVideo15Pipeline(
        text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer, vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),  # the 480p shift
        text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2,
        guider=ClassifierFreeGuidance(guidance_scale=6.0))


def random_norm_gains(transformer, seed=SEED + 4):
    """Every block's four qk-norm gains drawn from U(0.5, 1.5), each its own (a trained model's are
    not 1): with gains of 1 the four norms are the same function, and a mix-up between them is invisible."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for block in transformer.transformer_blocks:
            for name in ('norm_q', 'norm_k', 'norm_added_q', 'norm_added_k'):
                w = getattr(block.attn, name).weight
                w.copy_(0.5 + torch.rand(w.shape, generator=g))
    return transformer


def make_tiny_hunyuan(root, sizes=TINY):
    """Build the tiny pipeline and save it under root in diffusers layout; returns str(root).
    Reuses root if a previous call already completed there (model_index.json is written last)."""
    root = str(root)
    if not os.path.isfile(os.path.join(root, 'model_index.json')):
        tmp = root.rstrip('/') + '.tmp'
        make_tiny_pipeline(sizes).save_pretrained(tmp, safe_serialization=True)
        os.makedirs(os.path.dirname(os.path.abspath(root)), exist_ok=True)
        if os.path.isdir(root) and not os.listdir(root):
            os.rmdir(root)  # e.g. a fresh tmp_path_factory.mktemp() directory
        os.replace(tmp, root)  # a half-written build never looks complete
    return root


if __name__ == '__main__':  # python tests/tiny_hunyuan.py /tmp/tiny_hunyuan
    import sys
    print(make_tiny_hunyuan(sys.argv[1] if len(sys.argv) > 1 else '/tmp/tiny_hunyuan'))
