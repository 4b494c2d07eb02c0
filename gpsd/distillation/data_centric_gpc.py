r"""Data-centric self-distillation for GP classification (Borup & Andersen, §4.1)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import gpytorch
import torch
from gpytorch.kernels import Kernel
from gpytorch.means import Mean, ZeroMean
from torch import Tensor

from gpsd._internal.fitted import FitDependencies, Fitted
from gpsd._internal.memory_check import check_dense_matrices_fit
from gpsd._internal.module_state import (
    check_saved_num_steps,
    choice_setting,
)
from gpsd._internal.progress_reporter import ProgressReporter, check_progress
from gpsd._internal.validation import check_gp_modules, check_int
from gpsd._internal.variance import nonnegative_variance
from gpsd.distillation._gpc_steps import (
    FittedModules,
    SoftBernoulliLogitTerms,
    StepwiseClassifier,
    check_refit_options,
    check_trainable,
    refit_step_modules,
)
from gpsd.distillation._multiclass_steps import (
    DEFAULT_NUM_SAMPLES,
    SoftmaxLabelTerms,
    check_class_memory,
    check_class_modules,
    data_centric_chain,
    infer_num_classes,
    refuse_for_classes,
)
from gpsd.distillation._step_distiller import NoiseRule
from gpsd.laplace import (
    BernoulliLogitTerms,
    ClassificationTrainingData,
    ContinuousBernoulliTerms,
    LaplaceMode,
    LaplacePosterior,
    MulticlassLaplacePosterior,
    checked_classification_data,
    constant_parameters,
    laplace_latent_predictive,
    prior_at_test,
    prior_at_training,
    probit_approximation,
    symmetric_response_expectation,
)
from gpsd.progress import Callback

__all__ = ["DataCentricGPC"]

#: N x N matrices a fit holds at its peak besides the Cholesky factor each of the T steps keeps,
#: per problem of the batch (T + 5 measured at N = 2500 to 4000 on the CPU for T = 1, 2, 4: the
#: peak resident memory over one float64 matrix)
_WORKING_MATRICES = 5


@dataclasses.dataclass(frozen=True, eq=False)
class _DataCentricFit:
    """A :class:`DataCentricGPC`'s fit, one entry per fitted step, entry ``t - 1`` for step
    ``t`` (fewer than ``num_steps`` where a callback stopped the fit).

    :param modes: The Laplace mode of each step at the training inputs.
    :param targets: The targets each step is fitted to, ``(*batch, n)``.
    :param modules: The kernel and prior mean of each step.
    """

    modes: tuple[LaplaceMode, ...]
    targets: tuple[Tensor, ...]
    modules: tuple[FittedModules, ...]


@dataclasses.dataclass(frozen=True, eq=False)
class _DataCentricClassFit:
    """A :class:`DataCentricGPC`'s fit for :math:`K > 2` classes, one entry per fitted step, as
    :class:`_DataCentricFit`.

    :param posteriors: The multiclass Laplace posterior of each step.
    :param targets: The targets each step is fitted to, ``(*batch, n, K)`` (step 1: one-hot).
    :param modules: The kernel and prior mean of each step.
    """

    posteriors: tuple[MulticlassLaplacePosterior, ...]
    targets: tuple[Tensor, ...]
    modules: tuple[FittedModules, ...]


class DataCentricGPC(Fitted, StepwiseClassifier, ClassificationTrainingData, gpytorch.Module):
    r"""Data-centric self-distillation of a Laplace GP classifier (Borup & Andersen, §4.1).

    Step :math:`t` fits a Laplace GPC with the prior :math:`\mathcal{GP}(m, k)` to targets
    :math:`\mathbf y_t` (row ``t - 1`` of :meth:`step_targets`). Step 1 fits the Bernoulli-logistic
    likelihood to the labels, :math:`\mathbf y_1 \in \{0,1\}^N`; step :math:`t \ge 2` fits the
    previous step's soft predictions at the training inputs,

    .. math::

        \mathbf y_t = \mathbb{E}_{q_{t-1}}[\sigma(\mathbf f)] \in [0, 1]^N,

    with the continuous Bernoulli likelihood (C-GPC, the well-specified model for soft targets)

    .. math::

        \log p(\mathbf y_t \mid \mathbf f_t) = \mathbf y_t^\top \mathbf f_t
        - \sum_n \log(1 + e^{f_{t,n}}) + \sum_n \log C(\sigma(f_{t,n})),

    or, for comparison (Fig. 4), the misspecified Bernoulli likelihood on the soft targets. Each
    step :math:`t` may add its own noise :math:`\gamma_t` to the kernel diagonal of the training
    inputs (:math:`\tilde{\mathbf K}_t = \mathbf K + \gamma_t \mathbf I`, Fig. 5), and the targets
    may be thresholded at 1/2 (Fig. 10). The kernel matrix is computed once; each step
    warm-starts Newton from the previous mode. Cost grows linearly in the number of steps (no
    closed form exists).

    By default every step shares the kernel and prior mean as given. With
    ``refit_hyperparameters=True`` (the paper's Fig. 4, where every model's hyperparameters
    minimise its negative log marginal likelihood), step :math:`t` gets its own copies of them,
    fitted to its own targets: starting from ``covar_module``'s and ``mean_module``'s values,
    ``refit_max_iter`` Adam iterations at learning rate ``refit_lr`` maximise the Laplace
    marginal likelihood (plus any hyperpriors) of step :math:`t`'s model, the
    :class:`~gpsd.LaplaceGPClassifier` of :math:`\mathbf y_t` with step :math:`t`'s likelihood and
    noise :math:`\gamma_t`, exactly as
    :meth:`~gpsd.LaplaceGPClassifier.optimize_hyperparameters` does. Parameters that do not
    require a gradient stay fixed; a batch of targets shares one set of hyperparameters unless
    the kernel has that batch shape (the losses of the batch are summed). The soft targets of
    step :math:`t + 1` are step :math:`t`'s predictions with its fitted hyperparameters.
    :attr:`step_covar_modules` and :attr:`step_mean_modules` hold each step's modules and
    :attr:`refit_history` the losses of each step's refit. The cost is ``refit_max_iter``
    Laplace fits and marginal-likelihood gradients per step; ``covar_module`` and
    ``mean_module`` are left as they are (they are the starting point).

    **K classes.** Labels in :math:`0, \dots, K - 1` with :math:`K > 2` (``num_classes``, or one
    more than the largest label) give :math:`K` latent functions :math:`\mathbf f_c`,
    independent a priori, :math:`\mathbf f_c \sim \mathcal{GP}(m_c, k_c)`: ``covar_module``
    (and ``mean_module``) is shared by the :math:`K` latent functions unless it has batch shape
    ``(K,)``, whose entry :math:`c` is class :math:`c`'s. Step 1 fits the softmax likelihood to
    the labels (Rasmussen & Williams §3.5) under the prior covariance
    :math:`\mathbf K_c + \gamma_1 \mathbf I`; step :math:`t \ge 2` fits the previous step's
    class probabilities at the training inputs, rows on the simplex,

    .. math::

        \mathbf y_{t,i} = \mathbb{E}_{q_{t-1}}[\operatorname{softmax}(\mathbf f_i)],

    with the continuous categorical likelihood (the :math:`K`-class continuous Bernoulli),
    :math:`\log p(\mathbf y_{t,i} \mid \mathbf f_i) = \mathbf f_i^\top \mathbf y_{t,i} -
    A(\mathbf f_i)`, :math:`A` its log-normaliser, under :math:`\mathbf K_c + \gamma_t \mathbf I`.
    As the binary steps predict :math:`\sigma(f)`, every step's class probabilities are
    :math:`\mathbb{E}_{q_t}[\operatorname{softmax}(\mathbf f_*)]` (the continuous categorical's
    parameter, not its mean :math:`\nabla A`). Each step is a
    :class:`~gpsd.laplace.MulticlassLaplacePosterior`; its expectations are Monte Carlo averages
    over ``num_samples`` draws from the latent predictive, the same draws for every point and at
    every call (a CPU generator seeded with 0), so the targets and the predictions are the same at
    every fit, and a point's probabilities do not depend on the points predicted with it.
    :meth:`predict_proba` has a trailing class axis of size :math:`K`, :meth:`step_targets` (one-hot
    labels at step 1) and :meth:`latent_modes` are ``(*batch, T, n, K)``. ``soft_target_likelihood``
    stays ``"continuous_bernoulli"`` (read as the continuous categorical), ``threshold_targets``
    ``False``, ``target_method`` ``"quadrature"`` (read as the Monte Carlo average) and
    ``refit_hyperparameters`` ``False``; other values are refused. ``warm_start`` and
    ``use_stored_modes`` start the Newton runs as for two classes. The continuous
    categorical's factorisation is dense over the classes, :math:`O(K^3 n^3)` per Newton iteration.
    At :math:`K = 2` the binary model above is fitted (one latent function).

    The model fits lazily: :meth:`fit` need not be called (the first prediction fits), and
    predictions refit every step (warm-started from the stored modes) when the fit is stale
    (:meth:`fit` lists when), so they always belong to the current hyperparameters. Predictions hold every step along a
    step dimension before the test points (row ``t - 1`` for step ``t``); ``step=t`` selects one.
    They are differentiable in the test inputs; the hyperparameters are constants to them (the
    steps are fitted without autograd, so a gradient through the test-point kernel alone would be
    wrong). A state saved by a model with another ``num_steps`` is refused. The training data are
    stored detached. Every step is computed in the training inputs' dtype, whatever the dtype of
    the kernel and the mean.

    :param train_x: Training inputs ``(n, d)`` or ``(n,)``, float32 or float64.
    :param train_y: Labels ``(*batch, n)``: binary, in {0, 1}, or in ``0 ... K - 1``.
    :param covar_module: The kernel :math:`k`, any GPyTorch kernel: every step's, or the starting
        point of every step's refit with ``refit_hyperparameters``.
    :param mean_module: Prior mean (default zero).
    :param num_steps: Number of steps :math:`T \ge 1` (step 1 is the ordinary GPC; default: the
        length of the schedule ``noise``, or 2 where ``noise`` is one number).
    :param noise: :math:`\gamma_1, \dots, \gamma_T \ge 0`: one number for every step, a
        schedule of shape ``(T,)``, entry ``t - 1`` for step ``t``, or a batch of schedules
        ``(*s, T)``, which broadcasts with the batch of the labels as the regression distillers'
        do (every step of every schedule is fitted; predictions get the batch ``s``; not with
        ``refit_hyperparameters``, which refits one schedule's modules). Assigning
        ``model.noise`` later is checked the same way and keeps :math:`T` (one number is every
        step's).
    :param soft_target_likelihood: ``"continuous_bernoulli"`` (default) or ``"bernoulli"`` (the
        misspecified variant) for steps :math:`t \ge 2`.
    :param threshold_targets: Fit :math:`\mathbb 1[\mathbb{E}_{q_{t-1}}[\sigma(\mathbf f)] > 1/2]`
        at step :math:`t \ge 2` instead of the soft predictions.
    :param warm_start: Start each Newton run from the previous step's mode.
    :param target_method: ``"quadrature"`` (:func:`~gpsd.laplace.symmetric_response_expectation`)
        or ``"probit"`` (MacKay's approximation) for :math:`\mathbb{E}_q[\sigma(f)]`.
    :param max_iter: Newton iterations allowed per Laplace fit.
    :param refit_hyperparameters: Refit the kernel's and the prior mean's hyperparameters at
        every step (see above); ``False`` keeps them as given for every step.
    :param refit_max_iter: Adam iterations of each step's refit.
    :param refit_lr: Adam's learning rate of each step's refit.
    :param num_classes: :math:`K \ge 2` (default: one more than the largest label, and 2 for
        labels in {0, 1}); give it where a class has no training label.
    :param num_samples: Monte Carlo draws of the class probabilities for :math:`K > 2` classes
        (the soft targets and :meth:`predict_proba`).

    Example:

        >>> model = DataCentricGPC(x, y, ScaleKernel(RBFKernel()), num_steps=5).fit()
        >>> probs = model.predict_proba(test_x)  # shape: (5, M, 2)
        >>> t = model.best_step(val_x=val_x, val_y=val_y)
        >>> labels = model.predict(test_x, step=t)  # shape: (M,)
        >>> model = DataCentricGPC(x, labels_0_to_3, ScaleKernel(RBFKernel()), num_steps=3)
        >>> model.predict_proba(test_x).shape  # (3, M, 4)
    """

    def __init__(
        self,
        train_x: Tensor,
        train_y: Tensor,
        covar_module: Kernel,
        *,
        mean_module: Mean | None = None,
        num_steps: int | None = None,
        noise: float | Sequence[float] | Tensor = 0.0,
        soft_target_likelihood: str = "continuous_bernoulli",
        threshold_targets: bool = False,
        warm_start: bool = True,
        target_method: str = "quadrature",
        max_iter: int = 100,
        refit_hyperparameters: bool = False,
        refit_max_iter: int = 50,
        refit_lr: float = 0.05,
        num_classes: int | None = None,
        num_samples: int = DEFAULT_NUM_SAMPLES,
    ) -> None:
        super().__init__()
        check_gp_modules(covar_module, mean_module)
        refit = check_refit_options(refit_hyperparameters, refit_max_iter, refit_lr)
        self.refit_hyperparameters, self.refit_max_iter, self.refit_lr = refit
        self.soft_target_likelihood = soft_target_likelihood
        self.threshold_targets = threshold_targets
        self.target_method = target_method
        self._num_classes = infer_num_classes(train_y, num_classes)
        self.num_samples = num_samples
        train_x, train_y = checked_classification_data(train_x, train_y, self._target_terms)
        self.covar_module = covar_module
        self.mean_module = mean_module if mean_module is not None else ZeroMean()
        if self.refit_hyperparameters:
            check_trainable(self.covar_module, self.mean_module)
        self.warm_start = bool(warm_start)
        self.max_iter = check_int(max_iter, "max_iter")
        self.register_buffer("train_inputs", train_x)
        self.register_buffer("train_targets", train_y)
        self._init_steps(num_steps, noise, train_x)
        self._check_noise_batch()
        self._check_class_settings()
        # per step, (T, *batch, n) (for K > 2 classes, (T, *batch, n, K)): step_targets() and
        # latent_modes() lay them out
        classes = (self.num_classes,) if self.num_classes > 2 else ()
        shape = (self.num_steps, *train_y.shape, *classes)
        self.register_buffer("_step_targets", train_x.new_zeros(shape))
        self.register_buffer("_latent_modes", train_x.new_zeros(shape))
        self.register_buffer("is_fitted", torch.tensor(False, device=train_x.device))
        #: Newton iterations of each step of the last fit, entry ``t - 1`` for step ``t``
        self.newton_iterations: list[int] = []
        #: the loss (negative Laplace log marginal likelihood, summed over the batch, minus the
        #: log hyperprior) of every Adam iteration of each step's refit in the last fit, entry
        #: ``t - 1`` for step ``t`` (empty lists without ``refit_hyperparameters``)
        self.refit_history: list[list[float]] = []

    @property
    def _target_terms(self) -> BernoulliLogitTerms | SoftmaxLabelTerms:
        """The training targets are the first step's labels: 0/1 (Bernoulli), or in
        ``0 ... K - 1`` (softmax)."""
        if self.num_classes > 2:
            return SoftmaxLabelTerms(self.num_classes)
        return BernoulliLogitTerms()

    _noise_rule = NoiseRule(positive=False, steps_of_one_value=2)

    def _check_noise_batch(self) -> None:
        """A ``ValueError`` unless the batch of the schedules broadcasts with the labels' and the
        kernel's, and is empty where the steps refit their hyperparameters."""
        # for K > 2 classes the kernel's batch is its classes (_check_class_settings)
        self._schedule_batch(self.covar_module.batch_shape if self.num_classes == 2 else ())
        self._check_one_schedule_to_refit()

    def _check_one_schedule_to_refit(self) -> None:
        """A ``ValueError`` where the steps refit their hyperparameters for a batch of schedules
        (a refit fits one schedule's models)."""
        if self.refit_hyperparameters and self.noise.dim() > 1:
            raise ValueError(
                "refit_hyperparameters=True refits the modules of one noise schedule (T,), got "
                f"noise of shape {tuple(self.noise.shape)}; build one model per schedule to "
                "refit each, or pass refit_hyperparameters=False"
            )

    def _check_class_settings(self) -> None:
        """For :math:`K > 2` classes, a ``ValueError`` naming the setting that the :math:`K`-class
        steps do not have, or the module of another batch shape than ``()`` or ``(K,)``."""
        if self.num_classes == 2:
            return
        K = self.num_classes
        check_class_modules(self.covar_module, self.mean_module, K)
        fixed = (
            (
                "soft_target_likelihood",
                "continuous_bernoulli",
                "steps t >= 2 fit the continuous categorical: pass "
                "soft_target_likelihood='continuous_bernoulli'",
            ),
            ("threshold_targets", False, "pass threshold_targets=False"),
            (
                "target_method",
                "quadrature",
                "the targets are Monte Carlo averages: pass target_method='quadrature'",
            ),
            ("refit_hyperparameters", False, "pass refit_hyperparameters=False"),
        )
        for name, value, allowed in fixed:
            if getattr(self, name) != value:
                refuse_for_classes(K, name, getattr(self, name), allowed)

    soft_target_likelihood = choice_setting(
        "soft_target_likelihood",
        ("continuous_bernoulli", "bernoulli"),
        "The likelihood of steps :math:`t \\ge 2`; a new one refits on use.",
    )
    threshold_targets = choice_setting(
        "threshold_targets",
        (False, True),
        "Whether steps :math:`t \\ge 2` get the thresholded targets; a new value refits on use.",
    )
    target_method = choice_setting(
        "target_method",
        ("quadrature", "probit"),
        "How the soft targets :math:`\\mathbb{E}_q[\\sigma(f)]` are computed; a new one refits on use.",
    )

    #: :math:`\gamma_1, \dots, \gamma_T`, a buffer of shape ``(*s, T)`` (entry ``t - 1`` for
    #: step ``t``) in the training inputs' dtype. Assigning one number or schedules of ``T``
    #: numbers (checked) or writing into it refits on use.
    noise: Tensor

    _resizable_buffers = ("_step_targets", "_latent_modes", "train_inputs", "train_targets")

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        check_saved_num_steps(self, state_dict.get(prefix + "_step_targets"))
        return super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _fit_dependencies(self) -> FitDependencies:
        settings = (
            self.soft_target_likelihood,
            self.threshold_targets,
            self.target_method,
            self.max_iter,
            self.refit_hyperparameters,
            self.refit_max_iter,
            self.refit_lr,
            self.warm_start,
            self.num_classes,
            self.num_samples if self.num_classes > 2 else None,  # the K-class targets' draws
        )
        return FitDependencies(
            (self.covar_module, self.mean_module),
            (self.train_inputs, self.train_targets, self.noise),
            settings,
        )

    def _terms(self, step: int):
        if step == 1:
            return BernoulliLogitTerms()
        if self.soft_target_likelihood == "bernoulli":
            return SoftBernoulliLogitTerms()
        return ContinuousBernoulliTerms()

    def _soft_predictions(self, posterior: LaplacePosterior, K: Tensor, m: Tensor) -> Tensor:
        """The next step's targets: the posterior's predictions at the training inputs, whose
        prior covariance ``K`` and mean ``m`` are without the step's noise."""
        prior_var = torch.diagonal(K, dim1=-2, dim2=-1)
        mean, var = posterior.predictive(K, prior_var, m, diag=True)
        var = nonnegative_variance(var, prior_var)
        if self.target_method == "probit":
            return probit_approximation(mean, var)
        return symmetric_response_expectation(torch.sigmoid, mean, var)

    def _compute_fit(
        self,
        use_stored_modes: bool = True,
        progress: object = False,
        callback: Callback | None = None,
    ) -> _DataCentricFit | _DataCentricClassFit:
        """Fit steps 1..T (fewer where ``callback`` stops), by default warm-started from the
        stored modes."""
        self._check_noise_batch()  # labels of another batch (set_train_data), or refits set
        use_stored_modes = use_stored_modes and bool(self.is_fitted)
        if self.num_classes > 2:
            return self._compute_class_fit(use_stored_modes, progress, callback)
        check_dense_matrices_fit(
            f"{type(self).__name__}.fit",
            _WORKING_MATRICES + self.num_steps,
            self.train_inputs,
            self._schedule_batch(),
            "the kernel matrix, Newton's factorisation and the Cholesky factor each step keeps",
            "fit fewer num_steps, train on fewer points, or in float32 for half the bytes",
        )
        refit = self.refit_hyperparameters
        if refit:
            check_trainable(self.covar_module, self.mean_module)
        with torch.no_grad():
            shared = FittedModules(self.covar_module, self.mean_module)
            # shapes: (*batch, n), (*batch, n, n)
            m, K = prior_at_training(
                self.covar_module, self.mean_module, self.train_inputs, self.train_targets
            )
            n = K.shape[-1]
            eye = torch.eye(n, dtype=K.dtype, device=K.device)
            # every step fits the whole batch of labels and schedules: (*s, *batch, n)
            batch = torch.broadcast_shapes(self.noise.shape[:-1], m.shape[:-1])
            targets = self.train_targets.expand(*batch, n)
            modes: list[LaplaceMode] = []
            fitted_targets: list[Tensor] = []
            fitted_modules: list[FittedModules] = []
            self.newton_iterations = []
            self.refit_history = []
            init = None
            task = f"{type(self).__name__}.fit"
            with ProgressReporter(task, self.num_steps, progress, callback) as report:
                for step in range(1, self.num_steps + 1):
                    noise = self.noise[..., step - 1]  # shape: (*s,)
                    if refit:
                        modules, posterior = refit_step_modules(
                            self.train_inputs,
                            targets,
                            self.covar_module,
                            self.mean_module,
                            self._terms(step),
                            noise=float(noise),
                            max_iter=self.max_iter,
                            refit_max_iter=self.refit_max_iter,
                            refit_lr=self.refit_lr,
                            callback=report.forward(f"refit of step {step}"),
                        )
                        m, K = prior_at_training(
                            modules.covar_module, modules.mean_module, self.train_inputs, targets
                        )
                    else:
                        modules = shared
                        stored = self._latent_modes[step - 1]
                        if use_stored_modes and stored.shape == targets.shape:
                            init = stored
                        elif not self.warm_start:
                            init = None
                        posterior = LaplacePosterior(
                            m,
                            # no copy without noise
                            K if bool((noise == 0).all()) else K + noise[..., None, None] * eye,
                            self._terms(step),
                            targets,
                            init_f=init,
                            max_iter=self.max_iter,
                            check_targets=step == 1,  # later: the last step's probabilities
                        )
                    mode = posterior.mode
                    modes.append(mode)
                    fitted_targets.append(targets)
                    fitted_modules.append(modules)
                    self.newton_iterations.append(mode.iterations)
                    self.refit_history.append(modules.history)
                    if self._step_targets[step - 1].shape != targets.shape:
                        self._step_targets = targets.new_zeros(self.num_steps, *targets.shape)
                        self._latent_modes = torch.zeros_like(self._step_targets)
                    self._step_targets[step - 1] = targets
                    self._latent_modes[step - 1] = mode.f
                    init = mode.f
                    soft = self._soft_predictions(posterior, K, m)
                    del posterior  # its prior covariance K + noise I is not kept past the step
                    targets = (soft > 0.5).to(soft.dtype) if self.threshold_targets else soft
                    loss = -float(mode.log_marginal_likelihood.sum())
                    info = {"newton_iterations": mode.iterations}
                    if refit:
                        info["refit_iterations"] = len(modules.history)
                    if report.stopped or report.update(step, loss=loss, **info):
                        break
            self.is_fitted.fill_(True)
        return _DataCentricFit(tuple(modes), tuple(fitted_targets), tuple(fitted_modules))

    def _compute_class_fit(
        self, use_stored_modes: bool, progress: object, callback: Callback | None
    ) -> _DataCentricClassFit:
        """:meth:`_compute_fit` for :math:`K > 2` classes: the chain of multiclass Laplace
        fits."""
        self._check_class_settings()
        batch = torch.broadcast_shapes(self.noise.shape[:-1], self.train_targets.shape[:-1])
        shape = (self.num_steps, *batch, self.train_targets.shape[-1], self.num_classes)
        stored = self._latent_modes if use_stored_modes else None
        if stored is not None and stored.shape != shape:
            stored = None
        check_class_memory(
            f"{type(self).__name__}.fit",
            self.train_inputs,
            batch,
            self.num_classes,
            self.num_steps,
            dense=self.num_steps > 1,
        )
        shared = FittedModules(self.covar_module, self.mean_module)
        posteriors: list[MulticlassLaplacePosterior] = []
        fitted_targets: list[Tensor] = []
        self.newton_iterations = []
        self.refit_history = []
        with torch.no_grad():
            chain = data_centric_chain(
                self.train_inputs,
                self.train_targets,
                self.covar_module,
                self.mean_module,
                self.noise,
                self.num_classes,
                max_iter=self.max_iter,
                num_samples=self.num_samples,
                warm_start=self.warm_start,
                stored_modes=stored,
            )
            task = f"{type(self).__name__}.fit"
            with ProgressReporter(task, self.num_steps, progress, callback) as report:
                for step, posterior in enumerate(chain, start=1):
                    posteriors.append(posterior)
                    fitted_targets.append(posterior.train_targets)
                    self.newton_iterations.append(posterior.iterations)
                    self.refit_history.append([])
                    targets, mode = posterior.train_targets, posterior.mode
                    if self._step_targets[step - 1].shape != targets.shape:
                        self._step_targets = targets.new_zeros(self.num_steps, *targets.shape)
                        self._latent_modes = torch.zeros_like(self._step_targets)
                    self._step_targets[step - 1] = targets
                    self._latent_modes[step - 1] = mode
                    loss = -float(posterior.log_marginal_likelihood().sum())
                    info = {"newton_iterations": posterior.iterations}
                    if report.update(step, loss=loss, **info) or step == self.num_steps:
                        break
            self.is_fitted.fill_(True)
        modules = (shared,) * len(posteriors)
        return _DataCentricClassFit(tuple(posteriors), tuple(fitted_targets), modules)

    def fit(
        self,
        *,
        use_stored_modes: bool = False,
        progress: object = False,
        callback: Callback | None = None,
    ) -> DataCentricGPC:
        """Fit the ``num_steps`` steps at the current kernel hyperparameters; returns ``self``.

        The model also fits lazily, on first use (warm-started from the stored modes), and refits
        when the fit is stale: when a parameter or buffer of ``covar_module`` or ``mean_module``,
        the training data or ``noise`` has another value, shape, dtype or device (an optimiser step,
        a write through ``.data``, an assignment, ``load_state_dict``, ``.to()``), when a setting of
        the model (``soft_target_likelihood``, ``threshold_targets``, ``target_method``,
        ``warm_start``, ``max_iter``, ``refit_hyperparameters``, ``refit_max_iter``, ``refit_lr``,
        ``num_samples`` for :math:`K > 2` classes) or a :mod:`gpsd.settings` value that can change a
        result has changed, and after a backward pass through the fit's graph (the steps are fitted
        without autograd, so a gradient needed later does not refit). Nothing else refits: a fit
        made under grad mode serves predictions under ``torch.no_grad()`` as it is, and copies and
        pickles of the model refit on first use.

        Each step is one iteration for ``progress`` and ``callback`` (the record's ``loss`` is the
        step's negative Laplace log marginal likelihood, summed over the batch); a callback that
        returns ``True`` after step ``k`` leaves steps ``1..k`` fitted, and predictions then hold
        those steps alone until the next fit. With ``refit_hyperparameters`` the callback also
        sees every Adam iteration of step ``t``'s refit, as this task's records in the phase
        ``"refit of step t"`` (``True`` there ends the fit after step ``t``).

        :param use_stored_modes: Start each step from the stored mode (after ``load_state_dict``;
            with ``refit_hyperparameters`` each refit starts its Newton runs afresh).
        :param progress: ``True`` for a ``tqdm`` bar, or a bar of your own (:mod:`gpsd.progress`).
        :param callback: Called after each step with an :class:`~gpsd.IterationRecord`.
        """
        check_progress(progress, callback)
        self._refit(use_stored_modes=use_stored_modes, progress=progress, callback=callback)
        return self

    @property
    def step_covar_modules(self) -> tuple[Kernel, ...]:
        """The kernel of each fitted step, entry ``t - 1`` for step ``t`` (fitted first where
        needed): with ``refit_hyperparameters``, each step's own copy with its fitted
        hyperparameters (constants: their ``requires_grad`` is off); otherwise
        :attr:`covar_module` for every step."""
        return tuple(modules.covar_module for modules in self._current_fit().modules)

    @property
    def step_mean_modules(self) -> tuple[Mean, ...]:
        """The prior mean of each fitted step, entry ``t - 1`` for step ``t``, as
        :attr:`step_covar_modules`."""
        return tuple(modules.mean_module for modules in self._current_fit().modules)

    def _fitted_steps(self) -> int:
        return len(self._current_fit().modules)

    def step_targets(self, step: int | None = None) -> Tensor:
        r"""The targets each fitted step is fitted to (fitted first where needed):
        ``(*batch, T, n)``, row ``t - 1`` holding :math:`\mathbf y_t` (row 0 the labels), or
        :math:`\mathbf y_t` alone for ``step=t``, ``(*batch, n)``; for :math:`K > 2` classes
        ``(*batch, T, n, K)``, row 0 the one-hot labels. After a fit that a callback
        stopped at step ``k``, the ``k`` fitted steps.

        :param step: a step ``t`` in ``1..T`` (default: every fitted step).
        """
        targets = self._current_fit().targets
        return self._rows_of_steps([targets[t - 1] for t in self._steps(step)], step)

    def latent_modes(self, step: int | None = None) -> Tensor:
        r"""The Laplace modes :math:`\hat{\mathbf f}_t` of the fitted steps at the training
        inputs (fitted first where needed), laid out as :meth:`step_targets`:
        ``(*batch, T, n)``, or ``(*batch, n)`` for ``step=t``; for :math:`K > 2` classes
        ``(*batch, T, n, K)``.

        :param step: a step ``t`` in ``1..T`` (default: every fitted step).
        """
        fit = self._current_fit()
        if self.num_classes > 2:
            rows = [fit.posteriors[t - 1].mode for t in self._steps(step)]
        else:
            rows = [fit.modes[t - 1].f for t in self._steps(step)]
        return self._rows_of_steps(rows, step)

    def _class_posterior(self, step: int) -> tuple[MulticlassLaplacePosterior, FittedModules]:
        fit = self._current_fit()
        return fit.posteriors[step - 1], fit.modules[step - 1]

    def _latent_at_step(self, x: Tensor, step: int) -> tuple[Tensor, Tensor]:
        fit = self._current_fit()
        mode, modules = fit.modes[step - 1], fit.modules[step - 1]
        with constant_parameters(self):
            K_cross, K_diag, prior_mean = prior_at_test(
                modules.covar_module, modules.mean_module, x, self.train_inputs, diag=True
            )
        mean, var = laplace_latent_predictive(mode, K_cross, K_diag, prior_mean, diag=True)
        return mean, nonnegative_variance(var, K_diag)

    def _positive_probability(self, mean: Tensor, variance: Tensor, method: str) -> Tensor:
        if method == "probit":
            return probit_approximation(mean, variance)
        return symmetric_response_expectation(torch.sigmoid, mean, variance)
