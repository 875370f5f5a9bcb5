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

Sections (the numbers of the README's tables):
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
 6. (bench/verdicts.py, its own script: its block of results/README.md is kept as it last wrote it)
    the paper's claims decided by paired seeds, 5 seeds x 60 iterations.
 7. (bench/compute.py, its own script, its block kept the same way) alignment per unit of compute.

Where this differs from the issue's wording, and why: the overhead ratio of section 4 times the
transformer passes in the bench process right after the train.py run (a subprocess: it runs as
a user runs it, with no timing hooks inside), on the same batch sizes, thread count and machine;
peak memory is each process's ru_maxrss, which counts the Python interpreter and libraries too.
"""
import json
import math
import os
import subprocess
import sys
import tempfile
import time

import torch

from bench import common as C
import equalizer
import model as M
import sde
import toy
from configurator import configure, list_of

# ----------------------------------------------------------------------------- settings
out = 'results'                 # output folder: bench.json, README.md, *.png, cells/ (committed), runs/ (not)
quick = False                   # a reduced version of everything (<= 3 min on 2 cores)
sections = '0,1,2,3,4,5'        # which sections to run
ablations = 'a,b,c,d,e,f,g,h'   # which parts of section 3 to run (the tables show every part already cached)
threads = 1                     # torch CPU threads, here and in every train.py started (2 threads on a
                                # shared 2-core machine run ~10x slower: OpenMP spin-waits)
eta = 0.5                       # the paper's default exploration scale
group = 4                       # G of the exploration measurement (section 1)
bench_prompts = 16              # prompts of the section-1 rollouts (the toy's held-out prompts)
search_iters = 6                # bisection steps of the matched-exploration eta search
grad_clips = 4                  # clips whose per-step gradient norms are averaged (section 2)
seeds = 3                       # seeds per training cell (section 3)
train_iters = 15                # max_iters of a section-3 run
train_prompts_per_iter = 8      # prompts_per_iter of a section-3 run (x group_size clips)
acting_kl_max = 0.1             # parts b and c are run again at this kl_max, where the KL acts (part d)
budget_min = 0.0                # start no new training run after this many minutes (0: no limit)
first_seed = 0                  # section 3 runs seeds first_seed..seeds-1 (another process can take the others)
only = ''                       # run only the section-3 cells whose label contains this text ('': all)
reverse = False                 # run section 3's cells last to first: a second bench process started so
                                # meets the first in the middle (each skips the cells the other cached)
cost_iters = 4                  # iterations of the section-4 timing run (the first is warm-up)
_argv = [a + '=True' if a == '--quick' else  # a bare flag; lists like --sections=1,2 stay strings
         f"{a.split('=')[0]}={a.split('=', 1)[1]!r}" if a.split('=')[0] in ('--sections', '--ablations') else a
         for a in sys.argv[1:]]
config = configure(globals(), _argv, rules=dict(sections=list_of(*'012345'), ablations=list_of(*'abcdefgh')))
if first_seed >= seeds:
    raise SystemExit(f'config error: first_seed must be below seeds ({seeds}), got {first_seed}')
# -----------------------------------------------------------------------------
EVAL_PROMPTS = 16  # held-out prompts of every train.py run (the toy's)
EXTRA = {}  # more train.py overrides of every run
if quick:  # every section, tiny: a smoke test of the whole bench, never over the committed results
    out = os.path.join(tempfile.gettempdir(), 'bench_quick') if out == 'results' else out
    bench_prompts, search_iters, grad_clips, seeds, train_iters, cost_iters = 4, 1, 1, 1, 2, 2
    train_prompts_per_iter = 2
    EVAL_PROMPTS = 4  # x 1 seed, and no export
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(toy.DIR, 'eval_prompts.txt')) as f, open(os.path.join(out, 'eval4.txt'), 'w') as g:
        g.write(''.join(f.readlines()[:EVAL_PROMPTS]))
    EXTRA = dict(eval_samples=1, eval_prompts=os.path.join(out, 'eval4.txt'), export_dtype='')
torch.set_num_threads(threads)
KINDS = ('sage', 'flow', 'dance', 'cps')
TOY = {}  # the toy world's sampler settings, read from config/toy.py (num_steps, shift, cfg, ...)
exec(open('config/toy.py').read(), {}, TOY)
PAPER_STEPS, PAPER_SHIFT = 20, 5.0  # the paper's schedule
C.setup(out, threads, budget_min)
T_START, MODEL_HASH, cell, cached, table = C.T_START, C.MODEL_HASH, C.cell, C.cached, C.table
try:
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
except ImportError:  # the tables are written all the same
    plt = None


def f4(x):
    return f'{x:.4f}' if abs(x) >= 1e-3 or x == 0 else f'{x:.2e}'


def mean_std(xs):
    t = torch.tensor(xs, dtype=torch.float64)
    return t.mean().item(), (t.std().item() if len(xs) > 1 else 0.0)


def pm(xs):
    m, s = mean_std(xs)
    return f'{m:.4f} ± {s:.4f}' if len(xs) > 1 else f'{m:.4f}'


R = {}     # everything, written to out/bench.json
MD = []    # the README, section by section
_policy = None


def policy():
    global _policy
    if _policy is None:  # the base model, its dead ByT5 branch frozen as train.py loads it
        _policy = M.load_policy(toy.DIR, 'cpu').eval()
    return _policy


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
    run = C.train('s0_default' + ('_quick' if quick else ''), dict(ov, **EXTRA))
    with open(os.path.join(toy.DIR, 'pretrain.log')) as f:
        log = f.read().strip().split('\n')[-1]  # toy.py's last line: steps, time, final loss
    R['0'] = dict(base=b, run=run and dict(evals=run['evals'], wall=run['wall']), pretrain=log)
    cols = ('VQ', 'MQ', 'TA', 'composite', 'manifold', 'colour+direction right')
    fmt = lambda k, v: f'{100 * v:.0f}%' if k == 'colour+direction right' else f'{v:.3f}'
    rows = [[f'base, {TOY["num_steps"]} steps, shift {TOY["shift"]:g}, cfg {TOY["cfg"]:g} (the RL setting)'] + [fmt(k, b['rl'][k]) for k in cols],
            [f'base, {toy.EVAL_STEPS} steps, shift {toy.EVAL_SHIFT:g}, cfg {toy.EVAL_CFG:g}'] + [fmt(k, b['best'][k]) for k in cols],
            ['clean renders / pure noise'] + [f'{fmt(k, b["clean"][k])} / {fmt(k, b["noise"][k])}' for k in cols]]
    md = ['## 0. The toy world', '',
          f'The base model (`python toy.py`: {log.replace("done: ", "")}); ODE samples of the 16 held-out prompts x '
          f'{b["seeds"]} seeds; pure noise = decoded N(0, I) latents:', '',
          table(['sampling', 'VQ', 'MQ', 'TA', 'composite', 'manifold dist.', 'colour and direction right'], rows), '']
    if run is not None:
        e = {r['iter']: r for r in run['evals']}
        first, last = e[min(e)], e[max(e)]
        mid = ' -> '.join(f'{e[i]["composite"]:.3f} (iteration {i})' for i in sorted(e)[1:])
        md += [f'`python train.py config/toy.py` (sage, eta 0.5, equalizer, dual KL, '
               f'{max(e)} iterations of {TOY["prompts_per_iter"]} prompts x G={TOY["group_size"]}, lr '
               f'{TOY["learning_rate"]:.0e}, cfg {TOY["cfg"]:g}; {int(run["wall"]) // 60} min {int(run["wall"]) % 60} s here on one CPU thread, '
               f'one process): held-out composite ({EVAL_PROMPTS} prompts x {EXTRA.get("eval_samples", TOY["eval_samples"])} '
               f'seeds of train.py\'s own; iteration 0 '
               f'is the base model) '
               f'**{first["composite"]:.3f} -> {mid}**; TA {first["TA"]:.2f} -> {last["TA"]:.2f} (colour '
               f'{first["colour"]:.2f} -> {last["colour"]:.2f}, direction {first["direction"]:.2f} -> '
               f'{last["direction"]:.2f}), MQ {first["MQ"]:.2f} -> {last["MQ"]:.2f}, VQ {first["VQ"]:.2f} -> '
               f'{last["VQ"]:.2f}, manifold distance {first["manifold"]:.3f} -> {last["manifold"]:.3f}.', '']
    MD.extend(md)


# ============================================================================= 1. samplers
def variance_regime(kind, s, s_next, eta, regime, s1):
    """Sigma of one step under a treatment of the 1/(1-s) singularity at s = 1 (Fig. 9):
    'subst' FlowGRPO's: 1 - s replaced by 1 - s_1 where s = 1 (for sage: the rate u/(1-u) is
            u/max(1-u, 1-s_1), integrated exactly); 'clamp': 1 - s >= 3e-3 (flow: s/max(1-s, 3e-3) d);
    'default' each kind's own (flow = subst, sage = clamp). dance and cps have no singularity."""
    if regime == 'default' or kind in ('dance', 'cps'):
        return sde.variance(kind, s, s_next, eta)
    if kind == 'flow':
        if regime == 'subst':
            return sde.variance('flow', s, s_next, eta)
        return eta**2 * s / max(1 - s, 3e-3) * (s - s_next)
    if regime == 'clamp':
        return sde.variance('sage', s, s_next, eta)
    # sage, subst: int_{s'}^{s} u / max(1 - u, 1 - s1) du, split at s1 (exact on both pieces)
    lo, hi = s_next, min(s, s1)
    part = (-(hi - lo) + math.log((1 - lo) / (1 - hi))) if hi > lo else 0.0
    if s > s1:
        part += (s**2 - max(s_next, s1)**2) / 2 / (1 - s1)
    return eta**2 * part


