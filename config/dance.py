# The dance baseline as the SAGE-GRPO paper's Table 2 trains it: DanceGRPO (arXiv 2505.07818)'s sampler, GRPO with
# neither the temporal gradient equalizer nor a KL term. Its "with fixed KL" row adds config/fixed_kl.py.
#   torchrun --nproc_per_node=8 train.py config/dance.py                       # Setting B
#   torchrun --nproc_per_node=8 train.py config/dance.py config/fixed_kl.py    # with its fixed KL
#   python train.py config/toy.py config/dance.py --reward_weights="(1.0, 1.0, 1.0)"   # the toy, Setting A
# The noise scale stays at the reference's eta 0.5 (docs/method.md section 8).
sampler = 'dance'
equalizer = False               # S_t is SAGE-GRPO's
kl_strategy = 'none'
