"""
The GPU check's wheels against the lent machines' image (bench/gpu_image_packages.txt): every requirement of
every carried wheel is met by the image or by another carried wheel (package metadata, the image's markers);
and the image's import environment rebuilt here, a python that sees only the distributions the image has
plus the carried ones (links to this environment's installed copies), imports diffusers, transformers, peft
and every project module the check's phases and train.py reach; without httpx2, httpcore2 and truststore
(the wheels an earlier list forgot) it does not. The slow tier downloads the wheels as bench/gpu_wheels.sh
does and imports from them.

    python -m pytest tests/test_gpu_image.py            # the slow tier: -m slow (needs the network)
"""
import ast
import importlib.metadata
import os
import subprocess
import sys
import zipfile

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from bench import gpu_image

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FORGOTTEN = ('httpx2', 'httpcore2', 'truststore')  # huggingface_hub 2.4's network stack, absent from the image
# the list bench/gpu_wheels.sh carried by hand before the derivation
HAND_LISTED = ('diffusers', 'transformers', 'peft', 'huggingface_hub', 'importlib_metadata', 'zipp')


def pins():
    out = subprocess.run(['bash', os.path.join(ROOT, 'bench', 'gpu_wheels.sh'), '--print'], capture_output=True,
                         text=True, check=True).stdout.split()
    return dict(p.split('==') for p in out)


def unmet(carried):
    """Requirements of the carried {name: version} that neither the image nor another carried wheel meets.
    The image's version, where the list knows it, must satisfy; where it does not, its presence is taken."""
    img = gpu_image.image()
    have = {canonicalize_name(n): v for n, v in carried.items()}
    bad = []
    for name in carried:
        for r in importlib.metadata.requires(name) or []:
            req = Requirement(r)
            if req.marker is not None and not req.marker.evaluate(gpu_image.MARKERS):
                continue
            key = canonicalize_name(req.name)
            version = have.get(key, img.get(key))
            if key not in have and key not in img or version and not req.specifier.contains(version, True):
                bad.append(f'{name}: {req}')
    return bad


def test_every_requirement_of_the_carried_wheels_is_met_on_the_image():
    from bench.gpu_phases import WHEELS
    assert gpu_image.ROOTS == WHEELS  # what the env phase imports first
    carried = pins()
    assert unmet(carried) == []
    assert set(FORGOTTEN) <= set(carried)
    # the hand-written list misses httpx2 (huggingface_hub's), kernels (transformers'), lazy-importer
    bad = ' '.join(unmet({n: importlib.metadata.version(n) for n in HAND_LISTED}))
    assert 'httpx2' in bad and 'kernels' in bad and 'lazy-importer' in bad, bad


def phase_modules():
    """The project's modules the check's processes import, anywhere in a file (a phase's imports sit inside
    its function): followed from bench/gpu_check.py, bench/gpu_phases.py and train.py (the smoke phase)."""
    def path(mod):
        for p in (os.path.join(ROOT, *mod.split('.')) + '.py', os.path.join(ROOT, 'tests', mod + '.py')):
            if os.path.exists(p):
                return p
    found, todo = set(), ['bench.gpu_check', 'bench.gpu_phases', 'train']
    while todo:
        mod = todo.pop()
        if mod in found:
            continue
        found.add(mod)
        for node in ast.walk(ast.parse(open(path(mod)).read())):
            if isinstance(node, ast.Import):
                todo += [a.name for a in node.names if path(a.name)]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                todo += [m for m in [node.module] + [f'{node.module}.{a.name}' for a in node.names] if path(m)]
    return sorted(found - {'train'})  # train.py runs when imported: its imports are in the list


def image_site(folder, carried):
    """A folder of links to this environment's installed distributions that the image has or that are
    carried: what `import` finds on the image once the wheels are installed (versions: this environment's)."""
    keep = set(gpu_image.image()) | {canonicalize_name(n) for n in carried}
    os.makedirs(folder)
    for dist in importlib.metadata.distributions():
        if canonicalize_name(dist.metadata['Name']) not in keep:
            continue
        for top in {f.parts[0] for f in dist.files or [] if f.parts[0] != '..' and not f.name.endswith('.pth')}:
            src, dst = dist.locate_file(top), os.path.join(folder, top)
            if os.path.exists(src) and not os.path.lexists(dst):
                os.symlink(src, dst)
    return folder


def imports(site, modules, extra=()):
    """Import modules in a python that sees the standard library, `site`, `extra` and the repository only
    (-I -S: no site-packages, no PYTHONPATH)."""
    path = [*extra, site, ROOT, os.path.join(ROOT, 'tests')]
    code = f'import sys; sys.path[:0] = {path!r}\nfor m in {modules!r}: __import__(m)\nprint("ok")'
    return subprocess.run([sys.executable, '-I', '-S', '-c', code], capture_output=True, text=True, cwd=ROOT,
                          timeout=300, env=dict(os.environ, HF_HUB_OFFLINE='1', TRANSFORMERS_OFFLINE='1'))


def test_the_check_imports_in_the_image_environment(tmp_path):
    modules = ['diffusers', 'transformers', 'peft'] + phase_modules()
    assert {'bench.gpu_phases', 'models.policy', 'models.videoalign', 'infra.optimizer'} <= set(modules)
    carried = pins()
    p = imports(image_site(str(tmp_path / 'site'), carried), modules)
    assert p.returncode == 0 and p.stdout.strip() == 'ok', p.stderr[-3000:]
    # the hand-written list (no huggingface_hub network stack, no kernels): the first import fails
    p = imports(image_site(str(tmp_path / 'hand'), HAND_LISTED), ['transformers', 'diffusers', 'peft'])
    assert p.returncode != 0 and "No module named 'httpx2'" in p.stderr, p.stderr[-3000:]


@pytest.mark.slow  # downloads the wheels (~15 MB) as bench/gpu_wheels.sh does
def test_the_downloaded_wheels_import_in_the_image_environment(tmp_path):
    """The wheels themselves, unpacked as pip --target installs them, over the image's other distributions.
    A compiled wheel (kernels: CPython 3.12, the image's python) cannot load in another python: this
    environment's build of the same version stands in for it."""
    carried = pins()
    subprocess.run([sys.executable, '-m', 'pip', 'download', '-q', '--no-deps', '--only-binary=:all:',
                    '--python-version', '3.12', '--implementation', 'cp', '--platform', 'manylinux_2_17_x86_64',
                    '-d', str(tmp_path / 'whl')] + [f'{n}=={v}' for n, v in carried.items()], check=True, timeout=600)
    wheels = sorted(os.listdir(tmp_path / 'whl'))
    assert len(wheels) == len(carried), wheels
    compiled = [w.split('-')[0] for w in wheels if not w.endswith('-none-any.whl')]
    for w in wheels:
        if w.split('-')[0] not in compiled:
            zipfile.ZipFile(tmp_path / 'whl' / w).extractall(tmp_path / 'target')
    site = image_site(str(tmp_path / 'image'), compiled)  # the image's huggingface_hub shadowed by the wheel's
    p = imports(site, ['diffusers', 'transformers', 'peft'] + phase_modules(), extra=[str(tmp_path / 'target')])
    assert p.returncode == 0 and p.stdout.strip() == 'ok', p.stderr[-3000:]
