"""
What every rank must decide the same, on 2 gloo ranks that see different things (one spawned pair, its
results read by each test; the fast tier's only second rank for these):
- nonfinite_clips counts every rank's non-finite clips (infra/finite.py count): rank 1's NaN clip is
  logged by rank 0;
- the checkpoint clock (infra/rundir.py Cadence): clocks 1.5 minutes apart, save_every_min 10, both ranks
  decide to save when the later clock reaches 10 minutes (the maximum of the elapsed times), and both
  start again;
- preflight (extras/preflight.py check): a path only rank 1 misses stops both ranks, each with its line.

    python -m pytest tests/test_ranks_agree.py
"""
import json
import os
import socket

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rank(rank, port, out):
    """One rank of the pair: each behaviour's result into out/<rank>.json (imports here: a spawned child
    imports this file, so its top stays light)."""
    import torch.distributed as dist
    from extras import preflight
    from infra import finite, rundir
    os.chdir(ROOT)
    dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', rank=rank, world_size=2)
    seen = {}
    # nonfinite clips: rank 0's 3 clips finite, rank 1's second of 3 not
    seen['count'] = finite.count([True, True, True] if rank == 0 else [True, False, True], 'cpu')
    # the clock: rank 1's runs 1.5 minutes ahead of rank 0's
    now = [0.0]
    c = rundir.Cadence(every=0, minutes=10, device='cpu', clock=lambda: now[0])
    seen['clock'] = [c.due(1)]  # the run's first iteration: due on both, each rank's clock starts again
    for minutes in (4, 9, 11, 12, 20):  # rank 0's clock; from the save at 9, 10 more minutes come at 19 (17.5)
        now[0] = 60 * (minutes + 1.5 * rank)
        seen['clock'].append(c.due(2))
    # preflight: the toy's paths, rank 1's train prompts missing
    config = dict(model='assets/toy', reward_model='world', eval_metrics='', clip_dir='', pickscore_dir='',
                  videoalign_dir='', qwen_dir='', eval_prompts='assets/toy/eval_prompts.txt',
                  train_prompts='assets/toy/train_prompts.txt' if rank == 0 else '/nope/rank1_prompts.txt')
    try:
        preflight.check(config)
        seen['preflight'] = None
    except SystemExit as e:
        seen['preflight'] = str(e.code)
    with open(os.path.join(out, f'{rank}.json'), 'w') as f:
        json.dump(seen, f)
    dist.destroy_process_group()


@pytest.fixture(scope='module')
def ranks(tmp_path_factory):
    import torch.multiprocessing as mp
    out = str(tmp_path_factory.mktemp('ranks'))
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        port = s.getsockname()[1]
    mp.start_processes(_rank, args=(port, out), nprocs=2, start_method='spawn')
    return [json.load(open(os.path.join(out, f'{r}.json'))) for r in (0, 1)]


def test_nonfinite_clips_counts_every_ranks_clips(ranks):
    assert [r['count'] for r in ranks] == [1, 1]


def test_the_clock_decides_the_same_on_every_rank(ranks):
    # at 9 minutes on rank 0 (10.5 on rank 1) both save; then 19 - 9 = 10 (rank 1: 20.5 - 10.5) at rank 0's 20
    assert ranks[0]['clock'] == ranks[1]['clock'] == [True, False, True, False, False, True], ranks


def test_a_path_one_rank_misses_stops_every_rank(ranks):
    line = "train_prompts '/nope/rank1_prompts.txt' not found"
    for r in ranks:
        assert r['preflight'] and line in r['preflight'], r['preflight']
