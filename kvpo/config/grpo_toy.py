# GRPO with an SDE on the toy's streaming student (kvpo/grpo_ar.py): the baseline beside KVPO (kvpo/config/toy.py),
# the same model, prompts, optimizer, EMA and held-out evaluation, so bench/kvpo_verdicts.py pairs them seed by seed.
#   python -m kvpo.grpo_ar kvpo/config/grpo_toy.py
# Each frame's 4 denoising steps are SAGE steps (eta 0.5); 2 of them, drawn each iteration, carry the loss (KVPO's
# replay trains 2 of the 4 too). (Until issue 69: the AR toy, assets/toy_ar, 4 of its 8 steps trained.)
model = 'assets/toy_story'
reward_model = 'world'          # the toy world's exact reward
reward_weights = (0.5, 0.5, 1.0)  # Setting B, the toy's composite
train_prompts = 'assets/toy/train_prompts.txt'
eval_prompts = 'assets/toy/eval_prompts.txt'
device = 'cpu'
fps = 8
lora_rank = 0                   # the whole tiny model trains
group = 6                       # G: KVPO's K on the toy
frames = 9
train_steps = 2                 # of the 4 SDE steps
eval_frames = 9
prompts_per_iter = 4            # 4 prompts an iteration (over all ranks), KVPO's
learning_rate = 1e-4            # KVPO's toy setting
ema_decay = 0.9
max_iters = 30
eval_every = 10
save_every = 10
out_dir = 'out-grpo-ar-toy'
