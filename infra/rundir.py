"""
One run's directory (out_dir): what is in it, the lock, the history of its settings, whether a
start continues the run it holds, and the loop's state that its checkpoints carry (Run).

    python train.py config/toy.py                     # a new run, or the run out_dir holds, continued
    python train.py config/toy.py --max_iters=80      # the same run, trained on to iteration 80
    python train.py config/toy.py --init_from=scratch --out_dir=out-2   # a new run, only where none is

init_from='auto' (the default) continues the run out_dir holds from its newest intact checkpoint,
and starts a new one where out_dir holds none: after a crash, a preemption, a torchrun restart or a
resubmitted job the same command continues. Nothing of a run is destroyed by another start:
- 'scratch' into an out_dir that holds a run (checkpoints, a log, eval videos) stops with one line;
- a start whose settings change the run (every setting not in SAFE) names each difference and
  stops; a SAFE one is taken, and config.json keeps what changed at which iteration;
- a --max_iters below the run's iteration stops (a run does not go back);
- one run per out_dir at a time: rank 0 holds an flock on out_dir/.lock for the life of its process
  (the kernel releases it when the process dies, SIGKILL included); a second start stops.
A run with a log but no checkpoint yet starts again at iteration 0: every random draw is a function
of (seed, iteration, clip), so the same settings redo the same iterations.

    <out_dir>/.lock         the lock; its text names the holder (pid, host, since)
    <out_dir>/config.json   {"settings": those in force, "starts": [{"iter", "world", "time",
                             "changed": {setting: [before, after]}, "restart"}, ...]}

Tested by: python -m pytest tests/test_rundir.py
"""
import fcntl
import json
import os
import socket
import time

import torch
import torch.distributed as dist

from infra import checkpoint

# ----------------------------------------------------------------------------- settings (train.py's, set as its own)
save_every_min = 30.0           # minutes of wall clock between checkpoints too (0: by count only)
keep_checkpoints = 2            # newest checkpoints kept in out_dir
export_dtype = 'bfloat16'       # the last checkpoint exported to out_dir/export; '' for none
nonfinite_stop = 3              # optimizer steps skipped in a row (NaN gradient) that stop a run
wandb_project = ''              # also log to this wandb project ('': none; wandb installed)
# -----------------------------------------------------------------------------

LOCK = '.lock'
CONFIG = 'config.json'
LOG = 'metrics.jsonl'
# Settings a continued run may change: this start's own, when and how it evaluates, saves and logs
# (evaluation reads the policy, never trains it), and how the same computation is laid out (ranks,
# batches, device, attention kernel: the same math). Every other setting defines the run: the data,
# the model and the shape of the checkpoint's state, the sampler, the objective and its trust
# region, the reward, the seeds. learning_rate and weight_decay are among them because the
# checkpoint restores the optimizer's own hyperparameters: a new value would be silently ignored.
SAFE = frozenset((
    'out_dir', 'init_from', 'max_iters',
    'eval_every', 'eval_samples', 'eval_videos', 'eval_steps', 'eval_prompts', 'eval_metrics',
    'clip_dir', 'pickscore_dir', 'save_every', 'save_every_min', 'keep_checkpoints', 'export_dtype', 'diag_every', 'ratio_every',
    'wandb_project',
    'rollout_batch', 'train_batch', 'gradient_checkpointing', 'attention', 'attention_backend', 'device',
    'sp_size', 'dist_timeout', 'shard_size', 'solo_timeout',
))

_held = None  # rank 0: the open lock file; the flock lasts as long as this process holds it open


