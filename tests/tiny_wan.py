"""
A tiny Wan pipeline with random weights, built offline in about a second, for tests: every component
is the real class (diffusers' WanTransformer3DModel, AutoencoderKLWan and UniPC scheduler, the
transformers UMT5 encoder and T5 tokenizer), only small. Saved with WanPipeline.save_pretrained,
so anything that loads Wan-AI/Wan2.1-T2V-1.3B-Diffusers from a directory loads this one the same way.

    from tiny_wan import make_tiny_wan
    root = make_tiny_wan(tmp_path)              # Wan 2.1: VAE z_dim 16, 8x spatial
    root = make_tiny_wan(tmp_path, TINY_22)     # Wan 2.2 TI2V-5B's layout: z_dim 48, 16x, per-token timesteps
    root = make_tiny_wan(tmp_path, TINY_A14B)   # Wan 2.2 T2V-A14B's: two experts, boundary_ratio 0.875

Sizes as diffusers' own Wan tests build them (transformer patch (1, 2, 2), 2 heads x 12, 16 channels,
ffn 32, 2 layers, rope_max_seq_len 32; VAE base_dim 3), with a UMT5 encoder of d_model 16 in place
of their hub-downloaded T5. The tokenizer is transformers' T5Tokenizer (a tokenizers Unigram model) over
a word-level vocabulary: T5's <pad> 0, </s> 1, <unk> 2, a piece per word of WORDS, and single
characters as the fallback for any other word, so every prompt tokenises and ends with </s>.
Deterministic: the same weights and tokenizer on every call. Not a test file itself (no test_ prefix).
"""
import os
import string

import torch

SEED = 0  # every component is seeded, so two builds are bitwise identical
WORDS = ('a an the of in on at to and with is moving left right up down red green blue yellow circle square '
         'triangle cross car cat dog sign fox runs through deep snow pine forest dawn camera follows it low '
         'ground soft golden light falling breath visible cold air scene banner says reads number').split()
# every size of the pipeline in one dict: bench/rehearsal.py passes the released widths instead
# (its vae={}: AutoencoderKLWan's class defaults, which are Wan 2.1's VAE)
TINY = dict(
    vocab_size=None,  # UMT5 embedding rows (None: the tokenizer's own size; 256384 released)
    text=dict(d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2, relative_attention_num_buckets=8),
    vae=dict(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
             temperal_downsample=[False, True, True]),
    transformer=dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, ffn_dim=32, num_layers=2,
                     rope_max_seq_len=32),
    expand_timesteps=False,  # Wan 2.2 TI2V-5B: True (one timestep per video token)
    dtype=torch.float32,  # of the text encoder and VAE as built and saved
    transformer_dtype=torch.float32,  # of the saved transformer (the trainer loads it in fp32)
)
# Wan 2.2 TI2V-5B's layout: a VAE of 48 latent channels that patchifies 2x2 pixels first (12 channels
# in and out) and compresses 16x in space, a transformer of 48 channels, per-token timesteps; its
# latents_mean / latents_std are not 0 / 1 here, so the de-normalisation has something to get wrong
TINY_22 = dict(TINY, expand_timesteps=True, vae=dict(
    base_dim=3, z_dim=48, in_channels=12, out_channels=12, is_residual=True, patch_size=2, dim_mult=[1, 1, 1, 1],
    num_res_blocks=1, temperal_downsample=[False, True, True], scale_factor_spatial=16, scale_factor_temporal=4,
    latents_mean=[round(0.05 * i - 1.2, 4) for i in range(48)],
    latents_std=[round(0.5 + 0.03 * i, 4) for i in range(48)]))

# Wan 2.2 T2V-A14B's layout: Wan 2.1's parts with a second expert (transformer_2, other random weights)
# and the pipeline's boundary_ratio (0.875 released)
TINY_A14B = dict(TINY, boundary_ratio=0.875)


def make_tokenizer(words=WORDS):
    """T5Tokenizer over a word-level Unigram vocabulary (see the module docstring); len = 3 + 1 +
    words + characters. Ids follow T5's order: <pad> 0, </s> 1, <unk> 2."""
    from transformers import T5Tokenizer
    chars = [c for c in string.printable if not c.isspace()]
    # a word is one piece ('\u2581' marks a word start); characters cost more, so they only spell
    # out words that have no piece of their own
    vocab = [('<pad>', 0.0), ('</s>', 0.0), ('<unk>', 0.0), ('\u2581', -2.0)]
    vocab += [('\u2581' + w, -1.0) for w in dict.fromkeys(words)]
    vocab += [(c, -5.0) for c in chars] + [('\u2581' + c, -5.0) for c in chars]
    return T5Tokenizer(vocab=vocab, extra_ids=0, model_max_length=512)


def _cast(model, dtype):  # diffusers warns on any .to(dtype) of a model: cast only when it changes something
    return model if dtype == torch.float32 else model.to(dtype)


def make_tiny_pipeline(sizes=TINY):
    """The tiny WanPipeline in memory (CPU; float32 unless sizes['dtype'] says otherwise)."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    tokenizer = make_tokenizer()
    torch.manual_seed(SEED)
    text_encoder = UMT5EncoderModel(UMT5Config(
        vocab_size=sizes['vocab_size'] or len(tokenizer), **sizes['text'], feed_forward_proj='gated-gelu',
        dropout_rate=0.0, pad_token_id=0, eos_token_id=1)).to(sizes['dtype']).eval()  # umt5-xxl: gated-gelu

    torch.manual_seed(SEED + 1)
    vae = _cast(AutoencoderKLWan(**sizes['vae']), sizes['dtype']).eval()

    torch.manual_seed(SEED + 2)
    C = vae.config.z_dim  # latent channels (the class default, 16, where sizes['vae'] leaves it)
    transformer = _cast(WanTransformer3DModel(
        in_channels=C, out_channels=C, text_dim=sizes['text']['d_model'], **sizes['transformer']),
        sizes['transformer_dtype']).eval()
    two = {}
    if sizes.get('boundary_ratio') is not None:  # Wan 2.2 A14B: the low-noise expert, its own weights
        torch.manual_seed(SEED + 3)
        two = dict(boundary_ratio=sizes['boundary_ratio'], transformer_2=_cast(WanTransformer3DModel(
            in_channels=C, out_channels=C, text_dim=sizes['text']['d_model'], **sizes['transformer']),
            sizes['transformer_dtype']).eval())

    # the released scheduler (UniPC on flow sigmas, flow_shift 3.0); this project samples with its own
    # Euler / SDE steps (wan.py), the tests compare them with FlowMatchEulerDiscreteScheduler
    scheduler = UniPCMultistepScheduler(prediction_type='flow_prediction', use_flow_sigmas=True, flow_shift=3.0)
    return WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=scheduler,
                       transformer=transformer, expand_timesteps=sizes['expand_timesteps'], **two)


def make_tiny_wan(root, sizes=TINY):
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


if __name__ == '__main__':  # python tests/tiny_wan.py /tmp/tiny_wan [2.2 | a14b]
    import sys
    print(make_tiny_wan(sys.argv[1] if len(sys.argv) > 1 else '/tmp/tiny_wan',
                        TINY_22 if '2.2' in sys.argv[2:] else TINY_A14B if 'a14b' in sys.argv[2:] else TINY))
