# The toy world (models/toy.py): SAGE-GRPO end to end on a 2-core CPU in about 11 minutes.
#   python train.py config/toy.py
#   torchrun --nproc_per_node=2 train.py config/toy.py     # the FSDP2 path, gloo on CPU
# Everything not set here keeps train.py's default: the paper's, but for lambda_KL held by the gradient ratio
# (docs/method.md 5.6) and the switches of 6.2.
model = 'assets/toy'            # the committed, pretrained tiny HunyuanVideo15Transformer3DModel
reward_model = 'world'          # the toy world's own exact reward (models/toy.py): VQ, MQ, TA in [0, 1]
eval_metrics = ''               # no CLIPScore/PickScore: the toy's metrics are exact; 24x24 frames mean little to CLIP
train_prompts = 'assets/toy/train_prompts.txt'
eval_prompts = 'assets/toy/eval_prompts.txt'
out_dir = 'out-toy'
device = 'cpu'
fps = 8                         # toy.FPS
gradient_checkpointing = False  # activations of a 324-token clip are tiny
num_steps = 10                  # sampler steps (the paper: 20)
shift = 3.0                     # the toy's sigma-schedule shift
cfg = 1.0                       # no guidance: one forward per step, and the most room to improve
prompts_per_iter = 16           # 64 clips per iteration
group_size = 4
rollout_batch = 64              # all of a rank's clips in one forward
train_batch = 32
timestep_fraction = 0.5         # half of the 10 stochastic steps of each clip, chosen at random
learning_rate = 1e-4            # a 2-layer model on a tiny world moves faster than 8.3B parameters
optimizer = 'adamw'             # the toy's ablations ran with AdamW; Muon vs AdamW: results/ section 3 (f)
max_iters = 40
eval_every = 10                  # the held-out evaluation (and the reward-hacking alarm's look) every 10 iterations
eval_samples = 2                # 16 held-out prompts x 2 seeds
save_every = 20
diag_every = 3                  # the 4-pass gradient diagnostics every 3rd iteration (at 0 and 30 the anchor is the policy: KL gradient 0)
