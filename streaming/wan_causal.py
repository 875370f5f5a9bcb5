"""
Streaming Wan: Wan 2.1 T2V 1.3B made block-causal (LongLive, Self-Forcing, CausVid), generating a clip
block by block from a rolling KV cache (streaming/__init__.py), behind the model interface (models/__init__.py).
A causal model directory names a diffusers Wan 2.1 directory (config, text encoder, VAE) and a generator
checkpoint in the original Wan key names (optionally a LoRA):

    hf download Wan-AI/Wan2.1-T2V-1.3B-Diffusers --local-dir weights/Wan2.1-T2V-1.3B
    hf download Efficient-Large-Model/LongLive-1.3B --local-dir weights/LongLive-ckpt
    python -m streaming.wan_causal weights/LongLive --wan=weights/Wan2.1-T2V-1.3B --layout=longlive \
        --generator=weights/LongLive-ckpt/models/longlive_base.pt --lora=weights/LongLive-ckpt/models/lora.pt
    python sample.py --model=weights/LongLive --device=cuda --prompts=prompts/eval.txt

The command checks the checkpoint (every key converted, present and of the config's shape) and writes
WEIGHTS/model_index.json ('WanCausalPipeline', the paths, the model's layout) and transformer/config.json;
nothing is copied. The layout (streaming.LAYOUTS) is how the model's own inference code samples it, read back
by load_transformer, so sample.py, the evaluation and kvpo sample it so: --layout=longlive (window 12, sink 3,
4 steps warped at shift 5; 120 latent frames = 477 video frames unless --num_frames says otherwise, as its
inference yaml), self_forcing (global causal attention, no sink, the same 4 steps; 21 latent frames), causvid
(global, steps 1000/757/522 unwarped on a shift-8 grid; 21 latent frames). Without
--layout the model is recognised from its files' names (exactly one of longlive, self_forcing / self-forcing,
causvid, memflow in the generator's or the LoRA's path), else the flag is required: the weights of these
models have the same keys. memflow is refused in one line: its memory bank is not built here.
The weights are those the model's release samples with (RELEASED_KEYS): Self-Forcing's self_forcing_dmd.pt
holds 'generator' and 'generator_ema', and its inference loads 'generator_ema'; LongLive and CausVid load
'generator' (--key picks another; the entry read is recorded in the index). Keys: the wrapper's 'model.'
prefix (and FSDP's or compile's) is stripped, then diffusers' own single-file conversion
(convert_wan_transformer_to_diffusers) renames them; a missing, unexpected or mismatched key is one
SystemExit naming it, before any weight is used. A LoRA (LongLive's {'generator_lora': peft state dict}, on
every Linear of the attention blocks) is merged into the weights: W + alpha / r B A (alpha = r unless the
index says lora_alpha).

Where it differs from the released code: RoPE positions are absolute frame indices for the whole video
(the cache keeps rotated keys), as Self-Forcing's; the cache is written at timestep 0 (context noise 0, as
all three release).
forward() (the interface's velocity of a whole clip at one sigma) is the block-causal masked forward, for
completeness; the model samples with generate(), which sample.py and the held-out evaluation call.
No classifier-free guidance (the distilled models use none) and no sequence parallel.
Tested by: python -m pytest tests/test_wan_causal.py tests/test_layouts.py
"""
import json
import os
import sys

import torch
import torch.nn.functional as F
from diffusers import WanTransformer3DModel

from models import wan
import streaming
from models.attention import ATTENTIONS, backend as dispatcher_backend

PIPELINE = 'WanCausalPipeline'
TRANSFORMER = 'CausalWanTransformer3DModel'
HUB_ID = 'Wan-AI/Wan2.1-T2V-1.3B-Diffusers'  # plus a causal generator checkpoint (module docstring)
DEFAULTS = dict(sample_steps=len(streaming.LAYOUT['timesteps']), shift=streaming.LAYOUT['shift'], cfg=1.0, fps=16,
                negative_prompt='', num_frames=None, height=480, width=832, sample_prompts=4, sample_seeds=1)
# num_frames None: the length the model's release samples (its layout's 'frames': LongLive 120 latent frames)
LORA_TARGETS = wan.LORA_TARGETS
LAYOUT = streaming.LAYOUT  # the default of make() (the CLI asks for --layout unless the files name the model)
LAYOUTS = streaming.LAYOUTS
NAMES = dict(longlive=('longlive',), self_forcing=('self_forcing', 'self-forcing', 'selfforcing'),
             causvid=('causvid',), memflow=('memflow',))  # what a file's path may say
