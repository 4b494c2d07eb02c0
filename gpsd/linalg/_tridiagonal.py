"""The eigendecomposition of a symmetric matrix through its tridiagonal reduction, with the
eigenvectors kept as the product of the reduction's reflectors and the tridiagonal matrix's
eigenvectors."""

from __future__ import annotations

import numpy as np
import torch
from scipy.linalg import eigh_tridiagonal, get_lapack_funcs
from torch import Tensor

__all__ = ["FactoredEigenvectors", "tridiagonal_eigh"]


class FactoredEigenvectors:
    r"""The eigenvectors :math:`\mathbf V = \mathbf Q \mathbf Z` of a symmetric matrix
    :math:`\mathbf K = \mathbf Q \mathbf T \mathbf Q^\top`, never formed unless asked.

    :math:`\mathbf Q = \mathbf H_1 \cdots \mathbf H_{N-1}` is the product of the Householder
    reflectors of the tridiagonal reduction (LAPACK ``sytrd``, lower storage), and
    :math:`\mathbf Z` holds the eigenvectors of the tridiagonal :math:`\mathbf T`. Reflector
    :math:`i` acts on coordinates :math:`i+1, \dots, N-1`, so
    :math:`\mathbf Q = \operatorname{diag}(1, \mathbf Q')` where :math:`\mathbf Q'` is the
    orthogonal factor of a QR decomposition in LAPACK's ``geqrf`` storage, which
    ``torch.ormqr`` applies in :math:`\mathcal O(N^2 r)` flops to ``r`` columns.

    :param reflectors: shape ``(*b, N-1, N-1)``, the reflectors of :math:`\mathbf Q'` below the
        diagonal (``geqrf`` storage).
    :param tau: shape ``(*b, N-1)``, their scalar factors.
    :param z: shape ``(*b, N, k)``, eigenvectors of :math:`\mathbf T` (columns in the order of
        the eigenvalues they belong to).
    """

    def __init__(self, reflectors: Tensor, tau: Tensor, z: Tensor) -> None:
        self.reflectors = reflectors
        self.tau = tau
        self.z = z

    @property
    def shape(self) -> torch.Size:
        """``(*b, N, k)``, the shape of :math:`\\mathbf V`."""
        return self.z.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.z.dtype

    @property
    def device(self) -> torch.device:
        return self.z.device

    def _apply_q(self, x: Tensor, transpose: bool) -> Tensor:
        """:math:`\\mathbf Q \\mathbf x` (or :math:`\\mathbf Q^\\top \\mathbf x`) for ``x`` of
        shape ``(*, N, r)`` whose batch broadcasts against the reflectors'."""
        if x.shape[-2] == 1:  # N = 1: no reflector
            return x
        batch = torch.broadcast_shapes(x.shape[:-2], self.tau.shape[:-1])
        x = x.expand(*batch, *x.shape[-2:])
        reflectors = self.reflectors.expand(*batch, *self.reflectors.shape[-2:])
        tau = self.tau.expand(*batch, self.tau.shape[-1])
        tail = torch.ormqr(reflectors, tau, x[..., 1:, :], left=True, transpose=transpose)
        return torch.cat([x[..., :1, :], tail], dim=-2)

    def t_matmul(self, x: Tensor) -> Tensor:
        """:math:`\\mathbf V^\\top \\mathbf x` for ``x`` of shape ``(*, N, r)``: ``(*, k, r)``."""
        return self.z.mT @ self._apply_q(x, transpose=True)

    def matmul(self, c: Tensor) -> Tensor:
        """:math:`\\mathbf V \\mathbf c` for ``c`` of shape ``(*, k, r)``: ``(*, N, r)``."""
        return self._apply_q(self.z @ c, transpose=False)

    def to_dense(self) -> Tensor:
        """:math:`\\mathbf V`, shape ``(*b, N, k)`` (about :math:`2N^2k` flops)."""
        return self._apply_q(self.z, transpose=False)


def tridiagonal_eigh(dense: Tensor) -> tuple[Tensor, FactoredEigenvectors]:
    r"""Eigenvalues (ascending, shape ``(*b, N)``) and :class:`FactoredEigenvectors` of the
    symmetric ``dense`` (shape ``(*b, N, N)``, float32 or float64, any device).

    The reduction :math:`\mathbf K = \mathbf Q \mathbf T \mathbf Q^\top` (LAPACK ``sytrd``,
    :math:`\tfrac43 N^3` flops) and the eigenpairs of :math:`\mathbf T` by multiple relatively
    robust representations (``stemr``, :math:`\mathcal O(N^2)`) run on the CPU through SciPy's
    LAPACK; what ``torch.linalg.eigh`` adds to this, the divide-and-conquer eigenvectors of
    :math:`\mathbf T` and the back-transformation :math:`\mathbf Q \mathbf Z`
    (:math:`2N^3` flops), is skipped. The factors return to ``dense``'s device. No autograd graph
    is kept. Only the upper triangle of ``dense`` is read.

    :raises numpy.linalg.LinAlgError: where LAPACK reports a failure.
    """
    n = dense.shape[-1]
    batch = dense.shape[:-2]
    host = dense.detach().to("cpu").reshape(-1, n, n).numpy()
    dtype = host.dtype
    sytrd, sytrd_lwork = get_lapack_funcs(("sytrd", "sytrd_lwork"), (host,))
    evals = np.empty((host.shape[0], n), dtype=dtype)
    z = np.empty((host.shape[0], n, n), dtype=dtype)
    reflectors = np.zeros((host.shape[0], max(n - 1, 0), max(n - 1, 0)), dtype=dtype)
    tau = np.zeros((host.shape[0], max(n - 1, 0)), dtype=dtype)
    lwork, info = sytrd_lwork(n, lower=1)
    _check_info(info, "sytrd_lwork")
    for i, matrix in enumerate(host):
        # the transpose of a C-ordered matrix is its Fortran-ordered transpose: no copy, and
        # LAPACK's lower triangle is the upper triangle of ``matrix``
        packed, diag, offdiag, tau_i, info = sytrd(matrix.T, lower=1, lwork=int(lwork))
        _check_info(info, "sytrd")
        if n == 1:
            evals[i], z[i] = diag, 1.0
            continue
        evals[i], z[i] = eigh_tridiagonal(diag, offdiag, lapack_driver="stemr", check_finite=False)
        reflectors[i] = np.tril(packed[1:, :-1], -1)
        tau[i] = tau_i

    def back(a: np.ndarray) -> Tensor:
        return torch.from_numpy(a).reshape(*batch, *a.shape[1:]).to(dense.device)

    return back(evals), FactoredEigenvectors(back(reflectors), back(tau), back(z))


def _check_info(info: int, routine: str) -> None:
    if info != 0:
        raise np.linalg.LinAlgError(f"LAPACK {routine} failed with info = {info}")
