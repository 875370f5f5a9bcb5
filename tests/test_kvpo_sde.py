"""
The SDE on a streaming generator (kvpo/sde_ar.py), GRPO's baseline beside KVPO, against references written
here. python -m pytest tests/test_kvpo_sde.py
- with no stochastic step the rollout is streaming.generate's ODE clip; the SAGE steps move it;
- every recorded transition's log-prob equals torch.distributions.Normal's, its mean and std computed by a
  brute-force replay: one masked full forward of the clean frames before the block (each seeing its
  window, at timestep 0) and the noisy block, the mask built here, and SAGE's mean written out;
- recomputed under the same weights (one teacher-forced forward per step), the clip's log-prob equals the
  rollout's, and its gradient equals the brute-force replay's (through the context keys too);
- kvpo/grpo_ar.py run as a user runs it on the committed toy (ratio 1, no drift from the rollout's log-probs),
  and (slow tier) 2 gloo ranks equal one process.
"""
import math
import os

import pytest
import torch

import sde
from kvpo import sde_ar
import streaming
from streaming import toy_ar

SHAPE, FRAMES, ETA = (4, 2, 2), 6, 0.5  # a frame's latent (C, h, w); past the toy's window of 4


def tiny(seed=0):
    torch.manual_seed(seed)
    cfg = dict(toy_ar.CONFIG, in_channels=4, out_channels=4, num_layers=2, num_attention_heads=2,
               attention_head_dim=8, ffn_dim=32, rope_max_seq_len=64)
    return streaming.install(toy_ar.ToyARTransformer(**cfg), toy_ar.LAYOUT).eval()


def case(steps):
    net = tiny()
    ctx = torch.randn(2, 4, toy_ar.CONFIG['text_dim'], generator=torch.Generator().manual_seed(1))
    noise = torch.randn(2, *SHAPE[:1], FRAMES, *SHAPE[1:], generator=torch.Generator().manual_seed(2))
    gens = [torch.Generator().manual_seed(s) for s in (5, 6)]
    clip, rec = sde_ar.generate(net, noise, ctx, steps, 'sage', ETA, gens)
    return net, ctx, noise, clip, rec


def test_no_stochastic_step_is_the_ode_rollout():
    net, ctx, noise, clip, rec = case([])
    want = streaming.generate(net, noise, ctx)
    assert (clip - want).abs().max() < 1e-5 and torch.equal(rec['logps'], torch.zeros(2, 8, FRAMES))
    _, _, _, noisy, rec = case([0, 3, 7])
    assert (noisy - want).abs().max() > 1e-2 and (rec['logps'][:, [0, 3, 7]] != 0).all()
    assert (rec['stds'][[0, 3, 7]] > 0).all() and (rec['stds'][[1, 2, 4, 5, 6]] == 0).all()


def reference_mean(net, ctx, clean, x, start, k):
    """SAGE's mean of block `start` (1 frame) at step k, its velocity from one masked forward of the clean
    frames before it and the noisy frame x (B, C, 1, h, w); each frame sees what the layout lets it see."""
    L, sig = net.layout, sde_ar.schedule(net.layout)
    s, s1 = sig[k], sig[k + 1]

    def sees(i, j):  # query frame i, key frame j (absolute, 1-frame blocks)
        return j == i or (j < i and (j < L['sink'] or j >= i + 1 - (L['window'] - L['sink'])))
    pos = list(range(start)) + [start]
    mask = torch.tensor([[sees(i, j) for j in pos] for i in pos])
    sg = torch.tensor([[0.0] * start + [s]]).expand(len(x), -1)
    v = streaming.forward_masked(net, torch.cat([clean[:, :, :start], x], 2), sg, ctx, pos, mask)[:, :, -1:]
    var = sde.variance('sage', s, s1, ETA)
    return x + (s1 - s) * v - 0.5 * var / s * (x + (1 - s) * v), math.sqrt(var)  # mean = x + dt v - c noise_hat


def test_log_probs_against_a_brute_force_replay_and_torch_distributions():
    steps = [0, 2, 5, 7]
    net, ctx, noise, clip, rec = case(steps)
    xs = rec['xs']  # (B, S + 1, C, F, h, w)
    assert torch.equal(xs[:, -1], clip)
    for k in steps:
        ref = []
        for b in range(FRAMES):
            with torch.no_grad():
                mean, std = reference_mean(net, ctx, clip, xs[:, k, :, b:b + 1], b, k)
            want = torch.distributions.Normal(mean, std).log_prob(xs[:, k + 1, :, b:b + 1]).flatten(1).mean(1)
            assert (rec['logps'][:, k, b] - want).abs().max() < 1e-5, (k, b)
            ref.append(want)
        # recomputed from the clean clip under the same weights: the rollout's, block-averaged
        got = sde_ar.step_at(net, ctx, xs, k, 'sage', ETA)
        assert (got.logp - rec['logps'][:, k].mean(-1)).abs().max() < 1e-5
        assert (got.std - math.sqrt(sde.variance('sage', sde_ar.schedule(net.layout)[k],
                                                  sde_ar.schedule(net.layout)[k + 1], ETA))).abs().max() < 1e-6


