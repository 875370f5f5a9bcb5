"""
Worker for tests/test_sp.py: one launch of N ranks runs sequence parallel in each layout of
INPUTS' `layouts`, (sp, attention) pairs (sp dividing N; dp = N / sp groups of consecutive ranks,
train.py's layout), each on a fresh copy of a tiny HunyuanVideo 1.5 transformer (sp.enable, Ulysses
over gloo; attention='diffusers' runs as masked keys on diffusers' Ulysses, hunyuan15.cp_plan):
- the guided velocity of the clips of this rank's dp group (dp rank r // sp takes clips
  [dp_rank * B/dp, ...)), gathered over the groups, and the gradient of a fixed linear function of
  it, summed over all ranks (each rank holds its own tokens' share of its group's clips);
- the transformer passes counted (model.count_passes: once per sp group);
- sp.divide_work in each sp group: which rank computed which clip, and the result.
Rank 0 writes {(sp, attention): results} to OUT.

    python -m torch.distributed.run --nproc_per_node=4 tests/sp_layout_worker.py MODEL_DIR INPUTS OUT
"""
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
from models import policy as M  # noqa: E402
from infra import sp  # noqa: E402


def main(path, inputs, out):
    dist.init_process_group('gloo')
    rank, world = dist.get_rank(), dist.get_world_size()
    a = torch.load(inputs)
    res = {}
    for n, kind in a['layouts']:
        mesh = sp.mesh(n, 'cpu')
        net = M.load_transformer(path, attention=kind)
        net = sp.enable(net, mesh, M.family_of(net).cp_plan(net))
        procs = {type(b.attn.processor).__name__ for b in net.transformer_blocks}
        net.enable_gradient_checkpointing()  # as train.py runs it: the split inside each recomputation
        seen = []  # the tokens block 0's attention gets on this rank: its video and text shares
        net.transformer_blocks[0].attn.register_forward_pre_hook(lambda m, args, kw: seen.append(
            kw['hidden_states'].shape[1] + kw['encoder_hidden_states'].shape[1]), with_kwargs=True)
        dp_rank, dp = rank // n, world // n  # train.py's layout
        B = a['x'].shape[0] // dp
        mine = slice(dp_rank * B, (dp_rank + 1) * B)  # this group's clips
        cut = lambda ts: [t[mine] for t in ts]
        v = M.velocity(net, a['x'][mine], a['s'][mine], cut(a['text']), a['cfg'], cut(a['text_neg']))
        (v * a['w'][mine]).sum().backward()
        grads = {k: p.grad for k, p in net.named_parameters() if p.grad is not None}
        for g in grads.values():  # a group's ranks hold its clips' gradient together, the groups the batch's
            dist.all_reduce(g)
        passes = dict(rollout=0, update=0)
        M.count_passes(passes, ('rollout', 'update'))  # collective: every rank
        vs = [torch.empty_like(v) for _ in range(world)]
        dist.all_gather(vs, v.detach())
        assert all(torch.equal(vs[r], vs[dp_rank * n]) for r in range(dp_rank * n, dp_rank * n + n))
        work = sp.divide_work(lambda ids: dict(clip=torch.tensor(ids), rank=torch.full((len(ids),), rank)),
                              2 * n - 1, mesh)  # clips that do not split evenly over the group
        works = [None] * world
        dist.all_gather_object(works, work)  # every group's, from its first rank
        res[n, kind] = dict(v=torch.cat(vs[::n]), grads=grads, passes=passes, seen=seen, work=works[::n],
                            processors=procs)
        print(f'rank {rank} of {world}, sp {n} {kind}: block 0 saw {seen} tokens, passes {passes}', flush=True)
    if rank == 0:
        torch.save(res, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == '__main__':
    main(*sys.argv[1:4])
