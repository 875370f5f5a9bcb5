"""
Worker for tests/test_slow_io.py: rank 0's slow I/O under a collective timeout shorter than it, 2 CPU
ranks with gloo (dist_timeout 6 s here, NCCL's 10 min at full size). Exits non-zero when a rank timed
out in a collective (parallel.init's one line) or a check failed.

    python -m torch.distributed.run --nproc_per_node=2 tests/slow_io_worker.py load|save OUT_DIR SLOW_S

load: rank 0 reads the model SLOW_S late (8.3B read and upcast: minutes), then load_policy's broadcast;
save: three checkpoints with keep=1 and a dead save's directory, each delete of rank 0 SLOW_S long.
"""
import os
import shutil
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
from infra import checkpoint, parallel  # noqa: E402
from models import policy as M  # noqa: E402

TOY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'assets', 'toy')
TIMEOUT_MIN = 0.1  # dist_timeout: 6 s


def slowly(fn, seconds):
    def slow(*args, **kwargs):
        time.sleep(seconds)
        return fn(*args, **kwargs)
    return slow


what, out, slow_s = sys.argv[1], sys.argv[2], float(sys.argv[3])
ddp, rank, world, device = parallel.init('cpu', TIMEOUT_MIN)
assert ddp and world == 2
reference = M.load_transformer(TOY).state_dict() if rank == 1 else None  # before any slowing
if rank == 0 and what == 'load':
    M.load_transformer = slowly(M.load_transformer, slow_s)
policy = M.load_policy(TOY, 'cpu', fsdp=True, solo_timeout=1.0)
full = {n: p.full_tensor() for n, p in policy.named_parameters()}  # a collective: every rank
if rank == 1:  # rank 0's weights, read after the wait, arrived whole
    assert all(torch.equal(full[n], reference[n]) for n in full)

if what == 'save':
    if rank == 0:
        shutil.rmtree = slowly(shutil.rmtree, slow_s)  # checkpoint.py's deletes
        os.makedirs(os.path.join(out, 'ckpt_000000.tmp'))  # a save that died: removed by the next one
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    t0 = time.time()
    for i in (1, 2, 3):  # keep=1: the second and third saves each delete one checkpoint
        checkpoint.save(os.path.join(out, f'ckpt_{i:06d}'), policy, [opt], {}, dict(iter_num=i), keep=1)
    if rank == 0:
        print(f'three saves in {time.time() - t0:.1f} s', flush=True)
        assert checkpoint.found(out) == ['ckpt_000003'], os.listdir(out)  # at once: renamed out of the way
del policy
parallel.close()
if rank == 0 and what == 'save':
    checkpoint.finish_deletes()  # after the last collective: rank 0 alone waits for them
    assert sorted(os.listdir(out)) == ['ckpt_000003', 'latest'], os.listdir(out)
print(f'rank {rank}: ok', flush=True)
