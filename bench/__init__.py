"""
The experiments: one script per question, run from the repository root as modules.

    python -m bench.toy          # the toy world: samplers, Fig. 4, ablations, cost (results/README.md)
    python -m bench.verdicts     # paired-seed verdicts of the paper's claims (results/verdicts.md)
    python -m bench.paper        # the paper's experiments as it ran them: Table 2, Fig. 7, Fig. 8, advantages
    python -m bench.fullsize     # HunyuanVideo 1.5 at 8.3B: memory and FLOPs by fake tensors (results/fullsize.md)
    python -m bench.fullsize_gpu # the same micro-step on GPUs, beside the estimate
    python -m bench.hsdp         # 8.3B on 64 GPUs: flat FSDP vs HSDP, memory and bytes moved (results/hsdp.md)
    python -m bench.nodes        # train.py on simulated nodes: HSDP, failures, train.sbatch (results/nodes.md)
    python -m bench.checkpoint   # checkpoint save/resume and prompt-cache cost at three sizes
    python -m bench.credit       # token-credit cost and maps (results/credit_cost.md)
    python -m bench.rehearsal    # the real path at real width on CPU, random weights (results/rehearsal.md)
    python -m bench.gpu_check    # the one command for a lent GPU: six phases, a json each (results/gpu.md)

bench/common.py is their shared machinery (cached cells, README blocks, the train.py subprocess).
The method never imports from here: bench/ imports the root and its folders, not the other way.
"""
