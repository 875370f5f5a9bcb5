"""
bench/verdicts.py's statistics and report, without training: the t quantile against printed tables,
the interval's coverage by simulation, and the verdicts of a report written from fabricated cells
whose answers are known (a paired effect that an unpaired comparison would miss, a reversed one and
pure noise).

    python -m pytest tests/test_verdicts.py
"""
import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def load(name='verdicts'):
    """bench/<name>.py's functions, without running its main (settings at their defaults)."""
    import importlib
    argv, sys.argv = sys.argv, [f'bench/{name}.py']
    try:
        return importlib.import_module(f'bench.{name}')
    finally:
        sys.argv = argv


def test_t_quantile_matches_printed_tables():
    bv = load()
    table = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 9: 2.262, 30: 2.042}  # any statistics textbook, t_{0.975}
    for df, t in table.items():
        assert abs(bv.t975(df) - t) < 1e-3, (df, bv.t975(df), t)


def test_verdict_words():
    bv = load()
    ci = lambda lo, hi, n=5: dict(n=n, lo=lo, hi=hi, mean=(lo + hi) / 2)
    assert [bv.verdict(ci(0.1, 0.2)), bv.verdict(ci(-0.2, -0.1)), bv.verdict(ci(-0.1, 0.1)), bv.verdict(ci(0.0, 0.0)),
            bv.verdict(ci(1.0, 1.0))] == ['holds', 'fails', 'cannot be told', 'tied on every seed', 'holds']
    assert bv.verdict(ci(0.1, 0.2, n=1)) == 'too few seeds yet' and bv.verdict(ci(0, 0, n=0)) == 'not run'


def test_interval_covers_the_true_mean_95_percent():
    bv = load()
    g = torch.Generator().manual_seed(0)
    n_trials, hits = 4000, 0
    for _ in range(n_trials):
        d = (0.3 + 0.7 * torch.randn(5, generator=g, dtype=torch.float64)).tolist()
        ci = bv.paired(d, [0.0] * 5)
        hits += ci['lo'] <= 0.3 <= ci['hi']
    assert abs(hits / n_trials - 0.95) < 0.012, hits / n_trials  # 3.5 binomial standard errors


def fake_run(bc, base, shift, iters=60, every=5):
    """A cell's cached dict: held-out composite base + shift * progress, manifold mirrored."""
    evals = [dict(iter=i, composite=base + shift * i / iters, VQ=0.3 + shift * i / iters, MQ=0.3, TA=0.3,
                  manifold=0.07 - shift * i / iters / 10) for i in range(0, iters + 1, every)]
    return dict(overrides={}, evals=evals, before=evals[0], final=evals[-1], model_hash=bc.MODEL_HASH,
                iters=[dict(reward=0.6, group_std=0.2 + shift) for _ in range(iters)])


def test_report_of_fabricated_cells(tmp_path):
    bv = load()
    from bench import common as bc
    cells = tmp_path / 'cells'
    cells.mkdir()
    for k in ('flow', 'dance', 'cps'):  # section 1's matched-exploration cells, as committed
        src = os.path.join(ROOT, 'results', 'cells', bv.MATCH_CELL.format(k) + '.json')
        shutil.copy(src, cells / os.path.basename(src))
    bv.C.setup(str(tmp_path), 1, 0.0)
    labels = bv.cells()
    g = torch.Generator().manual_seed(1)
    spread = [0.0, 0.2, -0.15, 0.1, -0.05]  # between-seed spread far larger than the paired effects
    for s in range(5):
        for label, ov in labels.items():
            shift = 0.2  # the reference's gain
            if label == 'flow':
                shift = 0.15 + 0.003 * torch.randn(1, generator=g).item()  # sage better by 0.05 on every seed
            elif label == 'dance':
                shift = 0.25  # sage worse: the claim fails
            elif label == 'cps':
                shift = 0.2 + 0.1 * torch.randn(1, generator=g).item()  # noise only
            run = fake_run(bc, 0.55 + spread[s], shift)
            with open(cells / f'{bv.name(ov, s)}.json', 'w') as f:
                json.dump(run, f)
    p = subprocess.run([sys.executable, '-m', 'bench.verdicts', '--run=False', f'--out={tmp_path}'], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads((tmp_path / 'verdicts.json').read_text())
    c1 = res['comparisons']['1']
    late = 0.05 * 50 / 60  # the mean over iterations 40..60 of a gap growing linearly to 0.05
    assert late - 0.006 < c1['sage vs flow']['composite']['lo'] and c1['sage vs flow']['composite']['hi'] < late + 0.006
    assert bv.verdict(c1['sage vs flow']['composite']) == 'holds'  # the paired interval sees it ...
    sage_f, flow_f = ([0.55 + x + sh for x in spread] for sh in (0.2, 0.15))  # ... unpaired, it cannot be told
    sd = lambda xs: torch.tensor(xs, dtype=torch.float64).std().item()
    half = bv.t975(8) * math.sqrt(sd(sage_f) ** 2 / 5 + sd(flow_f) ** 2 / 5)
    assert abs(sum(sage_f) / 5 - sum(flow_f) / 5) < half
    assert bv.verdict(c1['sage vs dance']['composite']) == 'fails'
    assert bv.verdict(c1['sage vs dance']['manifold']) == 'fails'  # the mirrored manifold: lower is better
    row = res['short'][0]  # the README's short form of claim 1: holds vs, fails vs, cannot be told vs
    assert row[1].startswith('flow (+0.0') and row[2].startswith('dance (-') and 'cps' in row[3]
    md = (tmp_path / 'README.md').read_text()
    assert '<!-- bench.verdicts:begin' in md and 'holds vs flow' in md and 'fails vs dance' in md
    assert 'dance matched' not in res['cells']  # section 1 found no eta within 10% for dance
    speed = res['comparisons']['5']
    assert speed['flow to 0.7']['mean'] > 0 and speed['dance to 0.7']['mean'] < 0  # sage faster than flow
    assert 'Incomplete' not in (tmp_path / 'verdicts.md').read_text()
    pytest.importorskip('matplotlib')  # the tables do not need it, the plots do
    for k in range(1, 6):
        assert (tmp_path / f'verdict_{k}.png').read_bytes()[:4] == b'\x89PNG'


def test_put_block_rewrites_only_its_block(tmp_path):
    """The README writer every bench shares: its block is replaced, the hand-written text is not touched."""
    from bench import common as C
    path = str(tmp_path / 'R.md')
    C.put_block(path, 'bench_x', ['a', '', 'b'])  # no file yet: the block is the file
    with open(path, 'a') as f:
        f.write('hand-written\n')
    C.put_block(path, 'bench_y', ['y'])  # absent: appended after the text
    C.put_block(path, 'bench_x', ['new'])  # present: replaced in place
    text = open(path).read()
    assert text.index('new') < text.index('hand-written') < text.index('y\n') and 'a\n' not in text
    assert C.get_block(path, 'bench_x') == ['new'] and C.get_block(path, 'bench_z') is None
    assert '`python -m bench_x`' in text.split('\n')[0]  # the marker names the script to edit
    before = text
    for tag in ('bench_x', 'bench_y'):
        C.put_block(path, tag, C.get_block(path, tag))
    assert open(path).read() == before  # get then put: the file is unchanged
