import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """One intra-op thread: the adapters' problems are small (scikit-learn's checks use at most
    a few hundred points), where a second thread on a shared 2-core machine costs more time in
    contention than it saves."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
