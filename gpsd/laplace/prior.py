"""The GP prior's blocks that the Laplace classifiers work with, in the training data's dtype.

Public so that models built on :class:`~gpsd.laplace.LaplacePosterior` (the GPC self-distillers
of :mod:`gpsd.distillation`) evaluate the prior exactly as :class:`~gpsd.LaplaceGPClassifier` does.

A kernel or mean in another dtype than the data (float64 modules on float32 data) would otherwise
mix dtypes in the Newton iterations and the predictions.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import gpytorch
import torch
from torch import Tensor

from gpsd._internal.negligible import kernel_matrix

__all__ = ["constant_parameters", "prior_at_test", "prior_at_training"]


def prior_at_training(
    covar_module: gpytorch.kernels.Kernel,
    mean_module: gpytorch.means.Mean,
    x: Tensor,
    targets: Tensor,
    noise: Tensor | float = 0.0,
) -> tuple[Tensor, Tensor]:
    r"""Prior mean ``(*batch, n)`` and covariance :math:`\mathbf K + \gamma \mathbf I`
    ``(*batch, n, n)`` at the training inputs ``x`` (``(..., n, d)``), in ``x``'s dtype: the
    ``prior_mean`` and ``prior_covariance`` of a :class:`~gpsd.laplace.LaplacePosterior`.

    ``batch`` broadcasts the batches of the kernel, the mean and ``targets`` (``(..., n)``); the
    results are expanded views and keep the modules' autograd history.

    :param covar_module: The kernel :math:`k`.
    :param mean_module: The prior mean :math:`m`.
    :param x: Training inputs ``(..., n, d)``.
    :param targets: Training targets ``(..., n)`` (their batch shape only is used).
    :param noise: :math:`\gamma \ge 0` added to the diagonal.
    """
    K = kernel_matrix(covar_module, x).to(x.dtype)  # shape: (*bk, n, n)
    n = K.shape[-1]
    K = K + noise * torch.eye(n, dtype=K.dtype, device=K.device)
    m = mean_module(x).to(x.dtype)  # shape: (*bm, n)
    batch = torch.broadcast_shapes(K.shape[:-2], m.shape[:-1], targets.shape[:-1])
    return m.expand(*batch, n), K.expand(*batch, n, n)


def prior_at_test(
    covar_module: gpytorch.kernels.Kernel,
    mean_module: gpytorch.means.Mean,
    x: Tensor,
    train_x: Tensor,
    diag: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """``k(x, X)`` ``(*b, m, n)``, ``k(x, x)`` (``(*b, m)`` with ``diag``, else ``(*b, m, m)``) and
    the prior mean ``(*b, m)`` at test inputs ``x``, in the dtype of ``train_x``: the arguments
    of :meth:`LaplacePosterior.predictive <gpsd.laplace.LaplacePosterior.predictive>`.

    :param covar_module: The kernel :math:`k`.
    :param mean_module: The prior mean :math:`m`.
    :param x: Test inputs ``(..., m, d)``.
    :param train_x: Training inputs ``(..., n, d)``.
    :param diag: Return the diagonal of ``k(x, x)`` only.
    """
    dtype = train_x.dtype
    K_cross = kernel_matrix(covar_module, x, train_x).to(dtype)
    K_test = covar_module(x, diag=True) if diag else covar_module(x).to_dense()
    return K_cross, K_test.to(dtype), mean_module(x).to(dtype)


@contextlib.contextmanager
def constant_parameters(module: torch.nn.Module) -> Iterator[None]:
    """Within the block, ``module``'s parameters do not require gradients (restored afterwards).

    For predictions from steps fitted without autograd: what is computed from the test inputs
    then carries their gradient only, not a partial one in the hyperparameters through the
    test-point kernel alone (a wrong gradient, as the fitted steps move with them too). Not
    thread-safe: another thread using the parameters meanwhile sees them as constants too.
    """
    params = [p for p in module.parameters() if p.requires_grad] if torch.is_grad_enabled() else []
    try:
        for p in params:
            p.requires_grad_(False)
        yield
    finally:
        for p in params:
            p.requires_grad_(True)