MEMFLOW = ("MemFlow is not supported: its memory bank (bank 3 frames, recorded every 3 blocks, keys [sink, bank, "
           "local]) is not built here, and sampled with another layout it would make other videos than its authors'")
PREFIXES = ('model.', '_fsdp_wrapped_module.', '_orig_mod.', 'module.')  # wrappers' prefixes, stripped
GENERATOR_KEYS = ('generator', 'generator_ema', 'model', 'state_dict')  # where a training checkpoint keeps it
# the entry each model's released inference samples with, first if the checkpoint has it: Self-Forcing's
# inference.py --use_ema (its README's command) and demo.py load 'generator_ema'; LongLive and CausVid 'generator'
RELEASED_KEYS = dict(self_forcing=('generator_ema',) + GENERATOR_KEYS)


class CausalWanTransformer3DModel(WanTransformer3DModel):
    """diffusers' WanTransformer3DModel, unchanged but for its attention processors (streaming.install):
    its own class so that models.family_of finds this family's forward."""


def _strip(key):
    # wrappers nest in any order (FSDP or DDP around the model. wrapper, compile around FSDP): strip
    # until no prefix is left, not one pass in PREFIXES' order
    while not key.startswith('model.diffusion_model.'):
        p = next((p for p in PREFIXES if key.startswith(p)), None)
        if p is None:
            return key
        key = key[len(p):]
    return key


def read_state(file, key=None, keys=GENERATOR_KEYS, entry=None):
    """The generator's state dict of a checkpoint file (.pt with weights_only, or .safetensors): entry
    `key`, else the first of `keys` it has, else the file itself; wrapper prefixes stripped; one
    SystemExit if it cannot be read. entry: a list that gets the entry read (None: the file itself)."""
    try:
        if file.endswith('.safetensors'):
            from safetensors.torch import load_file
            sd = load_file(file)
        else:
            sd = torch.load(file, map_location='cpu', mmap=True, weights_only=True)
    except Exception as e:  # a truncated zip, a pickle with code, a missing file: the same one line
        raise SystemExit(f'{file}: not a readable checkpoint ({type(e).__name__}: {e})')
    for k in ((key,) if key else keys):
        if isinstance(sd.get(k), dict):
            sd = sd[k]
            break
    else:
        k = None
        if key:
            raise SystemExit(f'{file}: no {key!r} in the checkpoint (it holds {", ".join(map(str, sd)) or "nothing"})')
    if not sd or not all(torch.is_tensor(v) for v in sd.values()):
        raise SystemExit(f'{file}: not a state dict of tensors (keys: {", ".join(list(map(str, sd))[:5])})')
    if entry is not None:
        entry.append(k)
    return {_strip(k): v for k, v in sd.items()}


def generator_state(file, key, layout, entry=None):
    """The weights model `layout` samples with as its release does: entry `key` if named, else the first of
    the layout's RELEASED_KEYS the file has (Self-Forcing: 'generator_ema')."""
    return read_state(file, key, RELEASED_KEYS.get(layout.get('name'), GENERATOR_KEYS), entry)


def to_diffusers(sd):
    """Original Wan key names -> diffusers', by diffusers' single-file loader's own conversion."""
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers
    return convert_wan_transformer_to_diffusers(dict(sd))


def _name(module):
    """The diffusers name of an original-named Linear module (its weight key converted, '.weight' off)."""
    return next(iter(to_diffusers({module + '.weight': None})))[:-len('.weight')]


def merge_lora(sd, file, alpha=None):
    """sd with a peft LoRA state dict (file) merged: W + alpha / r B A per adapted Linear (original names)."""
    lora = read_state(file, keys=('generator_lora',))  # LongLive's entry, or a bare peft state dict
    pairs = {}
    for k, v in lora.items():
        k = k.replace('base_model.model.', '').replace('.default', '')
        for part in ('lora_A', 'lora_B'):
            if f'.{part}.' in k:
                pairs.setdefault(_name(_strip(k.split(f'.{part}.')[0])), {})[part] = v
    if not pairs:
        raise SystemExit(f'{file}: no lora_A / lora_B weights in it')
    out = dict(sd)
    for mod, ab in pairs.items():
        if set(ab) != {'lora_A', 'lora_B'} or mod + '.weight' not in out:
            raise SystemExit(f'{file}: LoRA of {mod!r} is {"half a pair" if len(ab) < 2 else "for no weight of the model"}')
        A, B, W = ab['lora_A'].float(), ab['lora_B'].float(), out[mod + '.weight']
        if (B.shape[0], A.shape[1]) != tuple(W.shape):
            raise SystemExit(f'{file}: LoRA of {mod!r} is {B.shape[0]}x{A.shape[1]}, the weight {tuple(W.shape)}')
        out[mod + '.weight'] = (W.float() + (alpha or A.shape[0]) / A.shape[0] * B @ A).to(W.dtype)
    return out


