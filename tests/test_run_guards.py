"""
The run's state and its guards, each against something written here. python -m pytest tests/test_run_guards.py
- infra/rundir.Run: the optimizer-step count comes back on resume, so a moving anchor's refresh cadence
  (infra.anchor.Anchor, every 3 optimizer steps) continues: a run saved after step 4 and resumed equals a
  straight run of 8 steps, the anchor after every step included (a count restarted at 0 would refresh it
  at step 7, not 6); the transformer passes, whether an evaluation is owed and the parts' state come
  back too;
- extras/diagnostics.NonFinite: a finite step resets the count (a NaN step is skipped, the next finite one
  taken); only `stop` non-finite steps in a row end the run, with one line naming the iteration;
- models/policy.shard: every FSDP unit's mixed-precision policy reduce-scatters gradients in fp32 and
  computes in bf16 on a GPU (fully_shard spied: no process group needed);
- infra/checkpoint.save after a kill: a directory a killed background delete left (<name>.<hex>.deleting,
  half deleted) is never a checkpoint to resume from and is gone after the next save; rotated
  checkpoints leave the listing at once (renamed), before their files are deleted.
"""
import math
import os
import threading

import pytest
import torch

import trust_region as tr
from infra.anchor import Anchor
from extras import diagnostics
from infra import checkpoint, rundir


# ----------------------------------------------------------------------------- Run: optimizer steps on resume
def built(out):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    anchor = Anchor(model, 'moving', every=3)
    return rundir.Run(out, 3, model, [opt], anchor, ('rollout',), dict(config={})), model, opt, anchor


def step(run, model, opt, anchor):
    """One optimizer step on a gradient that depends on the step's index, then the loop's anchor refresh."""
    g = torch.Generator().manual_seed(run.opt_steps)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)
    opt.step()
    run.opt_steps += 1
    run.iter_num += 1
    anchor.maybe_refresh(model, run.opt_steps)  # train.py's call, after the step
    return {k: v.clone() for k, v in anchor.state_dict().items()}


def test_resume_restores_the_optimizer_steps_and_the_anchor_cadence(tmp_path):
    straight = built(str(tmp_path / 'straight'))
    want = [step(*straight) for _ in range(8)]
    # the straight run's anchor: refreshed at steps 3 and 6 only
    w = [a['weight'] for a in want]
    assert [i + 1 for i in range(1, 8) if not torch.equal(w[i], w[i - 1])] == [3, 6]
    out = str(tmp_path / 'cut')
    run, model, opt, anchor = built(out)
    got = [step(run, model, opt, anchor) for _ in range(4)]
    run.save()
    run, model, opt, anchor = built(out)  # a new process: everything built again, then resumed
    run.resume(checkpoint.candidates(out, log=lambda m: None), log=lambda m: None)
    assert (run.iter_num, run.opt_steps) == (4, 4)
    got += [step(run, model, opt, anchor) for _ in range(4)]
    for i, (a, b) in enumerate(zip(want, got)):
        assert all(torch.equal(a[k], b[k]) for k in a), f'the anchor after step {i + 1}'
    assert torch.equal(model.weight, straight[1].weight)


# ----------------------------------------------------------------------------- the non-finite guard
def test_a_finite_step_resets_the_non_finite_count():
    guard = diagnostics.NonFinite(3, 'out')
    norms = [1.0, math.nan, 2.0, math.inf, math.nan, 0.5, math.nan, math.nan, 1.0, 3.0]
    skipped = [guard(n, i + 1) for i, n in enumerate(norms)]
    assert skipped == [not math.isfinite(n) for n in norms]  # every finite step is taken, however many NaNs before
    assert guard.row == 0
    for i in range(2):  # two in a row: skipped, the run goes on
        assert guard(math.nan, 20 + i)
    with pytest.raises(SystemExit, match=r'^iteration 22: 3 optimizer steps in a row .* in out is the last good one$'):
        guard(-math.inf, 22)


# ----------------------------------------------------------------------------- the blocks' mixed precision
class Blocks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(3)])


