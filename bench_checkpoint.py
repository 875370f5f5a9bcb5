"""
What a checkpoint and a resume cost as the model grows: random HunyuanVideo15Transformer3DModel
configs of about 20M, 80M and 320M parameters, in one process and on 2 FSDP2 ranks (gloo, CPU),
with this project's sharded checkpoints (checkpoint.py, DCP) and with the code they replaced (a full
state gathered to rank 0 and pickled into one state.pt; on resume every rank torch.loads all of it:
reimplemented below from git history, f775d5f train.py save_checkpoint and its resume block).

    python bench_checkpoint.py              # ~5 min on 2 cores; results/checkpoint.{md,json}, README block
    python bench_checkpoint.py --quick=True # the 20M config only (a smoke test)

Each measurement is a fresh child process (or 2 under torchrun): build the model, one AdamW step
(random gradients) and an anchor: the training state is fp32 weights + 2 AdamW moments + anchor =
16 bytes a parameter (gradients are freed before a save). A thread samples the process's resident
memory (/proc/self/statm) every millisecond during the save and during the resume; the table shows
the peak per rank, and that peak minus the RSS before the model was built (interpreter,
libraries, process group), as a fraction of the full training state. glibc is told to return freed blocks above 1 MB to the OS
(MALLOC_MMAP_THRESHOLD_), so a peak is what was live, not what the allocator kept.

Extrapolation to 8.3B on 8 ranks: per implementation and phase the fraction of the full state a
rank holds is fitted as a + b/N from N = 1 and 2 at the largest config (a: what every rank holds
whole, b: what is sharded), then per rank = (a + b/8) x 16 B x 8.3e9 and per node = 8 x that.
"""
import json
import os
import subprocess
import sys
import threading
import time

import torch

# ----------------------------------------------------------------------------- settings
out = 'results'                 # checkpoint.md and checkpoint.json go here
work = '/tmp/bench_checkpoint'  # checkpoints are written here (deleted after each measurement)
quick = False                   # the smallest config only
# random HunyuanVideo15Transformer3DModel configs: (name, num_layers, num_attention_heads); head dim 64
CONFIGS = (('20M', 3, 6), ('80M', 7, 8), ('320M', 14, 12))
TARGET_P = 8.3e9                # HunyuanVideo 1.5
TARGET_N = 8                    # GPUs (ranks) of one node
BYTES_PER_PARAM = 16            # fp32 weights + AdamW exp_avg, exp_avg_sq + anchor
README_BEGIN, README_END = '<!-- bench_checkpoint:begin -->', '<!-- bench_checkpoint:end -->'


def rss():
    with open('/proc/self/statm') as f:
        return int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE')


class Peak:
    """with Peak() as p: ... -> p.peak, the highest RSS sampled while the block ran."""

    def __enter__(self):
        self.peak, self.stop = rss(), False
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()
        return self

    def run(self):
        while not self.stop:
            self.peak = max(self.peak, rss())
            time.sleep(0.001)

    def __exit__(self, *exc):
        self.stop = True
        self.thread.join()
        self.peak = max(self.peak, rss())


# ----------------------------------------------------------------------------- the replaced code
def old_save(path, model, optimizer, anchor, loop):
    # what train.py did before (git f775d5f): gather everything to rank 0, one safetensors + one pickle
    import torch.distributed as dist
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, \
        get_optimizer_state_dict
    from torch.distributed.tensor import DTensor
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    weights = {k: v.contiguous() for k, v in get_model_state_dict(model, options=opts).items() if k in trainable}
    optim = get_optimizer_state_dict(model, optimizer, options=opts)
    anchor_state = {k: (v.full_tensor() if isinstance(v, DTensor) else v).cpu() for k, v in anchor.state_dict().items()}
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    os.makedirs(path, exist_ok=True)
    save_file(weights, os.path.join(path, 'model.safetensors'))
    torch.save(dict(optimizer=optim, anchor=anchor_state, **loop), os.path.join(path, 'state.pt'))


def old_load(path, model, optimizer, anchor):
    # rank 0 reads the weights and broadcasts; every rank torch.loads the whole state.pt
    import torch.distributed as dist
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, \
        set_optimizer_state_dict
    master = not dist.is_initialized() or dist.get_rank() == 0
    full = load_file(os.path.join(path, 'model.safetensors')) if master else {}
    if dist.is_initialized():
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True,
                                                                   strict=False))
    else:
        model.load_state_dict(full, strict=False)
    del full
    state = torch.load(os.path.join(path, 'state.pt'), weights_only=False)
    set_optimizer_state_dict(model, optimizer, optim_state_dict=state['optimizer'],
                             options=StateDictOptions(full_state_dict=True, strict=False))
    anchor.load_state_dict(state['anchor'])


