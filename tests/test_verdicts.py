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



def test_lower_is_better_is_signed_alike_on_both_sides():
    # the manifold distance, lower better: the reference at 0.05 + 0.001 s, the other at 0.07 + 0.002 s on
    # seed s, so the reference's advantage is +(0.02 + 0.001 s) a seed, mean +0.022 (a side left unsigned
    # would give about -0.12); the composite, higher better, +0.1 on every seed. bench.verdicts' advantage
    # and curve, and bench.paper's compare, the same numbers
    bv, bp = load(), load('paper')

    def run(manifold, composite):
        evals = [dict(iter=i, composite=composite, VQ=0.3, manifold=manifold) for i in range(0, 61, 5)]
        return dict(evals=evals, iters=[dict(group_std=0.2)])
    runs = {'ref': [run(0.05 + 0.001 * s, 0.6) for s in range(5)],
            'other': [run(0.07 + 0.002 * s, 0.5) for s in range(5)]}
    want = [0.02 + 0.001 * s for s in range(5)]
    for ci in (bv.advantage(runs, 'ref', 'other', 'manifold'), bp.compare(runs, 'ref', 'other', 'manifold')):
        assert ci['diffs'] == pytest.approx(want) and ci['mean'] == pytest.approx(0.022) and bv.verdict(ci) == 'holds'
    its, cis = bv.curve_of(runs, 'ref', 'other', 'manifold')
    assert its == list(range(0, 61, 5)) and all(c['diffs'] == pytest.approx(want) for c in cis)
    for ci in (bv.advantage(runs, 'ref', 'other', 'composite'), bp.compare(runs, 'ref', 'other', 'composite')):
        assert ci['diffs'] == pytest.approx([0.1] * 5)
    # the other way round: the other cell is nearer the manifold, the claim fails
    assert bv.verdict(bv.advantage(runs, 'other', 'ref', 'manifold')) == 'fails'

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


# ----------------------------------------------------------------------------- bench/paper.py
def config_settings(path):
    """The settings a config file sets, read as infra/configurator.py reads one."""
    ns = {}
    with open(os.path.join(ROOT, path)) as f:
        exec(f.read(), {}, ns)
    return {k: v for k, v in ns.items() if not k.startswith('_')}


def test_paper_cells_are_the_papers_recipes():
    """bench/paper.py's cells: the recipes of config/*.py, bench.verdicts' reference cells and names
    (so its 5 cached runs are reused), one cell where two would be bitwise the same run, and the order."""
    bv, bp = load(), load('paper')
    from trust_region import kl_weights
    cs = bp.cells()
    assert len(cs) == 25 and len({bp.name(ov, 0) for ov in cs.values()}) == 25  # every cell a run of its own
    a = {'reward_weights': config_settings('config/setting_a.py')['reward_weights']}
    assert bp.SETTING_A == a == {'reward_weights': (1.0, 1.0, 1.0)}
    # config/fixed_kl.py pins kl_ratio_target=0, as every bench run has it (bench/common.py PINNED): the cells
    # leave it out, so their names (and the runs cached under them) stay as they were
    from bench.common import PINNED
    fixed = config_settings('config/fixed_kl.py')
    assert fixed.pop('kl_ratio_target') == PINNED['kl_ratio_target'] == 0
    for k in ('dance', 'flow', 'cps'):
        recipe = config_settings(f'config/{k}.py')
        for st, extra in (('B', {}), ('A', a)):
            assert cs[f'{k} ({st})'] == dict(recipe, **extra)
            assert cs[f'{k} + fixed KL ({st})'] == dict(recipe, **fixed, **extra)
    for st, extra in (('B', {}), ('A', a)):
        assert cs[f'sage ({st})'] == dict(bv.REF, **extra)
        assert {cs[f'{x} ({st})']['advantage'] for x in ('taros', 'per_component')} == {'taros', 'per_component'}
    # the reference of Setting B is bench.verdicts' cell: the same settings, the same names, cached
    assert (bp.iters, bp.prompts, bp.eval_every, bp.seeds, bp.late_iters) == \
        (bv.iters, bv.prompts, bv.eval_every, bv.seeds, bv.late_iters)
    for s in range(bp.seeds):
        assert bp.name(cs['sage (B)'], s) == bv.name(bv.REF, s)
        assert os.path.exists(os.path.join(ROOT, 'results', 'cells', bv.name(bv.REF, s) + '.json'))
    assert not any(c in bp.name(cs['sage (A)'], 0) for c in ' ()')  # a tuple: 1.0,1.0,1.0
    # Fig. 7 (docs/method.md 5.5) and Fig. 8 at the defaults: kl_estimator only where the velocity term is on
    assert cs['lambda fixed 1e-5'] == dict(bv.REF, kl_init=1e-5, kl_min=1e-5, kl_max=1e-5, kl_warmup=0)
    assert cs['lambda 1e-7 -> 1e-6'] == dict(bv.REF, kl_max=1e-6)
    assert kl_weights('moving', 1.0, 0.1)[1] == kl_weights('none', 1.0, 0.1)[1] == 0  # sample = exact there
    assert all(kl_weights(ov.get('kl_strategy'), 1.0, 0.1)[1] > 0 for ov in cs.values() if 'kl_estimator' in ov)
    assert not any('updates_per_iter' in ov for ov in cs.values())  # the paper's one optimizer step an iteration
    assert all(ov.get('kl_max', 1e-5) <= 1e-5 for ov in cs.values() if ov['kl_strategy'] != 'fixed')  # its kl_max
    # the released loop's choices, one each (docs/method.md 6.1)
    assert cs['prompt_noise fixed'] == dict(bv.REF, prompt_noise='fixed') and cs['median lower'] == dict(bv.REF, median='lower')
    # the order of the runs: the advantage at Setting B first, then the cached references of it trained again
    # for their alarm (they were trained before it existed), then Table 2 at B; every run once
    order = bp.todo(cs)
    runs = [(lb, s) for lb, s, again in order if not again]
    assert len(runs) == len(set(runs)) == 25 * 5
    assert [lb for lb, _ in runs[:15]] == ['sage (B)', 'taros (B)', 'per_component (B)'] * 5
    assert {lb for lb, _ in runs[15:45]} == {f'{k}{kl} (B)' for k in ('dance', 'flow', 'cps') for kl in ('', ' + fixed KL')}
    again = [(lb, s) for lb, s, a in order if a]
    assert again == [('sage (B)', s) for s in range(5)] and order[15:20] == [('sage (B)', s, True) for s in range(5)]


