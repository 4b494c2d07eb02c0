"""Shared plumbing of the regression distillers: validation, backends, caching."""

from __future__ import annotations

import copy
import math
import operator
import warnings
from collections.abc import Callable
from typing import NamedTuple

import gpytorch
import torch
from gpytorch.constraints import GreaterThan
from gpytorch.distributions import MultivariateNormal
from gpytorch.kernels import Kernel
from gpytorch.likelihoods import GaussianLikelihood
from gpytorch.models import ExactGP
from gpytorch.utils.warnings import NumericalWarning
from linear_operator import to_dense
from linear_operator.operators import LinearOperator
from torch import Tensor

from gpsd._internal.module_state import ModuleState
from gpsd._internal.teacher import validate_teacher
from gpsd._internal.validation import as_float_tensor, check_finite, check_matrix, check_vector
from gpsd.linalg import (
    ChunkedKernelOperator,
    KernelSpectrum,
    ShiftedCG,
    ShiftedCholesky,
    choose_backend,
    free_memory_bytes,
)
from gpsd._internal.negligible import drop_negligible

#: Lanczos rank whose Ritz pairs deflate the CG backend, unless ``rank`` is given.
CG_DEFLATION_RANK = 256
#: Largest rank Lanczos grows to without a ``rank=``: there ``backend="auto"`` switches to
#: deflated CG, and ``backend="lanczos"`` stops (its accuracy check then warns or raises).
MAX_GROWN_RANK = 1024
#: Test inputs are predicted in chunks of this many points, bounding the N x M cross-covariance.
TEST_CHUNK_SIZE = 4096
#: Fraction of the device's free memory that the matrix-free backends fill with kernel rows kept
#: between products, unless ``kernel_cache_bytes`` is given.
KERNEL_CACHE_FRACTION = 0.5
#: Products with the row-chunked operator before it keeps rows: block Lanczos resolves a smooth
#: kernel in three, and holding K then costs more than it saves (on the 2-core CPU at N = 32,768:
#: 22 s for the three products with every row kept, 19 s without, and 13 GiB against 1 GiB).
KEEP_ROWS_AFTER = 3
#: N-vectors a prediction keeps free memory for beside the kept rows: about 8 blocks of
#: TEST_CHUNK_SIZE columns (a CG solve's iterates and products) and 4 row chunks of 2048 (a
#: kernel evaluation's temporaries).
_WORKING_COLUMNS = 8 * TEST_CHUNK_SIZE + 4 * 2048


class RegressionPath(NamedTuple):
    """Predictions for every distillation step at once.

    ``mean`` and ``variance`` have shape ``(*batch, T, M)``: one row per step ``t = 1..T``.
    ``covariance`` (``(*batch, T, M, M)``) is present only when asked for.
    """

    mean: Tensor
    variance: Tensor
    covariance: Tensor | None = None


def validate_gamma(gamma: object, like: Tensor, name: str = "gamma") -> Tensor:
    """A noise schedule as a tensor of shape ``(*s, T)``, strictly positive and finite."""
    gamma = as_float_tensor(gamma, name, dtype=like.dtype, device=like.device)
    if gamma.dim() == 0:
        gamma = gamma.reshape(1)
    if gamma.numel() == 0:
        raise ValueError(f"{name} must hold at least one noise value, got an empty schedule")
    if torch.isnan(gamma).any() or not (gamma > 0).all() or torch.isinf(gamma).any():
        raise ValueError(f"{name} must be strictly positive and finite, got {gamma.tolist()}")
    return gamma


def validate_training_data(train_x: object, train_y: object) -> tuple[Tensor, Tensor]:
    """``train_x`` as ``(*b, N, d)`` and ``train_y`` as ``(*b, N)``, finite, matching N."""
    train_x = as_float_tensor(train_x, "train_x")
    train_y = as_float_tensor(train_y, "train_y", dtype=train_x.dtype, device=train_x.device)
    train_x = check_matrix(train_x, "train_x", nonempty=True)
    train_y = check_vector(train_y, "train_y", n=train_x.shape[-2])
    try:
        torch.broadcast_shapes(train_x.shape[:-2], train_y.shape[:-1])
    except RuntimeError:
        raise ValueError(
            f"the batch shapes of train_x {tuple(train_x.shape)} and train_y "
            f"{tuple(train_y.shape)} must broadcast"
        ) from None
    return train_x, train_y