@pytest.mark.parametrize('cuda', [True, False])
def test_every_fsdp_unit_reduces_gradients_in_fp32(monkeypatch, cuda):
    import torch.distributed.fsdp as fsdp
    from models import policy
    calls = []
    monkeypatch.setattr(fsdp, 'fully_shard', lambda module, mp_policy=None, mesh=None, **kw: calls.append(
        (module, mp_policy)))
    net = Blocks()
    policy.shard(net, net.blocks, cuda)
    assert [m for m, _ in calls] == list(net.blocks) + [net]  # each block, then the root
    for module, mp in calls:
        assert mp.reduce_dtype == torch.float32, module  # not the bf16 compute dtype (an lr 1e-5 update vanishes)
        assert mp.param_dtype == (torch.bfloat16 if cuda else None)
    assert all(mp.cast_forward_inputs is False for m, mp in calls if m is not net)  # the blocks' inputs uncast


# ----------------------------------------------------------------------------- what a killed save or delete leaves
def test_a_killed_delete_leaves_nothing_to_resume_and_the_next_save_clears_it(tmp_path, monkeypatch):
    out = str(tmp_path / 'out')
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    save = lambda it: checkpoint.save(os.path.join(out, f'ckpt_{it:06d}'), model, [opt], {}, dict(iter_num=it),  # noqa
                                      keep=2)
    save(1)
    save(2)
    checkpoint.finish_deletes()
    # a process killed mid-delete: its rotated checkpoint renamed out of the way, half its files gone
    half = os.path.join(out, 'ckpt_000000.1a2b3c4d' + checkpoint.DISCARDED)
    os.makedirs(half)
    open(os.path.join(half, '.metadata'), 'wb').write(b'half')
    open(os.path.join(half, checkpoint.LOOP), 'w').write('{"iter_num": 0}')
    assert checkpoint.found(out) == ['ckpt_000001', 'ckpt_000002']  # never a checkpoint
    assert checkpoint.candidates(out, log=lambda m: None)[0].endswith('ckpt_000002')
    # rotation: the next save renames ckpt_000001 out of the listing before its files go
    gate, real = threading.Event(), checkpoint.shutil.rmtree

    def slow(path, **kw):  # a delete still running when save returns
        gate.wait(10)
        return real(path, **kw)
    monkeypatch.setattr(checkpoint.shutil, 'rmtree', slow)
    save(3)
    listed, pending = checkpoint.found(out), [d for d in os.listdir(out) if d.startswith('ckpt_000001.')]
    gate.set()
    assert listed == ['ckpt_000002', 'ckpt_000003']
    assert len(pending) == 1 and pending[0].endswith(checkpoint.DISCARDED)  # renamed; its files go in the background
    assert open(os.path.join(out, 'latest')).read().strip() == 'ckpt_000003'
    checkpoint.finish_deletes()
    assert sorted(os.listdir(out)) == ['ckpt_000002', 'ckpt_000003', 'latest']  # the killed delete's leftover too


class Part:
    """A part of the loop's state (the controller, the alarm): a state_dict of plain values."""
    def __init__(self):
        self.value = 0.0

    def state_dict(self):
        return dict(value=self.value)

    def load_state_dict(self, sd):
        self.value = sd['value']


def test_resume_restores_the_passes_the_owed_evaluation_and_the_parts(tmp_path):
    out = str(tmp_path / 'out')

    def new():
        model = torch.nn.Linear(3, 2)
        opt = torch.optim.AdamW(model.parameters())
        return rundir.Run(out, 2, model, [opt], Anchor(model, 'none', 1), ('rollout', 'update'),
                          dict(config={}), controller=Part())
    run = new()
    assert run.eval_owed and run.passes == dict(rollout=0, update=0)  # a new run owes the base model's evaluation
    run.iter_num, run.opt_steps, run.passes = 3, 2, dict(rollout=12, update=5)
    run.parts['controller'].value = 0.25
    run.save(eval_owed=True)  # a stop during the evaluation: it is owed again
    again = new()
    again.resume(checkpoint.candidates(out, log=lambda m: None), log=lambda m: None)
    assert (again.iter_num, again.opt_steps, again.passes, again.eval_owed) == (3, 2, dict(rollout=12, update=5), True)
    assert again.parts['controller'].value == 0.25
    run.iter_num = 4
    run.save()  # the evaluation ran: none owed
    again = new()
    again.resume(checkpoint.candidates(out, log=lambda m: None), log=lambda m: None)
    assert again.iter_num == 4 and again.eval_owed is False
