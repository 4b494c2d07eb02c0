"""ShiftedCholesky.factor and KernelSpectrum.from_dense name bad arguments: a negative shift
used to end in a "not positive definite after jitter" error, a list in an AttributeError, and a
kernel matrix holding NaN in eigh's "ill-conditioned" failure."""

import math

import pytest
import torch

from gpsd.linalg import KernelSpectrum, ShiftedCholesky

DT = torch.float64
X = torch.linspace(0, 1, 12, dtype=DT)
K = torch.exp(-0.5 * (X[:, None] - X[None, :]).square() / 0.3**2)


@pytest.mark.parametrize(
    "gamma, error, message",
    [
        (torch.tensor([0.1, -0.1], dtype=DT), ValueError, "1 of them are not, such as -0.1"),
        (torch.tensor(0.0, dtype=DT), ValueError, "finite positive shifts"),
        (torch.tensor([math.nan], dtype=DT), ValueError, "finite positive shifts"),
        (torch.tensor([math.inf], dtype=DT), ValueError, "finite positive shifts"),
        ([0.1], TypeError, "gamma must be a floating-point tensor of shifts, got list"),
        (torch.tensor([1]), TypeError, "got dtype torch.int64"),
    ],
)
def test_bad_shifts_are_named(gamma, error, message):
    with pytest.raises(error, match=message):
        ShiftedCholesky(K).factor(gamma)


def test_good_shifts_give_the_cholesky_factor():
    gamma = torch.tensor([0.1, 0.5], dtype=DT)
    factor = ShiftedCholesky(K).factor(gamma)
    eye = torch.eye(12, dtype=DT)
    for i, g in enumerate(gamma):
        torch.testing.assert_close(factor[i] @ factor[i].T, K + g * eye, rtol=1e-12, atol=1e-12)


def test_a_kernel_matrix_holding_nan_is_named():
    bad = K.clone()
    bad[3, 5] = math.nan
    with pytest.raises(ValueError, match="kernel must be finite, but it holds 1 NaN"):
        KernelSpectrum.from_dense(bad)