def validate_test_x(test_x: object, train_x: Tensor) -> Tensor:
    """``test_x`` as ``(*b, M, d)`` on the training data's device with matching ``d``."""
    if isinstance(test_x, Tensor) and test_x.device != train_x.device:
        raise ValueError(
            f"test_x is on {test_x.device} but the training data is on {train_x.device}; "
            "move them to the same device"
        )
    test_x = as_float_tensor(test_x, "test_x", dtype=train_x.dtype, device=train_x.device)
    if test_x.dim() == 1 and train_x.shape[-1] == 1:
        test_x = test_x.unsqueeze(-1)
    if test_x.dim() < 2 or test_x.shape[-1] != train_x.shape[-1]:
        raise ValueError(
            f"test_x must have shape (*batch, M, {train_x.shape[-1]}) to match train_x, "
            f"got {tuple(test_x.shape)}"
        )
    return check_finite(test_x, "test_x")


def unpack_teacher(teacher: ExactGP) -> tuple[Tensor, Tensor, Tensor]:
    """``(train_x, train_y, noise)`` of a trained GPyTorch ``ExactGP`` with a Gaussian likelihood."""
    validate_teacher(
        teacher, GaussianLikelihood, "a gpytorch.likelihoods.GaussianLikelihood (homoskedastic)"
    )
    noise = teacher.likelihood.noise.detach().squeeze(-1)
    return teacher.train_inputs[0], teacher.train_targets, noise


