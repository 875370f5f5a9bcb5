"""
The first 8-GPU launch, second pass (issue 59), on the toy and on CPU ranks:
- a clip whose rollout went NaN leaves the update: one NaN clip among four, the optimizer step is taken
  and its gradient is the three others', computed apart here (their log-densities by torch.distributions,
  the group advantages by hand); on 2 gloo ranks a rank whose clips all went NaN still joins every FSDP
  pass, and the run equals one process with the same clips NaN;
- checkpoints after the run's first iteration and by the clock (save_every_min, decided the same on every
  rank: 2 gloo ranks whose clocks disagree), with the toy's metrics unchanged;
- every path the run reads is checked before anything loads: a missing reward folder or watcher stops
  `python train.py config/toy.py` with one line per path and its `hf download` command, before the
  prompt encoding;
- the allocator's expandable_segments is set where torch reads it even after torch has parsed its
  config, and the start-up log says what torch reports.

    python -m pytest tests/test_launch_second.py
"""
import copy
import functools
import json
import os
import subprocess
import sys
import time

import pytest
import torch

import reward
import sde
from extras import preflight
from infra import finite, optimizer as optim, parallel, rundir
from models import policy as model

sys.path.insert(0, os.path.dirname(__file__))
from test_train import ROOT, SMALL, limit, metrics, run, run_here  # noqa: E402

NAN_FROM = 2  # the step from which an injected clip's latents and log-probs are NaN


def nan_rollouts(monkeypatch, bad, seen=None):
    """sde.rollout with the rollout (a kept trajectory) of batch indices `bad` NaN from step NAN_FROM on,
    as a bf16 overflow leaves it; seen: records each rollout's arguments (the text and cfg of its
    velocity's last forward) and clean copy."""
    inner, inner_velocity, last = sde.rollout, model.velocity, {}

    def velocity(net, x, s, text, cfg=1.0, text_neg=None):
        last.update(text=text, text_neg=text_neg, cfg=cfg)
        return inner_velocity(net, x, s, text, cfg, text_neg)

    def rollout(v, x, sigmas, kind, eta, gens, *a, **kw):
        x, traj = inner(v, x, sigmas, kind, eta, gens, *a, **kw)
        if traj is not None:
            if seen is not None:
                seen.append(dict(traj={k: v.clone() for k, v in traj.items()}, sigmas=sigmas, kind=kind, eta=eta,
                                 **last))
            for k in ('xs', 'logps'):
                traj[k][bad, NAN_FROM:] = float('nan')
        return x, traj
    monkeypatch.setattr(sde, 'rollout', rollout)
    monkeypatch.setattr(model, 'velocity', velocity)


