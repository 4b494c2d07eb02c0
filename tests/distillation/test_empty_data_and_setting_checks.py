"""An empty training set and malformed settings give errors that name the argument: an empty
set used to be refused with a message about an internal ``n`` (``backend="auto"``), returned the
prior silently (``dense``) or failed inside Newton's method (classifiers); string settings failed
inside torch, some only at prediction time."""

import gpytorch
import pytest
import torch

from gpsd import (
    DataCentricGPR,
    DistributionCentricGPR,
)

DTYPE = torch.float64


def _kernel():
    return gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).to(DTYPE)


EMPTY_X = torch.empty(0, 1, dtype=DTYPE)
EMPTY_Y = torch.empty(0, dtype=DTYPE)


@pytest.mark.parametrize("cls", [DataCentricGPR, DistributionCentricGPR])
@pytest.mark.parametrize("backend", ["auto", "dense", "cholesky"])
def test_regression_refuses_an_empty_training_set(cls, backend):
    with pytest.raises(ValueError, match=r"train_x must hold at least one input .*\(0, 1\)"):
        cls(_kernel(), EMPTY_X, EMPTY_Y, [0.1], backend=backend)


X = torch.linspace(0, 1, 12, dtype=DTYPE).unsqueeze(-1)
Y = torch.sin(6 * X).squeeze(-1)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(linalg_dtype="float64"), TypeError, "linalg_dtype must be a floating-point"),
        (dict(linalg_dtype=torch.int64), TypeError, "linalg_dtype must be a floating-point"),
        (dict(rtol="1e-6"), ValueError, "rtol must be a positive float"),
        (dict(rtol=0.0), ValueError, "rtol must be a positive float"),
        (dict(rank=0), ValueError, "rank must be a positive integer or None"),
    ],
)
@pytest.mark.parametrize("cls", [DataCentricGPR, DistributionCentricGPR])
def test_bad_settings_are_refused_at_construction(cls, kwargs, error, message):
    with pytest.raises(error, match=message):
        cls(_kernel(), X, Y, [0.1, 0.2], **kwargs)


def test_bad_settings_are_refused_when_set_and_good_ones_take_effect():
    model = DataCentricGPR(_kernel(), X, Y, [0.1, 0.2], backend="dense", linalg_dtype=None)
    with pytest.raises(TypeError, match="linalg_dtype"):
        model.linalg_dtype = "float32"
    with pytest.raises(ValueError, match="rtol"):
        model.rtol = -1.0
    with pytest.raises(ValueError, match="rank"):
        model.rank = 2.5
    assert model.linalg_dtype is None and model.rank is None
    model.rtol = 1e-4
    assert model.rtol == 1e-4
    # the factorisation dtype follows the setting: float32 data factored in float64 agree with
    # the float64 model, in float32 they carry float32 rounding of K's eigendecomposition
    ref = DataCentricGPR(_kernel(), X, Y, [0.1, 0.2], backend="dense").predict_mean(X)
    single = DataCentricGPR(
        _kernel().float(), X.float(), Y.float(), [0.1, 0.2], backend="dense", linalg_dtype=None
    )
    with torch.no_grad():
        single.linalg_dtype = torch.float64
        torch.testing.assert_close(single.predict_mean(X.float()).double(), ref, rtol=0, atol=1e-6)
