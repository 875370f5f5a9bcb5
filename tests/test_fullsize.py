"""
bench/fullsize.py's pieces (bench/fullsize_measure.py, fullsize_wan.py, fullsize_gpu.py): the
fake-tensor estimate against a real CPU run of the same small config (peak resident memory of a fresh
process), the fixed-order forward against diffusers' own, the attention stand-in's FLOPs and bytes
against their closed forms, and the GPU check at tiny size.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from bench import fullsize_measure as bf
from bench import fullsize_wan as bw
from bench.fullsize_gpu import TINY

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, 'tests'))  # tiny_hunyuan
# a small transformer with ~0.9 GB of training state (fp32 params, grads, AdamW, anchor: 20 bytes
# a parameter, 48M parameters) and 1152 video tokens, so activations count too
SMALL = dict(bf.load_config(os.path.join(ROOT, bf.model_config)), num_layers=2, num_attention_heads=8,
             attention_head_dim=64, rope_axes_dim=(16, 24, 24), text_embed_dim=64, text_embed_2_dim=64,
             image_embed_dim=32, num_refiner_layers=1)
RUN = dict(what='train', Fr=9, H=256, W=384, world=0, attn='math', bf16=False, n_store=1, L=(30, 10))


def test_estimate_matches_a_real_cpu_run():
    est = bf.measure(SMALL, **RUN)
    code = ('import json; from bench import fullsize_measure as bf; from tests.test_fullsize import SMALL, RUN; '
            'r = bf.rss_run(SMALL, **RUN); print("RSS", r["rss_growth"])')
    # a fixed mmap threshold: glibc then returns every freed tensor to the OS at once, so the
    # resident-memory peak is the peak of live tensors, not of the allocator's cache
    env = dict(os.environ, OMP_NUM_THREADS='1', MALLOC_MMAP_THRESHOLD_='65536', PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, '-c', code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    real = float(out.stdout.split('RSS')[-1])
    state = 20 * est['P']  # bytes of params + grads + AdamW + anchor
    assert state > 300e6
    fake = est['peak']['Total']
    assert abs(fake / real - 1) < 0.25, (fake / 2 ** 20, real / 2 ** 20)


def test_fixed_order_forward_is_diffusers_forward():
    # all text tokens valid: the reorder in diffusers' forward is then the identity on the tokens
    from diffusers import HunyuanVideo15Transformer3DModel as T
    from models.hunyuan15 import set_attention
    from models.policy import velocity
    from tiny_hunyuan import random_norm_gains
    torch.manual_seed(0)
    model = random_norm_gains(T(**TINY).eval())  # qk-norm gains that tell the four norms apart
    x, s = torch.randn(2, 4, 3, 4, 6), torch.tensor([0.7, 0.3])
    text = [torch.randn(2, 5, 16), torch.ones(2, 5), torch.randn(2, 3, 8), torch.ones(2, 3)]
    neg = [torch.randn(2, 4, 16), torch.ones(2, 4), torch.randn(2, 3, 8), torch.ones(2, 3)]
    with torch.no_grad():
        ref = velocity(model, x, s, text, cfg=6.0, text_neg=neg)  # diffusers' forward and attention processor
        set_attention(model, bf.processor)  # the bench's attention: train.py's (masked keys)
        model.forward = lambda *a: bf.transformer(model, *a)
        got = bf.velocity(model, x, s, text, neg, bf16=False)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)


def test_wan_rows_run_train_pys_velocity():
    # the Wan rows' forward (wan_velocity, on a model wan_build makes) is model.velocity's, text
    # padding and CFG included; and wan_tokens counts what the patch embedding makes
    from diffusers import WanTransformer3DModel as W
    from models.policy import velocity
    cfg = dict(num_attention_heads=2, attention_head_dim=12, in_channels=16, out_channels=16, text_dim=16,
               ffn_dim=32, num_layers=2, rope_max_seq_len=32)
    torch.manual_seed(0)
    model = W(**cfg).eval()
    assert type(bw.wan_build(cfg)) is W and bw.WAN.blocks(model) is model.blocks
    x, s = torch.randn(2, 16, 3, 4, 6), torch.tensor([0.7, 0.3])  # 9 frames at 32x48
    text, neg = [torch.randn(2, 5, 16), torch.ones(2, 5)], [torch.randn(2, 2, 16), torch.ones(2, 2)]
    with torch.no_grad():
        torch.testing.assert_close(bw.wan_velocity(model, x, s, text, neg, bf16=False),
                                   velocity(model, x, s, text, cfg=5.0, text_neg=neg))
        assert model.patch_embedding(x).flatten(2).shape[2] == bw.wan_tokens(9, 32, 48) == 3 * 2 * 3


def test_bench_attention_is_set_as_the_load_path_sets_it():
    # build() sets the blocks' attention with hunyuan15.set_attention, as model.load_transformer does;
    # masked keys: train.py's 'masked_keys' (its default, valid_tokens, needs mask values fake tensors lack)
    from models import attention
    from models import hunyuan15
    net = bf.build(TINY, checkpointing=False)
    assert bf.processor == 'masked_keys' and bf.processor in attention.ATTENTIONS
    assert all(type(b.attn.processor) is hunyuan15.MaskedKeysAttention for b in net.transformer_blocks)


def test_gpu_attention_allocates_and_counts_what_the_kernel_does():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker
    B, heads, S, d = 2, 16, 5000, 128
    with FakeTensorMode():
        q, k, v = (torch.randn(B, heads, S, d, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        mask = torch.ones(B, 1, S, S, dtype=torch.bool)
        mt, fc = MemTracker(), bf.FlopCount()
        mt.track_external(q, k, v, mask)
        with mt, fc:
            out = bf.gpu_attention(q, k, v, attn_mask=mask)
            fwd = fc.total
            out.sum().backward()
        peak = max(s['Total'] for s in mt.get_tracker_snapshot('peak').values())
    assert fwd == 4 * B * heads * S * S * d  # QK^T and AV
    assert fc.total == 3.5 * fwd  # backward: 2.5x the forward (five matmuls of the same size)
    inputs = 3 * B * heads * S * d * 2 + B * S * S
    # no (heads, S, S) weights: beyond the inputs, the bf16 bias and its padded copy (B, S, S)
    # and tensors of q's size dominate; the math path would hold B*heads*S*S*2 = 1.6 GB
    assert peak - inputs < 3 * B * S * S * 2 + 10 * B * heads * S * d * 4
    assert peak < B * heads * S * S * 2 / 2


def test_gpu_check_at_tiny_size_on_cpu():
    env = dict(os.environ, OMP_NUM_THREADS='1')
    out = subprocess.run([sys.executable, '-m', 'bench.fullsize_gpu', '--tiny', '--device=cpu'], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.split('CHECK_JSON ')[-1])
    for name in ('anchor forward', 'policy forward', 'backward', 'optimizer step', 'rollout forward'):
        assert res[name]['seconds'] > 0 and res[name]['peak_gib'] > 0
    # CPU kernels are batch-invariant: a clip's log-prob does not depend on its batch
    assert res['ratio_distance'] == 0.0


def test_sequence_parallel_splits_a_clips_work():
    """The full-size bench's sp runs (sp.enable over a fake 8-rank group, as train.py sets it): at sp 2
    a rank does half the FLOPs of a rollout forward (Ulysses adds none; the 41 text tokens pad to 42)
    and holds fewer activation bytes, while its stored rollout doubles (an sp group shares its clips)."""
    one, two = (bf.measure(SMALL, 'rollout', 9, 256, 384, world=8, sp=n, L=(30, 10)) for n in (1, 2))
    f1, f2 = (r['phases']['rollout forward']['flops'] for r in (one, two))
    assert abs(f2 / f1 - 0.5) < 0.02, f2 / f1
    c1, c2 = bf.categories(one), bf.categories(two)
    assert c2['activations'] < 0.75 * c1['activations'], (c1['activations'], c2['activations'])
    assert abs(c2['stored rollout (fp32)'] / c1['stored rollout (fp32)'] - 2) < 0.01  # (+ one micro-batch's text)
    with pytest.raises(ValueError, match='do not split'):  # 3 x 17 x 23 video tokens, odd
        bf.measure(SMALL, 'rollout', 9, 272, 368, world=8, sp=2, L=(30, 10))


# Wan 2.2 A14B (bench/fullsize_wan22.py): the shallow builds carried to 40 layers
RUNS = os.path.join(ROOT, 'results', 'fullsize_runs')
TINY_WAN = dict(num_attention_heads=2, attention_head_dim=12, in_channels=16, out_channels=16, text_dim=16,
                ffn_dim=32, num_layers=2, rope_max_seq_len=32)


@pytest.mark.parametrize('sp', [1, 2])
@pytest.mark.parametrize('what', ['train', 'rollout'])
def test_depth_line_gives_the_full_depth_wan_14b_runs(what, sp):
    # Wan 2.1 14B measured at 4, 6 and 8 layers (kept runs) and carried to 40 on the line through the
    # first two: every byte category, the peak phase and the FLOPs of the 40-layer run measured in full
    from bench import fullsize_wan22 as bw22
    name = lambda d: f'a14b_val14b_sp{sp}_{what}_81x480x832_L{d}.json'
    full = 'wan' + ('sp2' if sp == 2 else '') + f'_14b_fsdp8_{what}_81x480x832.json'
    if not all(os.path.exists(os.path.join(RUNS, f)) for f in [full] + [name(d) for d in (4, 6, 8)]):
        pytest.skip('kept runs absent: python -m bench.fullsize --only=a14b,wan,wansp')
    load = lambda f: json.load(open(os.path.join(RUNS, f)))
    runs = [dict(load(name(d)), layers=d) for d in (4, 6, 8)]
    got, ref = bw22.line(runs, 40), load(full)
    assert got['peak_phase'] == ref['peak_phase'] and got['check'] < 1e-6  # the third depth on the line
    a, b = bf.categories(got), bf.categories(ref)
    assert all(abs(a[k] - b[k]) < 2 ** 20 for k in b), {k: (a[k], b[k]) for k in b}  # within 1 MiB
    for k, ph in ref['phases'].items():
        assert abs(got['phases'][k]['flops'] / ph['flops'] - 1) < 1e-9 if ph['flops'] else got['phases'][k]['flops'] == 0
    assert abs(got['P'] - ref['P']) < 1  # 14.288 B parameters


def test_a14b_forward_is_experts_forward():
    # the bench's fixed routing (every sample above the boundary) gives Experts.forward's velocity, and
    # runs the idle expert (on one token) exactly when the update's Experts.forward does: with grad on
    from diffusers import WanTransformer3DModel as W
    from bench import fullsize_wan22 as bw22
    from models import wan
    torch.manual_seed(0)
    net = wan.Experts(W(**TINY_WAN).eval(), W(**TINY_WAN).eval(), 0.875)
    x, s = torch.randn(2, 16, 3, 4, 6), torch.tensor([0.9, 0.95])
    text = [torch.randn(2, 5, 16), torch.ones(2, 5)]
    for grad in (True, False):
        calls = []
        hooks = [e.register_forward_pre_hook(lambda m, a, kw, i=i: calls.append(i), with_kwargs=True)
                 for i, e in enumerate(net.experts)]
        with torch.set_grad_enabled(grad):
            ref = net(x, 1000 * s, text, net.high(s))
            n = len(calls)
            got = bw22.forward(net, x, 1000 * s, text)
        for h in hooks:
            h.remove()
        torch.testing.assert_close(got, ref)
        assert calls[:n] == calls[n:] == ([0, 1] if grad else [0])


@pytest.mark.slow  # three measured micro-steps, ~40 s alone (per-op bookkeeping): .ci/run's slow tier
def test_a14b_measure_is_a_line_in_depth():
    # the A14B family through measure() (FSDP2 over 8 fake ranks, one expert trained, the other frozen
    # in bf16) at 4, 5 and 6 layers an expert: the third on the line of the first two, and the idle
    # expert's resident bytes read off the categories at 40 layers are its shards on rank 0
    # (ceil(rows / 8) rows of each parameter: FSDP2 pads dim 0 to a multiple of the ranks)
    from bench import fullsize_wan22 as bw22
    cfg = dict(bf.load_config(os.path.join(ROOT, bw22.a14b_config)), **TINY_WAN)
    runs = []
    for d in (4, 5, 6):
        r = bf.measure(dict(cfg, num_layers=d), 'train', 5, 32, 64, world=8, fam=bw22.family('high', torch.bfloat16),
                       n_store=1, rollout_n=1)
        runs.append(dict(json.loads(json.dumps(r, default=str)), layers=d))
    assert runs[0]['P_trainable'] * 2 == runs[0]['P']  # one expert of two trains
    line = bw22.line(runs, 40)
    assert line['check'] < 1e-6, line['check']
    idle = bw22.idle_bytes(dict(line, categories=bf.categories(line), key='onebf16'))
    frozen = bw22.build(dict(cfg, num_layers=40), 'high', torch.bfloat16).transformer_2
    shard = sum(-(-p.shape[0] // 8) * p[0].numel() * p.element_size() for p in frozen.parameters())
    assert idle == shard, (idle, shard)
