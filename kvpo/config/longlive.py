# KVPO on LongLive (Wan 2.1 T2V 1.3B, block-causal) as released (docs/kvpo.md section 1; configs/train_kvpo_longlive.yaml):
#   python -m streaming.wan_causal weights/LongLive --wan=weights/Wan2.1-T2V-1.3B \
#       --generator=weights/LongLive-ckpt/models/longlive_base.pt --lora=weights/LongLive-ckpt/models/lora.pt
#   torchrun --nproc_per_node=8 -m kvpo.train kvpo/config/longlive.py
# Per-GPU memory: results/kvpo_memory.md. Everything not set here is kvpo/train.py's default (the released value).
model = 'weights/LongLive'
device = 'cuda'
lora_rank = 256                 # LoRA r 256, alpha 256 on the generator
adapter = 'checkpoint'          # LongLive's own LoRA loaded on all 10 Linear of each block and trained on
train_dtype = 'bfloat16'        # the generator trains in bf16: AdamW on bf16 parameters
group = 8                       # K = G = 8 branches + the anchor, one prompt a GPU
prompts_per_iter = 8            # 8 GPUs
m_nearest = 4
perturb_blocks = 5
frames = 147                    # the long-video setting: 21, then +18 a chunk
chunk_first = 21
chunk_then = 18
within_chunks = 7
cache_frames = 33               # local_attn_size 12 + slice_last_frames 21
release_reads = False           # route the planned frames (True: the release's reads, f + 3 once the cache rolls)
switch_frames = (39, 75, 111)   # 4 prompt segments (switch_frame_indices, aligned to chunk starts)
switch_recache = True           # recache_after_switch: the last 12 frames' keys and values under the new prompt
prompt_story = True             # a video's 4 prompts a line (prompt_min_segments = prompt_max_segments = 4)
train_prompts = 'prompts/stories.txt'  # released: vidprom_filtered_extended_switch_2.0_formatted.txt (not shipped)
context_noise = 0.00498         # context_noise 0 on the 1000-step shift-5 grid: add_noise at sigma 5e-3 / 1.004
tve_span = 'chunk'              # the replay: from the fork to the end of its chunk (6 blocks when the fork opens it)
grad_steps = 2                  # log_prob_grad_steps
reward_model = 'videoalign'     # released default: HPSv3 alone (not ported); VideoAlign VQ/MQ/TA instead
reward_weights = (1.0, 0.05, 0.1)  # the released config's VideoAlign weights (VQ 1.0, MQ 0.05, TA 0.1)
global_clip = 9                 # long_reward_normal_clip_len 36 video frames = 9 latent frames, one a segment
learning_rate = 1e-5
warmup = 5                      # lr_warmup_steps, in steps of old_every rollouts
lr_schedule = 'constant_with_warmup'  # diffusers' get_scheduler, stepped at each accumulation boundary
weight_decay = 0.01
grad_clip = 1.0
ema_decay = 0.999
old_every = 2                   # gradient_accumulation_steps 2: the old policy syncs every 2 rollouts
max_iters = 3000                # max_train_steps 1500 x 2 rollouts a step
eval_every = 4                  # eval_interval_steps 2 (rollouts)
save_every = 4                  # save_interval_steps 2 (rollouts)
eval_frames = 21                # held-out samples: one chunk (81 video frames)
fps = 16
seed = 42
out_dir = 'out-kvpo-longlive'
