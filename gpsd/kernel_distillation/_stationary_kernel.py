"""Plain-tensor evaluation of the stationary GPyTorch kernels the student can export.

GPyTorch kernels go through ``LinearOperator`` objects and keyword-only arguments, which neither
``torch.jit.script`` nor ``torch.export`` can compile. For the kernels below the student stores the
hyperparameters as plain tensors and evaluates the kernel itself, so its prediction path exports:

* ``RBFKernel`` (``"rbf"``), ``MaternKernel`` with ``nu`` in {0.5, 1.5, 2.5} (``"matern12"``,
  ``"matern32"``, ``"matern52"``), each with one lengthscale or ARD lengthscales, optionally wrapped
  in a ``ScaleKernel``, without ``active_dims`` and without batch shape.

Any other kernel is kept as a GPyTorch module ("generic"): prediction works, export does not.
"""

from __future__ import annotations

import math

import gpytorch
import torch
from torch import Tensor

STATIONARY_KERNEL_TYPES = ("rbf", "matern12", "matern32", "matern52")


def stationary_kernel_parameters(
    kernel: gpytorch.kernels.Kernel,
) -> tuple[str, Tensor, Tensor] | None:
    """``(kernel_type, lengthscale (d or 1,), outputscale ())``, or ``None`` if unsupported."""
    outputscale = None
    base = kernel
    if isinstance(kernel, gpytorch.kernels.ScaleKernel):
        if kernel.active_dims is not None or kernel.outputscale.numel() != 1:
            return None
        outputscale = kernel.outputscale.detach().reshape(())
        base = kernel.base_kernel
    if type(base) is gpytorch.kernels.RBFKernel:
        kind = "rbf"
    elif type(base) is gpytorch.kernels.MaternKernel and base.nu in (0.5, 1.5, 2.5):
        kind = {0.5: "matern12", 1.5: "matern32", 2.5: "matern52"}[base.nu]
    else:
        return None
    if base.active_dims is not None or len(base.batch_shape) != 0:
        return None
    lengthscale = base.lengthscale.detach().reshape(-1)
    if outputscale is None:
        outputscale = torch.ones((), dtype=lengthscale.dtype, device=lengthscale.device)
    return kind, lengthscale.clone(), outputscale.clone()


def stationary_kernel_from_squared_distance(
    kernel_type: str, r2: Tensor, outputscale: Tensor
) -> Tensor:
    """Evaluate ``outputscale * k(r)`` from scaled squared distances ``r2 = ||(x - z) / l||^2``."""
    if kernel_type == "rbf":
        return outputscale * torch.exp(-0.5 * r2)
    r = r2.clamp_min(1e-30).sqrt()
    if kernel_type == "matern12":
        return outputscale * torch.exp(-r)
    if kernel_type == "matern32":
        s = math.sqrt(3.0) * r
        return outputscale * (1.0 + s) * torch.exp(-s)
    s = math.sqrt(5.0) * r
    return outputscale * (1.0 + s + s * s / 3.0) * torch.exp(-s)
