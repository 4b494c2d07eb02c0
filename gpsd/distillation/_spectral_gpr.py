"""The base both regression distillers share: validation, cached factorisation, prediction."""

from __future__ import annotations

import abc
import contextlib

import gpytorch
import torch
from gpytorch.distributions import MultivariateNormal
from gpytorch.kernels import Kernel
from gpytorch.means import Mean, ZeroMean
from gpytorch.models import ExactGP
from linear_operator.operators import DiagLinearOperator
from torch import Tensor

from gpsd import settings
from gpsd._internal.kernel_dtype import kernel_in_dtype, needs_graph
from gpsd._internal.module_state import adopt_buffer_shapes, checked_setting, choice_setting
from gpsd._internal.negligible import kernel_matrix
from gpsd._internal.validation import (
    as_float_tensor,
    check_gp_modules,
    check_int,
    check_positive_float,
    check_same_device,
    replacement_data,
)
from gpsd._internal.variance import nonnegative_variance, warn_if_variance_error_large
from gpsd.distillation._common import (
    BackwardWatch,
    RegressionPath,
    StateSnapshot,
    unpack_teacher,
    validate_gamma,
    validate_test_x,
    validate_training_data,
    warn_low_precision_factorisation,
)
from gpsd.linalg import BACKENDS, SpectralFilter, make_engine


def autograd_context(state: dict):
    """``torch.no_grad()`` where the cached engine carries no autograd graph (the matrix-free
    backends): their results then carry none at all, rather than a partial graph through the
    cross-covariance or the prior mean alone, which would give wrong gradients.

    The state is read once, outside the context, so that switching the grad mode does not make
    the cache look stale.
    """
    return contextlib.nullcontext() if state["engine"].supports_autograd else torch.no_grad()


def _check_linalg_dtype(value: object) -> torch.dtype | None:
    """``None`` or a floating-point ``torch.dtype``, or a ``TypeError`` naming ``linalg_dtype``."""
    if value is None or (isinstance(value, torch.dtype) and value.is_floating_point):
        return value
    raise TypeError(
        f"linalg_dtype must be a floating-point torch.dtype (e.g. torch.float64) or None, "
        f"got {value!r}"
    )


