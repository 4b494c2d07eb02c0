import pytest
import torch


@pytest.fixture(autouse=True)
def _seed_and_restore_dtype():
    """Fixed seed per test; restore the default dtype afterwards."""
    dtype = torch.get_default_dtype()
    torch.manual_seed(0)
    yield
    torch.set_default_dtype(dtype)


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
