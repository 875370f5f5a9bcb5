"""
Benchmarks of SAGE-GRPO: the toy world and its default run, the samplers on the toy base model,
the gradient proxy of the equalizer, training ablations on the toy world, the cost of an
iteration, and HunyuanVideo 1.5 on paper.
Writes results/bench.json, results/README.md (the tables) and results/*.png (if matplotlib is
installed); every finished cell is cached as results/cells/<name>.json and skipped on a rerun
(a cell whose toy base model has changed since is rerun).

    python -m bench.toy                          # everything; section 3 trains 3 seeds x ~40 distinct configs (hours)
    python -m bench.toy --quick                  # a reduced version, <= 3 min on 2 cores, into /tmp/bench_quick
    python -m bench.toy --sections=1,2,5         # some sections only
    python -m bench.toy --ablations=a,b --seeds=5   # section 3, part of it, more seeds
    python -m bench.toy --budget_min=40          # start no new training run after 40 minutes
    python -m bench.toy --sections=3 --ablations=f --reverse=True   # a second process, meeting the first halfway

    python -m bench.toy --sections=             # no measuring: results/README.md and the README block from bench.json

Writes README.md's results block (between its bench.toy markers: the default run and Fig. 4, a line
each) from the same numbers, so the README never quotes a figure by hand; the rest is results/README.md.

Sections (the numbers of results/README.md's):
 0. the toy world: the base model's held-out ODE samples next to clean renders and pure noise, and
    the default run `python train.py config/toy.py` (the README's first figures).
 1. samplers without training: per-step std of every kind in three treatments of the s = 1
    singularity (pure arithmetic from sde.variance), and SDE rollouts vs ODE samples of the same
    prompts and initial noise on the toy base model, at eta 0.5 and at matched exploration.
 2. Fig. 4: measured ||d logp_t / d theta|| per step vs the proxy N_t of equalizer.py.
 3. training ablations: subprocesses of train.py config/toy.py, several seeds each: (a) sampler x
    equalizer, (b) KL strategy, (c) anchor interval, (d) kl_max, (e) flow G=8, (f) AdamW vs Muon
    (an lr sweep each), (g) the released lambda_KL cadence, initial-noise seeding and median.
 4. cost of one toy iteration vs the transformer passes it must do; peak memory, 1 vs 2 ranks;
    one optimizer step (AdamW, Muon) per rank.
 5. HunyuanVideo 1.5 on 8 GPUs on paper: memory per GPU and FLOPs per GRPO iteration.
 6-11. Their own scripts' blocks of results/README.md, kept as they last wrote them (every block of
    another script is): 6. the paper's claims decided by paired seeds, 5 seeds x 60 iterations
    (bench/verdicts.py); 7. alignment per unit of compute (bench/compute.py); 8. the paper's
    experiments as it ran them (bench/paper.py); 9. every model at full size (bench/fullsize.py);
    10. checkpoints and the prompt cache at 8.3B (bench/checkpoint.py); 11. HSDP on 64 GPUs
    (bench/hsdp.py).

The sections 1-4 are their own modules, one question each (bench/toy_samplers.py, toy_gradnorm.py,
toy_ablations.py, toy_cost.py; what they share: bench/toy_common.py); their settings sit at their tops
and this command line sets them. Sections 0 and 5 and the assembly of the READMEs are here.

Where this differs from the issue's wording, and why: the overhead ratio of section 4 times the
transformer passes in the bench process right after the train.py run (a subprocess: it runs as
a user runs it, with no timing hooks inside), on the same batch sizes, thread count and machine;
peak memory is each process's ru_maxrss, which counts the Python interpreter and libraries too.
"""
import json
import os
import re
import sys
import tempfile
import time

import torch

from bench import common as C
from bench import toy_ablations, toy_cost, toy_gradnorm, toy_samplers
from bench import toy_common as TC
from bench.toy_common import MD, R, TOY, mean_std, pm
from models import toy
from infra.configurator import configure, list_of

# ----------------------------------------------------------------------------- settings
sections = '0,1,2,3,4,5'        # which sections to run
threads = 1                     # torch CPU threads, here and in every train.py started (2 threads on a
                                # shared 2-core machine run ~10x slower: OpenMP spin-waits)
