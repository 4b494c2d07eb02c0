"""A kernel matrix that is never formed: products evaluated in row chunks."""

from __future__ import annotations

import torch
from gpytorch.kernels import Kernel
from linear_operator import to_dense
from linear_operator.operators import LinearOperator
from torch import Tensor

__all__ = ["ChunkedKernelOperator"]


class ChunkedKernelOperator(LinearOperator):
    r"""The symmetric kernel matrix :math:`\mathbf K = k(\mathbf X, \mathbf X)` as a matrix-free operator.

    A product :math:`\mathbf K \mathbf B` is computed chunk by chunk over the rows,

    .. math::
        (\mathbf K\mathbf B)_{I} = k(\mathbf X_I, \mathbf X)\,\mathbf B ,

    so memory stays at ``chunk_size x N`` kernel entries: the path for large N when pykeops is not
    installed (with pykeops, a GPyTorch KeOps kernel is the faster matrix-free operator). It is
    meant for the block Lanczos backend (:meth:`~gpsd.linalg.KernelSpectrum.from_lanczos`), which
    only multiplies; it carries no autograd graph (wrap its use in ``torch.no_grad()``).

    :param kernel: any GPyTorch kernel.
    :param x: inputs, shape ``(*b, N, d)``.
    :param chunk_size: rows evaluated at once.
    """

    def __init__(self, x: Tensor, *, kernel: Kernel, chunk_size: int = 2048) -> None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive integer, got {chunk_size}")
        super().__init__(x, kernel=kernel, chunk_size=chunk_size)
        self.x = x
        self.kernel = kernel
        self.chunk_size = chunk_size

    def _matmul(self, rhs: Tensor) -> Tensor:
        rows = []
        with torch.no_grad():
            for start in range(0, self.x.shape[-2], self.chunk_size):
                block = to_dense(
                    self.kernel(self.x[..., start : start + self.chunk_size, :], self.x)
                )
                rows.append(block @ rhs)
        return torch.cat(rows, dim=-2)

    def _size(self) -> torch.Size:
        n = self.x.shape[-2]
        return torch.Size((*self.x.shape[:-2], n, n))

    def _transpose_nonbatch(self) -> ChunkedKernelOperator:
        return self

    def _diagonal(self) -> Tensor:
        with torch.no_grad():
            return self.kernel(self.x, diag=True)

    def _expand_batch(self, batch_shape: torch.Size) -> ChunkedKernelOperator:
        x = self.x.expand(*batch_shape, *self.x.shape[-2:])
        return ChunkedKernelOperator(x, kernel=self.kernel, chunk_size=self.chunk_size)
