"""Two number systems in which gpsd evaluates its spectral filters.

A spectral filter of the data-centric family is built from the functions ``d / (d + g)`` and
``1 / (d + g)`` by products and affine combinations. Writing the recurrence once against a tiny
"algebra" lets the same code give

* the filter's values at the eigenvalues ``d`` of a kernel matrix (:class:`EigenvalueAlgebra`), and
* the filter's Taylor coefficients at ``d = 0`` (:class:`PowerSeriesAlgebra`), which the low-rank
  (Lanczos) backend applies to the small remainder of the spectrum as a polynomial in the operator.
"""

from __future__ import annotations

import torch
from torch import Tensor


class EigenvalueAlgebra:
    """Elementwise arithmetic on filter values at the eigenvalues ``d``, shape ``(*b, k)``."""

    def __init__(self, eigenvalues: Tensor) -> None:
        self.d = eigenvalues

    def one(self, like: Tensor) -> Tensor:
        # shape: (*s, k) after broadcasting the schedule batch against the spectrum batch
        return torch.ones_like(like.unsqueeze(-1) + self.d)

    def ratio(self, g: Tensor) -> Tensor:
        """``d / (d + g)`` for ``g`` of shape ``(*s,)``."""
        return self.d / (self.d + g.unsqueeze(-1))

    def reciprocal(self, g: Tensor) -> Tensor:
        """``1 / (d + g)``."""
        return 1.0 / (self.d + g.unsqueeze(-1))

    def mul(self, a: Tensor, b: Tensor) -> Tensor:
        return a * b

    def add_constant(self, a: Tensor, c: float) -> Tensor:
        return a + c

    def stack(self, items: list[Tensor]) -> Tensor:
        """Stack per-step elements ``(*, k)`` into ``(*, T, k)``."""
        return torch.stack(items, dim=-2)


class PowerSeriesAlgebra:
    """Truncated Taylor series in ``d`` at 0: coefficients ``c_0..c_J`` in the last dimension."""

    def __init__(self, order: int, dtype: torch.dtype, device: torch.device) -> None:
        self.order = order
        self._powers = torch.arange(order + 1, dtype=dtype, device=device)  # shape: (J+1,)

    def one(self, like: Tensor) -> Tensor:
        out = torch.zeros(*like.shape, self.order + 1, dtype=like.dtype, device=like.device)
        out[..., 0] = 1.0
        return out

    def reciprocal(self, g: Tensor) -> Tensor:
        """``1 / (d + g) = sum_j (-1)^j d^j / g^(j+1)``."""
        g = g.unsqueeze(-1)
        sign = 1.0 - 2.0 * (self._powers % 2)
        return sign * g.pow(-(self._powers + 1))

    def ratio(self, g: Tensor) -> Tensor:
        """``d / (d + g) = 1 - g / (d + g)``."""
        out = -g.unsqueeze(-1) * self.reciprocal(g)
        out[..., 0] = out[..., 0] + 1.0
        return out

    def mul(self, a: Tensor, b: Tensor) -> Tensor:
        """Cauchy product truncated at order ``J``."""
        a, b = torch.broadcast_tensors(a, b)
        out = torch.zeros_like(a)
        for j in range(self.order + 1):
            out[..., j:] = out[..., j:] + a[..., j : j + 1] * b[..., : self.order + 1 - j]
        return out

    def add_constant(self, a: Tensor, c: float) -> Tensor:
        out = a.clone()
        out[..., 0] = out[..., 0] + c
        return out

    def stack(self, items: list[Tensor]) -> Tensor:
        """Stack per-step series ``(*, J+1)`` into ``(*, T, J+1)``."""
        return torch.stack(items, dim=-2)


class ShiftedSolveAlgebra:
    r"""Filters applied to a right-hand side by shifted solves instead of an eigendecomposition.

    Elements are the vectors :math:`f(\mathbf K)\mathbf B` themselves. ``reciprocal(g)`` and
    ``ratio(g)`` return markers that :meth:`mul` applies: :math:`(\mathbf K + g\mathbf I)^{-1}
    \mathbf a` by a cached Cholesky factor, and :math:`\mathbf K (\mathbf K + g \mathbf I)^{-1}
    \mathbf a = \mathbf a - g (\mathbf K + g\mathbf I)^{-1}\mathbf a`. This evaluates exactly the
    filters built by a product chain (the data-centric family), one solve per step.

    :param rhs: :math:`\mathbf B`, shape ``(*b, N, r)``.
    :param solve: ``solve(g, a)`` returns :math:`(\mathbf K + g\mathbf I)^{-1}\mathbf a` for a
        shift ``g`` of shape ``(*s,)``.
    """

    def __init__(self, rhs: Tensor, solve) -> None:
        self.rhs = rhs
        self._solve = solve

    def one(self, like: Tensor) -> Tensor:
        shape = torch.broadcast_shapes(like.shape, self.rhs.shape[:-2])
        return self.rhs.expand(*shape, *self.rhs.shape[-2:])

    def reciprocal(self, g: Tensor) -> tuple[str, Tensor]:
        return ("reciprocal", g)

    def ratio(self, g: Tensor) -> tuple[str, Tensor]:
        return ("ratio", g)

    def mul(self, a: Tensor, b: tuple[str, Tensor]) -> Tensor:
        kind, g = b
        solved = self._solve(g, a)
        if kind == "reciprocal":
            return solved
        return a - g[..., None, None] * solved

    def add_constant(self, a: Tensor, c: float) -> Tensor:
        return a + c * self.rhs

    def stack(self, items: list[Tensor]) -> Tensor:
        """Stack per-step vectors ``(*, N, r)`` into ``(*, T, N, r)``."""
        return torch.stack(items, dim=-3)