def claim(config, master, log=print):
    """Collective. Lock out_dir (rank 0) and decide how this start begins: returns (checkpoints to
    resume from, newest first, [] for iteration 0; the run's config.json history, None for a new
    run). Stops with one line (SystemExit on every rank) where starting would harm the run held."""
    out_dir, init_from = config['out_dir'], config['init_from']
    error = None
    if master:
        try:
            _lock(out_dir)
        except SystemExit as e:
            error = str(e)
    if dist.is_initialized():  # every rank stops with rank 0's line
        box = [error]
        dist.broadcast_object_list(box)
        error = box[0]
    if error:
        raise SystemExit(error)
    what = holds(out_dir)
    if not what and init_from != 'resume':
        _own(out_dir, master)
        return [], None
    if init_from == 'scratch':
        again = ' (a torchrun restart: init_from=auto continues it)' \
            if int(os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)) else ''
        raise SystemExit(f'out_dir {out_dir!r} holds a run ({"; ".join(what)}){again}: nothing in it '
                         f'was changed. Continue it with init_from=auto (the default), or start a new '
                         f'run with another --out_dir')
    ckpts = checkpoint.candidates(out_dir, log=log) if checkpoint.found(out_dir) or init_from == 'resume' \
        else []  # newest first, the first verified intact (collective: each rank checks a share)
    loop = checkpoint.read_loop(ckpts[0]) if ckpts else None  # the state this start continues
    history = history_of(out_dir, loop and loop['config'])
    if history is None:  # a log, no checkpoint, no config.json: nothing says which run it is
        raise SystemExit(f'out_dir {out_dir!r} holds a run ({"; ".join(what)}) but no checkpoint and no '
                         f'{CONFIG}: its settings are unknown. Start a new run with another --out_dir')
    ran = loop['config'] if loop else history['settings']
    differ = [k for k in sorted(set(ran) & set(config))  # a setting the run's code had not: not compared
              if k not in SAFE and _plain(ran[k]) != _plain(config[k])]
    if differ:
        raise SystemExit(f'out_dir {out_dir!r} holds a run with other settings: '
                         + ', '.join(f'{k} {ran[k]!r} (the run) vs {config[k]!r}' for k in differ)
                         + '. They define the run: continue it with its values, or start a new run with '
                           'another --out_dir')
    at = loop['iter_num'] if loop else 0
    if config['max_iters'] < at:
        raise SystemExit(f'out_dir {out_dir!r} holds a run at iteration {at} ({os.path.basename(ckpts[0])}),'
                         f' past max_iters={config["max_iters"]}: a run does not go back. A larger '
                         f'--max_iters trains it on; another --out_dir starts a new run')
    if not ckpts:
        log(f'{out_dir} holds a run without a checkpoint ({"; ".join(what)}): it starts again at '
            f'iteration 0, redoing the same iterations')
    elif at == config['max_iters']:
        log(f'the run in {out_dir} is complete at iteration {at} (max_iters): nothing to train. A larger '
            f'--max_iters trains it on; another --out_dir starts a new run')
    _own(out_dir, master)
    return ckpts, history


def _lock(out_dir):
    # rank 0: create out_dir and take its lock without waiting; the holder's text is written only
    # once the start goes ahead (_own), so a start that stops leaves the file as it was
    global _held
    try:
        os.makedirs(out_dir, exist_ok=True)
        fd = os.open(os.path.join(out_dir, LOCK), os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by exec
    except OSError as e:
        raise SystemExit(f'out_dir {out_dir!r} is not writable: {e}')
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 200, 0).decode(errors='replace').strip() or 'a process'
        os.close(fd)
        raise SystemExit(f'out_dir {out_dir!r} is in use by another run ({holder}): wait for it to '
                         f'end, or use another --out_dir')
    except OSError as e:  # a filesystem without locks (some network mounts)
        print(f'warning: out_dir {out_dir!r} cannot be locked ({e}): nothing stops a second run in it')
    _held = fd


def _own(out_dir, master):
    if master and _held is not None:
        os.ftruncate(_held, 0)
        os.pwrite(_held, f'pid {os.getpid()} on {socket.gethostname()} since '
                         f'{time.strftime("%Y-%m-%d %H:%M:%S")}\n'.encode(), 0)


def _plain(v):
    return json.loads(json.dumps(v))  # as stored in JSON: a tuple is a list


def log_rows(out_dir):
    """metrics.jsonl's rows; a line cut short by a kill mid-write (only the last can be) is left out."""
    path = os.path.join(out_dir, LOG)
    rows = []
    for line in open(path) if os.path.exists(path) else []:
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass
    return rows


