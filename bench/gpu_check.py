"""
The one command for a lent GPU machine (one H100 or H200 for a short window: torch and transformers installed,
no diffusers, no network, no weights, one output folder of at most 8 files): six phases, each a process with
its own time limit, all within `deadline` seconds (9 minutes; 9.5 with the install), in the order that
answers the most important questions first.

    bash bench/gpu_wheels.sh            # once, here: the wheels the lent image lacks (bench/gpu_image.py) into .whl/
    # there: the device tool's run(carry=['.whl'], timeout_s=600, command=...), $OUT the folder that comes back
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl && export PYTHONPATH=/tmp/site || exit; PYTHONUNBUFFERED=1 python3 -m bench.gpu_check --out=$OUT
    python -m bench.gpu_check --out=gpu_out                 # any machine with a GPU and the requirements
    python -m bench.gpu_check --report=gpu_out              # a GPU run's files -> results/gpu.md
    python -m bench.gpu_check --device=cpu --out=/tmp/gc    # the same phases at the tests' tiny sizes (~3 min)

Each phase writes <out>/<i>_<name>.json the moment it has something (a phase that fails or runs out of
time still leaves its json, saying so) and prints one summary line; <out>/gpu_check.log keeps each
phase's last output lines, the running phase's rewritten every few seconds (a machine taken back
mid-phase still returns what it printed): 7 files. A phase at its limit is ended with every process
under it (end_tree: torchrun starts its workers in sessions of their own, out of reach of a group kill). Random weights at the real width, built on the GPU
(bench/gpu_phases.py, bench/gpu_phases_train.py); on a CPU the tests' tiny models.
0. env: fails fast, with one line, and then nothing else runs: the carried wheels import (diffusers,
   transformers, peft), the hub is offline (HF_HUB_OFFLINE, TRANSFORMERS_OFFLINE = 1: this check sets
   them), a one-rank NCCL all-reduce; then versions, a bf16 matmul's TFLOP/s, the kernel of torch's SDPA
   (a failure or timeout after the all-reduce passed stops nothing: the later phases need only those).
1. smoke: train.py with the tests' tiny models under torchrun (1 GPU, NCCL; on a CPU 2 ranks, gloo):
   one iteration, a resume that trains one more and exports; the export loaded by diffusers. The
   recompute fix and the whole program on real CUDA, first.
2. update: a full fine-tune's micro-step under FSDP2 at world 1 with `blocks` and 2x`blocks` blocks
   (anchor forward, forward, backward, clip, Muon + AdamW, timed apart), slopes to 54 blocks on a rank of
   8: its time, MFU from bench.fullsize's FLOP table, and its memory peak with the reward models
   resident (the figure that says whether a real update fits); with velocity()'s bf16 autocast and without.
3. attention: valid_tokens (models/attention.attend) on native, _native_flash, _native_cudnn,
   _native_efficient, flash and _flash_3 where installed, at the training size (81x352x624: 18018 video
   tokens, 18306 with the prompt's text): output and q, k, v gradients against an fp32 reference computed
   a head chunk at a time, each within 2x native's own error against it (bench/attention.py gate());
   forward and forward + backward by CUDA events; the fastest that passes, and then runs one update
   micro-step of the transformer, is the one to make train.py's attention_backend on that GPU.
4. reward: VideoAlign (Qwen2-VL-2B at its real depth) scoring four clips, the VAE at its released widths
   decoding one clip of each size: time, allocated and reserved peaks.
5. drift: the 8.3B transformer at full depth through models.policy.shard (FSDP2 over one rank: train.py's
   dtype path), the rollout-shaped forward (rollout_batch clips, no grad) against the update-shaped one
   (one clip, grad + gradient checkpointing) at the same weights and x_t, through policy.velocity and
   sde.step, at `steps` of sde.sigmas(20, 5) (a late one, a middle one): max |d logp|, |dv|/|v|, the
   fraction of clips whose ratio leaves 1 +- clip_range; the rollout forward's time and a world-1 rank's peak.
Budgets (s) on a GPU, estimated: env 45, smoke 120, update 110, attention 70, reward 80, drift 105 (530 of
540); the CPU run's own times are in results/gpu.md.
Tested by: python -m pytest tests/test_gpu_check.py (the slow tier runs the CPU path)
"""
import json
import os
import shutil
import subprocess
import sys
import time

