"""
No run is lost (rundir.py, train.py's start, checkpoint.py's rotation), as a user meets it: train.py's
command lines on one small finished run, first the starts that would destroy it (the run that is
SIGKILLed is a process; the others run in this process, test_train.run_here: a refusal is a
SystemExit with one line, which Python prints without a traceback, exit status 1).
- the same command with a smaller --max_iters, --init_from=scratch, and other run-defining settings
  (the model, group size, LoRA rank, learning rate): each stops with one line (the directory, what
  it holds, the ways on; each differing setting) and after all three every byte of the run, prompt
  cache included, is as it was;
- the same command with a larger --max_iters and a safe change continues the run (init_from=auto);
  a second start while it runs stops with one line naming the holder; SIGKILLed, its lock does not
  block the next start, which ends the run: each iteration logged once, every line and video of the
  first run still there, config.json's history says what changed at which iteration;
- rotation keeps the newest by iteration (not by name: 1000000 > 999999), never the one just
  written, and `latest` names one that exists; a prompt cache of another model is rebuilt;
- torchrun restarts across nodes on torch's shared store stop with one line.
The torchrun --max-restarts run (a worker SIGKILLed, the group restarted, bitwise the uninterrupted
run) is test_train.py's test_toy_fsdp_two_ranks.
"""
import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from test_train import ROOT, metrics, run_here

from infra import checkpoint

# the sequence: evaluations (4 videos each) and a checkpoint every iteration
S = ['train.py', 'config/toy.py', '--prompts_per_iter=2', '--group_size=2', '--num_steps=2', '--train_batch=1',
     '--diag_every=0', '--eval_samples=1', '--rollout_batch=2', '--eval_every=1', '--save_every=1', '--export_dtype=']


def snapshot(out):
    """Every file under out but the lock: relative path -> (sha1 of its bytes, mtime), once the deletes that
    train.py run in this process left in the background (an old checkpoint renamed *.deleting, its files
    going one by one) have finished: a walk meanwhile lists a file and then fails to open it."""
    checkpoint.finish_deletes()
    files = {}
    for root, _, names in os.walk(out):
        for n in names:
            p = os.path.join(root, n)
            if os.path.relpath(p, out) != '.lock':
                files[os.path.relpath(p, out)] = (hashlib.sha1(open(p, 'rb').read()).hexdigest(), os.path.getmtime(p))
    return files


def refused(monkeypatch, args, *says):
    said, _ = run_here(monkeypatch, args, check=False)
    assert said is not None and '\n' not in said and all(s in said for s in says), (says, said)
    return said


def test_same_command_continues_and_no_start_destroys_a_run(tmp_path, monkeypatch):
    out = str(tmp_path / 'out')
    run_here(monkeypatch, S + [f'--out_dir={out}', '--max_iters=3'])
    first, lines = snapshot(out), open(os.path.join(out, 'metrics.jsonl')).readlines()
    videos = sorted(v for v in first if v.startswith('eval'))
    assert len(lines) == 7 and len(videos) == 16 and checkpoint.found(out) == ['ckpt_000002', 'ckpt_000003']
    # 1. the same command, --max_iters=1: starting over would truncate the log to 3 lines, delete 8
    # videos, and rotate away its own new checkpoint (ckpt_000001 sorts before the run's)
    refused(monkeypatch, S + [f'--out_dir={out}', '--max_iters=1'], f"'{out}' holds a run at iteration 3 (ckpt_000003), past "
            'max_iters=1', '--max_iters', '--out_dir')
    refused(monkeypatch, S + [f'--out_dir={out}', '--max_iters=3', '--init_from=scratch'],
            f"'{out}' holds a run (checkpoints ckpt_000002, ckpt_000003; metrics.jsonl: 7 lines up to iteration 3; "
            '16 eval videos): nothing in it was changed', 'init_from=auto', '--out_dir')
    refused(monkeypatch, S + [f'--out_dir={out}', '--max_iters=3', '--group_size=4', '--lora_rank=4', '--learning_rate=1e-3',
                 '--model=/elsewhere/toy'],  # a refused start reads no model: the prompt cache stays too
            "group_size 2 (the run) vs 4", "learning_rate 0.0001 (the run) vs 0.001", "lora_rank 0 (the run) vs 4",
            "model 'assets/toy' (the run) vs '/elsewhere/toy'")
    assert snapshot(out) == first
    # 2. trained on with a safe change; a second start meanwhile stops; SIGKILLed, then the same command
    on = S + [f'--out_dir={out}', '--max_iters=5', '--eval_every=2']
    with open(tmp_path / 'log.txt', 'w') as log:
        p = subprocess.Popen([sys.executable] + on, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS='1'),
                             stdout=log, stderr=subprocess.STDOUT)
    t0 = time.time()
    while f'pid {p.pid} on' not in open(os.path.join(out, '.lock')).read():  # it holds out_dir
        assert p.poll() is None and time.time() - t0 < 120, open(tmp_path / 'log.txt').read()[-3000:]
        time.sleep(0.05)
    refused(monkeypatch, on, f"'{out}' is in use by another run (pid {p.pid} on")
    p.send_signal(signal.SIGKILL)  # the kernel releases its lock
    p.wait()
    run_here(monkeypatch, on)
    rows = metrics(out)
    assert [r['iter'] for r in rows if 'reward' in r] == [1, 2, 3, 4, 5]
    assert [r['iter'] for r in rows if 'eval_composite' in r] == [0, 1, 2, 3, 4, 5]
    assert open(os.path.join(out, 'metrics.jsonl')).readlines()[:7] == lines
    now = snapshot(out)
    assert all(now[v] == first[v] for v in videos) and len([v for v in now if v.startswith('eval')]) == 24
    assert checkpoint.found(out) == ['ckpt_000004', 'ckpt_000005'] and open(os.path.join(out, 'latest')).read() == 'ckpt_000005'
    history = json.load(open(os.path.join(out, 'config.json')))
    assert history['settings']['max_iters'] == 5 and 'changed' not in history['starts'][0]
    assert history['starts'][1]['iter'] == 3 and history['starts'][1]['changed'] == {'eval_every': [1, 2], 'max_iters': [3, 5]}


