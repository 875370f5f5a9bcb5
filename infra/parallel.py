"""
How the ranks are laid out and how they fail together: the process group from torchrun's
environment (or one plain process), the FSDP2 mesh (flat or HSDP), the proof that every rank sees
rank 0's directories, rank 0's solo phases, and the two collectives train.py's loop uses.

    python train.py config/toy.py                 # no RANK: one process, every collective a no-op
    torchrun --nproc_per_node=8 train.py          # one node: RANK, LOCAL_WORLD_SIZE, ... from torchrun
    torchrun --nnodes=8 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=HOST:29500 train.py
                                                  # 64 GPUs on 8 nodes (docs/multinode.md)

Layout: torchrun numbers a node's ranks consecutively. world = data parallel x sequence parallel;
an sp group is sp_size consecutive ranks inside one node holding the same clips (infra/sp.py), the
data-parallel rank is rank // sp_size. FSDP2 shards every weight over shard_size consecutive ranks
and replicates it over the world / shard_size groups (HSDP, a 2-D mesh: docs/method.md section
12.2); the default is one node's ranks, so a micro-step's all-gathers and reduce-scatters stay on
a node's links and only one all-reduce of the gradient shards crosses nodes (results/hsdp.md). On
one node that is plain FSDP over all ranks (mesh None).

Failing fast (docs/method.md section 12.1): every collective waits at most dist_timeout; a rank that
died or hangs makes the others' next collective fail, and each of them stops with one line holding
torch's own words (NCCL names the ranks that never joined with TORCH_NCCL_DESYNC_DEBUG=1; gloo
says only "timed out" or "connection reset"). Rank 0's solo phases (the prompt cache, the export,
minutes to an hour) are not waited on in a collective: the others wait on a key of the c10d store,
with solo_timeout. A directory that must be shared (out_dir, the prompt cache) is proven shared at
start: every rank reads back a file rank 0 wrote there (a fresh token; the cache's index), and all
agree in one collective.

Restarts (torchrun --max-restarts): torchrun's agent keeps one TCPStore for the whole job and hands
every restarted worker group the same one (torch/distributed/elastic/rendezvous/
dynamic_rendezvous.py builds it once; rendezvous.py adds no prefix): the new group would read the
keys the last one left, a dead peer's address (gloo: connectFullMesh "Connection refused"; NCCL: its
old unique id). Each restart meets under its own prefix; the restart count is the same on every
worker of one node only, so across nodes restarts need torch's own fresh store per rendezvous
(TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, docs/restarts.md).

Tested by: python -m pytest tests/test_nodes.py   (simulated nodes: several torchrun agents, gloo)
"""
import gc
import hashlib
import os
import re
import resource
import secrets
import socket
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

# ----------------------------------------------------------------------------- settings (train.py's, set as its own)
shard_size = 0                  # ranks a weight is sharded over (HSDP; 0: a node's ranks)
dist_timeout = 10.0             # minutes a collective waits: a dead or hung rank ends the job
solo_timeout = 60.0             # minutes the ranks wait for rank 0 alone (load, cache, export)
# -----------------------------------------------------------------------------

SEEN_WAIT = 5.0  # seconds a rank retries reading rank 0's token (a network filesystem's lookup delay)
TIMEOUT = None   # init()'s collective timeout, given to the groups of every mesh (mesh())


def init(device, timeout_minutes):
    """(ddp, rank, world, device): the process group (NCCL on GPUs, gloo on CPUs) under torchrun, this
    rank's GPU; every collective waits at most timeout_minutes, then this process stops with one line."""
    if device == 'cuda':  # before CUDA's allocator starts: it reads its settings once
        global _cuda_was_up
        _cuda_was_up = torch.cuda.is_initialized()
        expandable_segments()
    if device == 'cuda' and not torch.cuda.is_available():
        raise SystemExit('no CUDA device: run with --device=cpu (the toy world: python train.py config/toy.py)')
    if 'RANK' not in os.environ:
        return False, 0, 1, device
    global TIMEOUT
    TIMEOUT = timedelta(minutes=timeout_minutes)
    dist.init_process_group('nccl' if device == 'cuda' else 'gloo', timeout=TIMEOUT,
                            store=_store(TIMEOUT),  # a restart's own keys (see the docstring)
                            rank=int(os.environ['RANK']), world_size=int(os.environ['WORLD_SIZE']))
    if device == 'cuda':
        device = f'cuda:{int(os.environ["LOCAL_RANK"])}'
        torch.cuda.set_device(device)
    _one_line_on_collective_failure(dist.get_rank(), timeout_minutes)
    return True, dist.get_rank(), dist.get_world_size(), device