class Log:
    """The run's log: rank 0 prints a line of each row, appends the row to out_dir/metrics.jsonl as
    one JSON line (log_rows reads them back), and logs it to wandb where a project is given and
    wandb is installed. A row is an iteration's (with 'reward') or a held-out evaluation's."""

    def __init__(self, out_dir, master, wandb_project='', config=None):
        self.path, self.master, self.wandb = os.path.join(out_dir, LOG), master, None
        if wandb_project and master:
            try:
                import wandb
                wandb.init(project=wandb_project, config=config)
                self.wandb = wandb
            except ImportError:
                print('wandb is not installed: logging to metrics.jsonl only')

    def __call__(self, row):
        if self.master:
            print(self.line(row))
            with open(self.path, 'a') as f:
                f.write(json.dumps(row) + '\n')
            if self.wandb:
                self.wandb.log(row, step=row['iter'])

    @staticmethod
    def line(r):
        if 'reward' not in r:  # a held-out evaluation: every mean
            return (f"eval iter {r['iter']}: " + ' '.join(f'{k[5:]} {v:.4f}' for k, v in r.items() if k.startswith('eval_'))
                    + (f" (beyond their noise: {', '.join(r['watch_flagged'])})" if r.get('watch_flagged') else ''))
        return (f"iter {r['iter']}: reward {r['reward']:.4f} (VQ {r['VQ']:.3f} MQ {r['MQ']:.3f} TA {r['TA']:.3f}) "
                f"std {r['group_std']:.3f} kl {r['kl_pos']:.2e}/{r['kl_vel']:.2e} lam {r['lambda_kl']:.1e} "
                f"gnorm {r['grad_norm']:.3f} time {r['t_rollout']:.1f}/{r['t_reward']:.1f}/{r['t_update']:.1f}s")


def holds(out_dir):
    """What of a run out_dir holds, in words ([] for none): its checkpoints, its log, its eval videos
    (a prompt cache, a config.json or a lock alone are no run: they are rebuilt, or rewritten)."""
    what = []
    ckpts = checkpoint.found(out_dir)
    if ckpts:
        what.append(f'checkpoints {", ".join(ckpts)}')
    rows = log_rows(out_dir)
    if rows:
        what.append(f'metrics.jsonl: {len(rows)} lines up to iteration {max(r["iter"] for r in rows)}')
    videos = os.path.join(out_dir, 'eval')
    n = len([v for v in os.listdir(videos) if v.startswith('iter')]) if os.path.isdir(videos) else 0
    if n:
        what.append(f'{n} eval videos')
    return what


def history_of(out_dir, settings=None):
    """The run's config.json ({"settings", "starts"}); from a checkpoint's settings where there is
    none (or one of a single dict of settings); None where neither says anything."""
    try:
        with open(os.path.join(out_dir, CONFIG)) as f:
            h = json.load(f)
    except (OSError, ValueError):
        h = None
    if isinstance(h, dict) and not ('settings' in h and 'starts' in h):
        h = dict(settings=h, starts=[])
    if h is None and settings is not None:
        h = dict(settings=settings, starts=[])
    return h


def record(out_dir, history, config, iter_num, world, eval_owed=None):
    """Rank 0, once the start has loaded: config.json gains this start (iteration, world size, time,
    the settings changed since the last one), written by rename. history: claim()'s (None: new run).
    eval_owed given (True or False): the log rows and eval videos of iterations after iter_num (a
    crash's) go too (checkpoint.forget_after), so each iteration is logged once."""
    h = history or dict(settings=config, starts=[])
    start = dict(iter=iter_num, world=world, time=time.strftime('%Y-%m-%d %H:%M:%S'))
    changed = {k: [h['settings'].get(k), v] for k, v in config.items()
               if _plain(h['settings'].get(k)) != _plain(v)}
    if changed and history is not None:
        start['changed'] = changed
    if int(os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)):  # a torchrun restart of the worker group
        start['restart'] = int(os.environ['TORCHELASTIC_RESTART_COUNT'])
    path = os.path.join(out_dir, CONFIG)
    with open(path + '.tmp', 'w') as f:
        json.dump(dict(settings=config, starts=h['starts'] + [start]), f, indent=1)
    os.replace(path + '.tmp', path)
    if eval_owed is not None:
        checkpoint.forget_after(out_dir, iter_num, eval_owed)


