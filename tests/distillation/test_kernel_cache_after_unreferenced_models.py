"""Memory decisions are taken after the cycle collector has released what unreferenced models
held, where the free memory falls short: the default kernel cache of the matrix-free backends
(where it cannot hold every row) and the automatic backend choice (where a candidate would not
fit)."""

import gc
import weakref

import pytest
import torch
from gpr_reference import rbf_kernel

import gpsd.linalg.backend as backend_module
import gpsd.linalg.memory as memory_module
from gpsd import DataCentricGPR
from gpsd.linalg import choose_backend, free_memory_bytes

N = 1000
WORKING = (8 * 4096 + 4 * 2048) * N * 8  # a prediction's N-vectors, in float64 bytes
EVERY_ROW = N * N * 8


class _InACycle:
    """Stands for an unreferenced model: only the cycle collector frees it."""

    def __init__(self) -> None:
        self.me = self


@pytest.fixture
def collector_off():
    """Only explicit ``gc.collect()`` calls free cycles during the test."""
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    yield
    if was_enabled:
        gc.enable()


def _garbage_holding_memory(monkeypatch, free_while_held: int, free_after: int) -> list:
    """Unreferenced cyclic garbage; the free memory reads ``free_while_held`` until it is
    collected, then ``free_after``. Returns a list that the collection appends to."""
    freed: list[bool] = []
    garbage = _InACycle()
    weakref.finalize(garbage, freed.append, True)
    del garbage
    monkeypatch.setattr(
        memory_module,
        "_measured_free_bytes",
        lambda device: free_after if freed else free_while_held,
    )
    return freed


def test_garbage_is_collected_before_a_cache_that_cannot_hold_every_row(monkeypatch, collector_off):
    x = torch.rand(N, 2, dtype=torch.float64)
    freed = _garbage_holding_memory(monkeypatch, EVERY_ROW, 10 * WORKING)
    operator = backend_module._matrix_free(rbf_kernel(), x, torch.float64, None)
    assert freed == [True]
    # half of the memory freed; before the collection it would have been 0 (the working set
    # does not fit beside it)
    assert operator.cache_bytes == 5 * WORKING


def test_no_collection_where_the_free_memory_holds_every_row(monkeypatch, collector_off):
    x = torch.rand(N, 2, dtype=torch.float64)
    freed = _garbage_holding_memory(monkeypatch, 10 * WORKING, 20 * WORKING)
    operator = backend_module._matrix_free(rbf_kernel(), x, torch.float64, None)
    assert freed == []
    assert operator.cache_bytes == 5 * WORKING
    gc.collect()
    assert freed == [True]


def test_a_model_built_after_an_unreferenced_one_predicts_the_same(monkeypatch, collector_off):
    """End to end on the CPU: the second model, built while the first is cyclic garbage, keeps
    the rows the freed memory allows and predicts as the first did."""
    torch.manual_seed(0)
    x = torch.rand(300, 2, dtype=torch.float64)
    y = torch.sin(4 * x).sum(-1)
    test_x = torch.rand(50, 2, dtype=torch.float64)
    first = DataCentricGPR(x, y, rbf_kernel(), noise=[0.1, 0.2], backend="lanczos")
    expected = first.predict(test_x)
    freed = _garbage_holding_memory(monkeypatch, 300 * 300 * 8, 10 * 300 * 300 * 8 + 10 * WORKING)
    del first
    second = DataCentricGPR(x, y, rbf_kernel(), noise=[0.1, 0.2], backend="lanczos")
    got = second.predict(test_x)
    assert freed == [True]
    torch.testing.assert_close(got.mean, expected.mean, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(got.variance, expected.variance, rtol=1e-9, atol=1e-12)


def test_free_memory_bytes_collects_only_where_less_than_wanted_is_free(monkeypatch, collector_off):
    freed = _garbage_holding_memory(monkeypatch, 100, 1000)
    assert free_memory_bytes("cpu") == 100  # nothing wanted: nothing collected
    assert free_memory_bytes("cpu", wanted=100) == 100
    assert freed == []
    assert free_memory_bytes("cpu", wanted=101) == 1000
    assert freed == [True]


@pytest.mark.parametrize(
    ("n", "free_while_held", "expected", "collected"),
    [
        (1000, 10 * 2**20, "dense", True),  # 4 x 8 MB / 0.8 = 40 MB were not free
        (1000, 2**30, "dense", False),  # they were
        (50_000, 10 * 2**20, "lanczos", False),  # too large for dense or the chain anyway
    ],
)
def test_backend_choice_collects_where_a_candidate_would_not_fit(
    monkeypatch, collector_off, n, free_while_held, expected, collected
):
    freed = _garbage_holding_memory(monkeypatch, free_while_held, 2**30)
    assert choose_backend(n, 10, "cpu") == expected
    assert freed == ([True] if collected else [])
