"""
What holding the gradient ratio costs (train.py's default lambda_KL since issue 67: docs/method.md 5.6). Holding
it measures ||g_KL|| / ||g_policy|| on every optimizer step, so every micro-batch's backward runs the two terms
apart (extras/diagnostics.py GradientSplit): two backward passes of one forward, the KL gradients kept in a
second sum until the step. Measured two ways, each a ratio of one run:

- HunyuanVideo 1.5 at full size, on paper (bench/fullsize_measure.py: fake tensors, FSDP2 over a fake process
  group of `gpus` ranks, per-block checkpointing, bf16 compute): one micro-step (anchor forward, policy forward,
  backward, clip, AdamW) with and without the split, at three clip lengths of the paper's 352x624: per-GPU peak
  bytes and FLOPs. An iteration's FLOPs from them at the released schedule: every clip's `num_steps` rollout
  forwards (one forward each with CFG, the anchor forward's FLOPs) and its trained steps' micro-steps (sage at
  eta 0.5: every stochastic step); the reward and the VAE are left out (the same in both).
- The toy, as a user runs it: the README's two headline runs (bench.toy's cells s0_ratio and s0_paper_kl: the
  default, and the same at the paper's lambda_KL, which never splits), run side by side on the 2 cores, one
  thread each: the median update time and whole-iteration time of their 40 iterations.

    python -m bench.ratio_cost                 # ~15 min on 2 busy cores; writes results/ratio_cost.md/.json
    python -m bench.ratio_cost --run=False     # only the report, from the cells cached

Tested by: python -m pytest tests/test_ratio_cost.py
"""
import os
import statistics
import sys

import torch

from bench import common as C
from bench import fullsize_measure as FM
from bench.common import table
from infra.configurator import configure

# ----------------------------------------------------------------------------- settings
out = 'results'                 # cells/ (committed), ratio_cost.md/.json
frames = (21, 41, 81)           # clip lengths at full size (81: the released clip), at height x width below
height = 352                    # the paper's rollout resolution
width = 624
gpus = 8                        # FSDP ranks (a fake process group)
num_steps = 20                  # the released rollout steps; sage's stochastic steps are all trained
eta = 0.5
shift = 5.0
run = True                      # False: only the report
threads = 2
config = configure(globals(), sys.argv[1:] if __name__ == '__main__' else [])
# -----------------------------------------------------------------------------
GiB = 2 ** 30


def trained_steps():
    """Sage's stochastic steps at the released schedule: the steps a clip trains (timestep_fraction 1)."""
    import sde
    return len(sde.stochastic_steps('sage', sde.sigmas(num_steps, shift), eta))


def micro_step(Fr, split, measure=True):
    """One full-size micro-step (a cell): peak bytes per GPU by category, FLOPs by phase; measure=False:
    the cached cell or None."""
    name = f'ratio_cost_{Fr}x{height}x{width}_w{gpus}_{"split" if split else "plain"}'
    if not measure:
        return C.cached(name)

    def fn():
        torch.set_num_threads(threads)
        r = FM.measure(FM.load_config(), 'train', Fr, height, width, world=gpus, split=split)
        return dict(peak=FM.categories(r), peak_phase=r['peak_phase'], P=r['P'], tokens=r['tokens'],
                    flops={k: v['flops'] for k, v in r['phases'].items()}, seconds=r['seconds'])
    return C.cell(name, fn)


def full_size(n_train, measure=True):
    """Per clip length: the two micro-steps and the iteration's FLOPs, per GPU and clip."""
    rows = {}
    for Fr in frames:
        plain, split = micro_step(Fr, False, measure), micro_step(Fr, True, measure)
        if plain is None or split is None:
            continue
        fwd = plain['flops']['anchor forward']  # one forward of one clip with CFG: a rollout step's too

        def iteration(m):  # one clip: num_steps rollout forwards, n_train micro-steps
            return num_steps * fwd + n_train * sum(m['flops'].values())
        rows[Fr] = dict(tokens=plain['tokens'], P=plain['P'],
                        peak_gib=[plain['peak']['total'] / GiB, split['peak']['total'] / GiB],
                        peak_phase=[plain['peak_phase'], split['peak_phase']],
                        grads_gib=[plain['peak']['grads (fp32)'] / GiB, split['peak']['grads (fp32)'] / GiB],
                        temps_gib=[plain['peak']['backward temporaries'] / GiB, split['peak']['backward temporaries'] / GiB],
                        backward_tflop=[plain['flops']['backward'] / 1e12, split['flops']['backward'] / 1e12],
                        step_tflop=[sum(plain['flops'].values()) / 1e12, sum(split['flops'].values()) / 1e12],
                        iteration_tflop=[iteration(plain) / 1e12, iteration(split) / 1e12])
    return rows