budget_min = 0.0                # start no new training run after this many minutes (0: no limit)
# the sections' settings (out, quick, eta, then each section's: the tops of bench/toy_*.py), set from this
# command line too and handed back to their modules below
from bench.toy_common import eta, out, quick  # noqa: E402,F401
from bench.toy_samplers import bench_prompts, group, search_iters  # noqa: E402,F401
from bench.toy_gradnorm import grad_clips  # noqa: E402,F401
from bench.toy_ablations import (ablations, acting_kl_max, first_seed, only, reverse, seeds,  # noqa: E402,F401
                                 train_iters, train_prompts_per_iter)
from bench.toy_cost import cost_iters  # noqa: E402,F401
_argv = [a + '=True' if a == '--quick' else  # a bare flag; lists like --sections=1,2 stay strings
         f"{a.split('=')[0]}={a.split('=', 1)[1]!r}" if a.split('=')[0] in ('--sections', '--ablations') else a
         for a in sys.argv[1:]]
config = configure(globals(), _argv, rules=dict(sections=list_of(*'012345'), ablations=list_of(*'abcdefgh')))
if first_seed >= seeds:
    raise SystemExit(f'config error: first_seed must be below seeds ({seeds}), got {first_seed}')
# -----------------------------------------------------------------------------
if quick:  # every section, tiny: a smoke test of the whole bench, never over the committed results
    out = os.path.join(tempfile.gettempdir(), 'bench_quick') if out == 'results' else out
    bench_prompts, search_iters, grad_clips, seeds, train_iters, cost_iters = 4, 1, 1, 1, 2, 2
    train_prompts_per_iter = 2
    TC.EVAL_PROMPTS = 4  # x 1 seed, and no export
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(toy.DIR, 'eval_prompts.txt')) as f, open(os.path.join(out, 'eval4.txt'), 'w') as g:
        g.write(''.join(f.readlines()[:TC.EVAL_PROMPTS]))
    TC.EXTRA.update(eval_samples=1, eval_prompts=os.path.join(out, 'eval4.txt'), export_dtype='')
torch.set_num_threads(threads)
C.setup(out, threads, budget_min)
# the sections run with these values (--quick's included)
C.share({k: globals()[k] for k in config}, TC, toy_samplers, toy_gradnorm, toy_ablations, toy_cost)
T_START, MODEL_HASH, cell, table = C.T_START, C.MODEL_HASH, C.cell, C.table


# ============================================================================= 0. the toy world
def section0():
    """The README's toy-world figures: the base model's held-out ODE samples next to clean renders and
    pure noise, and the default run `python train.py config/toy.py` (a cached cell)."""
    def base():
        net, seeds_ = toy.load_model(), 1 if quick else toy.EVAL_SEEDS
        prompts = [p for p in toy.all_prompts() if toy.is_eval_prompt(p) for _ in range(seeds_)]
        clean = torch.stack([toy.render(p, i) for i, p in enumerate(prompts)])
        noise = toy.decode(torch.randn(len(prompts), *toy.LATENT_SHAPE, generator=torch.Generator().manual_seed(0)))
        return {'rl': toy.evaluate(net, TOY['num_steps'], TOY['shift'], TOY['cfg'], seeds_),
                'best': toy.evaluate(net, seeds=seeds_), 'clean': toy.summary(clean, prompts),
                'noise': toy.summary(noise, prompts), 'seeds': seeds_}
    b = cell('s0_base' + ('_quick' if quick else ''), base)
    ov = dict(max_iters=1, prompts_per_iter=2, eval_every=1, save_every=0) if quick else {}
    # train.py's defaults as they are (lambda_KL held at the gradient ratio 1: docs/method.md 5.6)
    run = C.train('s0_ratio' + ('_quick' if quick else ''), dict(ov, **TC.EXTRA), pinned=False)
    # the same at the paper's lambda_KL (1e-7 warming to 1e-5: the trust region does not act)
    paper = C.train('s0_paper_kl' + ('_quick' if quick else ''), dict(ov, **TC.EXTRA, kl_ratio_target=0.0))
    with open(os.path.join(toy.DIR, 'pretrain.log')) as f:
        log = f.read().strip().split('\n')[-1]  # toy.py's last line: steps, time, final loss
    R['0'] = dict(base=b, run=run and dict(evals=run['evals'], wall=run['wall']), pretrain=log,
                  paper=paper and dict(evals=paper['evals'], wall=paper['wall']))
    cols = ('VQ', 'MQ', 'TA', 'composite', 'manifold', 'colour+direction right')
    fmt = lambda k, v: f'{100 * v:.0f}%' if k == 'colour+direction right' else f'{v:.3f}'
    rows = [[f'base, {TOY["num_steps"]} steps, shift {TOY["shift"]:g}, cfg {TOY["cfg"]:g} (the RL setting)'] + [fmt(k, b['rl'][k]) for k in cols],
            [f'base, {toy.EVAL_STEPS} steps, shift {toy.EVAL_SHIFT:g}, cfg {toy.EVAL_CFG:g}'] + [fmt(k, b['best'][k]) for k in cols],
            ['clean renders / pure noise'] + [f'{fmt(k, b["clean"][k])} / {fmt(k, b["noise"][k])}' for k in cols]]
    md = ['## 0. The toy world', '',
          f'The base model (`python -m models.toy`: {log.replace("done: ", "")}); ODE samples of the 16 held-out prompts x '
          f'{b["seeds"]} seeds; pure noise = decoded N(0, I) latents:', '',
          table(['sampling', 'VQ', 'MQ', 'TA', 'composite', 'manifold dist.', 'colour and direction right'], rows), '']
    for r, what in ((run, 'config/toy.py` (sage, eta 0.5, equalizer, dual KL, lambda_KL holding the gradient ratio at 1'),
                    (paper, 'config/toy.py --kl_ratio_target=0` (the same at the paper\'s lambda_KL, 1e-7 warming to 1e-5')):
        if r is not None:
            md += [run_line(r, what), '']
    MD.extend(md)


