"""
Wan 2.1 T2V 1.3B and 14B at full size (models/wan.py; assets/wan21_t2v_*_transformer.json, the released
configs): their rows of bench/fullsize.py's estimate, measured as the HunyuanVideo rows are
(bench/fullsize_measure.py's measure, with this module's WAN functions) at their own clip size,
81x480x832: a full fine-tune on 8 GPUs (FSDP2) and on one GPU (no FSDP: fp32 master weights, bf16
autocast, as load_policy keeps them), and LoRA r64 on one GPU; their own section of fullsize.md and
rows of the README block. Wan's attention has no mask (wan.py): on a GPU flash attention takes it,
which allocates what the memory-efficient kernel does.

    python -m bench.fullsize --only=wan,wansp --reuse=True  # the Wan 2.1 rows alone (the others read back),
    python -m bench.fullsize --reuse=True              # then the report and README block from every kept run

Not a script: its settings (wan_*) are set from bench.fullsize's command line.
Tested by: python -m pytest tests/test_fullsize.py
"""
from types import SimpleNamespace

import torch

from bench import fullsize_measure as FM
from bench.common import table
from bench.fullsize_measure import GiB, build, load_config
from infra.configurator import number
from models.policy import _cat_text

# ----------------------------------------------------------------------------- settings
# set from bench.fullsize's command line (it imports them and hands the values back: bench/common.py's share)
wan_models = ('1.3b', '14b')    # Wan 2.1 T2V rows (assets/wan21_t2v_<m>_transformer.json)
wan_clip = (81, 480, 832)       # Wan 2.1's frames x H x W: 21 x 30 x 52 = 32,760 video tokens
wan_clips_1gpu = 8              # clips an iteration on one GPU (config/wan_1gpu.py: 2 prompts x G 4)
wan_sp = 2                      # sp degree of one more 14B row, full FT on 8 GPUs (part 'wansp'; 0: none)
RULES = dict(wan_models=((lambda v: len(v) > 0 and all(m in ('1.3b', '14b') for m in v)), "some of '1.3b', '14b'"),
             wan_clip=((lambda v: len(v) == 3 and v[0] % 4 == 1 and v[1] % 16 == 0 and v[2] % 16 == 0
                        and min(v) >= 1), '(frames, height, width): 1 + 4k frames, sides '
                                          'multiples of 16 (8x VAE, 2x2 patches)'),
             wan_clips_1gpu=number(1), wan_sp=number(0, then=' (0 or 1: no sp row)'))  # configure()'s rules for them
# -----------------------------------------------------------------------------

WAN_SETUPS = (('full FT, 8 GPUs', 'fsdp8'), ('full FT, 1 GPU', 'full1'), ('LoRA r64, 1 GPU', 'lora1'))


