"""
Wan 2.2 T2V-A14B at full size (models/wan.py: Experts; config/wan22_a14b.py): two experts of Wan 2.1
14B's shape (assets/wan21_t2v_14b_transformer.json) as one policy, FSDP2 over 8 ranks as train.py
applies it (models/policy.py shard: both experts' blocks, then the root Experts), a training
micro-step and a rollout forward at each of a14b_clips and sp degrees a14b_sp, for the setups of
SETUPS; its own section of bench/fullsize.py's results/fullsize.md and rows of its README block.

    python -m bench.fullsize --only=a14b --reuse=True   # these rows (every other run read back)
    python -m bench.fullsize --reuse=True               # then the report and README block from every kept run

Depth: a 40-layer expert pair takes 10-60 CPU-minutes a run here, so each setup is measured with
a14b_depths layers per expert and carried to 40 on the line through the first two (line()): with
per-block FSDP and per-block checkpointing every byte category of a phase's peak, and its FLOPs, is
a + b x layers. The third depth checks the line; the same extrapolation of Wan 2.1 14B from
shallow builds gives its full-depth runs (validation_runs; 81x480x832, sp 1 and 2, train and rollout:
every category and FLOP count exact to rounding, the report's table). At 2 layers FSDP's prefetch has
no next block at the backward's peak (one all-gather buffer less): depths start at 4. All of it, the
validation included: about 20 minutes on 2 busy cores.

In a micro-step one expert runs on real tokens (the high-noise one: train_step's sigma 0.9, a
rollout's 1.0); Experts.forward routes each sample by its sigma and, in the update, also runs the
other expert on one token (a trained expert always, a frozen one where another rank's samples need it:
the worst case, taken here), so ranks enter the same FSDP collectives. forward() is that computation
with the routing fixed (fake tensors cannot branch on a mask's values); tests/test_fullsize.py checks
it against Experts.forward. With one expert trained, the measured micro-step is the trained expert's;
a micro-step of the frozen one keeps no activations for backward, so it peaks lower (measured the
same way once: 56 GiB against 101 at 81x480x832, sp 1, the frozen expert fp32).

The "offloaded" figure is computed, not measured (train.py does not offload): the peak less the idle
expert's resident state (its sharded params and, if it trains, its grads, AdamW state and anchor),
read off the measured categories (idle_bytes), as if that state lived in host memory.

Not a script: its settings (a14b_*) are set from bench.fullsize's command line.
Tested by: python -m pytest tests/test_fullsize.py
"""
import json
from types import SimpleNamespace

import torch

from bench import fullsize_wan as FW
from bench.common import table
from bench.fullsize_measure import GiB, categories, load_config
from infra.configurator import number

# ----------------------------------------------------------------------------- settings
# set from bench.fullsize's command line (it imports them and hands the values back: bench/common.py's share)
a14b_config = 'assets/wan21_t2v_14b_transformer.json'  # each expert's shape (Wan 2.1 14B's, 40 layers)
a14b_clips = ((81, 480, 832), (81, 720, 1280))  # frames x H x W: 32,760 and 75,600 video tokens
a14b_sp = (1, 2, 4)             # sequence parallel degrees (sp.py over the 8 FSDP ranks; 40 heads)
a14b_depths = (4, 6, 8)         # layers per expert measured: the line through the first two, the third checks it
a14b_steps = 40                 # rollout steps a stored clip keeps (config/wan22_a14b.py: Wan's recipe)
a14b_rollout_batch = 1          # clips per rollout forward and rank (config/wan22_a14b.py)
RULES = dict(a14b_depths=((lambda v: len(v) >= 2 and len(set(v)) == len(v) and min(v) >= 4),
                          'two or more distinct layer counts, each at least 4 (FSDP prefetch)'),
             a14b_sp=((lambda v: len(v) > 0 and all(40 % n == 0 and 8 % n == 0 for n in v)),
                      'sp degrees dividing the 40 heads and the 8 ranks'),
             a14b_clips=((lambda v: len(v) > 0 and all(FW.RULES['wan_clip'][0](c) for c in v)),
                         '(frames, height, width) triples: ' + FW.RULES['wan_clip'][1]),
             a14b_steps=number(1), a14b_rollout_batch=number(1))
