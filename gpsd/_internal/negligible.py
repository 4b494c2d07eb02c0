r"""Kernel entries far below rounding, set to zero before CPU matrix products.

A stationary kernel decays to tiny entries between distant points: the RBF kernel falls below
the smallest normal number (about 2.2e-308 in float64, 1.2e-38 in float32) some 38 (float64) or
13 (float32) lengthscales apart. x86 CPUs take a slow path for arithmetic on such subnormal
numbers, operands or results, and the BLAS libraries behind ``torch.matmul`` leave it on
(``torch.set_flush_denormal`` does not reach their threads). Products of a tiny normal entry
with a small vector entry are subnormal too, so zeroing the subnormal entries alone is not
enough. Measured on a 2-core x86 machine (float64, RBF lengthscale 0.1 on [0, 10]^2): ``V.T @ C``
with a 4096 x 1000 cross-covariance ``C`` took 4.5 s instead of 0.33 s; conjugate-gradient
iterations with a 2048 x 2048 kernel matrix and 1000 right-hand sides took 0.2 to 0.76 s each
instead of 0.057 s, and 0.075 to 0.61 s with only the subnormal entries zeroed.

:func:`drop_negligible` zeroes every entry at most :math:`\epsilon^2 \max_{ij}|a_{ij}|` in size
(:math:`\epsilon` the dtype's machine epsilon). That changes the matrix by at most
:math:`n\epsilon^2\max|a_{ij}|` in the :math:`\infty`-norm (``n`` columns) and
:math:`\sqrt{nm}\,\epsilon^2\max|a_{ij}|` in the spectral norm (``m`` rows): far below the
rounding of any product with it. Every remaining entry is then at least :math:`\epsilon^2` times the largest,
so products with vectors of ordinary range stay normal. GPUs run subnormal arithmetic at full
speed, so tensors on them are left alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from linear_operator import to_dense
from torch import Tensor

#: Fewest right-hand sides for which a kernel block used in one product only is cleaned first:
#: on the 2-core x86 CPU above, cleaning a 2048 x 2048 block (about 30 ms) saves about 39 ms in
#: a product with 256 columns, 9 ms with 64 and 1 ms with 8.
DROP_MIN_COLUMNS = 128


def drop_negligible(matrix: Tensor, *, inplace: bool = False) -> Tensor:
    r"""``matrix`` (``(*b, n, m)``) with the entries of each matrix at most
    :math:`\epsilon^2\max_{ij}|a_{ij}|` set to zero, or ``matrix`` itself where it is not a
    floating-point CPU tensor or has no such entry.

    Without ``inplace`` the result is a new tensor (autograd passes through the kept entries);
    with it, a contiguous ``matrix`` is overwritten (for fresh tensors outside autograd). A
    single matrix with no negative entry, the usual kernel matrix, takes two reductions and one
    thresholding pass; others a mask of their magnitudes.
    """
    if matrix.device.type != "cpu" or not matrix.is_floating_point() or matrix.numel() == 0:
        return matrix
    values = matrix.detach()
    flat = values.reshape(-1, values.shape[-2] * values.shape[-1])  # shape: (B, n * m)
    low, high = flat.amin(-1), flat.amax(-1)
    largest = torch.maximum(high, -low)
    # an infinite entry must not make every other entry negligible
    threshold = torch.where(largest.isfinite(), torch.finfo(matrix.dtype).eps ** 2 * largest, 0.0)
    if bool((low > threshold).all()):  # every entry positive and above it: nothing to drop
        return matrix
    inplace = inplace and matrix.is_contiguous()  # not an expanded view, say
    if flat.shape[0] == 1 and bool(low >= 0):
        cut = float(threshold)
        return F.threshold_(matrix, cut, 0.0) if inplace else F.threshold(matrix, cut, 0.0)
    mask = values.abs() <= threshold.reshape(*values.shape[:-2], 1, 1)
    return matrix.masked_fill_(mask, 0.0) if inplace else matrix.masked_fill(mask, 0.0)


def kernel_matrix(kernel: Callable[..., Any], x1: Tensor, x2: Tensor | None = None) -> Tensor:
    """``kernel(x1)`` or ``kernel(x1, x2)`` as a dense tensor (``(*b, n1, n2)``) with the
    negligible entries dropped (:func:`drop_negligible`, not in place: autograd passes through).

    Every dense kernel matrix that the package factorises or multiplies on a CPU is made here.
    """
    covariance = kernel(x1) if x2 is None else kernel(x1, x2)
    return drop_negligible(to_dense(covariance))
