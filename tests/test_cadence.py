"""
The checkpoint clock through `python train.py` (one process, run here), in the fast tier: save_every=0
(no count), save_every_min=30, on a clock that reads 20 minutes for each iteration logged so far: a
checkpoint after the run's first iteration, then at iteration 3 (40 minutes after the first one's),
then at the end (4). A clock that started again each iteration would never reach 30 minutes. (Every rank
deciding the same: tests/test_ranks_agree.py; 12 iterations against the count: the slow tier's
tests/test_launch_second.py.)

    python -m pytest tests/test_cadence.py
"""
import functools
import os
import sys

from infra import rundir

sys.path.insert(0, os.path.dirname(__file__))
from test_train import SMALL, run_here  # noqa: E402


def test_save_every_min_comes_due_across_iterations(tmp_path, monkeypatch):
    out = str(tmp_path / 'clock')

    def minutes_20_an_iteration():  # 20 minutes for each iteration logged so far
        path = os.path.join(out, 'metrics.jsonl')
        done = sum('"reward"' in line for line in open(path)) if os.path.exists(path) else 0
        return 60.0 * 20 * done
    with monkeypatch.context() as m:
        m.setattr(rundir, 'Cadence', functools.partial(rundir.Cadence, clock=minutes_20_an_iteration))
        run_here(monkeypatch, SMALL + [f'--out_dir={out}', '--max_iters=4', '--diag_every=0', '--prompts_per_iter=1',
                                       '--num_steps=2', '--save_every=0', '--save_every_min=30',
                                       '--keep_checkpoints=10', '--export_dtype='])
    saved = sorted(int(d.split('_')[-1]) for d in os.listdir(out) if d.startswith('ckpt_') and '.' not in d)
    assert saved == [1, 3, 4], os.listdir(out)