# -----------------------------------------------------------------------------
LAYERS = 40  # Wan 2.1 14B's blocks, and each A14B expert's
# (name, key, experts that train, dtype of a frozen expert, LoRA rank, name in the README)
SETUPS = (('full FT, both experts', 'both', 'both', None, 0, 'full FT of both'),
          ('full FT, one expert, other frozen fp32', 'one', 'high', torch.float32, 0, 'of one (other fp32)'),
          ('full FT, one expert, other frozen bf16 (train.py on GPUs)', 'onebf16', 'high', torch.bfloat16, 0,
           'full FT of one (other frozen bf16)'),
          ('LoRA r64, both experts', 'lora', 'both', None, 64, 'LoRA r64 on both'))


def build(cfg, experts='both', frozen=None, lora=0):
    """Experts of two WanTransformer3DModels of config cfg on the meta device, as models/policy.py's
    load_policy makes them under FSDP: LoRA adapters (fp32) on an fp32 base; experts != 'both': the
    other frozen and held in `frozen` (Experts.freeze: bf16 is train.py's on GPUs)."""
    from diffusers import WanTransformer3DModel as T
    from models import wan
    with torch.device('meta'):
        net = wan.Experts(T.from_config(cfg), T.from_config(cfg), 0.875)  # boundary_ratio of model_index.json
        if lora:
            from peft import LoraConfig
            net.requires_grad_(False)
            net.add_adapter(LoraConfig(r=lora, lora_alpha=lora, target_modules=wan.LORA_TARGETS))
            for p in net.parameters():
                if p.requires_grad:
                    p.data = p.data.float()
    net.freeze(experts, frozen or torch.float32)
    net.enable_gradient_checkpointing()
    return net


def forward(net, x, t, text, high=None):
    """Experts.forward when every sample is the high-noise expert's (the bench's sigmas): that expert
    on x (B, C, F, h, w), and, with grad on, the other on one token, its output times 0 (_to_run's
    worst case); high: Experts.high's mask, not read (a fake tensor's values are not known)."""
    from models import wan
    v = wan._forward(net.transformer, x, t, text)
    if torch.is_grad_enabled():
        v = v + 0 * wan._token(net.transformer_2, x, t, text).sum()
    return v


def inputs(cfg, n, Fr, H, W, L1, L2, dev):
    """fullsize_wan.wan_inputs with a14b_steps rollout steps a clip stored (xs: steps + 1, means: steps)."""
    from models import wan
    C, f, h, w = cfg['out_channels'], (Fr - 1) // 4 + 1, H // 8, W // 8
    store = dict(xs=torch.randn(n, a14b_steps + 1, C, f, h, w, device=dev),   # float32, as sample() keeps
                 means=torch.randn(n, a14b_steps, C, f, h, w, device=dev))
    text = lambda: [torch.randn(1, wan.TEXT_TOKENS, cfg['text_dim'], device=dev),
                    torch.ones(1, wan.TEXT_TOKENS, device=dev)]
    return store, text(), text()


def family(experts='both', frozen=None):
    """measure()'s functions for A14B with `experts` trained (fam=; its lora argument reaches build)."""
    from models import wan
    return SimpleNamespace(build=lambda cfg, lora=0, attn=None: build(cfg, experts, frozen, lora), forward=forward,
                           velocity=FW.wan_velocity, inputs=inputs, tokens=FW.wan_tokens, blocks=wan.blocks,
                           text=lambda L1, L2: 512, cp_plan=wan.cp_plan)


# ----------------------------------------------------------------------------- depth

