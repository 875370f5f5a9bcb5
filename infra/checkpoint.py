"""
Training state that scales with the model: sharded checkpoints with torch.distributed.checkpoint
(DCP), read through infra/dcp_reader.py; models/export.py turns one into a diffusers transformer directory.

    <out_dir>/ckpt_000050/            one checkpoint = one DCP directory
        __0_0.distcp, __1_0.distcp    each rank's own shards: trainable weights, optimizer state, anchor
        .metadata                     DCP's index of the shards (which rank wrote which slice)
        loop.json                     iteration, optimizer steps, lambda_KL controller, optimizer
                                      hyperparameters, config, and every rank's files' sizes and crc32
    <out_dir>/latest                  the name of the newest published checkpoint
    (the keep_checkpoints newest by iteration stay, the one just published always among them)

    save(f'{out_dir}/ckpt_000050', model, optimizers, anchor.state_dict(), loop)   # collective
    loop = resume(candidates(out_dir), model, optimizers, anchor)   # collective: newest intact one

A save is a collective: every rank writes only its own shards (DCP stages one tensor at a time) and
reports their names, sizes and crc32; rank 0 verifies that it sees all of them, then writes
loop.json, renames the temporary directory into place and updates `latest` (atomic rename): a crash
at any moment leaves the last published checkpoint intact, and a shard rank 0 cannot see (a node
writing to a disk of its own) stops the run instead of publishing a checkpoint without it. No rank
waits in a collective on another's slow I/O: each rank writes and re-reads (crc32) only its own files,
all at once; rank 0's deletes (the rotation, a dead save's leftovers: 133 GB a checkpoint at 8.3B) are a
rename, then a background thread, after the last barrier. A load builds
and shards the policy first and reads into it, each rank only its slices, so a checkpoint saved on
N ranks resumes on M (DCP reshards). Seeds need no state: every random draw of train.py is a
function of (seed, iteration, clip), so the iteration number is the whole RNG state.

Where this differs from a plain dcp.save of everything, and why:
- only the trainable weights are saved (the frozen base of a LoRA run, and the toy's dead ByT5
  projection, come from the base model): an 8.3B LoRA checkpoint is megabytes.
- non-tensor state (optimizer hyperparameters, the controller) goes to loop.json, not into DCP,
  which would pickle it and unpickle it with weights_only=False; DCP's own .metadata index is read
  with an unpickler that admits only DCP's metadata classes (infra/dcp_reader.py).
- a weight that never got a gradient has no AdamW state in the saved run, but the load template
  has one (the state is initialised with a zero-gradient, zero-lr step, one parameter at a time);
  it is left as initialised: a weight without gradient is never updated, so resume stays bitwise
  exact.

Tested by: python -m pytest tests/test_checkpoint.py tests/test_train.py (infra/preemption.py: tests/test_preemption.py)
"""
import contextlib
import json
import os
import pickle
import secrets
import shutil
import sys
import threading
import zlib

import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, \
    get_optimizer_state_dict, set_model_state_dict, set_optimizer_state_dict

from infra.dcp_reader import Planner, Reader  # DCP's reader, without pickle's reach
from infra.parallel import reshard  # FSDP2's kept-gathered root weights, sharded back

# DCP works without a process group too (one process); it warns that it assumes so
warnings.filterwarnings('ignore', message='torch.distributed is disabled, unavailable or uninitialized')

LOOP = 'loop.json'              # the small state beside the shards
PREFIX = 'ckpt_'                # checkpoint directories are PREFIX + iteration, zero-padded
PINNED = 'pinned'               # a file in a checkpoint that no rotation removes (pin); it says why
DISCARDED = '.deleting'         # suffix of a directory on its way out: renamed, then deleted in the background


def _master():
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def _trainable_weights(model):
    # name -> tensor of the weights the optimizer moves (sharded DTensors under FSDP2, sharing
    # storage with the parameters): dcp.save writes them and dcp.load reads into them in place
    reshard(model)
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    return {k: v for k, v in get_model_state_dict(model).items() if k in names}


