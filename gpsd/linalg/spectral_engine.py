"""The one interface of the engines that apply spectral filters of a kernel matrix."""

from __future__ import annotations

import abc

import torch
from linear_operator.operators import DenseLinearOperator
from torch import Tensor

from gpsd.linalg.spectral_filter import SpectralFilter

__all__ = ["SpectralEngine"]


class SpectralEngine(abc.ABC):
    r"""What every engine of :func:`~gpsd.linalg.make_engine` offers: the filters
    :math:`f_t(\mathbf K)` of a :class:`~gpsd.linalg.SpectralFilter` applied to right-hand
    sides, their quadratic forms and traces, and how accurate they are.

    The engines: :class:`~gpsd.linalg.KernelSpectrum` (an eigendecomposition, full or by block
    Lanczos), :class:`~gpsd.linalg.ShiftedCholesky` (a chain of shifted Cholesky solves) and
    :class:`~gpsd.linalg.ShiftedCG` (deflated conjugate gradients). A caller uses them through
    this interface alone; no method is optional. :math:`\mathbf K` has shape ``(*b, N, N)``, a
    filter stack has ``F`` filters and a schedule batch ``*s``; ``*`` below is the broadcast of
    ``*s`` against ``*b``.

    A typical use::

        engine.check_accuracy(gamma_min, rtol)
        coords = engine.project(rhs)  # once, for several filters of the same rhs
        means = engine.apply(filt, coords)
    """

    #: Whether results carry an autograd graph to the kernel's hyperparameters (and shifts).
    supports_autograd: bool
    #: Whether the engine multiplies by :math:`\mathbf K` through an operator that never holds
    #: it whole (a :class:`~gpsd.linalg.ChunkedKernelOperator` or a KeOps kernel), as the
    #: ``"lanczos"`` and ``"cg"`` backends do. Such an engine builds no autograd graph, and
    #: :func:`~gpsd.linalg.make_engine` chooses it whatever the grad mode: a cache of it need
    #: not be rebuilt when the grad mode changes.
    matrix_free: bool = False
    #: Whether the engine resolves only part of the spectrum (a Lanczos
    #: :class:`~gpsd.linalg.KernelSpectrum`); only a full one has
    #: :meth:`~gpsd.linalg.KernelSpectrum.to_linear_operator`.
    is_truncated: bool = False
    #: :math:`N`.
    size: int
    #: Bounds ``(*, F, M)`` on the absolute error of the latest :meth:`quad_diag`'s values,
    #: where the engine has them (the iterative solvers); ``None`` where :meth:`error_estimate`
    #: covers the quadratic forms too, or they are exact up to rounding.
    quad_error_bound: Tensor | None = None

    @abc.abstractmethod
    def apply(self, filt: SpectralFilter, rhs: Tensor | object) -> Tensor:
        r""":math:`f_t(\mathbf K)\mathbf B` for every filter of the stack.

        :param filt: the filters, shape ``(*s, F)``.
        :param rhs: :math:`\mathbf B`, shape ``(*b, N, r)``, or what :meth:`project` made of it.
        :return: shape ``(*, F, N, r)``.
        """

    @abc.abstractmethod
    def cross(self, filt: SpectralFilter, left: Tensor, rhs: Tensor | object) -> Tensor:
        r""":math:`\mathbf C^\top f_t(\mathbf K)\mathbf B` for ``left`` :math:`\mathbf C` of shape
        ``(*b, N, M)`` and ``rhs`` as in :meth:`apply`; returns ``(*, F, M, r)``."""

    @abc.abstractmethod
    def quad_diag(self, filt: SpectralFilter, left: Tensor) -> Tensor:
        r""":math:`\operatorname{diag}(\mathbf C^\top f_t(\mathbf K)\mathbf C)` for ``left``
        :math:`\mathbf C` of shape ``(*b, N, M)``; returns ``(*, F, M)`` and sets
        :attr:`quad_error_bound`."""

    @abc.abstractmethod
    def trace(self, filt: SpectralFilter) -> Tensor:
        r""":math:`\operatorname{tr} f_t(\mathbf K)`; returns ``(*, F)``. An engine that would
        need :math:`N` solves for it raises a ``ValueError`` saying which backend has it."""

    def project(self, rhs: Tensor) -> Tensor | object:
        """``rhs`` (``(*b, N, r)``) in the form :meth:`apply` and :meth:`cross` take fastest,
        for several filters of the same right-hand side: its coordinates in an
        eigendecomposition, or ``rhs`` itself where the engine has no coordinates (the
        shifted-solve engines)."""
        return rhs

    @abc.abstractmethod
    def error_estimate(self, gamma_min: float) -> float:
        """An estimate of the relative error of filters whose smallest shift is ``gamma_min``
        (0 for the direct engines; rounding not counted)."""

    @abc.abstractmethod
    def check_accuracy(self, gamma_min: float, rtol: float) -> None:
        """Prepare for filters whose smallest shift is ``gamma_min`` and check that the engine
        can reach ``rtol`` for them: raise a ``ValueError`` where it cannot at all, warn with a
        ``NumericalWarning`` where its estimate exceeds ``rtol``. Call it before the filters."""


def is_matrix_free(kernel: object) -> bool:
    """Whether ``kernel`` is an operator that never holds the matrix whole (not a tensor nor a
    dense ``LinearOperator``; a callable counts as one): the rule behind
    :attr:`SpectralEngine.matrix_free`."""
    return not isinstance(kernel, (torch.Tensor, DenseLinearOperator))
