"""Which linear-algebra backend to use for a spectral-filter problem."""

from __future__ import annotations

import math
import time

import numpy as np
import torch
from gpytorch.kernels import Kernel
from gpytorch.utils.warnings import NumericalWarning
from linear_operator.operators import LinearOperator
from torch import Tensor

from gpsd import settings
from gpsd._internal.keops import is_keops_kernel
from gpsd._internal.kernel_dtype import kernel_in_dtype, needs_graph
from gpsd._internal.negligible import drop_negligible
from gpsd._internal.progress_reporter import check_progress
from gpsd._internal.user_warning import warn
from gpsd._internal.validation import check_int
from gpsd.exceptions import InsufficientMemoryError
from gpsd.linalg.chunked_kernel_operator import ChunkedKernelOperator
from gpsd.linalg.distributed_kernel_operator import DistributedKernelOperator
from gpsd.linalg.engine_request import BACKENDS, EngineRequest
from gpsd.linalg.kernel_spectrum import KernelSpectrum
from gpsd.linalg.memory import free_memory_bytes
from gpsd.linalg.shifted_cg import ShiftedCG
from gpsd.linalg.shifted_cholesky import ShiftedCholesky
from gpsd.linalg.spectral_engine import SpectralEngine
from gpsd.progress import Callback

__all__ = ["BACKENDS", "choose_backend", "make_engine"]

# The device limits of the choice are gpsd.settings.max_chain_factorisations and dense_max_n;
# their docstrings give the measurements behind the defaults.
# Peak memory of the dense eigendecomposition in N x N matrices of the factorisation dtype: the
# kernel matrix, its eigenvectors and about two more for the solver's workspace.
_EIGH_MATRICES = 4
# Least memory of the Cholesky chain: the kernel matrices, then per factor batch the shifted
# matrix and its factor.
_CHOLESKY_FACTOR_MATRICES = 2


def check_shareable(backend: str) -> None:
    """Refuse a backend that forms the whole kernel matrix (``"dense"``, ``"cholesky"``) for
    a ``process_group``, naming the matrix-free ones; every other backend passes."""
    if backend in ("dense", "cholesky"):
        raise ValueError(
            f"backend={backend!r} forms the whole kernel matrix on every rank and cannot "
            "share it out over process_group; use backend='lanczos' or 'cg' (or 'auto', "
            "which goes matrix-free with a process_group), or process_group=None"
        )


def forms_kernel_matrix(
    backend: str, x: Tensor, kernel: Kernel, dtype: torch.dtype, process_group: object = None
) -> bool:
    """Whether ``backend`` forms the kernel matrix of ``kernel`` at ``x`` (``(*b, N, d)``) for
    one factorisation in ``dtype``: ``"dense"``, ``"cholesky"``, or ``"auto"`` where
    :func:`choose_backend` picks one of them. With a ``process_group`` nothing forms it:
    ``"auto"`` goes matrix-free, and ``"dense"`` or ``"cholesky"`` raise the ``ValueError`` of
    :func:`make_engine`."""
    if process_group is not None:
        check_shareable(backend)
        return False
    if backend == "auto":
        batch = torch.broadcast_shapes(x.shape[:-2], kernel.batch_shape)
        backend = choose_backend(x.shape[-2], 1, x.device, dtype, batch.numel())
    return backend in ("dense", "cholesky")


