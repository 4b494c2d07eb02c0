"""The eigendecomposition of a symmetric matrix through its tridiagonal reduction, with the
eigenvectors kept as Householder reflectors and the eigenvectors of the tridiagonal matrix."""

from __future__ import annotations

import numpy as np
import torch
from scipy.linalg import get_lapack_funcs
from torch import Tensor

__all__ = ["ReflectedEigenvectors", "tridiagonal_eigh"]


class ReflectedEigenvectors:
    r"""Orthonormal eigenvectors :math:`\mathbf V = \mathbf Q \mathbf Z` (shape ``(*b, N, N)``)
    kept as the factors of the tridiagonal reduction: the reflectors of
    :math:`\mathbf Q = \mathbf H_1 \cdots \mathbf H_{N-1}` and the eigenvectors
    :math:`\mathbf Z` of the tridiagonal matrix.

    Reflector :math:`i` acts on coordinates :math:`i+1, \dots, N-1`, so
    :math:`\mathbf Q = \operatorname{diag}(1, \mathbf Q')` with :math:`\mathbf Q'` the orthogonal
    factor of a QR decomposition in LAPACK's ``geqrf`` storage, which ``torch.ormqr`` applies.
    A product with :math:`r` columns costs :math:`2N^2 r` flops for the reflectors and as much
    for :math:`\mathbf Z`; forming :math:`\mathbf V` costs :math:`2N^3` once, after which a
    product costs :math:`2N^2 r`. The reflectors are therefore applied until the columns they
    have multiplied reach :math:`N`; then :math:`\mathbf V` is formed and used from there on,
    so that no sequence of products costs more than twice what it would with
    :math:`\mathbf V` formed at the best moment.

    :param reflectors: the trailing block of ``sytrd``'s packed output, ``(*b, N-1, N-1)``.
    :param tau: the reflectors' scalar factors, ``(*b, N-1)``.
    :param z: the eigenvectors of the tridiagonal matrix, ``(*b, N, N)``.
    """

    def __init__(self, reflectors: Tensor, tau: Tensor, z: Tensor) -> None:
        self._reflectors: Tensor | None = reflectors
        self._tau: Tensor | None = tau
        self._z: Tensor | None = z
        self._dense: Tensor | None = None
        self._columns = 0
        self.shape = z.shape
        self.dtype = z.dtype
        self.device = z.device

    @property
    def is_formed(self) -> bool:
        """Whether :math:`\\mathbf V` has been formed (products are then one matrix product)."""
        return self._dense is not None

    def dense(self) -> Tensor:
        """:math:`\\mathbf V`, shape ``(*b, N, N)``, formed on first use."""
        if self._dense is None:
            self._dense = self._q_matmul(self._z, transpose=False)
            self._reflectors = self._tau = self._z = None
        return self._dense

    def matmul(self, coefficients: Tensor) -> Tensor:
        """:math:`\\mathbf V \\mathbf C` for ``coefficients`` of shape ``(*, N, r)``."""
        if self._formed_for(coefficients.shape[-1]):
            return self._dense @ coefficients
        return self._q_matmul(self._z @ coefficients, transpose=False)

    def t_matmul(self, rhs: Tensor) -> Tensor:
        """:math:`\\mathbf V^\\top \\mathbf B` for ``rhs`` of shape ``(*, N, r)``."""
        if self._formed_for(rhs.shape[-1]):
            return self._dense.mT @ rhs
        return self._z.mT @ self._q_matmul(rhs, transpose=True)

    def _formed_for(self, columns: int) -> bool:
        """Count ``columns`` more through the reflectors, forming V once they reach N."""
        if self._dense is None:
            self._columns += columns
            if self._columns >= self.shape[-1]:
                self.dense()
        return self._dense is not None

    def _q_matmul(self, x: Tensor, transpose: bool) -> Tensor:
        r""":math:`\mathbf Q \mathbf X` (or :math:`\mathbf Q^\top \mathbf X`), ``x`` of shape
        ``(*, N, r)`` broadcasting against the batch of the reflectors."""
        if x.shape[-2] == 1:
            return x
        batch = torch.broadcast_shapes(x.shape[:-2], self._tau.shape[:-1])
        x = x.expand(*batch, *x.shape[-2:])
        reflectors = self._reflectors.expand(*batch, *self._reflectors.shape[-2:])
        tau = self._tau.expand(*batch, self._tau.shape[-1])
        tail = torch.ormqr(reflectors, tau, x[..., 1:, :], left=True, transpose=transpose)
        return torch.cat([x[..., :1, :], tail], dim=-2)