def run_line(run, what):
    """A headline run's sentence: its held-out composite over the run, its components and the alarm."""
    e = {r['iter']: r for r in run['evals']}
    first, last = e[min(e)], e[max(e)]
    mid = ' -> '.join(f'{e[i]["composite"]:.3f} (iteration {i})' for i in sorted(e)[1:])
    return (f'`python train.py {what}, '
            f'{max(e)} iterations of {TOY["prompts_per_iter"]} prompts x G={TOY["group_size"]}, lr '
            f'{TOY["learning_rate"]:.0e}, cfg {TOY["cfg"]:g}; {int(run["wall"]) // 60} min {int(run["wall"]) % 60} s here on one '
            f'CPU thread, one process): held-out composite ({TC.EVAL_PROMPTS} prompts x '
            f'{TC.EXTRA.get("eval_samples", TOY["eval_samples"])} seeds of train.py\'s own; iteration 0 is the base model) '
            f'**{first["composite"]:.3f} -> {mid}**; TA {first["TA"]:.2f} -> {last["TA"]:.2f} (colour '
            f'{first["colour"]:.2f} -> {last["colour"]:.2f}, direction {first["direction"]:.2f} -> '
            f'{last["direction"]:.2f}), MQ {first["MQ"]:.2f} -> {last["MQ"]:.2f}, VQ {first["VQ"]:.2f} -> '
            f'{last["VQ"]:.2f}, manifold distance {first["manifold"]:.3f} -> {last["manifold"]:.3f}. '
            + alarm_sentence(run['evals']))


def alarm_sentence(evals):
    """What the reward-hacking alarm said at the run's evaluations (docs/method.md section 9)."""
    said = [(r['iter'], r['alarm']) for r in evals if r.get('alarm')]
    if not said:
        return 'The reward-hacking alarm: silent.' if any('alarm' in r for r in evals) else ''
    return ('The reward-hacking alarm (docs/method.md 9): ' + '; '.join(f'iteration {i}: {", ".join(names)}' for i, names in said) + '.')


