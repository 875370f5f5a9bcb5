# HunyuanVideo 1.5 480p with the paper's Setting A reward weights (VQ, MQ, TA all 1).
#   torchrun --nproc_per_node=8 train.py config/setting_a.py
reward_weights = (1.0, 1.0, 1.0)
out_dir = 'out-setting-a'