def test_rotation_by_iteration_keeps_the_checkpoint_just_written(tmp_path):
    # name order would delete ckpt_1000000 right after writing it ('ckpt_1000000' < 'ckpt_999999'),
    # and counting a later, damaged checkpoint among the newest would delete the one just written
    out = tmp_path / 'out'
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())

    def save(i, keep):
        checkpoint.save(str(out / f'ckpt_{i:06d}'), model, [opt], {}, dict(iter_num=i), keep=keep)
        assert os.path.isdir(out / open(out / 'latest').read())  # `latest` names one that exists
        return checkpoint.found(str(out))
    assert save(999998, 2) == ['ckpt_999998']
    assert save(999999, 2) == ['ckpt_999998', 'ckpt_999999']
    assert save(1000000, 2) == ['ckpt_999999', 'ckpt_1000000']
    os.makedirs(out / 'ckpt_1000005')  # a later one, damaged (no loop.json): the run resumed before it
    assert save(1000001, 1) == ['ckpt_1000001', 'ckpt_1000005']
    assert checkpoint.candidates(str(out), log=lambda m: None) == [str(out / 'ckpt_1000001')]


def test_prompt_cache_of_another_model_is_rebuilt(tmp_path):
    from infra import prompt_cache

    def encoder(value):  # model.encode_prompts' signature: each prompt's 4 tensors, one chunk at a time
        def encode_prompts(model, prompts, device, sink, chunk):
            sink({p: (torch.full((1, 2), value), torch.ones(1, dtype=torch.bool),
                      torch.full((1, 2), value), torch.ones(1, dtype=torch.bool)) for p in prompts})
        return encode_prompts
    path = str(tmp_path / 'pc')
    prompt_cache.build(path, 'model-a', ['a red circle moving left'], encode_prompts=encoder(1.0))
    prompt_cache.build(path, 'model-b', ['a red circle moving left'], encode_prompts=encoder(2.0))
    assert prompt_cache.PromptCache(path)['a red circle moving left'][0].eq(2.0).all()  # model-b's, not a's


def test_restarts_across_nodes_need_a_fresh_store(monkeypatch):
    from infra import parallel
    for k, v in dict(TORCHELASTIC_USE_AGENT_STORE='True', GROUP_WORLD_SIZE='2', TORCHELASTIC_MAX_RESTARTS='3').items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SystemExit, match='set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for every torchrun'):
        parallel._store(None)
    monkeypatch.setenv('TORCHELASTIC_USE_AGENT_STORE', 'False')  # torch's own fresh store per rendezvous
    assert parallel._store(None) is None


# ----------------------------------------------------------------------------- rundir.claim, in this process

RUN = dict(init_from='auto', max_iters=3, seed=0, model='assets/toy', group_size=2, eval_every=1)


def claim(out, said=None, **change):
    """rundir.claim of a start with RUN's settings changed by `change`: its (checkpoints, history) or its
    one line; the lock is let go after, as the process's exit would (test_train.run_here)."""
    from infra import rundir
    try:
        return rundir.claim(dict(RUN, out_dir=str(out), **change), True, log=(said if said is not None else []).append)
    except SystemExit as e:
        assert '\n' not in str(e)
        return str(e)
    finally:
        if rundir._held is not None:
            os.close(rundir._held)
            rundir._held = None


def a_run(out, iters=(2, 3)):
    """out_dir of a run of RUN's settings with checkpoints at `iters` and a log line for each iteration."""
    model = torch.nn.Linear(2, 2)
    for i in iters:
        checkpoint.save(str(out / f'ckpt_{i:06d}'), model, [torch.optim.AdamW(model.parameters())], {},
                        dict(iter_num=i, config=dict(RUN, out_dir=str(out))))
    (out / 'metrics.jsonl').write_text(''.join(json.dumps(dict(iter=i, reward=0.5)) + '\n' for i in range(1, max(iters) + 1)))
    return out


