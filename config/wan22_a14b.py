# Wan 2.2 T2V-A14B: two experts of 14B each (models/wan.py: Experts), the high-noise `transformer` above
# the pipeline's boundary_ratio 0.875 (timestep 1000 s >= 875), the low-noise `transformer_2` below it.
#   hf download Wan-AI/Wan2.2-T2V-A14B-Diffusers --local-dir weights/Wan2.2-T2V-A14B
#   torchrun --nproc_per_node=8 train.py config/wan22_a14b.py
# Wan's recipe: shift 12, 40 steps, 16 fps, guidance 4.0 at high noise and 3.0 at low noise. `cfg` is the
# high-noise expert's scale (WanPipeline's guidance_scale); the low-noise expert's is wan.GUIDANCE_2 (3.0).
# Memory (results/fullsize.md, "Wan 2.2 T2V-A14B", bench/fullsize_wan22.py: 8 GPUs, 81x480x832, 40 steps
# and 32 clips stored, the VAE and VideoAlign resident): LoRA r64 on both experts at sp 2 peaks at 50.0
# GiB a GPU (sp 1: 69.9). A full fine-tune of both experts is over 80 GB at every sp (99.3 at sp 4); of one
# (experts 'high' or 'low', the other frozen, held in bf16 on GPUs): 69.6 at sp 4 with --lora_rank=0
# --learning_rate=1e-5 --experts=high --sp_size=4 (sp 2: 77.9, too little headroom on an 80 GB GPU).
# At 81x720x1280 only LoRA at sp 4 fits (72.6).
model = 'weights/Wan2.2-T2V-A14B'
shift = 12.0
num_steps = 40
cfg = 4.0
fps = 16
num_frames = 81
height = 480
width = 832
experts = 'both'                # both experts train (their adapters)
lora_rank = 64                  # adapters on both experts' attention projections, fp32; the base frozen
learning_rate = 1e-4            # LoRA's step, as config/lora_1gpu.py
sp_size = 2                     # each clip's tokens over 2 ranks (Ulysses over the 40 heads)
prompts_per_iter = 8
rollout_batch = 1
out_dir = 'out-wan22'
