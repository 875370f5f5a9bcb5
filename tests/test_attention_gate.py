"""
The GPU check's attention gate (bench/gpu_phases.py attention, on its CPU path at its CPU size): a backend may
become train.py's attention_backend only if its output *and* its q, k, v gradients agree with native's. Two
fake backends beside native and a faithful copy of it, each timed here (the fakes fastest): one with native's
forward exactly but gradients half as large (a backend with wrong gradients trains a wrong model while every
forward check passes), one with a wrong forward. Both fail the gate and the one chosen is the copy, the
fastest of those that pass. (The choice among passing rows: tests/test_gpu_check.py.)

    python -m pytest tests/test_attention_gate.py
"""
import torch

MS = dict(native=10.0, copy=5.0, grad_off=1.0, fwd_off=1.0)  # forward (+ backward) milliseconds, set here


class HalfGrad(torch.autograd.Function):
    """The identity forward, the gradient halved backward."""
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return 0.5 * g


def test_a_backend_with_wrong_gradients_is_not_chosen(monkeypatch):
    from bench import gpu_phases
    from models import attention
    real_attend, real_backend, timed = attention.attend, attention.backend, []

    def backend(name):
        return name if name in MS and name != 'native' else real_backend(name)

    def attend(q, k, v, lengths, b=None):
        timed.append('native' if b not in MS else b)
        if b == 'grad_off':  # native's output exactly; dq, dk, dv half of native's
            return real_attend(*(HalfGrad.apply(t) for t in (q, k, v)), lengths, None)
        if b == 'fwd_off':
            return 1.1 * real_attend(q, k, v, lengths, None)
        return real_attend(q, k, v, lengths, None if b in MS else b)

    def event_ms(c, fn, reps=1):  # the backend fn calls, at its time set here
        fn()
        return MS[timed[-1]]
    monkeypatch.setattr(attention, 'backend', backend)
    monkeypatch.setattr(attention, 'attend', attend)
    monkeypatch.setattr(gpu_phases, 'event_ms', event_ms)
    monkeypatch.setattr(gpu_phases, 'BACKENDS', ('native', 'grad_off', 'fwd_off', 'copy'))
    # a transformer micro-step of a passing backend, where the phase runs one: finite (its own test's matter)
    monkeypatch.setattr(gpu_phases.train_phases, 'update_steps',
                        lambda *a, **k: dict(parts={'step': (0.0, None)}, finite=True), raising=False)
    rec = {}
    gpu_phases.attention(dict(device='cpu'), rec, lambda: None)
    rows = {r['backend']: r for r in rec['rows']}
    assert set(rows) == set(MS) and not any('error' in r for r in rows.values()), rows
    gate = {k: r['passes'] if 'passes' in r else r['agrees'] for k, r in rows.items()}  # the gate's verdict
    assert gate == dict(native=True, grad_off=False, fwd_off=False, copy=True), rows
    assert rec['fastest'] == 'copy', rows
