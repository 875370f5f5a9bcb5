"""
What a checkpoint and a resume cost as the model grows, and what the prompt cache costs a rank as
the prompt set grows. Checkpoints: random HunyuanVideo15Transformer3DModel
configs of about 20M, 80M and 320M parameters, in one process and on 2 FSDP2 ranks (gloo, CPU),
with this project's sharded checkpoints (checkpoint.py, DCP) and with the simplest alternative, a
gathered save (the full state gathered to rank 0 and pickled into one state.pt; on resume every rank
torch.loads all of it: old_save / old_load below).

    python -m bench.checkpoint              # ~5 min on 2 cores; results/checkpoint.{md,json}, results/README.md section 10
    python -m bench.checkpoint --parts=      # no measurement: the report and block from checkpoint.json
    python -m bench.checkpoint --quick=True # the 20M config only (a smoke test, into /tmp/bench_checkpoint_quick)
    python -m bench.checkpoint --parts=prompts   # one part again, the other keeps its last results

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

Prompt cache: 100 and 10,000 synthetic prompts of 2.2 MB (300 x 3584 bf16 Qwen embeddings) written
by prompt_cache.build (rank 0, chunk by chunk); a fresh process (one rank) opens the cache and reads
64 prompts; a single torch.save'd file (`old`) is loaded whole where it fits in RAM.
"""
import gc
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import torch

from bench import common as C

# ----------------------------------------------------------------------------- settings
out = 'results'                 # checkpoint.md and checkpoint.json go here
work = '/tmp/bench_checkpoint'  # checkpoints are written here (deleted after each measurement)
quick = False                   # the smallest config only
parts = 'checkpoint,prompts'    # which measurements to run (the other keeps its last results)
# random HunyuanVideo15Transformer3DModel configs: (name, num_layers, num_attention_heads); head dim 64
CONFIGS = (('20M', 3, 6), ('80M', 7, 8), ('320M', 14, 12))
TARGET_P = 8.3e9                # HunyuanVideo 1.5
TARGET_N = 8                    # GPUs (ranks) of one node
BYTES_PER_PARAM = 16            # fp32 weights + AdamW exp_avg, exp_avg_sq + anchor
PROMPT_COUNTS = (100, 10000)     # prompt-set sizes of the prompt-cache measurement
PROMPT_TOKENS, PROMPT_DIM = 300, 3584  # a prompt's Qwen embeddings: ~300 tokens x 3584 bf16 = 2.2 MB
PROMPT_READS = 64               # prompts one rank reads in the measurement
OLD_MAX_P = 1.2e8               # the gathered save is measured up to this size (at 320M its 2-rank resume
                                # needs ~14 GB on this shared 23 GB machine; its fraction is flat in P)
OLD_CACHE_MAX = 4e9             # the single-file cache is measured only below this size (host RAM)


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
    from infra import checkpoint
    from diffusers import HunyuanVideo15Transformer3DModel as T
    from infra.anchor import Anchor
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
    anchor = Anchor(model, 'dual', every=10)
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
        del model, anchor  # free the FSDP state (it holds the group) first: see the end of train.py
        gc.collect()
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
        cmd = launcher + ['-m', 'bench.checkpoint', '--worker', json.dumps([layers, heads, impl, phase, path, result])]
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        if p.returncode:
            raise RuntimeError(f'{cmd} failed:\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}')
        res[phase] = [json.load(open(f'{result}.{r}')) for r in range(nproc)]
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)
    return res


# ----------------------------------------------------------------------------- prompt cache
def fake_encode(model, prompts, device='cpu', sink=None, chunk=256):
    # model.encode_prompts' signature, synthetic embeddings of PROMPT_TOKENS x PROMPT_DIM bf16
    for c in range(0, len(prompts), chunk):
        sink({p: (torch.full((PROMPT_TOKENS, PROMPT_DIM), float(c + i), dtype=torch.bfloat16),
                  torch.ones(PROMPT_TOKENS), torch.zeros(1, 8), torch.zeros(1)) for i, p in enumerate(prompts[c:c + chunk])})


