"""
Collectives around slow I/O (issue 49, item 5): what rank 0 does alone for minutes at 8.3B (reading and
upcasting the model; deleting a rotated 133 GB checkpoint or a dead save's leftovers) must not sit
between collectives that the other ranks wait in under dist_timeout (NCCL's 10 minutes). Two CPU ranks
(gloo, tests/slow_io_worker.py) with a 6 s dist_timeout and rank 0's I/O slowed to 10 s: load_policy's
other ranks wait on the c10d store (solo_timeout), the broadcast then runs; checkpoint.save's deletes
run after its last barrier, in the background. What a failure would show: a rank's one line 'a
collective failed: ... timed out' and a non-zero exit; the first 8-GPU launch dying while rank 0 reads.

    python -m pytest tests/test_slow_io.py
"""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SLOW_S = 10  # rank 0's slow read or delete; dist_timeout is 6 s (slow_io_worker.TIMEOUT_MIN)


@pytest.mark.slow  # two 2-rank runs of ~30 s each: the slow tier (.ci/run)
@pytest.mark.parametrize('what', ['load', 'save'])
def test_rank_0_alone_with_slow_io_never_times_the_others_out(what, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS='1', PYTHONPATH=ROOT)
    cmd = [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2',
           os.path.join(ROOT, 'tests', 'slow_io_worker.py'), what, str(tmp_path / 'out'), str(SLOW_S)]
    run = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    why = [l for l in run.stderr.splitlines() if any(k in l for k in ('Error', 'failed', 'assert'))]
    assert run.returncode == 0, f'rc {run.returncode}\n{run.stdout[-2000:]}\n' + '\n'.join(why[-30:])
    assert 'rank 0: ok' in run.stdout and 'rank 1: ok' in run.stdout
    if what == 'save':  # the three saves did not wait for the four deletes (4 x 10 s)
        seconds = float(run.stdout.split('three saves in ')[1].split(' s')[0])
        assert seconds < SLOW_S, run.stdout
