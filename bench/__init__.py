"""
The experiments: one script per question, run from the repository root as modules, grouped by what
they prove (each writes its figures into results/, the README's blocks from those files).

The method's claims, on the toy world (2-core CPUs, paired seeds):
    python -m bench.toy          # samplers, Fig. 4, ablations, cost; the README's headline runs
    python -m bench.verdicts     # paired-seed verdicts of the paper's claims (results/verdicts.md)
    python -m bench.paper        # the paper's experiments as it ran them: Table 2, Fig. 7, Fig. 8, advantages
    python -m bench.trust_region # the trust region or a smaller step: dual vs none by learning rate
    python -m bench.alarm        # the reward-hacking alarm replayed on recorded evaluations
    python -m bench.compute      # the SDE window and timestep fraction: compute vs quality
The real model's cost at full size (fake tensors; the same micro-step on GPUs where lent):
    python -m bench.fullsize     # HunyuanVideo 1.5 at 8.3B: memory and FLOPs (results/fullsize.md)
    python -m bench.fullsize_gpu # the same micro-step on GPUs, beside the estimate
    python -m bench.hsdp         # 8.3B on 64 GPUs: flat FSDP vs HSDP, memory and bytes moved
    python -m bench.fullsize_causal  # the streaming family's generator at full size
    python -m bench.kvpo_memory  # KVPO's branches at full size
The program at scale, rehearsed on CPU:
    python -m bench.nodes        # train.py on simulated nodes: HSDP, failures, train.sbatch
    python -m bench.checkpoint   # checkpoint save/resume and prompt-cache cost at three sizes
    python -m bench.rehearsal    # the real path at real width, random weights (results/rehearsal.md)
    python -m bench.gpu_check    # the one command for a lent GPU: six phases, a json each (results/gpu.md)
The streaming family and KVPO (streaming/, kvpo/):
    python -m bench.toy_sf       # the distilled streaming toy against the base
    python -m bench.kvpo_signal  # what a KVPO group carries; python -m bench.kvpo_verdicts: its verdicts
    python -m bench.kvpo_diagnosis  # KVPO's suspects, one at a time

Retired one-off experiments (no test or README line runs them; their figures stay in results/ with
the commit that made them, the script in git's history): bench.credit (results/credit_cost.md),
bench.kvpo_branches (results/kvpo_branches.md).

bench/common.py is their shared machinery (cached cells, README blocks, the train.py subprocess).
The method never imports from here: bench/ imports the root and its folders, not the other way.
"""
