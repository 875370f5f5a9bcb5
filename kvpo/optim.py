"""
What KVPO trains and how it steps (docs/kvpo.md section 1, item 7): the adapter, the precision and the
learning-rate schedule, each as released with the alternative the toy uses.

    adapter 'checkpoint' (released): the streaming model's own LoRA (LongLive's, rank 256, alpha 256) kept
      as a trainable adapter on all 10 Linear layers of each block, W x + alpha / r B A x, A and B trained on
    adapter 'merged': that LoRA merged into W (streaming/wan_causal.py), a fresh adapter (B = 0) of lora_rank
      on the family's LORA_TARGETS (the attention projections)
    train_dtype 'bfloat16' (released): the weights AdamW updates, and its state, in bf16 (diffusers' fp32
      modules, norms and time embedding, stay fp32); 'float32': fp32 trained weights
    lr(it) = lr x lambda(it // every), lambda(n) = n / warmup for n < warmup, else 1: diffusers'
      constant_with_warmup stepped once per accumulation window of `every` rollouts (released), so the
      first window trains at lr 0; 'per_rollout': lr x min(1, (it + 1) / warmup)

Where this differs from the released code: nothing in what trains; in bf16 an AdamW step of lr 1e-5
rounds away on every weight above ~4e-3 in magnitude (bf16 keeps 8 bits), as it does in the release.
Tested by: python -m pytest tests/test_kvpo_release.py
"""
import torch

from models import hold_frozen
from models.policy import load_policy

# every Linear of a Wan block (diffusers' names; the original: self_attn / cross_attn q, k, v, o, ffn.0, ffn.2)
ALL_LINEAR = ['attn1.to_q', 'attn1.to_k', 'attn1.to_v', 'attn1.to_out.0',
              'attn2.to_q', 'attn2.to_k', 'attn2.to_v', 'attn2.to_out.0', 'ffn.net.0.proj', 'ffn.net.2']


def checkpoint_lora(path):
    """{diffusers module name: (A (r, in), B (out, r))} of the streaming model's own LoRA file (its
    model_index.json 'lora': LongLive's {'generator_lora': peft state dict} in the original Wan names)."""
    from streaming import wan_causal
    index = wan_causal._index(path)
    if not index.get('lora'):
        raise SystemExit(f"adapter='checkpoint': {path!r} names no LoRA (python -m streaming.wan_causal ... --lora=)")
    pairs = {}
    for k, v in wan_causal.read_state(index['lora'], keys=('generator_lora',)).items():
        k = k.replace('base_model.model.', '').replace('.default', '')
        for i, part in enumerate(('lora_A', 'lora_B')):
            if f'.{part}.' in k:
                pairs.setdefault(wan_causal._name(wan_causal._strip(k.split(f'.{part}.')[0])), [None, None])[i] = v
    return {m: tuple(ab) for m, ab in pairs.items()}, index.get('lora_alpha')


def load_unmerged(path):
    """The streaming transformer (fp32) of model directory `path` with its LoRA not merged."""
    from diffusers import WanTransformer3DModel
    from streaming import wan_causal
    from models.attention import backend
    index = wan_causal._index(path)
    config = WanTransformer3DModel.load_config(index['wan'], subfolder='transformer')
    net = wan_causal.build(config, index.get('layout', wan_causal.LAYOUT), backend=backend('native'))
    sd = wan_causal.to_diffusers(wan_causal.generator_state(index['generator'], index.get('generator_key'), net.layout))
    wan_causal.check(sd, net, index['generator'])
    net.load_state_dict({k: v.float() for k, v in sd.items()}, assign=True)
    return net.eval()


def load_generator(path, device, lora_rank, adapter='checkpoint', train_dtype='float32'):
    """The trainable streaming generator: lora_rank 0 trains every weight; else the adapter as the
    module docstring says. train_dtype: of every weight but diffusers' fp32 modules when 'bfloat16'."""
    if lora_rank == 0 or adapter == 'merged':
        net = load_policy(path, device, lora_rank=lora_rank)
    else:
        from peft import LoraConfig
        pairs, alpha = checkpoint_lora(path)
        net = load_unmerged(path).requires_grad_(False)
        if torch.device(device).type == 'cuda':
            hold_frozen(net, torch.bfloat16, buffers=True)  # the frozen base in bf16, as load_policy's
        net.add_adapter(LoraConfig(r=lora_rank, lora_alpha=alpha or lora_rank, target_modules=ALL_LINEAR))
        adapted = {n[:-len('.lora_A')] for n, _ in net.named_modules() if n.endswith('.lora_A')}
        if set(pairs) != adapted:
            miss = sorted(adapted - set(pairs)) or sorted(set(pairs) - adapted)
            raise SystemExit(f"adapter='checkpoint': the LoRA file and the 10 Linear of each block differ at "
                             f"{len(miss)} modules, e.g. {', '.join(miss[:3])}")
        for name, (A, B) in pairs.items():
            mod = net.get_submodule(name)
            if A is None or B is None or A.shape[0] != lora_rank:
                raise SystemExit(f"adapter='checkpoint': {name}'s LoRA is not an (A, B) pair of rank {lora_rank}")
            for lin, w in ((mod.lora_A['default'], A), (mod.lora_B['default'], B)):
                lin.weight.data = w.to(torch.float32).clone()  # fp32 master weights, as load_policy's adapters
        net = net.to(device)
    if train_dtype == 'bfloat16':  # released: AdamW on bf16 parameters
        hold_frozen(net, torch.bfloat16)
    return net


def precision(device, train_dtype):
    """The forwards' autocast: bf16 compute on a GPU (as velocity()) or for bf16 weights; fp32 otherwise."""
    kind = torch.device(device).type
    return torch.autocast(kind, torch.bfloat16, enabled=kind == 'cuda' or train_dtype == 'bfloat16')


def lr_at(it, lr, warmup, every, schedule='constant_with_warmup'):
    """The learning rate of the update at rollout `it` (0-based), as the module docstring says."""
    if schedule == 'per_rollout':
        return lr * min(1.0, (it + 1) / max(1, warmup))
    step = it // every  # one step per accumulation window (the old policy's sync)
    return lr * (step / max(1, warmup) if step < warmup else 1.0)
