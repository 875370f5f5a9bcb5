"""
The prompt set (read_prompts: a text file, or the released CSV format) and its embedding cache,
sized for a prompt set that does not fit in host memory: every prompt is encoded once (by rank 0,
with the pipeline's own encoders, model.encode_prompts) and written in chunks as safetensors shards
keyed by a hash of the prompt; each rank memory-maps the shards and reads only the prompts it uses,
when it uses them.

    <out_dir>/prompt_cache/index.json          {"model": ..., "tensors": n, "prompts": {hash: shard file}}
    <out_dir>/prompt_cache/00000.safetensors   "<hash>.0" .. "<hash>.{n-1}": the family's text tensors
                                               (HunyuanVideo 1.5: embeds, mask, embeds_2, mask_2; Wan: embeds, mask)

    prompts, seeds = read_prompts('prompts/train.txt')  # a text file, or a CSV with prompt (and seed)
    cache = PromptCache(build(dir, model, prompts))   # rank 0 builds (or extends), every rank opens
    e1, m1, e2, m2 = cache['a red circle moving left']  # as many as the family's encoder returns

10,000 prompts of HunyuanVideo 1.5 (1000 x 3584 bf16 Qwen tokens at most, ~2-7 MB each) are
20-70 GB: a torch.load of the whole cache on each of 8 ranks would need 8x that in host RAM.
Here a rank holds one prompt's tensors per lookup (plus the OS page cache, shared by all ranks).
Written atomically per shard and index (temp file, rename): a crash keeps the finished chunks.

Tested by: python -m pytest tests/test_checkpoint.py -k prompt_cache
"""
import csv
import hashlib
import json
import os
import shutil

import torch

from infra import parallel

CHUNK = 256  # prompts encoded and written per shard file (rank 0 holds one chunk at a time)
INDEX = 'index.json'


def choose(n, k, seed):
    """k indices of n prompts for an iteration, drawn from seed: distinct when k <= n, else with
    repeats (a prompt file shorter than an iteration)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randperm(n, generator=g)[:k] if k <= n else torch.randint(n, (k,), generator=g)).tolist()


def read_prompts(path):
    """Prompts of a text file (one per line) or a CSV with a 'prompt' column and an optional 'seed'
    column (the released format); returns the prompts and {prompt: seed} of those that have one."""
    try:
        with open(path, newline='', encoding='utf-8') as f:
            if path.endswith('.csv'):
                rows = list(csv.DictReader(f))
                if rows and 'prompt' not in rows[0]:
                    raise SystemExit(f'prompt file {path!r} has no prompt column (columns: {list(rows[0])})')
                lines = [r['prompt'].strip() for r in rows if r['prompt'].strip()]
                seeds = {r['prompt'].strip(): int(r['seed']) for r in rows if (r.get('seed') or '').strip()}
            else:
                lines, seeds = [l.strip() for l in f if l.strip()], {}
    except FileNotFoundError:
        raise SystemExit(f'prompt file {path!r} not found (one prompt per line, or a CSV with a prompt column)')
    except UnicodeDecodeError as e:
        line = open(path, 'rb').read()[:e.start].count(b'\n') + 1
        raise SystemExit(f'prompt file {path!r} is not UTF-8 text (line {line}: byte {e.object[e.start]:#x}); '
                         're-save it as UTF-8')
    if not lines:
        raise SystemExit(f'prompt file {path!r} is empty (one prompt per line, or a CSV with a prompt column)')
    return lines, seeds


def key(prompt):
    """The name of a prompt inside the cache: a hash (any text, any length, a valid tensor name)."""
    return hashlib.sha256(prompt.encode('utf-8')).hexdigest()[:32]


def build(path, model, prompts, encode_prompts, device='cpu', chunk=CHUNK):
    """Encode the prompts not yet in the cache at `path` (all, if it was built for another model).
    encode_prompts(model, prompts, device, sink, chunk): models/policy.py's, or a stand-in with its
    signature (bench/checkpoint.py)."""
    from safetensors.torch import save_file
    index = {}
    if os.path.exists(os.path.join(path, INDEX)):
        with open(os.path.join(path, INDEX)) as f:
            index = json.load(f)
    stale = index.get('model') != model  # another model's embeddings (or none): start over
    if stale:
        index = dict(model=model, prompts={})
    missing = sorted(p for p in set(prompts) if key(p) not in index['prompts'])

    def write(embeds):  # one chunk: {prompt: n tensors} -> a new shard, then the index
        nonlocal stale
        if stale:  # replaced only once this model's first chunk is encoded: a bad model path or
            shutil.rmtree(path, ignore_errors=True)  # prompt fails before touching the cache
            stale = False
        os.makedirs(path, exist_ok=True)
        name = f'{len({*index["prompts"].values()}):05d}.safetensors'
        tensors = {f'{key(p)}.{j}': t.contiguous() for p, ts in embeds.items() for j, t in enumerate(ts)}
        save_file(tensors, os.path.join(path, name + '.tmp'))
        os.replace(os.path.join(path, name + '.tmp'), os.path.join(path, name))
        index['prompts'].update({key(p): name for p in embeds})
        index['tensors'] = len(next(iter(embeds.values())))  # the same for every prompt of a model
        with open(os.path.join(path, INDEX + '.tmp'), 'w') as f:
            json.dump(index, f)
        os.replace(os.path.join(path, INDEX + '.tmp'), os.path.join(path, INDEX))
    if missing:
        encode_prompts(model, missing, device, sink=write, chunk=chunk)
    return path


def shared(path, model, prompts, encode_prompts, device, master, timeout_minutes=60.0):
    """Rank 0 builds the cache (the encoders' memory on one rank only) while the others wait on the
    c10d store for at most timeout_minutes (parallel.solo); then every rank proves it sees rank 0's
    directory (parallel.check_shared) and opens it, or every rank stops with one line. An error of
    rank 0's (e.g. a word outside the toy's vocabulary) stops every rank with the same line."""
    parallel.solo(lambda: build(path, model, prompts, encode_prompts, device), 'prompt_cache', timeout_minutes)
    parallel.check_shared(path, 'the prompt cache', master, INDEX)  # every rank reads rank 0's index
    return PromptCache(path)


class PromptCache:
    """cache[prompt] -> the family's text tensors, e.g. (embeds, mask, embeds_2, mask_2), read from the
    memory-mapped shard."""

    def __init__(self, path):
        with open(os.path.join(path, INDEX)) as f:
            index = json.load(f)
        self.index = index['prompts']
        self.n = index.get('tensors', 4)  # tensors a prompt (an index without the count: HunyuanVideo 1.5's 4)
        self.path, self.files = path, {}  # shard name -> open safe_open handle (mmap)

    def __getitem__(self, prompt):
        from safetensors import safe_open
        k = key(prompt)
        if k not in self.index:
            raise KeyError(f'prompt not in the cache: {prompt!r}')
        name = self.index[k]
        if name not in self.files:
            self.files[name] = safe_open(os.path.join(self.path, name), framework='pt')
        return tuple(self.files[name].get_tensor(f'{k}.{j}') for j in range(self.n))

    def __contains__(self, prompt):
        return key(prompt) in self.index

    def __len__(self):
        return len(self.index)