def std_tables():
    res = {}
    for name, (n, k) in (('paper', (PAPER_STEPS, PAPER_SHIFT)), ('toy', (TOY['num_steps'], TOY['shift']))):
        sig = sde.sigmas(n, k).double().tolist()
        res[name] = {regime: {kind: [math.sqrt(max(0.0, variance_regime(kind, sig[i], sig[i + 1], eta, regime, sig[1])))
                                     for i in range(n)] for kind in KINDS} for regime in ('subst', 'clamp', 'default')}
        res[name]['sigmas'] = sig
    return res


def rollouts(kind, eta_, prompts, shared=False, seed=0):
    """G rollouts per prompt of the base model (toy steps/shift/cfg). shared=False: every clip its
    own initial noise (a GRPO group, as train.py draws it); shared=True: the G clips of a prompt
    start from the same noise and differ only in the SDE's noise, so their spread is the sampler's
    own exploration (exactly 0 for the ODE). kind 'ode': the ODE sample of the same initial noise."""
    net, G = policy(), group
    clips = [(j, g) for j in range(len(prompts)) for g in range(G)]  # group j = rows j*G .. j*G+G-1
    sig = sde.sigmas(TOY['num_steps'], TOY['shift'])
    cache = M.encode_prompts(toy.DIR, prompts + [''])
    shape = M.latent_shape(toy.DIR, 0, 0, 0)
    frames = []
    for c in range(0, len(clips), 32):
        part = clips[c:c + 32]
        init = M.generators([seed * 10**6 + j * 100 + (0 if shared else g) for j, g in part])
        gens = M.generators([seed * 10**6 + j * 100 + g + 50 for j, g in part])  # the SDE's noise streams
        text = M.batch_text(cache, [prompts[j] for j, _ in part], 'cpu')
        neg = M.batch_text(cache, [''] * len(part), 'cpu')
        x, _ = M.sample(net, M.noise(shape, init, 'cpu'), sig, text, TOY['cfg'], neg, kind, eta_, gens)
        frames.append(toy.decode(x))
    frames = torch.cat(frames)
    r = toy.reward(frames, [prompts[j] for j, _ in clips])
    comp = 0.5 * r['VQ'] + 0.5 * r['MQ'] + r['TA']  # Setting B
    spread = comp.view(len(prompts), G).std(1, unbiased=False).mean()  # population std within a group
    return dict(manifold=toy.manifold_distance(frames), VQ=r['VQ'], MQ=r['MQ'], TA=r['TA'], composite=comp,
                **{'sde_std' if shared else 'group_std': spread})