def line(runs, depth=LAYERS):
    """The run at `depth` layers on the line through runs[0] and runs[1] (each with its 'layers'):
    every count of bytes (a phase's peak by category, the resident anchor and store) and FLOPs, and
    the parameter counts, a + b x layers; then the peak phase at that depth."""
    a, b = runs[:2]
    d1, d2 = a['layers'], b['layers']

    def mix(x, y):
        if isinstance(x, dict) or isinstance(y, dict):
            x, y = x or {}, y or {}
            return {k: mix(x.get(k, 0), y.get(k, 0)) for k in dict.fromkeys([*x, *y])}
        if isinstance(x, (int, float)) and not isinstance(x, bool):
            return x + (y - x) * (depth - d1) / (d2 - d1)
        return x
    out = dict(a, layers=depth, depths=[r['layers'] for r in runs], seconds=sum(r['seconds'] for r in runs),
               **{k: mix(a[k], b[k]) for k in ('phases', 'resident', 'P', 'P_trainable')})
    top = max(out['phases'], key=lambda k: out['phases'][k]['peak']['Total'])
    out['peak'], out['peak_phase'] = out['phases'][top]['peak'], top
    if len(runs) > 2:  # the check: the third depth's phase peaks and FLOPs against the line's
        c, p = runs[2]['phases'], line(runs[:2], runs[2]['layers'])['phases']
        out['check'] = max(max(abs(p[k]['peak']['Total'] / c[k]['peak']['Total'] - 1),
                               abs(p[k]['flops'] / c[k]['flops'] - 1) if c[k]['flops'] else 0) for k in c)
    return out


def shallow(run, key, what, Fr, H, W, cfg, **kw):
    """run() (bench.fullsize's: measure, kept in fullsize_runs/) at each of a14b_depths layers,
    carried to LAYERS by line(); None if a part of it is not measured (--only)."""
    runs = []
    for d in a14b_depths:
        r = run(f'{key}_L{d}', what, Fr, H, W, model_cfg=dict(cfg, num_layers=d), **kw)
        if r is None:
            return None
        runs.append(dict(json.loads(json.dumps(r, default=str)), layers=d))  # the keys as a kept run's
    return line(runs)


def validation_runs(run):
    """Wan 2.1 14B, full FT on 8 GPUs at wan_clip, sp 1 and wan_sp: the line from shallow builds, to
    compare with the full-depth runs of fullsize_wan.wan_runs (report)."""
    cfg, (Fr, H, W), out = load_config(a14b_config), FW.wan_clip, []
    for n in sorted({1, FW.wan_sp} - {0}):
        for what in ('train', 'rollout'):
            r = shallow(run, f'a14b_val14b_sp{n}_{what}_{Fr}x{H}x{W}', what, Fr, H, W, cfg, fam=FW.WAN, sp=n)
            if r is not None:
                out.append(dict(r, categories=categories(r)))
    return out


def a14b_runs(run):
    """The A14B rows: every setup of SETUPS, clip of a14b_clips and sp of a14b_sp, train and rollout,
    each carried to 40 layers an expert (keys 'a14b_...': part 'a14b')."""
    cfg, out = load_config(a14b_config), []
    for name, key, experts, frozen, lora, _ in SETUPS:
        for Fr, H, W in a14b_clips:
            for n in a14b_sp:
                for what in ('train', 'rollout'):
                    r = shallow(run, f'a14b_{key}_sp{n}_{what}_{Fr}x{H}x{W}', what, Fr, H, W, cfg,
                                fam=family(experts, frozen), lora=lora, sp=n, rollout_n=a14b_rollout_batch)
                    if r is not None:
                        out.append(dict(r, setup=name, key=key, sp=n, categories=categories(r)))
    return out


# ----------------------------------------------------------------------------- the report

def idle_bytes(r):
    """The idle expert's resident bytes in run r (its 'categories'): both experts train (or carry
    adapters): half of the sharded params, grads, AdamW state and anchor (the experts have one shape);
    one trains: the frozen expert's sharded params, the params less the trained expert's (its anchor's
    bytes: a copy of its shards)."""
    c = r['categories']
    if r['key'] in ('one', 'onebf16'):
        return c['params (fp32 master)'] - c['anchor (fp32)']
    return sum(c[k] for k in ('params (fp32 master)', 'grads (fp32)', 'optimizer (AdamW)', 'anchor (fp32)')) / 2


def flops(r):
    """TFLOP of one pass (one clip, one CFG branch; all ranks of an sp group), as fullsize_wan.wan_flops."""
    ph, n = r['phases'], r['sp']
    if r['what'] == 'rollout':
        return n * ph['rollout forward']['flops'] / (2 * a14b_rollout_batch) / 1e12
    return n * (ph['policy forward']['flops'] + ph['backward']['flops']) / 2 / 1e12


