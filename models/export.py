"""
A checkpoint as a diffusers transformer directory: the model family's transformer class loads it
(from_pretrained(dest)), and a diffusers pipeline takes it as its transformer/. A LoRA run's adapter
is merged into the base weights, and the adapter alone is written to dest/lora (diffusers'
save_lora_adapter). train.py exports its last checkpoint to out_dir/export (export_dtype).

    python -m models.export out-toy out-toy/export              # the newest intact checkpoint of a run
    python -m models.export out-toy/ckpt_000020 DEST --dtype=float32

Where this differs from a plain save_pretrained of the trained policy, and why:
- written beside dest (dest.tmp) and renamed into place: a crash or a kill mid-write (16.6 GB at
  8.3B) leaves the previous export whole (or none), never a half-written dest; a dest.tmp left by
  a killed export is cleared by the next one.
- the source is read from the sharded checkpoint into a plain model in this process alone
  (checkpoint.load_weights), even under torchrun: train.py's rank 0 exports while the others wait.
- a LoRA adapter is merged in float32 (on the CPU the base loads in float32), and only the merged
  weights are cast to dtype.

Tested by: python -m pytest tests/test_checkpoint.py -k export (LoRA: tests/test_train.py -k lora)
"""
import os
import shutil
import sys

import torch

from infra import checkpoint
from models.policy import load_policy

SHARD = '5GB'                   # max_shard_size of the exported safetensors files


def export(src, dest, dtype=torch.bfloat16):
    """Checkpoint (or out_dir's newest) -> a diffusers transformer directory at dest: the model
    family's transformer class loads it (from_pretrained(dest)). LoRA runs: merged into the
    base weights, and the adapter alone in dest/lora (diffusers' save_lora_adapter). Two experts
    (Wan 2.2 A14B): dest/transformer and dest/transformer_2, the pipeline's layout (from_pretrained(dest,
    subfolder=...)); an expert the run kept frozen is written as the base model has it."""
    from diffusers.utils import logging
    ckpt = checkpoint.resolve(src)
    cfg = checkpoint.read_loop(ckpt)['config']
    policy = checkpoint.load_weights(ckpt, load_policy(cfg['model'], 'cpu', lora_rank=cfg['lora_rank'],
                                                       experts=cfg.get('experts', 'both')))
    dest = os.path.abspath(dest)  # written beside it, then renamed into place (the docstring)
    tmp, old = dest + '.tmp', dest + '.old'
    shutil.rmtree(tmp, ignore_errors=True)  # an export that died
    try:
        if cfg['lora_rank'] > 0:
            policy.save_lora_adapter(os.path.join(tmp, 'lora'))  # adapter weights + its LoraConfig
            policy.fuse_lora()    # W += (alpha / r) B A, in float32
            policy.unload_lora()  # back to the plain diffusers modules
        logging.set_verbosity_error()  # its warning about float32 modules: this model has none
        policy.to(dtype).save_pretrained(tmp, safe_serialization=True, max_shard_size=SHARD)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(dest):
        os.replace(dest, old)  # two renames: between them (microseconds) dest.old is the export
    os.replace(tmp, dest)
    shutil.rmtree(old, ignore_errors=True)
    return dest


def final(out_dir, dtype, solo_timeout, master, transformer, done=True):
    """train.py's export of its last checkpoint to out_dir/export, by rank 0 alone while the others
    wait on the c10d store (solo_timeout), not in a collective (dist_timeout); transformer: the
    diffusers class that loads it, for the line that says so. Nothing if dtype is '' (export_dtype)
    or the run stopped before its end (not done)."""
    if not (dtype and done):
        return
    from infra import parallel
    dest = os.path.join(out_dir, 'export')
    parallel.solo(lambda: export(out_dir, dest, getattr(torch, dtype)), 'export', solo_timeout)
    if master:
        print(f'exported to {dest}: diffusers {transformer}.from_pretrained() loads it')


if __name__ == '__main__':
    args = [a for a in sys.argv[1:] if not a.startswith('--')]
    opts = dict(a[2:].split('=', 1) for a in sys.argv[1:] if a.startswith('--') and '=' in a)
    if len(args) != 2:
        raise SystemExit('usage: python -m models.export OUT_DIR_OR_CKPT DEST [--dtype=bfloat16|float32]')
    dt = getattr(torch, opts.get('dtype', 'bfloat16'), None)
    if not isinstance(dt, torch.dtype):
        raise SystemExit(f'--dtype must be a torch dtype such as bfloat16 or float32, got {opts["dtype"]!r}')
    print(f'exported {checkpoint.resolve(args[0])} -> {export(args[0], args[1], dt)}')
