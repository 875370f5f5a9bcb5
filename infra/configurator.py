"""
Overrides a script's settings (the constants at its top) from config files and --key=value flags,
as nanoGPT's configurator does, but strictly: an unknown key or a value of the wrong type is an
error that names the key, never a silent new global.

    python train.py config/toy.py --max_iters=20 --sampler=flow

Usage inside a script, after its settings:
    config = configure(globals())   # returns the resolved settings as a dict
    config = configure(globals(), sections=(variants,))  # and the settings of another file (its constants)

A section is a module whose settings (its lower-case constants) stand with its own code: a key that it
holds is set on it, the rest on the script; each configure() first puts a section's defaults back, so a
run in the same process (a test) starts from them.

Then every setting is checked against RULES below (ranges, sizes, the plumbing's own names) and the
script's own rules, before the script loads or writes anything: a bad value is one line that names the
setting, the value and what is allowed. A rule applies to every script that has a setting of that name.
A setting that picks one of the method's or a model's names gets its rule from the script, which
imports those names (this file imports nothing above infra/):
    configure(globals(), rules=dict(sampler=one_of(*sde.KINDS), **attention.RULES))

Tested by: python -m pytest tests/test_configurator.py   (every rule through the real scripts)
"""
import ast
import os
import sys
import types

from infra.optimizer import KINDS as OPTIMIZERS


def one_of(*choices):
    return (lambda v: v in choices), 'one of ' + ', '.join(map(repr, choices))


def list_of(*choices):  # a comma list of some of the choices, '' for none
    return (lambda v: all(c.strip() in choices for c in v.split(',') if c.strip())), \
        "a comma list of " + ', '.join(map(repr, choices)) + " ('' for none)"


def number(lo=None, hi=None, lo_open=False, then=''):  # lo <= v (lo < v if lo_open) and v <= hi
    text = ' and '.join(t for t in (lo is not None and f"{'greater than' if lo_open else 'at least'} {lo:g}",
                                    hi is not None and f'at most {hi:g}') if t)
    return (lambda v: (lo is None or (v > lo if lo_open else v >= lo)) and (hi is None or v <= hi)), text + then


def _pixels(v):  # a height or width the VAE compresses 16x
    return v >= 16 and v % 16 == 0


def _clip(v):  # (frames, height, width) of a clip: the VAE compresses time 4x, space 16x
    return len(v) == 3 and v[0] >= 1 and v[0] % 4 == 1 and _pixels(v[1]) and _pixels(v[2])


def prompt_or_file(v):  # sample.py --prompts: a prompt, or a file of prompts
    names_file = v.endswith(('.txt', '.csv')) or os.sep in v or '/' in v
    return not names_file or os.path.isfile(v) or 'file not found'


_CLIPS = ((lambda v: len(v) > 0 and all(_clip(c) for c in v)),
          '(frames, height, width) triples: 1 + 4k frames, sizes multiples of 16')


