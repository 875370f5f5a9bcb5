"""
The house's layout, read from the code's own imports (ast, every import statement at any depth and
every importlib.import_module of a literal name):
- the root holds the card's six files and nothing else that is Python;
- the method files (sde.py, equalizer.py, trust_region.py, reward.py) import only the standard library,
  torch and each other (the reward models are models: models/videoalign.py load_reward);
- infra/ (the plumbing) imports nothing of the repository outside infra/;
- models/ and extras/ import neither train.py nor sample.py, and extras/ is imported by no file of
  models/ or infra/ (an add-on stays one);
- no file outside models/ imports a model family file (a family is picked by its model directory);
- streaming/ (the block-causal family: Wan made causal, its toys) is a sibling of SAGE-GRPO's models: it
  imports models/, infra/ and the method files, and only kvpo/ imports it;
- kvpo/ (KVPO, the streaming method, and its GRPO-with-an-SDE baseline) imports models/, streaming/, infra/,
  reward.py and the method files; nothing imports kvpo/;
- no import circle between files;
- a family file that lacks an item of the interface is one error that names the item.
"""
import ast
import os
import sys
import types

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CARD = {'sde.py', 'equalizer.py', 'trust_region.py', 'reward.py', 'train.py', 'sample.py'}
METHOD = {'sde', 'equalizer', 'trust_region', 'reward'}
FOLDERS = ('models', 'infra', 'extras', 'streaming', 'kvpo')
KVPO_USES = ('models', 'streaming', 'infra', 'reward', 'sde', 'equalizer', 'trust_region', 'kvpo')
STREAMING_USES = ('models', 'streaming', 'infra', 'sde', 'equalizer', 'trust_region')  # what streaming/ may import  # what kvpo/ may import
FAMILIES = {'models.hunyuan15', 'models.wan', 'models.toy'}


def modules():
    """{module name: path} of the repository's code (the root files and the folders)."""
    out = {f[:-3]: os.path.join(ROOT, f) for f in os.listdir(ROOT) if f.endswith('.py')}
    for d in FOLDERS:
        for f in os.listdir(os.path.join(ROOT, d)):
            if f.endswith('.py'):
                name = d if f == '__init__.py' else f'{d}.{f[:-3]}'
                out[name] = os.path.join(ROOT, d, f)
    return out


