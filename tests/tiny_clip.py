"""make_tiny_clip(root, kind) -> a directory: a tiny random CLIPModel in the released layout, offline, ~1 s.

kind 'clip' stands for openai/clip-vit-large-patch14 (patch 32 here, the old flat preprocessor_config.json
with bare-int sizes), kind 'pickscore' for yuvalkirstain/PickScore_v1 (patch 14 as CLIP-H, the newer
dict-sized preprocessor_config.json, logit_scale = log 100). Both: text and vision towers of 2 layers,
width 32, projection 16, 224x224 images, 77 text positions, and the text config's legacy
eos_token_id = 2, as the released configs have (the pooled token is then the argmax id, <|endoftext|>).
The tokenizer is a real CLIP byte-level BPE (transformers' CLIPTokenizer: '</w>' word ends, lowercase,
<|startoftext|> ... <|endoftext|>, padded with <|endoftext|>) over every byte, with a few merges trained
offline here; its ids follow the released order (bytes, bytes</w>, merges, then the two special tokens).
"""
import json
import math
import os

import torch

SEED = 0  # the random weights derive from it
MERGES_VOCAB = 600  # size the merge trainer aims for (bytes and bytes</w> come first regardless)
TEXT = 'a cat walks on the grass, a dog runs in the park at night. a red circle moving left on a beach'
# every size in one dict per kind: bench/rehearsal.py passes the released widths instead (CLIP-L: text 768,
# vision 1024, projection 768; PickScore's CLIP-H: text 1024, vision 1280, projection 1024; vocab 49408)
TINY = dict(vocab_size=None,  # None: the trained BPE's own size; else padded so the specials are 49406, 49407
            text=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2),
            vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2),
            projection_dim=16, patch_size=None)  # None: 32 for 'clip', 14 for 'pickscore' (released: 14 both)


def tiny_tokenizer(vocab_size=None):
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import CLIPTokenizer

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())  # the 256 byte characters
    bpe = Tokenizer(models.BPE(end_of_word_suffix='</w>'))
    bpe.normalizer = normalizers.Lowercase()
    bpe.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    bpe.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=MERGES_VOCAB, initial_alphabet=alphabet,
                                                         end_of_word_suffix='</w>', show_progress=False))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(' ')) for m in json.loads(bpe.to_str())['model']['merges']]
    vocab = {}
    for t in alphabet + [a + '</w>' for a in alphabet] + [''.join(m) for m in merges]:
        vocab.setdefault(t, len(vocab))
    if vocab_size:  # unreachable entries (no merge makes them) put the specials at their released ids
        vocab.update({f'<unused_{i}>': i for i in range(len(vocab), vocab_size - 2)})
    for t in ['<|startoftext|>', '<|endoftext|>']:
        vocab.setdefault(t, len(vocab))
    return CLIPTokenizer(vocab=vocab, merges=merges)


def make_tiny_clip(root, kind='clip', sizes=TINY):
    from transformers import CLIPConfig, CLIPModel

    path = os.path.join(root, {'clip': 'clip-vit-large-patch14', 'pickscore': 'PickScore_v1'}[kind])
    tok = tiny_tokenizer(sizes['vocab_size'])
    tok.save_pretrained(path)  # tokenizer.json, tokenizer_config.json
    text = dict(vocab_size=len(tok), **sizes['text'],
                max_position_embeddings=77, bos_token_id=tok.bos_token_id, eos_token_id=2, pad_token_id=1)
    vision = dict(**sizes['vision'], image_size=224,
                  patch_size=sizes['patch_size'] or (32 if kind == 'clip' else 14))
    config = CLIPConfig(text_config=text, vision_config=vision, projection_dim=sizes['projection_dim'],
                        logit_scale_init_value=math.log(100))
    torch.manual_seed(SEED)
    CLIPModel(config).save_pretrained(path)  # config.json, model.safetensors
    mean, std = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
    pre = dict(do_resize=True, resample=3, do_center_crop=True, do_normalize=True, image_mean=mean, image_std=std)
    if kind == 'clip':  # openai/clip-vit-large-patch14's file: sizes as bare ints
        pre.update(size=224, crop_size=224, feature_extractor_type='CLIPFeatureExtractor')
    else:
        pre.update(size={'shortest_edge': 224}, crop_size={'height': 224, 'width': 224}, do_rescale=True,
                   rescale_factor=1 / 255, do_convert_rgb=True, image_processor_type='CLIPImageProcessor')
    with open(os.path.join(path, 'preprocessor_config.json'), 'w') as f:
        json.dump(pre, f, indent=2)
    return path