# ============================================================================= 5. on paper
def section5():
    # the full-size numbers are measured by bench/fullsize.py (fake tensors, ~30 min on 2 cores; not
    # re-run here): its markdown block is quoted as written, never retyped
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'results', 'fullsize')
    if not os.path.exists(path + '.md'):
        MD.extend(['## 5. HunyuanVideo 1.5 at full size', '', 'Run `python -m bench.fullsize` first.', ''])
        return
    with open(path + '.md') as f:
        lines = f.read().rstrip().split('\n')
    with open(path + '.json') as f:
        runs = json.load(f)['runs']
    R['5'] = dict(P=runs[0]['P'], peak_gib={f'{r["what"]} {r["frames"]}x{r["height"]}x{r["width"]} world {r["world"]}':
                                            r['peak']['Total'] / 2 ** 30 for r in runs})
    MD.extend(['## 5. ' + lines[0][3:]] + lines[1:] + [''])
    from diffusers import HunyuanVideo15Transformer3DModel as T
    with torch.device('meta'):  # the 480p model's architecture (the class defaults), no memory
        net = T()
    P, gpus = sum(p.numel() for p in net.parameters()), 8
    # Muon (optimizer.py) per optimizer step and rank: an all-gather of every 2-D gradient in fp32 and
    # 5 Newton-Schulz iterations on each whole (m, n) matrix, m <= n: 5 (4 m^2 n + 2 m^3) FLOPs, on every rank
    mats = [sorted(p.shape) for p in net.parameters() if p.ndim == 2]
    P_2d = sum(m * n for m, n in mats)
    muon = dict(P_2d=P_2d, gather_GB=4 * P_2d * (gpus - 1) / gpus / 1e9, ns_TFLOP=sum(5 * (4 * m * m * n + 2 * m ** 3)
                for m, n in mats) / 1e12, state_GB_per_gpu=(4 * P_2d + 8 * (P - P_2d)) / gpus / 1e9)
    R['5']['muon'] = muon
    md = []
    md += [f'Muon (the released optimizer, optimizer.py) per optimizer step and GPU: {muon["P_2d"] / 1e9:.2f} B weights '
           f'in 2-D matrices; gathering each whole gradient receives {muon["gather_GB"]:.1f} GB (fp32; FSDP2\'s own '
           f'weight all-gather moves 2 B/weight in bf16 per forward); Newton-Schulz on every whole matrix costs '
           f'{muon["ns_TFLOP"]:.0f} TFLOP, repeated on every rank (not split across ranks), '
           f'{muon["ns_TFLOP"] / 400:.2f} s at 400 TFLOP/s: small next to an iteration. Optimizer state '
           f'{muon["state_GB_per_gpu"]:.2f} GB per GPU (Muon momentum 4 B + AdamW 8 B per weight, /8) instead of '
           f'AdamW\'s {8 * P / gpus / 1e9:.2f} GB.', '']
    MD.extend(md)


# ============================================================================= main
print(f'bench: out={out} quick={quick} sections={sections} model={MODEL_HASH}', flush=True)
order = {'0': section0, '1': toy_samplers.section1, '2': toy_gradnorm.section2, '5': section5,
         '4': toy_cost.section4, '3': toy_ablations.section3}  # cheap ones first
for k, fn in order.items():
    if k in sections.split(','):
        fn()
        print(f'[{time.time() - T_START:6.0f}s] section {k} done', flush=True)
by_num = {}
cur = None
for line in MD:
    if line.startswith('## '):
        cur = line[3]
    by_num.setdefault(cur, []).append(line)
head = ['# Benchmarks', '',
        f'Written by `python -m bench.toy{" --quick" if quick else ""}` ({time.strftime("%Y-%m-%d %H:%M")}, toy base model '
        f'{MODEL_HASH}, torch {torch.__version__}, {threads} CPU threads). Raw numbers: bench.json; '
        'cached cells: cells/; plots: *.png.', '']
prev = {}
if os.path.exists(os.path.join(out, 'bench.json')):
    with open(os.path.join(out, 'bench.json')) as f:
        prev = json.load(f)
if prev.get('model_hash') == MODEL_HASH and prev.get('config', {}).get('quick') == quick:
    for k, lines in prev.get('markdown', {}).items():  # --sections=...: the others stay as last written
        if k not in by_num:
            by_num[k], R[k] = lines, prev.get(k)


