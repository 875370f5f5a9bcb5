"""
The lent GPU machines' Python image, and the wheels the GPU check must carry onto it (bench/gpu_wheels.sh
downloads what this prints).

    python -m bench.gpu_image            # the wheels to carry, one `name==version` a line
    python -m bench.gpu_image --why      # each with the requirement that asks for it; then the image's
                                         # distributions whose version there is unknown (assumed to fit)

The image's distributions are bench/gpu_image_packages.txt (read on the image: every name, a version for
some). The carried wheels are derived, not listed: start from what the check imports (ROOTS) at the
versions this environment's tests run with, and follow their requirements, each with its marker evaluated
for the image (CPython 3.12 on x86-64 Linux, no extras). A requirement is left to the image when the image
has the distribution and its version there, where known, satisfies it; otherwise it is carried at this
environment's version and its own requirements are followed in turn. The check installs the carried
wheels into a folder first on PYTHONPATH, so a carried one replaces the image's (huggingface_hub 2.4 over
the image's 1.33: transformers 5.25 asks for >= 2.4).
A requirement on a distribution whose version on the image is unknown is assumed met: --why lists them,
the one risk this cannot rule out without the image itself.
Tested by: python -m pytest tests/test_gpu_image.py (the image's import environment rebuilt here)
"""
import importlib.metadata
import os
import sys

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIST = os.path.join(ROOT, 'bench', 'gpu_image_packages.txt')
ROOTS = ('diffusers', 'transformers', 'peft')  # what the check's env phase imports (bench/gpu_phases.WHEELS)
# the image's interpreter and platform, as packaging's markers name them (python3 3.12.3, x86-64 Linux)
MARKERS = dict(python_version='3.12', python_full_version='3.12.3', implementation_name='cpython',
               platform_python_implementation='CPython', sys_platform='linux', platform_system='Linux',
               platform_machine='x86_64', os_name='posix', extra='')


def image(path=LIST):
    """{canonical name: version or None} of the image's distributions. The file: comment lines, one of them
    `# accelerate 1.15.0, botorch 0.18.1, ...` (the versions known), then one name a line."""
    names, versions = set(), {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            pairs = [p.split(' ') for p in line[2:].split(', ')] if line.startswith('# ') else []
            if len(pairs) > 2 and all(len(p) == 2 and p[1][:1].isdigit() for p in pairs):  # 'name version'
                versions.update((canonicalize_name(n), v) for n, v in pairs)
            elif line and not line.startswith('#'):
                names.add(canonicalize_name(line))
    return {n: versions.get(n) for n in names}


def requirements(name):
    """The requirements of this environment's installed `name` that apply on the image (markers, no extras)."""
    reqs = [Requirement(r) for r in importlib.metadata.requires(name) or []]
    return [r for r in reqs if r.marker is None or r.marker.evaluate(MARKERS)]


def met_by_image(req, img):
    """True where the image has the distribution at a version that satisfies req (an unknown one: assumed)."""
    name = canonicalize_name(req.name)
    return name in img and (img[name] is None or req.specifier.contains(img[name], prereleases=True))


def carried(img=None, roots=ROOTS):
    """[(name, version, why)]: ROOTS and every requirement the image does not meet, followed transitively;
    `why` is the requirement that asked for it ('' for a root). Versions: this environment's."""
    img = image() if img is None else img
    out, todo, seen = [], [(r, '') for r in roots], set()
    while todo:
        name, why = todo.pop(0)
        key = canonicalize_name(name)
        if key in seen:
            continue
        seen.add(key)
        version = importlib.metadata.version(name)  # raises if the tests' environment lacks it: install it here
        out.append((importlib.metadata.metadata(name)['Name'], version, why))
        for req in requirements(name):
            if not met_by_image(req, img):
                todo.append((req.name, f'{name} {version}: {req}'))
    return out


def assumed(img=None, roots=ROOTS):
    """The requirements of the carried wheels left to an image distribution of unknown version."""
    img = image() if img is None else img
    return sorted({f'{req} (of {name})' for name, _, _ in carried(img, roots) for req in requirements(name)
                   if met_by_image(req, img) and img[canonicalize_name(req.name)] is None and str(req.specifier)})


if __name__ == '__main__':
    why = '--why' in sys.argv[1:]
    for name, version, asked in carried():
        print(f'{name}=={version}' + (f'  # {asked or "imported by the check"}' if why else ''))
    if why:
        print('# assumed met by the image (its version there unknown):')
        print('\n'.join(f'#   {a}' for a in assumed()))
