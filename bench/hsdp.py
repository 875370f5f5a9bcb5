"""
HunyuanVideo 1.5 (8.3B) on 64 GPUs of 8 nodes without a GPU: per-GPU peak memory and the bytes a
GPU moves in one training micro-step, within a node and across nodes, for FSDP2 flat over all 64
ranks and HSDP (sharded over a node's 8, replicated over the 8 nodes: train.py's shard_size
default), each without and with sequence parallel 2, measured by torch on fake tensors.

    python -m bench.hsdp                       # the 4 runs -> results/hsdp.{md,json}, results/README.md section 11 (~40 min)
    python -m bench.hsdp --report_only=True    # the report and README.md block from results/hsdp.json
    python -m bench.hsdp --tiny=True           # a 2-block config, ~2 min: into /tmp/bench_hsdp_tiny

How: bench.fullsize_measure.measure runs the micro-step as train.py does (the anchor's forward without grad,
the policy's forward with both CFG branches, backward with per-block checkpointing, clip, AdamW) over
a fake process group of 64 ranks played by this process, FSDP2 by model.shard; its FSDP mesh,
init_device_mesh('cpu', (64,)), is here the (replicate, shard) mesh parallel.fsdp_mesh builds for
HSDP. Communication is recorded at torch's dispatcher: every op in the set CommDebugMode counts as a
collective (torch's list: c10d's all-gather, reduce-scatter, all-reduce, all-to-all, and the
functional collectives DTensor and diffusers' Ulysses call), with its tensor sizes and its process
group's ranks. A GPU's bytes are those of the ring algorithm (NCCL's bandwidth model): an all-gather
of n ranks moves (n-1)/n of its output, a reduce-scatter (n-1)/n of its input, an all-to-all (n-1)/n
of its input, an all-reduce 2(n-1)/n of its tensor. A collective whose group lies in one node counts
as within the node; one whose group spans nodes runs at the speed of the links between nodes (a
ring's slowest hop) and counts as across nodes. The count is checked against the closed form of
FSDP2's traffic (closed_form: bf16 all-gathers of the weights in each forward and the backward,
an fp32 reduce-scatter of the gradients, HSDP's all-reduce of the gradient shards) in the report.

Where it differs from 64 GPUs: no GPU ran it (bench/fullsize_measure.py's caveats apply); the optimizer is
AdamW (bench.fullsize_measure's micro-step): Muon's per-optimizer-step all-gather of every 2-D gradient
(optimizer.py) is not in a micro-step; flat, it spans all 64 ranks, under HSDP the shard group only.
"""
import json
import os
import sys
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.distributed.tensor.debug._comm_mode import c10d_collective_ops, funcol_native

from bench import common as C
from bench import fullsize_measure as FS
from infra.configurator import configure

# ----------------------------------------------------------------------------- settings
out_dir = 'results'             # hsdp.md and hsdp.json go here
report_only = False             # rewrite hsdp.md and the README block from hsdp.json (no measuring)
tiny = False                    # a 2-block, narrow config: a check of the method (~2 min)
gpus = 64                       # ranks of the job
node_gpus = 8                   # ranks of a node (HSDP's shard group)
clip = (81, 352, 624)           # frames x H x W of the trained clips (train.py's rollout size)
sps = (1, 2)                    # sequence-parallel degrees measured
config = configure(globals(), sys.argv[1:] if __name__ == '__main__' else [])
# -----------------------------------------------------------------------------
GiB = 2 ** 30
FUNCOL = {getattr(funcol_native, n) for n in ('all_gather_into_tensor', 'reduce_scatter_tensor', 'all_reduce',
                                              'all_to_all_single')}


def tiny_config():
    return dict(FS.load_config(), num_layers=2, num_refiner_layers=1, num_attention_heads=4, attention_head_dim=32,
                text_embed_dim=64, text_embed_2_dim=32, image_embed_dim=32, rope_axes_dim=[8, 12, 12])


def _ranks(group):
    if isinstance(group, str):  # the functional collectives name their group
        group = torch._C._distributed_c10d._resolve_process_group(group)
    elif isinstance(group, torch.ScriptObject):
        group = dist.ProcessGroup.unbox(group)
    return dist.get_process_group_ranks(group)


