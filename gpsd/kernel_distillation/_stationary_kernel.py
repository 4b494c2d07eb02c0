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


def scaled_squared_distances(x1: Tensor, x2: Tensor, lengthscale: Tensor) -> Tensor:
    r"""``r2[i, j]`` :math:`= \|(x_{1,i} - x_{2,j}) / \ell\|^2`, shape ``(n1, n2)``, in ``x1.dtype``,
    accumulated in float64 and rounded once.

    One float64 product of the augmented rows :math:`[z_i, \|z_i\|^2, 1]` and
    :math:`[-2 z_j, 1, \|z_j\|^2]` (:math:`z = x / \ell`, centred on the mean of ``x2``), so the
    cancellation in :math:`\|z_i\|^2 + \|z_j\|^2 - 2 z_i^\top z_j` happens in float64 and every
    entry carries the relative rounding of ``x1.dtype`` alone, close pairs and the diagonal
    included. (In float32 the same expansion errs by about :math:`\epsilon \|z\|^2` absolutely.)
    """
    wide = torch.float64
    inv_scale = lengthscale.to(wide).reciprocal()  # shape: (d,) or (1,)
    z1, z2 = x1.to(wide) * inv_scale, x2.to(wide) * inv_scale
    centre = z2.mean(-2, keepdim=True)  # shape: (1, d)
    z1, z2 = z1 - centre, z2 - centre
    ones1, ones2 = z1.new_ones(z1.shape[0], 1), z2.new_ones(z2.shape[0], 1)
    rows1 = torch.cat([z1, z1.square().sum(-1, keepdim=True), ones1], -1)  # shape: (n1, d + 2)
    rows2 = torch.cat([-2.0 * z2, ones2, z2.square().sum(-1, keepdim=True)], -1)  # (n2, d + 2)
    return (rows1 @ rows2.mT).to(x1.dtype).clamp_min_(0.0)