def summarise(m, ode=None):
    out_ = {k: float(v.float().mean()) for k, v in m.items()}
    if ode is not None:  # paired with the ODE sample of the same initial noise
        out_['d_manifold'] = float((m['manifold'] - ode['manifold']).mean())
    return out_


def section1():
    std = cell('s1_std', std_tables)
    prompts = [p for p in toy.all_prompts() if toy.is_eval_prompt(p)][:bench_prompts]

    def at_default():
        ode, ode_sh = rollouts('ode', 0.0, prompts), rollouts('ode', 0.0, prompts, shared=True)
        res = {'ode': dict(summarise(ode), sde_std=0.0)}
        for kind in KINDS:
            res[kind] = summarise(rollouts(kind, eta, prompts), ode)
            res[kind + '_shared'] = summarise(rollouts(kind, eta, prompts, shared=True), ode_sh)
            res[kind]['sde_std'] = res[kind + '_shared']['sde_std']
        return res
    base = cell(f's1_rollouts_p{len(prompts)}', at_default)
    ode_run = rollouts('ode', 0.0, prompts, shared=True)  # cheap; the pairing baseline of the searches
    target = base['sage']['sde_std']

    def matched(kind):
        def run():
            lo, hi = {'cps': (0.01, 1.0), 'dance': (0.1, 16.0)}.get(kind, (0.02, 4.0))
            tried = []
            for _ in range(search_iters):  # bisection in log eta; the SDE's spread grows with eta
                mid = math.sqrt(lo * hi)
                m = summarise(rollouts(kind, mid, prompts, shared=True), ode_run)
                tried.append(dict(eta=mid, **m))
                lo, hi = (mid, hi) if m['sde_std'] < target else (lo, mid)
            best = min(tried, key=lambda t: abs(t['sde_std'] - target))
            return dict(target=target, best=best, tried=tried)
        return cell(f's1_matched_{kind}_p{len(prompts)}_i{search_iters}', run)
    match = {kind: matched(kind) for kind in ('flow', 'dance', 'cps')}
    R['1'] = dict(std=std, rollouts=base, matched=match)

    steps = [0, 1, 5, 10, 15, 19]
    md = ['## 1. Samplers without training',
          f'Per-step std sqrt(Sigma) at eta {eta}, the paper\'s schedule (20 steps, shift 5), steps {steps}. '
          'Treatments of the 1/(1-s) singularity at s = 1 (Fig. 9): **subst** = FlowGRPO\'s (1-s at s=1 '
          'replaced by 1-s_1; for sage the rate u/(1-u) becomes u/max(1-u, 1-s_1), integrated exactly), '
          '**clamp** = 1-s >= 3e-3 (flow: s/max(1-s, 3e-3)·d), **default** = each kind\'s own (flow = subst, '
          'sage = clamp). dance and cps have no singularity: one row each.', '']
    rows = []
    for kind in KINDS:
        for regime in (('subst', 'clamp', 'default') if kind in ('sage', 'flow') else ('default',)):
            rows.append([kind, regime] + [f'{std["paper"][regime][kind][i]:.4f}' for i in steps])
    md += [table(['kind', 'treatment'] + [f'step {i}' for i in steps], rows), '']
    nt = TOY['num_steps']
    md += [f'The toy schedule ({nt} steps, shift {TOY["shift"]}), default treatment:', '',
           table(['kind'] + [f'{i}' for i in range(nt)],
                 [[k] + [f'{v:.3f}' for v in std['toy']['default'][k]] for k in KINDS]), '']
    md += [f'Rollouts of the toy base model ({len(prompts)} held-out prompts x G={group}, {nt} steps, shift '
           f'{TOY["shift"]}, cfg {TOY["cfg"]}), every SDE clip paired with the ODE sample of the same prompt and '
           'initial noise. manifold = RMS pixel distance to the nearest clean render (lower is better); '
           'Δmanifold = SDE - ODE, paired; group std = within-group std of 0.5VQ+0.5MQ+1.0TA over G clips '
           'with different initial noise (a GRPO group, exploration as train.py logs it); SDE std = the same '
           'over G clips sharing the initial noise (the sampler\'s own exploration; 0 for the ODE).', '']
    hdr = ['sampler', 'eta', 'manifold', 'Δmanifold', 'VQ', 'MQ', 'TA', 'composite', 'group std', 'SDE std']
    rw = lambda k, e, m: [k, e, f4(m['manifold']), f4(m.get('d_manifold', 0.0)), f4(m['VQ']), f4(m['MQ']),
                          f4(m['TA']), f4(m['composite']), f4(m['group_std']) if 'group_std' in m else '-',
                          f4(m['sde_std'])]
    md += [table(hdr, [rw('ode', 0, base['ode'])] + [rw(k, eta, base[k]) for k in KINDS]), '']
    md += [f'**Matched exploration**: the group std of distinct initial noises is dominated by that noise (the ODE '
           f'has one too), so eta is matched on the SDE std: for each kind, bisection ({search_iters} steps, log '
           f'eta) to sage\'s SDE std at eta {eta} ({f4(target)}); the closest point found (rollouts with shared '
           'initial noise, Δmanifold paired with their ODE samples):', '']
    md += [table(hdr, [rw('sage', eta, base['sage_shared'])] +
                 [rw(k, f'{v["best"]["eta"]:.3f}', v['best']) for k, v in match.items()]), '']
    verdict = []
    for k, v in match.items():
        dm, ds = v['best']['manifold'] - base['sage_shared']['manifold'], v['best']['sde_std'] - target
        verdict.append(f'{k}: manifold {"+" if dm >= 0 else ""}{dm:.4f} vs sage (SDE std off by {ds:+.4f})')
    md += ['Manifold distance minus sage\'s at matched exploration: ' + '; '.join(verdict) + '.', '']
    peak = {k: max(v['tried'], key=lambda t: t['sde_std']) for k, v in match.items()}
    md += ['The bisection assumes the SDE std grows with eta; it does not everywhere: past some eta the samples '
           'break (manifold distance jumps) and the reward spread of broken clips shrinks again. Largest SDE std '
           'seen per kind: ' + '; '.join(f'{k} {f4(t["sde_std"])} at eta {t["eta"]:.3f} (manifold {f4(t["manifold"])})'
                                        for k, t in peak.items()) + '. All points tried are in bench.json and '
           'samplers.png.', '']
    MD.extend(md)
    if plt:
        fig, ax = plt.subplots(1, 2, figsize=(10, 3.5))
        for kind in KINDS:
            ax[0].plot(std['paper']['default'][kind], marker='.', label=kind)
        ax[0].set(title=f'per-step std, 20 steps, shift 5, eta {eta}', xlabel='step', ylabel='std')
        ax[0].legend()
        for k, v in match.items():
            t = sorted(v['tried'], key=lambda t: t['sde_std'])
            ax[1].plot([x['sde_std'] for x in t], [x['manifold'] for x in t], marker='o', label=k)
        ax[1].scatter([target], [base['sage_shared']['manifold']], color='k', zorder=5, label=f'sage eta {eta}')
        ax[1].set(title='manifold distance vs exploration (toy)', xlabel='SDE std (reward spread, shared initial noise)',
                  ylabel='manifold distance')
        ax[1].legend()
        fig.tight_layout()
        fig.savefig(os.path.join(out, 'samplers.png'), dpi=110)
        plt.close(fig)


