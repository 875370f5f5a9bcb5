# GRPO with an SDE on the distilled streaming toy (kvpo/grpo_ar.py), beside KVPO on it: an overlay of
# kvpo/config/grpo_toy.py, so the same prompts, optimizer, EMA and held-out evaluation as KVPO's, paired seed by
# seed in bench/kvpo_verdicts.py. Its 4 denoising steps (the distilled sampler's sigmas and a terminal 0) are
# SAGE steps (eta 0.5); 2 of them, drawn each iteration, carry the loss (KVPO's replay trains 2 of the 4 too).
#   python -m kvpo.grpo_ar kvpo/config/grpo_toy.py kvpo/config/grpo_toy_sf.py
model = 'assets/toy_sf'
train_prompts = 'assets/toy_sf/train_prompts.txt'
eval_prompts = 'assets/toy_sf/eval_prompts.txt'
train_steps = 2                 # of the 4 SDE steps
out_dir = 'out-grpo-ar-toy-sf'
