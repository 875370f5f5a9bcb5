"""
A tiny causal Wan model directory for tests (streaming/wan_causal.py): the tiny Wan pipeline of tiny_wan.py
(3 transformer layers: a cache bug that only shows in a layer after the first write needs more than two),
a generator checkpoint of random weights saved in the ORIGINAL Wan key names as the self-forcing line saves
them ({'generator': {'model.' + name: tensor}}), and the directory `python -m streaming.wan_causal` writes.
The original names are written here, by hand, from Wan's own module names (blocks.N.self_attn.q, ffn.0,
head.head, norm3 the cross-attention's norm, ...), not by inverting diffusers' conversion: the round trip
of test_wan_causal.py checks the two agree. Not a test file itself (no test_ prefix).
"""
import os

import torch

from tiny_wan import TINY, make_tiny_wan

LAYERS = 3
ORIGINAL = [  # diffusers name piece -> Wan's own, applied in this order
    ('condition_embedder.time_embedder.linear_1', 'time_embedding.0'),
    ('condition_embedder.time_embedder.linear_2', 'time_embedding.2'),
    ('condition_embedder.text_embedder.linear_1', 'text_embedding.0'),
    ('condition_embedder.text_embedder.linear_2', 'text_embedding.2'),
    ('condition_embedder.time_proj', 'time_projection.1'),
    ('.attn1.', '.self_attn.'), ('.attn2.', '.cross_attn.'),
    ('.to_out.0.', '.o.'), ('.to_q.', '.q.'), ('.to_k.', '.k.'), ('.to_v.', '.v.'),
    ('ffn.net.0.proj', 'ffn.0'), ('ffn.net.2', 'ffn.2'),
    ('.norm2.', '.NORM3.'), ('.norm3.', '.norm2.'), ('.NORM3.', '.norm3.'),  # Wan's norm3 is diffusers' norm2
    ('proj_out', 'head.head'),
]


def original_name(key):
    for a, b in ORIGINAL:
        key = key.replace(a, b)
    if key == 'scale_shift_table':
        return 'head.modulation'
    return key.replace('.scale_shift_table', '.modulation')


def random_generator(config, seed=0):
    """A diffusers-named state dict of random weights for a WanTransformer3DModel of `config`."""
    from diffusers import WanTransformer3DModel
    torch.manual_seed(seed)
    net = WanTransformer3DModel.from_config(config)
    for p in net.parameters():  # scale-shift tables and norms random too: nothing is left at its init
        p.data = torch.randn_like(p) * 0.1 + (p.data if p.dim() > 1 else 0)
    return net.state_dict()


def make_tiny_causal(root, layers=LAYERS, layout=None):
    """root/wan (the tiny pipeline), root/generator.pt (original names), root/causal (the model directory,
    `layout` written into its index if given). Returns (causal dir, the diffusers-named state dict)."""
    from diffusers import WanTransformer3DModel
    from streaming import wan_causal
    wan = make_tiny_wan(os.path.join(root, 'wan'), {**TINY, 'transformer': {**TINY['transformer'], 'num_layers': layers}})
    sd = random_generator(WanTransformer3DModel.load_config(wan, subfolder='transformer'))
    gen = os.path.join(root, 'generator.pt')
    torch.save({'generator': {'model.' + original_name(k): v for k, v in sd.items()}}, gen)
    out = wan_causal.make(os.path.join(root, 'causal'), wan, gen)
    if layout:
        import json
        index = os.path.join(out, 'model_index.json')
        d = json.load(open(index))
        json.dump({**d, 'layout': layout}, open(index, 'w'))
    return out, sd


def inputs(path):
    """What test_wan_causal's FSDP test generates on 1 process and on 2 ranks: 2 prompts, 21 frames."""
    from streaming import wan_causal
    text = wan_causal.text_encoder(path, 'cpu')(['a red circle moving left', 'a fox runs through deep snow'])
    noise = torch.randn(2, *wan_causal.latent_shape(path, 21, 16, 16), generator=torch.Generator().manual_seed(5))
    return noise, text, [torch.Generator().manual_seed(s) for s in (11, 12)]
