"""The base both regression distillers share: validation, cached factorisation, prediction."""

from __future__ import annotations

import abc
import copy
import itertools

import torch
from gpytorch.distributions import MultivariateNormal
from gpytorch.kernels import Kernel
from gpytorch.means import Mean, ZeroMean
from gpytorch.models import ExactGP
from linear_operator.operators import DiagLinearOperator
from torch import Tensor, nn

import gpsd.linalg as linalg
from gpsd import settings
from gpsd._internal.collectives import (
    all_reduce_sum,
    check_group,
    check_same,
    module_fingerprint,
    tensor_fingerprint,
    text_checksum,
)
from gpsd._internal.fitted import FitDependencies, Fitted
from gpsd._internal.kernel_dtype import kernel_in_dtype, needs_graph
from gpsd._internal.module_state import checked_setting, choice_setting
from gpsd._internal.negligible import kernel_matrix
from gpsd._internal.progress_reporter import ProgressReporter
from gpsd._internal.validation import (
    as_float_tensor,
    check_finite,
    check_gp_modules,
    check_int,
    check_positive_float,
    check_same_device,
    replacement_data,
)
from gpsd._internal.variance import nonnegative_variance, warn_if_variance_error_large
from gpsd.distillation._common import (
    unpack_teacher,
    validate_test_x,
    validate_training_data,
    warn_low_precision_factorisation,
)
from gpsd.distillation._spectral_fit import Factorisation, SpectralFit
from gpsd.distillation._step_distiller import NoiseRule, StepDistiller
from gpsd.distillation._teacher_likelihood import (
    dense_log_likelihood,
    log_prior,
    matrix_free_log_likelihood,
    seeded_probes,
)
from gpsd.kernels.chunked_kernel import ChunkedKernel
from gpsd.linalg import BACKENDS, SpectralFilter
from gpsd.linalg.backend import default_cache_bytes, forms_kernel_matrix
from gpsd.linalg.shared_rows import check_same_rows, on_my_rows
from gpsd.prediction import Prediction
from gpsd.progress import Callback


def _tensors(*modules: nn.Module) -> list[Tensor]:
    """The parameters of ``modules``, in order."""
    return [p for m in modules for p in m.parameters()]


def _check_linalg_dtype(value: object) -> torch.dtype | None:
    """``None`` or a floating-point ``torch.dtype``, or a ``TypeError`` naming ``linalg_dtype``."""
    if value is None or (isinstance(value, torch.dtype) and value.is_floating_point):
        return value
    raise TypeError(
        f"linalg_dtype must be a floating-point torch.dtype (e.g. torch.float64) or None, "
        f"got {value!r}"
    )