# ----------------------------------------------------------------------------- one measurement
def worker(layers, heads, impl, phase, path, result):
    """Build the training state, then save it to path or resume from it; write result JSON."""
    import torch.distributed as dist
    import checkpoint
    from diffusers import HunyuanVideo15Transformer3DModel as T
    from trust_region import Anchor
    ddp = 'RANK' in os.environ
    if ddp:
        dist.init_process_group('gloo')
    base = rss()  # everything but the training state: interpreter, torch, diffusers, process group
    rank, world = (dist.get_rank(), dist.get_world_size()) if ddp else (0, 1)
    torch.manual_seed(0)
    model = T(num_layers=layers, num_refiner_layers=1, num_attention_heads=heads, attention_head_dim=64,
              text_embed_dim=64, text_embed_2_dim=8, image_embed_dim=16, rope_axes_dim=(16, 24, 24),
              in_channels=9, out_channels=4)
    P = sum(p.numel() for p in model.parameters())
    if ddp:
        from torch.distributed.fsdp import fully_shard
        for block in model.transformer_blocks:
            fully_shard(block)
        fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.01)
    if phase == 'save':  # one step with random gradients: AdamW state exists, gradients freed
        for p in model.parameters():
            p.grad = torch.randn_like(p) * 1e-3
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    anchor = Anchor(model, 'dual')
    loop = dict(iter_num=1, opt_steps=1, world=world, controller={}, config={})
    if ddp:
        dist.barrier()
    t0 = time.perf_counter()
    with Peak() as pk:
        if phase == 'save' and impl == 'dcp':
            checkpoint.save(path, model, [optimizer], anchor.state_dict(), loop)
        elif phase == 'save':
            old_save(path, model, optimizer, anchor, loop)
        elif impl == 'dcp':
            checkpoint.load(path, model, [optimizer], anchor)
        else:
            old_load(path, model, optimizer, anchor)
    seconds = time.perf_counter() - t0
    mine = ([f'__{rank}_0.distcp'] + (['.metadata', 'loop.json'] if rank == 0 else [])) if impl == 'dcp' else \
        (['model.safetensors', 'state.pt'] if rank == 0 else [])
    written = sum(os.path.getsize(os.path.join(path, f)) for f in mine) if phase == 'save' else 0
    r = dict(P=P, rank=rank, world=world, base=base, peak=pk.peak, seconds=seconds, written=written)
    with open(f'{result}.{rank}', 'w') as f:
        json.dump(r, f)
    if ddp:
        dist.barrier()
        dist.destroy_process_group()


def measure(layers, heads, impl, nproc, name):
    """Save then resume in fresh processes; per rank: peak RSS, seconds, bytes written."""
    import shutil
    path = os.path.join(work, f'{name}_{impl}_{nproc}', 'ckpt_000001')
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)
    os.makedirs(os.path.dirname(path))
    env = dict(os.environ, OMP_NUM_THREADS='1', MALLOC_MMAP_THRESHOLD_=str(1 << 20))
    res = {}
    for phase in ('save', 'resume'):
        result = os.path.join(work, f'{name}_{impl}_{nproc}_{phase}')
        launcher = [sys.executable, '-m', 'torch.distributed.run', '--standalone', f'--nproc_per_node={nproc}'] \
            if nproc > 1 else [sys.executable]
        cmd = launcher + [__file__, '--worker', json.dumps([layers, heads, impl, phase, path, result])]
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=os.path.dirname(os.path.abspath(__file__)))
        if p.returncode:
            raise RuntimeError(f'{cmd} failed:\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}')
        res[phase] = [json.load(open(f'{result}.{r}')) for r in range(nproc)]
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)
    return res


