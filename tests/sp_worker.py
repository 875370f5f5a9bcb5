"""
Worker for tests/test_sp.py and tests/test_wan.py: the guided velocity of a tiny transformer with its
tokens split over the ranks (sp.enable, Ulysses over gloo), and the gradient of a fixed linear
function of it, summed over the ranks. Rank 0 writes both to OUT.

    python -m torch.distributed.run --nproc_per_node=2 tests/sp_worker.py MODEL_DIR INPUTS OUT
"""
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
from infra import sp  # noqa: E402
from models.policy import family_of, load_transformer, velocity  # noqa: E402


def main(path, inputs, out):
    dist.init_process_group('gloo')
    rank, world = dist.get_rank(), dist.get_world_size()
    net = load_transformer(path)
    model = sp.enable(net, sp.mesh(world, 'cpu'), family_of(net).cp_plan(net))
    model.enable_gradient_checkpointing()  # as train.py runs it: the split inside each recomputation
    # the tokens block 0's self-attention sees on this rank: HunyuanVideo 1.5's joint attention
    # video/world + text/world, Wan's video/world (its cross-attention keeps the whole text)
    block = family_of(net).blocks(model)[0]
    attn = block.attn if hasattr(block, 'attn') else block.attn1
    seen = []
    attn.register_forward_pre_hook(lambda m, args, kwargs: seen.append(sum(
        t.shape[1] for t in (*args, *kwargs.values()) if torch.is_tensor(t) and t.dim() == 3)), with_kwargs=True)
    a = torch.load(inputs)
    v = velocity(model, a['x'], a['s'], a['text'], a['cfg'], a['text_neg'])  # (B, C, F, H, W), full on every rank
    (v * a['w']).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    for g in grads.values():  # each rank holds the gradient of its own tokens: the sum is the clip's
        dist.all_reduce(g)
    if rank == 0:
        torch.save(dict(v=v.detach(), grads=grads, seen=seen), out)
    print(f'rank {rank} of {world}: sp velocity done, block 0 saw {seen} tokens', flush=True)
    dist.barrier()
    del model
    dist.destroy_process_group()


if __name__ == '__main__':
    main(*sys.argv[1:4])