# ----------------------------------------------------------------------------- valid values
# setting: (test of a value, what is allowed); None passes only where the script's default is None
RULES = dict(
    optimizer=one_of(*OPTIMIZERS),
    init_from=one_of('auto', 'scratch', 'resume'),
    device=one_of('cuda', 'cpu'), export_dtype=one_of('bfloat16', 'float16', 'float32', ''), kl_direction=one_of(1, -1),
    credit_window=((lambda v: len(v) == 3 and all(k >= 1 and k % 2 for k in v)), '3 odd sizes (t, h, w) >= 1'),
    reward_weights=((lambda v: len(v) == 3 and all(w >= 0 for w in v)), '3 weights (VQ, MQ, TA) >= 0'),
    # sampler and sizes
    num_steps=number(1), eta=number(0, lo_open=True, then=' (at 0 no step is stochastic: nothing to train)'),
    shift=number(0, lo_open=True), cfg=number(1, then=' (1: no guidance)'),
    num_frames=((lambda v: v >= 1 and v % 4 == 1), '1 + 4k frames (the VAE compresses time 4x): 1, 5, ..., 81'),
    # a pixel side divides into latents x patches: 16x for HunyuanVideo 1.5 and Wan 2.1, 32x for Wan
    # 2.2 TI2V-5B (its family's latent_shape checks the rest)
    height=(_pixels, 'a multiple of 16 (the VAE and the patches compress space 16x)'),
    width=(_pixels, 'a multiple of 16 (the VAE and the patches compress space 16x)'),
    fps=number(0, lo_open=True),
    # GRPO, trust region, optimisation
    group_size=number(2, then=' (GRPO compares rollouts of a prompt)'), prompts_per_iter=number(1),
    rollout_batch=number(1), train_batch=number(1), updates_per_iter=number(1),
    timestep_fraction=number(0, 1, lo_open=True), clip_range=number(0, lo_open=True), adv_clip=number(0, lo_open=True),
    anchor_every=number(1), beta_pos=number(0), beta_vel=number(0), kl_max=number(0, lo_open=True),
    kl_init=number(0, lo_open=True), kl_min=number(0, lo_open=True), kl_warmup=number(0, then=' (0: none)'),
    kl_ratio_target=number(0, then=" (0: the paper's controller)"),
    alarm_z=number(0, lo_open=True, then=' (standard errors)'),
    kl_target=number(0, lo_open=True), learning_rate=number(0, then=' (0: a control run, nothing moves)'), weight_decay=number(0),
    grad_clip=number(0, lo_open=True), lora_rank=number(0), max_iters=number(0),
    eval_steps=number(0, then=' (0: num_steps)'), sde_window=number(0, then=' (0: every stochastic step)'),
    sp_size=number(1),  # it must divide the world size and the heads (HunyuanVideo 1.5 16, Wan 2.1 12 or 40, the
                        # toy's 3): train.py and infra/sp.py check
    shard_size=number(0, then=" (0: one node's ranks)"),  # it must divide the world size: infra/parallel.py checks
    dist_timeout=number(0, lo_open=True, then=' (minutes)'),
    solo_timeout=number(0, lo_open=True, then=" (minutes)"),
    # I/O
    eval_every=number(0), eval_samples=number(1), eval_videos=number(0), save_every=number(0),
    save_every_min=number(0, then=' (minutes; 0: by count only)'),
    keep_checkpoints=number(1), diag_every=number(0), num_prompts=number(1), samples=number(1),
    # benches (bench.compute's and bench.verdicts' `prompts`, bench.fullsize's `only`: their own rules)
    threads=number(1), seeds=number(1), iters=number(1), workers=number(1), worker=number(0),
    budget_min=number(0, then=' (0: no limit)'), repeats=number(1), blocks=number(1),
    phase_timeout=number(0, lo_open=True, then=' (seconds)'), parts=list_of('checkpoint', 'prompts'),
    group=number(2), bench_prompts=number(1, 16, then=' (the toy has 16 held-out prompts)'),
    grad_clips=number(1, 16, then=' (the toy has 16 held-out prompts)'), search_iters=number(1),
    train_iters=number(1), train_prompts_per_iter=number(1), acting_kl_max=number(0, lo_open=True),
    first_seed=number(0), cost_iters=number(2, then=' (the first is warm-up)'),
    evals=number(1), smooth=number(1), max_iters_factor=number(1), full_iters=number(1), full_gpus=number(1),
    tr_kl_max=number(0, lo_open=True), tr_updates=number(1), match_tol=number(0, lo_open=True),
    late_iters=number(0), thresholds=((lambda v: len(v) > 0 and all(0 < t <= 2 for t in v)),
                                      "held-out composites in (0, 2] (the toy's 0.5 VQ + 0.5 MQ + TA)"),
    gpus=number(1), clips=number(1), gpu_gb=number(0, lo_open=True),
    tflops=number(0, lo_open=True), videoalign_params=number(0), metrics_params=number(0),
    sizes=((lambda v: len(v) > 0 and all(len(s) == 2 and all(_pixels(x) for x in s) for s in v)),
           '(height, width) pairs, each a multiple of 16'),
    sp_clips=_CLIPS, lora_sizes=_CLIPS, video_sizes=_CLIPS,
    text_tokens=((lambda v: len(v) == 2 and all(n >= 1 for n in v)), '(Qwen, ByT5) token counts >= 1'),
    sp_sizes=((lambda v: len(v) > 0 and all(n >= 1 for n in v)), 'sequence-parallel degrees >= 1'),
    experts=one_of('both', 'high', 'low'),  # a two-expert model's (models/wan.py Experts)
)
# settings checked together: a rule keyed by their names, test(*values) -> None or why not
RULES[('kl_ratio_target', 'kl_min', 'kl_init', 'kl_max')] = (  # the paper's controller's (a held ratio: kl_init only)
    lambda held, lo, start, hi: None if held > 0 or lo <= start <= hi else
    f'lambda_KL needs kl_min <= kl_init <= kl_max (the paper\'s controller: kl_ratio_target=0), got '
    f'{lo:g}, {start:g}, {hi:g}', '')


