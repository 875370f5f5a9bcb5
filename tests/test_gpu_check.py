"""
bench/gpu_check.py, the one command for a lent GPU, on its CPU path: every phase at the tests' tiny sizes
(slow tier, ~2.5 min on 2 cores), and the time limits: a phase killed at its limit, and one the deadline
leaves no time for, each still leave a json that says so.

    python -m pytest -m slow tests/test_gpu_check.py
"""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMES = ('env', 'drift', 'attention', 'update', 'reward', 'smoke')


def check(tmp_path, *args, timeout=600):
    out = tmp_path / 'out'
    p = subprocess.run([sys.executable, '-m', 'bench.gpu_check', '--device=cpu', f'--out={out}',
                        f'--work_dir={tmp_path / "work"}', *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=timeout, env=dict(os.environ, OMP_NUM_THREADS='1'))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    recs = {f: json.loads((out / f).read_text()) for f in os.listdir(out) if f.endswith('.json')}
    return p.stdout.splitlines(), recs, sorted(os.listdir(out))


def test_a_phase_out_of_time_still_leaves_its_json(tmp_path):
    lines, recs, files = check(tmp_path, '--phases=drift,smoke', '--phase_timeout=3', '--deadline=4')
    assert files == ['1_drift.json', '5_smoke.json', 'gpu_check.log']
    assert recs['1_drift.json']['status'] == 'timeout' and recs['1_drift.json']['limit_s'] == 3
    assert recs['1_drift.json']['error'] == 'killed at its limit of 3 s'
    assert recs['5_smoke.json']['status'] == 'skipped'  # 1 s left: not started
    assert [l.split(':')[0] for l in lines[:2]] == ['1 drift', '5 smoke']


@pytest.mark.slow  # every phase at tiny size, train.py twice under torchrun: ~2.5 min on 2 cores
def test_every_phase_at_tiny_size_on_cpu(tmp_path):
    lines, recs, files = check(tmp_path)
    # what comes back from a device machine: at most 8 files, one json a phase and the log
    assert files == [f'{i}_{n}.json' for i, n in enumerate(NAMES)] + ['gpu_check.log'] and len(files) <= 8
    assert [l.split(' in ')[0] for l in lines[:6]] == [f'{i} {n}: ok' for i, n in enumerate(NAMES)], lines
    r = {n: recs[f'{i}_{n}.json'] for i, n in enumerate(NAMES)}
    assert all(x['status'] == 'ok' and x['rc'] == 0 for x in r.values())
    assert r['env']['matmul']['tflops'] > 0 and r['env']['sdpa']['kernels']
    # fp32 on a CPU: the rollout-shaped and update-shaped forwards agree far inside the clip range
    assert [s['step'] for s in r['drift']['steps']] == [19, 18, 17, 10, 0]
    assert all(s['max_abs_dlogp'] < 1e-5 and s['frac_beyond_clip'] == 0 for s in r['drift']['steps'])
    ran = {x['backend'] for x in r['attention']['rows'] if 'fwd_bwd_ms' in x}
    assert 'native' in ran and r['attention']['fastest'] in ran
    assert all(x['max_rel_diff'] < 1e-5 for x in r['attention']['rows'] if 'fwd_bwd_ms' in x)
    parts = ('anchor forward', 'forward', 'backward', 'clip', 'muon')
    assert len(r['update']['runs']) == 4 and all(x[p]['s'] > 0 for x in r['update']['runs'] for p in parts)
    assert set(r['update']['at_54_blocks_8_ranks']) == {'autocast', 'no_autocast'}
    assert r['reward']['videoalign']['second']['finite'] and len(r['reward']['vae']['decode']) == 1
    assert [x['iter'] for x in r['smoke']['iterations']] == [1, 2] and r['smoke']['export']['loaded']