def test_recomputed_gradient_equals_the_brute_force_replays():
    net, ctx, noise, clip, rec = case([1, 4])
    xs, params = rec['xs'], [p for p in net.parameters() if p.requires_grad]
    k, w = 4, torch.tensor([0.7, -1.3])  # a weighted sum of the two clips' log-probs, as an advantage would
    got = torch.autograd.grad((w * sde_ar.step_at(net, ctx, xs, k, 'sage', ETA).logp).sum(), params,
                              allow_unused=True)
    ref = 0
    for b in range(FRAMES):
        mean, std = reference_mean(net, ctx, clip, xs[:, k, :, b:b + 1], b, k)
        ref = ref + torch.distributions.Normal(mean, std).log_prob(xs[:, k + 1, :, b:b + 1]).flatten(1).mean(1)
    want = torch.autograd.grad((w * ref / FRAMES).sum(), params, allow_unused=True)
    flat = lambda gs: torch.cat([(torch.zeros_like(p) if g is None else g).flatten() for g, p in zip(gs, params)])
    g1, g2 = flat(got), flat(want)
    assert g2.norm() > 0 and (g1 - g2).norm() < 1e-4 * g2.norm()


def test_grpo_ar_runs_on_the_toy(tmp_path, monkeypatch):
    # kvpo/grpo_ar.py as a user runs it (in this process): two iterations on the committed toy, two held-out
    # prompts; the rollout policy is the updated one, so the ratio is 1 and the recomputed log-probs are the
    # rollout's (drift: float noise)
    import runpy
    import sys
    from test_train import metrics
    evals = tmp_path / 'eval.txt'
    evals.write_text('\n'.join(open('assets/toy/eval_prompts.txt').read().splitlines()[:2]) + '\n')
    out = str(tmp_path / 'run')
    monkeypatch.setattr(sys, 'argv', ['kvpo.grpo_ar', 'kvpo/config/grpo_toy.py', '--prompts_per_iter=1', '--group=3',
                                      '--max_iters=2', '--eval_every=2', '--save_every=0', f'--eval_prompts={evals}',
                                      f'--out_dir={out}', '--learning_rate=1e-3'])
    runpy.run_module('kvpo.grpo_ar', run_name='__main__')
    rows = metrics(out)
    assert [r['iter'] for r in rows] == [0, 1, 2, 2] and 'eval_composite' in rows[0] and 'eval_manifold' in rows[-1]
    it = [r for r in rows if 'loss' in r]
    assert all(r['ratio_max'] == 1.0 and r['drift'] < 1e-5 and r['grad_norm'] > 0 and r['group_std'] > 0 for r in it)
    assert os.path.exists(os.path.join(out, 'latest'))


@pytest.mark.slow
def test_grpo_ar_two_ranks_equal_one_process(tmp_path):
    # 2 gloo ranks, one prompt each, against one process with both: the same prompts, noises and update
    from test_train import metrics, run, weights
    one, two = str(tmp_path / 'one'), str(tmp_path / 'two')
    args = ['-m', 'kvpo.grpo_ar', 'kvpo/config/grpo_toy.py', '--prompts_per_iter=2', '--group=3', '--max_iters=2',
            '--eval_every=0', '--save_every=0', '--learning_rate=1e-3']
    run(args + [f'--out_dir={one}'])
    run(args + [f'--out_dir={two}'], torchrun=True)
    a, b = weights(one), weights(two)
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5
    for x, y in zip(metrics(one), metrics(two)):
        for k in ('reward', 'group_std', 'grad_norm'):  # the loss is ~0 (advantages sum to 0): float noise
            assert y[k] == pytest.approx(x[k], rel=1e-4, abs=1e-9), k


def test_grpo_ar_shuffled_advantages_same_rollout_other_update(tmp_path, monkeypatch):
    # bench/kvpo_diagnosis.py's control: --adv_shuffle=True permutes each group's advantages, nothing else, so
    # the first rollout (before any update) is the real run's, reward and group std bitwise; the update differs
    # (the permutation of 3 draws is not the identity here); the default stays the real assignment
    import runpy
    import sys
    from test_train import metrics, weights

    def one(name, *extra):
        out = str(tmp_path / name)
        monkeypatch.setattr(sys, 'argv', ['kvpo.grpo_ar', 'kvpo/config/grpo_toy.py', '--prompts_per_iter=1',
                                          '--group=3', '--max_iters=1', '--eval_every=0', '--save_every=0',
                                          '--warmup=1', f'--out_dir={out}', *extra])
        runpy.run_module('kvpo.grpo_ar', run_name='__main__')
        return metrics(out)[0], weights(out)
    (real, w_real), (shuf, w_shuf), (_, w_off) = one('real'), one('shuf', '--adv_shuffle=True'), \
        one('off', '--adv_shuffle=False')
    assert (shuf['reward'], shuf['group_std']) == (real['reward'], real['group_std']) and shuf['grad_norm'] > 0
    assert max((w_real[k] - w_shuf[k]).abs().max().item() for k in w_real) > 0
    assert all(torch.equal(w_real[k], w_off[k]) for k in w_real)