def _init_state(optimizers):
    # the optimizer state to load into, one parameter at a time: a zero-gradient, zero-lr step of
    # a one-parameter copy of its optimizer (any torch.optim class: AdamW, Muon, ...). DCP's own
    # initialisation steps all parameters at once, a whole model's gradients in flight.
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group['params']:
                if p in opt.state or not p.requires_grad:
                    continue
                one = type(opt)([{**group, 'params': [p], 'lr': 0.0}])
                p.grad = torch.zeros_like(p)
                one.step()  # lr 0: the weight is unchanged, bitwise
                p.grad = None
                opt.state[p] = one.state[p]


def _tensor_state(model, optimizers):
    # the optimizer's tensors, keyed by parameter name (not id): they reshard across world sizes.
    # optimizers: one or a list (e.g. Muon for matrices + AdamW for the rest): one combined dict
    reshard(model)
    osd = get_optimizer_state_dict(model, optimizers)
    return osd['state'], osd['param_groups']


def save(path, model, optimizers, anchor_state, loop, keep=2):
    """Collective: write checkpoint directory `path` (<out_dir>/ckpt_NNNNNN) and publish it; returns
    path. anchor_state: name -> tensor (Anchor.state_dict()); loop: JSON-able small state.
    Published only once rank 0 has verified every rank's shards: each rank reports the files it wrote
    (DCP's write results, not a directory listing) with their sizes and crc32, rank 0 finds each of
    them by name at the reported size and checks that they are every file DCP's .metadata refers to;
    else every rank stops with one line, removing what it wrote, and the last published checkpoint
    stays. A path this process already published or resumed from holds this very state (a preemption
    right after a save or a resume: nothing has stepped since, see infra/preemption.py): it is not rewritten
    (its loop.json may owe an evaluation that has run since: it runs again, logged once)."""
    out_dir, name = os.path.split(os.path.abspath(path))
    if os.path.join(out_dir, name) in _published:  # the same on every rank: no collective needed
        return path
    tmp = os.path.join(out_dir, name + '.tmp')
    if _master():
        os.makedirs(out_dir, exist_ok=True)
        for d in os.listdir(out_dir):  # saves that died before publishing (a rank died or hung mid-save),
            if d.startswith(PREFIX) and d.endswith('.tmp'):  # deletes a killed process left unfinished
                _discard(os.path.join(out_dir, d))
            elif d.startswith(PREFIX) and d.endswith(DISCARDED):
                _discard(os.path.join(out_dir, d), rename=False)
        os.makedirs(tmp)
    _barrier()
    opts = optimizers if isinstance(optimizers, (list, tuple)) else [optimizers]
    fresh = not any(o.state for o in opts)  # before the first optimizer step: no state to save (DCP
    # would make some with a zero-lr step, and a resumed AdamW would count one step too many)
    optim_state, groups = ({}, []) if fresh else _tensor_state(model, optimizers)
    writer = _Writer(tmp)  # every rank writes __<rank>_0.distcp; rank 0 also .metadata
    md = dcp.save({'model': _trainable_weights(model), 'optim': optim_state, 'anchor': dict(anchor_state)},
                  storage_writer=writer)
    mine = writer.written + ['.metadata'] * _master()
    mine = {f: [os.path.getsize(os.path.join(tmp, f)), _crc(os.path.join(tmp, f))] for f in mine}
    world = dist.get_world_size() if dist.is_initialized() else 1
    files = {f: v for part in _merge(mine, world) for f, v in part.items()}  # every rank's, by a collective
    why = _unverified(tmp, files, md) if _master() else None
    if dist.is_initialized():
        box = [why]
        dist.broadcast_object_list(box)  # rank 0's verdict, on every rank
        why = box[0]
    if why:
        for f in mine:  # what this rank wrote, in its own view of out_dir (a node's own disk, say)
            with contextlib.suppress(OSError):
                os.remove(os.path.join(tmp, f))
        with contextlib.suppress(OSError):
            os.rmdir(tmp)  # empty on a disk of this node's own; rank 0's is removed below
        if _master():
            shutil.rmtree(tmp, ignore_errors=True)
        raise SystemExit(f'checkpoint {path} not published: {why} (out_dir must be on a filesystem all '
                         'nodes share); the last published checkpoint is intact')
    if _master():
        with open(os.path.join(tmp, LOOP), 'w') as f:
            json.dump(dict(loop, param_groups=groups, files=files, optimizer_state=not fresh), f, indent=1)
        if os.path.exists(path):
            _discard(path)  # a damaged checkpoint of the same iteration
        os.replace(tmp, path)
        with open(os.path.join(out_dir, 'latest.tmp'), 'w') as f:
            f.write(name)
        os.replace(os.path.join(out_dir, 'latest.tmp'), os.path.join(out_dir, 'latest'))
    _barrier()  # every rank returns once the checkpoint is published
    if _master():
        # rotation by iteration among those up to this one, which stays (so `latest` names one
        # that exists); a later one (damaged: the run resumed before it) stays until its
        # iteration is saved again. After the barrier, and deleted in the background: no rank waits
        # in a collective while rank 0 deletes 133 GB at 8.3B
        older = [d for d in found(out_dir) if _iteration(d) < _iteration(name)
                 and not os.path.exists(os.path.join(out_dir, d, PINNED))]
        for d in older[:max(0, len(older) - (keep - 1))]:
            _discard(os.path.join(out_dir, d))
    _published.add(os.path.join(out_dir, name))
    return path