def test_paper_report_of_made_up_cells(tmp_path):
    """The report with some cells run, one with a single seed and most not run: paired verdicts, '-' for
    the visual metrics a cell lacks, and the alarm from the evals, from a side cell, or not recorded."""
    bp = load('paper')
    from bench import common as bc
    cs = bp.cells()
    (tmp_path / 'cells').mkdir()
    spread = [0.0, 0.2, -0.15, 0.1, -0.05]
    g = torch.Generator().manual_seed(2)

    def put(label, s, shift, alarm_at=None, clip=False):
        run = fake_run(bc, 0.55 + spread[s], shift)
        for i, e in enumerate(run['evals']):
            if clip:
                e['clipscore'] = 0.3 + shift * e['iter'] / 60
            if alarm_at is not None:  # recorded: a list at every evaluation, the base's included
                e.update(alarm=['VQ'] if i == alarm_at else [], watch_flagged=[])
        (tmp_path / 'cells' / f'{bp.name(cs[label], s)}.json').write_text(json.dumps(run))
    for s in range(5):
        put('sage (B)', s, 0.2, clip=True)  # before the alarm existed: not recorded
        put('taros (B)', s, 0.25 + 0.003 * torch.randn(1, generator=g).item(), alarm_at=4 if s < 2 else -1, clip=True)
        put('per_component (B)', s, 0.15 + 0.003 * torch.randn(1, generator=g).item())
        side = dict(evals=[dict(iter=i, alarm=[], watch_flagged=[]) for i in range(0, 61, 5)], model_hash=bc.MODEL_HASH)
        (tmp_path / 'cells' / f'alarm_{bp.name(cs["per_component (B)"], s)}.json').write_text(json.dumps(side))
    put('flow (B)', 0, 0.1)  # one seed so far
    again = fake_run(bc, 0.55, 0.2)  # sage (B) seed 0 trained again for its alarm: the same evaluations
    for i, e in enumerate(again['evals']):
        e.update(alarm=['VQ'] if i == 6 else [], watch_flagged=[])
    (tmp_path / 'cells' / f'rerun_{bp.name(cs["sage (B)"], 0)}.json').write_text(json.dumps(again))
    p = subprocess.run([sys.executable, '-m', 'bench.paper', '--run=False', f'--out={tmp_path}'], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads((tmp_path / 'paper.json').read_text())
    adv, t2 = res['comparisons']['advB'], res['comparisons']['t2B']
    assert adv['sage (B) vs taros (B)']['composite']['verdict'] == 'fails'  # taros better on every seed
    assert adv['sage (B) vs per_component (B)']['composite']['verdict'] == 'holds'
    assert adv['sage (B) vs per_component (B)']['manifold']['verdict'] == 'holds'  # lower is better
    assert adv['sage (B) vs taros (B)']['CLIPScore']['verdict'] == 'fails'
    assert adv['sage (B) vs taros (B)']['PickScore'] is None and adv['sage (B) vs per_component (B)']['CLIPScore'] is None
    assert t2['sage (B) vs flow (B)']['composite']['verdict'] == 'too few seeds yet'
    assert t2['sage (B) vs dance (B)']['composite']['verdict'] == 'not run'
    al = res['alarms']
    assert al['taros (B)'][:3] == [dict(evals=4, iter=20, watchers=['VQ'])] * 2 + ['never']
    assert al['sage (B)'] == [dict(evals=6, iter=30, watchers=['VQ'])] + ['not recorded'] * 4
    assert al['per_component (B)'] == ['never'] * 5
    assert al['taros (A)'] == [None] * 5
    md = (tmp_path / 'paper.md').read_text()
    assert '**Incomplete**: 109 of 125 runs' in md and '| dance (B) | not run |' in md
    assert 's0: 4 (iteration 20: VQ)' in md and '| sage (B) | 5 | 1/1 |' in md
    assert 'Trained again for the alarm (cells cached before it existed): 1 runs; the largest difference' in md
    assert '0.0e+00' in md  # the same evaluations
    assert res['have']['flow (B)'] == 1 and not (tmp_path / 'README.md').exists()  # only out='results' writes it
