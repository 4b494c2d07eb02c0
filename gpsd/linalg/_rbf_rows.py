r"""Rows of an RBF kernel matrix in two operations over the block instead of GPyTorch's five.

For the RBF kernel with outputscale :math:`s` and lengthscales :math:`\boldsymbol\ell`,

.. math::
    k(\mathbf x_i, \mathbf x_j) = \exp\!\Big(\log s - \tfrac12 \lVert \mathbf z_i \rVert^2
        - \tfrac12 \lVert \mathbf z_j \rVert^2 + \mathbf z_i^\top \mathbf z_j\Big),
    \qquad \mathbf z = (\mathbf x - \mathbf c) / \boldsymbol\ell ,

so a block of rows is one matrix product of the augmented inputs
:math:`[\mathbf z_i,\; \log s - \tfrac12\lVert\mathbf z_i\rVert^2,\; 1]` and
:math:`[\mathbf z_j,\; 1,\; -\tfrac12\lVert\mathbf z_j\rVert^2]`, exponentiated in place. GPyTorch's
``ScaleKernel(RBFKernel())`` writes the squared distances, clamps them, halves them,
exponentiates and scales, each a pass over the block (the last into a new tensor); a matrix-free
product at large N evaluates every entry at every product, and on a GPU those passes over memory
are its cost. The shift :math:`\mathbf c` (the mean of all inputs) keeps the norms, and so the
cancellation in the exponent, as small as GPyTorch's centring does; the entries agree with
GPyTorch's to rounding (a few units of :math:`\epsilon` relative to :math:`s`), and the
diagonal is set exactly by the caller.
"""

from __future__ import annotations

import torch
from gpytorch.kernels import Kernel, RBFKernel, ScaleKernel
from torch import Tensor


class RBFRows:
    """The augmented inputs of :mod:`this module <gpsd.linalg._rbf_rows>` for one product,
    made once (``O(N d)``) and used for every chunk of rows.

    :param left: shape ``(N, d + 2)``, the rows' side.
    :param right: shape ``(N, d + 2)``, the columns' side.
    """

    def __init__(self, left: Tensor, right: Tensor) -> None:
        self.left = left
        self.right = right

    @classmethod
    def for_kernel(cls, covar_module: Kernel, x: Tensor) -> RBFRows | None:
        """The augmented inputs for ``covar_module`` on ``x`` (``(N, d)``), or ``None`` where the
        kernel is not exactly an ``RBFKernel`` or a ``ScaleKernel`` of one, unbatched, on all
        input dimensions, with GPyTorch's own ``forward`` (a subclass, or a ``forward`` replaced
        on the instance, may compute another function, so it takes GPyTorch's path)."""
        if x.dim() != 2:
            return None
        log_scale = torch.zeros((), dtype=x.dtype, device=x.device)
        base = covar_module
        if type(base) is ScaleKernel:
            if not _plain(base):
                return None
            log_scale = base.outputscale.detach().to(x).log()
            base = base.base_kernel
        if type(base) is not RBFKernel or not _plain(base):
            return None
        lengthscale = base.lengthscale.detach().to(x)  # shape: (1, d) or (1, 1)
        z = (x - x.mean(-2, keepdim=True)) / lengthscale  # shape: (N, d)
        half_norm = 0.5 * (z * z).sum(-1, keepdim=True)  # shape: (N, 1)
        ones = torch.ones_like(half_norm)
        left = torch.cat([z, log_scale - half_norm, ones], dim=-1)
        right = torch.cat([z, ones, -half_norm], dim=-1)
        return cls(left, right)

    def block(self, start: int, stop: int) -> Tensor:
        """Rows ``start : stop`` of the kernel matrix, shape ``(stop - start, N)``, a fresh
        tensor."""
        return (self.left[start:stop] @ self.right.mT).exp_()


def _plain(kernel: Kernel) -> bool:
    """Unbatched, on all input dimensions, and with its class's ``forward``."""
    return (
        kernel.active_dims is None
        and kernel.batch_shape == torch.Size()
        and "forward" not in vars(kernel)
    )
