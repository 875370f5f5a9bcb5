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
def passes_from_zero():
    # model.PASSES counts this process's transformer passes between two count_passes calls; a test
    # that runs forwards in this process must not leave its count to the next (a process starts at 0)
    import model
    model.PASSES[:] = [0, 0]
    yield
