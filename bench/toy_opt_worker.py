"""
One optimizer step on the toy policy, timed: AdamW, then Muon (+ AdamW for the rest), on random
gradients, in one process or on every rank of an FSDP2 group; the median over the steps after the
first (which allocates the state), printed as a RESULT line (rank 0). Section 4 of bench/toy.py
(bench/toy_cost.py) runs it both ways:

    python -m bench.toy_opt_worker --reps=11
    python -m torch.distributed.run --standalone --nproc_per_node=2 -m bench.toy_opt_worker --reps=11
"""
import gc
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from infra.configurator import configure, number
from infra.optimizer import build
from models import policy as M
from models import toy

# ----------------------------------------------------------------------------- settings
reps = 11                       # optimizer steps timed per optimizer (the first is not counted)
config = configure(globals(), rules=dict(reps=number(2, then=' (the first step allocates the state)')))
# -----------------------------------------------------------------------------
ddp = 'RANK' in os.environ
if ddp:
    dist.init_process_group('gloo')
torch.set_num_threads(1)
net = M.load_policy(toy.DIR, 'cpu', fsdp=ddp)
params = [p for p in net.parameters() if p.requires_grad]
res = {}
for kind in ('adamw', 'muon'):
    opts, t = build(net, kind, 1e-4, 0.01), []
    for r in range(reps):
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3  # sharded like p under FSDP2
        if ddp:
            dist.barrier()
        t0 = time.perf_counter()
        for o in opts:
            o.step()
        t.append(time.perf_counter() - t0)
    res[kind] = statistics.median(t[1:])  # the first step allocates the state
if not ddp or dist.get_rank() == 0:
    print('RESULT ' + json.dumps(res))
if ddp:
    del net  # free the FSDP state (it holds the group) first: see the end of train.py
    gc.collect()
    dist.destroy_process_group()
