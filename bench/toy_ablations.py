"""
Section 3 of bench/toy.py, the training ablations on the toy world: subprocesses of
`train.py config/toy.py`, several seeds each: (a) sampler x equalizer, (b) KL strategy, (c) anchor
interval, (d) kl_max, (e) flow G=8, (f) AdamW vs Muon (an lr sweep each), (g) the released lambda_KL
cadence, initial-noise seeding and median, (h) token-level credit. Every cell cached
(results/cells/s3_*.json); the tables show every cached cell. Writes section 3 of results/README.md
and ablation_*.png.

    python -m bench.toy --sections=3 --ablations=a,b --seeds=5   # part of it, more seeds
    python -m bench.toy --sections=3 --ablations=f --reverse=True   # a second process, meeting the first halfway
"""
import os

import torch

from bench import toy_common as TC
from bench.common import cached, table
from bench.toy_common import KINDS, MD, R, f4, mean_std, plt, pm, run_train

# ----------------------------------------------------------------------------- settings
# set from bench.toy's command line (it imports them and hands the values back: bench/common.py's share)
from bench.toy_common import out, quick  # shared by several sections: bench.toy sets these copies too
ablations = 'a,b,c,d,e,f,g,h'   # which parts of section 3 to run (the tables show every part already cached)
seeds = 3                       # seeds per training cell (section 3)
train_iters = 15                # max_iters of a section-3 run
train_prompts_per_iter = 8      # prompts_per_iter of a section-3 run (x group_size clips)
acting_kl_max = 0.1             # parts b and c are run again at this kl_max, where the KL acts (part d)
first_seed = 0                  # section 3 runs seeds first_seed..seeds-1 (another process can take the others)
only = ''                       # run only the section-3 cells whose label contains this text ('': all)
reverse = False                 # run section 3's cells last to first: a second bench process started so
                                # meets the first in the middle (each skips the cells the other cached)
# -----------------------------------------------------------------------------


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
                   f'seeds 0..{seeds - 1}; final = ODE eval of the {TC.EVAL_PROMPTS} held-out prompts after the last '
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