def tridiagonal_eigh(dense: Tensor) -> tuple[Tensor, ReflectedEigenvectors]:
    r"""Eigenvalues (descending, shape ``(*b, N)``) and orthonormal eigenvectors
    (``(*b, N, N)``, as :class:`ReflectedEigenvectors`) of the symmetric ``dense``
    (shape ``(*b, N, N)``, float32 or float64, any device).

    The reduction :math:`\mathbf K = \mathbf Q \mathbf T \mathbf Q^\top` (LAPACK ``sytrd``,
    :math:`\tfrac43 N^3` flops) and the eigenpairs :math:`\mathbf T = \mathbf Z \operatorname{diag}
    (\mathbf d)\mathbf Z^\top` of the tridiagonal matrix by divide and conquer (``stevd``, which
    deflates the many tiny off-diagonal couplings of kernel matrices) run on the CPU through
    SciPy's LAPACK. The results return to ``dense``'s device, without an autograd graph. Only
    the upper triangle of ``dense`` is read.

    :raises numpy.linalg.LinAlgError: where LAPACK reports a failure.
    """
    n = dense.shape[-1]
    batch = dense.shape[:-2]
    host = dense.detach().to("cpu").reshape(-1, n, n).numpy()
    dtype = host.dtype
    sytrd, sytrd_lwork, stevd = get_lapack_funcs(("sytrd", "sytrd_lwork", "stevd"), (host,))
    lwork, info = sytrd_lwork(n, lower=1)
    _check_info(info, "sytrd_lwork")
    evals = np.empty((host.shape[0], n), dtype=dtype)
    reflectors, taus, zs = [], [], []
    for i, matrix in enumerate(host):
        # the transpose of a C-ordered matrix is its Fortran-ordered transpose: no copy, and
        # LAPACK's lower triangle is the upper triangle of ``matrix``
        packed, diag, offdiag, tau, info = sytrd(matrix.T, lower=1, lwork=int(lwork))
        _check_info(info, "sytrd")
        if n == 1:  # stevd takes no empty off-diagonal
            ascending, z = diag, np.ones((1, 1), dtype=dtype, order="F")
        else:
            ascending, z, info = stevd(diag, offdiag, compute_v=1)
            _check_info(info, "stevd")
        evals[i] = ascending[::-1]
        # column-major tensors (a transposed view of the Fortran array's C-ordered transpose),
        # the layout LAPACK and torch.ormqr take without a copy
        zs.append(_column_major(z[:, ::-1]))
        reflectors.append(_column_major(packed[1:, :-1]))
        taus.append(torch.from_numpy(tau))
    device = dense.device
    evals = torch.from_numpy(evals).reshape(*batch, n).to(device)
    vectors = ReflectedEigenvectors(
        _stack(reflectors, (*batch, n - 1, n - 1)).to(device),
        _stack(taus, (*batch, n - 1)).to(device),
        _stack(zs, (*batch, n, n)).to(device),
    )
    return evals, vectors


def _column_major(matrix: np.ndarray) -> Tensor:
    """``matrix`` as a tensor with column-major strides (one copy into Fortran order)."""
    return torch.from_numpy(np.array(matrix, order="F").T).mT


def _stack(tensors: list[Tensor], shape: tuple[int, ...]) -> Tensor:
    """The tensors stacked into ``shape`` (no copy for one tensor)."""
    return tensors[0].reshape(shape) if len(tensors) == 1 else torch.stack(tensors).reshape(shape)


def _check_info(info: int, routine: str) -> None:
    if info != 0:
        raise np.linalg.LinAlgError(f"LAPACK {routine} failed with info = {info}")
