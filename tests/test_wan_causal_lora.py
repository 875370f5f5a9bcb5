"""
The streaming converter's LoRA merge (models/wan_causal.merge_lora) against peft's own merge
(merge_and_unload) of the same adapters on a module named as Wan's original checkpoint names it.
python -m pytest tests/test_wan_causal_lora.py
- a LoRA file without an alpha merges at scale alpha / r = 1 (alpha = r: peft's merge at lora_alpha = r);
  with lora_alpha given, at alpha / r (peft's merge at that lora_alpha);
- a LoRA of a non-square weight (the feed-forward's 24 -> 32 and 32 -> 24) merges; its transpose (A of
  the output's width, B of the input's) is one SystemExit naming the module and both shapes;
- a checkpoint's keys lose a wrapper's prefix (module., _orig_mod., _fsdp_wrapped_module., model.; nested
  wrappers in any order),
  the entry is 'generator' unless one is named ('generator_ema'; one missing is a SystemExit naming what
  the file holds); peft's in-memory keys (.default) merge as the saved ones; half a pair is refused.
"""
import os

import pytest
import torch
from torch import nn

from streaming import wan_causal

R, DIM, FFN = 4, 24, 32


def original_wan():
    """Two blocks' adapted Linears, under the original Wan names (blocks.N.self_attn.q, ffn.0, ffn.2)."""
    torch.manual_seed(0)
    net = nn.Module()
    net.blocks = nn.ModuleList()
    for _ in range(2):
        b = nn.Module()
        b.self_attn = nn.Module()
        b.self_attn.q = nn.Linear(DIM, DIM)
        b.ffn = nn.Sequential(nn.Linear(DIM, FFN), nn.GELU(), nn.Linear(FFN, DIM))
        net.blocks.append(b)
    return net


def peft_lora(alpha, state=None):
    """(peft model of original_wan() with a rank-R LoRA at lora_alpha = alpha, its adapter state dict): random
    A and B (peft starts B at 0), or `state` loaded."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
    model = get_peft_model(original_wan(), LoraConfig(r=R, lora_alpha=alpha, target_modules=['self_attn.q', 'ffn.0',
                                                                                              'ffn.2']))
    if state is None:
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if 'lora_' in n:
                    p.copy_(torch.randn(p.shape, generator=g))
    else:
        set_peft_model_state_dict(model, state)
    return model, get_peft_model_state_dict(model)


def diffusers_named(net):
    """The base weights of original_wan's Linears, converted to diffusers names as the converter does."""
    return wan_causal.to_diffusers({k: v.detach().clone() for k, v in net.state_dict().items() if k.endswith('weight')})


def merged_by_peft(model):
    return {k: v for k, v in diffusers_named(model.merge_and_unload()).items()}


def test_lora_without_alpha_merges_at_alpha_r_and_with_alpha_at_alpha_over_r(tmp_path):
    base = diffusers_named(original_wan())
    assert base['blocks.0.ffn.net.0.proj.weight'].shape == (FFN, DIM)  # non-square: 24 -> 32
    model, state = peft_lora(R)
    assert state and all(k.startswith('base_model.model.blocks.') for k in state)  # peft's own names
    file = os.path.join(tmp_path, 'lora.pt')
    torch.save({'generator_lora': state}, file)  # as LongLive saves it
    want = merged_by_peft(model)
    got = wan_causal.merge_lora(base, file)  # no alpha: alpha = r, scale 1
    assert set(got) == set(base) and len(want) == len(base) == 6
    for k in base:
        assert (got[k] - base[k]).abs().max() > 1e-3, k  # every adapted weight moved
        assert torch.allclose(got[k], want[k], atol=1e-5), k
    alpha = 8.0  # given: scale alpha / r = 2
    want = merged_by_peft(peft_lora(alpha, state)[0])
    got = wan_causal.merge_lora(base, file, alpha)
    assert all(torch.allclose(got[k], want[k], atol=1e-5) for k in base)
    assert not torch.allclose(got['blocks.1.attn1.to_q.weight'], wan_causal.merge_lora(base, file)['blocks.1.attn1.to_q.weight'])