from infra.configurator import configure, list_of

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ----------------------------------------------------------------------------- settings
device = 'cuda'                 # 'cuda' (one GPU) or 'cpu' (the same phases at the tests' tiny sizes)
out = '/tmp/sage-gpu-check/out'  # the phases' json files and gpu_check.log (the device tool: $OUT)
work_dir = '/tmp/sage-gpu-check/work'  # logs, tokenizers, the smoke run's models and out_dir (wiped at the start)
phases = 'env,smoke,update,attention,reward,drift'  # the phases to run (a comma list of their names)
deadline = 540.0                # seconds for all phases (the device's 10-minute command, less the install)
phase_timeout = 150.0           # seconds: no phase runs longer (each has its share below, BUDGET)
blocks = None                   # K of the update phase: K and 2K blocks (None: 4 on a GPU, 1 on a CPU)
num_frames = 81                 # the clip of the update and drift phases (train.py's rollout size; a CPU: 9x64x96)
height = 352
width = 624
attention_size = (81, 352, 624)  # the attention phase's clip: the training size
video_sizes = ((81, 352, 624), (81, 480, 848))  # the reward phase: the paper's rollout size, the model's 480p
steps = (19, 10)                # the drift phase's steps of the 20: a late one (small std), a middle one
rollout_batch = 4               # clips of the rollout forward (train.py's default)
cfg = 6.0                       # classifier-free guidance of the forwards (train.py's default)
clip_range = 1e-4               # the PPO clip the drift is compared with (train.py's default)
tail_every = 5.0                # seconds between rewrites of the running phase's tail into <out>/gpu_check.log
report = ''                     # a folder of a GPU run's json files: write results/gpu.md from it, run nothing
config = configure(globals(), rules=dict(
    steps=((lambda v: len(v) > 0 and all(0 <= k < 20 for k in v)), 'steps of the 20, each in 0..19'),
    phases=list_of('env', 'smoke', 'update', 'attention', 'reward', 'drift')))
# -----------------------------------------------------------------------------
NAMES = ('env', 'smoke', 'update', 'attention', 'reward', 'drift')  # the most important question first
FILES = {n: f'{i}_{n}.json' for i, n in enumerate(NAMES)}
BUDGET = dict(env=45, smoke=120, update=110, attention=70, reward=80, drift=105)  # seconds on a GPU (530 of 540)
BUDGET_CPU = dict(env=40, smoke=150, update=70, attention=40, reward=60, drift=60)  # on 2 shared cores
OFFLINE = dict(HF_HUB_OFFLINE='1', TRANSFORMERS_OFFLINE='1')  # no network there: a hub lookup would hang
TAIL_LINES = 60  # a phase's last output lines kept in gpu_check.log


def fmt(x, spec='.2g'):
    return '-' if x is None else format(x, spec)


def summary(name, r):
    """The phase's figures in one line."""
    if name == 'env':
        v, g = r['versions'], r.get('gpu', {})
        return (f"{g.get('name', 'cpu')}, torch {v['torch']}, CUDA {v['cuda']}, diffusers {v['diffusers']}, "
                f"transformers {v['transformers']}, peft {v.get('peft')}; all-reduce {r['all_reduce']['backend']} "
                f"{r['all_reduce']['s']} s; {r['matmul']['dtype'][6:]} matmul {r['matmul']['tflops']} TFLOP/s; "
                f"SDPA kernel: {'; '.join(r['sdpa']['kernels'])[:120]}")
    if name == 'drift':
        rows = ', '.join(f"step {s['step']} (std {s['std']}): |d logp| {fmt(s['max_abs_dlogp'])} |dv|/|v| "
                         f"{fmt(s['max_rel_dv'])} beyond clip {s['frac_beyond_clip']:.2f}" for s in r['steps'])
        s = r['steps'][-1]
        return (f"{r['params_b']}B through shard(), {rows}; rollout forward {s['rollout_s']} s, peak "
                f"{s['rollout_peak_gib']} GiB (world 1)")
    if name == 'attention':
        ran = [f"{x['backend']} {x['fwd_bwd_ms']:.1f} ms ({x['fwd_bwd_tflops']} TFLOP/s, errors "
               f"{'/'.join(fmt(e) for e in x['errors'].values())}{'' if x['passes'] else ' FAILS'})"
               for x in r['rows'] if 'fwd_bwd_ms' in x]
        return (f"{r['size']} ({r['tokens']['prompt']} tokens) fwd+bwd, out/dq/dk/dv errors against fp32: "
                f"{'; '.join(ran)}; fastest within {r['gate']} and a micro-step: {r.get('fastest')}")
    if name == 'update':
        parts = []
        for k, e in r['at_54_blocks_8_ranks'].items():
            parts.append(f"{k}: " + ', '.join(f"{p} {e[p]['s']} s" for p in ('anchor forward', 'forward', 'backward',
                                                                              'clip', 'muon'))
                         + f", micro-step {e['micro_step_s']} s, MFU {fmt(e['mfu'])}, peak "
                         f"{e['peak_gib_per_rank']['total']} GiB a rank (reward models "
                         f"{e['peak_gib_per_rank']['reward']} GiB included)")
        errors = [f"{x['blocks']} blocks autocast {x['autocast']}: {x['error']}" for x in r['runs'] if 'error' in x]
        return f"at 54 blocks, a rank of 8: {'; '.join(parts) or 'none'}" + ''.join(f'; {e}' for e in errors)
    if name == 'reward':
        va = r['videoalign'].get('second', {})
        d = ', '.join(f"{x['clip']} {x['s']} s peak {x['peak_gib']}/{x['reserved_gib']} GiB"
                      for x in r.get('vae', {}).get('decode', []))
        return (f"VideoAlign {r['videoalign']['params_b']}B, 4 clips {va.get('s')} s peak {va.get('peak_gib')}/"
                f"{va.get('reserved_gib')} GiB (allocated/reserved); VAE decode {d or '-'}")
    if name == 'smoke':
        runs = ', '.join(f"{x['name']} ({x['how']}) {x['s']} s" for x in r['runs'])
        it = r.get('iterations', [{}])[-1]
        return (f"train.py ({r['backend']}): {runs}; ratio_max {fmt(it.get('ratio_max'))}; "
                f"export loaded: {r.get('export', {}).get('loaded', False)}")
    return ''


