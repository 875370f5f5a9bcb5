"""
What the sections of bench/toy.py share: the settings several of them read (out, quick, eta), the
toy world's sampler settings (config/toy.py), the base policy, the number formats, the results being
assembled (R for bench.json, MD for results/README.md) and one train.py run of sections 3 and 4.

Not a script: python -m bench.toy runs the sections (bench/toy_*.py), and its command line sets these
settings too (it imports them, then hands the values to every section module: bench/common.py's share).
"""
import torch

from bench import common as C
from models import policy as M
from models import toy

# ----------------------------------------------------------------------------- settings
out = 'results'                 # output folder: bench.json, README.md, *.png, cells/ (committed), runs/ (not)
quick = False                   # a reduced version of everything (<= 3 min on 2 cores)
eta = 0.5                       # the paper's default exploration scale
# -----------------------------------------------------------------------------
EVAL_PROMPTS = 16  # held-out prompts of every train.py run (the toy's; bench.toy --quick: 4)
EXTRA = {}  # more train.py overrides of every run (bench.toy --quick adds its own)
KINDS = ('sage', 'flow', 'dance', 'cps')
TOY = {}  # the toy world's sampler settings, read from config/toy.py (num_steps, shift, cfg, ...)
exec(open('config/toy.py').read(), {}, TOY)
PAPER_STEPS, PAPER_SHIFT = 20, 5.0  # the paper's schedule
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


def run_train(name, overrides, nproc=1):
    """One train.py run of section 3 or 4 -> its metrics (bench/common.py's train). None if over the time budget."""
    return C.train('s3_' + name, dict(overrides, **EXTRA), nproc)