def test_a_nan_clip_leaves_the_update_and_the_others_train(tmp_path, monkeypatch):
    """4 clips of one prompt (G=4), clip 2's rollout NaN from step 2: the iteration takes its optimizer
    step, logs nonfinite_clips 1, runs no forward of clip 2 (its micro-batch [2, 3] runs as [3]), and
    the gradient it steps with is, to float rounding, that of the
    other three clips alone: sum over their trained steps of -A_i d logp_i / (3 valid x 4 steps), with
    A the group advantages of the three finite rewards (population std) and logp the mean Gaussian
    log-density of the rollout's x_{t+1} (torch.distributions) at the policy's SDE mean and std.
    KL off, equalizer off, every step trained: the objective is that sum alone."""
    seen, grads, scored, built, passes = [], {}, [], {}, []
    nan_rollouts(monkeypatch, [2], seen)
    inner = model.velocity

    def counted(net, x, *a, **kw):  # the clips of each forward with grad: the update's
        if torch.is_grad_enabled() and not built.get('done'):
            passes.append(x.shape[0])
        return inner(net, x, *a, **kw)
    monkeypatch.setattr(model, 'velocity', counted)
    build, clip = optim.build, optim.clip_grad_norm

    def record_build(policy, *a, **kw):  # the policy as loaded, before any step
        built['policy'], built['start'] = policy, copy.deepcopy(policy)
        return build(policy, *a, **kw)

    def record_clip(optimizers, *a, **kw):  # the accumulated gradient, before the clip scales it
        grads.update({n: p.grad.clone() for n, p in built['policy'].named_parameters() if p.grad is not None})
        return clip(optimizers, *a, **kw)
    finite_frames = finite.FiniteFrames.__call__
    monkeypatch.setattr(finite.FiniteFrames, '__call__',
                        lambda self, *a, **kw: scored.append(finite_frames(self, *a, **kw)) or scored[-1])
    monkeypatch.setattr(optim, 'build', record_build)
    monkeypatch.setattr(optim, 'clip_grad_norm', record_clip)
    out = str(tmp_path / 'nan')
    run_here(monkeypatch, SMALL + [f'--out_dir={out}', '--max_iters=1', '--diag_every=0', '--prompts_per_iter=1',
                                   '--group_size=4', '--timestep_fraction=1.0', '--kl_strategy=none',
                                   '--equalizer=False', '--export_dtype='])
    built['done'] = True
    (row,) = [r for r in metrics(out) if 'reward' in r]
    assert row['skipped_steps'] == 0 and row['nonfinite_clips'] == 1 and row['nan_rewards'] == 1, row
    assert grads and all(torch.isfinite(g).all() for g in grads.values())
    # removed, not masked: train_batch 2, 4 steps: [0, 1] and [3] at each step (clip 2 was [2, 3]'s)
    assert sorted(passes) == [1] * 4 + [2] * 4, passes

    # the reference: the three finite clips alone, from the policy as loaded
    (r,) = [s for s in scored if torch.isnan(s['TA']).any()]  # the rollout's scoring (not the evaluation's)
    composite = 0.5 * r['VQ'] + 0.5 * r['MQ'] + 1.0 * r['TA']  # reward_weights (0.5, 0.5, 1)
    assert torch.isnan(composite[2]) and torch.isfinite(composite[[0, 1, 3]]).all()
    keep = [0, 1, 3]
    c = composite[keep].double()
    adv = ((c - c.mean()) / c.std(unbiased=False)).clamp(-5, 5).float()  # GRPO over the 3 finite members
    (roll,) = seen
    net = built['start'].train()
    xs, sig = roll['traj']['xs'][keep], roll['sigmas']
    text, text_neg = ([u[keep] for u in roll[k]] for k in ('text', 'text_neg'))
    n_steps, denom = len(sig) - 1, 3 * (len(sig) - 1)
    loss = 0.0
    for t in range(n_steps):  # sage: all 4 steps stochastic, all trained (timestep_fraction 1)
        x, x_next = xs[:, t], xs[:, t + 1]
        v = model.velocity(net, x, sig[t].expand(3), text, roll['cfg'], text_neg)
        st = sde.step(x, v, sig[t].item(), sig[t + 1].item(), roll['kind'], roll['eta'], x_next=x_next)
        std = st.std.view(3, *[1] * (x.dim() - 1)).expand_as(x_next)
        logp = torch.distributions.Normal(st.mean, std).log_prob(x_next.float()).flatten(1).mean(1)  # (3,)
        loss = loss + (-adv * torch.exp(logp - logp.detach())).sum() / denom
    loss.backward()
    ref = {n: p.grad for n, p in net.named_parameters() if p.grad is not None}
    assert ref.keys() == grads.keys()
    scale = max(g.abs().max().item() for g in ref.values())
    for n in ref:
        torch.testing.assert_close(grads[n], ref[n], rtol=1e-4, atol=1e-5 * scale, msg=n)


WRAP = '''import os, runpy, sys
sys.path.insert(0, {root!r})
import sde
bad = {{int(k): v for k, v in {bad!r}.items()}}.get(int(os.environ.get('RANK', 0)), [])
inner = sde.rollout
def rollout(*a, **kw):
    x, traj = inner(*a, **kw)
    if traj is not None:
        for k in ('xs', 'logps'):
            traj[k][bad, {nan_from}:] = float('nan')
    return x, traj
sde.rollout = rollout
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name='__main__')
'''