def imports(path, known):
    """The names of this repository's modules that the file at `path` imports, and every top-level
    module it imports (standard library and third party included)."""
    tree = ast.parse(open(path).read(), path)
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names |= {f'{node.module}.{a.name}' for a in node.names}  # from models import toy: models.toy
        elif (isinstance(node, ast.Call) and getattr(node.func, 'attr', getattr(node.func, 'id', None)) == 'import_module'
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            names.add(node.args[0].value)
    return {n for n in names if n in known}, {n.split('.')[0] for n in names}


def graph():
    mods = modules()
    return mods, {m: imports(p, mods) for m, p in mods.items()}


def layer(m):
    return m.split('.')[0] if m.split('.')[0] in FOLDERS else m


def violations(mods, deps):
    """One line per import that breaks the layout (the module docstring)."""
    bad = []
    stdlib = set(sys.stdlib_module_names)
    for m, (ours, top) in deps.items():
        for d in sorted(ours):
            if m in METHOD and d not in METHOD:
                bad.append(f'{m} (a method file) imports {d}')
            if layer(m) == 'infra' and layer(d) != 'infra':
                bad.append(f'{m} (plumbing) imports {d}')
            if layer(m) in ('models', 'extras') and d in ('train', 'sample'):
                bad.append(f'{m} imports the program {d}')
            if layer(m) in ('models', 'infra') and layer(d) == 'extras':
                bad.append(f'{m} imports the add-on {d}')
            if layer(d) == 'kvpo' and layer(m) != 'kvpo':
                bad.append(f'{m} imports {d} (nothing imports kvpo/)')
            if layer(d) == 'streaming' and layer(m) not in ('streaming', 'kvpo'):
                bad.append(f'{m} imports {d} (only kvpo/ imports streaming/)')
            if layer(m) == 'streaming' and layer(d) not in STREAMING_USES:
                bad.append(f'{m} (streaming) imports {d}')
            if layer(m) == 'kvpo' and layer(d) not in KVPO_USES:
                bad.append(f'{m} (kvpo) imports {d}')
            if d in FAMILIES and layer(m) not in ('models', 'streaming'):
                bad.append(f'{m} names the model family {d}')
        if m in METHOD:
            third = top - stdlib - {'torch'} - METHOD
            bad += [f'{m} (a method file) imports {t}' for t in sorted(third)]
    return bad


def circles(deps):
    """Every import circle between files, as a list of module names."""
    edges = {m: {d for d in ours if d in deps and d != m} for m, (ours, _) in deps.items()}
    found, state = [], {}

    def visit(m, path):
        state[m] = 'open'
        for d in sorted(edges[m]):
            if state.get(d) == 'open':
                found.append(path[path.index(d):] + [d])
            elif d not in state:
                visit(d, path + [d])
        state[m] = 'done'
    for m in sorted(edges):
        if m not in state:
            visit(m, [m])
    # a package and its own submodules are not a circle: `from models import policy` names the package
    return [c for c in found if len({layer(x) for x in c}) > 1 or not any(x in FOLDERS for x in c)]


def test_the_root_holds_the_card_files():
    assert {f for f in os.listdir(ROOT) if f.endswith('.py')} == CARD


def test_imports_run_one_way():
    mods, deps = graph()
    assert set(METHOD) <= set(mods) and {'models', 'models.policy', 'infra.checkpoint'} <= set(mods)
    assert violations(mods, deps) == []
    assert circles(deps) == []


def test_the_check_finds_a_method_file_that_imports_the_plumbing():
    # the same checks on a copy of the layout in which sde.py imports infra/parallel.py
    mods, deps = graph()
    bent = dict(deps, sde=(deps['sde'][0] | {'infra.parallel'}, deps['sde'][1] | {'infra'}))
    assert violations(mods, bent) == ['sde (a method file) imports infra.parallel',
                                      'sde (a method file) imports infra']
    bent = dict(deps, **{'infra.parallel': (deps['infra.parallel'][0] | {'trust_region'}, deps['infra.parallel'][1])})
    assert violations(mods, bent) == ['infra.parallel (plumbing) imports trust_region']
    bent = dict(deps, **{'infra.optimizer': (deps['infra.optimizer'][0] | {'models.toy'}, set())})
    assert violations(mods, bent) == ['infra.optimizer (plumbing) imports models.toy',
                                      'infra.optimizer names the model family models.toy']
    bent = dict(deps, reward=(deps['reward'][0] | {'models.policy'}, deps['reward'][1]))
    assert violations(mods, bent) == ['reward (a method file) imports models.policy']
    bent = dict(deps, sde=(deps['sde'][0] | {'equalizer'}, deps['sde'][1]))  # equalizer imports sde
    assert circles(bent) == [['equalizer', 'sde', 'equalizer']]


def test_a_family_missing_an_item_is_one_error_naming_it(monkeypatch):
    import models
    from models import toy
    fake = types.ModuleType('models.fake')
    fake.__dict__.update({k: getattr(toy, k) for k in models.INTERFACE if k != 'blocks'})
    fake.DEFAULTS = {k: v for k, v in toy.DEFAULTS.items() if k != 'sample_seeds'}
    monkeypatch.setitem(sys.modules, 'models.fake', fake)
    with pytest.raises(TypeError, match=r"models/fake.py lacks blocks, DEFAULTS\['sample_seeds'\] of the model interface"):
        models.load_family('fake')
    for name in models.FAMILIES.values():  # every shipped family provides all of it
        models.load_family(name)