def rules(*modules):
    """A script's rules for the settings that pick a module's names: each module's CHOICES ({setting:
    names}) as one_of, and its RULES as they are (models/attention.py, extras/metrics.py)."""
    out = {}
    for m in modules:
        out.update({k: one_of(*names) for k, names in getattr(m, 'CHOICES', {}).items()})
        out.update(getattr(m, 'RULES', {}))
    return out


_rules_of = rules  # configure()'s argument `rules` shadows the function's name there


def check(settings, rules=RULES, defaults=None):
    """SystemExit with one line for the first setting whose value breaks its rule. A rule of a tuple of
    settings, (names): test(*values) -> None or why not, checks them together."""
    for key, (test, allowed) in rules.items():
        if isinstance(key, tuple):
            why = test(*(settings[k] for k in key)) if all(k in settings for k in key) else None
            if why:
                raise SystemExit(f'config error: {why}')
            continue
        if key not in settings or (settings[key] is None and (defaults or {}).get(key, 0) is None):
            continue
        try:
            ok = settings[key] is not None and test(settings[key])
        except (TypeError, ValueError):  # e.g. a tuple of the wrong length or element type
            ok = False
        if ok is not True:
            why = f' ({ok})' if isinstance(ok, str) else ''
            raise SystemExit(f'config error: {key} must be {allowed}, got {settings[key]!r}{why}')


def _settings(g):
    # a setting is a public lower-case module-level constant of a plain type (an imported upper-case
    # constant such as equalizer.MEDIANS is a fact of the code, not a setting)
    plain = (bool, int, float, str, tuple, list, type(None))
    return {k: v for k, v in g.items() if not k.startswith('_') and not k.isupper() and isinstance(v, plain)}


def _check(key, value, settings):
    if key not in settings:
        close = [k for k in settings if k.split('_')[0] == key.split('_')[0]]
        hint = f' (did you mean {", ".join(close)}?)' if close else ''
        raise SystemExit(f'config error: unknown setting {key!r}{hint}')
    old = settings[key]
    if old is None or value is None or type(value) is type(old):
        return value
    if isinstance(old, float) and type(value) is int:  # 10 where 10.0 was meant
        return float(value)
    if isinstance(old, (tuple, list)) and isinstance(value, (tuple, list)):
        return type(old)(value)
    raise SystemExit(f'config error: {key} must be {type(old).__name__} '
                     f'(default {old!r}), got {type(value).__name__} {value!r}')


_SECTION_DEFAULTS = {}  # module name -> its settings as first imported


def configure(g, argv=None, rules=None, sections=()):
    """Apply config files and --key=value overrides from argv to the globals dict g and the sections'
    modules, then check every setting against RULES (updated with this script's own rules)."""
    argv = sys.argv[1:] if argv is None else argv
    settings, owner = _settings(g), {}
    for m in sections:
        own = _SECTION_DEFAULTS.setdefault(m.__name__, _settings(vars(m)))
        vars(m).update(own)  # its defaults, whatever an earlier run in this process set
        if set(own) & set(settings):
            raise ValueError(f'{m.__name__} and the script both define {sorted(set(own) & set(settings))}')
        settings.update(own)
        owner.update(dict.fromkeys(own, vars(m)))
    defaults = dict(settings)
    for arg in argv:
        if not arg.startswith('--'):
            # a config file: python assignments, executed in an empty namespace and then checked
            ns = {}
            try:
                with open(arg) as f:
                    exec(f.read(), {}, ns)
            except FileNotFoundError:
                raise SystemExit(f'config error: no config file {arg!r}')
            updates = {k: v for k, v in ns.items()
                       if not k.startswith('_') and not isinstance(v, types.ModuleType)}
        else:
            if '=' not in arg:
                raise SystemExit(f'config error: expected --key=value, got {arg!r}')
            key, raw = arg[2:].split('=', 1)
            try:
                value = ast.literal_eval(raw)
            except (ValueError, SyntaxError):
                value = raw  # a bare word is a string: --sampler=flow
            updates = {key: value}
        for key, value in updates.items():
            value = _check(key, value, settings)
            owner.get(key, g)[key] = settings[key] = value
    check(settings, {**RULES, **_rules_of(*sections), **(rules or {})}, defaults)  # sections' rules too
    return settings