@pytest.mark.slow  # torchrun with 2 gloo ranks and one process, an iteration each: ~40 s on 2 cores
def test_a_rank_whose_clips_all_went_nan_joins_every_pass(tmp_path):
    """2 ranks, 2 prompts x G=2: rank 1's two clips (the whole second group) NaN. Rank 1 has no finite
    clip, yet it must run as many FSDP forwards and backwards as rank 0 (it does: no hang, the step is
    taken); the loss's normalisation is the global one: the run equals one process with the same two
    clips NaN: the gradient norm (all ranks' shards; a rank-local normalisation would double it) and the
    loss. (Not the weights: AdamW's first step is g / |g|, blind to the gradient's scale.)"""
    outs = {}
    for name, bad, torchrun in (('ranks', {1: [0, 1]}, True), ('one', {0: [2, 3]}, False)):
        wrap = tmp_path / f'wrap_{name}.py'
        wrap.write_text(WRAP.format(root=ROOT, bad=bad, nan_from=NAN_FROM))
        outs[name] = str(tmp_path / name)
        run([str(wrap)] + SMALL + [f'--out_dir={outs[name]}', '--max_iters=1', '--diag_every=0',
                                   '--optimizer=adamw', '--export_dtype='], torchrun=torchrun)
    rows = {k: [r for r in metrics(o) if 'reward' in r] for k, o in outs.items()}
    for k, (r,) in rows.items():
        assert r['skipped_steps'] == 0 and r['nonfinite_clips'] == 2 and r['nan_rewards'] == 2, (k, r)
        assert r['grad_norm'] > 0
    a, b = rows['ranks'][0], rows['one'][0]
    assert abs(a['grad_norm'] - b['grad_norm']) <= 1e-4 * b['grad_norm'], (a['grad_norm'], b['grad_norm'])
    # a wrong normalisation (a rank's own valid count) would be a factor 2; this is fp32 sums' order
    assert abs(a['loss'] - b['loss']) <= 1e-3 * abs(b['loss']), (a['loss'], b['loss'])


# ----------------------------------------------------------------------------- checkpoints by the clock

def checkpoints(out):
    return sorted(int(d.split('_')[-1]) for d in os.listdir(out) if d.startswith('ckpt_'))


@pytest.mark.slow  # 12 toy iterations in this process: ~30 s on 2 busy cores
def test_checkpoints_after_the_first_iteration_and_by_the_clock(tmp_path, monkeypatch):
    """save_every=0 (no count): a checkpoint after the first iteration, then whenever 30 minutes have
    passed since the last one, on a clock that reads 20 minutes an iteration (iterations 3 and 5), and
    at the end (6); the metrics equal those of the same run checkpointing by count alone (every 2)."""
    out_t, out_n = str(tmp_path / 'clock'), str(tmp_path / 'count')

    def minutes_20_an_iteration():  # 20 minutes for each iteration logged so far
        path = os.path.join(out_t, 'metrics.jsonl')
        done = sum('"reward"' in line for line in open(path)) if os.path.exists(path) else 0
        return 60.0 * 20 * done
    with monkeypatch.context() as m:
        m.setattr(rundir, 'Cadence', functools.partial(rundir.Cadence, clock=minutes_20_an_iteration))
        printed = run_here(monkeypatch, SMALL + [f'--out_dir={out_t}', '--max_iters=6', '--diag_every=0',
                                                 '--save_every=0', '--save_every_min=30', '--keep_checkpoints=10',
                                                 '--export_dtype='])
    assert checkpoints(out_t) == [1, 3, 5, 6]
    assert 'allocator: cpu: no CUDA caching allocator' in printed  # the start-up line, on a CPU
    run_here(monkeypatch, SMALL + [f'--out_dir={out_n}', '--max_iters=6', '--diag_every=0', '--save_every=2',
                                   '--save_every_min=0', '--keep_checkpoints=10', '--export_dtype='])
    assert checkpoints(out_n) == [1, 2, 4, 6]  # the first iteration's, then by count
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith(('t_', 'peak_mem'))} for r in rows]  # noqa: E731
    assert strip(metrics(out_t)) == strip(metrics(out_n))
    message, _ = run_here(monkeypatch, SMALL + [f'--out_dir={tmp_path / "bad"}', '--save_every_min=-1'], check=False)
    assert message and 'save_every_min' in message and 'at least 0' in message, message


def _cadence_rank(rank, port, out):
    import torch.distributed as dist
    dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', rank=rank, world_size=2)
    now = [0.0]
    c = rundir.Cadence(every=0, minutes=10, device='cpu', clock=lambda: now[0])
    seen = [c.due(1)]  # the first iteration: due on both, and each rank's clock starts again (at 0)
    for minutes in (4, 9, 11, 12):  # rank 1's clock runs 1.5 minutes ahead of rank 0's
        now[0] = 60 * (minutes + 1.5 * rank)
        seen.append(c.due(2))
    with open(os.path.join(out, f'{rank}.json'), 'w') as f:
        json.dump(seen, f)
    dist.destroy_process_group()