# ============================================================================= 2. Fig. 4
def grad_norms(kind, n_steps, shift_):
    """||d logp_t / d theta|| per step (mean over clips) on the base model, and N_t, S_t."""
    net = policy()
    params = [p for p in net.parameters() if p.requires_grad]
    sig = sde.sigmas(n_steps, shift_)
    prompts = [p for p in toy.all_prompts() if toy.is_eval_prompt(p)][:grad_clips]
    cache = M.encode_prompts(toy.DIR, prompts + [''])
    text, neg = M.batch_text(cache, prompts, 'cpu'), M.batch_text(cache, [''] * len(prompts), 'cpu')
    gens = M.generators([1000 + i for i in range(len(prompts))])
    _, rec = M.sample(net, M.noise(M.latent_shape(toy.DIR, 0, 0, 0), gens, 'cpu'), sig, text, TOY['cfg'], neg,
                      kind, eta, gens, keep=True)
    norms = []
    for t in range(n_steps):
        if rec['stds'][0, t] == 0:  # an ODE step has no log-prob
            norms.append(0.0)
            continue
        g = []
        for b in range(len(prompts)):
            one = lambda tx: [u[b:b + 1] for u in tx]
            x, x_next = rec['xs'][b:b + 1, t], rec['xs'][b:b + 1, t + 1]
            v = M.velocity(net, x, sig[t].expand(1), one(text), TOY['cfg'], one(neg))
            logp = sde.step(x, v, sig[t].item(), sig[t + 1].item(), kind, eta, x_next=x_next).logp  # (1,)
            grads = [q for q in torch.autograd.grad(logp.sum(), params, allow_unused=True) if q is not None]
            g.append(torch.sqrt(sum(q.double().square().sum() for q in grads)).item())
        norms.append(sum(g) / len(g))
    N, S = equalizer.proxy(kind, sig, eta), equalizer.scales(kind, sig, eta)
    return dict(norm=norms, N=N.tolist(), S=S.tolist())