def test_lora_of_a_non_square_weight_is_checked_the_right_way_round(tmp_path):
    base = diffusers_named(original_wan())
    g = torch.Generator().manual_seed(2)
    A, B = torch.randn(R, DIM, generator=g), torch.randn(FFN, R, generator=g)  # ffn.0: 24 -> 32
    right = os.path.join(tmp_path, 'right.pt')
    torch.save({'base_model.model.blocks.0.ffn.0.lora_A.weight': A,
                'base_model.model.blocks.0.ffn.0.lora_B.weight': B}, right)  # a bare peft state dict
    got = wan_causal.merge_lora(base, right)
    k = 'blocks.0.ffn.net.0.proj.weight'
    assert torch.allclose(got[k], base[k] + B @ A, atol=1e-5)
    assert all(torch.equal(got[j], base[j]) for j in base if j != k)
    wrong = os.path.join(tmp_path, 'wrong.pt')  # the transpose: A (r, 32), B (24, r)
    torch.save({'base_model.model.blocks.0.ffn.0.lora_A.weight': B.T.contiguous(),
                'base_model.model.blocks.0.ffn.0.lora_B.weight': A.T.contiguous()}, wrong)
    with pytest.raises(SystemExit, match=r"blocks\.0\.ffn\.net\.0\.proj.* 24x32, the weight \(32, 24\)"):
        wan_causal.merge_lora(base, wrong)


def test_checkpoint_keys_wrappers_stripped_and_the_entry_picked(tmp_path):
    # a training checkpoint's generator under a wrapper's prefix (the self-forcing wrapper's model., FSDP's
    # _fsdp_wrapped_module., compile's _orig_mod., DDP's module.), in 'generator' and 'generator_ema'
    g = torch.Generator().manual_seed(3)
    W, E = torch.randn(DIM, DIM, generator=g), torch.randn(DIM, DIM, generator=g)
    file = os.path.join(tmp_path, 'ckpt.pt')
    torch.save({'generator': {'model.blocks.0.self_attn.q.weight': W, '_fsdp_wrapped_module.blocks.0.self_attn.k.weight': W,
                              '_orig_mod.blocks.0.self_attn.v.weight': W, 'module.blocks.0.self_attn.o.weight': W},
                'generator_ema': {'model.blocks.0.self_attn.q.weight': E}, 'step': torch.tensor(7)}, file)
    assert set(wan_causal.read_state(file)) == {f'blocks.0.self_attn.{m}.weight' for m in 'qkvo'}
    assert torch.equal(wan_causal.read_state(file)['blocks.0.self_attn.q.weight'], W)
    assert torch.equal(wan_causal.read_state(file, 'generator_ema')['blocks.0.self_attn.q.weight'], E)
    with pytest.raises(SystemExit, match="no 'generator_x' in the checkpoint .*generator, generator_ema, step"):
        wan_causal.read_state(file, 'generator_x')
    # a peft state dict as held in memory (the adapter's name, .default, in every key) merges as the saved one
    base = diffusers_named(original_wan())
    A, B = torch.randn(R, DIM, generator=g), torch.randn(DIM, R, generator=g)
    lora = os.path.join(tmp_path, 'lora.pt')
    torch.save({'base_model.model.blocks.1.self_attn.q.lora_A.default.weight': A,
                'base_model.model.blocks.1.self_attn.q.lora_B.default.weight': B}, lora)
    got = wan_causal.merge_lora(base, lora)
    assert torch.allclose(got['blocks.1.attn1.to_q.weight'], base['blocks.1.attn1.to_q.weight'] + B @ A, atol=1e-5)
    half = os.path.join(tmp_path, 'half.pt')
    torch.save({'base_model.model.blocks.1.self_attn.q.lora_A.weight': A}, half)
    with pytest.raises(SystemExit, match="LoRA of 'blocks.1.attn1.to_q' is half a pair"):
        wan_causal.merge_lora(base, half)


def test_nested_wrappers_stripped_in_any_order(tmp_path):
    W = torch.zeros(DIM, DIM)
    file = os.path.join(tmp_path, 'ckpt.pt')
    torch.save({'generator': {'_fsdp_wrapped_module.model.blocks.0.self_attn.q.weight': W,
                              '_orig_mod._fsdp_wrapped_module.blocks.0.self_attn.k.weight': W,
                              'module.model.blocks.0.self_attn.v.weight': W}}, file)  # DDP around the wrapper
    assert set(wan_causal.read_state(file)) == {f'blocks.0.self_attn.{m}.weight' for m in 'qkv'}
