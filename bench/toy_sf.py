"""
The distilled streaming toy (streaming/toy_sf.py) against issue 57's three targets, beside the bidirectional base,
on the 16 held-out prompts x `samples` seeds, every clip sampled exactly as sample.py samples it (the same seeds
seed * 1000 + i, the family's own sampler: the base 10 Euler steps at shift 3, cfg 1; a streaming model its
generate(), the distilled one the released 4 steps with fresh re-noising):

    composite (0.5 VQ + 0.5 MQ + TA)  >= 0.9 x the base's
    no fading: mean composite of the last third of the frames (6-8) at least 0.9 x the first third's (0-2), each
               third scored as a clip of its own by the toy's reward, per clip, then averaged over the clips (one
               sided: the base's last third scores above its first, a rise is not fading)
    objects move: the direction score (speed along the prompt's direction, models/toy.py reward) >= the base's

Rows: the base, the teacher-forced streaming toy (assets/toy_ar, 8 Euler steps), the distilled toy after stage 1
(assets/toy_sf/ode_init) and after stage 2 (assets/toy_sf), and the DMD teacher (the base at cfg 3, 16 steps).
assets/toy_ar and assets/toy_sf are built, not committed: python -m streaming.toy_ar, then python -m streaming.toy_sf.
It also runs sample.py itself (--model=assets/toy_sf --beside=assets/toy) and checks that its metrics.json
agrees with the rows here; its contact sheet becomes results/toy_sf.png.

    python -m bench.toy_sf              # writes results/toy_sf.md, results/toy_sf.json, results/toy_sf.png (~1 min)
Tested by: running it; the numbers are in results/toy_sf.md.
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile

import torch

import sde
from bench.common import table, write_report
from models import family, toy
from models.policy import encode_prompts, generators, guided_text, load_policy, noise, sample

samples = 4                     # seeds per held-out prompt
seed = 0                        # sample.py's --seed
OUT = 'results/toy_sf'
ROWS = {  # name: (model directory, steps, shift, cfg): None takes the family's DEFAULTS (as sample.py)
    'bidirectional base (sample.py)': ('assets/toy', None, None, None),
    'teacher-forced AR toy, 8 Euler steps': ('assets/toy_ar', None, None, None),
    'distilled, stage 1 (ODE pairs)': ('assets/toy_sf/ode_init', None, None, None),
    'distilled, stage 2 (DMD)': ('assets/toy_sf', None, None, None),
    'DMD teacher: base, 16 steps, cfg 3': ('assets/toy', 16, 3.0, 3.0),
}
THIRDS = (slice(0, 3), slice(6, 9))  # first and last third of the 9 frames


def composite(frames, prompts):
    r = toy.reward(frames, prompts)
    return 0.5 * r['VQ'] + 0.5 * r['MQ'] + r['TA'], r  # (B,)


def clips(path, prompts, steps, shift, cfg):
    """Decoded clips (B, F, 3, H, W) of `prompts` (clip i: seed seed * 1000 + i), as sample.py renders them."""
    fam = family(path)
    d = fam.DEFAULTS
    steps, shift, cfg = steps or d['sample_steps'], shift or d['shift'], cfg or d['cfg']
    unique = list(dict.fromkeys(prompts))
    text, neg = guided_text(encode_prompts(path, unique + [''], 'cpu'), prompts, '', 'cpu')
    net = load_policy(path, 'cpu').eval()
    gens = generators([seed * 1000 + i for i in range(len(prompts))])
    x0 = noise(toy.LATENT_SHAPE, gens, 'cpu')
    with torch.no_grad():
        if hasattr(fam, 'generate'):
            x = fam.generate(net, x0, text, gens, cfg, neg)
        else:
            x = sample(net, x0, sde.sigmas(steps, shift), text, cfg, neg, 'ode', 0.0, gens)[0]
    return fam.load_decoder(path, 'cpu')(x)


def measure(frames, prompts):
    c, r = composite(frames, prompts)
    first, last = (composite(frames[:, t], prompts)[0] for t in THIRDS)
    return dict(composite=c.mean().item(), VQ=r['VQ'].mean().item(), MQ=r['MQ'].mean().item(),
                TA=r['TA'].mean().item(), direction=r['direction'].mean().item(), colour=r['colour'].mean().item(),
                manifold=toy.manifold_distance(frames).mean().item(), first_third=first.mean().item(),
                last_third=last.mean().item(), last_over_first=(last.mean() / first.mean()).item())


def run_sample_py(prompts_file, out_dir):
    """sample.py as a user runs it: the distilled toy beside the base; its metrics.json and contact sheet."""
    cmd = [sys.executable, 'sample.py', '--model=assets/toy_sf', '--beside=assets/toy', '--checkpoint=',
           f'--prompts={prompts_file}', f'--samples={samples}', f'--seed={seed}', f'--out_dir={out_dir}']
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.load(open(os.path.join(out_dir, 'metrics.json')))


def main():
    torch.set_num_threads(toy.THREADS)
    held_out = [p for p in toy.all_prompts() if toy.is_eval_prompt(p)]
    prompts = held_out * samples  # clip i: prompt i % 16, as sample.py
    res = {'samples': samples, 'prompts': len(held_out), 'rows': {}}
    for name, (path, steps, shift, cfg) in ROWS.items():
        res['rows'][name] = measure(clips(path, prompts, steps, shift, cfg), prompts)
    rows, base = res['rows'], res['rows']['bidirectional base (sample.py)']
    final = rows['distilled, stage 2 (DMD)']
    with tempfile.TemporaryDirectory() as tmp:
        pfile = os.path.join(tmp, 'prompts.txt')
        open(pfile, 'w').write('\n'.join(held_out) + '\n')
        sp = run_sample_py(pfile, os.path.join(tmp, 'samples'))
        shutil.copy(os.path.join(tmp, 'samples', 'contact_sheet.png'), OUT + '.png')
    res['sample.py'] = sp  # its 'base' is --model (the distilled toy), 'ToyWorld' the bidirectional base
    agree = abs(sp['base']['composite'] - final['composite']) < 1e-4 and \
        abs(sp['ToyWorld']['composite'] - base['composite']) < 1e-4
    targets = {
        'composite >= 0.9 x base': (final['composite'], 0.9 * base['composite']),
        'last third >= 0.9 x the first': (final['last_over_first'], 0.9),
        'direction >= base': (final['direction'], base['direction']),
    }
    res['targets'] = {k: dict(value=v, bar=b, met=bool(v >= b)) for k, (v, b) in targets.items()}
    keys = ('composite', 'VQ', 'MQ', 'TA', 'direction', 'manifold', 'first_third', 'last_third', 'last_over_first')
    md = [f'# The distilled streaming toy (streaming/toy_sf.py) beside the bidirectional base',
          '', f'Written by `python -m bench.toy_sf`: the {len(held_out)} held-out prompts x {samples} seeds, each '
          'model sampled as sample.py samples it (same seeds; the distilled toy: the released 4 steps, sigmas '
          '1, .9375, .8333, .625, fresh re-noising; block 1, sink 1, window 4). Thirds: frames 0-2 and 6-8 '
          'scored as clips of their own.', '',
          table(['', 'x base', *keys], [[n, f'{r["composite"] / base["composite"]:.2f}', *(f'{r[k]:.4f}' for k in keys)]
                                        for n, r in rows.items()]), '',
          'Issue 57\'s targets, the distilled toy (stage 2):', '',
          table(['target', 'value', 'bar', 'met'],
                [[k, f'{t["value"]:.4f}', f'{t["bar"]:.4f}',
                  'yes' if t['met'] else 'NO'] for k, t in res['targets'].items()]), '',
          f'sample.py (`--model=assets/toy_sf --beside=assets/toy --checkpoint= --samples={samples}`) composite: '
          f'distilled {sp["base"]["composite"]:.4f}, base {sp["ToyWorld"]["composite"]:.4f} '
          f'({"equal to the rows above" if agree else "DIFFERENT from the rows above"}); its contact sheet: '
          'results/toy_sf.png (per prompt: the distilled toy above the base).']
    write_report(OUT, res, md)


if __name__ == '__main__':
    main()