class SpectralGPR(gpytorch.Module, abc.ABC):
    """A GP regressor whose predictions for every distillation step are spectral filters of K.

    Subclasses say which filters give the predictive mean (:meth:`_mean_filter`) and the
    posterior variance reduction (:meth:`_variance_filter`), and the smallest shift those filters
    use (:meth:`_smallest_shift`).
    """

    def __init__(
        self,
        kernel: Kernel,
        train_x: Tensor,
        train_y: Tensor,
        gamma: object,
        *,
        mean_module: Mean | None,
        backend: str,
        linalg_dtype: torch.dtype | None,
        rank: int | None,
        rtol: float,
        kernel_cache_bytes: int | None = None,
    ) -> None:
        super().__init__()
        check_gp_modules(kernel, mean_module, "kernel")
        kernel_cache_bytes = check_int(
            kernel_cache_bytes, "kernel_cache_bytes", minimum=0, optional=True
        )
        train_x, train_y = validate_training_data(train_x, train_y)
        self.kernel = kernel
        self.mean_module = mean_module if mean_module is not None else ZeroMean()
        # Detached: a buffer carrying a graph (into a feature extractor, or a learnt schedule)
        # serves one backward pass, after which the rebuilt cache runs into its freed graph, and
        # it cannot be deep-copied. Gradients reach the kernel's and the mean's parameters.
        self.register_buffer("train_x", train_x.detach())
        self.register_buffer("train_y", train_y.detach())
        self.register_buffer("gamma", validate_gamma(gamma, train_x).detach())
        self._check_batches(train_x, train_y)
        self.backend = backend
        self.linalg_dtype = linalg_dtype
        self.rank = rank
        self.rtol = rtol
        self.kernel_cache_bytes = kernel_cache_bytes
        self._cache: dict = {}

    def _check_batches(self, train_x: Tensor, train_y: Tensor) -> None:
        """A ``ValueError`` unless the batches of the schedules, the data and the kernel
        broadcast."""
        try:
            torch.broadcast_shapes(
                self.gamma.shape[:-1],
                train_x.shape[:-2],
                train_y.shape[:-1],
                self.kernel.batch_shape,
            )
        except RuntimeError:
            raise ValueError(
                f"the batch of schedules (gamma of shape {tuple(self.gamma.shape)}) must "
                f"broadcast with the batch of the training data (train_x of shape "
                f"{tuple(train_x.shape)}, train_y of shape {tuple(train_y.shape)}) and of the "
                f"kernel (batch shape {tuple(self.kernel.batch_shape)})"
            ) from None

    def set_train_data(
        self, inputs: Tensor | None = None, targets: Tensor | None = None, strict: bool = True
    ) -> None:
        """Replace the training inputs, targets or both (GPyTorch's ``ExactGP`` convention).

        They are checked as at construction. With ``strict`` (the default, as in GPyTorch) they
        must have the current shape, dtype and device; with ``strict=False`` the number of points
        and the batch shape may change (within what broadcasts with ``gamma`` and the kernel) and
        they are converted to the model's dtype (they must still be on its device). The next
        prediction refactors.

        :param inputs: New training inputs ``(*b, N, d)`` or ``(N,)`` (or a one-element tuple of
            them); ``None`` keeps the current.
        :param targets: New targets ``(*b, N)``; ``None`` keeps the current.
        :param strict: Refuse a new shape, dtype or device.
        """
        x, y = replacement_data(inputs, targets, self.train_x, self.train_y, strict)
        like = {"dtype": self.train_x.dtype}
        x, y = as_float_tensor(x, "train_x", **like), as_float_tensor(y, "train_y", **like)
        x, y = validate_training_data(x, y)
        check_same_device(self.train_x, x, "train_x", "the model")
        self._check_batches(x, y)
        self.train_x, self.train_y = x.detach(), y.detach()

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # data of another N (``set_train_data``) load into a model built on the old ones
        adopt_buffer_shapes(self, state_dict, prefix, ("train_x", "train_y"))
        return super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def __getstate__(self) -> dict:
        """The module's state without the cached factorisation, which ``copy.deepcopy`` and
        ``pickle`` cannot take while it holds an autograd graph; the copy rebuilds it on use."""
        state = super().__getstate__()
        return {**state, "_cache": {}}

    backend = choice_setting(
        "backend", BACKENDS, "The linear-algebra backend (one of :data:`~gpsd.linalg.BACKENDS`)."
    )
    linalg_dtype = checked_setting(
        "linalg_dtype",
        _check_linalg_dtype,
        "The dtype of the factorisation (``None``: the data's).",
    )
    rank = checked_setting(
        "rank",
        lambda value: check_int(value, "rank", optional=True),
        "The Lanczos rank (``None``: grown until the error estimate meets ``rtol``).",
    )
    rtol = checked_setting(
        "rtol",
        lambda value: check_positive_float(value, "rtol"),
        "The relative tolerance of the matrix-free backends.",
    )

    @classmethod
    def from_teacher(
        cls, teacher: ExactGP, gamma: object = None, num_steps: int | None = None, **kwargs
    ):
        """Distil a trained ``ExactGP`` teacher with a ``GaussianLikelihood``.

        The teacher's mean and kernel modules are shared, not copied. ``gamma`` defaults to the
        teacher's noise repeated ``num_steps`` times (so the teacher itself is step 1); with both
        given, ``num_steps`` must be the length of ``gamma``.
        """
        train_x, train_y, noise = unpack_teacher(teacher)
        num_steps = check_int(num_steps, "num_steps", optional=True)
        if gamma is not None and num_steps is not None:
            steps = validate_gamma(gamma, train_x).shape[-1]
            if steps != num_steps:
                raise ValueError(
                    f"num_steps={num_steps} does not match the {steps} steps of gamma; "
                    "give one of them"
                )
        if gamma is None:
            if num_steps is None:
                raise ValueError("give gamma, or num_steps >= 1 to repeat the teacher's noise")
            # shape: (*b, T): a batched teacher's noise per member of its batch
            gamma = noise.unsqueeze(-1).expand(*noise.shape, num_steps).clone()
        return cls(
            teacher.covar_module, train_x, train_y, gamma, mean_module=teacher.mean_module, **kwargs
        )

    @property
    def num_steps(self) -> int:
        """:math:`T`, the number of steps of every schedule."""
        return self.gamma.shape[-1]

    # ------------------------------------------------------------------ for subclasses
    @abc.abstractmethod
    def _smallest_shift(self) -> float:
        """The smallest noise any filter of the model uses (sets the Lanczos accuracy)."""

    @abc.abstractmethod
    def _mean_filter(self) -> SpectralFilter:
        """:math:`G_t` with :math:`\\mu_{t,*} = m_* + \\mathbf K_{*X} G_t(\\mathbf K)(\\mathbf y - m)`."""

    @abc.abstractmethod
    def _variance_filter(self) -> SpectralFilter:
        """:math:`R_t` with :math:`\\Sigma_{t,*} = \\mathbf K_{**} - \\mathbf K_{*X} R_t(\\mathbf K)\\mathbf K_{X*}`."""

    def _schedule(self, gamma: Tensor) -> Tensor:
        """A schedule in the factorisation's dtype."""
        return gamma.to(self.linalg_dtype or gamma.dtype)

    # ------------------------------------------------------------------ cached factorisation
    def _state(self) -> dict:
        """The backend engine and the targets' coordinates, recomputed when the state changes."""
        snapshot = self._cache.get("snapshot")
        config = self._config()
        if (
            snapshot is None
            or not snapshot.matches(self, config)
            or self._cache["backward"].reached
        ):
            self._cache = {"snapshot": StateSnapshot(self, config), "backward": BackwardWatch()}
            prior_mean = self.mean_module(self.train_x)
            warn_low_precision_factorisation(  # before a factorisation that it may explain fails
                self.kernel,
                self.train_x,
                self.linalg_dtype or self.train_x.dtype,
                self._smallest_shift(),
            )
            engine = make_engine(
                self.kernel,
                self.train_x,
                self.backend,
                self.gamma.shape[:-1],
                self.num_steps,
                self.linalg_dtype,
                self.rank,
                generator_seed=0,
                gamma_min=self._smallest_shift(),
                rtol=self.rtol,
                kernel_cache_bytes=self.kernel_cache_bytes,
            )
            engine.check_accuracy(self._smallest_shift(), self.rtol)
            # a matrix-free backend builds no graph: the grad mode need not rebuild it (with
            # backend="auto" the grad mode chooses the engine, so it always matters)
            matrix_free = self.backend in ("lanczos", "cg")
            self._cache["snapshot"].grad_matters = engine.supports_autograd or not matrix_free
            centred = (self.train_y - prior_mean).unsqueeze(-1)  # shape: (*b, N, 1)
            needs_grad = engine.supports_autograd and needs_graph(self.kernel, self.train_x)
            self._cache.update(
                engine=engine,
                # Test covariances in the factorisation's dtype: the variance k** - k*^T R k*
                # cancels, and float32 entries of k* cost up to ~1e-3.
                test_kernel=kernel_in_dtype(
                    self.kernel, self.train_x, self.linalg_dtype, keep_graph=needs_grad
                ),
                prior_mean=prior_mean,
                centred=centred,
                coords=engine.project(centred) if hasattr(engine, "project") else centred,
            )
            # A backward pass through the cached graph frees it: rebuild after one.
            self._cache["backward"].watch(engine, prior_mean)
        return self._cache

    def _config(self) -> tuple:
        """The settings the cached factorisation depends on besides the module's state."""
        return (self.backend, self.linalg_dtype, self.rank, self.rtol, self.kernel_cache_bytes)

    @property
    def error_estimate(self) -> float:
        """Estimated relative truncation error of the backend (0 for the direct dense and Cholesky
        ones). Rounding is not counted: it costs every backend a relative error of up to about
        ``eps * (lambda_max + noise) / noise``, ``eps`` the unit roundoff of the solves' dtype."""
        return self._state()["engine"].error_estimate(self._smallest_shift())

    # ------------------------------------------------------------------ prediction
    def predict(self, test_x: Tensor, full_cov: bool = False) -> RegressionPath:
        r"""Predictive means and variances of every step at ``test_x`` (shape ``(*b, M, d)``).

        Returns a :class:`~gpsd.distillation.RegressionPath` with ``mean`` and ``variance`` of shape
        ``(*batch, T, M)``; with ``full_cov=True`` also the ``(*batch, T, M, M)`` covariances.
        ``batch`` includes a batch of targets or of prior means; the variances and covariances,
        which depend on neither, are expanded over it (views: clone before writing in place).
        Without ``full_cov`` the test points are processed in chunks of
        :class:`gpsd.settings.test_chunk_size`, so memory stays at ``N x test_chunk_size``.
        """
        test_x = validate_test_x(test_x, self.train_x)
        chunk = settings.test_chunk_size.value()
        if full_cov or test_x.shape[-2] <= chunk:
            return self._predict_chunk(test_x, full_cov)
        parts = []
        for i in range(0, test_x.shape[-2], chunk):  # a loop, not a comprehension:
            # warnings point past predict (stacklevel) on every Python version
            parts.append(self._predict_chunk(test_x[..., i : i + chunk, :], False))
        return RegressionPath(
            torch.cat([p.mean for p in parts], dim=-1),
            torch.cat([p.variance for p in parts], dim=-1),
        )

    def _mean_weights(self, state: dict) -> Tensor:
        r""":math:`G_t(\mathbf K)(\mathbf y - m)` for every step, ``(*, T, N, 1)``, computed once."""
        if "mean_weights" not in state:
            state["mean_weights"] = state["engine"].apply(self._mean_filter(), state["coords"])
        return state["mean_weights"]

    def predict_mean(self, test_x: Tensor) -> Tensor:
        """Predictive means of every step at ``test_x``, shape ``(*batch, T, M)``.

        :meth:`predict` without the variances: one product with cached weights per chunk of
        :class:`gpsd.settings.test_chunk_size` test points. With ``backend="cg"`` this skips the variance solves,
        which have one right-hand side per test point.
        """
        test_x = validate_test_x(test_x, self.train_x)
        state = self._state()
        chunk = settings.test_chunk_size.value()
        starts = range(0, max(test_x.shape[-2], 1), chunk)
        with autograd_context(state):
            chunks = [test_x[..., i : i + chunk, :] for i in starts]
            return torch.cat([self._mean_chunk(state, chunk) for chunk in chunks], dim=-1)

    def _mean_chunk(self, state: dict, test_x: Tensor, cross: Tensor | None = None) -> Tensor:
        """Means ``(*, T, M)`` at ``test_x``, given the cross-covariance ``(*b, N, M)`` if known."""
        if cross is None:
            kernel, train_x = state["test_kernel"]
            cross = kernel_matrix(kernel, train_x, test_x.to(train_x.dtype))
        weights = self._mean_weights(state)  # shape: (*, T, N, 1)
        mean = (cross.to(weights).mT.unsqueeze(-3) @ weights).squeeze(-1)  # shape: (*, T, M)
        return mean.to(test_x.dtype) + self.mean_module(test_x).unsqueeze(-2)

    def _predict_chunk(self, test_x: Tensor, full_cov: bool) -> RegressionPath:
        state = self._state()
        engine = state["engine"]
        with autograd_context(state):
            variance_filter = self._variance_filter()
            kernel, train_x = state["test_kernel"]
            test_in = test_x.to(train_x.dtype)
            cross = kernel_matrix(kernel, train_x, test_in)  # shape: (*b, N, M)
            mean = self._mean_chunk(state, test_x, cross)
            prior_var = kernel(test_in, diag=True).unsqueeze(-2)  # shape: (*b, 1, M)
            reduction = engine.quad_diag(variance_filter, cross).to(prior_var)
            variance = nonnegative_variance(prior_var - reduction, prior_var)
            if engine.quad_error_bound is not None:  # the iterative solvers bound their forms
                warn_if_variance_error_large(variance, engine.quad_error_bound, prior_var, 4)
            variance = variance.to(test_x.dtype)
            # The variances do not depend on the targets or the prior mean: expanded (a view)
            # over their batch, so that they index as the means do.
            variance = variance.expand(mean.shape)  # shape: (*batch, T, M)
            covariance = None
            if full_cov:
                prior_cov = kernel(test_in).to_dense().unsqueeze(-3)
                reduction = engine.cross(variance_filter, cross, cross).to(prior_cov)
                covariance = (prior_cov - reduction).to(test_x.dtype)
                covariance = covariance.expand(*mean.shape, mean.shape[-1])  # (*batch, T, M, M)
        return RegressionPath(mean, variance, covariance)

    def forward(self, test_x: Tensor, full_cov: bool = False) -> MultivariateNormal:
        """The latent predictive distributions of all steps: batch shape ``(*batch, T)``."""
        path = self.predict(test_x, full_cov=full_cov)
        if full_cov:
            return MultivariateNormal(path.mean, path.covariance)
        return MultivariateNormal(path.mean, DiagLinearOperator(path.variance))