def prompt_worker(kind, path, n, reads, result):
    """One rank's view of the cache: open it, read `reads` prompts (a rank's share of some
    iterations); old: torch.load of the whole cache file. Peak RSS and seconds."""
    from infra import prompt_cache
    base = rss()
    prompts = [f'synthetic prompt {i}' for i in range(n)]
    t0 = time.perf_counter()
    with Peak() as pk:
        if kind == 'new':
            cache = prompt_cache.PromptCache(path)
            t_open = time.perf_counter() - t0
        else:
            cache = torch.load(path)['text']
            t_open = time.perf_counter() - t0
        # every byte read, as batch_text's copies read them (a safetensors mmap is read lazily)
        got = [float(cache[prompts[(i * 7919) % n]][0].float().sum()) for i in range(reads)]
    r = dict(base=base, peak=pk.peak, t_open=t_open, t_total=time.perf_counter() - t0, n_got=len(got))
    with open(result, 'w') as f:
        json.dump(r, f)


def bench_prompt_cache():
    """Write caches of 100 and 10,000 synthetic prompts once (rank 0's job), then measure one
    rank's open time and memory; the single-file cache is measured where it fits in RAM."""
    import shutil
    from infra import prompt_cache
    res = {}
    per_prompt = PROMPT_TOKENS * PROMPT_DIM * 2  # bytes of the embeddings (bf16)
    for n in PROMPT_COUNTS:
        prompts = [f'synthetic prompt {i}' for i in range(n)]
        path = os.path.join(work, f'prompts_{n}')
        shutil.rmtree(path, ignore_errors=True)
        t0 = time.perf_counter()
        prompt_cache.build(path, 'synthetic', prompts, encode_prompts=fake_encode)
        t_write = time.perf_counter() - t0
        row = dict(n=n, cache_gb=n * per_prompt / 1e9, t_write=t_write)
        kinds = [('new', path)]
        if n * per_prompt < OLD_CACHE_MAX:  # `old`: one torch.save'd dict, loaded whole by every rank
            old = os.path.join(work, f'prompts_{n}.pt')
            cache = {}
            fake_encode('synthetic', prompts, sink=cache.update)
            torch.save(dict(model='synthetic', text=cache), old)
            del cache
            kinds.append(('old', old))
        for kind, p in kinds:
            result = os.path.join(work, f'prompts_{n}_{kind}.json')
            subprocess.run([sys.executable, '-m', 'bench.checkpoint', '--prompt-worker', json.dumps([kind, p, n, PROMPT_READS, result])],
                           check=True, env=dict(os.environ, OMP_NUM_THREADS='1', MALLOC_MMAP_THRESHOLD_=str(1 << 20)),
                           cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
            row[kind] = json.load(open(result))
        shutil.rmtree(path, ignore_errors=True)
        if os.path.exists(os.path.join(work, f'prompts_{n}.pt')):
            os.remove(os.path.join(work, f'prompts_{n}.pt'))
        res[n] = row
        print(f'prompt cache {n}: written in {t_write:.1f} s', flush=True)
    md = ['', '### Prompt-embedding cache (infra/prompt_cache.py)', '',
          f'Synthetic prompts of {per_prompt / 1e6:.1f} MB each ({PROMPT_TOKENS} x {PROMPT_DIM} bf16). One rank opens the '
          f'cache and reads {PROMPT_READS} prompts scattered over it (a rank\'s share of many iterations), every byte of them; memory = peak RSS '
          'minus the RSS before, in a fresh process (it counts the memory-mapped pages read, shared by the ranks through the OS). `old`: one torch.save\'d file that every rank torch.loads whole '
          f'(measured where it fits in this machine\'s RAM, else marked as the cache size it would hold).', '',
          '| prompts | cache GB | written by rank 0 in s | new: open s | new: per-rank memory GB | old: load s | old: per-rank memory GB | old: 8 ranks GB |',
          '|---|---|---|---|---|---|---|---|']
    for n, row in res.items():
        new, old = row['new'], row.get('old')
        mem_old = (old['peak'] - old['base']) / 1e9 if old else row['cache_gb']
        t_old = f'{old["t_open"]:.2f}' if old else '-'
        md.append(f'| {n} | {row["cache_gb"]:.2f} | {row["t_write"]:.1f} | {new["t_open"]:.3f} | '
                  f'{(new["peak"] - new["base"]) / 1e9:.3f} | {t_old} | '
                  f'{mem_old:.2f}{"" if old else " (not run: the cache size)"} | {8 * mem_old:.0f} |')
    return res, md


# ----------------------------------------------------------------------------- main
def bench_checkpoints():
    configs = CONFIGS[:1] if quick else CONFIGS
    R = {}
    for name, layers, heads in configs:
        for impl in ('dcp', 'old'):
            for nproc in (1, 2):
                if impl == 'old' and R.get(f'{name} dcp 1', {}).get('P', 0) > OLD_MAX_P:
                    continue
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
    # extrapolation: a rank holds its 1/N share of the state plus g (what it holds beyond its share:
    # gathered copies, a whole loaded file, staging), g measured at N = 2 on the largest config
    ext = {}
    ST = BYTES_PER_PARAM * TARGET_P / 1e9
    for impl in ('dcp', 'old'):
        big = [name for name, _, _ in configs if f'{name} {impl} 2' in R][-1]  # the largest measured
        for phase in ('save', 'resume'):
            fr = R[f'{big} {impl} 2'][phase]['frac']
            g, g_other = max(fr) - 0.5, min(fr) - 0.5  # the worst rank (rank 0 gathers), the others
            ext[f'{impl} {phase}'] = dict(g=g, fitted_at=big, cpu_rank_gb=(1 / TARGET_N + g) * ST, host_rank_gb=g * ST,
                                          host_node_gb=(g + (TARGET_N - 1) * max(g_other, 0)) * ST)
    md = ['## Checkpoint and resume cost (bench/checkpoint.py)', '',
          'Random HunyuanVideo15Transformer3DModel configs, fp32 training state = 16 bytes a parameter (weights, '
          'AdamW moments, anchor), on this machine\'s 2 CPU cores (gloo). `dcp`: checkpoint.py (each rank writes '
          'and reads its own shards); `old`: a gathered save (the state gathered to rank 0, one pickle, every rank '
          'loads all of it). Peak = the highest sampled RSS of a rank during the save / the resume; fraction = '
          '(peak - RSS before the model was built: interpreter, libraries, process group) / full training state, the worst rank. Written = bytes per rank.', '',
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
    big = configs[-1][0]
    d = {ph: max(R[f'{big} dcp 2'][ph]['peak_gb']) / max(R[f'{big} dcp 1'][ph]['peak_gb']) for ph in ('save', 'resume')}
    md += ['', f'**At {big}, 2 ranks vs 1 process, per-rank peak RSS (absolute, interpreter included): save '
           f'{d["save"]:.2f}x, resume {d["resume"]:.2f}x** with dcp. The gathered save is not run above '
           f'{OLD_MAX_P / 1e6:.0f}M parameters (its 2-rank resume would need ~14 GB of this shared machine\'s 23 GB); '
           'its fractions do not depend on the size.', '',
           f'Extrapolated to {TARGET_P / 1e9:.1f}B parameters on {TARGET_N} ranks (full state {ST:.0f} GB): a rank '
           f'holds its 1/N share plus g, what it holds beyond its share (gathered copies, a whole loaded file, '
           f'staging), g = fraction - 1/2 measured at 2 ranks on the largest config run. On GPUs the share lives '
           f'in device memory, so g x {ST:.0f} GB is the host RAM a rank needs during a save or resume:', '',
           '| code, phase | measured at | g (worst rank) | GB per rank, state on CPU | host GB per rank, state on GPUs | host GB per node (8 ranks: the worst + 7 others) |',
           '|---|---|---|---|---|---|']
    md += [f'| {k} | {v["fitted_at"]} | {v["g"]:.2f} | {v["cpu_rank_gb"]:.0f} | {v["host_rank_gb"]:.0f} | '
           f'{v["host_node_gb"]:.0f} |' for k, v in ext.items()]
    worst = max(ext['dcp save']['host_node_gb'], ext['dcp resume']['host_node_gb'])
    old_worst = max(ext['old save']['host_node_gb'], ext['old resume']['host_node_gb'])
    md += ['', f'**A node of 8 GPUs training the 8.3B model needs about {worst:.0f} GB of host RAM beyond its '
           f'processes\' baseline during a save or a resume with sharded checkpoints; a gathered save would need about '
           f'{old_worst:.0f} GB** (it holds the whole state on rank 0 when saving and loads it on '
           'every rank). Both are upper bounds from CPU runs, where DCP\'s staging copies and the freshly '
           'initialised optimizer state count as well.']
    return dict(runs=R, extrapolation=ext), md


def main():
    global PROMPT_COUNTS, out
    if quick:  # a smoke test: never over the committed results
        PROMPT_COUNTS = (10, 100)
        out = os.path.join(tempfile.gettempdir(), 'bench_checkpoint_quick') if out == 'results' else out
    prev = {}
    if os.path.exists(os.path.join(out, 'checkpoint.json')):
        with open(os.path.join(out, 'checkpoint.json')) as f:
            prev = json.load(f)
    # --parts=prompts reruns one part; the other keeps its numbers and table from the last run (if any)
    ck, ck_md = bench_checkpoints() if 'checkpoint' in parts or 'checkpoint' not in prev else \
        (prev['checkpoint'], prev['markdown_checkpoint'])
    pc, pc_md = bench_prompt_cache() if 'prompts' in parts or 'prompt_cache' not in prev else \
        (prev['prompt_cache'], prev['markdown_prompts'])
    md = ck_md + pc_md
    os.makedirs(out, exist_ok=True)
    text = '\n'.join(md) + '\n'
    with open(os.path.join(out, 'checkpoint.md'), 'w') as f:
        f.write(f'<!-- written by python -m bench.checkpoint{" --quick" if quick else ""}, '
                f'{time.strftime("%Y-%m-%d %H:%M")}, torch {torch.__version__} -->\n' + text)
    with open(os.path.join(out, 'checkpoint.json'), 'w') as f:
        json.dump(dict(checkpoint=ck, prompt_cache=pc, markdown_checkpoint=ck_md, markdown_prompts=pc_md,
                       quick=quick), f, indent=1)
    if not quick:  # results/README.md section 10, the headlines; the tables and how: results/checkpoint.md
        bold = [l.split('**')[1] + '.' for l in ck_md if l.startswith('**')][-1:]  # the last: 8.3B on a node of 8 GPUs
        run = [r for k, r in ck['runs'].items() if k.endswith('dcp 2')][-1]  # the largest measured: bytes a parameter
        disk = sum(run['save']['written_gb']) / run['P'] * TARGET_P  # on disk, extrapolated to 8.3B
        bold.append(f'Disk per checkpoint at {TARGET_P / 1e9:.1f}B: about {disk:.0f} GB ({disk / TARGET_P * 1e9:.1f} bytes a '
                    f'parameter as written at {run["P"] / 1e6:.0f}M: fp32 weights, AdamW moments, anchor), '
                    f'1/{TARGET_N} of it written by each rank; `keep_checkpoints` of them stay.')
        C.put_block(os.path.join(out, 'README.md'), 'bench.checkpoint', [
            '## 10. Checkpoints and the prompt cache at 8.3B (`python -m bench.checkpoint`)', ''] +
            ['- ' + b for b in bold] + ['- Prompt cache (infra/prompt_cache.py): ' + '; '.join(
            f'{r.split("|")[1].strip()} prompts ({r.split("|")[2].strip()} GB) open in {r.split("|")[4].strip()} s '
            f'with {r.split("|")[5].strip()} GB per rank' for r in pc_md if r.startswith('| ') and r[2].isdigit()) +
            '. How, and every config: [checkpoint.md](checkpoint.md).'])
    print(text)


if __name__ == '__main__':
    if len(sys.argv) > 2 and sys.argv[1] in ('--worker', '--prompt-worker'):
        (worker if sys.argv[1] == '--worker' else prompt_worker)(*json.loads(sys.argv[2]))
    else:
        from infra.configurator import configure
        configure(globals())
        main()
