"""
train.py's settings of the advantage, lambda_KL, the velocity-KL estimator and the reward-hacking alarm,
each in this process (test_train.run_here) for one or a few toy iterations of 2 prompts, driven only by
--key=value and read only from what the run leaves (metrics.jsonl, checkpoints, printed lines):
- advantage='per_component' and 'taros' train other weights than 'grpo' from the same rollouts (a setting
  that never reached the advantage would leave all three bitwise equal);
- --kl_warmup and --kl_init reach the controller: lambda_KL logged after iteration 1 is the warm-up's
  closed form from kl_init (not kl_min, nor the default 100 steps), in the same three runs;
- kl_estimator='sample' pulls toward the rollout policy: with every advantage 0 (a constant reward) only
  the KL terms train, and at theta_old only the sample estimate has a gradient (the exact KLs are at their
  minimum): its one optimizer step moves the weights and makes the rollout's own transitions more likely
  under the checkpoint's weights (an estimator that never reached the loss would leave them the base's);
- the alarm's state is in the checkpoint: a run resumed after iteration 2 still knows the base model's
  evaluation and iteration 2's flags, so at iteration 3 it flags, trips on the watchers flagged at both and
  pins ckpt_000002 (a reward that rises with each call makes the held-out composite rise); the run is at
  Setting A, and every held-out composite logged is VQ + MQ + TA;
- hack_stop checkpoints the iteration it stops at: the alarm trips at iteration 2 (by hand, under the rising
  reward), the run writes ckpt_000002 with save_every 0 and logs nothing after it.
The same settings on 2 ranks against 1 process (torchrun): tests/test_train_ranks.py (slow tier).
"""
import os

import pytest
import torch

from test_train import metrics, run_here, weights

# 2 prompts x G=3 (a group of 2 members ranks the components in one order more often than not, which
# makes per_component's advantage GRPO's), 4 sampler steps, 2 held-out prompts, no diagnostics or export
ARGS = ['train.py', 'config/toy.py', '--prompts_per_iter=2', '--group_size=3', '--num_steps=4', '--rollout_batch=6',
        '--train_batch=3', '--eval_every=0', '--eval_samples=1', '--eval_videos=0', '--save_every=0', '--diag_every=0',
        '--export_dtype=']


@pytest.fixture
def args(tmp_path):
    (tmp_path / 'eval.txt').write_text('a red circle moving left\na blue square moving up\n')
    return ARGS + [f'--eval_prompts={tmp_path / "eval.txt"}']


# lambda_KL's warm-up from kl_init 1e-6, above kl_min 1e-7, over 4 optimizer steps to kl_max 1e-5 (one step an
# iteration): by hand 1e-6 + 9e-6 k / 4 after iteration k, 3.25e-6 at k = 1 (from kl_min: 2.575e-6; the
# default 100 steps: 1.09e-6). The advantage runs carry it, so their runs serve both tests
WARMUP = ['--kl_ratio_target=0', '--kl_init=1e-6', '--kl_min=1e-7', '--kl_max=1e-5', '--kl_warmup=4']


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
    """{advantage kind: its run's out_dir}: one iteration each, the same seed, so the same rollouts and
    rewards; only the advantage differs."""
    tmp = tmp_path_factory.mktemp('kinds')
    (tmp / 'eval.txt').write_text('a red circle moving left\na blue square moving up\n')
    outs = {}
    with pytest.MonkeyPatch.context() as monkeypatch:
        for kind in ('grpo', 'per_component', 'taros'):
            outs[kind] = str(tmp / kind)
            run_here(monkeypatch, ARGS + [f'--eval_prompts={tmp / "eval.txt"}', f'--out_dir={outs[kind]}',
                                          '--max_iters=1', f'--advantage={kind}'] + WARMUP)
    return outs


def test_advantage_kinds_change_what_is_trained(trained):
    w = {kind: weights(out) for kind, out in trained.items()}
    for a, b in (('grpo', 'per_component'), ('grpo', 'taros'), ('per_component', 'taros')):
        assert w[a].keys() == w[b].keys()
        assert any(not torch.equal(w[a][k], w[b][k]) for k in w[a]), (a, b)


def test_kl_warmup_starts_at_kl_init_and_reaches_the_controller(trained):
    for out in trained.values():
        lam = [r['lambda_kl'] for r in metrics(out) if 'reward' in r]
        assert lam == pytest.approx([3.25e-6], rel=1e-9), lam


