"""
Section 4 of bench/toy.py, the cost of one toy iteration: `train.py config/toy.py` timed in one
process and on 2 FSDP ranks (peak memory of each), against the transformer passes it must do, timed
in this process on the same batch sizes (the overhead ratio); and one optimizer step (AdamW, Muon) per
rank (bench/toy_opt_worker.py). Writes section 4 of results/README.md.

    python -m bench.toy --sections=4            # this section (its cells cached in results/cells)
"""
import json
import math
import os
import subprocess
import sys
import time

import torch

from bench.common import cell, table
from bench.toy_common import MD, R, TOY, mean_std, policy, run_train
from models import policy as M
from models import toy
import sde

# ----------------------------------------------------------------------------- settings
# set from bench.toy's command line (it imports them and hands the values back: bench/common.py's share)
from bench.toy_common import eta, quick  # shared by several sections: bench.toy sets these copies too
cost_iters = 4                  # iterations of the section-4 timing run (the first is warm-up)
# -----------------------------------------------------------------------------


def time_passes(cfg_run):
    """Seconds of the transformer passes one toy iteration must do, measured here on the same
    batch sizes: rollout forwards (no grad), anchor forwards (no grad) and forward+backwards."""
    net = policy().train()
    n_clips = cfg_run['prompts_per_iter'] * cfg_run['group_size']
    n = cfg_run['num_steps']
    rb, tb = min(cfg_run['rollout_batch'], n_clips), min(cfg_run['train_batch'], n_clips)  # clips per pass
    sig = sde.sigmas(n, cfg_run['shift'])
    n_sto = sum(sde.variance('sage', sig[i].item(), sig[i + 1].item(), eta) > 0 for i in range(n))
    n_train = max(1, round((cfg_run.get('timestep_fraction') or 1.0) * n_sto))  # as train.py trains them
    prompts = (toy.all_prompts() * 4)[:n_clips]
    cache = M.encode_prompts(toy.DIR, prompts + [''])
    shape = M.latent_shape(toy.DIR, 0, 0, 0)
    params = [p for p in net.parameters() if p.requires_grad]

    def batch(b):
        text, neg = M.batch_text(cache, prompts[:b], 'cpu'), M.batch_text(cache, [''] * b, 'cpu')
        return torch.randn(b, *shape), text, neg

    def fwd(b, grad):
        x, text, neg = batch(b)
        s = sig[torch.randint(n, (b,))]
        with torch.set_grad_enabled(grad):
            v = M.velocity(net, x, s, text, cfg_run['cfg'], neg)
        if grad:
            v.square().mean().backward()
    fwd(rb, False), fwd(tb, True)  # warm-up
    reps = dict(roll=n * math.ceil(n_clips / rb), anchor=n_train * math.ceil(n_clips / tb),
                fb=n_train * math.ceil(n_clips / tb))
    out_ = {}
    for k, b, grad in (('roll', rb, False), ('anchor', tb, False), ('fb', tb, True)):
        t0 = time.perf_counter()
        for _ in range(reps[k]):
            fwd(b, grad)
        out_[k] = time.perf_counter() - t0
    for p in params:
        p.grad = None
    net.eval()
    return dict(passes=reps, **{f't_{k}': v for k, v in out_.items()})


def optimizer_step_cost():
    """Seconds of one optimizer step (AdamW, Muon + AdamW) on the toy policy: 1 process, 2 FSDP ranks
    (bench/toy_opt_worker.py)."""
    worker = ['-m', 'bench.toy_opt_worker', f'--reps={3 if quick else 11}']
    res = {}
    for nproc in (1, 2):
        head = [sys.executable] if nproc == 1 else [sys.executable, '-m', 'torch.distributed.run', '--standalone',
                                                    '--nproc_per_node=2']
        p = subprocess.run(head + worker, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS='1'))
        if p.returncode:
            raise RuntimeError(f'optimizer step timing failed:\n{p.stderr[-3000:]}')
        res[f'{nproc}'] = json.loads([l for l in p.stdout.splitlines() if l.startswith('RESULT ')][-1][7:])
    return res


