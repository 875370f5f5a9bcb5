"""
How the ranks are laid out: the process group from torchrun's environment (or one plain process),
and the two collectives train.py's loop uses on small tensors.

    torchrun --nproc_per_node=8 train.py     # RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR from torchrun
    python train.py config/toy.py            # no RANK: one process, every collective a no-op

Layout: world = data parallel x sequence parallel; an sp group is sp_size consecutive ranks holding
the same clips (sp.py), the data-parallel rank is rank // sp_size.
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
    dist.init_process_group('nccl' if device == 'cuda' else 'gloo', timeout=timedelta(minutes=timeout_minutes))
    if device == 'cuda':
        device = f'cuda:{int(os.environ["LOCAL_RANK"])}'
        torch.cuda.set_device(device)
    return True, dist.get_rank(), dist.get_world_size(), device


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