class Run:
    """The loop's state that outlives a process: the iteration, the optimizer steps, the transformer
    passes by kind (models/policy.count_passes), whether an evaluation is owed (a new run owes the
    base model's; a stop during one owes it again), and `parts`' state_dicts (the lambda controller,
    the alarm). save() writes them with the weights, the optimizers' and the anchor's shards into a
    checkpoint (infra/checkpoint.py; a collective), resume() reads out_dir's newest intact one."""

    def __init__(self, out_dir, keep, model, optimizers, anchor, pass_kinds, fixed, **parts):
        self.out_dir, self.keep, self.model, self.optimizers, self.anchor = (out_dir, keep, model,
                                                                             optimizers, anchor)
        self.fixed, self.parts = fixed, parts  # fixed: saved as given (the config, the world size)
        self.iter_num, self.opt_steps, self.eval_owed = 0, 0, True
        self.passes = dict.fromkeys(pass_kinds, 0)

    def resume(self, ckpts, log=print):
        """The first intact checkpoint of ckpts (claim()'s, newest first) into the model, optimizers,
        anchor, parts and counters; none (a new run): they stay as built."""
        loop = checkpoint.resume(ckpts, self.model, self.optimizers, self.anchor, log=log)
        if not loop:
            return
        self.iter_num, self.opt_steps = loop['iter_num'], loop['opt_steps']
        self.passes.update(loop.get('passes', {}))
        self.eval_owed = loop.get('eval_owed', False)
        for name, part in self.parts.items():  # a part an older checkpoint lacks keeps its state
            if name in loop:
                part.load_state_dict(loop[name])

    def save_if_due(self, it, cadence, preemption, last, halt=False):
        """Checkpoint iteration `it` when due: after the run's first iteration, every save_every
        iterations and save_every_min minutes (cadence), at the last, on a stop request (SIGTERM:
        every rank asks once an iteration) and at halt (a tripped alarm with hack_stop). True: the
        run stops here."""
        stop = preemption.requested(cadence.device)
        if cadence.due(it) or it == last or stop or halt:  # due() first: a collective on every rank
            self.save()
        if stop and (not dist.is_initialized() or dist.get_rank() == 0):
            print(f'preempted: checkpoint of iteration {it} written; the same command continues')
        return stop or halt

    def save(self, eval_owed=False):
        """Collective: each rank writes its shards, rank 0 publishes <out_dir>/ckpt_<iteration>."""
        loop = dict(iter_num=self.iter_num, opt_steps=self.opt_steps, passes=self.passes,
                    eval_owed=eval_owed, **self.fixed,
                    **{name: part.state_dict() for name, part in self.parts.items()})
        path = os.path.join(self.out_dir, f'{checkpoint.PREFIX}{self.iter_num:06d}')
        return checkpoint.save(path, self.model, self.optimizers, self.anchor.state_dict(), loop,
                               self.keep)


class Cadence:
    """When the loop checkpoints, besides the end and a stop: after the run's first iteration (the
    storage path proven at once, not after hours; a resumed start has read a checkpoint already, and
    saves by count and clock), every `every` iterations of the run, and once
    `minutes` of wall-clock time have passed since this start or its last checkpoint (0: by count
    only), so a crash costs at most about `minutes` whatever an iteration takes. due(it) is a
    collective where minutes > 0: the ranks' elapsed times are reduced to their maximum, so every
    rank decides the same (each reads its own clock; a rank that saves alone would wait forever in
    the save's collectives). A due checkpoint starts the clock again (the save's own time counts in
    the next interval)."""

    def __init__(self, every, minutes, device, clock=None):
        self.every, self.minutes, self.device = every, minutes, device
        self.clock = clock or time.time
        self.last = self.clock()

    def due(self, it):
        """Whether the checkpoint of iteration `it` (just finished) is due by count or by time."""
        due = it == 1 or bool(self.every and it % self.every == 0)
        if self.minutes > 0:  # every rank enters the reduction, whatever its count says
            elapsed = torch.tensor([self.clock() - self.last], dtype=torch.float64, device=self.device)
            if dist.is_initialized():
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            due = due or elapsed.item() >= 60 * self.minutes
        if due:
            self.last = self.clock()
        return due

