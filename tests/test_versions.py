"""
The tested library versions (infra/versions.py, requirements.txt): diffusers and transformers are bounded
above and below, the installed ones are inside, and another version makes one line at start-up, not an
error. What a failure would show: a pip install that pulls a diffusers whose token order or attention
moved, silently; or a start-up that stops (or says nothing) on a version the code was never run with.

    python -m pytest tests/test_versions.py
"""
import importlib.metadata
import os

from infra import versions

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_requirements_bound_the_libraries_whose_internals_are_read():
    from packaging.specifiers import SpecifierSet
    bounds = versions.tested()
    assert set(bounds) == {'diffusers', 'transformers'}
    for name, spec in bounds.items():
        ops = {s.operator for s in SpecifierSet(spec)}
        assert '>=' in ops and '<' in ops, (name, spec)  # a floor and a ceiling
        assert SpecifierSet(spec).contains(importlib.metadata.version(name)), (name, spec)  # this install: tested


def test_the_tested_install_says_nothing():
    lines = []
    assert versions.check(lines.append) is None and lines == []


def test_an_untested_version_is_one_line_not_an_error(monkeypatch):
    real = importlib.metadata.version
    fake = {'diffusers': '0.43.0', 'transformers': '5.30.1'}
    monkeypatch.setattr(importlib.metadata, 'version', lambda name: fake.get(name) or real(name))
    lines = []
    line = versions.check(lines.append)
    assert lines == [line] and '\n' not in line
    assert 'diffusers 0.43.0 (tested: >=0.42,<0.43)' in line and 'transformers 5.30.1' in line
    fake['transformers'] = '5.17.0'  # the GPU machines' transformers: inside the range
    assert 'transformers' not in versions.untested() and 'diffusers 0.43.0' in versions.untested()
    fake['diffusers'] = '0.43.0.dev0'  # a development build of the next release: outside too
    assert 'diffusers 0.43.0.dev0' in versions.untested()


def test_train_says_it_at_start_up(monkeypatch):
    # preflight.start, train.py's start-up checks, says it through the log it is given (train.py's quiet():
    # the master alone prints), before anything loads
    from extras import preflight
    src = open(os.path.join(ROOT, 'train.py')).read()
    assert 'preflight.start(config, master, quiet)' in src
    said = []
    monkeypatch.setattr(preflight, 'check_versions', lambda log: log('diffusers 9.9 (tested: >=0.42,<0.43)'))
    monkeypatch.setattr(preflight.rundir, 'claim', lambda config, master, log: ('ckpts', 'history'))
    monkeypatch.setattr(preflight, 'check', lambda config: None)
    assert preflight.start(dict(out_dir=ROOT), True, said.append) == ('ckpts', 'history')
    assert said == ['diffusers 9.9 (tested: >=0.42,<0.43)']