def fit_stats(d):
    g, N, S = [torch.tensor(d[k], dtype=torch.float64) for k in ('norm', 'N', 'S')]
    keep = (g > 0) & (N > 0)
    lg, lN = g[keep].log(), N[keep].log()
    slope = ((lN - lN.mean()) * (lg - lg.mean())).sum() / (lN - lN.mean()).square().sum()
    pearson = lambda a, b: torch.corrcoef(torch.stack([a, b]))[0, 1].item()
    ge = g[keep] * S[keep]
    return dict(slope=slope.item(), r_log=pearson(lN, lg), r=pearson(N[keep], g[keep]),
                ratio=(g[keep].max() / g[keep].min()).item(), ratio_eq=(ge.max() / ge.min()).item())


def section2():
    runs = {}
    for kind in KINDS:
        runs[kind] = cell(f's2_{kind}_toy_c{grad_clips}', lambda: grad_norms(kind, TOY['num_steps'], TOY['shift']))
    runs['sage@paper'] = cell(f's2_sage_paper_c{grad_clips}', lambda: grad_norms('sage', PAPER_STEPS, PAPER_SHIFT))
    stats = {k: fit_stats(v) for k, v in runs.items()}
    R['2'] = dict(runs=runs, stats=stats)
    md = ['## 2. Fig. 4: measured gradient norm vs the proxy N_t',
          f'||d logp_t / d theta|| per step on the base model (autograd through model.velocity and '
          f'sde.step(x_next=...), mean over {grad_clips} clips of one SDE rollout each, eta {eta}); N_t from '
          'equalizer.proxy. slope = least-squares slope of log||g|| on log N_t; r = Pearson correlation '
          '(of logs, and raw); max/min = ratio of the largest to the smallest per-step norm over the trained '
          'steps, without and with the equalizer scale S_t. Schedules: the toy one '
          f'({TOY["num_steps"]} steps, shift {TOY["shift"]}) and, for sage, the paper\'s (20, shift 5).', '']
    md += [table(['kind', 'log-log slope', 'r (log)', 'r (raw)', 'max/min without S_t', 'max/min with S_t'],
                 [[k, f'{s["slope"]:.3f}', f'{s["r_log"]:.3f}', f'{s["r"]:.3f}', f'{s["ratio"]:.1f}',
                   f'{s["ratio_eq"]:.2f}'] for k, s in stats.items()]), '']
    d = runs['sage']
    md += ['sage, toy schedule, per step:', '',
           table(['step', '||g||', 'N_t', '||g|| / N_t', 'S_t', 'S_t ||g||'],
                 [[i, f4(g), f4(n), f4(g / n) if n else '-', f4(s), f4(s * g)]
                  for i, (g, n, s) in enumerate(zip(d['norm'], d['N'], d['S']))]), '']
    MD.extend(md)
    if plt:
        fig, ax = plt.subplots(figsize=(5, 4))
        for k, v in runs.items():
            pts = [(n, g) for n, g in zip(v['N'], v['norm']) if n > 0 and g > 0]
            ax.loglog(*zip(*pts), marker='o', linestyle='-', label=k)
        ax.set(xlabel='proxy N_t = |lambda_t| / std_t', ylabel='||d logp_t / d theta||', title='Fig. 4 (toy)')
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(out, 'fig4_gradnorm.png'), dpi=110)
        plt.close(fig)


# ============================================================================= 3. training ablations
def run_train(name, overrides, nproc=1):
    """One train.py run of section 3 or 4 -> its metrics (bench/common.py's train). None if over the time budget."""
    return C.train('s3_' + name, dict(overrides, **EXTRA), nproc)


RELEASED = dict(kl_update='backward', prompt_noise='fixed', median='lower')  # config/released.py's, on the toy


def ablation_cells():
    """{part: [(label, overrides)]}; every run also gets the common budget and a seed."""
    sage = dict(sampler='sage', equalizer=True, kl_strategy='dual')
    at = lambda m: ({} if m == 1e-5 else dict(kl_max=m))  # the released kl_max is train.py's default
    tag = lambda m: '' if m == 1e-5 else f', kl_max={m:g}'
    parts = {  # b and c at the released kl_max, where the KL barely acts, and again at acting_kl_max
        'a': [(f'{k} eq={"on" if e else "off"}', dict(sage, sampler=k, equalizer=e)) for k in KINDS for e in (True, False)],
        'b': [(f'kl={s}{tag(m)}', dict(sage, kl_strategy=s, **at(m))) for m in (1e-5, acting_kl_max)
              for s in ('none', 'fixed', 'stepwise', 'moving', 'dual') if s != 'none' or m == 1e-5] +
             [(f'kl={s}{tag(acting_kl_max)}, 2 updates', dict(sage, kl_strategy=s, **at(acting_kl_max), updates_per_iter=2))
              for s in ('none', 'stepwise', 'moving', 'dual')],  # two optimizer steps: the velocity KL acts
        'c': [(f'anchor_every={n}{tag(m)}', dict(sage, **at(m), **({} if n == 10 else dict(anchor_every=n))))
              for m in (1e-5, acting_kl_max) for n in (1, 5, 10, 50)],
        'd': [(f'kl_max={v:g}', dict(sage, **at(v))) for v in (1e-5, 1e-3, 1e-1, 1.0)],
        'e': [('flow G=8', dict(sage, sampler='flow', group_size=8)), ('sage G=4', dict(sage))],
        # the optimizers have no common lr scale (Muon's update RMS is ~0.2 lr): a sweep of each
        'f': [(f'{o} lr={lr:g}', dict(sage, **({} if lr == 1e-4 else dict(learning_rate=lr)),
                                      **({} if o == 'adamw' else dict(optimizer=o))))
              for o, lrs in (('adamw', (3e-5, 1e-4, 3e-4)), ('muon', (1e-4, 3e-4, 1e-3))) for lr in lrs],
        # config/released.py's cadence, seeding and median (those that apply to the toy), together and alone
        # (median='lower' alone only scales every S_t by one constant, 0.850 on 10 steps: AdamW's and
        # Muon's updates are invariant to that, up to eps and the KL term's tiny relative weight)
        'g': [('project defaults', dict(sage)), ('released: all three', dict(sage, **RELEASED))] +
             [(f'{k}={v}', dict(sage, **{k: v})) for k, v in RELEASED.items() if k != 'median'],
        'h': [('credit none', dict(sage)), ('credit tvrl (window)', dict(sage, credit='tvrl')),  # credit.py
              ('credit tvrl (frame)', dict(sage, credit='tvrl', credit_granularity='frame'))],
    }
    if quick:  # one cell: enough to exercise the subprocess path, the table and the curve
        parts = {'a': parts['a'][0:1]}
    return parts


