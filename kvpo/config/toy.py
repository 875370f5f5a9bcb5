# KVPO on the toy's streaming student (assets/toy_story: a block-causal Wan toy distilled from a teacher of its own
# architecture, the released 4-step sampler; streaming/toy_story.py): the released method scaled to the toy, on a
# CPU in minutes, the toy's 9-frame clips of one caption (kvpo/config/toy_story.py: its 4-prompt stories).
#   python -m kvpo.train kvpo/config/toy.py
#   torchrun --nproc_per_node=2 -m kvpo.train kvpo/config/toy.py
# The toy's layout is the released one scaled down (block 1, sink 1, window 4, the released 4 timesteps at shift 5;
# docs/streaming.md 5): a routed block sees the sink, n_random = 4 - 1 - m_nearest = 2 older frames of its branch's
# and itself (m = 1); the gradient flows through the first 2 of the 4 steps (grad_steps, released).
# One chunk of 9 frames: the local and the global reward score the same clip. (Until issue 69 this config ran the
# AR toy, assets/toy_ar, 8 ODE steps a frame: results/kvpo_toy.md; build it with python -m streaming.toy_ar.)
model = 'assets/toy_story'
reward_model = 'world'          # the toy world's exact reward
reward_weights = (0.5, 0.5, 1.0)  # Setting B, the toy's composite
train_prompts = 'assets/toy/train_prompts.txt'  # the toy's captions (the base's)
eval_prompts = 'assets/toy/eval_prompts.txt'
device = 'cpu'
fps = 8
lora_rank = 0                   # the whole tiny model trains
group = 6                       # K: a fork late in the clip has up to 5 older frames to route to
m_nearest = 1                   # the block itself (block 1)
perturb_blocks = 2              # P: forks 4..7 of 9 frames
frames = 9
chunk_first = 9
chunk_then = 9
within_chunks = 1
cache_frames = 9                # the whole clip: the pool is every frame between the sink and the fork
global_clip = 9
eval_frames = 9
prompts_per_iter = 4            # 4 prompts an iteration (over all ranks)
learning_rate = 1e-4            # a tiny model moves faster than 1.3B LoRA parameters
ema_decay = 0.9                 # tens of iterations, not 1500
max_iters = 30
eval_every = 10
save_every = 10
out_dir = 'out-kvpo-toy'
activation_checkpointing = False  # a 3-layer toy: activations are tiny
# the released long-video choices the toy does not take (kvpo/train.py's defaults are the released values):
tve_span = 'routed'             # the P routed blocks: a chunk of 9 frames would replay up to 5 blocks, not 2
switch_frames = ()              # one prompt: the toy's 9-frame clips are one caption each
context_noise = 0.0             # the student was distilled with its cache written from x0 itself
lr_schedule = 'per_rollout'     # 30 rollouts, not 3000: a warm-up from 0 over 10 of them would idle a third of the run
train_dtype = 'float32'         # a CPU run of a tiny model: bf16 would round away its lr 1e-4 steps on most weights
