r"""Factorisations of :math:`\mathbf R = (\mathbf K + \mathbf W^{-1})^{-1}` for the multiclass
Laplace engine, with :math:`\mathbf K` block-diagonal over the classes and :math:`\mathbf W`
block-diagonal over the points (never inverted: :math:`\mathbf R = \mathbf W^{1/2} \mathbf B^{-1}
\mathbf W^{1/2}`, :math:`\mathbf B = \mathbf I + \mathbf W^{1/2} \mathbf K \mathbf W^{1/2}`).

Latents and right-hand sides are laid out point-major, ``(*b, n, C)`` and ``(*b, n, C, r)``;
the class-major order ``c n + i`` is used inside only.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gpsd.exceptions import LaplaceConvergenceError

__all__ = ["DenseFactor", "SoftmaxFactor", "apply_K", "apply_blocks", "psd_sqrt"]


def apply_K(K: Tensor, F: Tensor) -> Tensor:
    """Each class's prior covariance ``K`` ``(*b, C, n, n)`` applied to its column of ``F``
    ``(*b, n, C)``; shape ``(*b, n, C)``."""
    return (K @ F.transpose(-1, -2).unsqueeze(-1)).squeeze(-1).transpose(-1, -2)


def apply_blocks(blocks: Tensor, F: Tensor) -> Tensor:
    """Each point's ``C x C`` block ``(*b, n, C, C)`` applied to its row of ``F`` ``(*b, n, C)``."""
    return (blocks @ F.unsqueeze(-1)).squeeze(-1)


def psd_sqrt(W: Tensor) -> Tensor:
    """The symmetric square root of each positive semi-definite block ``(*b, n, C, C)``, its
    eigenvalues clamped at 0 (round-off)."""
    values, vectors = torch.linalg.eigh(W)
    return (vectors * values.clamp_min(0.0).sqrt().unsqueeze(-2)) @ vectors.transpose(-1, -2)


def _cholesky(matrix: Tensor, what: str) -> Tensor:
    chol, info = torch.linalg.cholesky_ex(matrix)
    if (info != 0).any():
        hint = "" if matrix.dtype == torch.float64 else "; fit in float64"
        raise LaplaceConvergenceError(
            f"the Laplace matrix {what} is not positive definite: a prior covariance is not "
            f"positive semi-definite at {str(matrix.dtype).removeprefix('torch.')} precision{hint}"
        )
    return chol


def _blocks_by_apply(factor: DenseFactor, K: Tensor) -> tuple[Tensor, Tensor]:
    r"""The blocks of :meth:`DenseFactor.blocks` from :math:`\mathbf R` applied to the unit
    vectors and to the columns of :math:`\mathbf K` (:math:`Cn` right-hand sides each)."""
    n, C = K.shape[-1], K.shape[-3]
    # as (*b, n, C, C, n): entry [i, c, d, j] is row (c, i) of R times the column (d, j)
    unit = torch.eye(C * n, dtype=K.dtype, device=K.device).reshape(C, n, C * n)
    R_unit = factor.apply(unit.transpose(0, 1))
    R_unit = R_unit.reshape(*R_unit.shape[:-1], C, n)
    classes = torch.eye(C, dtype=K.dtype, device=K.device)
    columns = torch.einsum("...cij,cd->...icdj", K, classes).reshape(*K.shape[:-3], n, C, C * n)
    R_K = factor.apply(columns).reshape(*K.shape[:-3], n, C, C, n)
    R_blocks = torch.diagonal(R_unit, dim1=-3, dim2=-2).permute(
        *range(R_unit.dim() - 4), -1, -3, -2
    )  # shape: (*b, C, n, n)
    K_R_K = torch.einsum("...cil,...lcdi->...icd", K, R_K)  # shape: (*b, n, C, C)
    return K_R_K, R_blocks


class DenseFactor:
    r""":math:`\mathbf R` through the Cholesky factor of :math:`\mathbf B` of size :math:`Cn`, for
    any positive semi-definite blocks :math:`\mathbf W_i` (:math:`\mathbf W^{1/2}` their symmetric
    square roots): :math:`O(C^3 n^3)`.

    :param K: ``(*b, C, n, n)``.
    :param W: ``(*b, n, C, C)``.
    """

    def __init__(self, K: Tensor, W: Tensor) -> None:
        n, C = K.shape[-1], K.shape[-3]
        self.sqrt_W = psd_sqrt(W)
        S = self.sqrt_W
        B = torch.einsum("...ice,...eij,...jef->...cifj", S, K, S).reshape(*S.shape[:-3], C * n, -1)
        B = B + torch.eye(C * n, dtype=K.dtype, device=K.device)
        self.chol = _cholesky(B, "B = I + W^1/2 K W^1/2")
        #: :math:`\tfrac12 \log|\mathbf B|`, shape ``batch``
        self.half_log_det = torch.diagonal(self.chol, dim1=-2, dim2=-1).log().sum(-1)

    def apply(self, X: Tensor) -> Tensor:
        """:math:`\\mathbf R \\mathbf X` for ``X`` of shape ``(*b, n, C, r)``."""
        n, C, r = X.shape[-3:]
        SX = self.sqrt_W @ X  # shape: (*b, n, C, r)
        flat = SX.transpose(-3, -2).reshape(*SX.shape[:-3], C * n, r)
        solved = torch.cholesky_solve(flat, self.chol).reshape(*flat.shape[:-2], C, n, r)
        return self.sqrt_W @ solved.transpose(-3, -2)

    def blocks(self, K: Tensor) -> tuple[Tensor, Tensor]:
        r"""The per-point blocks of :math:`\mathbf K \mathbf R \mathbf K` ``(*b, n, C, C)`` and
        the per-class blocks of :math:`\mathbf R` ``(*b, C, n, n)``, :math:`O(C^3 n^3)`."""
        return _blocks_by_apply(self, K)


