"""
bench/gpu_check.py, the one command for a lent GPU, on its CPU path: every phase at the tests' tiny sizes
in the order env, smoke, update, attention, reward, drift (slow tier, ~3 min on 2 cores), and the time
limits: a phase killed at its limit, and one the deadline leaves no time for, each still leave a json that
says so; the env phase stops the check at once, with one line, when the carried wheels do not import;
a phase at its limit ends with every process under it (a child in a session of its own, as torchrun
starts its workers, included) and its output's tail reaches <out> while it runs; an env phase cut short
after its all-reduce stops nothing; the attention phase picks only a backend that passed its gate; the
carried wheels are the tested versions; the phases' modules import one way (no circle).

    python -m pytest -m slow tests/test_gpu_check.py
"""
import ast
import importlib.metadata
import json
import os
import subprocess
import sys
import time

import psutil
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMES = ('env', 'smoke', 'update', 'attention', 'reward', 'drift')


def check(tmp_path, *args, timeout=600, env=None):
    out = tmp_path / 'out'
    p = subprocess.run([sys.executable, '-m', 'bench.gpu_check', '--device=cpu', f'--out={out}',
                        f'--work_dir={tmp_path / "work"}', *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=timeout, env=dict(os.environ, OMP_NUM_THREADS='1', **(env or {})))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    recs = {f: json.loads((out / f).read_text()) for f in os.listdir(out) if f.endswith('.json')}
    return p.stdout.splitlines(), recs, sorted(os.listdir(out))


def test_a_phase_out_of_time_still_leaves_its_json(tmp_path):
    lines, recs, files = check(tmp_path, '--phases=smoke,drift', '--phase_timeout=3', '--deadline=4')
    assert files == ['1_smoke.json', '5_drift.json', 'gpu_check.log']
    assert recs['1_smoke.json']['status'] == 'timeout' and recs['1_smoke.json']['limit_s'] == 3
    assert recs['1_smoke.json']['error'] == 'killed at its limit of 3 s'
    assert recs['5_drift.json']['status'] == 'skipped'  # 1 s left: not started
    assert [l.split(':')[0] for l in lines[:2]] == ['1 smoke', '5 drift']


def test_a_phase_ended_at_its_limit_leaves_no_process_behind(monkeypatch):
    """A launcher whose child starts a session of its own (torchrun's workers do) and outlives it: end_tree
    of the launcher ends both; a kill of the launcher's group would have left the child running."""
    monkeypatch.setattr(sys, 'argv', ['gpu_check'])  # its settings read the command line at import
    from bench.gpu_check import end_tree
    code = ("import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', 'import time; "
            "time.sleep(600)'], start_new_session=True); print(c.pid, flush=True); time.sleep(600)")
    launcher = subprocess.Popen([sys.executable, '-c', code], stdout=subprocess.PIPE, text=True,
                                start_new_session=True)
    child = psutil.Process(int(launcher.stdout.readline()))
    assert os.getsid(child.pid) != os.getsid(launcher.pid)  # out of reach of os.killpg(launcher's group)
    end_tree(launcher.pid)
    assert launcher.wait(timeout=10) == -9
    assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE  # a zombie awaits init's reaping


def test_env_cut_short_after_its_all_reduce_stops_nothing(monkeypatch):
    monkeypatch.setattr(sys, 'argv', ['gpu_check'])
    from bench.gpu_check import env_passed
    assert env_passed(dict(status='timeout', all_reduce=dict(ok=True)))  # the matmul or SDPA profile ran long
    assert not env_passed(dict(status='timeout'))  # the imports or the all-reduce did not finish
    assert not env_passed(dict(status='failed', all_reduce=dict(ok=False)))


@pytest.mark.slow  # smoke killed mid-run: ~40 s
def test_a_smoke_killed_mid_run_leaves_no_worker_and_its_tail_in_out(tmp_path):
    """The smoke phase at a limit that falls while train.py's torchrun workers run: while it runs, its
    output's tail is in <out>/gpu_check.log; once the check ends, no process of the run is left."""
    out, work = tmp_path / 'out', tmp_path / 'work'
    p = subprocess.Popen([sys.executable, '-m', 'bench.gpu_check', '--device=cpu', f'--out={out}',
                          f'--work_dir={work}', '--phases=smoke', '--phase_timeout=15', '--tail_every=1'],
                         cwd=ROOT, stdout=subprocess.PIPE, text=True, env=dict(os.environ, OMP_NUM_THREADS='1'))
    mine = lambda: [q for q in psutil.process_iter(['cmdline']) if str(work) in ' '.join(q.info['cmdline'] or [])
                    and q.pid != p.pid and q.status() != psutil.STATUS_ZOMBIE]  # noqa: E731
    workers, running_log = set(), ''
    while p.poll() is None:
        workers |= {q.pid for q in mine() if 'train.py' in ' '.join(q.info['cmdline'])}
        log = out / 'gpu_check.log'
        if log.exists() and 'smoke: running' in log.read_text():
            running_log = log.read_text()
        time.sleep(0.5)
    assert 'smoke: timeout' in p.stdout.read()
    assert running_log.startswith('===== 1_smoke: running'), running_log
    assert workers, 'no train.py process was seen: the limit fell before torchrun started'
    assert mine() == []


def test_without_the_carried_wheels_the_env_phase_stops_everything_in_one_line(tmp_path):
    """A machine where diffusers does not import (the wheels forgotten; here a diffusers that fails to
    import comes first on the path): the env phase fails with one line naming the script that fetches
    them, and no other phase starts (each json says why)."""
    fake = tmp_path / 'site' / 'diffusers'
    fake.mkdir(parents=True)
    (fake / '__init__.py').write_text("raise ImportError('no module named diffusers (simulated)')\n")
    lines, recs, files = check(tmp_path, env=dict(PYTHONPATH=str(tmp_path / 'site')), timeout=120)
    assert files == [f'{i}_{n}.json' for i, n in enumerate(NAMES)] + ['gpu_check.log']
    env = recs['0_env.json']
    assert env['status'] == 'failed' and env['error'].startswith('env: diffusers does not import') \
        and 'bash bench/gpu_wheels.sh' in env['error'], env
    assert lines[0].startswith('0 env: failed') and 'bench/gpu_wheels.sh' in lines[0], lines
    for i, n in list(enumerate(NAMES))[1:]:
        assert recs[f'{i}_{n}.json'] == dict(phase=n, status='skipped', error=f"env failed: {env['error']}")


def attention_case(S=300, heads=4, d=64, lengths=(300, 200)):
    """A CFG pair's q, k, v and output gradient in bf16 (as on a GPU), the fp32 reference of attend from
    them, and `run(fn)`: (out, dq, dk, dv) of a backend fn(q, k, v, lengths) with that gradient."""
    import torch
    from bench.gpu_phases import reference
    from models.attention import attend
    torch.manual_seed(0)
    q, k, v, grad = (torch.randn(2, S, heads, d).bfloat16() for _ in range(4))

    def run(fn):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves, list(lengths))
        out.backward(grad)
        return [out.detach()] + [t.grad for t in leaves]
    native = lambda q, k, v, n: attend(q, k, v, n)  # noqa: E731  the default backend, in bf16
    return run, native, reference(q, k, v, grad, list(lengths))