def iterations(out):
    """{(setup name, clip, sp): (iteration peak, offloaded iteration peak)} in bytes, VAE and VideoAlign
    resident: the larger of the micro-step's and the rollout forward's."""
    extras, it = sum(out['wan_extras'].values()), {}
    for r in out.get('a14b', []):
        k = (r['setup'], f'{r["frames"]}x{r["height"]}x{r["width"]}', r['sp'])
        tot = r['categories']['total'] + extras
        a, b = it.get(k, (0, 0))
        it[k] = (max(a, tot), max(b, tot - idle_bytes(r)))
    return it


def readme_rows(out, gb):
    """The README block's A14B rows, one a clip: each setup train.py runs at the smallest sp that fits gb
    (the others, the frozen expert in fp32 and the offloaded figures: results/fullsize.md)."""
    rows, it, short = [], iterations(out), {s[0]: s[5] for s in SETUPS}
    for clip in dict.fromkeys(k[1] for k in it):
        fits, over = [], False
        for name in [n for n in dict.fromkeys(k[0] for k in it) if 'fp32' not in n]:  # train.py: bf16 on GPUs
            fit = sorted((sp, v[0] / GiB) for (s, c, sp), v in it.items() if (s, c) == (name, clip) and v[0] / GiB <= gb)
            if fit:
                fits.append(f'{short.get(name, name)}, sp {fit[0][0]} **{fit[0][1]:.1f}**')
            over |= not fit
        rows.append(['Wan 2.2 (A14B), 8 GPUs', clip, '; '.join(fits + [f'the others over {gb:.0f} GB at every sp'] * over)])
    return rows


