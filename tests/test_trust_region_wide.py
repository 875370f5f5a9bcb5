"""
The trust region at a second toy scale (issue 67, item 3): models/toy.py's second base model (the same recipe at
twice the width, loadable through the family interface train.py uses; a missing one names its command) and
bench/trust_region_wide.py (its queue, and its verdict from cached cells against a paired t interval by hand).
python -m pytest tests/test_trust_region_wide.py
"""
import json
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from models import toy  # noqa: E402


def test_wide_base_model_is_the_same_recipe_twice_as_wide(tmp_path, monkeypatch):
    import models
    monkeypatch.setattr(toy, 'STEPS', 2)
    d = tmp_path / 'toy_wide'
    toy.pretrain(str(d), **toy.WIDE)
    cfg = json.load(open(d / 'transformer' / 'config.json'))
    assert cfg['num_attention_heads'] * cfg['attention_head_dim'] == 192  # the toy's: 3 x 32 = 96
    assert {k: cfg[k] for k in toy.CONFIG if k not in toy.WIDE and not isinstance(toy.CONFIG[k], tuple)} == \
        {k: v for k, v in toy.CONFIG.items() if k not in toy.WIDE and not isinstance(v, tuple)}
    assert (d / 'train_prompts.txt').read_text() == open(os.path.join(ROOT, toy.DIR, 'train_prompts.txt')).read()
    fam = models.family(str(d))  # its model_index.json: the toy world's family, as train.py finds it
    assert fam is toy
    net = fam.load_transformer(str(d / 'transformer'))
    trained = sum(p.numel() for p in net.parameters() if p.requires_grad)
    narrow = sum(p.numel() for p in fam.load_transformer(os.path.join(ROOT, toy.DIR, 'transformer')).parameters()
                 if p.requires_grad)
    assert 3.5 < trained / narrow < 4.2  # attention and MLP weights grow as the width squared
    x = torch.randn(2, *toy.LATENT_SHAPE)
    v = toy.policy.velocity(net, x, torch.tensor([0.5, 0.9]), toy.encode_prompts(['a red circle moving left'] * 2))
    assert v.shape == x.shape and v.isfinite().all()


def test_a_missing_wide_base_model_names_its_command(monkeypatch):
    import models
    assert toy.BUILT_DIRS[toy.WIDE_DIR] == 'python -m models.toy wide'
    monkeypatch.setattr(toy, 'BUILT_DIRS', {'assets/toy_wide_not_here': toy.BUILT_DIRS[toy.WIDE_DIR]})
    with pytest.raises(SystemExit, match='is not built .*python -m models.toy wide'):
        models.family('assets/toy_wide_not_here')


@pytest.fixture
def bench(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, 'argv', ['bench.trust_region_wide', '--run=False', f'--out={tmp_path}'])
    sys.modules.pop('bench.trust_region_wide', None)
    from bench import trust_region_wide as W
    yield W
    sys.modules.pop('bench.trust_region_wide', None)


def test_queue_the_verdicts_cells_first_on_the_wide_model(bench, monkeypatch):
    W = bench
    seen = []
    monkeypatch.setattr(W.C, 'cached', lambda name: None)
    monkeypatch.setattr(W.C, 'train', lambda name, ov: seen.append((name, ov)))
    cs = W.cells()
    W.train_all(cs)
    labels = list(cs)
    assert labels == ['dual @ ratio 1, adamw 1e-4', 'none, adamw 5e-5', 'none, adamw 2.5e-5']
    want = [(labels[i], s) for s in range(5) for i in (0, 1)] + [(labels[2], s) for s in range(5)]
    assert [(n, ov['seed']) for n, ov in seen] == [('wide_' + W.P.name(cs[k], s), s) for k, s in want]
    assert all(ov['model'] == toy.WIDE_DIR and ov['max_iters'] == 60 and ov['prompts_per_iter'] == 8 for _, ov in seen)
    dual = seen[0][1]
    assert (dual['kl_strategy'], dual['kl_ratio_target'], dual['kl_init']) == ('dual', 1.0, 0.1)


def fake_run(composite, vq, manifold):
    """A cached cell whose held-out evaluations at iterations 40..60 all read these values."""
    e = lambda it, c, q, m: dict(iter=it, composite=c, VQ=q, MQ=0.4, TA=0.4, manifold=m, alarm=[])  # noqa: E731
    return dict(evals=[e(0, 0.6, 0.28, 0.078)] + [e(it, composite, vq, manifold) for it in range(40, 61, 5)],
                iters=[dict(kl_ratio=1.0, lambda_kl=0.2)] * 60)


def write(W, name, run):
    os.makedirs(os.path.join(W.out, 'cells'), exist_ok=True)
    with open(os.path.join(W.out, 'cells', name + '.json'), 'w') as f:
        json.dump(dict(run, model_hash=W.C.MODEL_HASH), f)


@pytest.mark.parametrize('vq_drop', [0.0, 0.05])
def test_verdict_against_the_best_none_by_a_paired_t_interval(bench, vq_drop):
    W = bench
    cs = W.cells()
    dual, none5, none25 = cs.values()
    diffs = [0.05, 0.07, 0.06, 0.08, 0.04]  # dual - none @ 5e-5 on composite, per seed
    for s, d in enumerate(diffs):
        base = 0.7 + 0.01 * s  # a seed's level, shared by its cells (paired)
        write(W, 'wide_' + W.P.name(none5, s), fake_run(base, 0.30, 0.07))
        write(W, 'wide_' + W.P.name(none25, s), fake_run(base - 0.02, 0.31, 0.069))
        write(W, 'wide_' + W.P.name(dual, s), fake_run(base + d, 0.30 - vq_drop + 0.001 * s, 0.065))
    res, md = W.report(cs)
    # by hand: mean 0.06, sample sd sqrt(0.001 / 4), t(0.975, 4) = 2.7764 -> half-width 0.0196
    h = 2.7764 * (0.001 / 4) ** 0.5 / 5 ** 0.5
    ci = res['verdicts']['dual @ ratio 1, adamw 1e-4 vs none, adamw 5e-5']['composite']
    assert ci['mean'] == pytest.approx(0.06) and ci['hi'] - ci['mean'] == pytest.approx(h, rel=1e-3)
    assert "the best 'none' (AdamW at 5e-5; 'none' at 5e-5 (5 seeds), 2.5e-5 (5 seeds))" in res['sentence']
    assert res['dual_wins'] is (vq_drop == 0.0)  # a VQ that falls beyond noise takes the win away
    assert ('beats the best' in res['sentence']) is (vq_drop == 0.0)
    assert res['cells']['wide (192): dual @ ratio 1, adamw 1e-4']['kl_ratio'] == pytest.approx(1.0)
    assert any(res['sentence'] in line for line in md)