def cell_name(ov, s):
    key = '_'.join(f'{k}-{v}' for k, v in sorted(ov.items()))
    return f'{key}_it{train_iters}_p{train_prompts_per_iter}_s{s}'


def section3():
    parts = ablation_cells()  # all are tabled from their cached cells; those in `ablations` are run first
    common = dict(max_iters=train_iters, prompts_per_iter=train_prompts_per_iter, eval_every=0, save_every=0,
                  eval_videos=0)
    todo = [(s, ov) for s in range(first_seed, seeds) for k, part in parts.items() if k in ablations.split(',')
            for label, ov in part if only in label]  # seed-major
    done = {}
    for s, ov in (todo[::-1] if reverse else todo):  # a run shared by several parts (e.g. sage + dual) runs once
        name = cell_name(ov, s)
        if name not in done:
            done[name] = run_train(name, dict(common, **ov, seed=s))
    res, md = {}, ['## 3. Training ablations (toy world)',
                   f'Budget per run: `python train.py config/toy.py --max_iters={train_iters} '
                   f'--prompts_per_iter={train_prompts_per_iter}` (group_size 4 unless stated, so '
                   f'{4 * train_prompts_per_iter} clips and one optimizer step per iteration, lr 1e-4), '
                   f'seeds 0..{seeds - 1}; final = ODE eval of the {EVAL_PROMPTS} held-out prompts after the last '
                   'iteration (mean ± std over seeds). before = the same eval of the base model. '
                   'explore = mean within-group reward std over the run. kl_grad = '
                   '||grad of the KL term|| / ||grad of the policy loss|| at the middle trained step '
                   '(diagnostics.gradient_norms, mean over iterations).', '']
    for part, cells in parts.items():
        rows, curves = [], {}
        for label, ov in cells:
            runs = [done.get(cell_name(ov, s)) or cached('s3_' + cell_name(ov, s)) for s in range(seeds)]
            runs = [r for r in runs if r]
            if not runs:
                rows.append([label, 'not run'] + [''] * 8)
                continue
            fin = lambda k: [r['final'][k] for r in runs]
            before = [r['before'].get('composite', float('nan')) for r in runs]
            explore = [mean_std([i['group_std'] for i in r['iters']])[0] for r in runs]
            klg = [i['kl_grad_ratio'] for r in runs for i in r['iters'] if 'kl_grad_ratio' in i]
            lam = [r['iters'][-1]['lambda_kl'] for r in runs]
            res[label] = dict(part=part, n=len(runs), composite=fin('composite'), VQ=fin('VQ'), MQ=fin('MQ'), TA=fin('TA'),
                              manifold=fin('manifold'), before=before, explore=explore, kl_grad_ratio=klg,
                              lambda_final=lam)
            rows.append([label, len(runs), f4(mean_std(before)[0]), pm(fin('composite')), pm(fin('VQ')),
                         pm(fin('MQ')), pm(fin('TA')), pm(fin('manifold')), pm(explore),
                         f'{mean_std(klg)[0]:.2e}' if klg else '-'])
            curves[label] = [[i['reward'] for i in r['iters']] for r in runs]
        title = {'a': '(a) sampler x equalizer, KL dual', 'b': '(b) KL strategy, sage + equalizer',
                 'c': '(c) anchor interval N (dual)', 'd': '(d) kl_max (upper clip / warm-up end of lambda_KL)',
                 'e': '(e) more samples for the baseline: flow G=8 vs sage G=4',
                 'f': '(f) optimizer: AdamW vs Muon (optimizer.py), a learning-rate sweep each',
                 'g': "(g) the released loop's lambda_KL cadence, initial-noise seeding and equalizer median",
                 'h': '(h) token-level credit (TVRL, credit.py), sage + equalizer + dual KL'}[part]
        md += [f'### {title}', '', table(['cell', 'seeds', 'before', 'final composite', 'VQ', 'MQ', 'TA',
                                          'manifold', 'explore', 'kl_grad'], rows), '']
        if plt and curves:
            fig, ax = plt.subplots(figsize=(6, 3.5))
            for label, cs in curves.items():
                n = min(len(c) for c in cs)
                t = torch.tensor([c[:n] for c in cs])
                m, sd = t.mean(0), (t.std(0) if len(cs) > 1 else torch.zeros(n))
                x = range(1, n + 1)
                ax.plot(x, m, label=label, ls='--' if 'kl_max' in label and part != 'd' else '-')  # identical runs overlap
                ax.fill_between(x, m - sd, m + sd, alpha=0.2)
            ax.set(xlabel='iteration', ylabel='mean rollout reward', title=title)
            ax.legend(fontsize=7)
            fig.tight_layout()
            fig.savefig(os.path.join(out, f'ablation_{part}.png'), dpi=110)
            plt.close(fig)
    R['3'] = res
    MD.extend(md)