def expandable_segments():
    """expandable_segments:True for the CUDA caching allocator unless the user set an allocator config
    (PYTORCH_CUDA_ALLOC_CONF or torch's newer PYTORCH_ALLOC_CONF): it grows a segment instead of keeping
    blocks of every size it met, so memory freed by one phase (a rollout's batch of 8 forwards) fits the
    next (the update's backward) instead of staying reserved in blocks of the wrong size. Set through
    torch's own setter, not only the environment: torch parses the variable once, at the first look at
    its allocator config, and a variable written after that look is never read (an import that asked
    first would have made it a no-op). The variable is written too, for the processes this one starts.
    Called before CUDA initialises (init()); allocator_line() says what torch then reports. The setter is
    private (torch._C, present in 2.13): where a torch lacks it, the variable alone is written, which
    holds only if torch has not read its config yet (said once)."""
    if 'PYTORCH_CUDA_ALLOC_CONF' not in os.environ and 'PYTORCH_ALLOC_CONF' not in os.environ:
        os.environ['PYTORCH_CUDA_ALLOC_CONF'] = 'expandable_segments:True'
        setter = _torch_private('_accelerator_setAllocatorSettings',
                                'PYTORCH_CUDA_ALLOC_CONF written only, read if torch has not yet read it')
        if setter:
            setter('expandable_segments:True')


def allocator_line(device):
    """The start-up log's line: the allocator settings torch reports, whether CUDA had started before
    they were set, and on a GPU whether the first segment is expandable (torch's memory snapshot)."""
    if not str(device).startswith('cuda'):
        return f'allocator: {device}: no CUDA caching allocator (expandable_segments applies on GPUs only)'
    getter = _torch_private('_accelerator_getAllocatorSettings', 'the environment\'s setting reported instead')
    env = os.environ.get('PYTORCH_CUDA_ALLOC_CONF', os.environ.get('PYTORCH_ALLOC_CONF'))
    settings = (getter() if getter else env and f'{env} (environment)') or '(torch defaults)'
    probe = torch.empty(1, device=device)  # a segment, to read back how the allocator made it
    segments = torch.cuda.memory_snapshot()
    expandable = any(s.get('is_expandable') for s in segments) if segments else None
    del probe
    return (f'allocator: {settings}, set before CUDA started: {not _cuda_was_up}; backend '
            f'{torch.cuda.memory.get_allocator_backend()}; first segment expandable: {expandable}')


_cuda_was_up = False  # init(): CUDA had initialised before the allocator setting (too late for it)
_SAID = set()  # the private torch functions found missing, each said once


def _torch_private(name, instead):
    """torch._C's private function `name`, or None where this torch lacks it (said once, with what
    is done `instead`)."""
    fn = getattr(torch._C, name, None)
    if fn is None and name not in _SAID:
        _SAID.add(name)
        print(f'allocator: torch {torch.__version__} has no torch._C.{name}: {instead}', flush=True)
    return fn


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


def _one_line_on_collective_failure(rank, timeout_minutes):
    # a collective that failed (a peer died: connection reset; or hangs: timed out) ends this
    # process with one line instead of a traceback through FSDP's hooks; other errors keep theirs
    default = sys.excepthook

    def hook(kind, e, tb):
        text = str(e).strip()
        if not (isinstance(e, dist.DistError) or isinstance(e, RuntimeError) and re.search('gloo|NCCL', text)):
            return default(kind, e, tb)
        first = text.splitlines()[0] if text else kind.__name__
        first = re.sub(r'^\[[^\]]*\]\s*', '', first).split('. ')[0]  # without gloo's [file:line] and advice
        print(f'rank {rank} ({socket.gethostname()}): a collective failed: {first} (dist_timeout '
              f'{timeout_minutes:g} min; a rank died or hangs, see its node\'s log)', file=sys.stderr, flush=True)
        os._exit(1)  # no teardown: the process group is broken, and gloo or NCCL could hang in it
    sys.excepthook = hook


def local_world():
    """Ranks of this node (torchrun's LOCAL_WORLD_SIZE); 1 without torchrun."""
    return int(os.environ.get('LOCAL_WORLD_SIZE', 1))


