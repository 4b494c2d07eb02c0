"""The eigendecomposition of a symmetric matrix through its tridiagonal reduction and the
eigenpairs of the tridiagonal matrix by divide and conquer."""

from __future__ import annotations

import numpy as np
import torch
from scipy.linalg import get_lapack_funcs
from torch import Tensor

__all__ = ["tridiagonal_eigh"]


def tridiagonal_eigh(dense: Tensor) -> tuple[Tensor, Tensor]:
    r"""Eigenvalues (ascending, shape ``(*b, N)``) and orthonormal eigenvectors
    (``(*b, N, N)``) of the symmetric ``dense`` (shape ``(*b, N, N)``, float32 or float64, any
    device).

    The reduction :math:`\mathbf K = \mathbf Q \mathbf T \mathbf Q^\top` (LAPACK ``sytrd``,
    :math:`\tfrac43 N^3` flops) and the eigenpairs :math:`\mathbf T = \mathbf Z \operatorname{diag}
    (\mathbf d)\mathbf Z^\top` of the tridiagonal matrix by divide and conquer (``stevd``,
    :math:`\mathcal O(N^2)` flops where, as in kernel matrices, most couplings deflate) run on
    the CPU through SciPy's LAPACK. :math:`\mathbf Q = \mathbf H_1 \cdots \mathbf H_{N-1}`,
    whose reflector :math:`i` acts on coordinates :math:`i+1, \dots, N-1`, is
    :math:`\operatorname{diag}(1, \mathbf Q')` with :math:`\mathbf Q'` the orthogonal factor of
    a QR decomposition in LAPACK's ``geqrf`` storage, so ``torch.ormqr`` forms :math:`\mathbf V = \mathbf Q \mathbf Z` (:math:`2N^3` flops).
    The results return to ``dense``'s device, without an autograd graph. Only the upper triangle
    of ``dense`` is read.

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
    evecs = []
    for i, matrix in enumerate(host):
        # the transpose of a C-ordered matrix is its Fortran-ordered transpose: no copy, and
        # LAPACK's lower triangle is the upper triangle of ``matrix``
        packed, diag, offdiag, tau, info = sytrd(matrix.T, lower=1, lwork=int(lwork))
        _check_info(info, "sytrd")
        if n == 1:
            evals[i] = diag
            evecs.append(torch.ones(1, 1, dtype=dense.dtype))
            continue
        evals[i], z, info = stevd(diag, offdiag, compute_v=1)
        _check_info(info, "stevd")
        z = torch.from_numpy(z)
        reflectors = torch.from_numpy(np.ascontiguousarray(packed[1:, :-1]))
        tail = torch.ormqr(reflectors, torch.from_numpy(tau), z[1:], left=True, transpose=False)
        evecs.append(torch.cat([z[:1], tail]))
    evals = torch.from_numpy(evals).reshape(*batch, n).to(dense.device)
    return evals, torch.stack(evecs).reshape(*batch, n, n).to(dense.device)


def _check_info(info: int, routine: str) -> None:
    if info != 0:
        raise np.linalg.LinAlgError(f"LAPACK {routine} failed with info = {info}")