def choose_backend(
    n: int,
    num_factorisations: int,
    device: torch.device | str,
    dtype: torch.dtype = torch.float64,
    batch_size: int = 1,
    num_schedules: int = 1,
    free_bytes: int | None = None,
    factor_batch_size: int | None = None,
) -> str:
    r"""Pick ``"cholesky"``, ``"dense"`` or ``"lanczos"`` for an ``n``-point problem.

    ``num_factorisations`` is the number of distinct shifted Cholesky factorisations the chain
    would need (steps times schedules). The chain is chosen while it is measured to be cheaper
    than one eigendecomposition (up to 3 factorisations, on the CPU and on CUDA); beyond the
    size where an ``n x n`` eigendecomposition is practical, the matrix-free Lanczos backend is
    used (the regressors switch to deflated CG, ``"cg"``, when Lanczos does not reach their
    accuracy).

    Memory decides too (``free_bytes``, default: :func:`free_memory_bytes` of ``device``). Let
    :math:`s` be the size of the kernel matrices (``batch_size`` of them, ``n x n`` in ``dtype``)
    and :math:`f` that of one Cholesky factor, which covers every schedule:
    ``factor_batch_size`` matrices. The eigendecomposition is chosen only if :math:`4s`
    (matrix, eigenvectors, workspace) fits in 80 % of the free memory. The chain is chosen only if
    all its :math:`T` factors fit in the cache of :class:`~gpsd.linalg.ShiftedCholesky`, half the
    memory left beside the matrix and one more factor:
    :math:`T f \le (\text{free} - s - f)/2`; otherwise the variances would factor every shift
    again (for every chunk of test points), and the chain would lose its edge.

    :param n: number of training points :math:`N`.
    :param num_factorisations: Cholesky factorisations the chain needs.
    :param device: where the factorisation runs.
    :param dtype: dtype of the factorisation.
    :param batch_size: number of independent ``n x n`` kernel matrices.
    :param num_schedules: number of noise schedules (each Cholesky factor covers all of them).
    :param free_bytes: memory available; measured on ``device`` when not given.
    :param factor_batch_size: ``n x n`` matrices in one factor: the broadcast of the schedules'
        batch shape with the kernel matrices' (default ``max(batch_size, num_schedules)``, right
        where the two batches pair; a schedule batch ``(3, 1)`` against a kernel batch ``(2,)``
        makes 6).
    """
    n = check_int(n, "n")
    num_factorisations = check_int(num_factorisations, "num_factorisations")
    batch_size = check_int(batch_size, "batch_size")
    num_schedules = check_int(num_schedules, "num_schedules")
    if factor_batch_size is None:
        factor_batch_size = max(batch_size, num_schedules)
    factor_batch_size = check_int(factor_batch_size, "factor_batch_size")
    max_chain = settings.max_chain_factorisations.value(device)
    dense_max_n = settings.dense_max_n.value(device)
    memory_fraction = settings.dense_memory_fraction.value()
    one_matrix = n * n * (torch.finfo(dtype).bits // 8)
    matrix_bytes = batch_size * one_matrix
    factor_bytes = factor_batch_size * one_matrix
    num_factors = math.ceil(num_factorisations / num_schedules)
    # T f <= (free - s - f) / 2, and 4 s <= 80 % of free (the docstring's rules)
    chain_needs = 2 * num_factors * factor_bytes + matrix_bytes + factor_bytes
    eigh_needs = math.ceil(_EIGH_MATRICES * matrix_bytes / memory_fraction)
    chain_by_size = num_factorisations <= max_chain and n <= 2 * dense_max_n
    eigh_by_size = n <= dense_max_n
    if free_bytes is None:
        # what the candidates that N and T allow need: collect garbage where it is not free
        needs = [chain_needs] * chain_by_size + [eigh_needs] * eigh_by_size
        free_bytes = free_memory_bytes(device, wanted=max(needs, default=None))
    if chain_by_size and chain_needs <= free_bytes:
        return "cholesky"
    if eigh_by_size and _EIGH_MATRICES * matrix_bytes <= memory_fraction * free_bytes:
        return "dense"
    return "lanczos"


#: N-vectors a prediction keeps free memory for beside the kept kernel rows: about 8 blocks of
#: test-chunk columns (a CG solve's iterates and products) and 4 row chunks of 2048 (a kernel
#: evaluation's temporaries).
_ROW_CHUNK_VECTORS = 4 * 2048


def make_engine(
    request: EngineRequest, *, progress: object = False, callback: Callback | None = None
) -> SpectralEngine:
    """The backend object for a kernel: a :class:`KernelSpectrum`, :class:`ShiftedCholesky` or
    :class:`ShiftedCG`, all of them :class:`~gpsd.linalg.SpectralEngine` s.

    ``request`` (an :class:`~gpsd.linalg.EngineRequest`) says what to build: below, ``kernel``
    (its ``covar_module``), ``x`` (its ``inputs``), ``backend``, ``rank``, ``rtol``,
    ``gamma_min`` (its ``smallest_noise``), ``kernel_cache_bytes`` (its ``cache_bytes``) and
    ``process_group`` are its fields. A caller that keeps the engine keeps the request with it: the engine serves
    every request equal to it.

    This function is gpsd's one backend policy: the choice of ``backend="auto"``, its
    Lanczos-first and Lanczos-to-CG fallbacks, and the memory each backend may take. Callers
    read what they need from the engine (:attr:`~gpsd.linalg.SpectralEngine.matrix_free`,
    :attr:`~gpsd.linalg.SpectralEngine.supports_autograd`), never from the backend's name.

    The Lanczos and CG backends never form the kernel matrix: a KeOps kernel's own operator or a
    :class:`~gpsd.linalg.ChunkedKernelOperator` supplies the products; the latter keeps the kernel
    rows it evaluates within ``kernel_cache_bytes`` (default: :class:`gpsd.settings.kernel_cache_fraction` of the
    device's free memory), so that later products read them instead of evaluating the kernel
    again. Ritz pairs count as
    resolved when their residual is below ``0.1 * rtol * gamma_min``, and the trace bound on the
    complement norm is taken without power iterations when it is below ``0.5 * rtol * gamma_min``
    (both then keep the error estimate under ``rtol``); without a ``rank`` the Krylov basis is
    extended block by block (an eighth of the largest rank per block, at most 64 columns) until
    the error estimate for the smallest shift ``gamma_min`` is below ``rtol``, up to
    :class:`gpsd.settings.max_lanczos_rank` (a basis of N columns would cost more than the dense decomposition it
    avoids). The CG backend deflates the Ritz pairs of a rank-``rank`` (default
    :class:`gpsd.settings.cg_deflation_rank`) Lanczos run and solves to relative residual ``rtol``.

    ``backend="auto"`` takes :func:`~gpsd.linalg.choose_backend`'s choice; where that is the dense
    eigendecomposition and no gradient is needed, it first grows Lanczos on the formed matrix up
    to rank ``N / 4`` (a smooth kernel's fast-decaying spectrum makes that far cheaper than
    ``eigh``) and falls back to the dense decomposition if that rank does not reach ``rtol``, or
    as soon as half of it shows that it cannot (:func:`_out_of_reach`). The attempt is skipped
    before any product where the trace and the Frobenius norm of the matrix already show more
    eigenvalues above the level the filters need than the rank could resolve
    (:func:`_eigenvalue_count_bound`; a slowly decaying spectrum). The dense decomposition goes
    through the tridiagonal reduction where no autograd graph is kept on the CPU
    (:meth:`KernelSpectrum.from_tridiagonal`, see :func:`_full_spectrum`). Beyond the size
    of a dense decomposition, or where it would not fit in the device's free memory, it grows
    Lanczos up to :class:`gpsd.settings.max_lanczos_rank` and, if that does not reach ``rtol``, solves by CG
    deflated with the Ritz pairs it found.

    A forced ``"lanczos"`` or ``"cg"`` on a slowly decaying spectrum, where the matrix would fit
    in memory, warns before it starts, with its estimated cost
    (:func:`_warn_if_hard_for_matrix_free`); a forced ``"cg"`` whose probes counted short warns
    after its Lanczos run of the default rank, before its first solve, where the eigenvalues it
    leaves to the iterations average at least ``gamma_min``
    (:func:`_warn_if_cg_iterates_on_much`).

    ``backend="dense"`` and ``"cholesky"`` form the ``N x N`` kernel matrices: where they cannot
    fit in the device's free memory (:func:`~gpsd.linalg.free_memory_bytes`), an
    :class:`~gpsd.InsufficientMemoryError` is raised before anything is allocated, with the bytes
    needed and free. The dense eigendecomposition needs 4 matrices (the kernel matrix, its
    eigenvectors and the solver's workspace); the chain needs the kernel matrix and, per factor,
    the shifted matrix and its factor, as large as the schedules' batch broadcast against the
    kernel's. The free memory these decisions and ``"auto"``'s choice plan with is the request's
    ``free_bytes`` where given, else :func:`~gpsd.linalg.free_memory_bytes` of the inputs'
    device (at most :class:`gpsd.settings.memory_limit`).

    ``progress`` and ``callback`` report the growth of a Lanczos basis, where the backend grows
    one (see :meth:`KernelSpectrum.from_lanczos`; by default nothing is reported). A callback
    that returns ``True`` stops the growth there: ``backend="lanczos"`` returns that spectrum,
    and ``"auto"`` goes on as when Lanczos does not reach ``rtol`` (deflated CG, or the dense
    eigendecomposition where that was the alternative).

    With a ``process_group`` (a ``torch.distributed.ProcessGroup``; ``None``: one process), the
    matrix-free backends multiply through a :class:`~gpsd.linalg.DistributedKernelOperator`,
    each rank evaluating its block of kernel rows, and every rank of the group must call this
    function with the same arguments. Lanczos then keeps each rank's rows of its Krylov basis
    and eigenvectors (:attr:`~gpsd.linalg.SpectralEngine.local_rows`), with every sum over the
    rows all-reduced in rank order, so all ranks hold the same eigenvalues; deflated CG gathers
    the Ritz vectors and runs its iterations the same on every rank. ``backend="auto"`` then goes matrix-free whatever N (Lanczos,
    and deflated CG where it does not reach ``rtol``), so that the group shares the work and
    every rank returns the single-process answer of that backend; ``"dense"`` and
    ``"cholesky"``, which would form the whole matrix on every rank and ignore the group, raise
    a ``ValueError`` naming the matrix-free backends.
    """
    if not isinstance(request, EngineRequest):
        raise TypeError(
            f"make_engine takes a gpsd.linalg.EngineRequest, got {type(request).__name__}"
        )
    check_progress(progress, callback)
    kernel, x, backend = request.covar_module, request.inputs, request.backend
    schedule_shape, num_steps = request.schedule_shape, request.steps
    eig_dtype, rank, rtol, gamma_min = (
        request.dtype,
        request.rank,
        request.rtol,
        request.smallest_noise,
    )
    kernel_cache_bytes, process_group = request.cache_bytes, request.process_group
    free_bytes = request.free_bytes
    n = x.shape[-2]
    if process_group is not None:
        check_shareable(backend)

    def lanczos(operator, r: int, stop_when=None) -> KernelSpectrum:
        return KernelSpectrum.from_lanczos(
            operator,
            rank=r,
            residual_tol=0.1 * rtol * gamma_min,
            complement_tol=0.5 * rtol * gamma_min,
            dtype=eig_dtype or x.dtype,
            generator=torch.Generator().manual_seed(request.seed),
            stop_when=stop_when,
            gamma_min=gamma_min,
            progress=progress,
            callback=callback,
        )

    def grow_lanczos(
        operator, max_rank: int, give_up_early: bool = False, moments: tuple | None = None
    ) -> KernelSpectrum:
        def stop(spectrum: KernelSpectrum) -> bool:
            if spectrum.meets(gamma_min, rtol, allow_power=False):
                return True
            if not give_up_early:
                return False
            if _out_of_reach(spectrum, max_rank, gamma_min, rtol):
                return True
            # the trace and Frobenius norm of the formed matrix count what the Ritz values leave
            return moments is not None and _too_many_above(
                spectrum.ritz_values, *moments, n, gamma_min, rtol, max_rank
            )

        return lanczos(operator, max_rank, stop)

    if backend in ("lanczos", "cg"):
        operator = _matrix_free(kernel, x, eig_dtype, kernel_cache_bytes, process_group)
        better, warned = None, False
        if process_group is None:  # a probe product on some ranks only would hang the others
            better = _dense_alternative(
                n, x, eig_dtype or x.dtype, num_steps, schedule_shape, kernel
            )
        if better is not None:
            warned = _warn_if_hard_for_matrix_free(
                operator, backend, better, n, x, eig_dtype or x.dtype, rank, gamma_min, rtol
            )
        try:
            if backend == "lanczos":
                if rank is not None:
                    return lanczos(operator, rank)
                return grow_lanczos(operator, min(n, settings.max_lanczos_rank.value()))
            spectrum = lanczos(
                operator, rank if rank is not None else min(n, settings.cg_deflation_rank.value())
            )
            if better is not None and not warned and rank is None:  # a given rank is chosen
                _warn_if_cg_iterates_on_much(spectrum, better, n, gamma_min, rtol)
            return ShiftedCG.from_spectrum(operator, spectrum, tol=rtol)
        except torch.OutOfMemoryError as err:
            raise InsufficientMemoryError(
                f"backend={backend!r} ran out of memory holding an {n}-row Krylov basis on "
                f"{x.device}; pass a smaller rank= (now {rank}) or kernel_cache_bytes=, or a "
                "KeOps kernel"
            ) from err
    needs_grad = needs_graph(kernel, x)
    try_lanczos_first = False
    # a kernel with a batch shape makes a batch of matrices from shared inputs too
    matrix_shape = torch.broadcast_shapes(x.shape[:-2], kernel.batch_shape)
    if backend in ("dense", "cholesky"):
        _check_dense_memory(
            backend, n, x.device, eig_dtype or x.dtype, matrix_shape, schedule_shape, free_bytes
        )
    if backend == "auto" and process_group is not None:
        backend = "lanczos"  # the group shares out the kernel rows of the matrix-free backends
    if backend == "auto":
        num_schedules = schedule_shape.numel()
        backend = choose_backend(
            n,
            num_schedules * num_steps,
            x.device,
            dtype=eig_dtype or x.dtype,
            batch_size=matrix_shape.numel(),
            num_schedules=num_schedules,
            # a factor's batch: the schedules' broadcast against the matrices', as the shift is
            factor_batch_size=torch.broadcast_shapes(schedule_shape, matrix_shape).numel(),
            free_bytes=free_bytes,
        )
        try_lanczos_first = backend == "dense" and not needs_grad
    # K is evaluated in the factorisation's dtype, as the matrix-free backends do; with a graph
    # to keep, through differentiable casts of the parameters (a copy would cut the graph).
    dense_kernel, dense_x = kernel_in_dtype(kernel, x, eig_dtype, keep_graph=needs_grad)
    try:
        if backend == "cholesky":
            return ShiftedCholesky(dense_kernel(dense_x), dtype=eig_dtype)
        if backend == "lanczos":  # chosen by choose_backend: no dense matrix (N or memory)
            operator = _matrix_free(kernel, x, eig_dtype, kernel_cache_bytes, process_group)
            spectrum = grow_lanczos(operator, min(n, settings.max_lanczos_rank.value()))
            if spectrum.meets(gamma_min, rtol):
                return spectrum
            return ShiftedCG.from_spectrum(operator, spectrum, tol=rtol)
        # The matrix fits: evaluate it once, for the Lanczos attempt and the fallback alike.
        dense = dense_kernel(dense_x).to_dense()
        dense = dense if eig_dtype is None else dense.to(eig_dtype)
        budget = rank or max(1, n // 4)
        moments = _trace_and_frobenius(dense) if try_lanczos_first else None
        if try_lanczos_first and not _hard_spectrum(*moments, n, budget, gamma_min, rtol):
            dense = drop_negligible(dense, inplace=not dense.requires_grad)  # Krylov products
            spectrum = grow_lanczos(dense, budget, give_up_early=True, moments=moments)
            if spectrum.meets(gamma_min, rtol):
                return spectrum
        return _full_spectrum(dense, eig_dtype, keep_graph=needs_grad)
    except torch.OutOfMemoryError as err:
        raise InsufficientMemoryError(
            f"backend={backend!r} ran out of memory factoring the {n} x {n} kernel matrix on "
            f"{x.device}; use backend='lanczos' or backend='cg', which never form it"
        ) from err


def _check_dense_memory(
    backend: str,
    n: int,
    device: torch.device,
    dtype: torch.dtype,
    matrix_shape: torch.Size,
    schedule_shape: torch.Size,
    free_bytes: int | None = None,
) -> None:
    """Raise :class:`~gpsd.InsufficientMemoryError` where ``backend`` (``"dense"`` or
    ``"cholesky"``) cannot fit its ``n x n`` matrices in ``free_bytes`` (default: the free
    memory of ``device``)."""
    one_matrix = n * n * (torch.finfo(dtype).bits // 8)
    matrix_bytes = matrix_shape.numel() * one_matrix
    if backend == "dense":
        needed = _EIGH_MATRICES * matrix_bytes
        what = f"{_EIGH_MATRICES} times the kernel matrices (matrix, eigenvectors, workspace)"
    else:
        factor_bytes = torch.broadcast_shapes(schedule_shape, matrix_shape).numel() * one_matrix
        needed = matrix_bytes + _CHOLESKY_FACTOR_MATRICES * factor_bytes
        what = "the kernel matrices, a shifted matrix and its Cholesky factor"
    free = free_memory_bytes(device, wanted=needed) if free_bytes is None else free_bytes
    if needed > free:
        raise InsufficientMemoryError(
            f"backend={backend!r} needs about {needed} bytes ({needed / 2**30:.3g} GiB: {what}, "
            f"N = {n} in {dtype}) on {device}, but {free} bytes ({free / 2**30:.3g} GiB) are "
            "free; use backend='lanczos' or backend='cg', which never form the N x N matrix"
        )


#: Krylov columns block Lanczos took per eigenpair it resolved: 2.2 to 3.8 in our measurements
#: (see :func:`_out_of_reach`); the decisions take the low end.
_COLUMNS_PER_PAIR = 2.2


def _full_spectrum(
    dense: Tensor, eig_dtype: torch.dtype | None, keep_graph: bool
) -> KernelSpectrum:
    """The full eigendecomposition of the formed ``dense`` matrix: through its tridiagonal
    reduction (:meth:`KernelSpectrum.from_tridiagonal`) on the CPU where no autograd graph is
    kept, with which a whole prediction at N = 2000 measured 1.1 to 1.4 times faster than with
    ``torch.linalg.eigh`` (``benchmarks/results/hard_spectrum_vs_sklearn_cpu.md``);
    ``torch.linalg.eigh`` otherwise (on CUDA the reduction would run on the host, which has not
    been measured to pay), and where LAPACK reports a failure of the reduction or of the
    tridiagonal eigensolver."""
    dtype = eig_dtype or dense.dtype
    tridiagonal = (
        not keep_graph
        and dense.device.type == "cpu"
        and dtype in (torch.float32, torch.float64)
        and dense.shape[-1] > 1
    )
    if tridiagonal:
        try:
            return KernelSpectrum.from_tridiagonal(dense, dtype=eig_dtype)
        except np.linalg.LinAlgError:  # LAPACK reported a failure
            pass
    return KernelSpectrum.from_dense(dense, dtype=eig_dtype)


def _eigenvalue_count_bound(trace: Tensor, frobenius_sq: Tensor, n: int, tau: float) -> Tensor:
    r"""A lower bound on the number of eigenvalues above ``tau`` of positive semi-definite
    matrices with traces ``trace`` and squared Frobenius norms ``frobenius_sq`` (``(*b,)``).

    The eigenvalues at most :math:`\tau` sum to at most :math:`N\tau`, so those above it sum to
    :math:`s \ge \operatorname{tr}\mathbf K - N\tau`; by Cauchy–Schwarz,
    :math:`s^2 \le n_\tau \sum_{d_i > \tau} d_i^2 \le n_\tau \lVert\mathbf K\rVert_F^2`:

    .. math::
        n_\tau \ge \frac{(\operatorname{tr}\mathbf K - N\tau)_+^2}{\lVert\mathbf K\rVert_F^2}.
    """
    excess = (trace - n * tau).clamp_min(0)
    return excess.square() / frobenius_sq.clamp_min(torch.finfo(frobenius_sq.dtype).tiny)


def _lanczos_threshold(gamma_min: float, rtol: float) -> float:
    r"""The eigenvalue level :math:`\tau` Lanczos must resolve down to (see :func:`_out_of_reach`),
    for the default Taylor order 4 of :meth:`KernelSpectrum.from_lanczos`."""
    return gamma_min * rtol ** (1.0 / 5)


def _trace_and_frobenius(dense: Tensor) -> tuple[Tensor, Tensor]:
    """:math:`\\operatorname{tr}\\mathbf K` and :math:`\\lVert\\mathbf K\\rVert_F^2` of the formed
    matrices (``(*b, N, N)``), each of shape ``(*b,)``."""
    with torch.no_grad():
        d = dense.detach()
        return d.diagonal(dim1=-2, dim2=-1).sum(-1), d.square().sum((-2, -1))


def _too_many_above(
    theta: Tensor,
    trace: Tensor,
    frobenius_sq: Tensor,
    n: int,
    gamma_min: float,
    rtol: float,
    budget: int,
) -> bool:
    r"""Whether the leading Ritz values ``theta`` (``(*b, p)``) of a matrix with trace ``trace``
    and squared Frobenius norm ``frobenius_sq`` (``(*b,)``) leave more eigenvalues above the
    level Lanczos must resolve than a basis of ``budget`` columns can resolve (:func:`_beyond`).

    The count is those of ``theta`` above the level :math:`\tau` plus
    :func:`_eigenvalue_count_bound` on the spectrum they leave,
    :math:`(\operatorname{tr}\mathbf K - \sum\theta_i - (N-p)\tau)_+^2 /
    (\lVert\mathbf K\rVert_F^2 - \sum\theta_i^2)`. Ritz values lie below the eigenvalues they
    approximate, so this estimates rather than bounds; it sees a flat spectrum under a few large
    eigenvalues (inputs in many dimensions, whose distances concentrate), which the bound on the
    whole matrix misses."""
    p = theta.shape[-1]
    if p >= n:
        return False
    tau = _lanczos_threshold(gamma_min, rtol)
    theta = theta.to(trace)
    rest = _eigenvalue_count_bound(
        trace - theta.sum(-1), frobenius_sq - theta.square().sum(-1), n - p, tau
    )
    count = (theta > tau).sum(-1) + rest
    return _beyond(count, budget)


def _hard_spectrum(
    trace: Tensor, frobenius_sq: Tensor, n: int, budget: int, gamma_min: float, rtol: float
) -> bool:
    """Whether, before the Lanczos attempt, the formed matrices (``trace`` and ``frobenius_sq``
    from :func:`_trace_and_frobenius`) are seen to have more eigenvalues above the level Lanczos
    must resolve than a basis of ``budget`` columns can resolve (:func:`_eigenvalue_count_bound`,
    :func:`_beyond`):
    the automatic choice then skips the attempt, whose products and Rayleigh–Ritz steps would be
    thrown away. A flat spectrum under a few large eigenvalues escapes this bound; during the
    attempt, :func:`_too_many_above` looks again at each checkpoint with the Ritz values."""
    tau = _lanczos_threshold(gamma_min, rtol)
    return _beyond(_eigenvalue_count_bound(trace, frobenius_sq, n, tau), budget)


#: Random columns of each of the two probe products of :func:`_warn_if_hard_for_matrix_free`.
_PROBE_COLUMNS = 8

#: Eigenpairs from which on block Lanczos took at least :data:`_COLUMNS_PER_PAIR` columns each
#: in our measurements (a few pairs of a fast-decaying spectrum can take fewer).
_MANY_PAIRS = 64


def _beyond(count: Tensor, budget: int) -> bool:
    """Whether ``count`` (``(*b,)``) eigenpairs to resolve are beyond a basis of ``budget``
    columns: more than it can hold, or, from :data:`_MANY_PAIRS` on, more than it can resolve
    at :data:`_COLUMNS_PER_PAIR` columns each."""
    many = (count >= _MANY_PAIRS) & (_COLUMNS_PER_PAIR * count > budget)
    return bool(((count > budget) | many).any())


def _dense_alternative(
    n: int,
    x: Tensor,
    dtype: torch.dtype,
    num_steps: int,
    schedule_shape: torch.Size,
    kernel: Kernel,
) -> str | None:
    """What ``backend="auto"`` would factor instead of a forced matrix-free run: ``"dense"`` or
    ``"cholesky"``, or ``None`` where the ``N x N`` matrix would not fit (the matrix-free
    backends are then the only way, and nothing better can be pointed to)."""
    matrix_shape = torch.broadcast_shapes(x.shape[:-2], kernel.batch_shape)
    num_schedules = schedule_shape.numel()
    better = choose_backend(
        n,
        num_schedules * num_steps,
        x.device,
        dtype=dtype,
        batch_size=matrix_shape.numel(),
        num_schedules=num_schedules,
        factor_batch_size=torch.broadcast_shapes(schedule_shape, matrix_shape).numel(),
    )
    return None if better == "lanczos" else better


def _cg_iterations(kappa: float, rtol: float) -> int:
    r"""CG iterations that reach relative residual ``rtol`` at condition number ``kappa``:
    :math:`\lceil \tfrac12\sqrt\kappa \log(2/\mathrm{rtol}) \rceil`."""
    return math.ceil(0.5 * math.sqrt(kappa) * math.log(2.0 / rtol))


def _warn_if_cg_iterates_on_much(
    spectrum: KernelSpectrum, better: str, n: int, gamma_min: float, rtol: float
) -> None:
    r"""Warn, before a forced ``"cg"`` run's first solve, where the spectrum its Lanczos run
    leaves to the iterations is not small against the noise: the :math:`N - k` eigenvalues of
    :math:`\mathbf K` on the complement of its :math:`k` Ritz vectors, which CG deflates,
    average

    .. math::
        \bar d_\perp = \frac{\operatorname{tr}\mathbf K - \sum_i \theta_i}{N - k}
        \ \ge\ \gamma_{\min}

    (:math:`\mathbf V^\top\mathbf K\mathbf V = \operatorname{diag}(\boldsymbol\theta)` for
    Ritz vectors, so the numerator is the complement's trace exactly). Where the smallest of
    them are near zero, as a kernel matrix's are, every solve then iterates at a condition
    number of at least :math:`1 + \bar d_\perp/\gamma_{\min}`, where one factorisation
    (``better``) would serve every step.

    It looks only after a run of the default rank (:class:`gpsd.settings.cg_deflation_rank`):
    a ``rank=`` the caller gives is a choice of how much to deflate. It catches the slowly
    decaying spectra that the probes of :func:`_warn_if_hard_for_matrix_free` count short
    (their count is a lower estimate): at N = 2000, the 3-D, 48-D and deliveries settings of
    ``benchmarks/bench_hard_spectrum_vs_sklearn.py``, where ``cg`` took 4 to 15 times
    ``dense``."""
    trace = spectrum.kernel_trace
    theta = spectrum.ritz_values  # shape: (*b, k)
    k = theta.shape[-1]
    if trace is None or k >= n:
        return
    mean = float(((trace.detach().to(theta) - theta.clamp_min(0).sum(-1)) / (n - k)).max())
    if not mean >= gamma_min:
        return
    kappa = 1.0 + mean / gamma_min
    warn(
        f"backend='cg' on a slowly decaying spectrum: after deflating {k} Ritz pairs, the "
        f"{n - k} eigenvalues left to the iterations average {mean:.3g}, not below the smallest "
        f"noise {gamma_min:.3g}, so every CG solve iterates on them (with the smallest near "
        f"zero, a condition number of {kappa:.3g} or more: {_cg_iterations(kappa, rtol)} "
        f"iterations or more per solve, each a product with K). The {n} x {n} matrix fits in "
        f"memory: backend='auto' (here "
        f"{better!r}) factors it once and is faster on such spectra",
        NumericalWarning,
    )


def _warn_if_hard_for_matrix_free(
    operator: Tensor | LinearOperator,
    backend: str,
    better: str,
    n: int,
    x: Tensor,
    dtype: torch.dtype,
    rank: int | None,
    gamma_min: float,
    rtol: float,
) -> bool:
    r"""Warn, before a forced ``"lanczos"`` or ``"cg"`` run starts, where the kernel's spectrum is
    too flat for it and the ``N x N`` matrix would fit in memory (``backend="auto"`` would then
    factor it: ``better``): with the estimated number of products and their measured time.
    Returns whether it warned.

    Two products count the eigenvalues above the level Lanczos must resolve, and time one of
    them. The first, with :math:`p` random columns :math:`\boldsymbol\Omega`, gives an
    orthonormal basis :math:`\mathbf Q` of :math:`\mathbf K\boldsymbol\Omega`, the leading part
    of the range; the second, with :math:`\mathbf Q` and :math:`p` random columns
    :math:`\boldsymbol\omega` projected onto the complement
    (:math:`\mathbf P_\perp = \mathbf I - \mathbf Q\mathbf Q^\top`), gives the Ritz values
    :math:`\theta_i` of :math:`\mathbf Q^\top\mathbf K\mathbf Q`, and
    :math:`\lVert\mathbf K_\perp\rVert_F^2` of :math:`\mathbf K_\perp =
    \mathbf P_\perp\mathbf K\mathbf P_\perp` as the mean of
    :math:`\lVert\mathbf P_\perp\mathbf K\mathbf P_\perp\boldsymbol\omega\rVert^2`, whose
    trace is exactly :math:`\operatorname{tr}\mathbf K - \sum_i\theta_i`. The count is the
    Ritz values above the level plus :func:`_eigenvalue_count_bound` on :math:`\mathbf K_\perp`:
    taking the leading part out first sees a flat spectrum under a few large eigenvalues
    (inputs in many dimensions), which a count on the whole matrix misses. Deflated CG's
    iterations per solve follow from the condition number bound
    :math:`1 + \sqrt{\lVert\mathbf K\rVert_F^2/(k+1)} / \gamma_{\min}` after deflating
    :math:`k` pairs.
    """
    matrix_shape = operator.shape[:-2]
    p = min(_PROBE_COLUMNS, n)
    with torch.no_grad():
        generator = torch.Generator().manual_seed(1)
        omega = torch.randn((*matrix_shape, n, 2 * p), generator=generator, dtype=dtype)
        omega = omega.to(x.device)
        start = time.perf_counter()
        product = operator @ omega[..., :p]  # shape: (*b, n, p)
        seconds = time.perf_counter() - start
        basis = torch.linalg.qr(product).Q  # shape: (*b, n, p)
        rest = omega[..., p:] - basis @ (basis.mT @ omega[..., p:])  # P_perp omega
        both = operator @ torch.cat([basis, rest], dim=-1)  # shape: (*b, n, 2p)
        projected = basis.mT @ both[..., :p]
        theta = torch.linalg.eigvalsh(0.5 * (projected + projected.mT))  # shape: (*b, p)
        perp = both[..., p:] - basis @ (basis.mT @ both[..., p:])  # K_perp omega
        frobenius_perp = perp.square().sum(-2).mean(-1)  # shape: (*b,)
        trace = operator.diagonal(dim1=-2, dim2=-1).sum(-1).to(theta)
    tau = _lanczos_threshold(gamma_min, rtol)
    rest_count = _eigenvalue_count_bound(trace - theta.sum(-1), frobenius_perp, n - p, tau)
    count = float(((theta > tau).sum(-1) + rest_count).max())
    frobenius_sq = theta.square().sum(-1) + frobenius_perp
    if backend == "lanczos":
        budget = rank or min(n, settings.max_lanczos_rank.value())
        if _COLUMNS_PER_PAIR * count <= max(budget, n // 4):
            return False
        columns = min(n, math.ceil(_COLUMNS_PER_PAIR * count))
        products = math.ceil(columns / min(64, max(4, budget // 8)))  # blocks of from_lanczos
        cost = (
            f"resolving them takes block Lanczos about {columns} Krylov columns (its budget "
            f"here is {budget}) in {products} products with K, about {products * seconds:.2g} s "
            f"at the {seconds:.2g} s one took"
        )
    else:
        if _COLUMNS_PER_PAIR * count <= n // 4:
            return False
        deflated = rank or min(n, settings.cg_deflation_rank.value())
        kappa = 1.0 + math.sqrt(float(frobenius_sq.max()) / (deflated + 1)) / gamma_min
        iterations = _cg_iterations(kappa, rtol)
        cost = (
            f"deflated CG solves with up to {iterations} iterations each (condition number up "
            f"to {kappa:.3g} after deflating {deflated} pairs), each iteration a product with K "
            f"({seconds:.2g} s for one here)"
        )
    warn(
        f"backend={backend!r} on a slowly decaying spectrum: the kernel matrix has at least "
        f"{count:.0f} eigenvalues above {tau:.3g}, the level the filters need resolved; {cost}. "
        f"The {n} x {n} matrix fits in memory: backend='auto' (here {better!r}) factors it "
        "once and is faster on such spectra",
        NumericalWarning,
    )
    return True


def _out_of_reach(spectrum: KernelSpectrum, max_rank: int, gamma_min: float, rtol: float) -> bool:
    r"""Whether a Lanczos run at half its rank budget or more looks unable to meet ``rtol``.

    The complement norm must fall to about :math:`\tau = \gamma_{\min}\,
    \mathrm{rtol}^{1/(J+1)}` for the Taylor series of order :math:`J` to reach ``rtol``. When
    every one of the :math:`r \ge` ``max_rank / 2`` Ritz values still exceeds :math:`\tau`, the
    kernel has at least :math:`r` eigenvalues above it (Cauchy interlacing), and resolving the
    :math:`k` leading pairs took block Lanczos 2.2 to 3.8 k columns in our measurements: more
    than the budget. Used where a failed attempt is thrown away (the Lanczos attempt before a
    dense eigendecomposition), not where its Ritz pairs deflate CG.
    """
    theta = spectrum.ritz_values  # shape: (*b, r)
    if 2 * theta.shape[-1] < max_rank:
        return False
    tau = gamma_min * rtol ** (1.0 / (spectrum.max_series_order + 1))
    return bool((theta >= tau).all(-1).any())


def _matrix_free(
    kernel: Kernel,
    x: Tensor,
    dtype: torch.dtype | None,
    cache_bytes: int | None,
    process_group: object = None,
) -> Tensor | LinearOperator:
    """The kernel matrix as an operator that is never formed whole (KeOps, or row chunks of which
    those that fit in ``cache_bytes`` are kept between products; ``None``:
    :class:`gpsd.settings.kernel_cache_fraction` of the device's free memory, less where the rest would not
    hold a prediction's working set of :data:`_ROW_CHUNK_VECTORS` plus 8 test chunks of N-vectors).
    With a ``process_group``, a :class:`~gpsd.linalg.DistributedKernelOperator`: each rank
    evaluates and keeps its own block of rows (a KeOps kernel by KeOps reductions over them).

    The products run in ``dtype`` (the factorisation's), so that the Krylov products, the Ritz
    residuals and the CG residuals reach that precision even for float32 data; the kernel is
    copied into ``dtype`` for that (these backends keep no graph).
    """
    kernel, x = kernel_in_dtype(kernel, x, dtype)
    if is_keops_kernel(kernel) and process_group is None:
        return kernel(x)
    if cache_bytes is None:
        cache_bytes = default_cache_bytes(x)
    if process_group is not None:
        return DistributedKernelOperator(
            x,
            covar_module=kernel,
            process_group=process_group,
            cache_bytes=cache_bytes,
            keep_after=settings.keep_kernel_rows_after.value(),
        )
    return ChunkedKernelOperator(
        x,
        covar_module=kernel,
        cache_bytes=cache_bytes,
        keep_after=settings.keep_kernel_rows_after.value(),
    )


def default_cache_bytes(x: Tensor) -> int:
    """Bytes of kernel rows to keep for the inputs ``x`` (``(*batch, N, d)``, in the dtype of the
    products): :class:`gpsd.settings.kernel_cache_fraction` of the free memory, less where the rest would not
    hold a prediction's working set. Where that cannot hold every row, the memory of models no
    longer referenced is collected first (:func:`~gpsd.linalg.free_memory_bytes`)."""
    itemsize = torch.finfo(x.dtype).bits // 8
    vectors = x.shape[:-1].numel()  # batch x N
    every_row = vectors * x.shape[-2] * itemsize
    free = free_memory_bytes(
        x.device, wanted=math.ceil(every_row / settings.kernel_cache_fraction.value())
    )
    working = (8 * settings.test_chunk_size.value() + _ROW_CHUNK_VECTORS) * vectors * itemsize
    return max(0, int(min(settings.kernel_cache_fraction.value() * free, free - working)))
