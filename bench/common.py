"""
Cached cells of the benchmarks (bench/toy.py, bench/verdicts.py): a finished measurement is one JSON file
<out>/cells/<name>.json stamped with the toy base model's hash. A rerun skips it (and reruns it if the
base model has changed since); it is written atomically, so a bench killed at any moment resumes at
the first cell it had not finished, and the cells are committed, so a long bench spans sessions.

    from bench import common as C
    C.setup(out='results', threads=1, budget_min=40)   # start no new training run after 40 minutes
    res = C.cell('s1_std', fn)                         # fn() once, then the cache
    run = C.train('v_sage_s0', dict(max_iters=60, seed=0))  # one `train.py config/toy.py` run, cached

train() runs train.py as a user runs it (a subprocess, no hooks inside) and keeps its logged metrics:
`iters` (one row per iteration), `evals` (every held-out evaluation, iteration 0 included), `final`
(the last evaluation) and `before` (iteration 0's).

put_block() rewrites the generated block of a Markdown file (README.md, results/README.md) that a
bench owns: figures in the README come from the files a bench wrote, never retyped.

share() hands a bench script's settings to the modules it is made of (bench/fullsize_*.py,
bench/toy_*.py): each keeps its settings at its top, the script imports them so that its command
line sets them, and hands the values back once configured.
"""
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time

from models import toy

OUT = 'results'        # where cells/ and runs/ live (setup() sets it)
THREADS = 1            # torch CPU threads of every train.py started
BUDGET_MIN = 0.0       # start no new training run after this many minutes (0: no limit)
T_START = time.time()


def setup(out, threads, budget_min):
    global OUT, THREADS, BUDGET_MIN
    OUT, THREADS, BUDGET_MIN = out, threads, budget_min
    os.makedirs(os.path.join(OUT, 'cells'), exist_ok=True)


def model_hash():
    """Fingerprint of the toy base model: cached cells of another base model are stale."""
    h = hashlib.sha256()
    d = os.path.join(toy.DIR, 'transformer')
    for f in sorted(os.listdir(d)):
        with open(os.path.join(d, f), 'rb') as fh:
            h.update(fh.read())
    return h.hexdigest()[:12]


MODEL_HASH = model_hash()


def cached(name):
    """The dict of a finished cell of this base model, or None."""
    path = os.path.join(OUT, 'cells', name + '.json')
    if os.path.exists(path):
        with open(path) as f:
            res = json.load(f)
        if res.get('model_hash') == MODEL_HASH:
            return res
    return None


def cell(name, fn):
    """Run fn() once: its dict is cached in OUT/cells/name.json (with the base model's hash)."""
    res = cached(name)
    if res is not None:
        return res
    path = os.path.join(OUT, 'cells', name + '.json')
    t0 = time.time()
    res = fn()
    if res is None:  # not run (time budget): nothing cached
        return None
    res.update(model_hash=MODEL_HASH, seconds=round(time.time() - t0, 1))
    with open(path + '.tmp', 'w') as f:
        json.dump(res, f, indent=1)
    os.replace(path + '.tmp', path)  # atomic: an interrupted bench never caches half a cell
    print(f'[{time.time() - T_START:6.0f}s] cell {name} done in {res["seconds"]}s', flush=True)
    return res


def write_report(out, res, md):
    """A bench's results: res as out.json, the markdown lines md as out.md, md on the console."""
    with open(out + '.json', 'w') as f:
        json.dump(res, f, indent=1)
    with open(out + '.md', 'w') as f:
        f.write('\n'.join(md) + '\n')
    print('\n'.join(md))


def table(header, rows):
    """A Markdown table from a header list and rows of already formatted cells."""
    lines = ['| ' + ' | '.join(header) + ' |', '|' + '---|' * len(header)]
    return '\n'.join(lines + ['| ' + ' | '.join(str(c) for c in r) + ' |' for r in rows])


def block_marks(tag):
    """The markers of the generated block `tag` (the module tag, e.g. bench.toy, writes it) in a Markdown file."""
    return (f'<!-- {tag}:begin: written by `python -m {tag}`; edit that script, not this block -->',
            f'<!-- {tag}:end -->')


