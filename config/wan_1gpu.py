# Wan 2.1 T2V 1.3B on one GPU: a full fine-tune (no FSDP), at Wan's own 81x480x832.
#   hf download Wan-AI/Wan2.1-T2V-1.3B-Diffusers --local-dir weights/Wan2.1-T2V-1.3B
#   python train.py config/wan_1gpu.py
# Fits one 80 GB GPU: bench/fullsize.py measures a training micro-step and a rollout forward of the
# 1.3B transformer on one GPU (fp32 master weights, gradients, AdamW state and anchor, bf16 autocast,
# checkpointing, 8 stored clips) plus the resident VAE and VideoAlign (results/fullsize.md, "Wan 2.1").
# Full fine-tuning, not LoRA: at 1.4B parameters the whole training state fits beside the activations,
# so nothing is gained by adapting a low-rank subspace, and the run is the method as the paper runs it.
# The 14B model needs FSDP on 8 GPUs, and on 80 GB GPUs sp 2 (its rows in the same table; LoRA r64
# on one 80 GB GPU does not fit it):
#   torchrun --nproc_per_node=8 train.py config/wan_1gpu.py --model=weights/Wan2.1-T2V-14B \
#       --sp_size=2 --prompts_per_iter=8
model = 'weights/Wan2.1-T2V-1.3B'
shift = 3.0                     # wan.DEFAULTS: diffusers' 480p value
cfg = 5.0                       # WanPipeline's guidance
fps = 16                        # Wan's frame rate (the reward samples at 2 fps)
num_frames = 81
height = 480
width = 832
prompts_per_iter = 2            # x group_size 4 = 8 clips an iteration
rollout_batch = 1               # one clip (x 2 CFG branches) per forward
out_dir = 'out-wan'
