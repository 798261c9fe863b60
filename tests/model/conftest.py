"""tests/model: run single-threaded. The smoke model's ops are tiny, so a second intra-op thread
only adds synchronisation (about 4× slower per step on a shared 2-core CI machine)."""
import pytest
import torch


@pytest.fixture(autouse=True)
def single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
