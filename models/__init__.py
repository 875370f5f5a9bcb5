"""
The model families: one file each, picked by the `_class_name` in a model directory's
model_index.json, and the one interface every family file provides (checked here, once, when a
family is first used: a file missing an item is one error that names it).

    HunyuanVideo15Pipeline -> models/hunyuan15.py     WanPipeline -> models/wan.py     ToyWorld -> models/toy.py

A new model is one more file and one more line in FAMILIES (docs/another_model.md). The policy
whatever the family (FSDP2, the guided velocity, sampling) is policy.py; nothing outside this
folder names a model class or a family.
"""
import importlib
import json
import os

FAMILIES = {'HunyuanVideo15Pipeline': 'hunyuan15', 'WanPipeline': 'wan', 'ToyWorld': 'toy', 'WanCausalPipeline': 'streaming.wan_causal', 'ToyWorldAR': 'streaming.toy_ar', 'ToyWorldSF': 'streaming.toy_sf',
            'ToyWorldStory': 'streaming.toy_story'}  # _class_name -> file
DEFAULT = 'hunyuan15'  # the family a directory that is not one is most likely meant to be

INTERFACE = {  # item: what it is
    'PIPELINE': 'the diffusers pipeline class name (model_index.json _class_name)',
    'TRANSFORMER': 'the diffusers transformer class name',
    'HUB_ID': 'where to download the weights',
    'DEFAULTS': 'dict: sample_steps, shift, cfg, fps, negative_prompt, num_frames, height, width, '
                'sample_prompts, sample_seeds',
    'LORA_TARGETS': 'the module names LoRA adapts',
    'load_transformer': '(path, meta, attention, backend) -> the float32 transformer, its attention set',
    'blocks': '(transformer) -> the FSDP and gradient-checkpointing units',
    'text_encoder': '(path, device) -> encode(prompts) -> [embeds, mask, ...] pairs, batch first',
    'forward': '(transformer, x, s, text) -> the velocity (B, C, F, h, w) at latents x, sigmas s',
    'load_decoder': '(path, device) -> decode(latents) -> frames (B, F, 3, H, W) in [0, 1]',
    'latent_shape': '(path, num_frames, height, width) -> (C, F, h, w)',
    'cp_plan': "(transformer) -> where sequence parallel splits and gathers (infra/sp.py)",
}
OPTIONAL = {  # a world with an exact reward of its own (the toy) provides reward and manifold_distance
    'guidance': '(transformer, s, cfg) -> the guidance scale of each sample at sigmas s (B,), given the '
                "run's cfg, for a family whose scale depends on the step (Wan 2.2 A14B's two experts); "
                'without it every sample has cfg',
    'reward': "(frames, prompts, fps) -> {'VQ', 'MQ', 'TA', ...: (B,)}, the reward interface of reward.py",
    'manifold_distance': '(frames) -> (B,) distance of each clip to the data manifold',
    'render': '(prompt, seed) -> a clean clip (F, 3, H, W) in [0, 1], the data: the reward-hacking alarm compares '
              'its watchers with their values on these (models/evaluate.py)',
    'generate': '(transformer, noise, text, gens, cfg, text_neg) -> latents (B, C, F, h, w): a family that samples by itself '
                '(streaming: block by block from a KV cache, streaming/__init__.py); sample.py and the held-out '
                'evaluation call it in place of their sampler',
}


def weights_missing(path, what, err, hub_id, local, hint=''):
    """The one-line stop (SystemExit) of a family whose weights cannot be read: what, where from, and
    the download that fixes it."""
    return SystemExit(f'could not load the {what} from {path!r} ({type(err).__name__}: {err}).\n'
                      f'Download the weights first, e.g.\n'
                      f'  hf download {hub_id} --local-dir {local}\n'
                      f'and pass --model={local}{hint}')


def hold_frozen(module, dtype, buffers=False):
    """A frozen module's floating parameters (and buffers) held in `dtype`, except diffusers'
    _keep_in_fp32_modules (norms, time embedding, Wan's rope tables): fp32 as its bf16 loading keeps them."""
    keep = getattr(module, '_keep_in_fp32_modules', None) or ()
    for name, t in [*module.named_parameters(), *(module.named_buffers() if buffers else ())]:
        if t.is_floating_point() and not any(k in name for k in keep):
            t.data = t.data.to(dtype)
    return module


def load_family(name):
    """The family file `name` (a value of FAMILIES), its interface checked."""
    module = name if '.' in name else f'models.{name}'  # a sibling family (streaming/) by its full name
    fam = importlib.import_module(module)
    missing = [item for item in INTERFACE if not hasattr(fam, item)]
    missing += [f"DEFAULTS['{k}']" for k in INTERFACE['DEFAULTS'].split(': ')[1].split(', ')
                if k not in getattr(fam, 'DEFAULTS', {})]
    if missing:
        raise TypeError(f'{module.replace(".", "/")}.py lacks {", ".join(missing)} of the model interface '
                        f'(models/__init__.py: INTERFACE)')
    return fam


def builders():
    """{absolute model directory: the command that builds it} of the toys the repository trains: a streaming
    toy's DIR (python -m its module) and a family's BUILT_DIRS (models/toy.py's second width); a relative
    directory is from the repository's root."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = {}
    for n in FAMILIES.values():
        fam = load_family(n)
        if '.' in n and getattr(fam, 'DIR', None):
            out[os.path.join(root, fam.DIR)] = f'python -m {n}'
        out.update({os.path.join(root, d): cmd for d, cmd in getattr(fam, 'BUILT_DIRS', {}).items()})
    return out


def family(path):
    """The family module of model directory `path` (see the module docstring)."""
    index = os.path.join(path, 'model_index.json')
    try:
        with open(index) as f:
            name = json.load(f)['_class_name']
    except (OSError, ValueError, KeyError) as e:
        built = None if os.path.exists(path) else builders().get(os.path.abspath(path))
        if built:
            raise SystemExit(f'{path!r} is not built (a toy model the repository trains): {built}')
        raise SystemExit(f'{path!r} is not a diffusers model directory ({index}: {type(e).__name__}).\n'
                         f'Download the weights first, e.g.\n'
                         f'  hf download {load_family(DEFAULT).HUB_ID} --local-dir weights/HunyuanVideo-1.5-480p_t2v\n'
                         f'and pass --model=weights/HunyuanVideo-1.5-480p_t2v (for the toy world: --model=assets/toy).')
    if name not in FAMILIES:
        raise SystemExit(f'{path!r} holds a {name}; supported: {", ".join(FAMILIES)} '
                         '(a new model family is one file: docs/another_model.md)')
    return load_family(FAMILIES[name])


def family_of(net):
    """The family module that runs transformer `net` (by its diffusers class, or a class of the family
    file itself such as wan.Experts; FSDP2-wrapped or not)."""
    for cls in type(net).__mro__:
        for name in FAMILIES.values():
            fam = load_family(name)
            if cls.__name__ == fam.TRANSFORMER or cls.__module__ == fam.__name__:
                return fam
    raise TypeError(f'no model family runs a {type(net).__name__}')
