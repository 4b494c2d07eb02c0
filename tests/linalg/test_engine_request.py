"""Tests of EngineRequest: validated when made, and equal exactly when an engine built for one
serves the other."""

import gpytorch
import pytest
import torch

from gpsd.linalg import EngineRequest, make_engine

DTYPE = torch.float64


def _request(kernel, x, **changes):
    fields = dict(
        backend="dense",
        schedule_shape=torch.Size([2]),
        steps=3,
        dtype=DTYPE,
        rank=None,
        rtol=1e-8,
        smallest_noise=0.1,
    )
    fields.update(changes)
    return EngineRequest(kernel, x, **fields)


def _problem():
    gen = torch.Generator().manual_seed(0)
    return gpytorch.kernels.RBFKernel().to(DTYPE), torch.rand(20, 2, generator=gen, dtype=DTYPE)


def test_requests_for_the_same_kernel_values_inputs_and_settings_are_equal():
    kernel, x = _problem()
    first = _request(kernel, x)
    second = _request(kernel, x.clone())  # the same values in another tensor
    assert first == second and hash(first) == hash(second)
    assert (first,) == (second,)  # as a cache keeps it, in a tuple


@pytest.mark.parametrize(
    "change",
    [
        {"backend": "cholesky"},
        {"schedule_shape": torch.Size([3])},
        {"steps": 4},
        {"dtype": torch.float32},
        {"rank": 8},
        {"rtol": 1e-6},
        {"smallest_noise": 0.2},
        {"cache_bytes": 0},
        {"seed": 1},
        {"free_bytes": 2**20},
    ],
)
def test_a_request_differing_in_one_field_is_unequal(change):
    kernel, x = _problem()
    assert _request(kernel, x) != _request(kernel, x, **change)


def test_a_request_is_unequal_once_the_kernel_or_the_inputs_change_in_place():
    kernel, x = _problem()
    before = _request(kernel, x)
    with torch.no_grad():
        kernel.raw_lengthscale.add_(0.5)
    after_kernel = _request(kernel, x)
    assert before != after_kernel
    x[3, 1] += 1.0
    assert after_kernel != _request(kernel, x)
    # another kernel object with the same values is another kernel
    other = gpytorch.kernels.RBFKernel().to(DTYPE)
    other.load_state_dict(kernel.state_dict())
    assert _request(other, x) != _request(kernel, x)
    assert _request(kernel, x) != "a request"


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"backend": "eigh"}, ValueError, "backend must be one of"),
        ({"steps": 0}, ValueError, "steps"),
        ({"rank": 2.5}, ValueError, "rank"),
        ({"rtol": 0.0}, ValueError, "rtol"),
        ({"smallest_noise": -1.0}, ValueError, "smallest_noise"),
        ({"cache_bytes": -1}, ValueError, "cache_bytes"),
        ({"seed": -1}, ValueError, "seed"),
        ({"free_bytes": -1}, ValueError, "free_bytes"),
        ({"dtype": torch.int64}, TypeError, "dtype must be a floating-point"),
        ({"schedule_shape": 2.5}, TypeError, "schedule_shape"),
        ({"process_group": "group"}, TypeError, "process_group"),
    ],
)
def test_a_bad_field_is_refused_naming_it(change, error, match):
    kernel, x = _problem()
    with pytest.raises(error, match=match):
        _request(kernel, x, **change)


def test_a_bad_kernel_or_inputs_are_refused_naming_them():
    kernel, x = _problem()
    with pytest.raises(TypeError, match="covar_module must be a gpytorch Kernel"):
        _request(lambda a: a, x)
    with pytest.raises(ValueError, match=r"inputs must be a tensor of shape \(\*b, N, d\)"):
        _request(kernel, x[:, 0])


def test_make_engine_takes_a_request_alone():
    kernel, x = _problem()
    with pytest.raises(TypeError, match="make_engine takes a gpsd.linalg.EngineRequest"):
        make_engine(kernel)
    engine = make_engine(_request(kernel, x))
    assert engine.name == "dense" and engine.size == 20