_deletes = {}  # directory -> the thread deleting it, of this process (which waits for them at its exit)


def _discard(path, rename=True):
    # rank 0: the directory out of every listing at once (a rename, atomic), then deleted by a thread of
    # its own; one that a killed process left half-deleted is found by its suffix at the next save
    for done in [d for d, t in _deletes.items() if not t.is_alive()]:
        del _deletes[done]
    if path in _deletes:
        return  # this process is deleting it already
    gone = f'{path}.{secrets.token_hex(4)}{DISCARDED}' if rename else path
    if rename:
        os.replace(path, gone)
    _deletes[gone] = threading.Thread(target=shutil.rmtree, args=(gone,), kwargs=dict(ignore_errors=True))
    _deletes[gone].start()


def finish_deletes():
    """Wait for this process's background deletes (tests; a process waits for them at its exit anyway)."""
    while _deletes:
        _deletes.popitem()[1].join()


class _Writer(dcp.FileSystemWriter):
    # DCP's file writer, remembering the files this rank wrote data to (its write results)
    def write_data(self, plan, planner):
        fut = super().write_data(plan, planner)  # done when it returns: the writes are synchronous
        self.written = sorted({r.storage_data.relative_path for r in fut.wait()})
        return fut


def _referenced(md):
    # the data files DCP's .metadata points into (a rank with nothing to write points nowhere)
    return {s.relative_path for s in md.storage_data.values()}


def _unverified(tmp, files, md):
    # rank 0: None if every file a rank reported is in rank 0's view of tmp at its size and they are
    # all the files .metadata refers to; else why not (one line)
    unreported = sorted(_referenced(md) - set(files))
    if unreported:
        return f'no rank reported writing {unreported[0]}'
    for f, (size, _) in sorted(files.items()):
        try:
            seen = os.path.getsize(os.path.join(tmp, f))  # by name: a listing can be stale
        except OSError:
            return f'{f} (written by rank {_writer_rank(f)}) is not in rank 0\'s {tmp}'
        if seen != size:
            return f'{f} is {seen} bytes in rank 0\'s view, {size} were written'
    return None


def _writer_rank(f):
    return f[2:].split('_')[0] if f.startswith('__') else '0'  # DCP's names: __<rank>_<n>.distcp


_published = set()  # checkpoint paths this process wrote or resumed from (see save)


def pin(out_dir, iteration, why):
    """Rank 0: keep the newest checkpoint of out_dir at or before `iteration` through every rotation (a
    file PINNED in it says why); its name, or None if there is none."""
    ckpts = [d for d in found(out_dir) if iteration is not None and _iteration(d) <= iteration]
    if not ckpts:
        return None
    with open(os.path.join(out_dir, ckpts[-1], PINNED), 'w') as f:
        f.write(why + '\n')
    return ckpts[-1]


def _is_ckpt(d):
    return d.startswith(PREFIX) and d[len(PREFIX):].isdigit()  # not a save's .tmp directory


