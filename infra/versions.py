"""
The library versions this code was tested with, and one line at start-up when another one runs.

    line = untested()          # None, or 'warning: untested versions: diffusers 0.43.0 (tested: >=0.42,<0.43), ...'

The code reads internals of two libraries, which a release may move without notice:
- diffusers: the HunyuanVideo 1.5 pipeline's text tokens come valid first, then padding (models/
  hunyuan15.py, models/attention.py trim and attend by it); its attention processor and dispatcher;
- transformers: the VideoAlign port (models/videoalign.py) patches Qwen2-VL's vision rope (_vision_rope_445) and
  maps its weight names; extras/metrics.py reads .pooler_output of CLIP's get_*_features (transformers 5).
The bounds are requirements.txt's, one source: the floor where the code needs it, the ceiling the next
release not yet tested. Outside them train.py still runs: rank 0 says so in one line, not an error.

Tested by: python -m pytest tests/test_versions.py
"""
import importlib.metadata
import os
import re

CHECKED = ('diffusers', 'transformers')  # the libraries whose internals the code reads
REQUIREMENTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'requirements.txt')


def tested(path=REQUIREMENTS):
    """{name: specifier string} of CHECKED as requirements.txt bounds them, e.g. {'diffusers': '>=0.42,<0.43'}."""
    out = {}
    with open(path) as f:
        for line in f:
            m = re.match(r'\s*([A-Za-z0-9_.-]+)\s*([<>=!~][^#;]*)', line)
            if m and m.group(1).lower() in CHECKED:
                out[m.group(1).lower()] = ''.join(m.group(2).split())
    return out


def untested(path=REQUIREMENTS):
    """One line naming every CHECKED library installed outside its tested range, or None (all inside,
    or no requirements.txt beside the code to compare with)."""
    from packaging.specifiers import SpecifierSet  # a dependency of transformers
    try:
        bounds = tested(path)
    except OSError:
        return None
    outside = []
    for name, spec in bounds.items():
        try:
            have = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue  # not installed: the import that needs it says so
        if not SpecifierSet(spec).contains(have, prereleases=True):
            outside.append(f'{name} {have} (tested: {spec})')
    if not outside:
        return None
    return (f'warning: untested versions: {", ".join(outside)}; the code reads their internals '
            '(infra/versions.py), so compare a short run with a tested install before a long one')


def check(log=print):
    """log(untested()) if there is a line to say; train.py calls it on rank 0 at start-up."""
    line = untested()
    if line:
        log(line)
    return line
