"""Two number systems in which gpsd evaluates its spectral filters.

A spectral filter of the data-centric family is built from the functions ``d / (d + g)``,
``g / (d + g)`` and ``1 / (d + g)`` by products and affine combinations. Writing the recurrence once against a tiny
"algebra" lets the same code give

* the filter's values at the eigenvalues ``d`` of a kernel matrix (:class:`EigenvalueAlgebra`), and
* the filter's Taylor coefficients at ``d = 0`` (:class:`PowerSeriesAlgebra`), which the low-rank
  (Lanczos) backend applies to the small remainder of the spectrum as a polynomial in the operator.
"""

from __future__ import annotations

import torch
from torch import Tensor


class EigenvalueAlgebra:
    r"""Elementwise arithmetic on filter values at the eigenvalues ``d``, shape ``(*b, k)``.

    A kernel matrix is positive semi-definite, so eigenvalues below zero are rounding errors (of
    size :math:`\epsilon\lVert\mathbf K\rVert`: down to :math:`-8 \cdot 10^{-6}` for a float32
    eigendecomposition of an RBF kernel on 200 points) and are taken as 0, where every factor
    keeps its range: :math:`0 \le d/(d + \gamma) < 1` and :math:`0 < 1/(d + \gamma) \le 1/\gamma`.
    Left negative, a :math:`d` near :math:`-\gamma` makes :math:`|d/(d + \gamma)| \gg 1` and
    :math:`1/(d + \gamma)` huge or infinite, and a filter of :math:`t` steps multiplies :math:`t`
    such factors: three steps with :math:`\gamma = 10^{-5}` took values down to -7000 instead of
    values in :math:`[0, 1]`.
    """

    def __init__(self, eigenvalues: Tensor) -> None:
        self.d = eigenvalues.clamp_min(0.0)

    def one(self, like: Tensor) -> Tensor:
        # shape: (*s, k) after broadcasting the schedule batch against the spectrum batch
        return torch.ones_like(like.unsqueeze(-1) + self.d)

    def ratio(self, g: Tensor) -> Tensor:
        """``d / (d + g)`` for ``g`` of shape ``(*s,)``."""
        return self.d / (self.d + g.unsqueeze(-1))

    def reciprocal(self, g: Tensor) -> Tensor:
        """``1 / (d + g)``."""
        return 1.0 / (self.d + g.unsqueeze(-1))

    def complement(self, g: Tensor) -> Tensor:
        """``g / (d + g)`` (``1 - d / (d + g)`` without the cancellation)."""
        g = g.unsqueeze(-1)
        return g / (self.d + g)

    def mul(self, a: Tensor, b: Tensor) -> Tensor:
        return a * b

    def add_constant(self, a: Tensor, c: float) -> Tensor:
        return a + c

    def scale(self, a: Tensor, s: Tensor) -> Tensor:
        """``a`` times one number per schedule, ``s`` of shape ``(*s,)``."""
        return a * s.unsqueeze(-1)

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
        r"""``d / (d + g)``, whose coefficients are formed directly:

        .. math::
            \frac{d}{d + g} = \sum_{j \ge 1} (-1)^{j+1} \frac{d^j}{g^j} .

        Not as :math:`1 - g/(d + g)`: :math:`1 - g\,\mathrm{fl}(1/g)` is not 0 for every
        :math:`g` (1.1e-16 for :math:`g = 49`), which broke the zero of order :math:`t` of
        :math:`F_t` at 0, and :math:`g \cdot g^{-(j+1)}` overflowed where :math:`g^{-j}` does not.
        """
        sign = 1.0 - 2.0 * (self._powers % 2)
        out = -sign * g.unsqueeze(-1).pow(-self._powers)
        out[..., 0] = 0.0
        return out

    def complement(self, g: Tensor) -> Tensor:
        """``g / (d + g) = sum_j (-1)^j d^j / g^j``."""
        sign = 1.0 - 2.0 * (self._powers % 2)
        return sign * g.unsqueeze(-1).pow(-self._powers)

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

    def scale(self, a: Tensor, s: Tensor) -> Tensor:
        """The series ``a`` times one number per schedule, ``s`` of shape ``(*s,)``."""
        return a * s.unsqueeze(-1)

    def stack(self, items: list[Tensor]) -> Tensor:
        """Stack per-step series ``(*, J+1)`` into ``(*, T, J+1)``."""
        return torch.stack(items, dim=-2)


class ShiftedSolveAlgebra:
    r"""Filters applied to a right-hand side by shifted solves instead of an eigendecomposition.

    Elements are the vectors :math:`f(\mathbf K)\mathbf B` themselves. ``reciprocal(g)``,
    ``ratio(g)`` and ``complement(g)`` return markers that :meth:`mul` applies:
    :math:`(\mathbf K + g\mathbf I)^{-1} \mathbf a` by a cached Cholesky factor,
    :math:`\mathbf K (\mathbf K + g \mathbf I)^{-1} \mathbf a = \mathbf a - g (\mathbf K +
    g\mathbf I)^{-1}\mathbf a` and :math:`g (\mathbf K + g\mathbf I)^{-1}\mathbf a`. This evaluates exactly the
    filters built by a product chain (the data-centric family), one solve per step.

    :param rhs: :math:`\mathbf B`, shape ``(*b, N, r)``.
    :param solve: ``solve(g, a)`` returns :math:`(\mathbf K + g\mathbf I)^{-1}\mathbf a` for a
        shift ``g`` of shape ``(*s,)``.
    """

    def __init__(self, rhs: Tensor, solve) -> None:
        self.rhs = rhs
        self._solve = solve
        # (a, g, solve): a data-centric step multiplies the same vectors by a reciprocal and a
        # ratio of the same shift, which share one solve (kept by identity, for this evaluation)
        self._last: tuple[Tensor, Tensor, Tensor] | None = None

    def one(self, like: Tensor) -> Tensor:
        shape = torch.broadcast_shapes(like.shape, self.rhs.shape[:-2])
        return self.rhs.expand(*shape, *self.rhs.shape[-2:])

    def reciprocal(self, g: Tensor) -> tuple[str, Tensor]:
        return ("reciprocal", g)

    def ratio(self, g: Tensor) -> tuple[str, Tensor]:
        return ("ratio", g)

    def complement(self, g: Tensor) -> tuple[str, Tensor]:
        return ("complement", g)

    def mul(self, a: Tensor, b: tuple[str, Tensor]) -> Tensor:
        kind, g = b
        if self._last is not None and self._last[0] is a and self._last[1] is g:
            solved = self._last[2]
        else:
            solved = self._solve(g, a)
            self._last = (a, g, solved)
        if kind == "reciprocal":
            return solved
        if kind == "complement":
            return g[..., None, None] * solved
        return a - g[..., None, None] * solved

    def add_constant(self, a: Tensor, c: float) -> Tensor:
        return a + c * self.rhs

    def scale(self, a: Tensor, s: Tensor) -> Tensor:
        """The vectors ``a`` ``(*, N, r)`` times one number per schedule, ``s`` of shape ``(*s,)``."""
        return a * s[..., None, None]

    def stack(self, items: list[Tensor]) -> Tensor:
        """Stack per-step vectors ``(*, N, r)`` into ``(*, T, N, r)``."""
        return torch.stack(items, dim=-3)
