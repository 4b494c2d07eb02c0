r"""Distribution-centric self-distillation for GP classification (Borup & Andersen, §4.2)."""

from __future__ import annotations

import copy
import dataclasses

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
    fixed_setting,
)
from gpsd._internal.progress_reporter import ProgressReporter
from gpsd._internal.validation import check_gp_modules, check_int
from gpsd._internal.variance import nonnegative_variance
from gpsd.distillation._gpc_steps import (
    FittedModules,
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
    infer_num_classes,
    refuse_for_classes,
    tempered_posterior,
)
from gpsd.laplace import (
    ClassificationTrainingData,
    LaplacePosterior,
    MulticlassLaplacePosterior,
    checked_classification_data,
    closed_form_probability,
    constant_parameters,
    expected_response,
    likelihood_module,
    prior_at_test,
    prior_at_training,
    resolve_likelihood_terms,
)
from gpsd.progress import Callback

__all__ = ["DistributionCentricGPC"]

_METHODS = ("iterated", "tempered", "scaled_kernel")
#: N x N matrices a fit holds at its peak besides the steps' posteriors it keeps (T, or one
#: without ``store_all_steps``), per problem of the batch: the recursion's prior, correction and
#: products, and Newton's factorisation (``"iterated"``), or Newton's factorisation and the step's
#: posterior (the approximations). At N = 2500 to 4000 on the CPU for T = 1, 2, 4, a fit's peak
#: resident memory over one float64 matrix is 11 to 13 (``"iterated"``) and 7 (``"tempered"``)
#: plus the posteriors kept.
_WORKING_MATRICES = {"iterated": 11, "tempered": 7, "scaled_kernel": 7}


@dataclasses.dataclass(frozen=True, eq=False)
class _StepPosterior:
    r"""One step's posterior, :math:`m_t(x) = m(x) + k(x, \mathbf X)\mathbf c_t` and
    :math:`k_t(x, x') = s_t k(x, x') - k(x, \mathbf X) \mathbf Q_t k(\mathbf X, x')`.

    :param mode: The Laplace mode :math:`\hat{\mathbf f}_t` at the training inputs, ``(*batch, n)``.
    :param coefficients: :math:`\mathbf c_t`, ``(*batch, n)``.
    :param correction: :math:`\mathbf Q_t`, ``(*batch, n, n)``.
    """

    mode: Tensor
    coefficients: Tensor
    correction: Tensor


@dataclasses.dataclass(frozen=True, eq=False)
class _DistributionCentricFit:
    """A :class:`DistributionCentricGPC`'s fit, by step (counted from 1).

    :param steps: The posterior of each step computed: every step the recursion reached
        (``"iterated"``), or step ``T`` (the approximations), and the steps computed on request
        after the fit (the approximations); without ``store_all_steps``, step ``T`` and the last
        other step computed alone.
    :param modules: The kernel and prior mean of each step computed with
        ``refit_hyperparameters`` (empty without).
    :param class_steps: For :math:`K > 2` classes (where :attr:`steps` is empty), the tempered
        posterior of each step computed, kept as :attr:`steps` keeps the approximations'.
    """

    steps: dict[int, _StepPosterior] = dataclasses.field(default_factory=dict)
    modules: dict[int, FittedModules] = dataclasses.field(default_factory=dict)
    class_steps: dict[int, MulticlassLaplacePosterior] = dataclasses.field(default_factory=dict)


