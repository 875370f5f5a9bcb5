# The "with fixed KL" rows of the SAGE-GRPO paper's Table 2, after a baseline's config: a KL term to the
# initial model (never refreshed) with a constant coefficient, as Flow-GRPO trains (beta 0.04), in place of
# SAGE-GRPO's moving anchor, velocity term and adaptive lambda_KL.
#   torchrun --nproc_per_node=8 train.py config/flow.py config/fixed_kl.py
kl_strategy = 'fixed'           # KL(theta || initial model): the position term only
kl_init = 0.04                  # lambda_KL constant: start = floor = ceiling, no warm-up
kl_min = 0.04
kl_max = 0.04
kl_warmup = 0
kl_ratio_target = 0.0           # the constant above, not held by the gradient ratio
