"""
Training state that survives interruption (checkpoint.py, dcp_reader.py, export.py, prompt_cache.py,
train.py's signal and resume code), tested as a user meets it: real signals on running toy runs, then
resume (train.py's own launches; the resumes that train nothing run it in this process,
test_train.train_in_process).
- SIGTERM on one process: the last finished iteration is checkpointed, exit 0; a second SIGTERM
  exits at once and the last checkpoint stays intact (bytes and mtimes); kill -9 then resume leaves
  each iteration in metrics.jsonl once and no eval videos of lost iterations; the resumed run's
  weights are bitwise those of an uninterrupted run.
- SIGTERM on torchrun (2 ranks): every rank stops after the same iteration; the checkpoint has one
  shard file per rank; it resumes in one process and back on 2 ranks (DCP reshards).
- a damaged newest checkpoint (other bytes, or truncated) and a `latest` naming a gone one are
  named and skipped.
- the export (bf16) loads with diffusers' from_pretrained and gives the policy's velocity (the
  fp32, LoRA and HunyuanVideo-pipeline checks are in test_train.py).
- the prompt cache reads back what was encoded, from memory-mapped shards, and is rebuilt, not
  read, for another model's text encoder;
- a crafted .metadata is refused by every reader of a checkpoint (the unpickler in use).
"""
import io
import json
import os
import pickle
import signal
import subprocess
import sys
import time

import pytest
import torch

from test_train import ROOT, SMALL, check_run, export_matches_policy, metrics, run, run_here, train_in_process, weights

from infra import checkpoint
from infra import dcp_reader
from models import export


