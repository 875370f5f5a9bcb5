"""
Overrides a script's settings (the constants at its top) from config files and --key=value flags,
as nanoGPT's configurator does, but strictly: an unknown key or a value of the wrong type is an
error that names the key, never a silent new global.

    python train.py config/toy.py --max_iters=20 --sampler=flow

Usage inside a script, after its settings:
    config = configure(globals())   # returns the resolved settings as a dict
"""
import ast
import sys
import types


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


def configure(g, argv=None):
    """Apply config files and --key=value overrides from argv to the globals dict g."""
    argv = sys.argv[1:] if argv is None else argv
    settings = _settings(g)
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
            g[key] = settings[key] = value
    return settings
