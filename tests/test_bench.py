"""
bench/toy.py --quick end to end (~100 s of CPU; its 4 train.py runs evaluate 4 held-out prompts x 1
seed): every section runs in its reduced form and writes finite numbers, the Markdown tables and (with
matplotlib) the plots. Marked slow: the suite (CI, 10 minutes on 2 cores) leaves it out; run it
after changing bench/toy.py, bench/toy_*.py or bench/common.py (.ci/run runs it):

    python -m pytest -m slow tests/test_bench.py
"""
import json
import math
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # ~2 min: not in the README's command (pytest.ini); .ci/run runs it
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def numbers(x):
    """Every int/float inside a JSON value."""
    if isinstance(x, bool):
        return []
    if isinstance(x, (int, float)):
        return [x]
    if isinstance(x, dict):
        return [n for v in x.values() for n in numbers(v)]
    if isinstance(x, list):
        return [n for v in x for n in numbers(v)]
    return []


@pytest.fixture(scope='module')
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp('bench')
    from bench import common as C  # blocks other scripts own (results/README.md sections 6-11): kept through the rewrite
    for tag in ('bench.verdicts', 'bench.paper', 'bench.checkpoint'):
        C.put_block(str(out / 'README.md'), tag, [f'## planted by {tag}', '', f'{tag} line'])
    p = subprocess.run([sys.executable, '-m', 'bench.toy', '--quick', f'--out={out}'], cwd=ROOT,
                       capture_output=True, text=True, timeout=360)  # ~100 s alone, more beside the suite's other worker
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return out


def test_outputs_exist_and_are_finite(quick):
    with open(quick / 'bench.json') as f:
        res = json.load(f)
    for section in ('0', '1', '2', '3', '4', '5'):
        assert section in res, f'section {section} missing from bench.json'
    nums = numbers({k: res[k] for k in ('0', '1', '2', '3', '4', '5')})
    assert len(nums) > 100 and all(math.isfinite(n) for n in nums)
    # the headline numbers are there and sane
    assert res['2']['stats']['sage']['ratio_eq'] < res['2']['stats']['sage']['ratio']  # S_t equalizes
    base = res['0']['base']  # the toy world's references bracket the base model
    assert base['noise']['composite'] < base['rl']['composite'] < base['clean']['composite'] == 2.0
    assert base['clean']['manifold'] < 1e-3 < base['rl']['manifold'] < base['noise']['manifold']
    assert [e['iter'] for e in res['0']['run']['evals']] == [0, 1]  # the default run, shortened
    assert res['4']['runs']['1 process']['peak_mem_gb_ranks'][0] > 0
    assert len(res['4']['runs']['FSDP 2 ranks']['peak_mem_gb_ranks']) == 2  # each rank's own peak
    assert res['4']['runs']['overhead']['ratio'] > 0
    assert 8.0e9 < res['5']['P'] < 8.7e9  # HunyuanVideo 1.5: 8.3B parameters
    assert len(os.listdir(quick / 'cells')) >= 10  # every cell cached for the next run


def test_markdown_tables(quick):
    md = (quick / 'README.md').read_text()
    for head in ('## 0.', '## 1.', '## 2.', '## 3.', '## 4.', '## 5.', 'Overhead ratio', 'Matched exploration'):
        assert head in md
    assert 'nan' not in md.lower().replace('nanogpt', '')


def test_other_scripts_blocks_kept(quick):
    from bench import common as C  # the rewrite keeps every block another script wrote, in its order, after the sections
    md = (quick / 'README.md').read_text()
    tags = ('bench.verdicts', 'bench.paper', 'bench.checkpoint')
    assert [C.get_block(str(quick / 'README.md'), t) for t in tags] == [[f'## planted by {t}', '', f'{t} line'] for t in tags]
    assert md.index('## 5.') < md.index('bench.verdicts line') < md.index('bench.paper line') < md.index('bench.checkpoint line')


def test_plots(quick):
    pytest.importorskip('matplotlib')  # the tables do not need it, the PNGs do
    for name in ('samplers.png', 'fig4_gradnorm.png', 'ablation_a.png'):
        data = (quick / name).read_bytes()
        assert data[:8] == b'\x89PNG\r\n\x1a\n' and len(data) > 1000
