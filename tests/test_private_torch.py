"""
The private torch functions the code calls (torch.optim._muon's Newton-Schulz and lr rule in
infra/optimizer.py; torch._C's allocator setter and getter in infra/parallel.py), hidden as a torch
without them would have none: the optimizer steps as with them (the stand-ins are the same math) and the
allocator setting falls back to its environment variable, each missing function said once in the log.

    python -m pytest tests/test_private_torch.py
"""
import torch
import torch.optim._muon as torch_muon

from infra import optimizer, parallel


def muon_steps(seed=0):
    """Three Muon steps of a tall and a wide matrix (both orientations of Newton-Schulz): their weights."""
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(12, 40), torch.nn.Linear(40, 6))
    opt = optimizer.build(net, 'muon', lr=1e-2, weight_decay=0.01)
    for _ in range(3):
        net(torch.randn(5, 12)).square().mean().backward()
        for o in opt:
            o.step()
        optimizer.zero_grad(opt)
    return [p.detach().clone() for p in net.parameters()]


def test_muon_without_torchs_private_functions_steps_as_with_them(monkeypatch, capsys):
    with_them = muon_steps()
    monkeypatch.setattr(optimizer, '_SAID', set())
    monkeypatch.delattr(torch_muon, '_zeropower_via_newtonschulz')
    monkeypatch.delattr(torch_muon, '_adjust_lr')
    without = muon_steps()
    for a, b in zip(with_them, without):  # bf16 iterations, fused (torch) or not (ours): a rounding apart
        assert torch.allclose(a, b, rtol=0, atol=1e-4), (a - b).abs().max()
    said = [l for l in capsys.readouterr().out.splitlines() if l.startswith('optimizer: torch')]
    assert len(said) == 2 and '_zeropower_via_newtonschulz' in said[0] + said[1]  # once each, over 6 steps


def test_newton_schulz_is_torchs():
    torch.manual_seed(0)
    coefficients = (3.4445, -4.775, 2.0315)  # torch.optim.Muon's defaults
    for shape in ((16, 48), (48, 16)):
        G = torch.randn(*shape)
        ours = optimizer.newton_schulz(G, coefficients, 5, 1e-7).float()
        theirs = torch_muon._zeropower_via_newtonschulz(G, coefficients, 5, 1e-7).float()
        assert ours.shape == G.shape and (ours - theirs).abs().max() < 2e-2 * theirs.abs().max()
        s = torch.linalg.svdvals(ours)
        assert 0.4 < s.min() and s.max() < 1.6  # orthogonal up to the iteration's spread
    assert optimizer.adjust_lr(1.0, (40, 12)) == torch_muon._adjust_lr(1.0, 'match_rms_adamw', (40, 12))


def test_the_allocator_setting_without_torchs_private_setter(monkeypatch, capsys):
    monkeypatch.setattr(parallel, '_SAID', set())
    monkeypatch.delenv('PYTORCH_CUDA_ALLOC_CONF', raising=False)
    monkeypatch.delenv('PYTORCH_ALLOC_CONF', raising=False)
    monkeypatch.delattr(torch._C, '_accelerator_setAllocatorSettings')
    monkeypatch.delattr(torch._C, '_accelerator_getAllocatorSettings')
    parallel.expandable_segments()
    import os
    assert os.environ['PYTORCH_CUDA_ALLOC_CONF'] == 'expandable_segments:True'  # for torch's own first read
    monkeypatch.delenv('PYTORCH_CUDA_ALLOC_CONF')
    parallel.expandable_segments()
    assert parallel._torch_private('_accelerator_getAllocatorSettings', 'the environment') is None
    parallel._torch_private('_accelerator_getAllocatorSettings', 'the environment')
    said = [l for l in capsys.readouterr().out.splitlines() if l.startswith('allocator: torch')]
    assert len(said) == 2 and 'setAllocatorSettings' in said[0] and 'getAllocatorSettings' in said[1], said
