"""
GPU memory the fake-tensor accounting (bench/fullsize.py) cannot see, issue 49 item 6, on the CPU with
CUDA simulated where only CUDA shows it:
- the allocator runs with expandable segments (set before CUDA starts; a user's own setting kept);
- the log's peaks: allocated and reserved, both started again each iteration;
- the reward-hacking watchers (CLIP-L, PickScore) in bf16 on a GPU, and a bf16 scorer scores as fp32 does;
- the VAE's encoder (decode only) is dropped at load, and decoding is unchanged;
- the anchor's swap reuses one buffer: the second applied() allocates nothing, the first at most the
  largest weight (was: a copy of every trainable weight per micro-batch, 3.9 GB a GPU at 8.3B).
What a failure would show: reserved memory growing past allocated over iterations until an OOM that the
allocated peak never predicted; a peak that never comes down after one evaluation.

    python -m pytest tests/test_launch_memory.py
"""
import os
import sys
import types

import pytest
import torch

from extras import metrics
from infra import parallel
from models import policy as M
from infra.anchor import Anchor

sys.path.insert(0, os.path.dirname(__file__))
from tiny_clip import make_tiny_clip  # noqa: E402
from tiny_hunyuan import make_tiny_hunyuan  # noqa: E402
from tiny_wan import make_tiny_wan  # noqa: E402


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda as a GPU process sees it: available, peaks to read (GiB), a reset that records itself."""
    state = dict(allocated=3.0, reserved=5.0, resets=0)
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)
    monkeypatch.setattr(torch.cuda, 'max_memory_allocated', lambda *a: state['allocated'] * 2 ** 30)
    monkeypatch.setattr(torch.cuda, 'max_memory_reserved', lambda *a: state['reserved'] * 2 ** 30)
    monkeypatch.setattr(torch.cuda, 'reset_peak_memory_stats', lambda *a: state.update(resets=state['resets'] + 1))
    return state


@pytest.mark.parametrize('user', [None, 'PYTORCH_CUDA_ALLOC_CONF', 'PYTORCH_ALLOC_CONF'])
def test_expandable_segments_before_cuda_starts(fake_cuda, monkeypatch, user):
    for k in ('RANK', 'PYTORCH_CUDA_ALLOC_CONF', 'PYTORCH_ALLOC_CONF'):
        monkeypatch.delenv(k, raising=False)
    if user:
        monkeypatch.setenv(user, 'max_split_size_mb:512')
    assert parallel.init('cuda', 10.0) == (False, 0, 1, 'cuda')  # one process: no process group
    if user:  # the user's own allocator config stays as it is
        assert os.environ[user] == 'max_split_size_mb:512' and len({'PYTORCH_CUDA_ALLOC_CONF', 'PYTORCH_ALLOC_CONF'}
                                                                  & set(os.environ)) == 1
    else:
        assert os.environ['PYTORCH_CUDA_ALLOC_CONF'] == 'expandable_segments:True'
    monkeypatch.delenv('PYTORCH_CUDA_ALLOC_CONF', raising=False)
    parallel.init('cpu', 10.0)
    assert 'PYTORCH_CUDA_ALLOC_CONF' not in os.environ or user == 'PYTORCH_CUDA_ALLOC_CONF'  # CPU: not touched


def test_peaks_allocated_and_reserved_reset_each_iteration(fake_cuda, monkeypatch):
    assert parallel.peak_memory_gb('cuda').tolist() == [3.0]  # the existing call: allocated
    assert parallel.peak_memory_gb('cuda', 'reserved').tolist() == [5.0]
    parallel.reset_peak_memory('cuda')
    assert fake_cuda['resets'] == 1
    parallel.reset_peak_memory('cpu')  # a process's resident peak cannot be reset: nothing to do
    assert fake_cuda['resets'] == 1
    # train.py logs both, and starts the next iteration's peaks after its row
    src = open(os.path.join(os.path.dirname(os.path.dirname(__file__)), 'train.py')).read()
    assert 'parallel.peak_memory(device)' in src and 'parallel.reset_peak_memory(device)' in src
    monkeypatch.setattr(parallel.dist, 'is_initialized', lambda: False)
    assert parallel.peak_memory('cuda') == dict(peak_mem_gb=3.0, peak_mem_gb_ranks=[3.0], peak_mem_reserved_gb=5.0)


def test_watchers_in_bf16_on_a_gpu_score_as_fp32(tmp_path, monkeypatch):
    moved = []

    class Model:
        def to(self, *args):
            moved.append(args)
            return self
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: False)
    metrics.move({'clipscore': types.SimpleNamespace(model=Model())}, 'cuda:3')
    metrics.move({'clipscore': types.SimpleNamespace(model=Model())}, 'cpu')
    assert moved == [('cuda:3', torch.bfloat16), ('cpu', None)]  # back on the CPU: the dtype stays
    # a real scorer held in bf16 (as on a GPU) scores the frames as in fp32, to bf16's rounding
    path = make_tiny_clip(str(tmp_path), 'clip')
    fn = metrics.load_clipscore(path)
    frames = torch.rand(2, 3, 3, 40, 56, generator=torch.Generator().manual_seed(0))
    prompts = ['a cat walks on the grass', 'a red circle moving left']
    fp32 = fn(frames, prompts)
    fn.model.to(None, torch.bfloat16)
    assert next(fn.model.parameters()).dtype == torch.bfloat16
    torch.testing.assert_close(fn(frames, prompts), fp32, atol=0.02, rtol=0)  # cosines in 2.5 x [0, 1]


@pytest.mark.parametrize('make', [make_tiny_hunyuan, make_tiny_wan], ids=['hunyuan', 'wan'])
def test_the_vae_encoder_is_dropped_and_decoding_unchanged(make, tmp_path, monkeypatch):
    root = make(tmp_path)
    fam = M.family(root)
    cls = {'models.hunyuan15': 'AutoencoderKLHunyuanVideo15', 'models.wan': 'AutoencoderKLWan'}[fam.__name__]
    import diffusers
    vae_class = getattr(diffusers, cls)
    full = vae_class.from_pretrained(root, subfolder='vae', torch_dtype=torch.float32)
    assert sum(p.numel() for p in full.encoder.parameters()) > 0
    built = []
    real = vae_class.from_pretrained.__func__
    monkeypatch.setattr(vae_class, 'from_pretrained', classmethod(lambda c, *a, **k: built.append(real(c, *a, **k))
                                                                  or built[-1]))
    decode = M.load_decoder(root, 'cpu')
    vae = built[0]
    assert vae.encoder is None  # no encoder weights held (never moved to a GPU)
    assert getattr(vae, 'quant_conv', None) is None
    C, F, h, w = M.latent_shape(root, 9, 32, 32)
    z = torch.randn(1, C, F, h, w, generator=torch.Generator().manual_seed(0))
    ref = vae_class.from_pretrained(root, subfolder='vae', torch_dtype=vae.dtype)  # encoder kept
    with torch.no_grad():
        frames = decode(z)
        if fam.__name__ == 'models.hunyuan15':
            ref.enable_tiling()
            ref.enable_slicing()
            want = ref.decode(z.to(ref.dtype) / ref.config.scaling_factor, return_dict=False)[0]
        else:
            ref.enable_slicing()
            mean = torch.tensor(ref.config.latents_mean).view(1, -1, 1, 1, 1)
            std = torch.tensor(ref.config.latents_std).view(1, -1, 1, 1, 1)
            want = ref.decode(z.float() * std + mean, return_dict=False)[0]
    want = ((want.float().clamp(-1, 1) + 1) / 2).permute(0, 2, 1, 3, 4)
    assert torch.equal(frames, want)


class _NewMemory(torch.utils._python_dispatch.TorchDispatchMode):
    """Bytes of every tensor an op returns in storage none of its inputs had: what a call allocates."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs))
                if isinstance(t, torch.Tensor)}
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                self.bytes += t.untyped_storage().nbytes()
        return out


def test_anchor_swap_reuses_one_buffer():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
    anchor = Anchor(model, 'dual', every=10)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}  # the anchor's weights
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # the policy moves away from the anchor
    policy = {n: p.detach().clone() for n, p in model.named_parameters()}
    x = torch.randn(4, 16)
    with torch.no_grad():
        expected = torch.func.functional_call(model, initial, (x,))
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    for call in range(3):
        with _NewMemory() as new:
            with anchor.applied(model):  # the swap in and out alone
                pass
        assert new.bytes <= (largest if call == 0 else 0), (call, new.bytes, largest)  # was: every weight, each call
        with anchor.applied(model):
            out = model(x)
        assert torch.equal(out, expected)  # the anchor's forward
        assert all(torch.equal(p, policy[n]) for n, p in model.named_parameters())  # the policy back, bitwise
        assert all(torch.equal(w, initial[n]) for n, w in anchor.state_dict().items())  # the anchor kept