# ----------------------------------------------------------------------------- main
def main():
    configs = CONFIGS[:1] if quick else CONFIGS
    R = {}
    for name, layers, heads in configs:
        for impl in ('dcp', 'old'):
            for nproc in (1, 2):
                t0 = time.time()
                r = measure(layers, heads, impl, nproc, name)
                P = r['save'][0]['P']
                S = BYTES_PER_PARAM * P
                row = dict(P=P, state_gb=S / 1e9)
                for phase in ('save', 'resume'):
                    ranks = r[phase]
                    row[phase] = dict(
                        peak_gb=[x['peak'] / 1e9 for x in ranks],
                        frac=[(x['peak'] - x['base']) / S for x in ranks],  # per rank, of the full state
                        seconds=max(x['seconds'] for x in ranks),
                        written_gb=[x['written'] / 1e9 for x in ranks])
                R[f'{name} {impl} {nproc}'] = row
                print(f'{name} {impl} N={nproc}: save frac {max(row["save"]["frac"]):.2f}, resume frac '
                      f'{max(row["resume"]["frac"]):.2f} ({time.time() - t0:.0f} s)', flush=True)
    # extrapolation: fraction per rank = a + b / N from N = 1, 2 at the largest config
    big = configs[-1][0]
    ext = {}
    for impl in ('dcp', 'old'):
        for phase in ('save', 'resume'):
            f1, f2 = max(R[f'{big} {impl} 1'][phase]['frac']), max(R[f'{big} {impl} 2'][phase]['frac'])
            b = 2 * (f1 - f2)
            a = f1 - b
            per_rank = (a + b / TARGET_N) * BYTES_PER_PARAM * TARGET_P / 1e9
            ext[f'{impl} {phase}'] = dict(a=a, b=b, per_rank_gb=per_rank, node_gb=TARGET_N * per_rank)
    md = ['## Checkpoint and resume cost (bench_checkpoint.py)', '',
          f'Random HunyuanVideo15Transformer3DModel configs, fp32 training state = 16 bytes a parameter (weights, '
          f'AdamW moments, anchor), on this machine\'s 2 CPU cores (gloo). `dcp`: checkpoint.py (each rank writes '
          f'and reads its own shards); `old`: the code it replaced (gathered to rank 0, one pickle, every rank '
          f'loads all of it). Peak = the highest sampled RSS of a rank during the save / the resume; fraction = '
          f'(peak - RSS before the model was built: interpreter, libraries, process group) / full training state, the worst rank. Written = bytes per rank.', '',
          '| config | params | state GB | code | ranks | save peak GB per rank | save fraction | resume peak GB per rank '
          '| resume fraction | written GB per rank | save s | resume s |',
          '|---|---|---|---|---|---|---|---|---|---|---|---|']
    for k, row in R.items():
        name, impl, n = k.split()
        s, r = row['save'], row['resume']
        md.append(f'| {name} | {row["P"] / 1e6:.1f}M | {row["state_gb"]:.2f} | {impl} | {n} | '
                  f'{" / ".join(f"{g:.2f}" for g in s["peak_gb"])} | **{max(s["frac"]):.2f}** | '
                  f'{" / ".join(f"{g:.2f}" for g in r["peak_gb"])} | **{max(r["frac"]):.2f}** | '
                  f'{" / ".join(f"{g:.2f}" for g in s["written_gb"])} | {s["seconds"]:.1f} | {r["seconds"]:.1f} |')
    d = {ph: max(R[f'{big} dcp 2'][ph]['peak_gb']) / max(R[f'{big} dcp 1'][ph]['peak_gb']) for ph in ('save', 'resume')}
    md += ['', f'At {big}, 2 ranks vs 1 process, per-rank peak (absolute): save {d["save"]:.2f}x, resume '
           f'{d["resume"]:.2f}x with dcp.', '',
           f'Extrapolated to {TARGET_P / 1e9:.1f}B parameters on {TARGET_N} ranks (fraction per rank = a + b/N, fitted '
           f'at {big}; full state {BYTES_PER_PARAM * TARGET_P / 1e9:.0f} GB):', '',
           '| code, phase | a (whole on every rank) | b (sharded) | GB per rank | GB per node (8 ranks) |',
           '|---|---|---|---|---|']
    md += [f'| {k} | {v["a"]:.2f} | {v["b"]:.2f} | {v["per_rank_gb"]:.0f} | {v["node_gb"]:.0f} |' for k, v in ext.items()]
    worst = max(ext['dcp save']['node_gb'], ext['dcp resume']['node_gb'])
    old_worst = max(ext['old save']['per_rank_gb'], ext['old resume']['node_gb'])
    md += ['', f'A node that trains the 8.3B model with these checkpoints needs about {worst:.0f} GB of host RAM for the '
           f'training state across its 8 ranks during a save or a resume (the state itself is '
           f'{BYTES_PER_PARAM * TARGET_P / 1e9:.0f} GB; on GPUs it lives in device memory and DCP stages it one '
           f'tensor at a time), plus each process\'s interpreter; the old code needed up to {old_worst:.0f} GB.']
    os.makedirs(out, exist_ok=True)
    text = '\n'.join(md) + '\n'
    with open(os.path.join(out, 'checkpoint.md'), 'w') as f:
        f.write(f'<!-- written by python bench_checkpoint.py{" --quick" if quick else ""}, '
                f'{time.strftime("%Y-%m-%d %H:%M")}, torch {torch.__version__} -->\n' + text)
    with open(os.path.join(out, 'checkpoint.json'), 'w') as f:
        json.dump(dict(runs=R, extrapolation=ext, quick=quick), f, indent=1)
    if not quick and os.path.exists('README.md'):  # the README quotes the generated block, never retyped
        readme = open('README.md').read()
        if README_BEGIN in readme:
            head, rest = readme.split(README_BEGIN)
            readme = head + README_BEGIN + '\n' + text + rest[rest.index(README_END):]
            with open('README.md', 'w') as f:
                f.write(readme)
    print(text)


if __name__ == '__main__':
    if len(sys.argv) > 2 and sys.argv[1] == '--worker':
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        worker(*json.loads(sys.argv[2]))
    else:
        from configurator import configure
        configure(globals())
        main()
