"""
The toy's headline run, `python train.py config/toy.py`, as a user runs it (one process, one thread), cut to its
first 20 iterations (~6 min; the whole 40 took 15 min in .ci/run's slow tier, which must end within CI's 30).
What it pins: the default (lambda_KL holding the gradient ratio at 1: docs/method.md 5.6) improves without
reward hacking: its held-out composite and VQ end above the base model's, the manifold distance below, the
reward-hacking alarm (models/evaluate.py, docs/method.md section 9) stays silent (no `alarm:` line, no watcher
flagged in any row), and the ratio is measured in every row with lambda_KL far above the paper's 1e-5.
The alarm's other side is tested on recorded runs: it trips in every 'none' run at 1e-4, whose VQ falls
(tests/test_alarm.py's replay of bench.alarm's runs; the README's second headline run, at the paper's lambda,
trips on VQ at iteration 40: bench.toy section 0), and pins the checkpoint before it (tests/test_train_settings.py).
Marked slow (the README's command leaves it out; .ci/run runs it): python -m pytest -m slow tests/test_headline.py
"""
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_headline_improves_and_the_alarm_stays_silent(tmp_path):
    out = str(tmp_path / 'headline')
    p = subprocess.run([sys.executable, 'train.py', 'config/toy.py', f'--out_dir={out}', '--export_dtype=',
                        '--max_iters=20'], cwd=ROOT,
                       env=dict(os.environ, OMP_NUM_THREADS='1'), capture_output=True, text=True, timeout=2400)
    said = p.stdout + p.stderr
    assert p.returncode == 0, said[-3000:]
    rows = [json.loads(l) for l in open(os.path.join(out, 'metrics.jsonl'))]
    ev = [r for r in rows if 'eval_composite' in r]
    assert [r['iter'] for r in ev] == [0, 10, 20]
    assert ev[-1]['eval_composite'] > ev[0]['eval_composite'] + 0.05 and ev[-1]['eval_VQ'] > ev[0]['eval_VQ']
    assert ev[-1]['eval_manifold'] < ev[0]['eval_manifold']
    assert not [l for l in said.splitlines() if l.startswith('alarm:')], said[-3000:]
    assert all(not r.get('alarm') and not r.get('watch_flagged') for r in rows)
    steps = [r for r in rows if 'reward' in r]
    assert all('kl_ratio' in r for r in steps) and steps[-1]['lambda_kl'] > 1e-3  # measured every step, held