def _traffic(func, args):
    """(kind, group ranks, bytes a GPU sends by the ring algorithm) of one collective call."""
    nbytes = lambda t: t.numel() * t.element_size()
    op = func._overloadpacket
    funcol = op in FUNCOL  # (..., group_name): the last argument; c10d: the first ScriptObject is the group
    group = [a for a in args if isinstance(a, str)][-1] if funcol else \
        next(a for a in args if isinstance(a, torch.ScriptObject))
    ranks = _ranks(group)
    n = len(ranks)
    if op in (torch.ops.c10d._allgather_base_, funcol_native.all_gather_into_tensor):
        size = nbytes(args[0]) * (1 if op is torch.ops.c10d._allgather_base_ else n)  # the gathered output
        return 'all-gather', ranks, size * (n - 1) / n
    if op is torch.ops.c10d.allgather_:  # a list of outputs (diffusers' Ulysses key mask)
        return 'all-gather', ranks, sum(nbytes(t) for t in args[1]) * (n - 1)
    if op in (torch.ops.c10d._reduce_scatter_base_, funcol_native.reduce_scatter_tensor):
        size = nbytes(args[1] if op is torch.ops.c10d._reduce_scatter_base_ else args[0])  # the input
        return 'reduce-scatter', ranks, size * (n - 1) / n
    if op in (torch.ops.c10d.allreduce_, funcol_native.all_reduce):
        size = sum(nbytes(t) for t in args[0]) if isinstance(args[0], (list, tuple)) else nbytes(args[0])
        return 'all-reduce', ranks, 2 * size * (n - 1) / n
    if op in (torch.ops.c10d.alltoall_base_, funcol_native.all_to_all_single):
        size = nbytes(args[1] if op is torch.ops.c10d.alltoall_base_ else args[0])
        return 'all-to-all', ranks, size * (n - 1) / n
    raise ValueError(f'collective {op} is not counted by this bench')


class Counted(FS.FlopCount):
    """bench.fullsize_measure's FLOP counter that also records every collective (see the module docstring)."""
    calls = []  # (kind, ranks, bytes) of the run in progress

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if out is not NotImplemented and (func._overloadpacket in c10d_collective_ops or
                                          func._overloadpacket in FUNCOL):
            Counted.calls.append(_traffic(func, list(args) + list((kwargs or {}).values())))
        return out