def test_the_attention_gate_reads_each_tensor_against_fp32(monkeypatch):
    """Against an fp32 reference (a head chunk at a time), at 2x native's own error per tensor: bf16's
    rounding of the exact result passes; a kernel 1% off in scale fails, and one whose dq alone is 1%
    off fails too (a gate on the output alone would pass it)."""
    import torch
    from bench.gpu_phases import errors, gate
    run, native, ref = attention_case()
    native_err = errors(run(native), ref)
    assert all(1e-3 < e < 5e-3 for e in native_err), native_err  # bf16's few roundings
    assert gate(errors([r.bfloat16() for r in ref], ref), native_err)[0]  # the exact result, rounded to bf16
    assert not gate(errors([x * 1.01 for x in run(native)], ref), native_err)[0]  # a 1% scale error

    class ScaleDq(torch.autograd.Function):  # identity forward; q's gradient 1% too large
        forward = staticmethod(lambda ctx, q: q.view_as(q))
        backward = staticmethod(lambda ctx, g: 1.01 * g)
    wrong_dq = run(lambda q, k, v, n: native(ScaleDq.apply(q), k, v, n))
    err = errors(wrong_dq, ref)
    assert gate(errors(wrong_dq[:1] + run(native)[1:], ref), native_err)[0]  # its output alone passes
    assert not gate(err, native_err)[0] and err[1] > 2 * native_err[1] and err[2] <= 2 * native_err[2], err
    # per head chunk: the reference does not depend on how many heads are computed together
    from bench import gpu_phases
    assert gpu_phases.REF_HEADS > 1
    monkeypatch.setattr(gpu_phases, 'REF_HEADS', 1)
    assert all(torch.equal(a, b) for a, b in zip(attention_case()[2], ref))