# ============================================================================= 4. cost
def time_passes(cfg_run):
    """Seconds of the transformer passes one toy iteration must do, measured here on the same
    batch sizes: rollout forwards (no grad), anchor forwards (no grad) and forward+backwards."""
    net = policy().train()
    n_clips = cfg_run['prompts_per_iter'] * cfg_run['group_size']
    n = cfg_run['num_steps']
    rb, tb = min(cfg_run['rollout_batch'], n_clips), min(cfg_run['train_batch'], n_clips)  # clips per pass
    sig = sde.sigmas(n, cfg_run['shift'])
    n_sto = sum(sde.variance('sage', sig[i].item(), sig[i + 1].item(), eta) > 0 for i in range(n))
    n_train = max(1, round((cfg_run.get('timestep_fraction') or 1.0) * n_sto))  # as train.py trains them
    prompts = (toy.all_prompts() * 4)[:n_clips]
    cache = M.encode_prompts(toy.DIR, prompts + [''])
    shape = M.latent_shape(toy.DIR, 0, 0, 0)
    params = [p for p in net.parameters() if p.requires_grad]

    def batch(b):
        text, neg = M.batch_text(cache, prompts[:b], 'cpu'), M.batch_text(cache, [''] * b, 'cpu')
        return torch.randn(b, *shape), text, neg

    def fwd(b, grad):
        x, text, neg = batch(b)
        s = sig[torch.randint(n, (b,))]
        with torch.set_grad_enabled(grad):
            v = M.velocity(net, x, s, text, cfg_run['cfg'], neg)
        if grad:
            v.square().mean().backward()
    fwd(rb, False), fwd(tb, True)  # warm-up
    reps = dict(roll=n * math.ceil(n_clips / rb), anchor=n_train * math.ceil(n_clips / tb),
                fb=n_train * math.ceil(n_clips / tb))
    out_ = {}
    for k, b, grad in (('roll', rb, False), ('anchor', tb, False), ('fb', tb, True)):
        t0 = time.perf_counter()
        for _ in range(reps[k]):
            fwd(b, grad)
        out_[k] = time.perf_counter() - t0
    for p in params:
        p.grad = None
    net.eval()
    return dict(passes=reps, **{f't_{k}': v for k, v in out_.items()})


OPT_WORKER = """
import gc, os, statistics, sys, time, json, torch, torch.distributed as dist
sys.path.insert(0, os.getcwd())
import toy, model as M
from optimizer import build
ddp = 'RANK' in os.environ
if ddp:
    dist.init_process_group('gloo')
torch.set_num_threads(1)
net = M.load_policy(toy.DIR, 'cpu', fsdp=ddp)
params = [p for p in net.parameters() if p.requires_grad]
res = {}
for kind in ('adamw', 'muon'):
    opts, t = build(net, kind, 1e-4, 0.01), []
    for r in range(REPS):
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3  # sharded like p under FSDP2
        if ddp:
            dist.barrier()
        t0 = time.perf_counter()
        for o in opts:
            o.step()
        t.append(time.perf_counter() - t0)
    res[kind] = statistics.median(t[1:])  # the first step allocates the state
if not ddp or dist.get_rank() == 0:
    print('RESULT ' + json.dumps(res))
if ddp:
    del net  # free the FSDP state (it holds the group) first: see the end of train.py
    gc.collect()
    dist.destroy_process_group()
"""


def optimizer_step_cost():
    """Seconds of one optimizer step (AdamW, Muon + AdamW) on the toy policy: 1 process, 2 FSDP ranks."""
    path = os.path.join(out, 'runs', 'opt_worker.py')
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, 'w') as f:
        f.write(OPT_WORKER.replace('REPS', str(3 if quick else 11)))
    res = {}
    for nproc in (1, 2):
        head = [sys.executable] if nproc == 1 else [sys.executable, '-m', 'torch.distributed.run', '--standalone',
                                                    '--nproc_per_node=2']
        p = subprocess.run(head + [path], capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS='1'))
        if p.returncode:
            raise RuntimeError(f'optimizer step timing failed:\n{p.stderr[-3000:]}')
        res[f'{nproc}'] = json.loads([l for l in p.stdout.splitlines() if l.startswith('RESULT ')][-1][7:])
    return res