def test_sample_kl_estimator_pulls_toward_the_rollout_policy(tmp_path, monkeypatch, args):
    from models import policy as M
    from models import toy
    import sde
    score = toy.reward

    def constant(frames, prompts, fps=toy.FPS):  # equal rewards in every group: every advantage is 0
        return {k: torch.full_like(v, 0.5) for k, v in score(frames, prompts, fps).items()}
    rollouts, inner, inner_velocity, last = [], sde.rollout, M.velocity, {}

    def velocity(net, x, s, text, cfg=1.0, text_neg=None):  # the text and cfg of the last forward
        last.update(text=text, cfg=cfg, text_neg=text_neg)
        return inner_velocity(net, x, s, text, cfg, text_neg)

    def recording(v, x, sigmas, kind, eta, *a, keep=(), **kw):
        out = inner(v, x, sigmas, kind, eta, *a, keep=keep, **kw)
        if keep:  # a rollout, not the held-out ODE samples
            rollouts.append((sigmas, last['text'], last['cfg'], last['text_neg'], kind, eta, out[1]))
        return out
    monkeypatch.setattr(toy, 'reward', constant)
    monkeypatch.setattr(sde, 'rollout', recording)
    monkeypatch.setattr(M, 'velocity', velocity)
    lam = ['--kl_ratio_target=0', '--kl_init=1.0', '--kl_min=1.0', '--kl_max=1.0', '--kl_warmup=0', '--weight_decay=0',
           '--timestep_fraction=1.0', '--optimizer=adamw', '--learning_rate=1e-5']
    out = str(tmp_path / 'sample')
    run_here(monkeypatch, args + [f'--out_dir={out}', '--max_iters=1', '--kl_estimator=sample'] + lam)
    moved = weights(out)
    base = M.load_policy(toy.DIR, 'cpu')
    names = dict(base.named_parameters())
    assert moved.keys() <= names.keys()
    assert sum(not torch.equal(t, names[k]) for k, t in moved.items()), 'nothing trained: no gradient reached the weights'

    @torch.no_grad()
    def logp(net):  # the mean log-density of every stochastic transition the rollouts made, under net
        total, n = 0.0, 0
        for sigmas, text, cfg, text_neg, kind, eta, rec in rollouts:
            for t in range(len(sigmas) - 1):
                x, x_next = rec['xs'][:, t], rec['xs'][:, t + 1]
                s = sigmas[t].expand(len(x))
                st = sde.step(x, M.velocity(net, x, s, text, cfg, text_neg), sigmas[t].item(),
                              sigmas[t + 1].item(), kind, eta, x_next=x_next)
                if st.logp is not None:
                    total, n = total + st.logp.sum().item(), n + len(x)
        return total / n
    before = logp(base)
    trained = M.load_policy(toy.DIR, 'cpu')
    trained.load_state_dict(moved, strict=False)
    after = logp(trained)
    # pulled toward the rollout policy: its own samples more likely after the step (pushed away: less)
    assert after > before, (before, after)


def rising(monkeypatch):
    """The toy's reward with TA raised by 1 at each call: the held-out composite rises at every evaluation
    (a few toy iterations of 2 prompts do not raise it), while every clip of a call shares the shift, so the
    advantages, and what is trained, are the toy's own."""
    from models import toy
    score, calls = toy.reward, []

    def reward(frames, prompts, fps=toy.FPS):
        calls.append(1)
        sc = score(frames, prompts, fps)
        return dict(sc, TA=sc['TA'] + len(calls))
    monkeypatch.setattr(toy, 'reward', reward)


def test_alarm_state_survives_a_resume_and_setting_a_is_evaluated_at_a(tmp_path, monkeypatch, args):
    # an evaluation every iteration, alarm_z tiny (any move beyond 0 counts); 2 iterations, a checkpoint
    # each, then the same command resumed to 3: iteration 3 still compares with the base model's
    # evaluation (iteration 0) and remembers iteration 2's flags and evaluation (a rising reward: flags at
    # every evaluation)
    rising(monkeypatch)
    out = str(tmp_path / 'alarm')
    run_args = args + [f'--out_dir={out}', '--eval_every=1', '--save_every=1', '--alarm_z=1e-9',
                       '--reward_weights=(1.0, 1.0, 1.0)']
    run_here(monkeypatch, run_args + ['--max_iters=2'])
    said = run_here(monkeypatch, run_args + ['--max_iters=3', '--init_from=resume'])
    evals = {r['iter']: r for r in metrics(out) if 'eval_composite' in r}
    assert sorted(evals) == [0, 1, 2, 3]
    for r in evals.values():  # Setting A: composite = VQ + MQ + TA (Setting B's 0.5 VQ + 0.5 MQ + TA: not)
        assert r['eval_composite'] == pytest.approx(r['eval_VQ'] + r['eval_MQ'] + r['eval_TA'], rel=1e-6), r
    flagged2, flagged3 = evals[2]['watch_flagged'], evals[3]['watch_flagged']
    assert flagged3, 'the resumed run lost the base model: nothing flagged at iteration 3'
    tripped = [k for k in flagged3 if k in flagged2]  # flagged at two evaluations in a row, by hand
    assert tripped and evals[3]['alarm'] == tripped, (flagged2, flagged3, evals[3]['alarm'])
    assert 'alarm: iteration 3: ' in said and 'ckpt_000002 is kept' in said
    assert os.path.exists(os.path.join(out, 'ckpt_000002', 'pinned'))


def test_hack_stop_checkpoints_the_iteration_it_stops_at(tmp_path, monkeypatch, args):
    # a rising reward and alarm_z tiny: watchers flagged at iterations 1 and 2, so the alarm trips at 2, by
    # hand; hack_stop then writes ckpt_000002 (no save_every would) and runs nothing after it, no export
    rising(monkeypatch)
    out = str(tmp_path / 'stop')
    said = run_here(monkeypatch, args + [f'--out_dir={out}', '--max_iters=4', '--eval_every=1', '--alarm_z=1e-9',
                                         '--hack_stop=True', '--export_dtype=float32'])
    rows = metrics(out)
    assert [r['iter'] for r in rows if r.get('alarm')] == [2] and max(r['iter'] for r in rows) == 2
    assert 'alarm: iteration 2: ' in said
    assert open(os.path.join(out, 'latest')).read().strip() == 'ckpt_000002'
    assert os.listdir(out).count('ckpt_000002') == 1 and not os.path.exists(os.path.join(out, 'export'))
