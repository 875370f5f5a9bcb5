"""train.py with credit='tvrl' (credit.py), as a user runs it: the toy under torchrun
--nproc_per_node=2 (FSDP2, gloo; a weight a frame), and the HunyuanVideo 1.5 path with tiny random
parts and the tiny VideoAlign in one process (a weight a latent token, the default granularity).
Each run logs finite numbers, a credit map that is not uniform (credit_peak > 1), and a ratio of
exactly 1 at theta = theta_old (clipfrac 0: old and new log-probs share the weights).
python -m pytest tests/test_credit_train.py"""
import math

import pytest

from test_train import SMALL, check_run, run, run_here


def check_credit(out, iters):
    rows = check_run(out, iters)
    for r in rows:
        assert math.isfinite(r['credit_peak']) and r['credit_peak'] > 1.0, r
        assert r['clipfrac'] == 0.0, r
    return rows


@pytest.mark.slow  # .ci/run's slow tier: the README's command stays under 10 minutes
def test_toy_tvrl_frame_granularity_two_ranks(tmp_path):
    out = str(tmp_path / 'tvrl2')
    run(SMALL + [f'--out_dir={out}', '--max_iters=2', '--credit=tvrl', '--credit_granularity=frame',
                 '--credit_window=(1, 1, 1)'], torchrun=True)
    check_credit(out, 2)


def test_bad_credit_setting_fails_clearly(tmp_path, monkeypatch):
    said, _ = run_here(monkeypatch, SMALL + [f'--out_dir={tmp_path / "bad"}', '--credit=tokens'], check=False)
    assert "credit must be one of 'none', 'tvrl', got 'tokens'" in said


def test_hunyuan_path_tiny_parts_tvrl(tmp_path, monkeypatch):
    from tiny_hunyuan import make_tiny_hunyuan
    from tiny_videoalign import make_tiny_videoalign
    root = make_tiny_hunyuan(str(tmp_path / 'hv'))
    ckpt_dir, qwen_dir = make_tiny_videoalign(str(tmp_path / 'va'))
    out = str(tmp_path / 'out')
    run_here(monkeypatch, ['train.py', f'--model={root}', '--reward_model=videoalign', f'--videoalign_dir={ckpt_dir}',
                           f'--qwen_dir={qwen_dir}', '--device=cpu', '--num_frames=9', '--height=32', '--width=32',
                           '--fps=8', '--num_steps=3', '--prompts_per_iter=2', '--group_size=2', '--rollout_batch=2',
                           '--train_batch=1', '--max_iters=1', '--eval_every=0', f'--out_dir={out}',
                           '--eval_prompts=prompts/eval.txt', '--credit=tvrl', '--eval_metrics=', '--diag_every=1'])
    check_credit(out, 1)
