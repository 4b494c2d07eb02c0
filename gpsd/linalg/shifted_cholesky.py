"""Spectral filters of the data-centric family by a chain of shifted Cholesky solves."""

from __future__ import annotations

from collections import OrderedDict

import torch
from linear_operator import to_dense
from linear_operator.operators import LinearOperator
from linear_operator.utils.cholesky import psd_safe_cholesky
from linear_operator.utils.warnings import PerformanceWarning
from torch import Tensor

from gpsd._internal.user_warning import warn
from gpsd._internal.validation import check_int
from gpsd.linalg._shifted_solve import ShiftedSolveEngine, carries_graph
from gpsd.linalg.memory import free_memory_bytes
from gpsd.linalg.spectral_filter import SpectralFilter

__all__ = ["ShiftedCholesky"]


class ShiftedCholesky(ShiftedSolveEngine):
    r"""Applies the filters of :class:`~gpsd.linalg.SpectralFilter` by shifted solves.

    Every factor :math:`1/(d + \gamma)` or :math:`d/(d+\gamma)` of a data-centric filter becomes a
    solve with :math:`\mathbf K + \gamma\mathbf I = \mathbf L_\gamma \mathbf L_\gamma^\top`:

    .. math::
        \mathbf K(\mathbf K + \gamma\mathbf I)^{-1}\mathbf a
        = \mathbf a - \gamma\,(\mathbf K + \gamma\mathbf I)^{-1}\mathbf a .

    Each distinct shift is factored once (:math:`\mathcal O(N^3/3)`), so ``T`` steps cost ``T``
    Cholesky factorisations: cheaper than one eigendecomposition when ``T`` is small, and exact.
    It offers the same ``apply``/``cross``/``quad_diag``/``trace`` as
    :class:`~gpsd.linalg.KernelSpectrum`, for the filters it can evaluate.

    **Memory.** Each factor is as large as :math:`\mathbf K` times the schedules it covers. The
    factors are kept for reuse (the variances need them again after the means) while their bytes
    add up to at most ``max_cached_bytes``, the least recently used one dropped first; one that
    was dropped is factored again when needed, with a ``PerformanceWarning`` the first time.

    :param kernel: :math:`\mathbf K`, shape ``(*b, N, N)``.
    :param dtype: the dtype of the factorisations (default: the kernel's).
    :param max_cached_bytes: memory for cached factors, a non-negative integer (at least one
        factor is always kept). Default: half the memory free on the kernel's device when the
        first factor is made.
    """

    name = "cholesky"

    def __init__(
        self,
        kernel: Tensor | LinearOperator,
        dtype: torch.dtype | None = None,
        max_cached_bytes: int | None = None,
    ) -> None:
        if max_cached_bytes is not None:
            max_cached_bytes = check_int(max_cached_bytes, "max_cached_bytes", minimum=0)
        dense = to_dense(kernel)
        self.kernel_matrix = dense if dtype is None else dense.to(dtype)
        self.dtype = self.kernel_matrix.dtype
        self.size = dense.shape[-1]
        self.max_cached_bytes = max_cached_bytes
        self._factors: OrderedDict[tuple, Tensor] = OrderedDict()
        self._dropped: set[tuple] = set()  # keys of factors dropped from the cache
        self._cached_bytes = 0  # bytes of the factors in the cache
        self._warned = False

    def factor(self, noise: Tensor) -> Tensor:
        """Cholesky factor of :math:`\\mathbf K + \\gamma\\mathbf I` for ``noise`` of shape ``(*s,)``.

        A ``noise`` that requires gradients (with gradients enabled) is factored afresh and not
        cached: a cached factor would carry the graph of the shift it was made for, not this
        one's. Factors made with and without a graph to the kernel matrix are cached apart.

        :raises TypeError: if ``noise`` is not a floating-point tensor.
        :raises ValueError: if a shift is zero, negative, NaN or infinite.
        """
        if not isinstance(noise, Tensor) or not noise.is_floating_point():
            kind = f"dtype {noise.dtype}" if isinstance(noise, Tensor) else type(noise).__name__
            raise TypeError(f"noise must be a floating-point tensor of shifts, got {kind}")
        host = noise.detach().cpu()  # the cache key and the check in one transfer
        bad = ~((host > 0) & host.isfinite())
        if bool(bad.any()):
            raise ValueError(
                f"noise must hold finite positive shifts; {int(bad.sum())} of them are not, "
                f"such as {float(host[bad][0])}"
            )
        if carries_graph(noise):
            return psd_safe_cholesky(self._shifted(noise))
        with_graph = self.kernel_matrix.requires_grad and torch.is_grad_enabled()
        key = (tuple(noise.shape), host.numpy().tobytes(), with_graph)
        if key in self._factors:
            self._factors.move_to_end(key)
            return self._factors[key]
        if key in self._dropped and not self._warned:
            self._warned = True
            warn(
                f"ShiftedCholesky factors a shift again that it dropped from its cache "
                f"(max_cached_bytes={self.max_cached_bytes} holds {len(self._factors)} factors); "
                "every later pass over the shifts (the variances of each chunk of test points) "
                "refactors them all. Use backend='dense' (one eigendecomposition for any number "
                "of steps) or a matrix-free backend ('lanczos', 'cg'), or raise max_cached_bytes",
                PerformanceWarning,
            )
        factor = psd_safe_cholesky(self._shifted(noise))
        if self.max_cached_bytes is None:
            self.max_cached_bytes = free_memory_bytes(factor.device) // 2
        # Factors of schedules of different batch shapes differ in size: count their bytes
        # (counting the new factor's size once per cached one overfilled or emptied the cache).
        size = factor.nbytes
        while self._factors and self._cached_bytes + size > self.max_cached_bytes:
            dropped_key, dropped = self._factors.popitem(last=False)
            self._cached_bytes -= dropped.nbytes
            self._dropped.add(dropped_key)
        self._factors[key] = factor
        self._cached_bytes += size
        return factor

    def _shifted(self, noise: Tensor) -> Tensor:
        """:math:`\\mathbf K + \\gamma\\mathbf I`, shape ``(*s, *b, N, N)``."""
        eye = torch.eye(self.size, dtype=self.kernel_matrix.dtype, device=self.kernel_matrix.device)
        return self.kernel_matrix + noise.to(self.kernel_matrix)[..., None, None] * eye

    def _solve(self, noise: Tensor, rhs: Tensor) -> Tensor:
        return torch.cholesky_solve(rhs, self.factor(noise))

    def _resolvent_quad_diag(self, noise: Tensor, left: Tensor) -> tuple[Tensor, None]:
        """Squared column norms of :math:`\\mathbf L_\\gamma^{-1}\\mathbf C`: one triangular solve
        (exact up to rounding: no error bound)."""
        half = torch.linalg.solve_triangular(self.factor(noise), left, upper=False)
        return half.square().sum(-2), None

    def trace(self, filt: SpectralFilter) -> Tensor:
        """:math:`\\operatorname{tr} f_t(\\mathbf K)` by solves with the identity; ``(*, F)``."""
        eye = torch.eye(self.size, dtype=self.kernel_matrix.dtype, device=self.kernel_matrix.device)
        eye = eye.expand(*self.kernel_matrix.shape[:-2], self.size, self.size)
        return self.apply(filt, eye).diagonal(dim1=-2, dim2=-1).sum(-1)