def get_block(path, tag):
    """The lines of block `tag` in path (markers excluded), or None if it has none."""
    text = open(path).read() if os.path.exists(path) else ''
    a, b = text.find(f'<!-- {tag}:begin'), text.find(f'<!-- {tag}:end -->')
    return text[text.index('\n', a) + 1:b][:-1].split('\n') if 0 <= a < b else None  # [:-1]: the newline before end


def put_block(path, tag, lines):
    """Rewrite block `tag` of a Markdown file (appended if absent); the rest of the file stays as it is."""
    text = open(path).read() if os.path.exists(path) else ''
    begin, end = block_marks(tag)
    block = '\n'.join([begin] + list(lines) + [end])
    a, b = text.find(f'<!-- {tag}:begin'), text.find(end)
    text = text[:a] + block + text[b + len(end):] if 0 <= a < b else \
        (text.rstrip('\n') + '\n\n' if text.strip() else '') + block + '\n'
    with open(path + '.tmp', 'w') as f:
        f.write(text)
    os.replace(path + '.tmp', path)  # atomic: a killed bench never leaves half a README


def share(settings, *modules):
    """Set each module's setting of a name in `settings` (a module constant of a plain type, as
    infra/configurator.py counts settings) to its value: the script's configured one."""
    plain = (bool, int, float, str, tuple, list, type(None))
    for m in modules:
        g = vars(m)
        g.update({k: v for k, v in settings.items() if k in g and isinstance(g[k], plain)})


def over_budget():
    return bool(BUDGET_MIN) and time.time() - T_START > 60 * BUDGET_MIN


# The benches' runs keep the lambda_KL they were measured with before the ratio hold became train.py's
# default (docs/method.md 5.6): the paper's controller, unless a run's overrides set kl_ratio_target.
PINNED = dict(kl_ratio_target=0.0)


def train_cmd(run_dir, overrides, nproc=1, pinned=True):
    head = [sys.executable] if nproc == 1 else \
        [sys.executable, '-m', 'torch.distributed.run', '--standalone', f'--nproc_per_node={nproc}']
    return head + ['train.py', 'config/toy.py', f'--out_dir={run_dir}'] + \
        [f'--{k}={v}' for k, v in dict(PINNED if pinned else {}, **overrides).items()]


def train(name, overrides, nproc=1, pinned=True):
    """One train.py config/toy.py run -> its metrics (cached as the cell `name`). None if over the budget.
    pinned=False: train.py's defaults as they are now (the README's headline run), not PINNED."""
    def run():
        if over_budget():
            print(f'skip {name}: over the time budget of {BUDGET_MIN} min', flush=True)
            return None
        run_dir = os.path.join(OUT, 'runs', name)
        shutil.rmtree(run_dir, ignore_errors=True)
        env = dict(os.environ, OMP_NUM_THREADS=str(THREADS if nproc == 1 else max(1, THREADS // nproc)))
        t0 = time.time()
        p = subprocess.run(train_cmd(run_dir, overrides, nproc, pinned), capture_output=True, text=True, env=env)
        wall = time.time() - t0
        with open(os.path.join(run_dir, 'log.txt') if os.path.isdir(run_dir) else os.devnull, 'w') as f:
            f.write(p.stdout[-20000:] + p.stderr[-20000:])
        if p.returncode:
            raise RuntimeError(f'{name}: train.py failed ({p.returncode}):\n{p.stderr[-3000:]}')
        rows = [json.loads(l) for l in open(os.path.join(run_dir, 'metrics.jsonl'))]
        # keep the metrics, config and log; drop checkpoints, eval videos and the prompt cache
        for f in os.listdir(run_dir):
            if f not in ('metrics.jsonl', 'config.json', 'log.txt'):
                shutil.rmtree(os.path.join(run_dir, f), ignore_errors=True) if os.path.isdir(os.path.join(run_dir, f)) \
                    else os.remove(os.path.join(run_dir, f))
        evals = [dict(iter=r['iter'], **{k[5:]: v for k, v in r.items() if k.startswith('eval_')},
                      **{k: r[k] for k in ('alarm', 'watch_flagged') if k in r})  # the reward-hacking alarm's
                 for r in rows if 'eval_composite' in r]  # iteration 0 (the base model) first
        return dict(overrides=overrides, wall=wall, iters=[r for r in rows if 'reward' in r], evals=evals,
                    before={k: v for k, v in evals[0].items() if k != 'iter'},
                    final={k: v for k, v in evals[-1].items() if k != 'iter'})
    return cell(name, run)