def one_line(name, rec):
    """summary() of a finished phase; of a failed one its error, then what its partial record holds."""
    try:
        line = summary(name, rec)
    except (KeyError, IndexError, TypeError, ValueError) as e:  # a partial record
        line = f'(partial record: no {e})'
    return line if rec.get('status') == 'ok' else f"{rec.get('error', '')} | {line}"


def end_tree(pid):
    """SIGKILL pid and every process under it. The tree is read before any is killed (a killed parent's
    children are re-parented and lost to the walk) and each found process is stopped first, so none
    starts another in between; a process group or session would miss torchrun's workers (their own)."""
    import psutil
    try:
        procs = {pid: psutil.Process(pid)}
    except psutil.NoSuchProcess:
        return
    while True:  # stop each known process, then read its children; done when a pass finds none new
        new = {}
        for q in procs.values():
            try:
                q.suspend()
                new.update((c.pid, c) for c in q.children(recursive=True) if c.pid not in procs)
            except psutil.NoSuchProcess:
                pass
        if not new:
            break
        procs.update(new)
    for q in procs.values():
        try:
            q.kill()
        except psutil.NoSuchProcess:
            pass
    # the rest gone before the caller goes on; pid itself left to its parent's wait(), which reads its status
    psutil.wait_procs([q for q in procs.values() if q.pid != pid], timeout=10)


def write_log(sections):
    """<out>/gpu_check.log: the finished phases' sections, then the running one's."""
    with open(os.path.join(out, 'gpu_check.log'), 'w') as f:
        f.write(''.join(sections))


def tail_of(log):
    with open(log, errors='replace') as f:
        return f.read().splitlines()[-TAIL_LINES:]


