"""
The ready check of bench/fullsize.py's estimate for the day GPUs are at hand: the estimate's
micro-step and rollout forward (bench/fullsize_measure.py) on real tensors, random weights of the
real size (no download), each part timed, its peak memory printed beside the estimate's
(results/fullsize.json), and the PPO ratio of a batched rollout against one clip at a time.

    python -m bench.fullsize_gpu                          # one GPU: LoRA micro-step, rollout forward, bf16 batch invariance
    torchrun --nproc_per_node=8 -m bench.fullsize_gpu     # all GPUs: a full fine-tune micro-step (FSDP2)
    python -m bench.fullsize_gpu --tiny --device=cpu      # the check at tiny size on a CPU (tests/test_fullsize.py)

bench/gpu_check.py's update phase times one GPU's micro-step instead. The clip, text, LoRA rank and model are the
estimate's settings (bench/fullsize_measure.py), set from this command line too.
"""
import json
import os
import sys
import time
from functools import partial

import torch
import torch.distributed as dist

from bench import common as C
from bench import fullsize_measure as FM
from bench.fullsize_measure import (GiB, build, inputs, load_config, rollout_step, setup, train_step, transformer,
                                    velocity)
from infra.configurator import configure
from models.policy import shard
from infra.anchor import Anchor

# ----------------------------------------------------------------------------- settings
tiny = False                    # --tiny: the check with a small random transformer (tests)
device = 'cuda'                 # device of the check
out_dir = 'results'             # where bench.fullsize wrote fullsize.json: its estimates are printed beside
# the measurement's settings that the check uses (bench/fullsize_measure.py), set from this command line too
from bench.fullsize_measure import (lora_rank, model_config, num_frames, num_steps, processor,  # noqa: E402,F401
                                    rollout_batch, seed, sizes, text_tokens)
# a bare --tiny is a flag; imported (bench/attention.py, tests), the settings keep their defaults
config = configure(globals(), [a + '=True' if a == '--tiny' else a for a in sys.argv[1:]]
                   if __name__ == '__main__' else [], rules=FM.RULES)
C.share(config, FM)  # the measurement runs with this command line's values
# -----------------------------------------------------------------------------

TINY = dict(in_channels=9, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=2,
            num_refiner_layers=1, text_embed_dim=16, text_embed_2_dim=8, image_embed_dim=12,
            rope_axes_dim=(2, 2, 4))  # docs/method.md section 11.1's tiny transformer: builds in milliseconds


def check():
    """Real tensors, random weights of the real size (no download): under torchrun a full
    fine-tune micro-step with FSDP2 on every rank, else a LoRA micro-step on one device; a rollout
    forward; the PPO ratio of clips rolled out in a batch and recomputed one at a time (the blocks'
    attention is timed by bench/attention.py --gpu)."""
    import resource
    import sde
    ddp = 'RANK' in os.environ
    dev = device
    if ddp:
        dist.init_process_group('nccl' if device == 'cuda' else 'gloo')
        if device == 'cuda':
            dev = f'cuda:{int(os.environ["LOCAL_RANK"])}'
            torch.cuda.set_device(dev)
    cuda = dev.startswith('cuda')
    master = not ddp or dist.get_rank() == 0
    cfg = TINY if tiny else load_config()
    Fr, H, W = (9, 64, 96) if tiny else (num_frames, *sizes[0])
    L1, L2 = (8, 4) if tiny else text_tokens
    torch.manual_seed(seed)
    model = build(cfg, lora=0 if ddp else lora_rank, bf16_base=cuda)
    model.forward = partial(transformer, model)
    if ddp:
        shard(model, model.transformer_blocks, cuda=cuda)
    model.to_empty(device=dev)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)  # random weights: the cost does not depend on their values
    opt, anchor = setup(model, dev), Anchor(model, 'dual', every=10)
    store, text, text_neg = inputs(cfg, rollout_batch, Fr, H, W, L1, L2, dev)
    res, t = {}, [time.time()]

    def peak():  # bytes: the CUDA allocator's peak, or the process's peak RSS on a CPU
        return torch.cuda.max_memory_allocated(dev) if cuda else \
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def phase(name):
        if cuda:
            torch.cuda.synchronize(dev)
        res[name] = dict(seconds=time.time() - t[0], peak_gib=peak() / GiB)
        t[0] = time.time()
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    t[0] = time.time()
    train_step(model, anchor, opt, store, text, text_neg, cuda, phase)
    opt.zero_grad(set_to_none=True)  # train.py frees the gradients after the optimizer step
    rollout_step(model, store, text, text_neg, rollout_batch, cuda, phase)
    # batch invariance: logp of each clip's step from the batched rollout forward, then recomputed
    # alone (as the update does); exp(difference) is the PPO ratio at theta == theta_old
    x, s, s_next = store['xs'][:, 0], 0.9, 0.85
    expand = lambda tx: [u.expand(rollout_batch, *u.shape[1:]) for u in tx]
    with torch.no_grad():
        v = velocity(model, x, torch.full((rollout_batch,), s, device=dev), expand(text), expand(text_neg), cuda)
        st = sde.step(x, v, s, s_next, 'sage', 0.5, noise=torch.randn_like(x))
        one = [sde.step(x[i:i + 1], velocity(model, x[i:i + 1], torch.full((1,), s, device=dev), text, text_neg,
                                              cuda), s, s_next, 'sage', 0.5, x_next=st.x_next[i:i + 1]).logp
               for i in range(rollout_batch)]
    ratio = torch.exp(torch.cat(one) - st.logp)                         # (n,) exactly 1 if batch-invariant
    res['ratio_distance'] = (ratio - 1).abs().max().item()
    P = sum(p.numel() for p in model.parameters())  # a DTensor's numel is the global one
    est = {}
    path = os.path.join(out_dir, 'fullsize.json')
    if not tiny and os.path.exists(path):
        with open(path) as f:
            runs = json.load(f)['runs']
        pick = lambda what, world: next((r for r in runs if r['what'] == what and r['world'] == world
                                         and (r['height'], r['width']) == (H, W)), None)
        est = {k: pick(w, dist.get_world_size() if ddp else 0) for k, w in (('train', 'train'), ('rollout', 'rollout'))}
    if master:
        print(f'check on {dev} x{dist.get_world_size() if ddp else 1}: {"full fine-tune, FSDP2" if ddp else f"LoRA r{lora_rank}"}, '
              f'~{P / 1e9:.3f}B params, {Fr}x{H}x{W}')
        for name, r in res.items():
            if name == 'ratio_distance':
                continue
            e = est.get('rollout' if 'rollout' in name else 'train')
            e = e and e['phases'].get(name)
            print(f'  {name:16s} {r["seconds"]:8.2f} s   peak {r["peak_gib"]:7.2f} GiB' +
                  (f'   (estimate {e["peak"]["Total"] / GiB:.2f} GiB)' if e else ''))
        d = res['ratio_distance']
        print(f'  PPO ratio, batched rollout vs one clip at a time: max |ratio - 1| = {d:.2e} '
              f'({"above" if d > 1e-4 else "within"} the clip range 1e-4)')
        print('CHECK_JSON ' + json.dumps(res))
    if ddp:
        dist.destroy_process_group()


if __name__ == '__main__':
    check()