class DistributionCentricGPC(
    Fitted, StepwiseClassifier, ClassificationTrainingData, gpytorch.Module
):
    r"""Distribution-centric self-distillation of a Laplace GP classifier (Borup & Andersen, §4.2).

    The Laplace posterior of step :math:`t` becomes the prior of step :math:`t + 1`, always with the
    original labels (eqs. 14-15):

    .. math::

        m_{t+1}(x) = m_t(x) + k_t(x, \mathbf X) \mathbf K_t^{-1}(\hat{\mathbf f}_t - m_t(\mathbf X)),
        \qquad
        k_{t+1}(x, x') = k_t(x, x') - k_t(x, \mathbf X)(\mathbf K_t + \mathbf W_t^{-1})^{-1}
        k_t(\mathbf X, x').

    Every posterior is kept in the form :math:`m_t(x) = m(x) + k(x, \mathbf X)\mathbf c_t`,
    :math:`k_t(x, x') = s_t k(x, x') - k(x, \mathbf X) \mathbf Q_t k(\mathbf X, x')`, so predictions
    cost :math:`O(n^2)` per test point at any step. Three methods (``method``):

    * ``"iterated"``: the recursion itself, :math:`t` Newton solves (cost linear in :math:`t`).
    * ``"tempered"``: one Laplace fit of the likelihood raised to the power :math:`t` under the prior
      :math:`\mathcal{GP}(m, k)`, i.e. the data duplicated :math:`t` times. Its covariance is
      :math:`(\mathbf K^{-1} + t\mathbf W)^{-1}`; this is the posterior that :math:`t` iterations
      approximate (they coincide exactly for a Gaussian likelihood). Constant cost in :math:`t`.
    * ``"scaled_kernel"``: the paper's approximation, prior :math:`\mathcal{GP}(m, t k)` and the
      likelihood once. It preserves the *mode* and the latent predictive *mean* of the tempered
      posterior (Prop. 4.2 A), but its latent covariance is :math:`t` times larger,
      :math:`t(\mathbf K^{-1} + t\mathbf W)^{-1}`, so the predicted class probabilities
      :math:`\mathbb{E}_q[\sigma(f)]` are pulled towards 1/2 (the MAP decision boundary is the same).
      Constant cost in :math:`t`.

    Step 1 of every method is the ordinary Laplace GPC.

    **K classes.** Labels in :math:`0, \dots, K - 1` with :math:`K > 2` (``num_classes``, or one
    more than the largest label) give :math:`K` latent functions, independent a priori,
    :math:`\mathbf f_c \sim \mathcal{GP}(m_c, k_c)` (``covar_module`` and ``mean_module``
    shared by the classes unless they have batch shape ``(K,)``, entry :math:`c` class
    :math:`c`'s), and the softmax likelihood (``likelihood`` stays ``"bernoulli_logit"``, read
    as its :math:`K`-class counterpart, or is ``"softmax"``). Only ``"tempered"`` is available:
    step :math:`t` is the Laplace approximation of the softmax likelihood raised to the power
    :math:`t` under the original prior,

    .. math::

        q_t(\mathbf f) \propto \prod_i p(y_i \mid \mathbf f_i)^t \,
        \mathcal N(\mathbf f \mid \mathbf m, \operatorname{blockdiag}_c \mathbf K_c),

    whose prior stays block-diagonal over the classes (a
    :class:`~gpsd.laplace.MulticlassLaplacePosterior` of
    :class:`~gpsd.laplace.TemperedSoftmaxTerms`; its tempered Hessian blocks
    :math:`t(\operatorname{diag}\boldsymbol\pi_i - \boldsymbol\pi_i\boldsymbol\pi_i^\top)` are
    factored densely, :math:`O(K^3 n^3)` per Newton iteration). ``"iterated"`` and
    ``"scaled_kernel"`` are refused: the posterior covariance that ``"iterated"`` carries into the
    next prior couples the classes, :math:`(\mathbf K^{-1} + \mathbf W)^{-1}` with :math:`\mathbf W`
    dense over the classes at each point, and the engine takes priors independent per class;
    ``"scaled_kernel"`` approximates the iterated chain the same way. Class probabilities are Monte
    Carlo averages over ``num_samples`` draws, the same for every point and at every call (a
    generator seeded with 0); :meth:`predict_proba` has a trailing class axis of size :math:`K`,
    :meth:`latent_modes` and :meth:`step_targets` (one-hot labels) are ``(*batch, T, n, K)``.
    ``refit_hyperparameters`` is refused. The steps' posteriors are not part of ``state_dict``: a
    loaded state refits on first use. At :math:`K = 2` the binary model above is fitted.

    By default every step shares the kernel and prior mean as given. With
    ``refit_hyperparameters=True``, step :math:`t` gets its own copies of them, whose
    hyperparameters maximise the Laplace marginal likelihood (plus any hyperpriors) of step
    :math:`t`'s model on the labels: ``refit_max_iter`` Adam iterations at learning rate
    ``refit_lr`` from ``covar_module``'s and ``mean_module``'s values, exactly as
    :meth:`~gpsd.LaplaceGPClassifier.optimize_hyperparameters` does. Step :math:`t`'s model is,
    for ``"tempered"``, the likelihood raised to the power :math:`t` under
    :math:`\mathcal{GP}(m, k)`; for ``"scaled_kernel"``, the likelihood once under
    :math:`\mathcal{GP}(m, t k)` (a free output scale absorbs the factor :math:`t`, so that
    every step then equals step 1); for ``"iterated"``, the :math:`t`-fold duplicated data that
    :math:`t` iterations approximate, i.e. the tempered model's evidence
    :math:`\int p(\mathbf y \mid \mathbf f)^t\,p(\mathbf f)\,d\mathbf f` (for a Gaussian
    likelihood, exactly the product of the :math:`t` steps' marginal likelihoods), after which
    the recursion runs its :math:`t` steps with those hyperparameters (:math:`T(T+1)/2` Newton
    solves for :math:`T` steps). Parameters that do not require a gradient stay fixed, as do
    the likelihood's own; a batch of labels shares one set of hyperparameters unless the kernel
    has that batch shape. :attr:`step_covar_modules` and :attr:`step_mean_modules` hold each
    step's modules, :attr:`refit_history` the losses of each refit. The refitted modules are
    not part of ``state_dict``.

    The model fits lazily: :meth:`fit` need not be called (the first prediction fits), and
    predictions refit (as :meth:`fit` does) when the fit is stale (:meth:`fit` lists when), so
    that every step belongs to the current model. Predictions hold every step along a step
    dimension before the test points (row ``t - 1`` for step ``t``); ``step=t`` selects one.
    The steps' posteriors in ``state_dict`` (``coefficients``, ``covariance_corrections`` and
    the modes) record the last fit; a loaded state is refitted on first use, its modes the
    warm starts of the approximations. A state saved by a model with another ``num_steps`` is
    refused.
    Predictions are differentiable in the test inputs; the hyperparameters are constants to them
    (the steps are fitted without autograd, so a gradient through the test-point kernel alone
    would be wrong). The training data are stored detached. Every step is computed in the
    training inputs' dtype, whatever the dtype of the kernel and the mean. In float32,
    ``"iterated"`` loses accuracy with the number of steps where the
    kernel matrix is ill-conditioned (each step forms :math:`\mathbf K_t = \mathbf K(\mathbf I
    - \mathbf Q_t \mathbf K)` explicitly): class probabilities 1.7e-3 off the float64 ones at
    :math:`T = 10` with lengthscale 8, outputscale 50 and 40 points, where ``"tempered"`` is
    8e-5 off; fit in float64 where that matters.

    :param train_x: Training inputs ``(n, d)`` or ``(n,)``, float32 or float64.
    :param train_y: Labels ``(*batch, n)`` for the likelihood (0/1 for the Bernoulli ones), or in
        ``0 ... K - 1`` for :math:`K > 2` classes.
    :param covar_module: The kernel :math:`k`: every step's, or the starting point of every
        step's refit with ``refit_hyperparameters``.
    :param mean_module: Prior mean (default zero).
    :param num_steps: :math:`T \ge 1`.
    :param method: ``"iterated"``, ``"tempered"`` or ``"scaled_kernel"``.
    :param likelihood: As for :class:`~gpsd.laplace.LaplaceGPClassifier` (default logistic).
    :param max_iter: Newton iterations allowed per Laplace fit.
    :param store_all_steps: Keep every step's posterior (``T`` matrices of size ``n x n``) so that
        any step can be predicted; with ``False`` only the last step is kept (``"iterated"`` then
        predicts only step ``T``; the approximations recompute other steps on request).
    :param refit_hyperparameters: Refit the kernel's and the prior mean's hyperparameters at
        every step (see above); ``False`` keeps them as given for every step.
    :param refit_max_iter: Adam iterations of each step's refit.
    :param refit_lr: Adam's learning rate of each step's refit.
    :param num_classes: :math:`K \ge 2` (default: one more than the largest label, and 2 for
        labels in {0, 1}); give it where a class has no training label.
    :param num_samples: Monte Carlo draws of the class probabilities for :math:`K > 2` classes.

    Example:

        >>> model = DistributionCentricGPC(x, y, ScaleKernel(RBFKernel()), num_steps=10).fit()
        >>> probs = model.predict_proba(test_x)  # shape: (10, M, 2)
        >>> t = model.best_step(val_x=val_x, val_y=val_y)
    """

    def __init__(
        self,
        train_x: Tensor,
        train_y: Tensor,
        covar_module: Kernel,
        *,
        mean_module: Mean | None = None,
        num_steps: int = 10,
        method: str = "iterated",
        likelihood: object = "bernoulli_logit",
        max_iter: int = 100,
        store_all_steps: bool = True,
        refit_hyperparameters: bool = False,
        refit_max_iter: int = 50,
        refit_lr: float = 0.05,
        num_classes: int | None = None,
        num_samples: int = DEFAULT_NUM_SAMPLES,
    ) -> None:
        super().__init__()
        check_gp_modules(covar_module, mean_module)
        num_steps = check_int(num_steps, "num_steps")
        refit = check_refit_options(refit_hyperparameters, refit_max_iter, refit_lr)
        self.refit_hyperparameters, self.refit_max_iter, self.refit_lr = refit
        self._num_classes = infer_num_classes(train_y, num_classes)
        self.num_samples = num_samples
        if self.num_classes > 2:
            if not (isinstance(likelihood, str) and likelihood in ("bernoulli_logit", "softmax")):
                refuse_for_classes(
                    self.num_classes, "likelihood", likelihood, "pass 'softmax' (or the default)"
                )
            self.terms = SoftmaxLabelTerms(self.num_classes)
        else:
            self.terms = resolve_likelihood_terms(likelihood)
        train_x, train_y = checked_classification_data(train_x, train_y, self.terms)
        module = likelihood_module(likelihood, self.terms) if self.num_classes == 2 else None
        if module is not None:
            self.likelihood = module  # its parameters train with the kernel's; a change refits
        self.covar_module = covar_module
        self.mean_module = mean_module if mean_module is not None else ZeroMean()
        if self.refit_hyperparameters:
            check_trainable(self.covar_module, self.mean_module)
        self._init_steps(num_steps)
        self.method = method
        self.max_iter = check_int(max_iter, "max_iter")
        self._check_class_settings()
        n = train_x.shape[-2]
        self._store_all_steps = bool(store_all_steps)
        # the posteriors of K > 2 classes are kept in the fit alone, not in the buffers
        T = 0 if self.num_classes > 2 else num_steps if self.store_all_steps else 1
        # the buffers below hold T posteriors of N x N: refused before they are allocated
        self._check_memory(type(self).__name__, train_x, train_y)
        self.register_buffer("train_inputs", train_x)
        self.register_buffer("train_targets", train_y)
        # per kept step, (T, *batch, n) (T = 1 without store_all_steps): latent_modes() lays
        # them out
        self.register_buffer("_latent_modes", train_x.new_zeros(T, *train_y.shape))
        self.register_buffer("coefficients", train_x.new_zeros(T, *train_y.shape))
        self.register_buffer("covariance_corrections", train_x.new_zeros(T, *train_y.shape, n))
        self.register_buffer(
            "computed_steps", torch.zeros(num_steps, dtype=torch.bool, device=train_x.device)
        )
        #: Newton iterations of each step computed, by step (counted from 1)
        self.newton_iterations: dict[int, int] = {}
        #: the loss of every Adam iteration of each step's refit, by step (counted from 1;
        #: empty without ``refit_hyperparameters``)
        self.refit_history: dict[int, list[float]] = {}

    store_all_steps = fixed_setting("store_all_steps", "Whether every step's posterior is kept.")

    method = choice_setting(
        "method",
        _METHODS,
        '``"iterated"``, ``"tempered"`` or ``"scaled_kernel"``; a new one refits on use.',
    )

    def _check_class_settings(self) -> None:
        """For :math:`K > 2` classes, a ``ValueError`` naming ``method`` unless it is
        ``"tempered"``, ``refit_hyperparameters`` unless it is off, or a module of another batch
        shape than ``()`` or ``(K,)``."""
        if self.num_classes == 2:
            return
        K = self.num_classes
        if self.method != "tempered":
            refuse_for_classes(
                K,
                "method",
                self.method,
                "pass method='tempered': the iterated posterior couples the classes in the next "
                "step's prior, which the multiclass Laplace engine takes independent per class "
                "(and 'scaled_kernel' approximates that chain)",
            )
        if self.refit_hyperparameters:
            refuse_for_classes(K, "refit_hyperparameters", True, "pass refit_hyperparameters=False")
        check_class_modules(self.covar_module, self.mean_module, K)

    def _fit_dependencies(self) -> FitDependencies:
        """The kernel, the mean, the likelihood (where it is a module), the training data and
        ``method``, ``max_iter``, ``store_all_steps``, the refit settings and ``num_classes``."""
        refit = (self.refit_hyperparameters, self.refit_max_iter, self.refit_lr)
        return FitDependencies(
            (self.covar_module, self.mean_module, getattr(self, "likelihood", None)),
            (self.train_inputs, self.train_targets),
            (self.method, self.max_iter, self.store_all_steps, refit, self.num_classes),
        )

    _resizable_buffers = (
        "_latent_modes",
        "coefficients",
        "covariance_corrections",
        "train_inputs",
        "train_targets",
    )

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        check_saved_num_steps(self, state_dict.get(prefix + "computed_steps"))
        return super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _check_memory(self, task: str, x: Tensor, y: Tensor) -> None:
        """Raise :class:`~gpsd.InsufficientMemoryError` before a fit on inputs ``x`` and targets
        ``y`` that would not fit in the device's free memory (:data:`_WORKING_MATRICES`)."""
        kept = self.num_steps if self.store_all_steps else 1
        if self.num_classes > 2:
            check_class_memory(task, x, y.shape[:-1], self.num_classes, kept + 1, dense=True)
            return
        advice = "train on fewer points, or fit in float32 for half the bytes"
        if kept > 1:
            advice = f"pass store_all_steps=False to keep one step's posterior, {advice}"
        check_dense_matrices_fit(
            task,
            _WORKING_MATRICES[self.method] + kept,
            x,
            torch.broadcast_shapes(y.shape[:-1], self.covar_module.batch_shape),
            f"the kernel matrix, the {self.method!r} method's working matrices and the "
            f"posteriors of the {kept} steps it keeps",
            advice,
        )

    def _prior(self) -> tuple[Tensor, Tensor]:
        return prior_at_training(
            self.covar_module, self.mean_module, self.train_inputs, self.train_targets
        )

    def _slot(self, step: int) -> int | None:
        if self.store_all_steps:
            return step - 1
        return 0 if step == self.num_steps else None

    def _store(
        self, fit: _DistributionCentricFit, step: int, f: Tensor, c: Tensor, Q: Tensor
    ) -> None:
        """Keep step ``step``'s posterior in ``fit``, and in the buffers where they keep it
        (the warm starts of later fits, saved in ``state_dict``)."""
        slot = self._slot(step)
        if slot is None:  # not kept in the buffers: the last such step alone in the fit
            for other in [t for t in fit.steps if self._slot(t) is None]:
                del fit.steps[other]
        fit.steps[step] = _StepPosterior(f, c, Q)
        if slot is None:
            return
        T = self.num_steps if self.store_all_steps else 1
        # the kernel added a batch shape, or a loaded state held another number of steps
        if self.coefficients.shape != (T, *c.shape):
            self._latent_modes = f.new_zeros(T, *f.shape)
            self.coefficients = c.new_zeros(T, *c.shape)
            self.covariance_corrections = Q.new_zeros(T, *Q.shape)
        self._latent_modes[slot] = f
        self.coefficients[slot] = c
        self.covariance_corrections[slot] = Q
        self.computed_steps[step - 1] = True

    def _nearest_mode(self, step: int) -> Tensor | None:
        done = [s for s in range(1, self.num_steps + 1) if bool(self.computed_steps[s - 1])]
        done = [s for s in done if self._slot(s) is not None]
        if not done:
            return None
        nearest = min(done, key=lambda s: abs(s - step))
        return self._latent_modes[self._slot(nearest)]

    def _refit_modules(
        self,
        fit: _DistributionCentricFit,
        step: int,
        temperature: float = 1.0,
        scale: float = 1.0,
        callback: Callback | None = None,
    ) -> LaplacePosterior:
        r"""Refit step ``step``'s kernel and prior mean (:func:`refit_step_modules`) for the
        likelihood raised to ``temperature`` under :math:`\mathcal{GP}(m, s k)`, ``s = scale``;
        keeps them and returns the Laplace posterior there (for the kernel ``scale`` times the
        refitted one).
        ``callback`` sees every Adam iteration of the refit."""
        check_trainable(self.covar_module, self.mean_module)
        kernel = self.covar_module
        if scale != 1.0:  # s k: a ScaleKernel whose fixed output scale is s
            kernel = copy.deepcopy(kernel)
            like = next(iter(kernel.parameters()), self.train_inputs)
            kernel = gpytorch.kernels.ScaleKernel(kernel, batch_shape=kernel.batch_shape)
            kernel = kernel.to(dtype=like.dtype, device=like.device)
            kernel.outputscale = torch.full_like(kernel.outputscale, scale)
            kernel.raw_outputscale.requires_grad_(False)
        modules, posterior = refit_step_modules(
            self.train_inputs,
            self.train_targets,
            kernel,
            self.mean_module,
            self.terms,
            temperature=temperature,
            max_iter=self.max_iter,
            refit_max_iter=self.refit_max_iter,
            refit_lr=self.refit_lr,
            callback=callback,
        )
        if scale != 1.0:
            modules.covar_module = modules.covar_module.base_kernel
        fit.modules[step] = modules
        self.refit_history[step] = modules.history
        return posterior

    def _step_modules_at(self, step: int) -> FittedModules:
        """The kernel and prior mean of step ``step`` (in 1..``_fitted_steps()``)."""
        if not self.refit_hyperparameters:
            return FittedModules(self.covar_module, self.mean_module)
        fit = self._current_fit()
        if step not in fit.modules:  # a step of an approximation that was not kept
            with torch.no_grad():
                self._fit_approximation(fit, step)
        return fit.modules[step]

    @property
    def step_covar_modules(self) -> tuple[Kernel, ...]:
        """The kernel of each fitted step, entry ``t - 1`` for step ``t`` (fitted first where
        needed): with ``refit_hyperparameters``, each step's own copy with its fitted
        hyperparameters (constants: their ``requires_grad`` is off); otherwise
        :attr:`covar_module` for every step."""
        steps = range(1, self._fitted_steps() + 1)
        return tuple(self._step_modules_at(t).covar_module for t in steps)

    @property
    def step_mean_modules(self) -> tuple[Mean, ...]:
        """The prior mean of each fitted step, entry ``t - 1`` for step ``t``, as
        :attr:`step_covar_modules`."""
        steps = range(1, self._fitted_steps() + 1)
        return tuple(self._step_modules_at(t).mean_module for t in steps)

    def _fit_approximation(
        self, fit: _DistributionCentricFit, step: int, callback: Callback | None = None
    ) -> None:
        t = float(step)
        scale = t if self.method == "scaled_kernel" else 1.0
        temperature = 1.0 if self.method == "scaled_kernel" else t
        if self.refit_hyperparameters:
            posterior = self._refit_modules(fit, step, temperature, scale, callback)
        else:
            m, K = self._prior()
            if scale != 1.0:
                K = scale * K  # the posterior keeps it: the unscaled matrix is freed
            posterior = LaplacePosterior(
                m,
                K,
                self.terms,
                self.train_targets,
                init_f=self._nearest_mode(step),
                temperature=temperature,
                max_iter=self.max_iter,
            )
        S = posterior.covariance_correction()
        mode = posterior.mode
        # mean m + (sK)(x, X) a ; cov s k - s^2 k(x,X) S k(X,x)
        self._store(fit, step, mode.f, scale * mode.alpha, scale**2 * S)
        self.newton_iterations[step] = mode.iterations

    def _fit_iterated(self, fit: _DistributionCentricFit, report: ProgressReporter) -> None:
        if self.refit_hyperparameters:
            for step in range(1, self.num_steps + 1):
                self._refit_modules(
                    fit,
                    step,
                    temperature=float(step),
                    callback=report.forward(f"refit of step {step}"),
                )
                modules = fit.modules[step]
                m0, K0 = prior_at_training(
                    modules.covar_module,
                    modules.mean_module,
                    self.train_inputs,
                    self.train_targets,
                )
                *_, (mode, c, Q) = self._recursion(m0, K0, step)
                self._store(fit, step, mode.f, c, Q)
                self.newton_iterations[step] = mode.iterations
                loss = -float(mode.log_marginal_likelihood.sum())
                info = {"newton_iterations": mode.iterations}
                info["refit_iterations"] = len(modules.history)
                if report.stopped or report.update(step, loss=loss, **info):
                    break
            return
        m0, K0 = self._prior()
        for step, (mode, c, Q) in enumerate(self._recursion(m0, K0, self.num_steps), start=1):
            self._store(fit, step, mode.f, c, Q)
            self.newton_iterations[step] = mode.iterations
            loss = -float(mode.log_marginal_likelihood.sum())
            if report.update(step, loss=loss, newton_iterations=mode.iterations):
                break

    def _recursion(self, m0: Tensor, K0: Tensor, num_steps: int):
        r"""Steps ``1..num_steps`` of the recursion from the prior ``m0, K0``: yields each step's
        mode, coefficients :math:`\mathbf c_t` and correction :math:`\mathbf Q_t`."""
        n = K0.shape[-1]
        c = torch.zeros_like(m0)
        Q = torch.zeros_like(K0)
        eye = torch.eye(n, dtype=K0.dtype, device=K0.device)
        init = None
        for _ in range(num_steps):
            P = eye - Q @ K0  # k_{t-1}(x, X) = k(x, X) P
            K_prev = K0 @ P  # k_{t-1}(X, X)
            K_prev = 0.5 * (K_prev + K_prev.transpose(-1, -2))
            m_prev = m0 + (K0 @ c.unsqueeze(-1)).squeeze(-1)
            posterior = LaplacePosterior(
                m_prev, K_prev, self.terms, self.train_targets, init_f=init, max_iter=self.max_iter
            )
            S = posterior.covariance_correction()
            mode = posterior.mode
            c = c + (P @ mode.alpha.unsqueeze(-1)).squeeze(-1)
            Q = Q + P @ S @ P.transpose(-1, -2)
            Q = 0.5 * (Q + Q.transpose(-1, -2))
            init = mode.f
            yield mode, c, Q

    def fit(
        self, *, progress: object = False, callback: Callback | None = None
    ) -> DistributionCentricGPC:
        """Fit all ``num_steps`` steps (``"iterated"``) or only the last one (the
        approximations, which compute other steps when predicted); returns ``self``.

        The model also fits lazily, on first use, and refits when the fit is stale: when a
        parameter or buffer of ``covar_module``, ``mean_module`` or the likelihood, or the
        training data has another value, shape, dtype or device (an optimiser step, a write
        through ``.data``, an assignment, ``load_state_dict``, ``.to()``), when a setting of the
        model (``method``, ``max_iter``, ``refit_hyperparameters``, ``refit_max_iter``,
        ``refit_lr``) or a :mod:`gpsd.settings` value that can change a result has changed, and
        after a backward pass through the fit's graph (the steps are fitted without autograd, so
        a gradient needed later does not refit). Nothing else refits: a fit made under grad mode
        serves predictions under ``torch.no_grad()`` as it is, and copies and pickles of the
        model refit on first use.

        For ``"iterated"`` each step is one
        iteration for ``progress`` and ``callback`` (the record's ``loss`` is the step's negative
        Laplace log marginal likelihood, summed over the batch), and a callback that returns
        ``True`` after step ``k`` leaves steps ``1..k`` fitted (predictions then hold those steps
        alone until the next fit); the approximations report their one Laplace fit. With
        ``refit_hyperparameters`` the callback also sees every Adam iteration of the refits, as
        this task's records in the phase ``"refit of step t"`` (the approximations: ``"refit"``);
        ``True`` there ends the fit after that step.

        :param progress: ``True`` for a ``tqdm`` bar, or a bar of your own (:mod:`gpsd.progress`).
        :param callback: Called after each iteration with an :class:`~gpsd.IterationRecord`.
        """
        return super().fit(progress=progress, callback=callback)

    def _compute_fit(
        self, progress: object = False, callback: Callback | None = None
    ) -> _DistributionCentricFit:
        self._check_memory(f"{type(self).__name__}.fit", self.train_inputs, self.train_targets)
        total = self.num_steps if self.method == "iterated" else 1
        task = f"{type(self).__name__}.fit"
        fit = _DistributionCentricFit()
        with torch.no_grad(), ProgressReporter(task, total, progress, callback) as report:
            self.computed_steps.fill_(False)
            self.newton_iterations = {}
            self.refit_history = {}
            if self.num_classes > 2:
                self._check_class_settings()
                posterior = self._fit_class_step(fit, self.num_steps)
                report.update(1, newton_iterations=posterior.iterations)
            elif self.method == "iterated":
                self._fit_iterated(fit, report)
            else:
                self._fit_approximation(fit, self.num_steps, report.forward("refit"))
                step = self.num_steps
                if not report.stopped:
                    report.update(1, newton_iterations=self.newton_iterations[step])
        return fit

    def _fit_class_step(
        self, fit: _DistributionCentricFit, step: int
    ) -> MulticlassLaplacePosterior:
        """For :math:`K > 2` classes: the tempered posterior of step ``step``, kept in ``fit``
        (without ``store_all_steps``, with step ``T``'s alone); Newton's method starts from the
        mode of the nearest step fitted."""
        fitted = list(fit.class_steps)
        nearest = min(fitted, key=lambda t: abs(t - step)) if fitted else None
        posterior = tempered_posterior(
            self.train_inputs,
            self.train_targets,
            self.covar_module,
            self.mean_module,
            self.num_classes,
            float(step),
            max_iter=self.max_iter,
            init_alpha=None if nearest is None else fit.class_steps[nearest].alpha,
        )
        self.newton_iterations[step] = posterior.iterations
        if not self.store_all_steps:
            for other in [t for t in fit.class_steps if t != self.num_steps]:
                del fit.class_steps[other]
        fit.class_steps[step] = posterior
        return posterior

    def _class_posterior(self, step: int) -> tuple[MulticlassLaplacePosterior, FittedModules]:
        fit = self._current_fit()
        posterior = fit.class_steps.get(step)
        if posterior is None:
            with torch.no_grad():
                posterior = self._fit_class_step(fit, step)
        return posterior, FittedModules(self.covar_module, self.mean_module)

    def _fitted_steps(self) -> int:
        fit = self._current_fit()
        if self.method != "iterated":
            return self.num_steps
        kept = [t for t in fit.steps if self._slot(t) is not None]
        return max(kept, default=0)  # the last step the recursion reached

    def _state(self, step: int) -> tuple[float, _StepPosterior]:
        r"""The scale :math:`s_t` and the posterior of step ``step`` (in
        1..``_fitted_steps()``), computed where an approximation's step is not kept."""
        scale = float(step) if self.method == "scaled_kernel" else 1.0
        fit = self._current_fit()
        if self.method == "iterated":
            if step not in fit.steps or self._slot(step) is None:
                raise ValueError(
                    f"step {step} was not kept: predict step={self.num_steps} alone, or fit "
                    "with store_all_steps=True to predict every step"
                )
        elif step not in fit.steps:
            with torch.no_grad():
                self._fit_approximation(fit, step)
        return scale, fit.steps[step]

    def latent_modes(self, step: int | None = None) -> Tensor:
        r"""The Laplace modes :math:`\hat{\mathbf f}_t` of the fitted steps at the training
        inputs (fitted first where needed): ``(*batch, T, n)``, row ``t - 1`` for step ``t``, or
        ``(*batch, n)`` for ``step=t``; for :math:`K > 2` classes ``(*batch, T, n, K)``. Steps
        that the model does not keep are computed as a prediction of them would be (the
        approximations), or refused as it would be (``"iterated"`` without ``store_all_steps``).

        :param step: a step ``t`` in ``1..T`` (default: every fitted step).
        """
        if self.num_classes > 2:
            modes = [self._class_posterior(t)[0].mode for t in self._steps(step)]
        else:
            modes = [self._state(t)[1].mode for t in self._steps(step)]
        return self._rows_of_steps(modes, step)

    def step_targets(self, step: int | None = None) -> Tensor:
        """The targets each fitted step is fitted to: the labels at every step (the steps
        differ in their prior or likelihood, not in their targets), laid out as
        :meth:`latent_modes`: ``(*batch, T, n)``, or ``(*batch, n)`` for ``step=t``; for
        :math:`K > 2` classes their one-hot rows, ``(*batch, T, n, K)``.

        :param step: a step ``t`` in ``1..T`` (default: every fitted step).
        """
        steps = self._steps(step)
        if self.num_classes > 2:
            one_hot = self.terms.targets(self.train_targets, self.num_classes)
            return self._rows_of_steps([one_hot] * len(steps), step)
        mode = self._state(steps[0])[1].mode
        batch = torch.broadcast_shapes(self.train_targets.shape[:-1], mode.shape[:-1])
        labels = self.train_targets.expand(*batch, self.train_targets.shape[-1])
        return self._rows_of_steps([labels] * len(steps), step)

    def _latent_at_step(self, x: Tensor, step: int) -> tuple[Tensor, Tensor]:
        scale, posterior = self._state(step)
        c, Q = posterior.coefficients, posterior.correction
        modules = self._step_modules_at(step)
        with constant_parameters(self):
            K_cross, K_diag, prior_mean = prior_at_test(
                modules.covar_module, modules.mean_module, x, self.train_inputs, diag=True
            )
        mean = prior_mean + (K_cross @ c.unsqueeze(-1)).squeeze(-1)  # shape: (*batch, m)
        prior_var = scale * K_diag
        var = prior_var - ((K_cross @ Q) * K_cross).sum(-1)
        return mean, nonnegative_variance(var, prior_var)

    def _positive_probability(self, mean: Tensor, variance: Tensor, method: str) -> Tensor:
        if method == "probit":
            return closed_form_probability(self.terms, mean, variance)
        return expected_response(self.terms, mean, variance)
