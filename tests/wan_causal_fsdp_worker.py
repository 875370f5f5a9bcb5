"""
Worker for tests/test_wan_causal.py::test_fsdp_two_ranks_equal_one_process: the tiny causal Wan loaded by
policy.load_policy with FSDP2 (fully_shard per block, then the root; rank 0 reads, the others build on the
meta device and receive shards and the rope tables by broadcast) over 2 CPU processes with gloo, each rank
generating the same clips block by block; each writes OUT/rank{r}.pt.

    python -m torch.distributed.run --nproc_per_node=2 tests/wan_causal_fsdp_worker.py CAUSAL_DIR OUT
"""
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from streaming import wan_causal  # noqa: E402
from models.policy import load_policy  # noqa: E402
from tiny_wan_causal import inputs  # noqa: E402

path, out = sys.argv[1:3]
dist.init_process_group('gloo')
rank = dist.get_rank()
net = load_policy(path, 'cpu', fsdp=True)
x = wan_causal.generate(net, *inputs(path))
torch.save(x, os.path.join(out, f'rank{rank}.pt'))
dist.destroy_process_group()
print(f'rank {rank} of 2: ok')
