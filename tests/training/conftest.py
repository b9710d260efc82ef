import pytest
import torch


@pytest.fixture
def one_thread():
    """Tiny models run fastest on one thread, and two threads slow down tenfold when other jobs share the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