def test_the_cadence_by_count_and_by_clock():
    """One process, a clock set by hand: due after the run's first iteration, then at every 3rd (count) and
    once 10 minutes passed since the last save (clock), whichever comes first."""
    now = [0.0]
    c = rundir.Cadence(every=3, minutes=10, device='cpu', clock=lambda: now[0])
    seen = []
    for it, minutes in zip(range(1, 8), (1, 2, 4, 13, 13.5, 20, 25)):
        now[0] = 60 * minutes
        seen.append(c.due(it))  # a due checkpoint starts the clock again
    assert seen == [True, False, True, False, False, True, False]  # 1 first, 3 count, 6 count and clock
    now[0] = 60 * 36  # 16 minutes after the save at 20, iteration 7: by the clock alone
    assert c.due(7)
    assert rundir.Cadence(every=0, minutes=0, device='cpu').due(1)  # the run's first, whatever the settings
    assert not rundir.Cadence(every=0, minutes=0, device='cpu').due(5)  # a resumed start's first: by count, clock


@pytest.mark.slow  # two spawned gloo ranks: ~20 s on 2 busy cores
def test_the_clock_decides_the_same_on_every_rank(tmp_path):
    """2 gloo ranks whose clocks differ by 1.5 minutes, save_every_min 10: at 9 minutes on rank 0 (10.5
    on rank 1) both decide to save (the ranks' elapsed times reduced to their maximum), and both start
    again from their own clocks."""
    import socket
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        port = s.getsockname()[1]
    mp.start_processes(_cadence_rank, args=(port, str(tmp_path)), nprocs=2, start_method='spawn')
    seen = [json.load(open(tmp_path / f'{r}.json')) for r in (0, 1)]
    assert seen[0] == seen[1] == [True, False, True, False, False], seen


# ----------------------------------------------------------------------------- paths before loading

def toy_reward_folders(tmp_path):
    """A VideoReward folder and a Qwen folder holding the files the loaders open first (empty)."""
    va, qwen = tmp_path / 'VideoReward', tmp_path / 'Qwen2-VL-2B-Instruct'
    (va / 'checkpoint-100').mkdir(parents=True)
    qwen.mkdir()
    for f in (va / 'model_config.json', va / 'checkpoint-100' / 'model.pth', qwen / 'config.json'):
        f.write_text('{}')
    return str(va), str(qwen)


def settings(**kw):
    base = dict(model='assets/toy', reward_model='world', videoalign_dir='/nope/va', qwen_dir='/nope/qwen',
                eval_metrics='', clip_dir='/nope/clip', pickscore_dir='/nope/pick',
                train_prompts='assets/toy/train_prompts.txt', eval_prompts='assets/toy/eval_prompts.txt')
    return dict(base, **kw)