def start(args, out, torchrun=False):
    env = dict(os.environ, OMP_NUM_THREADS='1', TOKENIZERS_PARALLELISM='false')
    launcher = [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2'] \
        if torchrun else [sys.executable]
    os.makedirs(out, exist_ok=True)
    log = open(os.path.join(out, 'stdout.txt'), 'w')
    return subprocess.Popen(launcher + args, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def wait_for(cond, p, timeout=240):
    t0 = time.time()
    while not cond():
        assert p.poll() is None, f'process ended early ({p.returncode})'
        assert time.time() - t0 < timeout, 'timed out'
        time.sleep(0.1)


def logged(out):
    # iterations logged so far (metrics.jsonl may be half-written while we look)
    try:
        return [json.loads(l)['iter'] for l in open(os.path.join(out, 'metrics.jsonl')) if l.endswith('\n')]
    except (FileNotFoundError, ValueError):
        return []


def stdout(out):
    return open(os.path.join(out, 'stdout.txt')).read()


def newest(out):
    return open(os.path.join(out, 'latest')).read().strip()


def files_of(path):
    """Every file's bytes and mtime: a rewrite with the same sizes (or the same bytes) shows."""
    return {f: (open(os.path.join(path, f), 'rb').read(), os.stat(os.path.join(path, f)).st_mtime_ns)
            for f in os.listdir(path)}


ARGS = SMALL + ['--max_iters=4', '--eval_every=1']  # an eval (and a video) every iteration


def test_sigterm_kill9_and_resume_are_exact_one_process(tmp_path, monkeypatch, capsys):
    ref, out = str(tmp_path / 'ref'), str(tmp_path / 'run')
    run_here(monkeypatch, ARGS + [f'--out_dir={ref}'])  # the uninterrupted run, in this process
    # 1. SIGTERM once iteration 1 is logged: the last finished iteration's checkpoint, exit 0
    p = start(ARGS + [f'--out_dir={out}', '--save_every=0'], out)
    wait_for(lambda: 1 in logged(out), p)
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=120) == 0, stdout(out)[-3000:]
    k = max(logged(out))
    assert 'preempted' in stdout(out) and newest(out) == f'ckpt_{k:06d}' and k < 4
    # 2. kill -9 after an iteration past the checkpoint was logged, and its eval video written
    p = start(ARGS + [f'--out_dir={out}', '--init_from=resume', '--save_every=0'], out)
    wait_for(lambda: k + 1 in logged(out) and any(f.startswith(f'iter{k + 1:06d}') for f in os.listdir(f'{out}/eval')), p)
    p.kill()
    p.wait()
    # 3. resume with nothing left to do: the log and the eval videos are back at iteration k (in this
    # process, train_in_process: train.py up to its loop, which has nothing to do)
    assert train_in_process(monkeypatch, ARGS + [f'--out_dir={out}', '--init_from=resume', f'--max_iters={k}',
                                                 '--export_dtype=']) is None
    assert sorted(logged(out)) == [0] + sorted(list(range(1, k + 1)) * 2)  # the base model eval, then train + eval rows
    assert all(int(f[4:10]) <= k for f in os.listdir(f'{out}/eval'))
    # 4. two SIGTERMs: out at once (128 + 15), the published checkpoint untouched. The first alone stops
    # at the next forward (preemption.py), which may come before the second arrives: then exit 0 with
    # nothing rewritten (it resumed from that very checkpoint); test_preemption.py pins the 143 path
    before = files_of(os.path.join(out, newest(out)))
    p = start(ARGS + [f'--out_dir={out}', '--init_from=resume', '--save_every=1'], out)
    wait_for(lambda: 'resumed from' in stdout(out), p)
    p.send_signal(signal.SIGTERM)
    wait_for(lambda: 'rank 0: SIGTERM' in stdout(out) or p.poll() is not None, p)  # two at once would arrive as one
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=60) in (0, 128 + signal.SIGTERM)
    assert checkpoint.damage(os.path.join(out, newest(out))) is None
    assert before == files_of(os.path.join(out, newest(out)))  # not rewritten: bytes and mtimes
    # 5. resume to the end: bitwise the uninterrupted run, each iteration logged once
    run_here(monkeypatch, ARGS + [f'--out_dir={out}', '--init_from=resume'])
    check_run(out, 4)
    wa, wb = weights(ref), weights(out)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[key], wb[key]) for key in wa)
    assert [r['iter'] for r in metrics(out)] == [r['iter'] for r in metrics(ref)]
    assert [r['lambda_kl'] for r in metrics(out) if 'reward' in r] == [r['lambda_kl'] for r in metrics(ref) if 'reward' in r]
    # 6. damaged newest checkpoint and a `latest` naming a gone one: named, skipped, the next one used
    checkpoint.finish_deletes()  # the rotated-out one, renamed *.deleting, deleted in this process's background
    ck = sorted(d for d in os.listdir(out) if d.startswith('ckpt_') and not d.endswith('.tmp'))
    assert len(ck) == 2  # keep_checkpoints
    shard = os.path.join(out, ck[-1], '__0_0.distcp')
    with open(shard, 'r+b') as f:  # silent corruption: same size, other bytes
        f.seek(os.path.getsize(shard) // 2)
        f.write(b'\0' * 4096)
    with open(os.path.join(out, 'latest'), 'w') as f:
        f.write('ckpt_000099')
    capsys.readouterr()
    assert train_in_process(monkeypatch, ARGS + [f'--out_dir={out}', '--init_from=resume']) is None  # (this process)
    said = capsys.readouterr().out
    assert 'names ckpt_000099, which is gone' in said
    assert f'{ck[-1]} is damaged (__0_0.distcp has changed since it was written' in said
    assert f'resumed from {os.path.join(out, ck[0])}' in said
    with open(shard, 'r+b') as f:  # truncated
        f.truncate(os.path.getsize(shard) // 2)
    assert checkpoint.damage(os.path.join(out, ck[-1])).startswith('__0_0.distcp is ')
    assert checkpoint.damage(os.path.join(out, ck[0])) is None
    # nothing intact at all: one clear line
    with open(os.path.join(out, ck[0], 'loop.json'), 'w') as f:
        f.write('{')
    said = train_in_process(monkeypatch, ARGS + [f'--out_dir={out}', '--init_from=resume'])
    assert said.startswith(f'{out!r} has no intact checkpoint to resume from'), said


@pytest.mark.slow  # .ci/run's slow tier: the README's command stays under 10 minutes
def test_sigterm_two_ranks_and_resume_across_world_sizes(tmp_path, monkeypatch):
    out = str(tmp_path / 'fsdp')
    p = start(ARGS + [f'--out_dir={out}', '--save_every=0', '--eval_every=0'], out, torchrun=True)
    wait_for(lambda: 1 in logged(out), p)
    p.send_signal(signal.SIGTERM)  # torchrun forwards it to both workers
    p.wait(timeout=120)
    k = max(logged(out))
    log = stdout(out)
    assert 'rank 0: SIGTERM' in log and 'rank 1: SIGTERM' in log and 'preempted' in log and k < 4
    files = sorted(os.listdir(os.path.join(out, newest(out))))
    assert files == ['.metadata', '__0_0.distcp', '__1_0.distcp', 'loop.json']  # one shard file per rank
    assert checkpoint.read_loop(os.path.join(out, newest(out)))['world'] == 2
    # 2 ranks -> 1 process -> 2 ranks
    run_here(monkeypatch, ARGS + [f'--out_dir={out}', '--init_from=resume', f'--max_iters={k + 1}', '--eval_every=0',
                                  '--save_every=1'])
    assert checkpoint.read_loop(os.path.join(out, newest(out)))['world'] == 1
    run(ARGS + [f'--out_dir={out}', '--init_from=resume', '--eval_every=0'], torchrun=True)
    check_run(out, 4)
    # the exported diffusers model (bf16) is the checkpoint's policy
    from diffusers import HunyuanVideo15Transformer3DModel as T
    export_matches_policy(T.from_pretrained(os.path.join(out, 'export')), out, 'assets/toy', tol=2e-2)


def test_prompt_cache_reads_back_what_was_encoded(tmp_path):
    from models import policy as M
    from infra import prompt_cache
    from models import toy
    prompts = toy.all_prompts()[:10] + ['']
    path = prompt_cache.build(str(tmp_path / 'pc'), toy.DIR, prompts[:6], M.encode_prompts, chunk=4)  # two shards
    path = prompt_cache.build(path, toy.DIR, prompts, M.encode_prompts, chunk=4)                      # extended: +2 shards
    cache, ref = prompt_cache.PromptCache(path), M.encode_prompts(toy.DIR, prompts)
    assert len(cache) == len(prompts) and len([f for f in os.listdir(path) if f.endswith('.safetensors')]) == 4
    for p in prompts:
        assert all(torch.equal(a, b) for a, b in zip(cache[p], ref[p]))


def test_prompt_cache_rebuilt_for_another_text_encoder(tmp_path):
    """An out_dir's cache holds one model's embeddings: built for the toy, then asked for another model
    (the toy with another text table: another text encoder) and fewer prompts, it serves that
    encoder's embeddings of those prompts and nothing of the toy's (a prompt not asked for again is
    gone, not served stale); a model whose encoder fails on the first chunk leaves the cache as it
    was; back to the toy, the toy's again. The reference is model.encode_prompts of each model.
    Fails if the cache is keyed by prompt only (the toy's embeddings would be read for the other)."""
    import shutil
    from models import policy as M
    from infra import prompt_cache
    from models import toy
    from safetensors.torch import load_file, save_file
    other = tmp_path / 'other'  # the toy, but another text table (shared transformer)
    other.mkdir()
    shutil.copy(os.path.join(toy.DIR, 'model_index.json'), other)
    os.symlink(os.path.abspath(os.path.join(toy.DIR, 'transformer')), other / 'transformer')
    table = load_file(os.path.join(toy.DIR, 'text_embeddings.safetensors'))['embeddings']
    save_file({'embeddings': torch.randn(table.shape, generator=torch.Generator().manual_seed(0))},
              str(other / 'text_embeddings.safetensors'))
    prompts, path = toy.all_prompts()[:9] + [''], str(tmp_path / 'pc')

    def shards():
        return sorted(f for f in os.listdir(path) if f.endswith('.safetensors'))

    def holds(model, asked):
        cache, want = prompt_cache.PromptCache(path), M.encode_prompts(model, asked)
        assert len(cache) == len(asked) and all(p in cache for p in asked)
        return all(torch.equal(a, b) for p in asked for a, b in zip(cache[p], want[p]))

    prompt_cache.build(path, toy.DIR, prompts, M.encode_prompts, chunk=4)
    assert holds(toy.DIR, prompts) and len(shards()) == 3
    toy_embeds = M.encode_prompts(toy.DIR, prompts)
    prompt_cache.build(path, str(other), prompts[:5], M.encode_prompts, chunk=4)  # another model, fewer prompts
    assert holds(str(other), prompts[:5]) and len(shards()) == 2  # the toy's shards are gone
    cache = prompt_cache.PromptCache(path)
    assert not any(torch.equal(cache[p][0], toy_embeds[p][0]) for p in prompts[:5] if p)  # not the toy's
    with pytest.raises(KeyError):
        cache[prompts[7]]  # the toy's, not asked for again: not served
    with pytest.raises(SystemExit, match="'purple' not in the toy vocabulary"):  # fails on the first chunk
        prompt_cache.build(path, toy.DIR, ['a purple circle moving left'], M.encode_prompts)
    assert holds(str(other), prompts[:5]) and len(shards()) == 2  # as it was
    prompt_cache.build(path, toy.DIR, prompts, M.encode_prompts, chunk=4)
    assert holds(toy.DIR, prompts) and len(shards()) == 3


def _call(module, name, *args):
    """Pickle bytes that call module.name(*args) when loaded (STACK_GLOBAL + REDUCE), written by
    hand: pickle itself would never name a function through another module."""
    text = lambda s: b'\x8c' + bytes([len(s.encode())]) + s.encode()  # SHORT_BINUNICODE
    return b'\x80\x04' + text(module) + text(name) + b'\x93' + pickle.dumps(args, protocol=2)[2:-1] + b'R.'


def test_metadata_unpickler_admits_dcp_metadata_and_nothing_else(tmp_path):
    """DCP's .metadata is read with an allowlist of exact (module, name) pairs: crafted payloads
    that would run code are refused before anything runs (os.system reached through a module DCP
    imports, a dotted name, builtins.eval, getattr on a class that is not one of DCP's enums); a
    real checkpoint still loads; Python 3.11.2's getattr(EnumClass, 'NAME') for DCP's own enum
    members is admitted. The payloads are checked to run under plain pickle first."""
    from collections import OrderedDict
    from pathlib import PosixPath
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING as E

    def marker(i):
        return str(tmp_path / f'ran{i}')

    payloads = [
        _call('torch.distributed.checkpoint.filesystem', 'os.system', f'touch {marker(0)}'),
        _call('torch.distributed.checkpoint.filesystem', 'os.makedirs', marker(1)),
        _call('torch.distributed.checkpoint.metadata', 'os.makedirs', marker(2)),
        _call('torch', 'os.makedirs', marker(3)),
        _call('builtins', 'eval', f'__import__("os").makedirs({marker(4)!r})'),
        _call('builtins', 'exec', f'__import__("os").makedirs({marker(5)!r})'),
    ]
    for i, p in enumerate(payloads):  # the payload is real: plain pickle runs it
        pickle.loads(p)
        assert os.path.exists(marker(i)), i
        os.system(f'rm -rf {marker(i)}')
    for i, p in enumerate(payloads):
        with pytest.raises(pickle.UnpicklingError):
            dcp_reader.SafeUnpickler(io.BytesIO(p)).load()
        assert not os.path.exists(marker(i)), f'payload {i} ran'

    class Ref:  # pickles as getattr(cls, name), the way Python 3.11.2 pickles an enum member
        def __init__(self, cls, name):
            self.cls, self.name = cls, name

        def __reduce__(self):
            return getattr, (self.cls, self.name)

    # getattr(PosixPath, 'touch')(PosixPath(marker)): a method of an admitted class
    text = lambda s: b'\x8c' + bytes([len(s.encode())]) + s.encode()
    path_cls = text(PosixPath.__module__) + text('PosixPath') + b'\x93'
    touch = (b'\x80\x04' + text('builtins') + text('getattr') + b'\x93' + path_cls + text('touch') + b'\x86R'
             + path_cls + text(marker(6)) + b'\x85R' + b'\x85R.')

    member = E.TORCH_CONTIGUOUS_FORMAT
    assert dcp_reader.SafeUnpickler(io.BytesIO(pickle.dumps(Ref(E, member.name)))).load() is member
    for bad in [pickle.dumps(Ref(OrderedDict, 'fromkeys')), pickle.dumps(Ref(E, 'mro')), touch]:
        with pytest.raises(pickle.UnpicklingError):
            dcp_reader.SafeUnpickler(io.BytesIO(bad)).load()
    assert not os.path.exists(marker(6))
    pickle.loads(touch)
    assert os.path.exists(marker(6))  # plain pickle runs it
    # a real checkpoint: model, Muon and AdamW state, anchor
    from models import toy  # noqa: F401  (plugs the toy world into model.py)
    from models.policy import load_policy
    from infra.optimizer import build
    from infra.anchor import Anchor
    policy = load_policy('assets/toy', 'cpu')
    opts = build(policy, 'muon', 1e-4, 0.01)
    for p in policy.parameters():
        p.grad = torch.randn_like(p) if p.requires_grad else None
    for o in opts:
        o.step()
    path = str(tmp_path / 'ckpt_000001')
    checkpoint.save(path, policy, opts, Anchor(policy, 'dual', every=10).state_dict(), dict(iter_num=1))
    w = checkpoint.read_tensors(path)
    assert w and all(torch.equal(w[n], p.detach()) for n, p in policy.named_parameters() if n in w)
    assert checkpoint.read_tensors(path, 'optim')


def test_crafted_metadata_is_refused_where_checkpoints_are_read(tmp_path):
    """The unpickler in use: a real checkpoint whose .metadata is replaced by a payload (and loop.json's
    size and crc32 of it updated, as whoever can write one file can write the other) is called damaged
    by candidates() (it reads .metadata through the unpickler to check every file it names), so an
    export of the out_dir finds no intact checkpoint; every reader handed the checkpoint itself refuses
    it with the unpickler's error: load and resume (train.py), export (sample.py, train.py's end),
    load_weights (sample.py) and read_tensors. The payloads run under plain pickle: an undotted torch callable
    (torch.save writes a file) and a dotted name walked through a module DCP imports (os.makedirs).
    Were any of them to read .metadata with DCP's own reader (pickle.load), the payload would run:
    the marker file would exist and no UnpicklingError come."""
    import zlib
    from models import toy  # noqa: F401  (plugs the toy world into model.py)
    from models.policy import load_policy
    from infra.anchor import Anchor
    base = os.path.join(ROOT, 'assets/toy')
    policy = load_policy(base, 'cpu')
    opts = [torch.optim.AdamW(policy.parameters())]
    for p in policy.parameters():
        p.grad = torch.randn_like(p)
    opts[0].step()
    out = str(tmp_path / 'out')
    ckpt = checkpoint.save(os.path.join(out, 'ckpt_000001'), policy, opts, Anchor(policy, 'dual', every=10).state_dict(),
                           dict(iter_num=1, config=dict(model=base, lora_rank=0)))
    marker = str(tmp_path / 'ran')
    payloads = {'torch.save': _call('torch', 'save', {}, marker),
                'torch.distributed.checkpoint.filesystem.os.makedirs':
                    _call('torch.distributed.checkpoint.filesystem', 'os.makedirs', marker)}
    for name, payload in payloads.items():
        pickle.loads(payload)  # the payload is real: plain pickle runs it
        assert os.path.exists(marker), name
        os.system(f'rm -rf {marker}')
        with open(os.path.join(ckpt, '.metadata'), 'wb') as f:
            f.write(payload)
        loop = checkpoint.read_loop(ckpt)
        loop['files']['.metadata'] = [len(payload), zlib.crc32(payload)]
        with open(os.path.join(ckpt, 'loop.json'), 'w') as f:
            json.dump(loop, f)
        assert checkpoint.damage(ckpt) == '.metadata unreadable (UnpicklingError)', name  # bytes as listed
        for find in (lambda: checkpoint.candidates(out, collective=False),
                     lambda: export.export(out, str(tmp_path / 'export'), torch.float32)):
            with pytest.raises(SystemExit, match='has no intact checkpoint'):
                find()
        refused = f'{name} is not allowed in a DCP .metadata file'
        for read in (lambda: checkpoint.load(ckpt, policy, opts, Anchor(policy, 'dual', every=10)),
                     lambda: export.export(ckpt, str(tmp_path / 'export'), torch.float32),
                     lambda: checkpoint.load_weights(ckpt, load_policy(base, 'cpu')),
                     lambda: checkpoint.read_tensors(ckpt, 'optim')):
            with pytest.raises(pickle.UnpicklingError, match=refused):
                read()
        with pytest.raises(SystemExit, match=f'cannot resume from {ckpt}: UnpicklingError: {refused}'):
            checkpoint.resume([ckpt], policy, opts, Anchor(policy, 'dual', every=10), log=lambda m: None)
        assert not os.path.exists(marker) and not os.path.exists(tmp_path / 'export'), name


def test_export_is_atomic_and_loads_with_diffusers(tmp_path, monkeypatch):
    """export.export writes beside the destination and renames: an export that fails mid-write
    (disk full: a half-written weights file, then an error) leaves the previous export whole, or
    none; a temporary directory left by a killed export is cleared by the next one; what is
    exported loads with diffusers' from_pretrained and holds the checkpoint's weights."""
    from models import toy  # noqa: F401  (plugs the toy world into model.py)
    from diffusers import HunyuanVideo15Transformer3DModel as T
    from models.policy import load_policy
    policy = load_policy(os.path.join(ROOT, 'assets/toy'), 'cpu')
    loop = dict(iter_num=1, config=dict(model=os.path.join(ROOT, 'assets/toy'), lora_rank=0))
    out, dest = str(tmp_path / 'out'), str(tmp_path / 'out' / 'export')
    opt = [torch.optim.AdamW(policy.parameters())]

    def exported_equals(policy):
        e = T.from_pretrained(dest)
        sd = policy.state_dict()
        return all(torch.equal(v, sd[k]) for k, v in e.state_dict().items())

    checkpoint.save(os.path.join(out, 'ckpt_000001'), policy, opt, {}, loop)
    os.makedirs(dest + '.tmp')  # left by an export that was killed
    open(os.path.join(dest + '.tmp', 'junk'), 'w').close()
    export.export(out, dest, torch.float32)
    assert exported_equals(policy) and not os.path.exists(dest + '.tmp') and 'junk' not in os.listdir(dest)
    before = {f: open(os.path.join(dest, f), 'rb').read() for f in os.listdir(dest)}

    def disk_full(self, save_directory, **kwargs):
        os.makedirs(save_directory, exist_ok=True)
        with open(os.path.join(save_directory, 'diffusion_pytorch_model.safetensors'), 'wb') as f:
            f.write(b'half')
        raise OSError('No space left on device')

    with torch.no_grad():
        policy.proj_out.weight.add_(1.0)  # a newer checkpoint to export
    checkpoint.save(os.path.join(out, 'ckpt_000002'), policy, opt, {}, dict(loop, iter_num=2))
    with monkeypatch.context() as m:
        m.setattr(T, 'save_pretrained', disk_full)
        with pytest.raises(OSError, match='No space'):
            export.export(out, dest, torch.float32)
        with pytest.raises(OSError, match='No space'):  # a first export that fails: none at all
            export.export(out, str(tmp_path / 'none'), torch.float32)
    assert before == {f: open(os.path.join(dest, f), 'rb').read() for f in os.listdir(dest)}  # the old one, whole
    assert not os.path.exists(tmp_path / 'none') and sorted(os.listdir(tmp_path)) == ['out']
    export.export(out, dest, torch.float32)  # and the next export replaces it
    assert exported_equals(policy) and sorted(os.listdir(out)) == ['ckpt_000001', 'ckpt_000002', 'export', 'latest']


def test_forget_after_drops_an_owed_evaluation(tmp_path):
    """Resume at iteration k: later iterations' log lines and eval videos go; with eval_owed (a
    preemption cut iteration k's evaluation short, the resumed run evaluates first) k's evaluation
    rows and videos go too, its training row stays."""
    rows = [{'iter': 0, 'eval_composite': 0.1}, {'iter': 1, 'reward': 0.2}, {'iter': 1, 'eval_composite': 0.3},
            {'iter': 2, 'reward': 0.4}]
    for owed, kept in ((False, rows[:3]), (True, rows[:2])):
        out = tmp_path / str(owed)
        os.makedirs(out / 'eval')
        (out / 'metrics.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in rows))
        for i in (0, 1, 2):
            (out / 'eval' / f'iter{i:06d}_0.mp4').write_bytes(b'')
        checkpoint.forget_after(str(out), 1, eval_owed=owed)
        assert [json.loads(l) for l in (out / 'metrics.jsonl').read_text().splitlines()] == kept
        assert sorted(os.listdir(out / 'eval')) == [f'iter{i:06d}_0.mp4' for i in ((0, 1) if not owed else (0,))]


def test_crc32_is_of_every_byte_of_a_file(tmp_path):
    """checkpoint._crc is zlib's crc32 of the whole file, read in blocks: a file of 2.5 blocks (40 MB),
    and a byte changed in its last block changes it."""
    import zlib
    data = bytearray(os.urandom(40 << 20))
    path = tmp_path / 'shard'
    path.write_bytes(data)
    assert checkpoint._crc(str(path)) == zlib.crc32(data)
    data[-1] ^= 1
    path.write_bytes(data)
    assert checkpoint._crc(str(path)) == zlib.crc32(data) != zlib.crc32(data[:-1] + bytes([data[-1] ^ 1]))


def test_damage_checks_every_file_listed_in_loop_json(tmp_path):
    """damage() checks each file loop.json lists (every rank's shards, not the first alone): a second
    rank's shard listed with its size and crc32 is intact as written, and named once it has other
    bytes of the same size, is cut short or is gone; the first rank's shard changed in its last byte too."""
    import zlib
    model = torch.nn.Linear(4, 4)
    path = checkpoint.save(str(tmp_path / 'out' / 'ckpt_000001'), model, [torch.optim.AdamW(model.parameters())],
                           {}, dict(iter_num=1))
    other = os.path.join(path, '__1_0.distcp')  # as rank 1 of a 2-rank save would have written it
    data = os.urandom(5000)
    open(other, 'wb').write(data)
    loop = checkpoint.read_loop(path)
    loop['files']['__1_0.distcp'] = [len(data), zlib.crc32(data)]
    with open(os.path.join(path, 'loop.json'), 'w') as f:
        json.dump(loop, f)
    assert checkpoint.damage(path) is None
    for damage, why in [(lambda f: (f.seek(4999), f.write(bytes([data[-1] ^ 1]))), 'has changed since it was written (crc32)'),
                        (lambda f: f.truncate(4000), 'is 4000 bytes, 5000 were written')]:
        open(other, 'wb').write(data)
        with open(other, 'r+b') as f:
            damage(f)
        assert checkpoint.damage(path) == f'__1_0.distcp {why}'
    os.remove(other)
    assert checkpoint.damage(path) == '__1_0.distcp is missing'
    open(other, 'wb').write(data)
    mine = os.path.join(path, '__0_0.distcp')
    with open(mine, 'r+b') as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    assert checkpoint.damage(path) == '__0_0.distcp has changed since it was written (crc32)'


def test_save_clears_what_interrupted_saves_left(tmp_path):
    """A save removes every checkpoint temporary directory an earlier save left (one of another
    iteration, with files in it: a rank died mid-save), and nothing else of out_dir."""
    out = tmp_path / 'out'
    for d in ('ckpt_000004.tmp', 'ckpt_000006.tmp', 'export.tmp'):
        os.makedirs(out / d)
        (out / d / '__0_0.distcp').write_bytes(b'half')
    model = torch.nn.Linear(2, 2)
    checkpoint.save(str(out / 'ckpt_000005'), model, [torch.optim.AdamW(model.parameters())], {}, dict(iter_num=5))
    checkpoint.finish_deletes()  # rank 0 deletes in the background (renamed out of the way at once)
    assert sorted(os.listdir(out)) == ['ckpt_000005', 'export.tmp', 'latest']
    assert checkpoint.damage(str(out / 'ckpt_000005')) is None