class SpectralGPR(Fitted, StepDistiller, abc.ABC):
    """A GP regressor whose predictions for every distillation step are spectral filters of K.

    Subclasses say which filters give the predictive mean (:meth:`_mean_filter`), the
    posterior variance reduction (:meth:`_variance_filter`) and the residuals at the training
    inputs (:meth:`_residual_filter`), the smallest shift those filters use
    (:meth:`_smallest_shift`) and the noise of each step (:meth:`_step_noise`).

    The fit (:class:`~gpsd.distillation._spectral_fit.SpectralFit`, by
    :class:`~gpsd._internal.fitted.Fitted`'s lifecycle) depends on the kernel, the prior mean,
    the training data, the schedule, the backend settings and the subclass's settings
    (:meth:`_targets_config`); its part the factorisation of :math:`\\mathbf K` (the engine)
    on the kernel, the training inputs, the backend settings and the smallest shift alone.
    Changing the targets, ``alpha`` or ``method`` therefore reuses the factorisation.
    """

    def __init__(
        self,
        train_x: Tensor,
        train_y: Tensor,
        covar_module: Kernel,
        *,
        noise: object,
        num_steps: int | None,
        mean_module: Mean | None,
        backend: str,
        linalg_dtype: torch.dtype | None,
        rank: int | None,
        rtol: float,
        kernel_cache_bytes: int | None = None,
        process_group: object = None,
    ) -> None:
        super().__init__()
        check_gp_modules(covar_module, mean_module, "covar_module")
        if process_group is not None:
            check_group(process_group)
        kernel_cache_bytes = check_int(
            kernel_cache_bytes, "kernel_cache_bytes", minimum=0, optional=True
        )
        train_x, train_y = validate_training_data(train_x, train_y)
        self.covar_module = covar_module
        self.mean_module = mean_module if mean_module is not None else ZeroMean()
        # Detached: a buffer carrying a graph (into a feature extractor, or a learnt schedule)
        # serves one backward pass, after which the rebuilt cache runs into its freed graph, and
        # it cannot be deep-copied. Gradients reach the kernel's and the mean's parameters.
        self.register_buffer("train_x", train_x.detach())
        self.register_buffer("train_y", train_y.detach())
        self._init_steps(num_steps, noise, train_x)
        self._check_batches(train_x, train_y)
        self.backend = backend
        self.linalg_dtype = linalg_dtype
        self.rank = rank
        self.rtol = rtol
        self.kernel_cache_bytes = kernel_cache_bytes
        #: The ``torch.distributed.ProcessGroup`` whose ranks share the kernel rows of the
        #: matrix-free backends (``None``: this process alone).
        self.process_group = process_group

    _noise_rule = NoiseRule(
        positive=True, why="every step's posterior needs K + noise * I invertible"
    )
    _criteria = {"gcv": ("gcv", False), "validation": ("validation_mse", True)}

    def _check_noise_batch(self) -> None:
        self._check_batches(self.train_x, self.train_y)

    def _check_batches(self, train_x: Tensor, train_y: Tensor) -> None:
        """A ``ValueError`` unless the batches of the schedules, the data and the kernel
        broadcast."""
        try:
            torch.broadcast_shapes(
                self.noise.shape[:-1],
                train_x.shape[:-2],
                train_y.shape[:-1],
                self.covar_module.batch_shape,
            )
        except RuntimeError:
            raise ValueError(
                f"the batch of schedules (noise of shape {tuple(self.noise.shape)}) must "
                f"broadcast with the batch of the training data (train_x of shape "
                f"{tuple(train_x.shape)}, train_y of shape {tuple(train_y.shape)}) and of "
                f"covar_module (batch shape {tuple(self.covar_module.batch_shape)})"
            ) from None

    def set_train_data(
        self, inputs: Tensor | None = None, targets: Tensor | None = None, strict: bool = True
    ) -> None:
        """Replace the training inputs, targets or both (GPyTorch's ``ExactGP`` convention).

        They are checked as at construction. With ``strict`` (the default, as in GPyTorch) they
        must have the current shape, dtype and device; with ``strict=False`` the number of points
        and the batch shape may change (within what broadcasts with ``noise`` and the kernel) and
        they are converted to the model's dtype (they must still be on its device). The next
        prediction refactors (new targets alone reuse the factorisation).

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

    _resizable_buffers = ("train_x", "train_y")

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
        cls, teacher: ExactGP, *, num_steps: int | None = None, noise: object = None, **kwargs
    ):
        """Distil a trained ``ExactGP`` teacher with a ``GaussianLikelihood``.

        The teacher's ``mean_module`` and ``covar_module`` are shared, not copied. ``noise``
        defaults to the teacher's noise repeated ``num_steps`` times (so the teacher itself is
        step 1); with both given, they must agree as in the constructor. A teacher trained with
        a :class:`~gpsd.ChunkedKernel` gives its ``base_kernel`` (the matrix-free backends
        chunk the kernel rows themselves) and, unless ``process_group`` is given, its process
        group.

        :param teacher: a trained ``gpytorch.models.ExactGP`` with a ``GaussianLikelihood``.
        :param num_steps: the number of steps :math:`T`.
        :param noise: the noise schedule :math:`\\gamma_1, \\dots, \\gamma_T` (default: the
            teacher's noise at every step).
        :param kwargs: the other keyword arguments of the constructor.
        """
        return cls._from_teacher(teacher, noise, num_steps=num_steps, **kwargs)

    @classmethod
    def _from_teacher(cls, teacher: ExactGP, noise: object, **kwargs):
        """:meth:`from_teacher` for every family: the teacher checked once, its noise repeated
        over the steps by :meth:`_repeated_teacher_noise` where ``noise`` is ``None``, its
        modules shared and a :class:`~gpsd.ChunkedKernel` unwrapped; ``kwargs`` go to the
        constructor."""
        train_x, train_y, teacher_noise = unpack_teacher(teacher)
        if noise is None:
            noise = cls._repeated_teacher_noise(teacher_noise, kwargs)
        covar_module = teacher.covar_module
        if isinstance(covar_module, ChunkedKernel):
            kwargs.setdefault("process_group", covar_module.process_group)
            covar_module = covar_module.base_kernel
        mean_module = teacher.mean_module
        return cls(train_x, train_y, covar_module, noise=noise, mean_module=mean_module, **kwargs)

    @classmethod
    def _repeated_teacher_noise(cls, teacher_noise: Tensor, options: dict) -> Tensor:
        """The teacher's noise ``(*b,)`` at every step, ``(*b, T)``, for the step keywords in
        ``options`` (the constructor's)."""
        num_steps = check_int(options.get("num_steps"), "num_steps", optional=True)
        if num_steps is None:
            raise ValueError("give noise, or num_steps >= 1 to repeat the teacher's noise")
        # shape: (*b, T): a batched teacher's noise per member of its batch
        return teacher_noise.unsqueeze(-1).expand(*teacher_noise.shape, num_steps).clone()

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

    @abc.abstractmethod
    def _residual_filter(self) -> SpectralFilter:
        """A positive multiple (per step) of :math:`\\mathbf I - \\mathbf S_t`, where
        :math:`\\boldsymbol\\mu_t - m = \\mathbf S_t(\\mathbf y - m)` is step :math:`t`'s fit at
        the training inputs (for :meth:`gcv`, whose ratio the multiple leaves unchanged)."""

    @abc.abstractmethod
    def _step_noise(self) -> Tensor:
        """The observation noise of every step, shape ``(*s, T)`` (``include_noise``)."""

    def _targets_config(self) -> tuple:
        """The subclass's settings that the targets' coordinates depend on."""
        return ()

    def _schedule(self, noise: Tensor) -> Tensor:
        """A schedule in the factorisation's dtype."""
        return noise.to(self.linalg_dtype or noise.dtype)

    # ------------------------------------------------------------------ the fit
    def fit(self, *, progress: object = False, callback: Callback | None = None) -> SpectralGPR:
        """Compute the factorisation and the targets' coordinates now; returns the model.

        The model also fits lazily, on first use, and refits when the fit is stale: when a
        parameter or buffer of ``covar_module`` or ``mean_module``, the training data
        (``set_train_data``) or the schedule (``model.noise = ...``) has another value, shape,
        dtype or device (an optimiser step, a write through ``.data``, ``load_state_dict``,
        ``.to()``), when a setting of the model (``backend``, ``linalg_dtype``, ``rank``,
        ``rtol``, ``kernel_cache_bytes``, ``process_group`` and the family's own: ``alpha``,
        ``method``, ``inner_steps``) or a :mod:`gpsd.settings` value
        that can change a result has changed, when a gradient is needed (gradients enabled and a
        parameter that requires one) and the fit was made without an autograd graph on a backend
        that differentiates, and after a backward pass through the fit's graph. Nothing else
        refits: a fit made under grad mode serves predictions under ``torch.no_grad()`` as it
        is, and copies and pickles of the model refit on first use. New targets, ``alpha`` or
        ``method`` reuse the factorisation. ``fit()`` chooses when the work is done, and
        reports it.

        :param progress: a progress bar for the growth of a Lanczos basis, one iteration per
            block of Krylov vectors (see :mod:`gpsd.progress`); the direct backends do not
            iterate.
        :param callback: called with an :class:`~gpsd.IterationRecord` per block (``info``:
            the rank and the error estimate); returning ``True`` stops the growth, and the
            backend goes on from the basis reached as when Lanczos falls short of ``rtol``.
        """
        return super().fit(progress=progress, callback=callback)

    # ------------------------------------------------------------------ hyperparameters
    def log_marginal_likelihood(self) -> Tensor:
        r"""The teacher's log marginal likelihood, shape ``(*batch,)``: step 1's exact GP, prior
        :math:`\mathcal{GP}(m, k)` and noise :math:`\gamma_1` (the first entry of each
        schedule),

        .. math::
            \log p(\mathbf y \mid \boldsymbol\theta, \gamma_1)
            = -\tfrac12 (\mathbf y - \mathbf m)^\top (\mathbf K + \gamma_1\mathbf I)^{-1}
            (\mathbf y - \mathbf m) - \tfrac12 \log\det(\mathbf K + \gamma_1\mathbf I)
            - \tfrac N2 \log 2\pi ,

        in the factorisation's dtype (``linalg_dtype``). ``backend="dense"`` and ``"cholesky"``
        (and ``"auto"`` where it would pick one of them) factor the formed matrix by Cholesky;
        ``"lanczos"`` and ``"cg"`` never form it: GPyTorch's ``MultivariateNormal.log_prob`` on
        a :class:`~gpsd.linalg.ChunkedKernelOperator` (a
        :class:`~gpsd.linalg.DistributedKernelOperator` with a ``process_group``), by
        preconditioned CG and stochastic Lanczos quadrature as ``gpytorch.settings`` set them
        (``cg_tolerance``, ``num_trace_samples``, ``max_preconditioner_size``; below
        ``max_cholesky_size`` GPyTorch factors the matrix), with random probe vectors. The
        result carries the autograd graph of ``covar_module`` and ``mean_module`` where their
        tensors have the factorisation's dtype (else it is computed on copies, without one).
        """
        dtype = self.linalg_dtype or self.train_x.dtype
        kernel, mean, _ = self._modules_in(dtype)
        return self._teacher_log_likelihood(kernel, mean, self.noise[..., 0].to(dtype))

    def optimize_hyperparameters(
        self,
        *,
        max_iter: int = 50,
        lr: float = 0.05,
        learn_noise: bool = True,
        progress: object = False,
        callback: Callback | None = None,
    ) -> SpectralGPR:
        r"""Maximise the teacher's marginal likelihood (:meth:`log_marginal_likelihood`) over
        the parameters of ``covar_module`` and ``mean_module`` that require gradients and the
        teacher's noise :math:`\gamma_1`, with Adam (at most ``max_iter`` iterations, learning
        rate ``lr``); returns ``self``, with the loss of every iteration in :attr:`history`.

        The loss, as GPyTorch's ``ExactMarginalLogLikelihood`` has it, is

        .. math::
            -\frac1N \Big(\sum_b \log p(\mathbf y_b \mid \boldsymbol\theta, \gamma_1)
            + \sum_j \log p_j(\theta_j)\Big),

        summed over the batch, with the hyperpriors registered on the modules. **The noise.**
        The schedule is a constant of the model; what is learnt is one positive factor
        :math:`c` per schedule (``exp`` of a parameter starting at 0), by which the whole schedule
        is multiplied: :math:`\gamma_1` becomes the teacher's learnt noise
        :math:`c\gamma_1`, and the ratios :math:`\gamma_t / \gamma_1` of the later steps are
        kept (a constant schedule stays constant, as :meth:`from_teacher` makes it). With
        ``learn_noise=False`` the schedule is left as it is.

        Every backend trains: ``dense`` and ``cholesky`` by the exact Cholesky likelihood,
        ``lanczos`` and ``cg`` matrix-free: memory :math:`\mathcal O(N c + N t)` for row
        chunks of :math:`c` and :math:`t` probe vectors, plus the kernel rows each evaluation
        keeps for its CG iterations and backward pass while they fit in ``kernel_cache_bytes``
        (by default, as for the fit, a share of the free memory; ``kernel_cache_bytes=0``
        keeps none and never holds :math:`N^2` values). The probe vectors
        of iteration :math:`i` are drawn with the global random state seeded by :math:`i` and
        put back after: runs repeat, and every rank of a ``process_group`` draws the same. The
        optimisation runs in the factorisation's dtype: where ``linalg_dtype`` differs from the
        modules' dtype, on copies whose values are written back at the end. Modules shared
        with a teacher (:meth:`from_teacher`) are trained with it. The cached factorisation
        belongs to the old hyperparameters and is dropped; the next prediction (or
        :meth:`fit`) refits.

        :param max_iter: the most Adam iterations.
        :param lr: Adam's learning rate.
        :param learn_noise: learn the noise (the schedule's factor) as well.
        :param progress: ``True`` for a ``tqdm`` bar, or a bar of your own (:mod:`gpsd.progress`).
        :param callback: called after each iteration with an :class:`~gpsd.IterationRecord`
            (``loss`` the loss before the iteration's step; ``info["noise"]`` the teacher's
            noise it used); returning ``True`` stops.
        """
        max_iter = check_int(max_iter, "max_iter", minimum=0)
        lr = check_positive_float(lr, "lr")
        if not isinstance(learn_noise, bool):
            raise TypeError(f"learn_noise must be True or False, got {learn_noise!r}")
        self._check_modules()
        dtype = self.linalg_dtype or self.train_x.dtype
        kernel, mean, copied = self._modules_in(dtype)
        first = self.noise[..., :1].to(dtype)  # shape: (*s, 1)
        log_factor = torch.zeros_like(first, requires_grad=learn_noise)
        params = [p for m in (kernel, mean) for p in m.parameters() if p.requires_grad]
        params += [log_factor] if learn_noise else []
        if not params:
            raise ValueError(
                "the model has no trainable hyperparameters: no parameter of covar_module or "
                "mean_module requires a gradient, and learn_noise is False"
            )
        optimizer = torch.optim.Adam(params, lr=lr)
        n = self.train_x.shape[-2]
        self.history: list[float] = []
        task = f"{type(self).__name__}.optimize_hyperparameters"
        with ProgressReporter(task, max_iter, progress, callback) as report:
            for iteration in range(1, max_iter + 1):
                optimizer.zero_grad()
                with seeded_probes(iteration, self.train_x.device):
                    noise = (first * log_factor.exp()).squeeze(-1)  # shape: (*s,)
                    fit = self._teacher_log_likelihood(kernel, mean, noise).sum()
                    loss = -(fit + log_prior((kernel, mean), fit)) / n
                    loss.backward()
                optimizer.step()
                self.history.append(loss.item())
                teacher_noise = float(noise.detach().reshape(-1)[0])
                if report.update(iteration, loss=self.history[-1], noise=teacher_noise):
                    break
        with torch.no_grad():
            if copied:
                own = _tensors(self.covar_module, self.mean_module)
                for value, trained in zip(own, _tensors(kernel, mean), strict=True):
                    value.copy_(trained.to(value.dtype))
            if learn_noise:
                self.noise = self.noise * log_factor.exp().to(self.noise.dtype)
        return self

    def _modules_in(self, dtype: torch.dtype) -> tuple[Kernel, Mean, bool]:
        """``covar_module`` and ``mean_module`` in ``dtype``: themselves where every
        floating-point tensor of theirs has it, else copies (and ``True``)."""
        modules = (self.covar_module, self.mean_module)
        tensors = [t for m in modules for t in itertools.chain(m.parameters(), m.buffers())]
        if all(t.dtype == dtype for t in tensors if t.is_floating_point()):
            return self.covar_module, self.mean_module, False
        kernel, mean = (copy.deepcopy(m).to(dtype) for m in modules)
        return kernel, mean, True

    def _teacher_log_likelihood(self, kernel: Kernel, mean: Mean, noise: Tensor) -> Tensor:
        """:meth:`log_marginal_likelihood` with ``kernel``, ``mean`` and the teacher's noise
        ``noise`` (``(*s,)``), all in the factorisation's dtype."""
        dtype = self.linalg_dtype or self.train_x.dtype
        x, y = self.train_x.to(dtype), self.train_y.to(dtype)
        if self._dense_likelihood(dtype):
            return dense_log_likelihood(kernel, mean, x, y, noise)
        cache_bytes = self.kernel_cache_bytes
        if cache_bytes is None:  # rows kept within one evaluation, as the fit keeps them
            cache_bytes = default_cache_bytes(x)
        return matrix_free_log_likelihood(
            kernel, mean, x, y, noise, self.process_group, cache_bytes=cache_bytes
        )

    def _dense_likelihood(self, dtype: torch.dtype) -> bool:
        """Whether the backend forms the kernel matrix for one factorisation
        (:func:`~gpsd.linalg.backend.forms_kernel_matrix`)."""
        return forms_kernel_matrix(
            self.backend, self.train_x, self.covar_module, dtype, self.process_group
        )

    def _engine_request(self) -> linalg.EngineRequest:
        """The request for the engine of :math:`\\mathbf K` at the current state."""
        return linalg.EngineRequest(
            self.covar_module,
            self.train_x,
            self.backend,
            self.noise.shape[:-1],  # the automatic choice counts the factorisations
            self.num_steps,
            self.linalg_dtype,
            self.rank,
            self.rtol,
            self._smallest_shift(),
            cache_bytes=self.kernel_cache_bytes,
            process_group=self.process_group,
        )

    def _fit_dependencies(self) -> FitDependencies:
        return FitDependencies(
            (self.covar_module, self.mean_module),
            (self.train_x, self.train_y, self.noise),
            (self._engine_request(), *self._targets_config()),
        )

    def _fit_follows_gradients(self, fit: SpectralFit | Factorisation) -> bool:
        # a matrix-free engine builds no graph, and the grad mode does not change the choice of
        # one: it need not refit when the mode changes
        return fit.engine.supports_autograd or not fit.engine.matrix_free

    def _compute_fit(
        self, progress: object = False, callback: Callback | None = None
    ) -> SpectralFit:
        request = self._engine_request()
        factor = self._fit_part(
            "factorisation",
            FitDependencies((self.covar_module,), (), (request,)),
            lambda: self._factorise(request, progress=progress, callback=callback),
            self._fit_follows_gradients,
        )
        self._check_same_on_every_rank()
        with factor.autograd_context():
            prior_mean = self.mean_module(self.train_x)
            centred = (self.train_y - prior_mean).unsqueeze(-1)  # shape: (*b, N, 1)
            coords = factor.engine.project(_my_rows(factor.engine, centred))
        return SpectralFit(
            factor.engine, factor.test_kernel, prior_mean, centred, coords, self._mean_filter()
        )

    def _factorise(
        self,
        request: linalg.EngineRequest,
        progress: object = False,
        callback: Callback | None = None,
    ) -> Factorisation:
        self._check_modules()
        self._check_same_on_every_rank()  # before the ranks' Krylov iterations could part ways
        gamma_min = request.smallest_noise
        warn_low_precision_factorisation(  # before a factorisation that it may explain fails
            self.covar_module, self.train_x, self.linalg_dtype or self.train_x.dtype, gamma_min
        )
        engine = linalg.make_engine(request, progress=progress, callback=callback)
        engine.check_accuracy(gamma_min, self.rtol)
        keep_graph = engine.supports_autograd and needs_graph(self.covar_module, self.train_x)
        # Test covariances in the factorisation's dtype: the variance k** - k*^T R k* cancels,
        # and float32 entries of k* cost up to ~1e-3.
        test_kernel = kernel_in_dtype(
            self.covar_module, self.train_x, self.linalg_dtype, keep_graph=keep_graph
        )
        return Factorisation(engine, test_kernel)

    def _check_modules(self) -> None:
        """A ``ValueError`` naming a module whose tensors are on another device, or whose
        floating-point tensors have another dtype, than the model's training data."""
        x = self.train_x
        for name in ("covar_module", "mean_module"):
            module = getattr(self, name)
            for tensor in itertools.chain(module.parameters(), module.buffers()):
                if tensor.device != x.device:
                    raise ValueError(
                        f"{name} is on {tensor.device} but the model's training data are on "
                        f"{x.device}; move the model with .to(device)"
                    )
                if tensor.is_floating_point() and tensor.dtype != x.dtype:
                    raise ValueError(
                        f"{name} has dtype {tensor.dtype} but the model's training data have "
                        f"{x.dtype}; convert the model with .to({x.dtype}) (linalg_dtype sets "
                        "the dtype of the factorisation)"
                    )

    def _guard(self, fit: SpectralFit, value: Tensor, *inputs: Tensor) -> Tensor:
        """``value`` through the engine's :meth:`~gpsd.linalg.SpectralEngine.guard`, with the
        parameters of ``covar_module`` and ``mean_module`` and ``inputs`` as its leaves."""
        leaves = _tensors(self.covar_module, self.mean_module)
        return fit.engine.guard(value, *leaves, *inputs)

    @property
    def error_estimate(self) -> float:
        """Estimated relative truncation error of the backend (0 for the direct dense and Cholesky
        ones). Rounding is not counted: it costs every backend a relative error of up to about
        ``eps * (lambda_max + noise) / noise``, ``eps`` the unit roundoff of the solves' dtype."""
        return self._current_fit().engine.error_estimate(self._smallest_shift())

    # ------------------------------------------------------------------ prediction
    def predict(
        self,
        test_x: Tensor,
        *,
        step: int | None = None,
        include_noise: bool = False,
        full_cov: bool = False,
    ) -> Prediction:
        r"""Predictive means and variances of every step at ``test_x`` (shape ``(*b, M, d)``).

        Returns a :class:`~gpsd.Prediction` with ``mean`` and ``variance`` of shape
        ``(*batch, T, M)``, row ``t - 1`` for step ``t``; with ``step=t`` that row alone,
        ``(*batch, M)``. ``batch`` includes a batch of schedules, of targets or of prior means;
        the variances, which depend on neither targets nor prior means, are expanded over them
        (views: clone before writing in place). Without ``full_cov`` the test points are
        processed in chunks of :class:`gpsd.settings.test_chunk_size`, so memory stays at
        ``N x test_chunk_size``.

        With the ``"lanczos"`` and ``"cg"`` backends the results carry no autograd graph: where
        one would be needed (grad enabled and a parameter of ``covar_module`` or
        ``mean_module`` requiring grad), a backward pass that reaches them raises a
        :class:`~gpsd.BackendError`; ``"dense"`` and ``"cholesky"`` differentiate.

        :param test_x: test inputs, ``(*b, M, d)`` or ``(M,)``.
        :param step: a step ``t`` in ``1..T`` (default: every step).
        :param include_noise: add the noise of each step to the variances and to the
            covariances' diagonals: :math:`\gamma_t` for data-centric distillation, the
            effective noise :math:`\tilde\gamma_t` for distribution-centric.
        :param full_cov: also return the covariances ``(*batch, T, M, M)``.
        """
        step = self._check_step(step)
        test_x = validate_test_x(test_x, self.train_x)
        if self._splits_test_points(test_x, full_cov):
            prediction = self._predict_split(test_x)
        else:
            prediction = self._predict_all(test_x, full_cov)
        if include_noise:
            noise = self._step_noise().to(prediction.mean).unsqueeze(-1)  # shape: (*s, T, 1)
            covariance = prediction.covariance
            if covariance is not None:
                eye = torch.eye(
                    covariance.shape[-1], dtype=covariance.dtype, device=covariance.device
                )
                covariance = covariance + noise.unsqueeze(-1) * eye
            prediction = Prediction(prediction.mean, prediction.variance + noise, covariance)
        if step is not None:
            prediction = prediction.select(step - 1, dim=-2)
        return prediction

    def _splits_test_points(self, test_x: Tensor, full_cov: bool) -> bool:
        """Whether the ranks of :attr:`process_group` share the test points out (and check
        that all hold the same ones). Not where the engine needs products with K for the test
        columns (deflated CG, a complement series, covariances), nor where it splits the
        training rows (:attr:`~gpsd.linalg.SpectralEngine.local_rows`): every rank then takes
        part in every test point, with its rows."""
        fit = self._current_fit()
        if self.process_group is None or not self._distributed(fit):
            return False
        if not full_cov and fit.engine.columns_are_local:
            return True
        check_same_rows(test_x, self.process_group)
        return False

    def _predict_split(self, test_x: Tensor) -> Prediction:
        """:meth:`_predict_all` on this rank's share of the test points, gathered."""
        fit = self._current_fit()
        _ = fit.mean_weights  # computed on every rank, before the ranks part ways
        parts = on_my_rows(
            test_x, lambda part: self._stacked(self._predict_all(part, False)), self.process_group
        )
        mean = self._guard(fit, parts[0], test_x)
        return Prediction(mean, self._guard(fit, parts[1], test_x))

    @staticmethod
    def _stacked(prediction: Prediction) -> Tensor:
        """The means and variances of ``prediction`` stacked, ``(2, *batch, T, M)``."""
        mean = prediction.mean
        return torch.stack([mean, prediction.variance.expand(mean.shape)])

    # ------------------------------------------------------------------ distributed
    def _distributed(self, fit: SpectralFit) -> bool:
        """Whether the engine multiplies through the ranks of :attr:`process_group`."""
        return self.process_group is not None and fit.engine.matrix_free

    def _over_rows(self, engine: object, partial: Tensor) -> Tensor:
        """The sum over the ranks, in rank order, of this rank's sums over its rows, where the
        engine splits the rows (:attr:`~gpsd.linalg.SpectralEngine.local_rows`); ``partial``
        itself where every rank holds every row."""
        if engine.local_rows is None:
            return partial
        return all_reduce_sum(partial, self.process_group, "all_gather of the predictions' sums")

    def _at_every_row(self, fit: SpectralFit, filt: SpectralFilter) -> Tensor:
        r""":math:`f_t(\mathbf K)(\mathbf y - m)` at every training input, ``(*, F, N, 1)``:
        gathered from the ranks where the engine splits the rows."""
        engine = fit.engine
        out = engine.apply(filt, fit.coords)
        return out if engine.local_rows is None else engine.all_rows(out)

    def _check_same_on_every_rank(self) -> None:
        """The same ``ValueError`` on every rank of :attr:`process_group` unless all hold the
        same targets, noise schedule, prior mean and model settings (the operator checks the
        inputs and the kernel)."""
        if self.process_group is None:
            return
        fields = {
            **tensor_fingerprint("train_y", self.train_y),
            **tensor_fingerprint("noise", self.noise),
            **module_fingerprint(self.mean_module, "mean_module"),
            "model settings": torch.tensor([text_checksum(repr(self._targets_config()))]),
        }
        check_same(
            fields,
            self.process_group,
            "the check of the model's data",
            "every rank must build the model from the same train_y, noise, mean_module and "
            "settings",
        )

    def _predict_all(self, test_x: Tensor, full_cov: bool) -> Prediction:
        chunk = settings.test_chunk_size.value()
        if full_cov or test_x.shape[-2] <= chunk:
            return self._predict_chunk(test_x, full_cov)
        parts = []
        for i in range(0, test_x.shape[-2], chunk):
            parts.append(self._predict_chunk(test_x[..., i : i + chunk, :], False))
        return Prediction(
            torch.cat([p.mean for p in parts], dim=-1),
            torch.cat([p.variance for p in parts], dim=-1),
        )

    def predict_mean(self, test_x: Tensor, *, step: int | None = None) -> Tensor:
        """Predictive means of every step at ``test_x``, shape ``(*batch, T, M)`` (or
        ``(*batch, M)`` for ``step=t``).

        :meth:`predict` without the variances: one product with cached weights per chunk of
        :class:`gpsd.settings.test_chunk_size` test points. With ``backend="cg"`` this skips the
        variance solves, which have one right-hand side per test point.
        """
        step = self._check_step(step)
        test_x = validate_test_x(test_x, self.train_x)
        fit = self._current_fit()
        distributed = self.process_group is not None and self._distributed(fit)
        if distributed and fit.engine.local_rows is not None:
            check_same_rows(test_x, self.process_group)  # every rank takes part, with its rows
        if distributed and fit.engine.local_rows is None:
            _ = fit.mean_weights  # computed on every rank, before the ranks part ways
            mean = on_my_rows(test_x, lambda part: self._means(fit, part), self.process_group)
        else:
            mean = self._means(fit, test_x)
        mean = self._guard(fit, mean, test_x)
        return mean if step is None else mean[..., step - 1, :]

    def _means(self, fit: SpectralFit, test_x: Tensor) -> Tensor:
        """Means ``(*, T, M)`` at ``test_x``, chunk by chunk, computed by this process."""
        chunk = settings.test_chunk_size.value()
        starts = range(0, max(test_x.shape[-2], 1), chunk)
        with fit.autograd_context():
            chunks = [test_x[..., i : i + chunk, :] for i in starts]
            return torch.cat([self._mean_chunk(fit, chunk) for chunk in chunks], dim=-1)

    def _mean_chunk(self, fit: SpectralFit, test_x: Tensor, cross: Tensor | None = None) -> Tensor:
        """Means ``(*, T, M)`` at ``test_x``, given the cross-covariance ``(*b, N, M)`` if known."""
        engine = fit.engine
        if cross is None:
            kernel, train_x = fit.test_kernel
            cross = kernel_matrix(kernel, _my_rows(engine, train_x), test_x.to(train_x.dtype))
        weights = fit.mean_weights  # shape: (*, T, N, 1), this rank's rows of a split
        # one product with the T weight vectors side by side (T matrix-vector products would
        # read the cross-covariance T times)
        mean = (cross.to(weights).mT @ weights.squeeze(-1).mT).mT  # shape: (*, T, M)
        mean = self._over_rows(engine, mean)
        return mean.to(test_x.dtype) + self.mean_module(test_x).unsqueeze(-2)

    def _predict_chunk(self, test_x: Tensor, full_cov: bool) -> Prediction:
        fit = self._current_fit()
        engine = fit.engine
        with fit.autograd_context():
            variance_filter = self._variance_filter()
            kernel, train_x = fit.test_kernel
            test_in = test_x.to(train_x.dtype)
            # shape: (*b, N, M), this rank's rows where the engine splits them
            cross = kernel_matrix(kernel, _my_rows(engine, train_x), test_in)
            mean = self._mean_chunk(fit, test_x, cross)
            prior_var = kernel(test_in, diag=True).unsqueeze(-2)  # shape: (*b, 1, M)
            reduction = engine.quad_diag(variance_filter, cross).to(prior_var)
            variance = nonnegative_variance(prior_var - reduction, prior_var)
            if engine.quad_error_bound is not None:  # the iterative solvers bound their forms
                warn_if_variance_error_large(variance, engine.quad_error_bound, prior_var)
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
        mean = self._guard(fit, mean, test_x)
        variance = self._guard(fit, variance, test_x)
        if covariance is not None:
            covariance = self._guard(fit, covariance, test_x)
        return Prediction(mean, variance, covariance)

    def forward(self, test_x: Tensor, *, full_cov: bool = False) -> MultivariateNormal:
        """The latent predictive distributions of all steps: batch shape ``(*batch, T)``
        (diagonal covariances unless ``full_cov``)."""
        prediction = self.predict(test_x, full_cov=full_cov)
        if full_cov:
            return MultivariateNormal(prediction.mean, prediction.covariance)
        return MultivariateNormal(prediction.mean, DiagLinearOperator(prediction.variance))

    # ------------------------------------------------------------------ choosing t
    def gcv(self) -> Tensor:
        r"""Generalised cross-validation score of every step, shape ``(*batch, T)``.

        Step :math:`t`'s fit at the training inputs is a linear smoother of the targets,
        :math:`\boldsymbol\mu_t - m = \mathbf S_t(\mathbf y - m)`, and

        .. math::
            \operatorname{GCV}(t) = \frac{N \lVert \mathbf y - \boldsymbol\mu_t \rVert^2}
            {\big(N - \operatorname{tr}\mathbf S_t\big)^2},

        smaller is better. :math:`\mathbf I - \mathbf S_t` is evaluated as a filter of its own,
        not as a difference: :math:`\mathbf y - \boldsymbol\mu_t` and
        :math:`N - \operatorname{tr}\mathbf S_t` cancel to rounding where the noise is tiny.

        The ``"dense"`` and ``"cholesky"`` backends read the trace off the factorisation
        exactly. The matrix-free ones estimate the part they cannot read off from
        :class:`gpsd.settings.trace_probes` Rademacher vectors (seed
        :class:`gpsd.settings.trace_probe_seed`): ``"lanczos"`` the curvature of the filters on
        the complement of its eigenpairs
        (:meth:`KernelSpectrum.trace_estimate <gpsd.linalg.KernelSpectrum.trace_estimate>`),
        ``"cg"`` the trace beyond the Ritz vectors of its deflation, through solves
        (:meth:`ShiftedCG.trace_estimate <gpsd.linalg.ShiftedCG.trace_estimate>`). Every step
        shares the probes, so the choice of step is steadier than the scores' standard errors
        (:meth:`gcv_standard_error`) suggest. The scores are kept with the fit, for the
        settings they were estimated under.
        """
        return self._gcv()[0]

    def gcv_standard_error(self) -> Tensor:
        r"""The standard error of every step's :meth:`gcv` score, ``(*batch, T)``:
        :math:`2\,\operatorname{GCV}(t)\,\sigma_t / (N - \operatorname{tr}\mathbf S_t)`
        for the standard error :math:`\sigma_t` of the probes' part of the trace (to first
        order), 0 where no probes were needed (``"dense"``, ``"cholesky"``, and a Lanczos
        spectrum that needs no series beyond first order). It covers the probes only: the
        backend's own error (:attr:`error_estimate`, up to ``rtol``; a Lanczos spectrum short
        of ``rtol`` warns) comes on top."""
        return self._gcv()[1]

    def _gcv(self) -> tuple[Tensor, Tensor]:
        """The scores and their standard errors; kept with the fit where they carry no graph."""
        fit = self._current_fit()
        key = (settings.trace_probes.value(), settings.trace_probe_seed.value())
        if key not in fit.gcv_scores:
            result = self._estimate_gcv(fit)
            if fit.engine.supports_autograd:  # a graph is not kept beyond its use
                return result
            fit.gcv_scores[key] = result
        score, error = fit.gcv_scores[key]
        return self._guard(fit, score), error

    def _estimate_gcv(self, fit: SpectralFit) -> tuple[Tensor, Tensor]:
        engine = fit.engine
        residuals = self._residual_filter()
        n = self.train_x.shape[-2]
        with fit.autograd_context():
            # (N - tr S_t) and its standard error, times the filter's multiple
            generator = torch.Generator().manual_seed(settings.trace_probe_seed.value())
            dof, dof_error = engine.trace_estimate(
                residuals, settings.trace_probes.value(), generator
            )
            if not bool((dof.detach() > 0).all()):
                raise ValueError(
                    "the stochastic estimate of N - tr S_t came out non-positive for some step; "
                    "raise gpsd.settings.trace_probes"
                )
            resid = self._at_every_row(fit, residuals).squeeze(-1)
            rss = resid.square().sum(-1)  # ||y - mu_t||^2, times the multiple squared
            score = n * rss / dof.square()
            error = 2 * score.detach() * dof_error / dof.detach()
        dtype = self.train_y.dtype
        return score.to(dtype), error.to(dtype)

    def validation_mse(self, val_x: Tensor, val_y: Tensor) -> Tensor:
        """Mean squared error of every step's predictive mean on a validation set, ``(*batch, T)``.

        :param val_x: validation inputs, ``(*b, M, d)`` or ``(M,)``.
        :param val_y: validation targets, ``(*b, M)``.
        """
        val_x = validate_test_x(val_x, self.train_x, "val_x")
        if isinstance(val_y, Tensor):
            check_same_device(self.train_x, val_y, "val_y", "the model's training data")
        val_y = check_finite(
            as_float_tensor(val_y, "val_y", dtype=val_x.dtype, device=val_x.device), "val_y"
        )
        if val_y.dim() == 0 or val_y.shape[-1] != val_x.shape[-2]:
            raise ValueError(
                f"val_y must have {val_x.shape[-2]} entries (one per row of val_x), "
                f"got shape {tuple(val_y.shape)}"
            )
        mean = self.predict_mean(val_x)
        return (mean - val_y.unsqueeze(-2)).square().mean(-1)


def _my_rows(engine: object, full: Tensor) -> Tensor:
    """This rank's rows of ``full`` (``(*, N, c)``) where ``engine`` splits the training rows
    across a process group (:attr:`~gpsd.linalg.SpectralEngine.local_rows`), else ``full``."""
    rows = engine.local_rows
    return full if rows is None else full[..., rows, :]
