"""An empty training set and a malformed noise give classifiers errors that name the argument."""

import gpytorch
import pytest
import torch

from gpsd import (
    DataCentricGPC,
    DistributionCentricGPC,
    LaplaceGPClassifier,
)

DTYPE = torch.float64


def _kernel():
    return gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).to(DTYPE)


EMPTY_X = torch.empty(0, 1, dtype=DTYPE)


EMPTY_Y = torch.empty(0, dtype=DTYPE)


@pytest.mark.parametrize(
    "build",
    [
        lambda: LaplaceGPClassifier(EMPTY_X, EMPTY_Y, _kernel()),
        lambda: DataCentricGPC(EMPTY_X, EMPTY_Y, _kernel(), num_steps=2),
        lambda: DistributionCentricGPC(EMPTY_X, EMPTY_Y, _kernel(), num_steps=2),
    ],
)
def test_classifiers_refuse_an_empty_training_set(build):
    with pytest.raises(ValueError, match="train_x must hold at least one input"):
        build()


X = torch.linspace(0, 1, 12, dtype=DTYPE).unsqueeze(-1)


Y = torch.sin(6 * X).squeeze(-1)


@pytest.mark.parametrize("noise", [torch.full((12,), 0.1), "0.1x", -1.0, float("nan")])
def test_the_classifier_noise_must_be_one_finite_non_negative_number(noise):
    with pytest.raises(ValueError, match="noise must be a finite float >= 0"):
        LaplaceGPClassifier(X, (Y > 0).to(DTYPE), _kernel(), noise=noise)