def test_the_attention_backend_is_the_fastest_that_passes_and_steps():
    from bench.gpu_phases import fastest_correct
    step = dict(micro_step=dict(s=1.0, finite=True))
    rows = [dict(backend='native', fwd_bwd_ms=10.0, passes=True, **step),
            dict(backend='flash', fwd_bwd_ms=4.0, passes=False),  # faster, but its gradients are off
            dict(backend='_flash_3', fwd_bwd_ms=3.0, passes=True, micro_step=dict(error='RuntimeError: ...')),
            dict(backend='_native_cudnn', fwd_bwd_ms=6.0, passes=True, **step),
            dict(backend='_native_efficient', fwd_bwd_ms=5.0, passes=True),  # never stepped: not called correct
            dict(backend='xformers', skipped='not installed')]
    assert fastest_correct(rows) == '_native_cudnn'
    assert fastest_correct(rows[1:3]) is None


def test_the_carried_wheels_are_the_tested_versions():
    """bench/gpu_wheels.sh pins what this environment's tests run with: a GPU check runs the same code."""
    pins = subprocess.run(['bash', os.path.join(ROOT, 'bench', 'gpu_wheels.sh'), '--print'], capture_output=True,
                          text=True, check=True).stdout.split()
    names = [p.split('==')[0] for p in pins]
    assert {'diffusers', 'transformers', 'peft'} <= set(names)
    assert pins == [f'{n}=={importlib.metadata.version(n)}' for n in names]


def test_the_phases_import_one_way():
    """bench/gpu_phases.py -> gpu_phases_train.py -> gpu_common.py, and no import back (a circle before)."""
    deps = {}
    for name in ('gpu_check', 'gpu_phases', 'gpu_phases_train', 'gpu_common'):
        tree = ast.parse(open(os.path.join(ROOT, 'bench', f'{name}.py')).read())
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                found |= {node.module.split('.')[-1]} | {a.name for a in node.names}
            elif isinstance(node, ast.Import):
                found |= {a.name.split('.')[-1] for a in node.names}
        deps[name] = found & {'gpu_check', 'gpu_phases', 'gpu_phases_train', 'gpu_common'}
    assert deps == dict(gpu_check=set(), gpu_phases={'gpu_phases_train', 'gpu_common'},
                        gpu_phases_train={'gpu_common'}, gpu_common=set()), deps


@pytest.mark.slow  # every phase at tiny size, train.py twice under torchrun: ~3 min on 2 cores
def test_every_phase_at_tiny_size_on_cpu(tmp_path):
    lines, recs, files = check(tmp_path)
    # what comes back from a device machine: at most 8 files, one json a phase and the log
    assert files == [f'{i}_{n}.json' for i, n in enumerate(NAMES)] + ['gpu_check.log'] and len(files) <= 8
    assert [l.split(' in ')[0] for l in lines[:6]] == [f'{i} {n}: ok' for i, n in enumerate(NAMES)], lines
    r = {n: recs[f'{i}_{n}.json'] for i, n in enumerate(NAMES)}
    assert all(x['status'] == 'ok' and x['rc'] == 0 for x in r.values())
    assert r['env']['matmul']['tflops'] > 0 and r['env']['sdpa']['kernels']
    assert r['env']['all_reduce'] == dict(backend='gloo', ok=True, s=r['env']['all_reduce']['s'])
    assert r['env']['versions']['diffusers'] and r['env']['versions']['peft']
    # fp32 on a CPU: the rollout-shaped and update-shaped forwards agree far inside the clip range, through
    # the training run's FSDP2 wrapping
    assert [s['step'] for s in r['drift']['steps']] == [19, 10] and r['drift']['path'].startswith('models.policy.shard')
    assert all(s['max_abs_dlogp'] < 1e-5 and s['frac_beyond_clip'] == 0 for s in r['drift']['steps'])
    a = r['attention']
    ran = {x['backend'] for x in a['rows'] if 'fwd_bwd_ms' in x}
    assert 'native' in ran and a['fastest'] in ran and a['tokens']['video'] == 3 * 4 * 6
    assert all(x['passes'] and max(x['errors'].values()) < 1e-5 for x in a['rows']
               if 'fwd_bwd_ms' in x)
    parts = ('anchor forward', 'forward', 'backward', 'clip', 'muon')
    assert len(r['update']['runs']) == 4 and all(x[p]['s'] > 0 for x in r['update']['runs'] for p in parts)
    assert set(r['update']['at_54_blocks_8_ranks']) == {'autocast', 'no_autocast'}
    assert r['update']['reward_resident_gib'] >= 0
    peak = r['update']['at_54_blocks_8_ranks']['autocast']['peak_gib_per_rank']
    assert set(peak) == {'state', 'grads', 'transient', 'reward', 'total'}
    assert r['reward']['videoalign']['second']['finite'] and len(r['reward']['vae']['decode']) == 1
    assert [x['iter'] for x in r['smoke']['iterations']] == [1, 2] and r['smoke']['export']['loaded']
