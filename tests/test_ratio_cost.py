"""
What holding the gradient ratio costs (bench/ratio_cost.py), checked where it can be without the full size:
- the split micro-step (bench/fullsize_measure.py train_step with split=True: extras/diagnostics.py's own
  GradientSplit) on a small transformer sharded over 2 fake ranks: the forward FLOPs are the plain step's, the
  backward's exactly twice (two backward passes, each recomputing its checkpointed blocks), and the gradients
  held at the peak grow from one sharded fp32 set (4 bytes a parameter over the ranks, by hand) to about two;
- slow tier: with real tensors in one process (no FSDP), the split step's peak resident memory exceeds the
  plain step's by one fp32 gradient of the trainable weights (4 bytes a parameter), the KL term's sum;
- the report from cached cells: an iteration's FLOPs by hand (num_steps rollout forwards + every trained
  step's micro-step), sage's trained steps at the released schedule (all 20 stochastic), the toy's medians.
python -m pytest tests/test_ratio_cost.py
"""
import json
import os
import statistics
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, 'tests'))
from bench import common as C  # noqa: E402
from bench import fullsize_measure as bf  # noqa: E402
from bench import ratio_cost as RC  # noqa: E402
from test_fullsize import RUN, SMALL  # noqa: E402


def test_split_micro_step_runs_two_backwards_and_keeps_a_second_gradient_sum():
    run = dict(RUN, world=2, attn='gpu', bf16=True)
    plain, split = bf.measure(SMALL, **run), bf.measure(SMALL, **run, split=True)
    f0, f1 = ({k: v['flops'] for k, v in r['phases'].items()} for r in (plain, split))
    assert f1['anchor forward'] == f0['anchor forward'] > 0 and f1['policy forward'] == f0['policy forward']
    assert f1['backward'] == 2 * f0['backward']  # both passes recompute the checkpointed blocks
    g0, g1 = (bf.categories(r)['grads (fp32)'] for r in (plain, split))
    assert g0 == pytest.approx(4 * plain['P_trainable'] / 2, rel=0.01)  # fp32, sharded over 2 ranks
    assert 1.8 * g0 <= g1 <= 2.0 * g0 + 1e6  # the KL sum beside the policy's, until the step
    assert bf.categories(split)['total'] > bf.categories(plain)['total']


@pytest.mark.slow
def test_split_step_costs_one_gradient_of_resident_memory():
    cfg = dict(SMALL, num_layers=5)  # 58M parameters: a gradient of 232 MB against the allocator's noise
    code = ('import json, sys; from bench import fullsize_measure as bf; from tests.test_fullsize import RUN; '
            'r = bf.rss_run(json.loads(sys.argv[1]), **RUN, split=sys.argv[2] == "split"); '
            'print("RSS", r["rss_growth"], r["P_trainable"])')
    env = dict(os.environ, OMP_NUM_THREADS='1', MALLOC_MMAP_THRESHOLD_='65536', PYTHONPATH=ROOT)
    got = {}
    for kind in ('plain', 'split'):
        out = subprocess.run([sys.executable, '-c', code, json.dumps(cfg), kind], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-2000:]
        got[kind] = [float(x) for x in out.stdout.split('RSS')[-1].split()]
    grad = 4 * got['plain'][1]  # one fp32 gradient of the trainable weights
    assert got['split'][0] - got['plain'][0] == pytest.approx(grad, rel=0.15), (got, grad)


def test_report_from_cells(tmp_path, monkeypatch):
    monkeypatch.setattr(C, 'OUT', str(tmp_path))
    os.makedirs(tmp_path / 'cells')
    monkeypatch.setattr(RC, 'frames', (21,))
    GiB = 2 ** 30

    def cell(name, res):
        with open(tmp_path / 'cells' / f'{name}.json', 'w') as f:
            json.dump(dict(res, model_hash=C.MODEL_HASH), f)
    flops = dict(plain={'anchor forward': 2e12, 'policy forward': 2e12, 'backward': 6e12},
                 split={'anchor forward': 2e12, 'policy forward': 2e12, 'backward': 12e12, 'ratio': 0})
    for kind, total in (('plain', 40 * GiB), ('split', 44 * GiB)):
        cell(f'ratio_cost_21x{RC.height}x{RC.width}_w{RC.gpus}_{kind}',
             dict(peak={'total': total, 'grads (fp32)': total / 10, 'backward temporaries': total / 20},
                  peak_phase='backward', P=8.3e9, tokens=6864,
                  flops=flops[kind], seconds=1.0))
    its = lambda u: [dict(t_rollout=1.0, t_reward=0.5, t_update=u + i / 100, kl_ratio=1.0) for i in range(5)]  # noqa: E731
    cell('s0_ratio', dict(iters=its(3.0), wall=130.0))
    cell('s0_paper_kl', dict(iters=its(2.0), wall=100.0))
    n_train = RC.trained_steps()
    assert n_train == 20  # sage at eta 0.5: every one of the 20 steps is stochastic, and trained
    full = RC.full_size(n_train, measure=False)
    plain, split = ((20 * 2e12 + 20 * f) / 1e12 for f in (10e12, 16e12))  # by hand: 20 forwards + 20 micro-steps
    assert full[21]['iteration_tflop'] == pytest.approx([plain, split])
    assert full[21]['backward_tflop'] == pytest.approx([6, 12]) and full[21]['peak_gib'] == pytest.approx([40, 44])
    small = RC.toy()
    assert small['ratio']['update'] == pytest.approx(statistics.median([3.0 + i / 100 for i in range(5)]) /
                                                     statistics.median([2.0 + i / 100 for i in range(5)]))
    assert small['ratio']['wall'] == pytest.approx(1.3)
    res, md = RC.report(n_train, full, small)
    assert f'{split / plain:.2f}x the FLOPs of an iteration' in res['sentence'] and '+4.0 GiB' in res['sentence']
    assert 'backward 2.00x' in res['sentence'] and any('| 21 x 352 x 624' in l for l in md)