def check_layout(world, shard_size, sp_size, n_clips):
    """shard_size (0: one node's ranks) -> the ranks a weight is sharded over; SystemExit with one
    line if it does not divide the world, if an sp group would span nodes, or if the n_clips of
    an iteration do not divide over the data-parallel ranks (world / sp_size)."""
    node = local_world()
    shard_size = shard_size or min(node, world)
    if world % shard_size:
        raise SystemExit(f'shard_size {shard_size} must divide the world size {world} (HSDP: '
                         'world / shard_size replicas of each shard)')
    if node % sp_size:
        raise SystemExit(f'sp_size {sp_size} must divide the {node} ranks of a node (--nproc_per_node): '
                         'a sequence-parallel group runs an all-to-all in every block, on a node\'s links')
    if n_clips % (world // sp_size):
        raise SystemExit(f'prompts_per_iter * group_size = {n_clips} must be divisible by the world '
                         f'size {world} / sp_size {sp_size}')
    return shard_size


def layout(rank, world, shard_size, sp_size, sp_mesh, n_clips, log=None):
    """check_layout()'s shard_size, and this rank's share of an iteration's n_clips: (shard_size,
    dp_rank, dp_world, dp_group, clip_ids: the global indices of its clips). An sp group (consecutive
    ranks) is one data-parallel rank, its ranks hold the same clips; dp_group: one rank of each sp
    group (None: the whole world). log: where describe()'s line goes, in a distributed run."""
    shard_size = check_layout(world, shard_size, sp_size, n_clips)
    if log and world > 1:
        log(describe(world, shard_size, sp_size))
    dp_rank, dp_world = rank // sp_size, world // sp_size
    n = n_clips // dp_world
    group = sp_mesh['dp'].get_group() if sp_mesh else None
    return shard_size, dp_rank, dp_world, group, list(range(dp_rank * n, (dp_rank + 1) * n))


def describe(world, shard_size, sp_size):
    """'layout: 64 ranks; weights sharded over 8 and replicated 8x (HSDP); sp 2'"""
    hsdp = f' and replicated {world // shard_size}x (HSDP)' if shard_size < world else ''
    return f'layout: {world} ranks; weights sharded over {shard_size}{hsdp}; sp {sp_size}'


def close():
    """The end of a distributed run: every rank meets first (none tears the process group down
    early), then the group is destroyed once what holds it is freed (FSDP modules do: their
    finalisers can abort the process at exit, 'terminate called without an active exception')."""
    if dist.is_initialized():
        dist.barrier()
        gc.collect()
        dist.destroy_process_group()


def mesh(device, shape, names):
    """init_device_mesh whose groups wait at most dist_timeout, as the default group does: a group torch
    creates for a mesh gets the backend's default timeout (NCCL 10 min, gloo 30), not the one
    init_process_group was given (docs/method.md section 12.2)."""
    from torch.distributed.device_mesh import init_device_mesh
    kind = torch.device(device).type

    def options():  # a group's options, with our timeout
        o = dist.ProcessGroupNCCL.Options() if kind == 'cuda' else dist.ProcessGroupGloo._Options()
        o._timeout = TIMEOUT
        return o
    return init_device_mesh(kind, shape, mesh_dim_names=names,
                            backend_override={n: options() for n in names} if TIMEOUT else None)


def fsdp_mesh(world, shard_size, device):
    """The mesh model.shard gives FSDP2: None (flat over all ranks, the default group) when one shard
    group is the world, else (replicate, shard) = (world / shard_size, shard_size), consecutive ranks
    in a shard group."""
    return None if shard_size == world else mesh(device, (world // shard_size, shard_size), ('replicate', 'shard'))


def check_shared(path, what, master, name=None):
    """Collective: every rank sees the directory rank 0 sees at `path`, or every rank stops with the
    same line. The proof is a file rank 0 wrote there: `name` (e.g. the prompt cache's index), or
    else a token file rank 0 writes now (creating the directory), named by a fresh random token and
    removed after; every rank reads it by name (a directory listing can be stale on a network
    filesystem) and compares its bytes with rank 0's sha256."""
    file, error, digest = name or f'.shared-{secrets.token_hex(8)}', None, None
    if master:
        try:
            if name is None:
                os.makedirs(path, exist_ok=True)
                with open(os.path.join(path, file), 'w') as f:
                    f.write(file)
            digest = _sha256(os.path.join(path, file))
        except OSError as e:
            error = f'{what} {path!r} is not {"readable" if name else "writable"}: {e}'
    if not dist.is_initialized():
        if error:
            raise SystemExit(error)
        if name is None:
            os.remove(os.path.join(path, file))
        return
    box = [file, digest, error]
    dist.broadcast_object_list(box)  # rank 0's file and its digest, once written
    file, digest, error = box
    if error:
        raise SystemExit(error)
    seen, t0 = master, time.time()
    while not seen and time.time() - t0 < SEEN_WAIT:
        try:
            seen = _sha256(os.path.join(path, file)) == digest
        except OSError:
            pass
        if not seen:
            time.sleep(0.2)
    reports = [None] * dist.get_world_size()
    dist.all_gather_object(reports, (seen, socket.gethostname()))
    if master and name is None:
        os.remove(os.path.join(path, file))
    blind = [f'{r} ({host})' for r, (ok, host) in enumerate(reports) if not ok]
    if blind:
        ranks = f'rank {blind[0]} does' if len(blind) == 1 else f'ranks {", ".join(blind)} do'
        raise SystemExit(f'{what} {path!r} must be on a filesystem all nodes share: {ranks} not see the file '
                         f'rank 0 wrote in it ({file})')


def _sha256(path):
    with open(path, 'rb') as f:
        return hashlib.sha256(f.read()).hexdigest()


_SOLO_CALLS = {}  # name -> solo() calls of this process so far


def solo(fn, name, timeout_minutes):
    """Rank 0 alone runs fn() (minutes to an hour: the prompt cache, the export) while the other ranks
    wait on the c10d store's key `name`, not in a collective (whose dist_timeout is short), for at
    most timeout_minutes. A SystemExit of rank 0's stops every rank with its line. Returns fn()'s
    result on rank 0, None elsewhere. Every rank calls it alike (a name's n-th call waits on its own key)."""
    if not dist.is_initialized():
        return fn()
    store = dist.distributed_c10d._get_default_store()  # per torchrun attempt: a restart starts afresh
    _SOLO_CALLS[name] = _SOLO_CALLS.get(name, 0) + 1
    n = _SOLO_CALLS[name]  # a key once set stays: a second call of a name must not find the first's
    key = f'solo/{name}' if n == 1 else f'solo/{name}/{n}'
    if dist.get_rank() == 0:
        try:
            out = fn()
        except SystemExit as e:
            store.set(key, str(e))
            raise
        except BaseException as e:  # a traceback on rank 0; the others stop with a line
            store.set(key, f'rank 0 failed in {name}: {type(e).__name__}: {str(e)[:300]}')
            raise
        store.set(key, '')
        return out
    try:
        store.wait([key], timedelta(minutes=timeout_minutes))
    except dist.DistError as e:  # a timeout, or rank 0's node is gone with the store it held
        raise SystemExit(f'rank {dist.get_rank()}: rank 0 did not finish {name} within solo_timeout '
                         f'({timeout_minutes:g} min) or its node is gone ({str(e).splitlines()[0][:200]})')
    error = store.get(key).decode()
    if error:
        raise SystemExit(error)
    return None


def reshard(model):
    """Put FSDP2's sharded weights back in every unit. FSDP2 leaves the root's weights all-gathered after
    a forward (backward needs them), and named_parameters() then returns those full tensors; resharded,
    the next forward all-gathers again, from what was written into the shards."""
    from torch.distributed.fsdp import FSDPModule
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def gather(t, group=None):
    """(n, ...) on every rank of group (None: all) -> (ranks * n, ...) in rank order."""
    if not dist.is_initialized():
        return t
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts)


def total(t):
    """A float tensor summed over all ranks (every rank gets the same tensor)."""
    if dist.is_initialized():
        t = t.clone()
        dist.all_reduce(t)
    return t


def mean(x, device):
    """The mean of a float over all ranks (every rank gets the same number)."""
    if not dist.is_initialized():
        return float(x)
    t = torch.tensor([float(x)], device=device)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def mean_of(values, device):
    """The mean of all ranks' floats `values` (a list each, of any length: a rank may have none) over
    their total count (every rank gets the same number; nan where no rank has one)."""
    t = torch.tensor([float(sum(values)), float(len(values))], device=device, dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(t)
    return t[0].item() / t[1].item() if t[1] > 0 else float('nan')


def peak_memory(device):
    """The log's fields of the peaks since the last reset_peak_memory(): 'peak_mem_gb' (the largest
    rank's allocated), 'peak_mem_gb_ranks' (every rank's) and 'peak_mem_reserved_gb' (the largest's)."""
    mem, reserved = peak_memory_gb(device), peak_memory_gb(device, 'reserved')
    return dict(peak_mem_gb=mem.max().item(), peak_mem_gb_ranks=mem.tolist(),
                peak_mem_reserved_gb=reserved.max().item())


def peak_memory_gb(device, kind='allocated'):
    """Every rank's peak memory in GiB since the last reset_peak_memory(), (world,) in rank order: on a GPU
    the CUDA allocator's peak of `kind`, 'allocated' (what tensors hold) or 'reserved' (what the allocator
    holds from the driver: allocated plus cached and fragmented blocks; an out-of-memory error comes
    when this reaches the GPU's size); on a CPU the process's peak resident set (either kind, since start)."""
    if torch.device(device).type == 'cuda':
        peak = torch.cuda.max_memory_reserved() if kind == 'reserved' else torch.cuda.max_memory_allocated()
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0  # bytes
    t = torch.tensor([float(peak)])
    return (gather(t.to(device)).cpu() if dist.is_initialized() else t) / 2 ** 30


def reset_peak_memory(device):
    """Start both peaks of peak_memory_gb() again from what is allocated now (GPU; a CPU's cannot)."""
    if torch.device(device).type == 'cuda':
        torch.cuda.reset_peak_memory_stats()