def _iteration(d):
    return int(d[len(PREFIX):])


def found(out_dir):
    """The checkpoint directories of out_dir by iteration, oldest first (by name 1000000 < 999999)."""
    names = os.listdir(out_dir) if os.path.isdir(out_dir) else []
    return sorted((d for d in names if _is_ckpt(d)), key=_iteration)


def _crc(path):
    crc = 0
    with open(path, 'rb') as f:
        while block := f.read(1 << 24):
            crc = zlib.crc32(block, crc)
    return crc


def _share(names, collective=True):
    # this rank's share of a list of files, and a way to merge every rank's findings
    collective = collective and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if collective else (0, 1)
    return sorted(names)[rank::world], world


def _merge(part, world):
    if world == 1:
        return [part]
    parts = [None] * world
    dist.all_gather_object(parts, part)
    return parts


def damage(path, collective=True):
    """None if `path` is an intact checkpoint, else why not (one line): every file DCP's .metadata
    points into is listed in loop.json, and every listed file (all ranks' shards) has its size and
    crc32. Collective under torchrun (unless collective=False): each file is read once, by one rank
    (1/N of the reading each)."""
    try:
        with open(os.path.join(path, LOOP)) as f:
            files = json.load(f)['files']
    except FileNotFoundError:
        return f'no {LOOP}'
    except (OSError, ValueError, KeyError) as e:
        return f'{LOOP} unreadable ({e})'
    try:  # every file DCP's index points into must be listed (and so checked) in loop.json
        unlisted = sorted(_referenced(Reader(path).read_metadata()) - set(files))
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError) as e:
        return f'.metadata unreadable ({type(e).__name__})'
    if unlisted:
        return f'{unlisted[0]} is not listed in {LOOP}'
    mine, world = _share(files, collective)
    why = None
    for f in mine:
        p, (size, crc) = os.path.join(path, f), files[f]
        if not os.path.exists(p):
            why = f'{f} is missing'
        elif os.path.getsize(p) != size:
            why = f'{f} is {os.path.getsize(p)} bytes, {size} were written'
        elif _crc(p) != crc:
            why = f'{f} has changed since it was written (crc32)'
        if why:
            break
    return next((w for w in _merge(why, world) if w), None)


def candidates(out_dir, log=print, collective=True):
    """Checkpoints of out_dir to resume from, newest first, the first one verified intact; says
    which ones are skipped and why. Collective under torchrun (see damage)."""
    names = found(out_dir)[::-1]
    latest = os.path.join(out_dir, 'latest')
    if os.path.exists(latest):
        with open(latest) as f:
            named = f.read().strip()
        if named not in names:
            log(f'warning: {latest} names {named}, which is gone')
    good = []
    for i, d in enumerate(names):  # verified newest first, up to the first intact one; the older
        why = damage(os.path.join(out_dir, d), collective)  # ones stay as fallbacks should its load fail
        if why:
            log(f'warning: checkpoint {os.path.join(out_dir, d)} is damaged ({why}): skipped')
        else:
            good = [os.path.join(out_dir, d) for d in names[i:]]
            break
    if not good:
        raise SystemExit(f'{out_dir!r} has no intact checkpoint to resume from'
                         + (f' (found {", ".join(names)})' if names else ''))
    return good


def read_loop(path):
    with open(os.path.join(path, LOOP)) as f:
        return json.load(f)


def _load(path, state, no_dist=False):
    reader = Reader(path)
    saved = set(reader.read_metadata().state_dict_metadata)
    need = {f'{top}.{k}' for top in ('model', 'anchor') for k in state.get(top, {})}
    if need - saved:
        raise ValueError(f'does not match the model: {sorted(need - saved)[:3]} not in it')
    # optimizer: a weight that never got a gradient has no state in the file (see the docstring)
    dcp.load(state, storage_reader=reader, planner=Planner(allow_partial_load=True), no_dist=no_dist)