def section4():
    ov = dict(max_iters=cost_iters, eval_every=0, save_every=0, eval_videos=0, diag_every=0)
    if quick:
        ov['prompts_per_iter'] = 4
    one = run_train(f'cost_1proc_it{cost_iters}_p{ov.get("prompts_per_iter", 8)}', ov)
    two = run_train(f'cost_fsdp2_it{cost_iters}_p{ov.get("prompts_per_iter", 8)}', ov, nproc=2)
    cfg_run = {k: TOY.get(k) for k in ('prompts_per_iter', 'group_size', 'rollout_batch', 'train_batch',
                                       'num_steps', 'shift', 'cfg', 'timestep_fraction')}
    cfg_run.update({k: v for k, v in ov.items() if k in cfg_run})
    passes = cell(f's4_passes_p{cfg_run["prompts_per_iter"]}', lambda: time_passes(cfg_run))
    res = {}
    for name, r in (('1 process', one), ('FSDP 2 ranks', two)):
        if r is None:
            continue
        it = r['iters'][1:] or r['iters']  # the first iteration warms up allocators and kernels
        m = {k: mean_std([i[k] for i in it])[0] for k in ('t_rollout', 't_reward', 't_update')}
        m['peak_mem_gb_ranks'] = it[-1].get('peak_mem_gb_ranks', [it[-1]['peak_mem_gb']])  # a peak: the last is the max
        m['t_iter'] = m['t_rollout'] + m['t_reward'] + m['t_update']
        res[name] = m
    ideal = passes['t_roll'] + passes['t_anchor'] + passes['t_fb']
    if '1 process' in res:
        m = res['1 process']
        res['overhead'] = dict(ideal=ideal, ratio=m['t_iter'] / ideal, rollout=m['t_rollout'] / passes['t_roll'],
                               update=m['t_update'] / (passes['t_anchor'] + passes['t_fb']))
    opt = None if quick else cell('s4_optimizer_step', optimizer_step_cost)  # two more processes: not in --quick
    R['4'] = dict(runs=res, passes=passes, config=cfg_run, optimizer_step=opt)
    md = ['## 4. Cost of one toy GRPO iteration',
          f'`train.py config/toy.py` ({cfg_run["prompts_per_iter"]} prompts x G={cfg_run["group_size"]}, '
          f'{cfg_run["num_steps"]} steps, cfg {cfg_run["cfg"]}, KL dual, diagnostics off), mean over iterations '
          f'2..{cost_iters} on this machine\'s 2 CPU cores (shared; timings are noisy). Peak memory = ru_maxrss '
          'of each process (each rank under torchrun).', '']
    md += [table(['run', 'rollout s', 'reward s', 'update s', 'iteration s', 'peak mem GB (per rank)'],
                 [[k, f'{v["t_rollout"]:.2f}', f'{v["t_reward"]:.3f}', f'{v["t_update"]:.2f}', f'{v["t_iter"]:.2f}',
                   ' / '.join(f'{g:.3f}' for g in v['peak_mem_gb_ranks'])] for k, v in res.items() if k != 'overhead']), '']
    if 'overhead' in res:
        o = res['overhead']
        md += [f'The transformer passes an iteration must do, timed in the bench process on the same batch sizes: '
               f'{passes["passes"]["roll"]} rollout forwards ({passes["t_roll"]:.2f} s), '
               f'{passes["passes"]["anchor"]} anchor forwards ({passes["t_anchor"]:.2f} s), '
               f'{passes["passes"]["fb"]} forward+backwards ({passes["t_fb"]:.2f} s): {ideal:.2f} s in all. '
               f'**Overhead ratio = iteration / passes = {o["ratio"]:.3f}** (target <= 1.10; rollout '
               f'{o["rollout"]:.3f}, update {o["update"]:.3f}).', '']
    n2d = opt and sum(p.numel() for p in policy().parameters() if p.requires_grad and p.ndim == 2)
    md += [] if opt is None else [f'One optimizer step on the toy policy ({n2d / 1e6:.2f} M weights in 2-D matrices; random gradients; median '
           'of 10 steps after the first, seconds per rank): Muon gathers every 2-D gradient (one all-gather per '
           'matrix) and orthogonalises the whole matrix on every rank (optimizer.py).', '',
           table(['optimizer', '1 process s', 'FSDP 2 ranks s (per rank)'],
                 [[k, f'{opt["1"][k]:.4f}', f'{opt["2"][k]:.4f}'] for k in ('adamw', 'muon')]), '']
    MD.extend(md)