def findings():
    """The findings of section 2 and the section-3 ablations, each sentence from their numbers."""
    mean, sci = lambda xs: sum(xs) / len(xs), lambda x: f'{x:.0e}'.replace('e-0', 'e-').replace('e+00', '')
    p3, st, out_ = R.get('3') or {}, (R.get('2') or {}).get('stats'), []
    if st:
        sl, rl, ra, re = ([v[k] for v in st.values()] for k in ('slope', 'r_log', 'ratio', 'ratio_eq'))
        out_.append(f'- *Fig. 4*: for every sampler `||d logp_t / d theta||` tracks `N_t` (log-log slope {min(sl):.2f} '
                    f'to {max(sl):.2f}, correlation of the logs at least {min(rl):.2f}); S_t brings the max/min of the '
                    f'per-step gradient norms from {min(ra):.0f}-{max(ra):.0f}x down to at most {max(re):.2f}x.')
    kls = [k for k in ('kl=fixed', 'kl=stepwise', 'kl=moving', 'kl=dual') if p3.get(k, {}).get('kl_grad_ratio')]
    sweep = sorted((float(k.split('=')[1]), v) for k, v in p3.items() if k.startswith('kl_max=') and v['kl_grad_ratio'])
    if kls and sweep and 'kl=none' in p3:
        comp = [mean(p3[k]['composite']) for k in kls + ['kl=none']]
        out_.append(f'- *The trust region at the released kl_max {sci(sweep[0][0])}* (part b): its gradient is at most '
                    f'{sci(max(mean(p3[k]["kl_grad_ratio"]) for k in kls))} of the policy\'s (mean over iterations) and '
                    f'every KL strategy, none included, ends at composite {min(comp):.4f}' +
                    (f'-{max(comp):.4f}' if f'{min(comp):.4f}' != f'{max(comp):.4f}' else ' (all of them)') + '. Part (d), '
                    'kl_max: KL gradient / policy gradient (composite): ' + ', '.join(
                        f'{sci(x)}: {sci(mean(v["kl_grad_ratio"]))} ({mean(v["composite"]):.3f})' for x, v in sweep) + '.')
    opts = {o: sorted((float(k.split('=')[1]), v) for k, v in p3.items() if k.startswith(o + ' lr=')) for o in ('adamw', 'muon')}
    if all(opts.values()):
        out_.append('- *Optimizer* (part f), composite by learning rate: ' + '; '.join(
            f'{o}: ' + ', '.join(f'{sci(lr)} {pm(v["composite"])}' for lr, v in runs) for o, runs in opts.items()) + '.')
    g = [p3.get(k) for k in ('project defaults', 'released: all three', 'prompt_noise=fixed')]
    if all(g):
        ours, rel, seed = (mean(v['composite']) for v in g)
        out_.append(f'- *The released cadence, seeding and median* (part g): composite {rel:.4f} vs ours {ours:.4f} '
                    f'(seed std {mean_std(g[0]["composite"])[1]:.3f}); initial noises fixed per prompt alone: {seed:.4f}' +
                    (', so the gap is the seeding.' if abs(seed - rel) < abs(ours - rel) / 10 else '.'))
    return out_


found = findings()  # the sections' conclusions in a sentence each: the first part of results/README.md
if found:
    head += ['## Findings', '', f'Sections 2 and 3 in a sentence each (section 3: {train_iters} iterations x '
             f'{seeds} seeds of every switch, parts (a)-(h); the paired 5-seed verdicts are section 6); the tables '
             'follow.', ''] + found + ['']
# sections 6 on: from the first block another script writes (bench.verdicts, bench.compute, bench.paper, ...) to
# the end, the file is kept as it is (their blocks and the text written between them)
md_path = os.path.join(out, 'README.md')
old_md = open(md_path).read() if os.path.exists(md_path) else ''
first = re.search(r'^<!-- (?!bench\.toy:)(.+?):begin', old_md, re.M)
with open(md_path, 'w') as f:
    f.write('\n'.join(head + [l for k in sorted(by_num) for l in by_num[k]]) + '\n'
            + (old_md[first.start():] if first else ''))
with open(os.path.join(out, 'bench.json'), 'w') as f:
    json.dump(dict(config=config, model_hash=MODEL_HASH, **R, markdown=by_num), f, indent=1)


def readme_block():
    """The README's headline figures, from this run's results: the default run and Fig. 4, a line each;
    every table and the other findings are results/README.md's."""
    run = [l for l in by_num.get('0', []) if l.startswith('`python train.py config/toy.py')]
    return ['- ' + l for l in run] + [f for f in found if f.startswith('- *Fig. 4*')]


if not quick and out == 'results' and os.path.exists('README.md'):
    C.put_block('README.md', 'bench.toy', readme_block())
    print('README.md: results block rewritten', flush=True)
print(f'bench done in {time.time() - T_START:.0f}s: {out}/README.md', flush=True)
