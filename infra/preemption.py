"""
Preemption: SIGTERM checkpoints and exits 0 within one forward, whatever an iteration costs.

    kill -TERM <pid>      # torchrun forwards it to every worker; SLURM sends it before KillWait

torchrun SIGKILLs its workers 30 s after forwarding a SIGTERM (its shutdown timeout) and SLURM 30 s
after its own (KillWait), while one iteration at 8.3B takes minutes to hours, so train.py cannot
finish the iteration first: it stops at the next forward or micro-batch boundary (point()), where all
ranks agree through one all-reduce, and saves the last finished iteration (checkpoint.save).

Where this differs from a plain "save at the end of the iteration": the cut iteration is redone on
resume (bitwise: every random draw is a function of (seed, iteration, clip)); after an iteration's
first optimizer step (updates_per_iter > 1) the iteration finishes first, as the weights have moved.
A stop that finds a peer gone (torchrun SIGTERMs the survivors of a worker that died, to restart the
group) saves nothing and exits at once: the restart resumes from the last published checkpoint.
Tested by: python -m pytest tests/test_preemption.py (2 ranks, SIGTERM to one of them mid-update,
mid-rollout, after an iteration's first optimizer step, mid-evaluation).
"""
import copy
import os
import signal
import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

from infra.checkpoint import _barrier


class Preemption:
    """SIGTERM stops the run at the next forward or micro-batch boundary (point()), checkpointed,
    with exit status 0: launchers SIGKILL 30 s after their SIGTERM (torchrun's shutdown timeout,
    SLURM's KillWait), and one iteration at 8.3B takes minutes to hours. Until the iteration's first
    optimizer step the weights, optimizer and anchor are those of the last finished iteration, so
    that is the state saved; what changes earlier (the lambda_KL controller under
    kl_update='backward') is put back as it was at begin(). Every random draw is a function of
    (seed, iteration, clip), so the resumed run redoes the cut iteration bitwise. After the first
    optimizer step of an iteration (updates_per_iter > 1) the boundaries do nothing until the next
    begin(): the iteration finishes and train.py checkpoints it at its end.
    A second SIGTERM, or a SIGINT, exits at once. Either way the last published checkpoint stays
    intact (atomic publication), and the half-written temporary directory is removed by the next save."""

    def __init__(self, rank=0, device='cpu'):
        self.rank, self.device, self.flag = rank, device, False
        self.save, self.snapshot = None, []  # None: no resumable state at hand (see begin)
        signal.signal(signal.SIGTERM, self.on_signal)
        signal.signal(signal.SIGINT, self.on_signal)

    def on_signal(self, signum, frame):
        if signum == signal.SIGINT or self.flag:
            os._exit(128 + signum)  # at once: no cleanup that could touch the checkpoints
        self.flag = True
        print(f'rank {self.rank}: SIGTERM, checkpoint at the next forward boundary, then exit', flush=True)

    def requested(self, device=None):
        """Whether any rank got SIGTERM: one all_reduce, so that every rank stops at the same point."""
        if not dist.is_initialized():
            return self.flag
        t = torch.tensor([float(self.flag)], device=device or self.device)
        try:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        except RuntimeError as e:  # a peer died (gloo: "Connection closed by peer"): no collective
            if not self.flag:      # can complete, so no checkpoint; the last published one stays
                raise
            self.gone(e)
        return t.item() > 0  # on a GPU a sync, once per forward of seconds

    def gone(self, e):
        """The stop cannot complete (a peer died, or the save failed): exit at once, unpublished."""
        why = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        print(f'rank {self.rank}: SIGTERM, but the stop failed ({why}): exit without a checkpoint; the '
              f'last published one stays', flush=True)
        os._exit(128 + signal.SIGTERM)

    def begin(self, save, *stateful):
        """From here to stepped(), a stop calls save() (a collective checkpoint of the last finished
        iteration; it returns the path) after giving each of `stateful` (state_dict/load_state_dict, or a dict)
        back the state it has now."""
        self.save, self.snapshot = save, [(o, copy.deepcopy(o if isinstance(o, dict) else o.state_dict())) for o in stateful]

    def stepped(self):
        """The weights moved: no stop before the next begin()."""
        self.save = None

    def points(self, items):
        """The items, with a boundary (point()) before each: for b in preemption.points(microbatches)."""
        for item in items:
            self.point()
            yield item

    def point(self):
        """A boundary between forwards. Collective between begin() and stepped() (every rank passes
        the same boundaries: same batch counts), a no-op without communication outside."""
        if self.save is None or not self.requested():
            return
        for o, state in self.snapshot:
            if isinstance(o, dict):  # train.py's pass counts: restored in place
                o.clear()
                o.update(state)
            else:
                o.load_state_dict(state)
        try:
            path = self.save()
        except (RuntimeError, CheckpointException) as e:  # a peer died during the save: not published
            self.gone(e)
        if self.rank == 0:
            print(f'preempted: {path} published; the same command continues', flush=True)
        _barrier()
        sys.stdout.flush()
        sys.stderr.flush()
        # out from deep inside the loop, whose frames hold the FSDP model: a normal exit would tear
        # the process group down before the model (an abort at exit, see the end of train.py);
        # nothing is left to write
        os._exit(0)
