"""
How the ranks are laid out: the process group from torchrun's environment (or one plain process),
and the two collectives train.py's loop uses on small tensors.

    torchrun --nproc_per_node=8 train.py     # RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR from torchrun
    python train.py config/toy.py            # no RANK: one process, every collective a no-op

Layout: world = data parallel x sequence parallel; an sp group is sp_size consecutive ranks holding
the same clips (sp.py), the data-parallel rank is rank // sp_size.

Restarts (torchrun --max-restarts): torchrun's agent keeps one TCPStore for the whole job and hands
every restarted worker group the same one (torch/distributed/elastic/rendezvous/
dynamic_rendezvous.py builds it once; rendezvous.py adds no prefix): the new group would read the
keys the last one left, a dead peer's address (gloo: connectFullMesh "Connection refused"; NCCL: its
old unique id). Each restart meets under its own prefix; the restart count is the same on every
worker of one node only, so across nodes restarts need torch's own fresh store per rendezvous
(TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, docs/restarts.md).
"""
import os
from datetime import timedelta

import torch
import torch.distributed as dist


def init(device, timeout_minutes):
    """(ddp, rank, world, device): the process group (NCCL on GPUs, gloo on CPUs) under torchrun, this
    rank's GPU; every collective waits at most timeout_minutes."""
    if device == 'cuda' and not torch.cuda.is_available():
        raise SystemExit('no CUDA device: run with --device=cpu (the toy world: python train.py config/toy.py)')
    if 'RANK' not in os.environ:
        return False, 0, 1, device
    timeout = timedelta(minutes=timeout_minutes)
    dist.init_process_group('nccl' if device == 'cuda' else 'gloo', timeout=timeout,
                            store=_store(timeout),  # a restart's own keys (see the docstring)
                            rank=int(os.environ['RANK']), world_size=int(os.environ['WORLD_SIZE']))
    if device == 'cuda':
        device = f'cuda:{int(os.environ["LOCAL_RANK"])}'
        torch.cuda.set_device(device)
    return True, dist.get_rank(), dist.get_world_size(), device


def _store(timeout):
    # None: torch's env:// store, new at every start; else torchrun's one store, a prefix per restart
    env = os.environ
    if env.get('TORCHELASTIC_USE_AGENT_STORE') != 'True':
        return None
    if int(env.get('GROUP_WORLD_SIZE', 1)) > 1 and int(env.get('TORCHELASTIC_MAX_RESTARTS', 0)):
        raise SystemExit('torchrun --max-restarts across nodes: set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 '
                         'for every torchrun (a restarted group would meet in the last one\'s store; '
                         'docs/restarts.md)')
    store = dist.TCPStore(env['MASTER_ADDR'], int(env['MASTER_PORT']), is_master=False, timeout=timeout)
    return dist.PrefixStore(f'restart_{env["TORCHELASTIC_RESTART_COUNT"]}/default_pg', store)


def gather(t, group=None):
    """(n, ...) on every rank of group (None: all) -> (ranks * n, ...) in rank order."""
    if not dist.is_initialized():
        return t
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts)


def mean(x, device):
    """The mean of a float over all ranks (every rank gets the same number)."""
    if not dist.is_initialized():
        return float(x)
    t = torch.tensor([float(x)], device=device)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()
