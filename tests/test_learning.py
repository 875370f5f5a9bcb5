"""
train.py as a whole does the method, not just something finite (subprocesses, as a user runs it):
- the loop learns: a short seeded toy run on 4 prompts raises their composite by a margin the
  committed model clears with room (measured: +0.13 at seed 0, +0.30 and +0.07 at seeds 1 and 2),
  and that the same run with the PPO ratio inverted cannot (measured: -0.29 at seed 0);
- the logged KLs: the velocity KL is 0 at one optimizer step per rollout batch (theta == theta_old),
  the position KL is 0 right after each anchor refresh and > 0 in between;
- grouping, under 2 ranks with P != G and a group spanning ranks: the advantages and NaN mask the loss
  receives equal reward.group_advantages applied to each prompt's own clips, computed here from the
  rewards the run saw.
"""
import json
import os

import torch

from reward import SETTING_B, combine, group_advantages
from test_train import ROOT, metrics, run, run_here

# train.py with its reward and loss pieces wrapped to record, per rank, what the reward model returned
# (prompt, scores) and what the objective received (advantages, valid mask); RECORD_NAN=k makes the k-th
# clip of every rollout reward call NaN (a video the reward model failed on)
RECORDER = '''
import atexit, json, os, runpy, sys
sys.path.insert(0, os.getcwd())  # run as a file (torchrun takes no -c): the repository root
from models import toy
from extras import diagnostics
log = dict(rewards=[], losses=[])
score, add = toy.reward, diagnostics.UpdateStats.add
def scored(frames, prompts, fps=toy.FPS):
    sc = score(frames, prompts, fps)
    if 'RECORD_NAN' in os.environ and len(prompts) > 1:
        for v in sc.values():
            v[int(os.environ['RECORD_NAN'])] = float('nan')
    log['rewards'].append(dict(prompts=list(prompts), **{k: v.tolist() for k, v in sc.items()}))
    return sc
def recorded(self, loss, terms, *rest):  # each micro-batch of train.py's update: what its objective received
    log['losses'].append(dict(adv=terms['adv'].tolist(), valid=terms['valid'].tolist()))
    return add(self, loss, terms, *rest)
toy.reward, diagnostics.UpdateStats.add = scored, recorded
atexit.register(lambda: json.dump(log, open(os.environ['RECORD'] + '_' + os.environ.get('RANK', '0') + '.json', 'w')))
sys.argv = sys.argv[1:]
runpy.run_path('train.py', run_name='__main__')
'''


def test_the_loop_learns_and_logs_sensible_kls(tmp_path, monkeypatch):
    prompts = tmp_path / 'four.txt'
    with open(os.path.join(ROOT, 'assets/toy/train_prompts.txt')) as f:
        prompts.write_text(''.join(f.readlines()[:4]))  # few prompts: the policy can improve on them fast
    out = str(tmp_path / 'learn')
    run_here(monkeypatch, ['train.py', 'config/toy.py', f'--train_prompts={prompts}', f'--eval_prompts={prompts}',
                           '--prompts_per_iter=4', '--group_size=4', '--rollout_batch=16', '--train_batch=16',
                           '--num_steps=10', '--timestep_fraction=0.3', '--max_iters=8', '--eval_every=0',
                           '--eval_samples=4', '--eval_videos=0', '--save_every=0', '--diag_every=0',
                           '--anchor_every=3', '--seed=0', f'--out_dir={out}'])
    rows = metrics(out)
    evals = [r['eval_composite'] for r in rows if 'eval_composite' in r]  # iteration 0 and 8, same seeds
    assert evals[-1] - evals[0] > 0.05, evals  # +0.13 as committed; -0.29 with the ratio inverted
    it = [r for r in rows if 'reward' in r]
    assert [r['iter'] for r in it] == list(range(1, 9))
    # iteration k trains the policy after k - 1 optimizer steps; the anchor was refreshed at step
    # 0, 3, 6: a copy of that very policy at iterations 1, 4, 7
    for r in it:
        assert abs(r['kl_vel']) < 1e-9, r  # the rollout's means, recomputed by the same weights
        if (r['iter'] - 1) % 3 == 0:
            assert r['kl_pos'] == 0, r
        else:
            assert r['kl_pos'] > 1e-6, r


def test_grouping_matches_group_advantages_per_prompt_across_two_ranks(tmp_path):
    out, rec, runner = str(tmp_path / 'group'), str(tmp_path / 'rec'), tmp_path / 'recorder.py'
    runner.write_text(RECORDER)
    # 3 prompts x G=2 on 2 ranks: clips 0-2 on rank 0, 3-5 on rank 1, so prompt 1's group spans both
    run([str(runner), 'train.py', 'config/toy.py', '--prompts_per_iter=3', '--group_size=2', '--num_steps=4',
         '--rollout_batch=8', '--train_batch=8', '--max_iters=1', '--eval_every=0', '--eval_samples=1',
         '--eval_videos=0', '--save_every=0', '--diag_every=0', f'--out_dir={out}'],
        torchrun=True, env={'RECORD': rec, 'RECORD_NAN': '2'})
    logs = [json.load(open(f'{rec}_{r}.json')) for r in range(2)]
    train_prompts = set(open(os.path.join(ROOT, 'assets/toy/train_prompts.txt')).read().split('\n'))
    prompts, r = [], []
    for log in logs:  # the rollout's reward call of each rank (the others: held-out evaluations, and
        # preflight's one clip scored before the policy loads)
        call, = [c for c in log['rewards'] if set(c['prompts']) <= train_prompts and len(c['prompts']) > 1]
        prompts += call['prompts']
        r += combine({k: torch.tensor(call[k]) for k in ('VQ', 'MQ', 'TA')}, SETTING_B).tolist()  # train.py's weights
    assert len(prompts) == 6 and len(set(prompts)) == 3
    expected_adv, expected_valid = [0.0] * 6, [0.0] * 6
    for p in set(prompts):  # each prompt's own clips form its group, wherever they ran
        members = [i for i, q in enumerate(prompts) if q == p]
        assert len(members) == 2
        adv, valid, _ = group_advantages(torch.tensor([[r[i] for i in members]]))
        for j, i in enumerate(members):
            expected_adv[i], expected_valid[i] = adv[0, j].item(), float(valid[0, j])
    assert expected_valid.count(0.0) == 2  # clip 2 of each rank was made NaN
    assert sum(a != 0 for a in expected_adv) >= 2  # a group with two finite, different rewards
    got_adv, got_valid = [], []
    for log in logs:  # the first loss call of the update holds all of the rank's clips
        first = log['losses'][0]
        got_adv += first['adv']
        got_valid += first['valid']
    assert got_valid == expected_valid
    assert torch.allclose(torch.tensor(got_adv), torch.tensor(expected_adv), atol=1e-6), (got_adv, expected_adv)