def check(sd, net, file):
    """One SystemExit naming what differs between sd and net's state dict (keys, shapes)."""
    want = {k: tuple(v.shape) for k, v in net.state_dict().items()}
    missing, extra = sorted(set(want) - set(sd)), sorted(set(sd) - set(want))
    bad = [f'{k} {tuple(sd[k].shape)} (the model: {want[k]})' for k in want if k in sd and tuple(sd[k].shape) != want[k]]
    for what, ks in (('missing', missing), ('unexpected', extra), ('of the wrong shape', bad)):
        if ks:
            raise SystemExit(f'{file}: {len(ks)} keys {what} after conversion to diffusers names, e.g. '
                             f'{", ".join(ks[:3])}: not a Wan generator checkpoint of this config')


def _index(path):
    try:
        with open(os.path.join(path, 'model_index.json')) as f:
            index = json.load(f)
    except (OSError, ValueError) as e:
        raise SystemExit(f'{path!r}: no readable model_index.json ({e}); write one with python -m streaming.wan_causal')
    here = lambda p: p if p is None or os.path.isabs(p) else os.path.join(path, p)
    return {**index, 'wan': here(index['wan']), 'generator': here(index['generator']), 'lora': here(index.get('lora'))}


def build(config, layout, cls=CausalWanTransformer3DModel, backend=None):
    """An uninitialised causal transformer on the meta device, its rope tables real (they are no weights)."""
    with torch.device('meta'):
        net = cls.from_config(config)
    net.rope = type(net.rope)(net.config.attention_head_dim, net.config.patch_size, net.config.rope_max_seq_len)
    for b in net.blocks:
        b.attn1.processor._attention_backend = b.attn2.processor._attention_backend = backend
    return streaming.install(net, layout)


def load_transformer(path, meta=False, attention=ATTENTIONS[0], backend='native'):
    """The causal transformer in float32: the Wan directory's config, the generator's weights (LoRA merged)."""
    index = _index(path)
    config = WanTransformer3DModel.load_config(index['wan'], subfolder='transformer')
    net = build(config, index.get('layout', LAYOUT), backend=dispatcher_backend(backend))
    if meta:
        return net
    sd = to_diffusers(generator_state(index['generator'], index.get('generator_key'), net.layout))
    if index['lora']:
        sd = merge_lora(sd, index['lora'], index.get('lora_alpha'))
    check(sd, net, index['generator'])
    net.load_state_dict({k: v.float() for k, v in sd.items()}, assign=True)
    return net.eval()


def blocks(net):
    return net.blocks


def text_encoder(path, device):
    return wan.text_encoder(_index(path)['wan'], device)


def context(text):
    """The text as Wan's cross-attention reads it: 512 tokens, zeros after the prompt's (wan.py)."""
    return F.pad(text[0].float(), (0, 0, 0, wan.TEXT_TOKENS - text[0].shape[1]))  # fp32: autocast casts on a GPU


def forward(net, x, s, text):
    """The velocity of a whole clip x (B, C, F, h, w) at sigmas s (B,), every block seeing its window."""
    n = x.shape[2]
    mask = streaming.frame_mask(n, net.layout)  # block-causal, windowed (teacher_mask's noisy half sees no earlier block)
    return streaming.forward_masked(net, x, s[:, None].expand(-1, n), context(text), range(n), mask)


def generate(net, noise, text, gens=None, cfg=1.0, text_neg=None):
    """Latents (B, C, F, h, w) block by block from the KV cache (streaming.generate); bf16 on a GPU.
    The distilled models run without guidance (cfg 1, DEFAULTS); cfg != 1 guides against text_neg."""
    neg = None if text_neg is None else context(text_neg)
    with torch.autocast('cuda', torch.bfloat16, enabled=noise.is_cuda):
        return streaming.generate(net, noise, context(text), gens, cfg=cfg, context_neg=neg).float()


def load_decoder(path, device):
    return wan.load_decoder(_index(path)['wan'], device)


