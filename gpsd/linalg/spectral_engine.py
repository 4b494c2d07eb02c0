"""The one interface of the engines that apply spectral filters of a kernel matrix."""

from __future__ import annotations

import abc
from collections.abc import Callable

import torch
from linear_operator.operators import DenseLinearOperator
from torch import Tensor

from gpsd import settings
from gpsd._internal.validation import check_int
from gpsd.exceptions import BackendError
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

    #: The backend the engine implements (``"dense"``, ``"cholesky"``, ``"lanczos"``, ``"cg"``).
    name: str
    #: Whether results carry an autograd graph to the kernel's hyperparameters (and shifts).
    supports_autograd: bool
    #: Whether quadratic forms with test columns need no product with :math:`\mathbf K` (the
    #: forms are projections on eigenvectors every rank holds), so that the ranks of a process
    #: group can share test points out without multiplying together.
    columns_are_local: bool = False
    #: The rows of the ``N``-row vectors this rank holds where the engine splits them across
    #: the ranks of a process group (a Lanczos :class:`~gpsd.linalg.KernelSpectrum` of a
    #: :class:`~gpsd.linalg.DistributedKernelOperator`): its ``N``-row arguments and the rows
    #: :meth:`apply` returns are then this rank's rows, and its forms are summed over the
    #: ranks. ``None``: every row, on every rank.
    local_rows: slice | None = None
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
    #: Whether :meth:`trace` is exact up to rounding (the direct engines and a full spectrum);
    #: where it is not, :meth:`trace_estimate` estimates the trace from probe vectors.
    exact_trace: bool = True
    #: :math:`N`.
    size: int
    #: Bounds ``(*, F, M)`` on the absolute error of the latest :meth:`quad_diag`'s values,
    #: where the engine has them (the iterative solvers); ``None`` where :meth:`error_estimate`
    #: covers the quadratic forms too, or they are exact up to rounding.
    quad_error_bound: Tensor | None = None

    def guard(self, value: Tensor, *leaves: Tensor) -> Tensor:
        """``value``, a result of this engine, as it may enter an autograd graph.

        An engine whose results carry gradients (:attr:`supports_autograd`) returns ``value``
        itself. Another returns it linked to those of ``leaves`` that require grad (the tensors
        the result depends on: the kernel's parameters, test inputs) through a node whose
        backward raises a :class:`~gpsd.BackendError` naming the engine's backend: a gradient
        would need a graph the engine does not build, and a result without any graph would let a
        training loop run on without its gradient. Where gradients are disabled, or no leaf
        requires grad, ``value`` is returned as it is.

        :param value: a result of the engine, of any shape.
        :param leaves: the tensors ``value`` depends on (others than tensors are ignored).
        """
        if self.supports_autograd or not torch.is_grad_enabled():
            return value
        needing = [t for t in leaves if isinstance(t, Tensor) and t.requires_grad]
        if not needing:
            return value
        return _NoBackward.apply(value, self.name, *needing)

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
        need :math:`N` solves for it raises a ``ValueError`` naming :meth:`trace_estimate`."""

    def trace_estimate(
        self, filt: SpectralFilter, num_probes: int, generator: torch.Generator
    ) -> tuple[Tensor, Tensor]:
        r""":math:`\operatorname{tr} f_t(\mathbf K)` and the standard error of that value, both
        ``(*, F)``: an engine with :attr:`exact_trace` returns :meth:`trace` and zeros; the others
        estimate the part of the trace they cannot read off their factorisation from
        ``num_probes`` Rademacher vectors drawn from ``generator`` (Hutchinson's estimator), the
        same vectors for every filter of the stack, so that the differences between steps are
        estimated far better than the traces themselves.

        :param filt: the filters, shape ``(*s, F)``.
        :param num_probes: the number of probe vectors, at least 2.
        :param generator: a CPU generator the probes are drawn from (the same seed gives the same
            probes on every device and every rank).
        """
        value = self.trace(filt)
        return value, torch.zeros_like(value)

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


#: The backends whose engines build an autograd graph, named by the error of
#: :meth:`SpectralEngine.guard`.
_GRAPH_BACKENDS = ("dense", "cholesky")


class _NoBackward(torch.autograd.Function):
    """The identity on an engine's result, linked to the leaves it depends on, whose backward
    raises a :class:`~gpsd.BackendError` naming the engine's backend."""

    @staticmethod
    def forward(ctx, value: Tensor, backend: str, *leaves: Tensor) -> Tensor:
        ctx.backend = backend
        return value.clone()

    @staticmethod
    def backward(ctx, *grads: Tensor):
        raise BackendError(
            f"backend={ctx.backend!r} builds no autograd graph, and a backward pass reached one "
            f"of its results; use backend={_GRAPH_BACKENDS[0]!r} or {_GRAPH_BACKENDS[1]!r} to "
            "differentiate through the distiller, or compute the results under torch.no_grad()"
        )


def is_matrix_free(kernel: object) -> bool:
    """Whether ``kernel`` is an operator that never holds the matrix whole (not a tensor nor a
    dense ``LinearOperator``; a callable counts as one): the rule behind
    :attr:`SpectralEngine.matrix_free`."""
    return not isinstance(kernel, (torch.Tensor, DenseLinearOperator))


def columns_per_chunk(vectors_per_column: int) -> int:
    """How many columns keep ``vectors_per_column`` vectors of length ``N`` per column within
    ``N`` times :class:`gpsd.settings.test_chunk_size`, the memory a chunk of test points takes
    (at least one column)."""
    return max(1, settings.test_chunk_size.value() // max(1, vectors_per_column))


def hutchinson(
    samples: Callable[[Tensor], Tensor],
    size: int,
    num_probes: int,
    generator: torch.Generator,
    vectors_per_probe: int,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[Tensor, Tensor]:
    r"""The mean over ``num_probes`` Rademacher vectors :math:`\mathbf z` of ``samples(Z)`` and its
    standard error (the sample standard deviation over :math:`\sqrt{m}`).

    ``samples`` maps probes ``Z`` of shape ``(N, c)`` to one value per probe, ``(..., c)``. The
    probes are drawn on the CPU one after another (the ``i``-th probe does not depend on how they
    are chunked) and handed over in chunks of :func:`columns_per_chunk` (``vectors_per_probe``
    vectors of length ``N`` per probe).
    """
    num_probes = check_int(num_probes, "num_probes", minimum=2)  # a standard error needs 2
    chunk = columns_per_chunk(vectors_per_probe)
    values = []
    for start in range(0, num_probes, chunk):
        count = min(chunk, num_probes - start)
        values.append(samples(rademacher(size, count, generator, dtype, device)))
    return sample_mean(torch.cat(values, dim=-1))


def rademacher(
    size: int, count: int, generator: torch.Generator, dtype: torch.dtype, device: torch.device
) -> Tensor:
    """``count`` Rademacher vectors of length ``size`` as the columns of an ``(N, count)`` tensor,
    drawn on the CPU one after another: the ``i``-th vector from a generator does not depend on
    how many are drawn at once."""
    signs = torch.randint(0, 2, (count, size), generator=generator, dtype=torch.int8)
    return (2 * signs - 1).to(dtype=dtype, device=device).mT


def sample_mean(values: Tensor) -> tuple[Tensor, Tensor]:
    r"""The mean of ``values`` ``(..., m)`` over its last dimension and its standard error (the
    sample standard deviation over :math:`\sqrt{m}`)."""
    return values.mean(-1), values.std(-1) / values.shape[-1] ** 0.5