def make_engine(
    kernel: Kernel,
    x: Tensor,
    backend: str,
    schedule_shape: torch.Size,
    num_steps: int,
    eig_dtype: torch.dtype | None,
    rank: int | None,
    generator_seed: int,
    gamma_min: float,
    rtol: float,
    kernel_cache_bytes: int | None = None,
):
    """The backend object for a kernel: a :class:`KernelSpectrum`, :class:`ShiftedCholesky` or
    :class:`ShiftedCG`.

    The Lanczos and CG backends never form the kernel matrix: a KeOps kernel's own operator or a
    :class:`~gpsd.linalg.ChunkedKernelOperator` supplies the products; the latter keeps the kernel
    rows it evaluates within ``kernel_cache_bytes`` (default: :data:`KERNEL_CACHE_FRACTION` of the
    device's free memory), so that later products read them instead of evaluating the kernel
    again. Ritz pairs count as
    resolved when their residual is below ``0.1 * rtol * gamma_min``, and the trace bound on the
    complement norm is taken without power iterations when it is below ``0.5 * rtol * gamma_min``
    (both then keep the error estimate under ``rtol``); without a ``rank`` the Krylov basis is
    extended block by block (an eighth of the largest rank per block, at most 64 columns) until
    the error estimate for the smallest shift ``gamma_min`` is below ``rtol``, up to
    :data:`MAX_GROWN_RANK` (a basis of N columns would cost more than the dense decomposition it
    avoids). The CG backend deflates the Ritz pairs of a rank-``rank`` (default
    :data:`CG_DEFLATION_RANK`) Lanczos run and solves to relative residual ``rtol``.

    ``backend="auto"`` takes :func:`~gpsd.linalg.choose_backend`'s choice; where that is the dense
    eigendecomposition and no gradient is needed, it first grows Lanczos on the formed matrix up
    to rank ``N / 4`` (a smooth kernel's fast-decaying spectrum makes that far cheaper than
    ``eigh``; a failed attempt costs products with an N x N matrix and Rayleigh-Ritz steps of
    about N³ / 2 flops of matrix products, a few per cent of an ``eigh``) and falls back to
    the dense decomposition if that rank does not reach ``rtol``, or as soon as half of it shows
    that it cannot (:func:`_out_of_reach`). Beyond the size
    of a dense decomposition, or where it would not fit in the device's free memory, it grows
    Lanczos up to :data:`MAX_GROWN_RANK` and, if that does not reach ``rtol``, solves by CG
    deflated with the Ritz pairs it found.
    """
    n = x.shape[-2]

    def lanczos(operator, r: int, stop_when=None) -> KernelSpectrum:
        return KernelSpectrum.from_lanczos(
            operator,
            rank=r,
            residual_tol=0.1 * rtol * gamma_min,
            complement_tol=0.5 * rtol * gamma_min,
            dtype=eig_dtype or x.dtype,
            generator=torch.Generator().manual_seed(generator_seed),
            stop_when=stop_when,
        )

    def grow_lanczos(operator, max_rank: int, give_up_early: bool = False) -> KernelSpectrum:
        def stop(spectrum: KernelSpectrum) -> bool:
            if spectrum.meets(gamma_min, rtol, allow_power=False):
                return True
            return give_up_early and _out_of_reach(spectrum, max_rank, gamma_min, rtol)

        return lanczos(operator, max_rank, stop)

    if backend in ("lanczos", "cg"):
        operator = _matrix_free(kernel, x, eig_dtype, kernel_cache_bytes)
        try:
            if backend == "lanczos":
                if rank is not None:
                    return lanczos(operator, rank)
                return grow_lanczos(operator, min(n, MAX_GROWN_RANK))
            spectrum = lanczos(operator, rank if rank is not None else min(n, CG_DEFLATION_RANK))
            return ShiftedCG.from_spectrum(operator, spectrum, tol=rtol)
        except torch.OutOfMemoryError as err:
            raise MemoryError(
                f"backend={backend!r} ran out of memory holding an {n}-row Krylov basis on "
                f"{x.device}; pass a smaller rank= (now {rank}) or kernel_cache_bytes=, or a "
                "KeOps kernel"
            ) from err
    needs_grad = needs_graph(kernel, x)
    try_lanczos_first = False
    if backend == "auto":
        # a kernel with a batch shape makes a batch of matrices from shared inputs too
        matrix_shape = torch.broadcast_shapes(x.shape[:-2], kernel.batch_shape)
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
        )
        try_lanczos_first = backend == "dense" and not needs_grad
    # K is evaluated in the factorisation's dtype, as the matrix-free backends do; with a graph
    # to keep, through differentiable casts of the parameters (a copy would cut the graph).
    dense_kernel, dense_x = kernel_in_dtype(kernel, x, eig_dtype, keep_graph=needs_grad)
    try:
        if backend == "cholesky":
            return ShiftedCholesky(dense_kernel(dense_x), dtype=eig_dtype)
        if backend == "lanczos":  # chosen by choose_backend: no dense matrix (N or memory)
            operator = _matrix_free(kernel, x, eig_dtype, kernel_cache_bytes)
            spectrum = grow_lanczos(operator, min(n, MAX_GROWN_RANK))
            if spectrum.meets(gamma_min, rtol):
                return spectrum
            return ShiftedCG.from_spectrum(operator, spectrum, tol=rtol)
        # The matrix fits: evaluate it once, for the Lanczos attempt and the fallback alike.
        dense = dense_kernel(dense_x).to_dense()
        dense = dense if eig_dtype is None else dense.to(eig_dtype)
        if try_lanczos_first:
            dense = drop_negligible(dense, inplace=not dense.requires_grad)  # Krylov products
            spectrum = grow_lanczos(dense, rank or max(1, n // 4), give_up_early=True)
            if spectrum.meets(gamma_min, rtol):
                return spectrum
        return KernelSpectrum.from_dense(dense, dtype=eig_dtype)
    except torch.OutOfMemoryError as err:
        raise MemoryError(
            f"backend={backend!r} ran out of memory factoring the {n} x {n} kernel matrix on "
            f"{x.device}; use backend='lanczos' or backend='cg', which never form it"
        ) from err


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
    kernel: Kernel, x: Tensor, dtype: torch.dtype | None, cache_bytes: int | None
) -> Tensor | LinearOperator:
    """The kernel matrix as an operator that is never formed whole (KeOps, or row chunks of which
    those that fit in ``cache_bytes`` are kept between products; ``None``:
    :data:`KERNEL_CACHE_FRACTION` of the device's free memory, less where the rest would not
    hold a prediction's working set of :data:`_WORKING_COLUMNS` N-vectors).

    The products run in ``dtype`` (the factorisation's), so that the Krylov products, the Ritz
    residuals and the CG residuals reach that precision even for float32 data; the kernel is
    copied into ``dtype`` for that (these backends keep no graph).
    """
    kernel, x = kernel_in_dtype(kernel, x, dtype)
    is_keops = any(
        type(m).__module__.startswith("gpytorch.kernels.keops") for m in kernel.modules()
    )
    if is_keops:
        return kernel(x)
    if cache_bytes is None:
        cache_bytes = _default_cache_bytes(x)
    return ChunkedKernelOperator(
        x, kernel=kernel, cache_bytes=cache_bytes, keep_after=KEEP_ROWS_AFTER
    )


def _default_cache_bytes(x: Tensor) -> int:
    """Bytes of kernel rows to keep for the inputs ``x`` (``(*batch, N, d)``, in the dtype of the
    products): :data:`KERNEL_CACHE_FRACTION` of the free memory, less where the rest would not
    hold a prediction's working set. Where that cannot hold every row, the memory of models no
    longer referenced is collected first (:func:`~gpsd.linalg.free_memory_bytes`)."""
    itemsize = torch.finfo(x.dtype).bits // 8
    vectors = x.shape[:-1].numel()  # batch x N
    every_row = vectors * x.shape[-2] * itemsize
    free = free_memory_bytes(x.device, wanted=math.ceil(every_row / KERNEL_CACHE_FRACTION))
    working = _WORKING_COLUMNS * vectors * itemsize
    return max(0, int(min(KERNEL_CACHE_FRACTION * free, free - working)))


def needs_graph(kernel: Kernel, x: Tensor) -> bool:
    """Whether kernel matrices of ``kernel`` at ``x`` would carry an autograd graph now."""
    return torch.is_grad_enabled() and (
        x.requires_grad or any(p.requires_grad for p in kernel.parameters())
    )


def kernel_in_dtype(
    kernel: Kernel, x: Tensor, dtype: torch.dtype | None, keep_graph: bool = False
) -> tuple[Callable[..., Tensor], Tensor]:
    """``kernel`` and ``x`` in ``dtype`` (``None``: unchanged). Every parameter and buffer must
    match the inputs' dtype (mixed dtypes fail in some GPyTorch kernels, e.g.
    ``PolynomialKernel``): without ``keep_graph`` the kernel is a copy in ``dtype``, which
    carries no graph to the original; with it, a :class:`GraphKernelInDtype`."""
    if dtype is None or dtype == x.dtype:
        return kernel, x
    if keep_graph:
        return GraphKernelInDtype(kernel, dtype), x.to(dtype)
    return copy.deepcopy(kernel).to(dtype), x.to(dtype)


#: above this estimate of the relative error (:func:`warn_low_precision_factorisation`) a
#: factorisation in a low-precision dtype warns
LOW_PRECISION_WARNING = 0.1


def warn_low_precision_factorisation(
    kernel: Kernel, x: Tensor, dtype: torch.dtype, gamma_min: float, stacklevel: int = 4
) -> None:
    r"""Warn with a ``NumericalWarning`` where factoring :math:`\mathbf K + \gamma\mathbf I` in
    ``dtype`` may cost the predictions their accuracy.

    Rounding :math:`\mathbf K` and the solves to the dtype's precision :math:`\epsilon` perturbs
    the solutions by up to about :math:`\epsilon\,\lambda_{\max}/\gamma_{\min}` relative;
    :math:`\lambda_{\max} \le \operatorname{tr}\mathbf K` (a diagonal evaluation) bounds it.
    Variances :math:`k_{**} - \mathbf k_*^\top(\mathbf K + \gamma\mathbf I)^{-1}\mathbf k_*`
    cancel on top of that where the data pin the posterior, so they can be worse than the
    estimate (11 % at an estimate of 0.06: 2000 points, lengthscale 0.2, noise 4e-3), while
    the means are within it.
    Checked where :math:`\epsilon > 10^{-10}` (float32, half precision): float32 data with
    ``linalg_dtype=None``, whose predictions were 15-21 % off at :math:`\gamma = 10^{-6}`,
    :math:`N = 40`, without a word.
    """
    eps = torch.finfo(dtype).eps
    if eps <= 1e-10:
        return
    with torch.no_grad():
        trace = float(to_dense(kernel(x, diag=True)).sum(-1).max())
    estimate = eps * trace / gamma_min
    if estimate > LOW_PRECISION_WARNING:
        warnings.warn(
            f"the kernel matrix is factored in {dtype} with a smallest noise of {gamma_min:.3g} "
            f"against a trace of {trace:.3g}: solves may be off by up to about "
            f"{min(estimate, 1.0):.2g} relative (eps * tr K / noise), and the variances, "
            "differences of nearly equal terms where the data pin the posterior, by more; use "
            "linalg_dtype=torch.float64",
            NumericalWarning,
            stacklevel=stacklevel,
        )


class GraphKernelInDtype:
    """``kernel`` evaluated in ``dtype`` with its autograd graph kept: every floating-point
    parameter and buffer is replaced, for the call only, by a differentiable cast, so that
    float32 hyperparameters give float64 kernel matrices whose gradients reach them.

    Called as a kernel (``(x1, x2=None, diag=False)``), it returns dense tensors, evaluated while
    the casts are in place. Each module is visited once and a tensor shared by several entries
    gets one cast (``torch.func.functional_call`` would swap a submodule used twice twice, and
    leave the cast in place of the parameter); buffers the kernel creates during the call (the
    random weights of ``RFFKernel``, say) are returned to the kernel's own dtype.
    """

    def __init__(self, kernel: Kernel, dtype: torch.dtype) -> None:
        self.kernel = kernel
        self.dtype = dtype

    def __call__(self, x1: Tensor, x2: Tensor | None = None, diag: bool = False) -> Tensor:
        modules = list(self.kernel.modules())  # each module once
        before = {(id(module), name) for module in modules for name in module._buffers}
        casts: dict[int, Tensor] = {}
        swapped: list[tuple[dict, str, Tensor]] = []
        own_dtype = None
        try:
            for module in modules:
                for store in (module._parameters, module._buffers):
                    for name, value in list(store.items()):
                        if value is None or not value.is_floating_point():
                            continue
                        own_dtype = own_dtype or value.dtype
                        if value.dtype != self.dtype:
                            swapped.append((store, name, value))
                            store[name] = casts.setdefault(id(value), value.to(self.dtype))
            x1 = x1.to(self.dtype)
            x2 = x1 if x2 is None else x2.to(self.dtype)
            return to_dense(self.kernel(x1, x2, diag=diag))
        finally:
            for store, name, value in reversed(swapped):
                store[name] = value
            for module in self.kernel.modules():
                for name, value in list(module._buffers.items()):
                    new = (id(module), name) not in before
                    if new and own_dtype and value is not None and value.is_floating_point():
                        module._buffers[name] = value.to(own_dtype)


class StateSnapshot:
    """A module's state (:class:`~gpsd._internal.module_state.ModuleState`), its settings (``config``:
    anything else the cache depends on, such as the backend) and the grad mode at one moment:
    the distillers rebuild their cached factorisation when any of them has changed."""

    def __init__(self, module: gpytorch.Module, config: tuple) -> None:
        self.grad_enabled = torch.is_grad_enabled()
        #: whether the grad mode matters: ``False`` for an engine that never builds a graph (the
        #: matrix-free backends), whose factorisation serves both modes
        self.grad_matters = True
        self.config = config
        self.state = ModuleState(module)

    def matches(self, module: gpytorch.Module, config: tuple) -> bool:
        return (
            (not self.grad_matters or self.grad_enabled == torch.is_grad_enabled())
            and self.config == config
            and self.state.matches(module)
        )


class BackwardWatch:
    """Notes when a backward pass reaches any of the watched tensors.

    A cached factorisation that carries an autograd graph can serve one backward pass only (the
    pass frees the graph's saved tensors), so the distillers rebuild it once :attr:`reached` is
    set. The hooks hold this small object alone, not the cache, so no reference cycle runs
    through the autograd graph.
    """

    def __init__(self) -> None:
        self.reached = False

    def _hook(self, grad: Tensor) -> None:
        self.reached = True

    def watch(self, *objects: object) -> None:
        """Hook every tensor that carries a graph among ``objects`` and their attributes."""
        for obj in objects:
            values = vars(obj).values() if not isinstance(obj, Tensor) else (obj,)
            for value in values:
                if isinstance(value, Tensor) and value.requires_grad:
                    value.register_hook(self._hook)


def student_likelihood(noise: Tensor, like: Tensor) -> GaussianLikelihood:
    """A ``GaussianLikelihood`` with the noise variances ``noise`` (shape ``(*b,)``, its batch
    shape), in ``like``'s dtype.

    Its noise constraint is GPyTorch's default lower bound of 1e-4, lowered to half of the
    smallest noise where that is smaller (the students of small or many-step schedules need less).
    """
    noise = noise.detach().to(like)
    bound = min(1e-4, 0.5 * float(noise.min()))
    likelihood = GaussianLikelihood(noise_constraint=GreaterThan(bound), batch_shape=noise.shape)
    likelihood = likelihood.to(like)
    likelihood.noise = noise.unsqueeze(-1)
    return likelihood


def student_batch(
    train_x: Tensor, train_y: Tensor, mean_module: gpytorch.Module, kernel: gpytorch.Module
) -> torch.Size:
    """The broadcast batch shape of the training inputs, targets, prior mean and kernel."""
    with torch.no_grad():
        mean_batch = mean_module(train_x).shape[:-1]
    return torch.broadcast_shapes(
        train_x.shape[:-2], train_y.shape[:-1], mean_batch, getattr(kernel, "batch_shape", ())
    )


def student_gp(
    train_x: Tensor,
    targets: Tensor,
    noise: Tensor,
    mean_module: gpytorch.Module,
    kernel: gpytorch.Module,
) -> ExactGPFromModules:
    """The student ``ExactGP`` (in evaluation mode) of copies of ``mean_module`` and ``kernel``.

    ``targets`` ``(*b, N)`` and ``noise`` ``(*s,)`` may be batched: the student's batch is the
    broadcast of theirs, the inputs', the prior mean's and the kernel's, as the distiller pairs
    them, and its ``GaussianLikelihood`` holds one noise per member.
    """
    mean_module = copy.deepcopy(mean_module)
    kernel = copy.deepcopy(kernel)
    train_x, targets = batched_gp_data(train_x, targets, mean_module)
    batch = torch.broadcast_shapes(targets.shape[:-1], noise.shape, kernel.batch_shape)
    train_x = train_x.expand(*batch, *train_x.shape[-2:])
    targets = targets.expand(*batch, targets.shape[-1])
    likelihood = student_likelihood(noise.expand(batch), train_x)
    return ExactGPFromModules(train_x, targets, likelihood, mean_module, kernel).eval()


def schedule_index(
    gamma: Tensor, schedule: object, student_batch: torch.Size | None = None
) -> tuple[int, ...]:
    """``schedule`` checked as an index of one schedule in the batch ``gamma.shape[:-1]``.

    For a student (``student_batch`` given: the batch of its data, prior mean and kernel, see
    :func:`student_batch`), ``()`` takes the whole batch, and an index is refused where that
    batch is not empty (a schedule of a batch pairs with it by broadcasting, so one schedule
    alone has no targets, mean or kernel of its own).
    """
    batch = gamma.shape[:-1]
    if student_batch is not None and isinstance(schedule, tuple) and not schedule:
        return ()  # a student of the whole batch
    try:  # integer types as check_int takes them (NumPy's, 0-d integer tensors), bool not
        items = schedule if isinstance(schedule, tuple) else (schedule,)
        if any(isinstance(i, bool) for i in items):
            raise TypeError
        schedule = tuple(operator.index(i) for i in items)
    except TypeError:
        raise TypeError(f"schedule must be an int or a tuple of ints, got {schedule!r}") from None
    if not batch:
        if schedule:
            raise ValueError(f"schedule must be () for a single schedule, got {schedule}")
        return ()
    if student_batch:
        raise ValueError(
            "a student of one schedule of a batch of schedules needs unbatched training data, "
            f"kernel and prior mean; got gamma of shape {tuple(gamma.shape)} and a batch of "
            f"shape {tuple(student_batch)} of these (take the student of the whole batch with "
            "schedule=(), or build a distiller with that schedule alone)"
        )
    if len(schedule) != len(batch) or not all(
        -n <= i < n for i, n in zip(schedule, batch, strict=False)
    ):
        raise ValueError(
            f"schedule must index one schedule of the batch of shape {tuple(batch)} "
            f"(gamma has shape {tuple(gamma.shape)}), got {schedule or '()'}"
        )
    return schedule


def pair_batches(outer_product: Tensor, outer: torch.Size, inner: torch.Size) -> Tensor:
    """Broadcast two batch shapes that an outer product kept apart.

    ``outer_product`` has shape ``(*outer, *inner, *tail)``; the result has shape
    ``(*broadcast(outer, inner), *tail)``, its entry at a batch index taking the ``outer`` and
    ``inner`` entries that broadcasting pairs (dimensions aligned from the right, size-1
    dimensions repeated).
    """
    tail = outer_product.shape[len(outer) + len(inner) :]
    ndim = max(len(outer), len(inner))
    outer = torch.Size([1] * (ndim - len(outer))) + outer
    inner = torch.Size([1] * (ndim - len(inner))) + inner
    batch = torch.broadcast_shapes(outer, inner)
    padded = outer_product.reshape(*outer, *inner, *tail)
    index = []
    for sizes in (outer, inner):
        for k, size in enumerate(sizes):
            shape = [1] * ndim
            shape[k] = batch[k]
            positions = torch.arange(batch[k], device=outer_product.device)
            index.append((positions if size > 1 else 0 * positions).reshape(shape))
    return padded[tuple(index)]  # shape: (*batch, *tail)


def batched_gp_data(
    train_x: Tensor, train_y: Tensor, mean_module: gpytorch.Module
) -> tuple[Tensor, Tensor]:
    """``train_x`` ``(*b, N, d)`` and ``train_y`` ``(*b, N)`` expanded (views) to one batch.

    ``b`` broadcasts the batches of the inputs, the targets and the prior mean at the inputs: a
    GPyTorch ``ExactGP`` cannot predict from unbatched inputs next to a batch of targets or a
    batched mean (a shape error), so the students and the iterated models get batched inputs.
    A kernel's own batch needs no expansion (GPyTorch broadcasts it).
    """
    with torch.no_grad():
        mean_batch = mean_module(train_x).shape[:-1]
    batch = torch.broadcast_shapes(train_x.shape[:-2], train_y.shape[:-1], mean_batch)
    return train_x.expand(*batch, *train_x.shape[-2:]), train_y.expand(*batch, train_y.shape[-1])


class ExactGPFromModules(ExactGP):
    """An ordinary GPyTorch exact GP assembled from a mean and a kernel module.

    The students of the regression distillers are of this class, so that every GPyTorch tool
    (``ExactMarginalLogLikelihood``, ``get_fantasy_model``, ``state_dict``) applies to them.
    """

    def __init__(self, train_x, train_y, likelihood, mean_module, covar_module) -> None:
        super().__init__(train_x, train_y, likelihood)
        self.mean_module = mean_module
        self.covar_module = covar_module

    def forward(self, x: Tensor) -> MultivariateNormal:
        return MultivariateNormal(self.mean_module(x), self.covar_module(x))
