# HunyuanVideo 1.5 on one GPU: LoRA adapters instead of full fine-tuning (no FSDP).
#   python train.py config/lora_1gpu.py
# Fits one 80 GB GPU at the paper's rollout size: bench/fullsize.py measures a training micro-step
# at 81x352x624 (bf16 frozen base, fp32 adapters, bf16 autocast, checkpointing, 8 stored clips) plus the resident
# VAE and VideoAlign below 80 GB (results/fullsize.md, "LoRA r64 on one GPU").
lora_rank = 64
learning_rate = 1e-4            # LoRA usually wants a larger step than full fine-tuning
prompts_per_iter = 2
rollout_batch = 1
num_frames = 81                 # the size measured to fit (see above)
height = 352
width = 624
out_dir = 'out-lora'