def run_phase(i, name, limit, cfg_json, done):
    """One phase in a process of its own, ended with all its processes (end_tree) at its limit; its
    output's tail rewritten into gpu_check.log every tail_every seconds while it runs. `done`: the
    finished phases' log sections, this one's appended."""
    path, log = os.path.join(out, FILES[name]), os.path.join(work_dir, f'{name}.log')
    t0 = time.time()
    with open(log, 'w') as f:
        p = subprocess.Popen([sys.executable, '-m', 'bench.gpu_phases', name, cfg_json], stdout=f, cwd=ROOT,
                             stderr=subprocess.STDOUT, start_new_session=True)
        while True:
            left = limit - (time.time() - t0)
            try:
                rc = p.wait(timeout=max(0.0, min(tail_every, left)))
                break
            except subprocess.TimeoutExpired:
                if left <= tail_every:  # the limit: the phase, torchrun and its workers
                    end_tree(p.pid)
                    rc = p.wait()
                    break
                write_log(done + [f'===== {i}_{name}: running, {time.time() - t0:.0f} s of {limit:.0f}\n'
                                  + '\n'.join(tail_of(log)) + '\n'])
    rec = {}
    if os.path.exists(path):
        with open(path) as f:
            rec = json.load(f)
    timed_out = time.time() - t0 >= limit and rc != 0
    status = 'ok' if rc == 0 else 'timeout' if timed_out else 'failed'
    rec.update(phase=name, status=status, rc=rc, seconds=round(time.time() - t0, 1), limit_s=round(limit))
    tail = tail_of(log)
    if status == 'timeout':
        rec['error'] = f'killed at its limit of {limit:.0f} s'
    elif status == 'failed' and not rec.get('error'):  # the phase's own line, else the exception's, else the last
        rec['error'] = next((l for l in reversed(tail) if 'Error' in l or 'error' in l), tail[-1] if tail else '')[:300]
    if os.path.exists(path + '.tmp'):  # a write cut short by the kill: not one of the files that come back
        os.remove(path + '.tmp')
    with open(path, 'w') as f:
        json.dump(rec, f, indent=1)
    done.append(f'===== {i}_{name}: {status}, exit {rc}, {rec["seconds"]} s\n' + '\n'.join(tail) + '\n')
    write_log(done)
    line = one_line(name, rec)
    print(f'{i} {name}: {status} in {rec["seconds"]:.0f} s of {limit:.0f} | {line}', flush=True)
    return rec


def env_passed(rec):
    """What the later phases need of env: the wheels imported and a one-rank all-reduce gave 1 (recorded
    in that order); the versions, matmul and SDPA figures after it are for the report only."""
    return rec['status'] == 'ok' or rec.get('all_reduce', {}).get('ok') is True


def main():
    cuda = device == 'cuda'
    if cuda:
        import torch
        if not torch.cuda.is_available():
            raise SystemExit('no CUDA device: --device=cpu runs the same phases at the tests\' tiny sizes')
    shutil.rmtree(work_dir, ignore_errors=True)
    os.makedirs(work_dir)
    os.makedirs(out, exist_ok=True)
    for f in list(FILES.values()) + ['gpu_check.log']:  # this run's files only
        if os.path.exists(os.path.join(out, f)):
            os.remove(os.path.join(out, f))
    c = dict(config, blocks=blocks or (4 if cuda else 1), files=FILES, out=os.path.abspath(out),
             work_dir=os.path.abspath(work_dir), steps=list(steps))
    os.environ.update(OFFLINE)  # the phases' processes inherit it; the env phase checks it took
    t0, budget, why_not, done = time.time(), BUDGET if cuda else BUDGET_CPU, None, []
    for i, name in enumerate(NAMES):
        if name not in [p.strip() for p in phases.split(',')]:
            continue
        limit = min(budget[name], phase_timeout, deadline - (time.time() - t0))
        why_not = why_not or (limit < 2 and 'the deadline left no time')
        if why_not:  # the phase's json says why it did not run
            with open(os.path.join(out, FILES[name]), 'w') as f:
                json.dump(dict(phase=name, status='skipped', error=why_not), f)
            print(f'{i} {name}: skipped | {why_not}', flush=True)
            continue
        rec = run_phase(i, name, limit, json.dumps(c), done)
        if name == 'env' and not env_passed(rec):  # nothing else can run: fail fast
            why_not = f"env failed: {rec.get('error', '')}"
    print(f'gpu_check: {time.time() - t0:.0f} s; files in {out}', flush=True)


def write_report(folder, dest='results/gpu.md'):
    """results/gpu.md from a run's json files: each phase's summary line, then its record."""
    recs = {}
    for name in NAMES:
        path = os.path.join(folder, FILES[name])
        if os.path.exists(path):
            with open(path) as f:
                recs[name] = json.load(f)
    env = recs.get('env', {})
    md = ['# GPU check', '', f"Written by `python -m bench.gpu_check --report={folder}` from a run of "
          f"`python -m bench.gpu_check` on {env.get('gpu', {}).get('name', env.get('device', '?'))} "
          '(bench/gpu_check.py says what each phase measures).', '']
    for i, name in enumerate(NAMES):
        r = recs.get(name)
        if r is None:
            md.append(f'- **{i} {name}**: not run')
            continue
        line = one_line(name, r)
        md.append(f"- **{i} {name}** ({r.get('status')}, {r.get('seconds')} s): {line}")
    md += ['', '```json', json.dumps(recs, indent=1)[:60000], '```', '']
    with open(dest, 'w') as f:
        f.write('\n'.join(md))
    print(f'wrote {dest}')


if __name__ == '__main__':
    write_report(report) if report else main()