@contextmanager
def counted(shard):
    """bench.fullsize_measure.measure with collectives recorded, and its FSDP mesh (world,) replaced by the
    HSDP mesh (world / shard, shard) when shard < world (parallel.fsdp_mesh's)."""
    import torch.distributed.device_mesh as dm
    plain, flops = dm.init_device_mesh, FS.FlopCount

    def mesh(device_type, shape, **kw):
        if len(shape) == 1 and shard < shape[0]:
            return plain(device_type, (shape[0] // shard, shard), mesh_dim_names=('replicate', 'shard'))
        return plain(device_type, shape, **kw)
    dm.init_device_mesh, FS.FlopCount, Counted.calls = mesh, Counted, []
    try:
        yield Counted.calls
    finally:
        dm.init_device_mesh, FS.FlopCount = plain, flops


def run(cfg, shard, sp, world=gpus, node=node_gpus, Fr=clip[0], H=clip[1], W=clip[2], L=None):
    """One micro-step: peak bytes per GPU by category and bytes moved per GPU by collective kind,
    within a node and across nodes (node: ranks per node, consecutive)."""
    with counted(shard) as calls:
        r = FS.measure(cfg, 'train', Fr, H, W, world=world, sp=sp, n_store=1, L=L)
    comm = {}
    for kind, ranks, b in calls:
        where = 'within' if len({x // node for x in ranks}) == 1 else 'across'
        comm[f'{kind} {where}'] = comm.get(f'{kind} {where}', 0) + b
    r.update(shard=shard, node=node, comm=comm, categories=FS.categories(r), calls=len(calls))
    return r


def closed_form(P, P_blocks, world, shard, node):
    """FSDP2's bytes per GPU in a micro-step from the parameter counts alone: bf16 all-gathers over the
    shard group, of every block 3 times (the anchor's forward, the policy's forward, the backward) and
    of the root's own weights twice (it stays gathered from the policy's forward to its backward,
    docs/method.md section 12.2); a reduce-scatter of the fp32 gradients of all P weights over the
    shard group; under HSDP an all-reduce of the fp32 gradient shard over the replicas. Sequence
    parallel's all-to-alls are not in it."""
    ag = 2 * (3 * P_blocks + 2 * (P - P_blocks)) * (shard - 1) / shard
    rs = 4 * P * (shard - 1) / shard
    ar = 2 * (4 * P / shard) * (world // shard - 1) / (world // shard)
    where = 'within' if shard <= node else 'across'
    return {f'all-gather {where}': ag, f'reduce-scatter {where}': rs, **({'all-reduce across': ar} if shard < world else {})}


def measure_all():
    cfg = tiny_config() if tiny else FS.load_config()
    t0, runs = time.time(), []
    for sp in sps:
        for shard in (gpus, node_gpus):
            r = run(cfg, shard, sp)
            print(f'[{time.time() - t0:5.0f}s] shard {shard} sp {sp}: peak {r["peak"]["Total"] / GiB:.1f} GiB, '
                  + ', '.join(f'{k} {v / 1e9:.2f} GB' for k, v in sorted(r['comm'].items())), flush=True)
            runs.append(r)
    P_blocks = sum(p.numel() for p in FS.build(cfg).transformer_blocks.parameters())
    out = dict(config=config, runs=runs, torch=torch.__version__, seconds=time.time() - t0, P_blocks=P_blocks,
               closed_form=[closed_form(r['P'], P_blocks, gpus, r['shard'], node_gpus) for r in runs])
    dest = '/tmp/bench_hsdp_tiny' if tiny else out_dir
    os.makedirs(dest, exist_ok=True)
    with open(os.path.join(dest, 'hsdp.json'), 'w') as f:
        json.dump(out, f, indent=1, default=str)
    write(out, dest, readme=not tiny)


def rows(out):
    g = lambda b: f'{b / GiB:.1f}'
    res = []
    for r in out['runs']:
        within = sum(v for k, v in r['comm'].items() if 'within' in k)
        across = sum(v for k, v in r['comm'].items() if 'across' in k)
        layout = 'flat FSDP' if r['shard'] == r['world'] else f'HSDP {r["world"] // r["shard"]}x{r["shard"]}'
        res.append([layout, r['sp'], g(r['categories']['total']), f'{within / 1e9:.1f}', f'{across / 1e9:.1f}'])
    return res


HEADER = ['64 GPUs (8 nodes), 8.3B', 'sp', 'peak GiB/GPU (transformer)', 'GB a GPU moves within its node',
          'GB a GPU moves across nodes']


def write(out, dest, readme=True):
    c = out['config']
    cats = list(out['runs'][0]['categories'])
    name = lambda r: ('flat' if r['shard'] == r['world'] else 'HSDP') + f', sp {r["sp"]}'
    md = ['## 64 GPUs on 8 nodes: flat FSDP vs HSDP, measured on fake tensors', '',
          f'Written by `python -m bench.hsdp` (torch {out["torch"]}, {out["seconds"] / 60:.0f} min on 2 shared CPU '
          'cores); raw numbers: hsdp.json. One training micro-step of the 8.3B transformer (bench/fullsize.py\'s: '
          'anchor forward, policy forward with both CFG branches, backward with per-block checkpointing, clip, AdamW) '
          f'on clips of {"x".join(map(str, c["clip"]))}, one stored clip per GPU, over a fake process group of '
          f'{c["gpus"]} ranks, {c["node_gpus"]} to a node. Flat: FSDP2 over all ranks. HSDP: sharded over a node\'s '
          f'{c["node_gpus"]} ranks and replicated over the nodes (train.py\'s default `shard_size`). Bytes: what one '
          'GPU sends by the ring algorithm, per collective kind; "across" = the collective\'s group spans nodes '
          '(see bench/hsdp.py). No GPU has run this.', '',
          C.table(HEADER, rows(out)), '',
          '### Peak memory per GPU (GiB) by category', '',
          C.table(['category'] + [name(r) for r in out['runs']],
                  [[k] + [f'{r["categories"][k] / GiB:.1f}' for r in out['runs']] for k in cats] +
                  [['peak in'] + [r['peak_phase'] for r in out['runs']]]), '',
          '### GB a GPU moves in one micro-step, by collective, measured and from the closed form', '',
          'Closed form (FSDP2\'s traffic from the parameter counts alone, sp\'s all-to-alls not in it): bf16 '
          'all-gathers of every block 3 times (the anchor\'s forward, the policy\'s forward, the backward) and of the '
          'root\'s own weights twice, a reduce-scatter of the fp32 gradients of all weights, and under HSDP an '
          'all-reduce of the fp32 gradient shard over the nodes (bench.hsdp.closed_form). Measured below it: weights '
          'without a gradient in this step are not reduced.', '']
    kinds = sorted({k for r in out['runs'] for k in r['comm']} | {k for f in out['closed_form'] for k in f})
    md.append(C.table(['collective'] + [f'{name(r)}: measured' for r in out['runs']] + ['closed form, flat',
                                                                                         'closed form, HSDP'],
                      [[k] + [f'{r["comm"].get(k, 0) / 1e9:.2f}' for r in out['runs']] +
                       [f'{out["closed_form"][i].get(k, 0) / 1e9:.2f}' for i in (0, 1)] for k in kinds]))
    with open(os.path.join(dest, 'hsdp.md'), 'w') as f:
        f.write('\n'.join(md) + '\n')
    if readme:
        C.put_block(os.path.join(dest, 'README.md'), 'bench.hsdp', [  # results/README.md section 11
            '## 11. 64 GPUs on 8 nodes: flat FSDP vs HSDP (`python -m bench.hsdp`)', '',
            'One training micro-step of 8.3B on 64 GPUs, fake tensors (how, and by category and collective: '
            '[hsdp.md](hsdp.md)):', '', C.table(HEADER, rows(out))])


if __name__ == '__main__':
    if report_only:
        with open(os.path.join(out_dir, 'hsdp.json')) as f:
            write(json.load(f), out_dir)
    else:
        measure_all()