def test_claim_refuses_a_log_without_checkpoints_resume_into_nothing_and_a_changed_seed(tmp_path):
    """The refusals of rundir.claim, each one line: a metrics log with no checkpoint and no config.json
    (its settings are unknown; with a config.json it starts again at 0), init_from='resume' into an
    out_dir that holds nothing, a changed seed (it defines the run; a SAFE change goes ahead); each
    leaves out_dir's files as they were."""
    logged = tmp_path / 'logged'
    logged.mkdir()
    (logged / 'metrics.jsonl').write_text(json.dumps(dict(iter=1, reward=0.5)) + '\n' + json.dumps(dict(iter=2, reward=0.6)) + '\n')
    before = snapshot(str(logged))
    assert claim(logged) == (f"out_dir {str(logged)!r} holds a run (metrics.jsonl: 2 lines up to iteration 2) but no "
                             "checkpoint and no config.json: its settings are unknown. Start a new run with another --out_dir")
    assert snapshot(str(logged)) == before
    (logged / 'config.json').write_text(json.dumps(dict(settings=dict(RUN, out_dir=str(logged)), starts=[])))
    said = []
    assert claim(logged, said) == ([], dict(settings=dict(RUN, out_dir=str(logged)), starts=[]))
    assert said and 'starts again at iteration 0' in said[0]
    empty = tmp_path / 'empty'
    assert claim(empty, init_from='resume') == f"{str(empty)!r} has no intact checkpoint to resume from"
    assert claim(empty) == ([], None)  # auto: a new run
    run = a_run(tmp_path / 'run')
    before = snapshot(str(run))
    assert claim(run, seed=1).startswith(f"out_dir {str(run)!r} holds a run with other settings: seed 0 (the run) vs 1.")
    assert snapshot(str(run)) == before
    ckpts, history = claim(run, eval_every=2)  # SAFE: continued
    assert ckpts == [str(run / 'ckpt_000003'), str(run / 'ckpt_000002')] and history['settings']['seed'] == 0


def test_claim_same_length_resubmission_continues_a_shorter_one_is_refused(tmp_path):
    """A resubmission of a finished run with the same max_iters is taken (nothing to train, said so),
    not refused; a --max_iters below the run's iteration is refused; a larger one continues."""
    run = a_run(tmp_path / 'run')
    said = []
    assert claim(run, said)[0] == [str(run / 'ckpt_000003'), str(run / 'ckpt_000002')]
    assert said == [f'the run in {run} is complete at iteration 3 (max_iters): nothing to train. A larger '
                    '--max_iters trains it on; another --out_dir starts a new run']
    assert claim(run, max_iters=2).startswith(f"out_dir {str(run)!r} holds a run at iteration 3 (ckpt_000003), past max_iters=2")
    said = []
    assert claim(run, said, max_iters=4)[0][0] == str(run / 'ckpt_000003') and said == []


def test_lock_names_its_holder_and_a_refused_start_leaves_it(tmp_path):
    """out_dir/.lock: a start that goes ahead writes 'pid <its pid> on <host> since <time>' (over a dead
    holder's text); while it is held a second start stops naming that holder; a refused start leaves
    the file as it was."""
    import fcntl
    import re
    import socket
    from infra import rundir
    out = tmp_path / 'out'
    out.mkdir()  # the lock file of a run that died (a lock alone is no run), its text longer than ours
    (out / '.lock').write_text(f'pid 4194304 on {"a-long-host-name-" * 8} since 2000-01-01 00:00:00\n')
    assert claim(out) == ([], None)
    text = (out / '.lock').read_text()
    assert re.fullmatch(rf'pid {os.getpid()} on {re.escape(socket.gethostname())} since '
                        r'\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\n', text), text
    fd = os.open(out / '.lock', os.O_RDWR)  # another process's flock, as it were (another open file)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        assert claim(out) == (f"out_dir {str(out)!r} is in use by another run ({text.strip()}): wait for it to end, "
                              "or use another --out_dir")
    finally:
        os.close(fd)
    run = a_run(tmp_path / 'run')
    (run / '.lock').write_text('pid 1 on elsewhere since 2000-01-01 00:00:00\n')
    assert claim(run, init_from='scratch').startswith(f"out_dir {str(run)!r} holds a run (")
    assert (run / '.lock').read_text() == 'pid 1 on elsewhere since 2000-01-01 00:00:00\n'
    assert rundir._held is None


def test_latest_names_the_checkpoint_just_written(tmp_path):
    """`latest` is the name of the checkpoint each save published, also with a later (damaged) one beside it."""
    out = tmp_path / 'out'
    model = torch.nn.Linear(2, 2)
    os.makedirs(out / 'ckpt_000009')  # damaged: no loop.json
    for i in (1, 2, 3):
        checkpoint.save(str(out / f'ckpt_{i:06d}'), model, [torch.optim.AdamW(model.parameters())], {}, dict(iter_num=i))
        assert (out / 'latest').read_text() == f'ckpt_{i:06d}' and not os.path.exists(out / 'latest.tmp')
    assert checkpoint.found(str(out)) == ['ckpt_000002', 'ckpt_000003', 'ckpt_000009']