class SoftmaxFactor:
    r""":math:`\mathbf R` for the softmax's blocks :math:`\mathbf W = \mathbf D - \boldsymbol\Pi
    \boldsymbol\Pi^\top`, :math:`\mathbf D = \operatorname{diag}(\boldsymbol\pi)`, by Rasmussen &
    Williams' Algorithm 3.3: with :math:`\mathbf E_c = \mathbf D_c^{1/2} (\mathbf I + \mathbf
    D_c^{1/2} \mathbf K_c \mathbf D_c^{1/2})^{-1} \mathbf D_c^{1/2} = (\mathbf K_c + \mathbf
    D_c^{-1})^{-1}` and :math:`\mathbf M \mathbf M^\top = \sum_c \mathbf E_c` (which uses
    :math:`\sum_c \boldsymbol\pi_c = \mathbf 1`),

    .. math::

        \mathbf R = \mathbf E - \mathbf E \mathbf P (\mathbf M \mathbf M^\top)^{-1}
        \mathbf P^\top \mathbf E, \qquad
        \tfrac12 \log|\mathbf B| = \sum_c \sum_i \log (\mathbf L_c)_{ii}
        + \sum_i \log M_{ii},

    :math:`\mathbf P` the :math:`n` identities stacked, :math:`\mathbf L_c` the Cholesky factor
    of :math:`\mathbf I + \mathbf D_c^{1/2} \mathbf K_c \mathbf D_c^{1/2}`: :math:`C + 1`
    factorisations of size :math:`n`, :math:`O(C n^3)`.

    :param K: ``(*b, C, n, n)``.
    :param pi: The class probabilities at the latents, ``(*b, n, C)``.
    """

    def __init__(self, K: Tensor, pi: Tensor) -> None:
        n = K.shape[-1]
        sqrt_d = pi.transpose(-1, -2).sqrt()  # shape: (*b, C, n)
        B = sqrt_d.unsqueeze(-1) * K * sqrt_d.unsqueeze(-2)
        B = B + torch.eye(n, dtype=K.dtype, device=K.device)
        chol = _cholesky(B, "I + D_c^1/2 K_c D_c^1/2")
        # E_c = D_c^1/2 B_c^-1 D_c^1/2, shape: (*b, C, n, n)
        self.E = sqrt_d.unsqueeze(-1) * torch.cholesky_solve(torch.diag_embed(sqrt_d), chol)
        self.chol_M = _cholesky(self.E.sum(-3), "M = sum_c E_c")
        #: :math:`\tfrac12 \log|\mathbf B|`, shape ``batch``
        self.half_log_det = torch.diagonal(chol, dim1=-2, dim2=-1).log().sum((-1, -2))
        self.half_log_det = self.half_log_det + torch.diagonal(
            self.chol_M, dim1=-2, dim2=-1
        ).log().sum(-1)

    def apply(self, X: Tensor) -> Tensor:
        """:math:`\\mathbf R \\mathbf X` for ``X`` of shape ``(*b, n, C, r)``."""
        EX = self.E @ X.transpose(-3, -2)  # shape: (*b, C, n, r)
        t = torch.cholesky_solve(EX.sum(-3), self.chol_M)  # shape: (*b, n, r)
        return (EX - self.E @ t.unsqueeze(-3)).transpose(-3, -2)

    def blocks(self, K: Tensor) -> tuple[Tensor, Tensor]:
        r"""The per-point blocks of :math:`\mathbf K \mathbf R \mathbf K` ``(*b, n, C, C)`` and
        the per-class blocks :math:`\mathbf R_c = \mathbf E_c - \mathbf E_c (\mathbf M
        \mathbf M^\top)^{-1} \mathbf E_c` of :math:`\mathbf R` ``(*b, C, n, n)``, in
        :math:`O(C n^3)`: with :math:`\mathbf G_c = \mathbf M^{-1} \mathbf E_c \mathbf K_c`,
        block :math:`i` of :math:`\mathbf K \mathbf R \mathbf K` is
        :math:`\operatorname{diag}_c\bigl((\mathbf K_c \mathbf E_c \mathbf K_c)_{ii}\bigr) -
        \bigl(\sum_r (\mathbf G_c)_{ri} (\mathbf G_d)_{ri}\bigr)_{cd}`."""
        H = torch.linalg.solve_triangular(self.chol_M.unsqueeze(-3), self.E, upper=False)
        R_blocks = self.E - H.transpose(-1, -2) @ H  # shape: (*b, C, n, n)
        E_K = self.E @ K
        first = (K * E_K.transpose(-1, -2)).sum(-1)  # (K_c E_c K_c)_ii, shape: (*b, C, n)
        G = H @ K
        second = torch.einsum("...cri,...dri->...icd", G, G)  # shape: (*b, n, C, C)
        return torch.diag_embed(first.transpose(-1, -2)) - second, R_blocks
