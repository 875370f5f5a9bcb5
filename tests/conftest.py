import pytest
import torch


@pytest.fixture(autouse=True, scope='module')
def one_thread():
    # small tensors on 2 shared cores: a second intra-op thread only adds spin-waits (measured
    # 5-10x slower when another process is busy); every test module runs with one thread
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def no_process_group_left():
    # a test that initialises a process group in this process (a fake one for the full-size bench)
    # must destroy it: train.py run here afterwards (test_train.run_here) would take it for torchrun's
    yield
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail('this test left a process group initialised')


@pytest.fixture(autouse=True)
def passes_from_zero():
    # model.PASSES counts this process's transformer passes between two count_passes calls; a test
    # that runs forwards in this process must not leave its count to the next (a process starts at 0)
    from models import policy as model
    model.PASSES[:] = [0, 0]
    yield


# The slowest files first (seconds on 2 cores, measured with --durations=0): pytest-xdist's
# --dist loadfile hands out whole files in collection order, so a long file collected last would
# run alone at the end while the other worker idles. Longest first keeps the two workers even.
SLOW_FIRST = ('test_headline.py', 'test_kl_ratio.py',  # the slow tier's longest (-m slow: ~7 and ~4 min)
              'test_train.py', 'test_preemption.py', 'test_checkpoint.py', 'test_wan.py', 'test_train_ranks.py',
              'test_nodes.py', 'test_wan22.py', 'test_compute.py', 'test_credit_train.py', 'test_learning.py',
              'test_sp.py', 'test_alarm.py', 'test_train_settings.py', 'test_rundir.py', 'test_fullsize.py', 'test_sample.py')


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FIRST)))  # stable: a file's order kept
