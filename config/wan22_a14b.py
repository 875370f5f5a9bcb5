# Wan 2.2 T2V-A14B: two experts of 14B each (models/wan.py: Experts), the high-noise `transformer` above
# the pipeline's boundary_ratio 0.875 (timestep 1000 s >= 875), the low-noise `transformer_2` below it.
#   hf download Wan-AI/Wan2.2-T2V-A14B-Diffusers --local-dir weights/Wan2.2-T2V-A14B
#   torchrun --nproc_per_node=8 train.py config/wan22_a14b.py --sp_size=2
# Wan's recipe: shift 12, 40 steps, 16 fps, guidance 4.0 at high noise and 3.0 at low noise. `cfg` is the
# high-noise expert's scale (WanPipeline's guidance_scale); the low-noise expert's is wan.GUIDANCE_2 (3.0).
# experts: 'both' trains both; 'high' or 'low' trains one and keeps the other frozen (half the optimizer
# state and anchor). Memory at this size is not measured here (bench/fullsize has no A14B rows yet).
model = 'weights/Wan2.2-T2V-A14B'
shift = 12.0
num_steps = 40
cfg = 4.0
fps = 16
num_frames = 81
height = 480
width = 832
experts = 'both'
prompts_per_iter = 8
rollout_batch = 1
out_dir = 'out-wan22'
