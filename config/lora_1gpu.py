# HunyuanVideo 1.5 on one GPU: LoRA adapters instead of full fine-tuning (no FSDP).
#   python train.py config/lora_1gpu.py
lora_rank = 64
learning_rate = 1e-4            # LoRA usually wants a larger step than full fine-tuning
prompts_per_iter = 2
rollout_batch = 1
out_dir = 'out-lora'
