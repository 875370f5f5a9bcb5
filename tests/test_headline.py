"""
The toy's headline run, `python train.py config/toy.py`, as a user runs it, beside the same run at the paper's
lambda_KL (`--kl_ratio_target=0`; two processes, one thread each, side by side: ~12 min on 2 cores). What it pins:
- the reward-hacking alarm (models/evaluate.py, docs/method.md section 9) trips on the paper's run, whose
  composite rises while VQ, the toy's on-manifold quality, falls: one `alarm:` line that names VQ with its
  base -> now figures and standard error, `alarm` in metrics.jsonl's evaluation rows, and the checkpoint of the
  evaluation before the alarm pinned (never rotated away) and still there at the end;
- the headline run (lambda_KL holding the gradient ratio at 1, the default: docs/method.md 5.6) improves
  without it: its held-out composite and VQ end above the base model's, the manifold distance below, and the
  alarm stays silent (no `alarm:` line, no name in any row).
Marked slow (the README's command leaves it out; .ci/run runs it): python -m pytest -m slow tests/test_headline.py
"""
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_paper_lambda_trips_on_vq_and_the_headline_improves_silently(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS='1')
    runs = {name: (str(tmp_path / name), subprocess.Popen(
        [sys.executable, 'train.py', 'config/toy.py', f'--out_dir={tmp_path / name}', '--export_dtype='] + extra,
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        for name, extra in (('headline', []), ('paper', ['--kl_ratio_target=0']))}
    said = {}
    for name, (out, p) in runs.items():
        said[name], _ = p.communicate(timeout=2400)
        assert p.returncode == 0, said[name][-3000:]
    rows = {name: [json.loads(l) for l in open(os.path.join(out, 'metrics.jsonl'))] for name, (out, _) in runs.items()}
    alarms = [l for l in said['paper'].splitlines() if l.startswith('alarm:')]
    assert any('VQ ' in l and '; SE ' in l for l in alarms), said['paper'][-3000:]
    tripped = [r for r in rows['paper'] if r.get('alarm')]
    assert any('VQ' in r['alarm'] for r in tripped), [r.get('watch_flagged') for r in rows['paper']]
    evals = [r['iter'] for r in rows['paper'] if 'eval_composite' in r]
    before = evals[evals.index(tripped[0]['iter']) - 1]  # the evaluation before the first alarm
    out = runs['paper'][0]
    kept = [d for d in os.listdir(out) if d.startswith('ckpt_') and os.path.exists(os.path.join(out, d, 'pinned'))]
    # its checkpoint (the newest at or before it: config/toy.py saves every 20) stays past every rotation
    assert kept == [f'ckpt_{before - before % 20:06d}'], (kept, sorted(os.listdir(out)))
    ev = [r for r in rows['headline'] if 'eval_composite' in r]
    assert ev[-1]['eval_composite'] > ev[0]['eval_composite'] + 0.05 and ev[-1]['eval_VQ'] > ev[0]['eval_VQ']
    assert ev[-1]['eval_manifold'] < ev[0]['eval_manifold']
    assert not [l for l in said['headline'].splitlines() if l.startswith('alarm:')], said['headline'][-3000:]
    assert all(not r.get('alarm') and not r.get('watch_flagged') for r in rows['headline'])
    assert all('kl_ratio' in r for r in rows['headline'] if 'reward' in r)  # measured every step