def test_preflight_names_each_missing_path_with_its_download(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert preflight.missing(settings()) == []  # the toy: all there, no reward folder needed
    va, qwen = toy_reward_folders(tmp_path)
    assert preflight.missing(settings(reward_model='videoalign', videoalign_dir=va, qwen_dir=qwen)) == []
    os.remove(os.path.join(va, 'checkpoint-100', 'model.pth'))  # an interrupted download
    lines = preflight.missing(settings(model='/nope/hv', reward_model='videoalign', videoalign_dir=va,
                                       qwen_dir='/nope/qwen', eval_metrics='clipscore,pickscore',
                                       train_prompts='/nope/p.txt'))
    assert lines == [
        "model '/nope/hv': model_index.json not found; get it with: hf download "
        'hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v --local-dir /nope/hv',
        f"videoalign_dir {va!r}: checkpoint-*/model.pth not found; get it with: hf download KwaiVGI/VideoReward "
        f'--local-dir {va}',
        "qwen_dir '/nope/qwen': config.json not found; get it with: hf download Qwen/Qwen2-VL-2B-Instruct "
        '--local-dir /nope/qwen',
        "clip_dir '/nope/clip': config.json not found; get it with: hf download openai/clip-vit-large-patch14 "
        '--local-dir /nope/clip',
        "pickscore_dir '/nope/pick': config.json not found; get it with: hf download yuvalkirstain/PickScore_v1 "
        '--local-dir /nope/pick',
        "train_prompts '/nope/p.txt' not found (a prompt a line, or a CSV with a prompt column)"], lines
    hub = 'hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v'  # train.py's default names the hub
    assert preflight.missing(settings(model=hub)) == [
        f"model {hub!r}: model_index.json not found; get it with: hf download {hub} --local-dir "
        'weights/HunyuanVideo-1.5-480p_t2v and pass --model=weights/HunyuanVideo-1.5-480p_t2v']


@pytest.mark.parametrize('args, wants', [
    (['--reward_model=videoalign', '--videoalign_dir={tmp}/va', '--qwen_dir={tmp}/qwen'],
     ['hf download KwaiVGI/VideoReward --local-dir {tmp}/va', 'hf download Qwen/Qwen2-VL-2B-Instruct --local-dir {tmp}/qwen']),
    (['--eval_metrics=pickscore', '--pickscore_dir={tmp}/pick'],
     ['hf download yuvalkirstain/PickScore_v1 --local-dir {tmp}/pick'])])
def test_a_missing_reward_folder_stops_the_toy_before_the_model_loads(tmp_path, args, wants):
    """`python train.py config/toy.py` with the reward (or a watcher) pointed at folders that are not there:
    it stops with one line per folder and its download command, no traceback, before the prompt encoding
    (out_dir holds no prompt cache) and before the model: nothing printed after the settings."""
    tmp, out = str(tmp_path), str(tmp_path / 'out')
    t0 = time.time()
    p = run(['train.py', 'config/toy.py', f'--out_dir={out}'] + [a.format(tmp=tmp) for a in args], check=False,
            timeout=limit(120))
    seconds = time.time() - t0
    said = p.stdout + p.stderr
    assert p.returncode == 1 and 'Traceback' not in said, said[-3000:]
    for w in wants:
        assert w.format(tmp=tmp) in p.stderr, p.stderr[-2000:]
    assert not os.path.exists(os.path.join(out, 'prompt_cache')), os.listdir(out)
    assert p.stdout.splitlines()[-1].startswith('allocator: cpu'), p.stdout[-500:]  # the settings, then nothing
    assert seconds < limit(60), seconds  # the imports and the settings, nothing loaded


# ----------------------------------------------------------------------------- the allocator

ALLOC = '''import os, sys
sys.path.insert(0, {root!r})
import torch
torch._C._accelerator_getAllocatorSettings()  # something looked first: torch has parsed its config
from infra import parallel
parallel.expandable_segments()
print(repr(torch._C._accelerator_getAllocatorSettings()), torch.cuda.is_initialized())
'''


def test_expandable_segments_take_effect_after_torch_parsed_its_config(tmp_path):
    """In a fresh process whose torch has already read its allocator config (an import that asked
    first), the setting still takes: torch reports expandable_segments:True (a variable written then is
    never read), CUDA untouched; a user's own config is kept."""
    env = {k: v for k, v in os.environ.items() if k not in ('PYTORCH_CUDA_ALLOC_CONF', 'PYTORCH_ALLOC_CONF')}
    script = ALLOC.format(root=ROOT)
    p = subprocess.run([sys.executable, '-c', script], capture_output=True, text=True, env=env, timeout=120)
    assert p.stdout.split() == ["'expandable_segments:True'", 'False'], p.stdout + p.stderr
    p = subprocess.run([sys.executable, '-c', script], capture_output=True, text=True, timeout=120,
                       env=dict(env, PYTORCH_CUDA_ALLOC_CONF='max_split_size_mb:512'))
    assert p.stdout.split() == ["'max_split_size_mb:512'", 'False'], p.stdout + p.stderr


def test_the_start_up_line_says_what_torch_reports(monkeypatch):
    """On a GPU the line reports torch's settings, whether CUDA had started before them, the allocator
    backend and whether the first segment is expandable (torch's snapshot; faked here); on a CPU it says
    there is no CUDA allocator."""
    assert parallel.allocator_line('cpu').startswith('allocator: cpu: no CUDA caching allocator')
    monkeypatch.setattr(torch, 'empty', lambda *a, **kw: None)
    monkeypatch.setattr(torch.cuda, 'memory_snapshot', lambda: [{'is_expandable': True, 'total_size': 2 ** 21}])
    monkeypatch.setattr(torch.cuda.memory, 'get_allocator_backend', lambda: 'native')
    monkeypatch.setattr(torch._C, '_accelerator_getAllocatorSettings', lambda: 'expandable_segments:True')
    monkeypatch.setattr(parallel, '_cuda_was_up', False)
    assert parallel.allocator_line('cuda:0') == ('allocator: expandable_segments:True, set before CUDA started: '
                                                 'True; backend native; first segment expandable: True')
