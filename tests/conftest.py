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