def load(path, model, optimizers, anchor):
    """Collective: read checkpoint `path` into the (already built and sharded) model, its
    optimizer(s) and the anchor; returns the loop state (loop.json)."""
    loop = read_loop(path)
    weights = _trainable_weights(model)
    if not loop.get('optimizer_state', True):  # saved before the first optimizer step (a preemption):
        _load(path, {'model': weights, 'anchor': anchor.state_dict()})  # the optimizers stay as built
        set_model_state_dict(model, weights, options=StateDictOptions(strict=False))
        _published.add(os.path.abspath(path))
        return loop
    _init_state(optimizers if isinstance(optimizers, (list, tuple)) else [optimizers])
    optim_state, _ = _tensor_state(model, optimizers)  # the tensors to load into
    _load(path, {'model': weights, 'optim': optim_state, 'anchor': anchor.state_dict()})
    set_model_state_dict(model, weights, options=StateDictOptions(strict=False))
    set_optimizer_state_dict(model, optimizers, {'state': optim_state, 'param_groups': loop['param_groups']},
                             options=StateDictOptions(strict=False))
    _published.add(os.path.abspath(path))
    return loop


def resume(ckpts, model, optimizers, anchor, log=print):
    """Collective: load the first of ckpts (candidates(), newest first) that loads into the built and
    sharded model, optimizers and anchor; a damaged one is named and the next one tried (it overwrites
    whatever the damaged one had loaded). Returns its loop state, or None for an empty ckpts."""
    for i, ckpt in enumerate(ckpts):
        try:
            loop = load(ckpt, model, optimizers, anchor)
        except Exception as e:  # a damaged shard
            if i + 1 == len(ckpts):
                raise SystemExit(f'cannot resume from {ckpt}: {type(e).__name__}: {str(e)[:300]}')
            log(f'warning: checkpoint {ckpt} is damaged ({type(e).__name__}): falling back to {ckpts[i + 1]}')
            continue
        log(f'resumed from {ckpt} at iteration {loop["iter_num"]}' + (' (the newest intact checkpoint)' if i else ''))
        return loop
    return None


def load_weights(path, model):
    """The trained weights of checkpoint `path` into a plain (unsharded) model, in one process."""
    weights = _trainable_weights(model)
    _load(path, {'model': weights}, no_dist=True)  # this process alone, even under torchrun
    model.load_state_dict(weights, strict=False)
    return model


def read_tensors(path, part='model'):
    """{name: tensor} of one part ('model', 'optim', 'anchor') of a checkpoint, in one process,
    without a model to load into (built from DCP's index): for tests and inspection."""
    md = Reader(path).read_metadata().state_dict_metadata
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in md.items() if k.startswith(part + '.')}
    dcp.load(state, storage_reader=Reader(path), planner=Planner(), no_dist=True)
    return {k[len(part) + 1:]: v for k, v in state.items()}


def forget_after(out_dir, iter_num, eval_owed=False):
    """On (re)start at iteration iter_num: drop the metrics.jsonl lines and eval videos of later
    iterations (they will run again), so that a crash leaves each iteration logged once; with
    eval_owed (a preemption cut iteration iter_num's evaluation short), its evaluation's too."""
    log = os.path.join(out_dir, 'metrics.jsonl')
    if os.path.exists(log):
        with open(log) as f:
            lines = f.readlines()
        kept = [l for l in lines if _kept(l, iter_num, eval_owed)]
        if len(kept) < len(lines):
            with open(log + '.tmp', 'w') as f:
                f.writelines(kept)
            os.replace(log + '.tmp', log)
    videos = os.path.join(out_dir, 'eval')
    for v in os.listdir(videos) if os.path.isdir(videos) else []:
        if v.startswith('iter') and int(v[4:10]) >= iter_num + (not eval_owed):  # iter000123_4.mp4
            os.remove(os.path.join(videos, v))


def _kept(line, iter_num, eval_owed):
    try:
        row = json.loads(line)
    except ValueError:  # cut short by a kill mid-write: that row runs again
        return False
    return row['iter'] < iter_num or row['iter'] == iter_num and not (eval_owed and 'reward' not in row)


def resolve(path):
    """A checkpoint directory: the one given, or the newest intact one of a train.py out_dir."""
    if os.path.isfile(os.path.join(path, LOOP)):
        return path
    return candidates(path, log=lambda m: print(m, file=sys.stderr), collective=False)[0]  # this process alone
