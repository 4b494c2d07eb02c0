import contextlib

import pytest
import torch

# One intra-op thread per test process: the tests' problems are small, and on a shared machine
# (the 2-core CI, a laptop running other jobs) torch's default of one thread per core spends
# more time in contention than it saves: 811 of the tests took 3.8 times as long with torch's
# default two threads on a loaded 2-core machine, and twice as long on an idle one
# (benchmarks/results/test_suite_threads_cpu.md).
torch.set_num_threads(1)

# With torch 2.13's CPU build and two intra-op threads, the first torch.exp of a process was seen
# to return float64 values with relative errors of about 3e-9 (about 1 process in 5; later calls
# are exact to 2e-16). A first call here keeps that out of the tests, which compare at
# tolerances near 1e-10.
torch.exp(torch.zeros(1, dtype=torch.float64))


@pytest.fixture(autouse=True)
def _seed_and_restore_dtype():
    """Fixed seed per test; restore the default dtype afterwards."""
    dtype = torch.get_default_dtype()
    torch.manual_seed(0)
    yield
    torch.set_default_dtype(dtype)


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture
def use_setting():
    """Enter ``gpsd.settings`` context managers for the rest of a test:
    ``use_setting(gpsd.settings.test_chunk_size(30))``; each is left when the test ends."""
    with contextlib.ExitStack() as stack:
        yield stack.enter_context


@pytest.fixture
def count_calls(monkeypatch):
    """``count_calls(module, name)`` replaces ``module.name`` by a wrapper that counts its calls
    in the one-element list it returns, for the rest of the test."""

    def install(module, name):
        calls = [0]
        original = getattr(module, name)

        def counted(*args, **kwargs):
            calls[0] += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
        return calls

    return install
