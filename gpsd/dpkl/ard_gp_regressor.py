"""Plain GP baseline with an ARD squared-exponential kernel on the raw inputs."""

from __future__ import annotations

import math

import gpytorch
import torch
from torch import Tensor

from gpsd._internal.validation import check_positive_float
from gpsd.dpkl._regressor_base import EmbeddingGPRegressorBase, check_inputs

__all__ = ["ARDGPRegressor"]


class ARDGPRegressor(EmbeddingGPRegressorBase):
    r"""Exact GP with :math:`k(\mathbf{x}, \mathbf{x}') = s \exp\big(-\tfrac12 \sum_j
    (x_j - x'_j)^2 / h_j^2\big)` on the inputs (the "GP" baseline of Mallick et al.).

    Same API as :class:`~gpsd.dpkl.DPKLRegressor` (``fit``, ``predict``, ``nll``, ``rmse``); all
    hyperparameters follow the ordinary gradient. The lengthscales start at
    ``initial_lengthscale`` (default :math:`\sqrt{D}`, the scale of the distances between
    standardised inputs; GPyTorch's default 0.69 makes every kernel entry vanish for large
    :math:`D`, and a short Adam run then never leaves the noise-only solution).

    :param train_x: ``(n, D)`` training inputs.
    :param train_y: ``(n,)`` training targets (standardise them).
    :param likelihood: a ``GaussianLikelihood`` (default: a new one).
    :param initial_lengthscale: the starting value of every lengthscale (default :math:`\sqrt{D}`).
    """

    def __init__(
        self,
        train_x: Tensor,
        train_y: Tensor,
        *,
        likelihood: gpytorch.likelihoods.GaussianLikelihood | None = None,
        initial_lengthscale: float | None = None,
    ) -> None:
        train_x = check_inputs(train_x, "train_x")
        if initial_lengthscale is None:
            initial_lengthscale = math.sqrt(train_x.shape[-1])
        initial_lengthscale = check_positive_float(initial_lengthscale, "initial_lengthscale")
        super().__init__(train_x, train_y, likelihood)
        self.covar_module = gpytorch.kernels.ScaleKernel(
            gpytorch.kernels.RBFKernel(ard_num_dims=train_x.shape[-1])
        )
        self.to(train_x)
        # a tensor in the data's dtype: a Python float passes through float32 in the setter
        self.covar_module.base_kernel.lengthscale = torch.tensor(
            initial_lengthscale, dtype=train_x.dtype, device=train_x.device
        )