def toy():
    """The README's two headline runs (bench.toy's cells), side by side: update and iteration times."""
    runs = {k: C.cached(k) for k in ('s0_ratio', 's0_paper_kl')}
    if any(r is None for r in runs.values()):
        return None
    med = lambda r, f: statistics.median(f(x) for x in r['iters'])  # noqa: E731
    res = {}
    for k, r in runs.items():
        res[k] = dict(update_s=med(r, lambda x: x['t_update']),
                      iteration_s=med(r, lambda x: x['t_rollout'] + x['t_reward'] + x['t_update']),
                      wall_s=r['wall'], iters=len(r['iters']), split=all('kl_ratio' in x for x in r['iters']))
    a, b = res['s0_ratio'], res['s0_paper_kl']
    res['ratio'] = dict(update=a['update_s'] / b['update_s'], iteration=a['iteration_s'] / b['iteration_s'],
                        wall=a['wall_s'] / b['wall_s'])
    return res


def report(n_train, full, small):
    res = dict(config=config, trained_steps=n_train, full=full, toy=small)
    md = ['# What holding the gradient ratio costs (`python -m bench.ratio_cost`)', '',
          'train.py\'s default lambda_KL holds the KL/policy gradient ratio (docs/method.md 5.6), so every backward runs '
          'the two terms apart: two backward passes of one forward (GradientSplit). Plain: one backward, as at the '
          'paper\'s lambda_KL.', '']
    if full:
        rows = [[f'{Fr} x {height} x {width} ({r["tokens"]} tokens)'] +
                [f'{r[k][0]:.1f} -> {r[k][1]:.1f} ({r[k][1] / r[k][0]:.2f}x)' for k in
                 ('peak_gib', 'grads_gib', 'temps_gib', 'backward_tflop', 'step_tflop', 'iteration_tflop')]
                for Fr, r in full.items()]
        md += [f'**HunyuanVideo 1.5 (8.3B) at full size, on paper** (fake tensors, FSDP2 over {gpus} ranks, per-block '
               f'checkpointing; per GPU, one clip): a micro-step plain -> split; an iteration per clip at the released '
               f'schedule ({num_steps} rollout forwards and {n_train} trained steps, sage at eta {eta:g}; the reward '
               'and the VAE left out).', '',
               table(['clip', 'peak GiB', 'grads GiB', 'backward temporaries GiB', 'backward TFLOP', 'micro-step TFLOP',
                      'iteration TFLOP'], rows), '',
               'The peak grows by the KL term\'s gradient sum (one more sharded fp32 gradient, the grads column) and by '
               'backward temporaries that grow with the tokens and the depth (about one bf16 hidden state of a block a '
               'block, alive from the first backward pass into the second under FSDP2): not seen without FSDP, where the '
               'real resident memory of a small config grows by the gradient sum alone (tests/test_ratio_cost.py, slow); what '
               'holds them is not pinned down, and a GPU run would tell.', '']
    if small:
        a, b, r = small['s0_ratio'], small['s0_paper_kl'], small['ratio']
        md += [f'**The toy, as a user runs it** (the README\'s headline runs, side by side on 2 cores, one thread each; '
               f'medians over {a["iters"]} iterations): update {b["update_s"]:.2f} s -> {a["update_s"]:.2f} s '
               f'({r["update"]:.2f}x), iteration {b["iteration_s"]:.2f} s -> {a["iteration_s"]:.2f} s ({r["iteration"]:.2f}x), '
               f'the whole run with its evaluations {r["wall"]:.2f}x.', '']
    sentence = None
    if full:
        top = full[max(full)]
        sentence = (f'holding the gradient ratio (the default) costs HunyuanVideo 1.5 at {max(full)} x {height} x {width} '
                    f'{top["iteration_tflop"][1] / top["iteration_tflop"][0]:.2f}x the FLOPs of an iteration '
                    f'(backward {top["backward_tflop"][1] / top["backward_tflop"][0]:.2f}x) and '
                    f'{top["peak_gib"][1] - top["peak_gib"][0]:+.1f} GiB of peak per GPU '
                    f'({top["peak_gib"][0]:.1f} -> {top["peak_gib"][1]:.1f})')
        if small:
            sentence += f'; the toy\'s iteration {small["ratio"]["iteration"]:.2f}x its time'
    res['sentence'] = sentence
    if sentence:
        md += [f'**In one sentence**: {sentence}.', '']
    return res, md


if __name__ == '__main__':
    C.setup(out, threads, 0)
    n_train = trained_steps()
    res, md = report(n_train, full_size(n_train, measure=run), toy())
    C.write_report(os.path.join(out, 'ratio_cost'), res, md)
    if out == 'results' and res['sentence']:
        line = (f'- *What the default costs* (`python -m bench.ratio_cost`): {res["sentence"]}. '
                '[results/ratio_cost.md](results/ratio_cost.md), docs/method.md 5.6.')
        C.put_block('README.md', 'bench.ratio_cost', [line])
        C.put_block(os.path.join(out, 'README.md'), 'bench.ratio_cost',
                    ['## 17. What holding the gradient ratio costs (`python -m bench.ratio_cost`)', '', line])