def section4():
    ov = dict(max_iters=cost_iters, eval_every=0, save_every=0, eval_videos=0, diag_every=0)
    if quick:
        ov['prompts_per_iter'] = 4
    one = run_train(f'cost_1proc_it{cost_iters}_p{ov.get("prompts_per_iter", 8)}', ov)
    two = run_train(f'cost_fsdp2_it{cost_iters}_p{ov.get("prompts_per_iter", 8)}', ov, nproc=2)
    cfg_run = {k: TOY.get(k) for k in ('prompts_per_iter', 'group_size', 'rollout_batch', 'train_batch',
                                       'num_steps', 'shift', 'cfg', 'timestep_fraction')}
    cfg_run.update({k: v for k, v in ov.items() if k in cfg_run})
    passes = cell(f's4_passes_p{cfg_run["prompts_per_iter"]}', lambda: time_passes(cfg_run))
    res = {}
    for name, r in (('1 process', one), ('FSDP 2 ranks', two)):
        if r is None:
            continue
        it = r['iters'][1:] or r['iters']  # the first iteration warms up allocators and kernels
        m = {k: mean_std([i[k] for i in it])[0] for k in ('t_rollout', 't_reward', 't_update')}
        m['peak_mem_gb_ranks'] = it[-1].get('peak_mem_gb_ranks', [it[-1]['peak_mem_gb']])  # a peak: the last is the max
        m['t_iter'] = m['t_rollout'] + m['t_reward'] + m['t_update']
        res[name] = m
    ideal = passes['t_roll'] + passes['t_anchor'] + passes['t_fb']
    if '1 process' in res:
        m = res['1 process']
        res['overhead'] = dict(ideal=ideal, ratio=m['t_iter'] / ideal, rollout=m['t_rollout'] / passes['t_roll'],
                               update=m['t_update'] / (passes['t_anchor'] + passes['t_fb']))
    opt = None if quick else cell('s4_optimizer_step', optimizer_step_cost)  # two more processes: not in --quick
    R['4'] = dict(runs=res, passes=passes, config=cfg_run, optimizer_step=opt)
    md = ['## 4. Cost of one toy GRPO iteration',
          f'`train.py config/toy.py` ({cfg_run["prompts_per_iter"]} prompts x G={cfg_run["group_size"]}, '
          f'{cfg_run["num_steps"]} steps, cfg {cfg_run["cfg"]}, KL dual, diagnostics off), mean over iterations '
          f'2..{cost_iters} on this machine\'s 2 CPU cores (shared; timings are noisy). Peak memory = ru_maxrss '
          'of each process (each rank under torchrun).', '']
    md += [table(['run', 'rollout s', 'reward s', 'update s', 'iteration s', 'peak mem GB (per rank)'],
                 [[k, f'{v["t_rollout"]:.2f}', f'{v["t_reward"]:.3f}', f'{v["t_update"]:.2f}', f'{v["t_iter"]:.2f}',
                   ' / '.join(f'{g:.3f}' for g in v['peak_mem_gb_ranks'])] for k, v in res.items() if k != 'overhead']), '']
    if 'overhead' in res:
        o = res['overhead']
        md += [f'The transformer passes an iteration must do, timed in the bench process on the same batch sizes: '
               f'{passes["passes"]["roll"]} rollout forwards ({passes["t_roll"]:.2f} s), '
               f'{passes["passes"]["anchor"]} anchor forwards ({passes["t_anchor"]:.2f} s), '
               f'{passes["passes"]["fb"]} forward+backwards ({passes["t_fb"]:.2f} s): {ideal:.2f} s in all. '
               f'**Overhead ratio = iteration / passes = {o["ratio"]:.3f}** (target <= 1.10; rollout '
               f'{o["rollout"]:.3f}, update {o["update"]:.3f}).', '']
    n2d = opt and sum(p.numel() for p in policy().parameters() if p.requires_grad and p.ndim == 2)
    md += [] if opt is None else [f'One optimizer step on the toy policy ({n2d / 1e6:.2f} M weights in 2-D matrices; random gradients; median '
           'of 10 steps after the first, seconds per rank): Muon gathers every 2-D gradient (one all-gather per '
           'matrix) and orthogonalises the whole matrix on every rank (optimizer.py).', '',
           table(['optimizer', '1 process s', 'FSDP 2 ranks s (per rank)'],
                 [[k, f'{opt["1"][k]:.4f}', f'{opt["2"][k]:.4f}'] for k in ('adamw', 'muon')]), '']
    MD.extend(md)


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
order = {'0': section0, '1': section1, '2': section2, '5': section5, '4': section4, '3': section3}  # cheap ones first
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
# sections 6 and 7: the blocks bench/verdicts.py and bench/compute.py write, kept as they last wrote them
keep = {tag: C.get_block(os.path.join(out, 'README.md'), tag) for tag in ('bench.verdicts', 'bench.compute')}
with open(os.path.join(out, 'README.md'), 'w') as f:
    f.write('\n'.join(head + [l for k in sorted(by_num) for l in by_num[k]]) + '\n')
for tag, lines in keep.items():
    if lines is not None:
        C.put_block(os.path.join(out, 'README.md'), tag, lines)
with open(os.path.join(out, 'bench.json'), 'w') as f:
    json.dump(dict(config=config, model_hash=MODEL_HASH, **R, markdown=by_num), f, indent=1)


def readme_block():
    """The README's headline figures, from this run's results: the default run and Fig. 4, a line each;
    every table and the other findings are results/README.md's."""
    run = [l for l in by_num.get('0', []) if l.startswith('`python train.py config/toy.py`')]
    return ['- ' + l for l in run] + [f for f in found if f.startswith('- *Fig. 4*')]


if not quick and out == 'results' and os.path.exists('README.md'):
    C.put_block('README.md', 'bench.toy', readme_block())
    print('README.md: results block rewritten', flush=True)
print(f'bench done in {time.time() - T_START:.0f}s: {out}/README.md', flush=True)
