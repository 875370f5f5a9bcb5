# The toy where the trust region acts: lambda_KL held at 0.1 (results/trust_region.md, docs/method.md 5.6).
#   python train.py config/toy.py config/toy_trust.py
# At the paper's lambda_KL (1e-7 warming to 1e-5) the KL term's gradient is ~1e-6 of the policy term's: inert.
kl_init = 0.1                   # lambda_KL from the first optimizer step
kl_min = 0.1                    # held: the controller's floor and ceiling are the same
kl_max = 0.1
kl_warmup = 0                   # no warm-up