def a14b_report(out, g):
    """results/fullsize.md's A14B section."""
    runs, c, extras = out.get('a14b', []), out['config'], sum(out['wan_extras'].values())
    gb = c['gpu_gb']
    md = ['### Wan 2.2 T2V-A14B: two experts on 8 GPUs, extrapolated in depth (wan.py Experts)', '',
          f'Two experts of Wan 2.1 14B\'s shape as one policy, FSDP2 over 8 ranks as train.py applies it (every block '
          f'of both experts, then the root), a micro-step and a rollout forward measured as the Wan 2.1 rows are, with '
          f'{" and ".join(map(str, c.get("a14b_depths", a14b_depths)[:2]))} layers an expert and carried to {LAYERS} on '
          'the line through them '
          '(bench/fullsize_wan22.py). The stored rollout is config/wan22_a14b.py\'s: '
          f'{c.get("a14b_steps", a14b_steps)} steps a clip, {c["clips"]} clips an iteration ({c["clips"]} x sp / 8 a '
          f'rank), {c.get("a14b_rollout_batch", a14b_rollout_batch)} a rollout forward (x 2 CFG branches). One '
          'expert runs on real tokens (the high-noise one), the other, in the update, on one token (Experts.forward\'s '
          'collective padding); a rollout step runs one expert only. Setups: both experts trained; the high one trained '
          'and the low one frozen and sharded, in bf16 as train.py keeps it on GPUs (Experts.freeze), and in fp32; LoRA '
          f'r{c["lora_rank"]} on both (fp32 base, as load_policy keeps it under FSDP). AdamW state (train.py\'s Muon: '
          'less). Resident beside: ' + ', '.join(f'{k} {g(v)} GiB' for k, v in out['wan_extras'].items()) + '.', '']
    val = out.get('a14b_check', [])
    full = {(r['what'], r.get('sp', 1)): r for r in out.get('wan', []) if r['model'] == 'Wan 2.1 14B'
            and r['setup'].startswith('full FT, 8 GPUs')}
    rows = []
    for v in val:
        f = full.get((v['what'], v['sp']))
        if f:
            err = max(abs(v['categories'][k] - f['categories'][k]) for k in f['categories'])
            fl = sum(p['flops'] for p in v['phases'].values()) / sum(p['flops'] for p in f['phases'].values()) - 1
            rows.append([f'{v["what"]}, sp {v["sp"]}', g(f['categories']['total']), g(v['categories']['total']),
                         f'{100 * (v["categories"]["total"] / f["categories"]["total"] - 1):+.3f}%', f'{err / GiB:.3f}',
                         f'{100 * fl:+.3f}%', f'{f["peak_phase"]} / {v["peak_phase"]}', f'{100 * v.get("check", 0):.3f}%'])
    if rows:
        md += [f'The method against Wan 2.1 14B\'s full-depth runs (full FT, 8 GPUs, {"x".join(map(str, FW.wan_clip))}, '
               'the table above): the same build at the shallow depths, carried to 40 layers.', '',
               table(['run', 'measured at 40 layers', 'extrapolated', 'error', 'largest category error (GiB)',
                      'FLOPs error', 'peak phase (measured / extrapolated)', 'third depth off the line'], rows), '']
    rows = []
    it = iterations(out)
    for r in runs:
        k = (r['setup'], f'{r["frames"]}x{r["height"]}x{r["width"]}', r['sp'])
        c_ = r['categories']
        rows.append([r['setup'], k[1], r['sp'], r['what'], g(c_['total']), g(c_['total'] + extras),
                     g(idle_bytes(r)), g(c_['total'] + extras - idle_bytes(r)), r['peak_phase'], f'{flops(r):.0f}'])
    md += [table(['setup', 'clip', 'sp', 'run', 'peak GiB/GPU', '+ VAE, VideoAlign', 'idle expert resident',
                  '+ VAE, VideoAlign, idle expert offloaded', 'peak phase', 'TFLOP a pass'], rows), '']
    if runs:
        d = runs[0]['depths']
        md += [f'Every run was measured at {", ".join(map(str, d))} layers an expert; the {d[-1]}-layer one lies '
               f'{100 * max(r.get("check", 0) for r in runs):.3f}% at most off the line of the others (phase peaks and '
               'FLOPs). Idle expert resident: both trained, half the sharded params, grads (freed before a rollout), '
               'AdamW state and anchor; one trained, the frozen expert\'s shards (fp32 or bf16, its norms and '
               'modulation tables fp32 in both). TFLOP a pass: one clip, one CFG branch, all ranks of an sp group '
               '(the update\'s forward + backward with its recompute; at sp > 1 diffusers\' Ulysses recomputes the '
               'attention forward, as in the sequence-parallel section).', '']
    rows = [[s, clip, sp, g(a), 'yes' if a / GiB <= gb else 'no', g(b), 'yes' if b / GiB <= gb else 'no']
            for (s, clip, sp), (a, b) in it.items()]
    md += [f'An iteration (the larger of its micro-step and rollout forward, VAE and VideoAlign resident) against '
           f'{gb:.0f} GB, as the GPU holds it and with the idle expert\'s resident state in host memory instead '
           '(computed: train.py does not offload; in the update the idle expert\'s one-token pass would need its '
           'blocks brought back, not counted):', '',
           table(['setup', 'clip', 'sp', 'iteration GiB/GPU', f'fits {gb:.0f} GB', 'idle expert offloaded',
                  f'fits {gb:.0f} GB'], rows), '']
    md += ['Fits: ' + '; '.join(f'{clip}: {text}' for _, clip, text in readme_rows(out, gb)).replace('**', '')
           + ' (iteration GiB per GPU; the README\'s rows).', '']
    first = lambda s, clip, j: min((sp for (s2, c2, sp), v in it.items() if (s2, c2) == (s, clip) and v[j] / GiB <= gb),
                                   default=99)  # the smallest sp that fits, as held (j 0) or offloaded (j 1)
    better = [(s, clip, first(s, clip, 1)) for s, clip in dict.fromkeys(k[:2] for k in it)
              if first(s, clip, 1) < first(s, clip, 0)]
    md += ['With the idle expert offloaded (computed), at a smaller sp than otherwise or where none fits: '
           + '; '.join(f'{s}, {clip}, sp {sp} {it[s, clip, sp][1] / GiB:.1f}' for s, clip, sp in better) + '.', '']
    return md
