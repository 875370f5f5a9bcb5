"""
bench/attention.py: its FLOP count of one block against the closed form of attention's FLOPs
(4 B heads S_q S_k d forward, 2.5x that backward), and its GPU timing path at tiny size on a CPU
(every processor x backend a CPU runs gives diffusers' block outputs; the others are reported, not
crashed on). python -m pytest tests/test_bench_attention.py
"""
from bench import attention as ba


def test_flop_count_is_the_closed_form():
    # bench.fullsize_gpu's tiny block (2 heads x 8), 72 video tokens, a CFG pair of 8 + 4 and 3 + 0 valid
    # text tokens padded to T = 8 + 4 + 1 (the masked image token): masked keys attend over all
    # S = V + T tokens per sample, valid tokens over V + 12 and V + 3
    heads, d, V, T = 2, 8, 72, 13
    m, v = (ba.block_flops(9, 64, 96, (8, 4), (3, 0), k, small=True) for k in ('masked_keys', 'valid_tokens'))
    assert (m['V'], m['T'], m['valid']) == (V, T, [12, 3])
    assert m['attn_forward'] == 4 * 2 * heads * (V + T) ** 2 * d
    assert v['attn_forward'] == 4 * heads * d * ((V + 12) ** 2 + (V + 3) ** 2)
    for r in (m, v):
        assert r['attn_forward+backward'] == 3.5 * r['attn_forward']  # the backward: 2.5x the forward
    # everything but the attention is the same: the padded tokens still pass the linear layers
    assert m['forward'] - m['attn_forward'] == v['forward'] - v['attn_forward']


def test_gpu_path_at_tiny_size_on_cpu(monkeypatch):
    monkeypatch.setattr(ba, 'tiny', True)
    monkeypatch.setattr(ba, 'device', 'cpu')
    monkeypatch.setattr(ba, 'reps', 1)
    rows, avail = ba.time_all()
    ran = {(r['processor'], r['backend']) for r in rows if 'ms' in r}
    assert ran >= {(k, b) for k in ('diffusers', 'masked_keys', 'valid_tokens') for b in ('native', '_native_math')}
    assert ('valid_tokens', '_native_flash') in ran  # no mask: valid tokens only
    for r in rows:
        assert 'ms' in r or 'error' in r or 'skipped' in r, r
        if 'ms' in r:  # float32 on a CPU: diffusers' outputs to rounding, and the kernel named
            assert r['max_rel_diff'] < 1e-5 and r['kernels'], r
    assert {r['skipped'] for r in rows if r['backend'] == '_native_flash' and r['processor'] != 'valid_tokens'} == \
        {'takes no mask'}
    md = ba.gpu_report(rows, avail, ba.versions('cpu'))
    assert '| 9x64x96 | 85 | valid_tokens | native |' in md


def test_flops_of_real_sizes_drop_only_the_padding():
    # at 81x352x624 with the fullsize bound (1000 + 256 prompt tokens, a negative of 8): the saving is
    # the padded keys' share of attention, and attention is most of a block
    m, v = (ba.block_flops(81, 352, 624, (1000, 256), (8, 0), k) for k in ('masked_keys', 'valid_tokens'))
    V, T = m['V'], m['T']
    assert (V, T) == (18018, 1257)
    expect = 1 - ((V + 1256) ** 2 + (V + 8) ** 2) / (2 * (V + T) ** 2)
    assert abs((1 - v['attn_forward'] / m['attn_forward']) - expect) < 1e-9
    assert m['attn_forward'] > 0.5 * m['forward']
