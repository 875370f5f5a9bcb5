# The released SAGE-GRPO training run on 8 GPUs, as far as this project's settings express it.
#   torchrun --nproc_per_node=8 train.py config/released.py
# Sources: Tencent-Hunyuan/SAGE-GRPO scripts/post_train/train_grpo.sh (the launch flags: "sh"),
# post_train.py (TrainingConfig defaults, _build_optimizer: "pt"), hyvideo/utils/grpo_utils.py
# ("gu"), and HunyuanVideo-1.5 hyvideo/optim/muon.py; docs/method.md sections 6-7 have the reading.
# What these settings cannot express (the NaN-reward handling, the anchor's precision, Muon's >2-D
# kernels): docs/method.md section 6. The transformer is the 480p t2v one (--model), as released.
optimizer = 'muon'              # pt use_muon=True -> muon.get_muon_optimizer (Muon 2-D, AdamW 0/1-D)
learning_rate = 1e-5            # sh --learning_rate 1e-5; pt get_scheduler("constant")
weight_decay = 0.01             # pt weight_decay (Muon and its AdamW part alike)
grad_clip = 1.0                 # pt max_grad_norm
prompts_per_iter = 2            # sh --batch_size 2 per data-parallel rank x (8 GPUs / sp 2) = 8 clips = 2 prompts x G
group_size = 4                  # sh --num_generations 4
sp_size = 2                     # sh --sp_size 2: 2 GPUs share each clip's tokens (infra/sp.py), data parallel 8 / 2 = 4
rollout_batch = 1               # one clip per forward (2 clips per pair of ranks)
train_batch = 1                 # pt mini_batch_size_per_update 1
max_iters = 10000               # sh --max_steps 10000 (one optimizer step per rollout batch)
kl_update = 'backward'          # gu: the controller's update() after every backward, on the rank's own KL
prompt_noise = 'fixed'          # gu/pt: a prompt's G initial noises from its CSV seed (+ member), every draw
median = 'lower'                # gu: torch.median in the gradient balancing (sh --use_grad_balancing True)
sampler = 'sage'                # sh --sde_type sage_grpo
eta = 0.5                       # pt eta
num_steps = 20                  # pt grpo_sampling_steps
shift = 5.0                     # pt infer_flow_shift_video
cfg = 6.0                       # pt cfg_scale
num_frames = 81                 # pt sample_n_frames
timestep_fraction = 1.0         # pt timestep_fraction; sh --enable_timestep_permutation True (random order)
clip_range = 1e-4               # pt clip_range
adv_clip = 5.0                  # pt adv_clip_max
kl_strategy = 'dual'            # sh --use_moving_KL True --use_dual_kl True
anchor_every = 10               # sh --update_ref_model_step 10
beta_pos = 1.0                  # sh --dual_kl_moving_weight 1.0
beta_vel = 0.1                  # sh --dual_kl_step_weight 0.1
kl_max = 1e-5                   # sh --kl_weight 1e-5 (lambda_KL's upper clip)
kl_init = 1e-7                  # pt kl_coef 1e-7: lambda_KL's start
kl_ratio_target = 0.0           # gu KLController: the paper's lambda_KL rule, not our ratio hold (5.6)
kl_estimator = 'sample'         # gu: the step-wise term 0.1 * mean(logp_old - logp_theta), a one-sample estimate
reward_weights = (0.5, 0.5, 1.0)  # pt reward_weights {"VQ":0.5,"MQ":0.5,"TA":1.0}
eval_every = 50                 # pt validation_interval
save_every = 100                # pt save_interval
seed = 42                       # pt seed
out_dir = 'out-released'