def wan_tokens(Fr, H, W):
    """Wan 2.1's video tokens for Fr frames at H x W (VAE 4x in time, 8x in space; 2x2 patches)."""
    return ((Fr - 1) // 4 + 1) * (H // 16) * (W // 16)


def wan_inputs(cfg, n, Fr, H, W, L1, L2, dev):
    """fullsize_measure.inputs for Wan: the stored rollout of n clips (16 latent channels, 8x spatial), and one
    text tensor of wan.TEXT_TOKENS (512) UMT5 tokens with its mask (L1, L2 unused: Wan pads to 512)."""
    from models import wan
    C, f, h, w = cfg['out_channels'], (Fr - 1) // 4 + 1, H // 8, W // 8
    store = dict(xs=torch.randn(n, FM.num_steps + 1, C, f, h, w, device=dev),   # float32, as sample() keeps
                 means=torch.randn(n, FM.num_steps, C, f, h, w, device=dev))
    text = lambda: [torch.randn(1, wan.TEXT_TOKENS, cfg['text_dim'], device=dev), torch.ones(1, wan.TEXT_TOKENS, device=dev)]
    return store, text(), text()


def wan_velocity(model, x, s, text, text_neg, bf16):
    """model.velocity for Wan with CFG (wan.forward, diffusers' own transformer forward), both
    branches in one batch; CPU autocast stands in for CUDA's."""
    from models import wan
    B = x.shape[0]
    with torch.autocast(x.device.type, torch.bfloat16, enabled=bf16):
        v = wan.forward(model, torch.cat([x, x]), torch.cat([s, s]), _cat_text(text, text_neg)).float()
    return v[B:] + 5.0 * (v[:B] - v[B:])                                 # (B, ...) guided


def wan_build(cfg, lora=0, checkpointing=True, bf16_base=True, attn=None):
    from diffusers import WanTransformer3DModel
    return build(cfg, lora, checkpointing, bf16_base, cls=WanTransformer3DModel)


def wan_cp_plan(model):
    from models import wan
    return wan.cp_plan(model)


WAN = SimpleNamespace(build=wan_build, forward=None, velocity=wan_velocity, inputs=wan_inputs, tokens=wan_tokens,
                      blocks=lambda m: m.blocks, text=lambda L1, L2: 512, cp_plan=wan_cp_plan)


def wan_runs(run):
    """The Wan 2.1 rows: each model of wan_models at wan_clip, a training micro-step and a rollout
    forward for every setup of WAN_SETUPS (one GPU: wan_clips_1gpu clips stored, one per rollout forward),
    and for 14B the full fine-tune on 8 GPUs at sp wan_sp too (keys 'wansp<n>_...': part 'wansp')."""
    out, (Fr, H, W) = [], wan_clip
    for m in wan_models:
        cfg = load_config(f'assets/wan21_t2v_{m}_transformer.json')
        setups = WAN_SETUPS + (((f'full FT, 8 GPUs, sp {wan_sp}', 'fsdp8'),) if m == '14b' and wan_sp > 1 else ())
        for name, key in setups:
            kw = dict(world=FM.gpus) if key == 'fsdp8' else dict(world=0, n_store=wan_clips_1gpu, rollout_n=1)
            n = wan_sp if 'sp' in name else 1
            for what in ('train', 'rollout'):
                r = run(f'wan{"sp" + str(n) if n > 1 else ""}_{m}_{key}_{what}_{Fr}x{H}x{W}', what, Fr, H, W,
                        model_cfg=cfg, fam=WAN, lora=FM.lora_rank if key == 'lora1' else 0, sp=n, **kw)
                if r is not None:
                    out.append(dict(r, model=f'Wan 2.1 {m.upper()}', setup=name,
                                    attention='WanAttnProcessor (no mask)'))  # whatever `processor` says
    return out


def wan_extras(videoalign_params):
    """Bytes resident beside the transformer in a Wan run: the VAE in float32 (wan.load_decoder; the
    class defaults are Wan 2.1's VAE) and VideoAlign in bf16 (videoalign_params: bench.fullsize's
    setting); UMT5 is freed before training."""
    from diffusers import AutoencoderKLWan
    with torch.device('meta'):
        vae_P = sum(p.numel() for p in AutoencoderKLWan().parameters())
    return {'VAE (fp32)': 4 * vae_P, 'VideoAlign (bf16)': 2 * videoalign_params}


def wan_flops(r):
    """TFLOP of one pass (one clip, one CFG branch; at sp n, all n ranks of its group): a forward, or a
    forward + backward (with the block recompute) of the update."""
    ph, n = r['phases'], r.get('sp', 1)
    if r['what'] == 'rollout':
        return n * ph['rollout forward']['flops'] / (2 * (FM.rollout_batch if r['world'] else 1)) / 1e12
    return n * (ph['policy forward']['flops'] + ph['backward']['flops']) / 2 / 1e12


def wan_report(out, g):
    """results/fullsize.md's Wan 2.1 section."""
    runs, extras, c = out['wan'], out['wan_extras'], out['config']
    Fr, H, W = c.get('wan_clip', wan_clip)
    md = [f'### Wan 2.1 T2V 1.3B and 14B at {Fr}x{H}x{W} (wan.py)', '',
          f'The same micro-step and rollout forward as above, with WanTransformer3DModel built from the released configs '
          f'(assets/wan21_t2v_*_transformer.json) and called through wan.forward: {wan_tokens(Fr, H, W):,} video tokens '
          '(VAE 4x in time, 8x in space, 2x2 patches), 512 UMT5 text tokens of width 4096 attended by every block\'s '
          'cross-attention without a mask, CFG 2 branches. Full fine-tune on 8 GPUs: FSDP2 as above, '
          f'{c["clips"] // FM.gpus} clips stored a rank, {c["rollout_batch"]} per rollout forward. On one GPU (train.py '
          'without torchrun): no FSDP, the full fine-tune keeps fp32 master weights, AdamW state, gradients and the fp32 '
          f'anchor on the device, bf16 autocast; LoRA r{c["lora_rank"]} keeps the frozen base in bf16 and adapters, AdamW '
          f'and anchor in fp32; {c.get("wan_clips_1gpu", wan_clips_1gpu)} clips stored, one per rollout forward. '
          f'14B also at sp {c.get("wan_sp", wan_sp)} (sp.py over the same 8 ranks, diffusers\' own _cp_plan: a rank '
          'runs the blocks on its share of the video tokens and the whole text), its sp group\'s clips stored. '
          'The optimizer state is AdamW\'s (8 bytes a trained parameter); train.py\'s default Muon keeps 4 on its 2-D '
          'matrices, so the full fine-tune\'s optimizer row is an upper bound. Resident beside the transformer: '
          + ', '.join(f'{k} {g(v)} GiB' for k, v in extras.items()) + ' (the UMT5-XXL text encoder is freed once the '
          'prompts are cached).', '']
    cats = list(runs[0]['categories'])
    name = lambda r: f'{r["model"]}, {r["setup"]}: {r["what"]}'
    rows = [[k] + [g(r['categories'][k]) for r in runs] for k in cats]
    rows.append(['peak phase'] + [r['peak_phase'] for r in runs])
    rows.append(['**total with VAE and VideoAlign**'] + [f'**{g(r["categories"]["total"] + sum(extras.values()))}**'
                                                          for r in runs])
    rows.append([f'fits {c["gpu_gb"]:.0f} GB'] + ['yes' if (r['categories']['total'] + sum(extras.values())) / GiB
                                                  <= c['gpu_gb'] else 'no' for r in runs])
    rows.append(['TFLOP a pass (one clip, one CFG branch; all ranks of an sp group)'] + [f'{wan_flops(r):.1f}' for r in runs])
    md += [table(['GiB per GPU'] + [name(r) for r in runs], rows), '']
    P = {r['model']: r['P'] for r in runs}
    md += ['Parameters: ' + ', '.join(f'{m} {p / 1e9:.3f} B' for m, p in P.items()) + '. A pass is one clip through '
           'the transformer for one CFG branch: a forward (rollout, evaluation) or a forward and a backward with its '
           'block recompute (update); the anchor\'s forward costs a forward. An iteration of G clips a prompt and N '
           'steps, all trained, costs about G x N x 2 x (forward + anchor forward + forward-backward) per prompt.', '']
    return md
