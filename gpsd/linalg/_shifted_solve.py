"""What the shifted-solve backends (Cholesky chain, conjugate gradients) have in common."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable
from typing import TypeVar

import torch
from torch import Tensor

from gpsd._internal.module_state import write_count
from gpsd.linalg._algebra import ShiftedSolveAlgebra
from gpsd.linalg.spectral_engine import SpectralEngine
from gpsd.linalg.spectral_filter import SpectralFilter

T = TypeVar("T")


class ShiftedSolveEngine(SpectralEngine):
    r"""Applies data-centric spectral filters through solves with :math:`\mathbf K + \gamma\mathbf I`.

    Subclasses provide :meth:`solve` and the dtype the solves run in; this base turns solves into
    the ``apply``/``cross``/``quad_diag`` of :class:`~gpsd.linalg.SpectralEngine`; the
    right-hand sides need no coordinates (:meth:`project` returns them as they are). A
    filter that is a plain resolvent (the posterior variance) needs one solve per distinct shift;
    repeated shifts of a schedule (the usual constant noise) are solved once. Shifts that
    require gradients are exact in autograd: each is solved for separately, as equal values from
    different tensors (or different steps of one) must send their gradients to their own entries.
    """

    supports_autograd = True
    #: dtype of the solves.
    dtype: torch.dtype

    #: ``(rhs, its version counter, noise, result, its version counter, grad mode)`` of the
    #: latest solve, reused by the next call with the same right-hand side and shift (the CG
    #: backend's timed solve serves the first step of a chain).
    _last: tuple | None = None
    #: Bounds ``(*, F, M)`` on the absolute truncation error of the latest :meth:`quad_diag`'s
    #: values, where the engine has them (the iterative ones; rounding and, for several shifts in
    #: CG, split-off Ritz pairs aside); ``None`` where the solves are exact up to rounding.
    quad_error_bound: Tensor | None = None
    #: :math:`N`.
    size: int

    def solve(self, noise: Tensor, rhs: Tensor) -> Tensor:
        r""":math:`(\mathbf K + \gamma\mathbf I)^{-1}` ``rhs`` for ``noise`` ``(*s,)``, ``rhs`` ``(*, N, r)``.

        The previous result is reused when the same right-hand side (the same tensor, or a view of
        the same unmodified memory with the same shape) comes again with equal shifts, and the
        result has not been written to since, in the same grad mode (a result without a graph
        must not serve a call that needs one). Tensors made under ``torch.inference_mode()``
        keep no write counter, so their solves are not reused.
        """
        if self._last is not None and _same_rhs(self._last[0], self._last[1], rhs):
            last_gamma, last_out = self._last[2], self._last[3]
            written = write_count(last_out)
            if (
                written is not None
                and written == self._last[4]
                and self._last[5] == torch.is_grad_enabled()
                and (
                    last_gamma is noise
                    or (
                        _graph_free(last_gamma, noise)
                        and last_gamma.shape == noise.shape
                        and bool(torch.equal(last_gamma, noise))
                    )
                )
            ):
                return last_out
        out = self._solve(noise, rhs)
        self._last = (rhs, write_count(rhs), noise, out, write_count(out), torch.is_grad_enabled())
        return out

    @abstractmethod
    def _solve(self, noise: Tensor, rhs: Tensor) -> Tensor:
        """The solve itself, without the reuse of :meth:`solve`."""

    def apply(self, filt: SpectralFilter, rhs: Tensor) -> Tensor:
        """:math:`f_t(\\mathbf K)` ``rhs`` for every filter; returns ``(*, F, N, r)``."""
        rhs = rhs.to(self.dtype)
        return filt.to(self.dtype, rhs.device).evaluate(ShiftedSolveAlgebra(rhs, self.solve))

    def cross(self, filt: SpectralFilter, left: Tensor, rhs: Tensor) -> Tensor:
        """:math:`\\mathbf C^\\top f_t(\\mathbf K)\\mathbf B`; returns ``(*, F, M, r)``."""
        return left.to(self.dtype).mT.unsqueeze(-3) @ self.apply(filt, rhs)

    def quad_diag(self, filt: SpectralFilter, left: Tensor) -> Tensor:
        """:math:`\\operatorname{diag}(\\mathbf C^\\top f_t(\\mathbf K)\\mathbf C)`; ``(*, F, M)``."""
        left = left.to(self.dtype)
        self.quad_error_bound = None
        if not filt.is_resolvent:
            return (left.unsqueeze(-3) * self.apply(filt, left)).sum(-2)
        noise = filt.noise.to(dtype=self.dtype, device=left.device)
        steps = per_distinct_shift(noise, lambda t, g: self._resolvent_quad_diag(g, left))
        if steps[0][1] is not None:
            self.quad_error_bound = torch.stack([bound for _, bound in steps], dim=-2)
        return torch.stack([value for value, _ in steps], dim=-2)

    def _resolvent_quad_diag(self, noise: Tensor, left: Tensor) -> tuple[Tensor, Tensor | None]:
        """:math:`\\operatorname{diag}(\\mathbf C^\\top(\\mathbf K + \\gamma\\mathbf I)^{-1}\\mathbf C)`
        and a bound on its absolute error (``None``: exact up to rounding)."""
        return (left * self.solve(noise, left)).sum(-2), None

    def error_estimate(self, gamma_min: float) -> float:
        """Zero: exact up to rounding (subclasses that iterate override this)."""
        return 0.0

    def check_accuracy(self, gamma_min: float, rtol: float) -> None:  # noqa: B027
        """Nothing to check before solving (iterative subclasses check every solve)."""


def per_distinct_shift(noise: Tensor, compute: Callable[[int, Tensor], T]) -> list[T]:
    """``compute(t, noise[..., t])`` for every step ``t`` of ``noise`` ``(*s, T)``, computed once
    per distinct shift: equal shifts share a result, unless their gradients must reach each one
    separately (:func:`carries_graph`)."""
    done: dict[object, T] = {}
    out = []
    for t in range(noise.shape[-1]):
        g = noise[..., t]
        key = t if carries_graph(g) else g.detach().cpu().numpy().tobytes()
        if key not in done:
            done[key] = compute(t, g)
        out.append(done[key])
    return out


def carries_graph(shift: Tensor) -> bool:
    """Whether results computed from ``shift`` now would carry an autograd graph to it."""
    return shift.requires_grad and torch.is_grad_enabled()


def _graph_free(*shifts: Tensor) -> bool:
    """Whether no shift carries an autograd graph: only then may equal values share a result
    (one computed for another shift tensor would send its gradient to that tensor)."""
    return not any(carries_graph(g) for g in shifts)


def _same_rhs(a: Tensor, version: int, b: Tensor) -> bool:
    """Whether ``b`` holds the values ``a`` held when its version counter read ``version``: the
    same memory, shape and strides, and nothing written to it since (views share the counter),
    and the same autograd history (a detached view must not take a result with a graph)."""
    return (
        a.grad_fn is b.grad_fn
        and a.requires_grad == b.requires_grad
        and a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
        and a.device == b.device
        and version is not None
        and write_count(b) == version
    )