def video_frames(layout):
    """The video frames of the length the model's release samples: 4 (F - 1) + 1 for its F latent frames (an index
    written without 'frames' takes the named model's)."""
    frames = layout.get('frames') or LAYOUTS.get(layout.get('name'), LAYOUT)['frames']
    return 4 * (frames - 1) + 1  # Wan 2.1's VAE: 4x temporal, the first frame alone


def latent_shape(path, num_frames, height, width):
    """(C, F, h, w) of num_frames video frames (None: the layout's released length, video_frames)."""
    index = _index(path)
    layout = index.get('layout', LAYOUT)
    shape = wan.latent_shape(index['wan'], num_frames or video_frames(layout), height, width)
    if shape[1] % layout['block']:
        raise SystemExit(f'{num_frames} frames are {shape[1]} latent frames: not whole blocks of {layout["block"]}')
    if layout.get('max_frames') and shape[1] > layout['max_frames']:  # global attention over a fixed cache
        raise SystemExit(f'{num_frames} frames are {shape[1]} latent frames: {layout["name"]} samples at most '
                         f'{layout["max_frames"]} (its released cache)')
    return shape


def cp_plan(net):
    raise SystemExit('sequence parallel does not split a streaming model (its blocks are 3 frames): sp_size=1')


def recognise(*files):
    """The model a checkpoint is, from its files' paths (the weights of all have Wan's keys): the one name of
    NAMES they say, else None."""
    said = {name for name, words in NAMES.items() for f in files if f for w in words if w in f.lower()}
    return said.pop() if len(said) == 1 else None


def layout_of(name, generator, lora=None):
    """The layout dict of `name` (None: recognised from the files); one SystemExit for MemFlow or none."""
    name = name or recognise(generator, lora)
    if name == 'memflow':
        raise SystemExit(MEMFLOW)
    if name not in LAYOUTS:
        raise SystemExit(f'{generator}: which model is it? pass --layout={"|".join(LAYOUTS)} (its keys are Wan\'s '
                         f'whichever model trained it, and each samples with its own layout)' if name is None else
                         f'--layout={name}: not one of {", ".join(LAYOUTS)} (memflow: not supported)')
    return LAYOUTS[name]


def make(out, wan_dir, generator, lora=None, key=None, lora_alpha=None, layout='longlive'):
    """Check a causal checkpoint against wan_dir's config, then write the causal model directory `out` with
    the layout of model `layout` (a LAYOUTS name; None: recognised from the files' names)."""
    layout = layout_of(layout, generator, lora)
    config = WanTransformer3DModel.load_config(wan_dir, subfolder='transformer')
    entry = []  # the checkpoint's entry read: recorded, so that every reader samples the same weights
    sd = to_diffusers(generator_state(generator, key, layout, entry))
    if lora:
        sd = merge_lora(sd, lora, lora_alpha)
    check(sd, build(config, layout), generator)
    os.makedirs(os.path.join(out, 'transformer'), exist_ok=True)
    rel = lambda p: p and os.path.relpath(os.path.abspath(p), os.path.abspath(out))
    with open(os.path.join(out, 'model_index.json'), 'w') as f:
        json.dump(dict(_class_name=PIPELINE, wan=rel(wan_dir), generator=rel(generator), generator_key=entry[0],
                       lora=rel(lora), lora_alpha=lora_alpha, layout=layout), f, indent=1)
    with open(os.path.join(out, 'transformer', 'config.json'), 'w') as f:  # sizes for policy.transformer_config
        json.dump({**config, '_class_name': TRANSFORMER}, f, indent=1)
    return out


def main(argv):
    import argparse
    ap = argparse.ArgumentParser(description='write a causal Wan model directory (module docstring)')
    ap.add_argument('out')
    ap.add_argument('--wan', required=True)
    ap.add_argument('--generator', required=True)
    ap.add_argument('--lora')
    ap.add_argument('--key', help="the checkpoint's generator entry: generator or generator_ema (default: what the "
                                  "model's release samples with, RELEASED_KEYS: Self-Forcing generator_ema)")
    ap.add_argument('--lora_alpha', type=float)
    ap.add_argument('--layout', help=f'the model: {"|".join(NAMES)} (default: the one its files\' names say)')
    a = ap.parse_args(argv)
    out = make(a.out, a.wan, a.generator, a.lora, a.key, a.lora_alpha, a.layout)
    index = json.load(open(os.path.join(out, 'model_index.json')))
    print('wrote', out, 'with the layout of', index['layout']['name'], 'sampling', index['generator_key'] or 'the file')


if __name__ == '__main__':
    main(sys.argv[1:])
