r"""Data-centric self-distillation for GP classification (Borup & Andersen, §4.1)."""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence

import gpytorch
import numpy as np
import torch
from gpytorch.kernels import Kernel
from gpytorch.means import Mean, ZeroMean
from torch import Tensor

from gpsd._internal.module_state import (
    ModuleState,
    adopt_buffer_shapes,
    check_saved_num_steps,
    choice_setting,
    fixed_setting,
)
from gpsd._internal.validation import (
    check_gp_modules,
    check_int,
    check_test_inputs,
)
from gpsd._internal.variance import nonnegative_variance
from gpsd.laplace.prior import constant_parameters, prior_at_test, prior_at_training
from gpsd.laplace.training_data import ClassificationTrainingData, checked_classification_data
from gpsd.laplace.bernoulli_logit_terms import BernoulliLogitTerms
from gpsd.laplace.continuous_bernoulli_terms import ContinuousBernoulliTerms
from gpsd.laplace.newton import LaplaceMode, find_laplace_mode
from gpsd.laplace.predictive import (
    laplace_latent_predictive,
    probit_approximation,
    symmetric_response_expectation,
)

__all__ = ["DataCentricGPC"]


def _schedule(value: float | Sequence[float], num_steps: int, name: str) -> list[float]:
    if isinstance(value, numbers.Real) or (
        isinstance(value, (torch.Tensor, np.ndarray)) and value.ndim == 0
    ):
        values = [float(value)] * num_steps
    elif isinstance(value, Iterable) and not isinstance(value, str):
        values = [float(v) for v in value]
        if len(values) != num_steps:
            raise ValueError(f"{name} must have num_steps={num_steps} entries, got {len(values)}")
    else:
        raise TypeError(
            f"{name} must be a number or a sequence of num_steps={num_steps} numbers, "
            f"got {type(value).__name__}"
        )
    for v in values:
        if not (v >= 0 and v < float("inf")):
            raise ValueError(f"{name} must hold finite numbers >= 0, got {values}")
    return values


class DataCentricGPC(ClassificationTrainingData, gpytorch.Module):
    r"""Data-centric self-distillation of a Laplace GP classifier (Borup & Andersen, §4.1).

    Step 1 fits a Bernoulli-logistic Laplace GPC to the hard labels :math:`\mathbf y_0 \in \{0,1\}^N`.
    Step :math:`t \ge 2` fits a fresh GPC with the same prior :math:`\mathcal{GP}(m, k)` to the
    previous step's soft predictions at the training inputs,

    .. math::

        \mathbf y_{t-1} = \mathbb{E}_{q_{t-1}}[\sigma(\mathbf f)] \in [0, 1]^N,

    with the continuous Bernoulli likelihood (C-GPC, the well-specified model for soft targets)

    .. math::

        \log p(\mathbf y_{t-1} \mid \mathbf f_t) = \mathbf y_{t-1}^\top \mathbf f_t
        - \sum_n \log(1 + e^{f_{t,n}}) + \sum_n \log C(\sigma(f_{t,n})),

    or, for comparison (Fig. 4), the misspecified Bernoulli likelihood on the soft targets. Each step
    may add its own noise :math:`\gamma_t` to the kernel diagonal of the training inputs
    (:math:`\tilde{\mathbf K}_t = \mathbf K + \gamma_t \mathbf I`, Fig. 5), and the targets may be
    thresholded at 1/2 (Fig. 10). The kernel matrix is computed once; each step warm-starts Newton
    from the previous mode. Cost grows linearly in the number of steps (no closed form exists).

    Predictions refit every step (warm-started from the stored modes) when any parameter or buffer
    or a setting (``noise_schedule``, ``soft_target_likelihood``, ``threshold_targets``,
    ``target_method``, ``max_iter``) has changed since the last :meth:`fit`, so they always belong
    to the current hyperparameters. Predictions are differentiable in the test inputs; the
    hyperparameters are constants to them (the steps are fitted without autograd, so a gradient
    through the test-point kernel alone would be wrong). A state saved by a model with another
    ``num_steps`` is refused. The training data are stored detached. Every step is computed in
    the training inputs' dtype, whatever the dtype of the kernel and the mean.

    :param train_x: Training inputs ``(n, d)`` or ``(n,)``.
    :param train_y: Binary labels ``(*batch, n)`` in {0, 1}.
    :param covar_module: The (fixed) kernel :math:`k`, any GPyTorch kernel.
    :param num_steps: Number of steps :math:`T \ge 1` (step 1 is the ordinary GPC).
    :param mean_module: Prior mean (default zero).
    :param noise: :math:`\gamma_t`, one number or ``num_steps`` numbers (step 1 included).
    :param soft_target_likelihood: ``"continuous_bernoulli"`` (default) or ``"bernoulli"`` (the
        misspecified variant) for steps :math:`t \ge 2`.
    :param threshold_targets: Pass :math:`\mathbb 1[\mathbf y_{t-1} > 1/2]` instead of the soft
        predictions.
    :param warm_start: Start each Newton run from the previous step's mode.
    :param target_method: ``"quadrature"`` (:func:`~gpsd.laplace.symmetric_response_expectation`)
        or ``"probit"`` (MacKay's approximation) for :math:`\mathbb{E}_q[\sigma(f)]`.
    :param max_iter: Newton iterations allowed per Laplace fit.
    """

    def __init__(
        self,
        train_x: Tensor,
        train_y: Tensor,
        covar_module: Kernel,
        num_steps: int = 2,
        mean_module: Mean | None = None,
        noise: float | Sequence[float] = 0.0,
        soft_target_likelihood: str = "continuous_bernoulli",
        threshold_targets: bool = False,
        warm_start: bool = True,
        target_method: str = "quadrature",
        max_iter: int = 100,
    ) -> None:
        super().__init__()
        check_gp_modules(covar_module, mean_module)
        num_steps = check_int(num_steps, "num_steps")
        self.soft_target_likelihood = soft_target_likelihood
        self.threshold_targets = threshold_targets
        self.target_method = target_method
        train_x, train_y = checked_classification_data(train_x, train_y, self._target_terms)
        self.covar_module = covar_module
        self.mean_module = mean_module if mean_module is not None else ZeroMean()
        self._num_steps = num_steps
        self._noise_schedule = tuple(_schedule(noise, num_steps, "noise"))
        self.warm_start = bool(warm_start)
        self.max_iter = check_int(max_iter, "max_iter")
        self.register_buffer("train_inputs", train_x)
        self.register_buffer("train_targets", train_y)
        shape = (num_steps, *train_y.shape)
        self.register_buffer("step_targets", train_x.new_zeros(shape))
        self.register_buffer("latent_modes", train_x.new_zeros(shape))
        self.register_buffer("is_fitted", torch.tensor(False, device=train_x.device))
        self._modes: list[LaplaceMode] | None = None
        # the parameters, buffers and settings that self._modes were fitted at
        self._modes_state: tuple[ModuleState, tuple] | None = None
        self.newton_iterations: list[int] = []

    @property
    def _target_terms(self) -> BernoulliLogitTerms:
        """The training targets are 0/1 labels (the first step's Bernoulli likelihood)."""
        return BernoulliLogitTerms()

    num_steps = fixed_setting(
        "num_steps", ":math:`T` (the buffers hold one set of targets per step)."
    )

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

    @property
    def noise_schedule(self) -> tuple[float, ...]:
        """:math:`\\gamma_1, \\dots, \\gamma_T`; assigning a new schedule (one number, or
        ``num_steps`` numbers) refits on use."""
        return self._noise_schedule

    @noise_schedule.setter
    def noise_schedule(self, value: float | Sequence[float]) -> None:
        self._noise_schedule = tuple(_schedule(value, self.num_steps, "noise_schedule"))

    def _apply(self, fn, *args, **kwargs):
        self._modes = None
        return super()._apply(fn, *args, **kwargs)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        check_saved_num_steps(self, state_dict.get(prefix + "step_targets"))
        names = ("step_targets", "latent_modes", "train_inputs", "train_targets")
        adopt_buffer_shapes(self, state_dict, prefix, names)
        self._modes = None
        return super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _settings(self) -> tuple:
        """The settings besides the module's state that the fitted steps depend on."""
        return (
            self._noise_schedule,
            self.soft_target_likelihood,
            self.threshold_targets,
            self.target_method,
            self.max_iter,
        )

    def _modes_are_current(self) -> bool:
        """Whether :attr:`_modes` were fitted at the current parameters, buffers and settings."""
        if self._modes is None or self._modes_state is None:
            return False
        state, settings = self._modes_state
        return settings == self._settings() and state.matches(self)

    def _terms(self, step: int):
        if step == 1 or self.soft_target_likelihood == "bernoulli":
            return BernoulliLogitTerms()
        return ContinuousBernoulliTerms()

    def _soft_predictions(self, mode: LaplaceMode, K: Tensor, m: Tensor) -> Tensor:
        prior_var = torch.diagonal(K, dim1=-2, dim2=-1)
        mean, var = laplace_latent_predictive(mode, K, prior_var, m, diag=True)
        var = nonnegative_variance(var, prior_var)
        if self.target_method == "probit":
            return probit_approximation(mean, var)
        return symmetric_response_expectation(torch.sigmoid, mean, var)

    def fit(self, use_stored_modes: bool = False) -> DataCentricGPC:
        """Run the ``num_steps`` steps at the current kernel hyperparameters; returns ``self``.

        :param use_stored_modes: Start each step from the stored mode (after ``load_state_dict``).
        """
        with torch.no_grad():
            # shapes: (*batch, n), (*batch, n, n)
            m, K = prior_at_training(
                self.covar_module, self.mean_module, self.train_inputs, self.train_targets
            )
            n = K.shape[-1]
            eye = torch.eye(n, dtype=K.dtype, device=K.device)
            targets = self.train_targets.expand(m.shape)
            modes: list[LaplaceMode] = []
            self.newton_iterations = []
            init = None
            for step in range(1, self.num_steps + 1):
                stored = self.latent_modes[step - 1]
                if use_stored_modes and bool(self.is_fitted) and stored.shape == targets.shape:
                    init = stored
                elif not self.warm_start:
                    init = None
                mode = find_laplace_mode(
                    K + self._noise_schedule[step - 1] * eye,
                    targets,
                    self._terms(step),
                    prior_mean=m,
                    init_f=init,
                    max_iter=self.max_iter,
                    check_targets=step == 1,  # later steps: the last step's probabilities
                )
                modes.append(mode)
                self.newton_iterations.append(mode.num_iter)
                if self.step_targets[step - 1].shape != targets.shape:
                    self.step_targets = targets.new_zeros(self.num_steps, *targets.shape)
                    self.latent_modes = torch.zeros_like(self.step_targets)
                self.step_targets[step - 1] = targets
                self.latent_modes[step - 1] = mode.f
                init = mode.f
                soft = self._soft_predictions(mode, K, m)
                targets = (soft > 0.5).to(soft.dtype) if self.threshold_targets else soft
            self._modes = modes
            self.is_fitted.fill_(True)
            self._modes_state = (ModuleState(self), self._settings())
        return self

    def _mode(self, step: int | None) -> tuple[int, LaplaceMode]:
        step = self.num_steps if step is None else check_int(step, "step")
        if step > self.num_steps:
            raise ValueError(f"step must be in 1..{self.num_steps}, got {step}")
        if not self._modes_are_current():
            if not bool(self.is_fitted):
                raise RuntimeError("DataCentricGPC is not fitted; call fit() first")
            self.fit(use_stored_modes=True)
        assert self._modes is not None
        return step, self._modes[step - 1]

    def _test_inputs(self, x: Tensor) -> Tensor:
        return check_test_inputs(x, self.train_inputs)

    def predict_latent(self, x: Tensor, step: int | None = None) -> tuple[Tensor, Tensor]:
        """Latent predictive mean and variance of step ``step`` (default: the last) at ``x``,
        differentiable in ``x`` (the hyperparameters are constants to them: the steps are fitted
        without autograd)."""
        x = self._test_inputs(x)
        _, mode = self._mode(step)
        with constant_parameters(self):
            K_cross, K_diag, prior_mean = prior_at_test(
                self.covar_module, self.mean_module, x, self.train_inputs, diag=True
            )
        mean, var = laplace_latent_predictive(mode, K_cross, K_diag, prior_mean, diag=True)
        return mean, nonnegative_variance(var, K_diag)

    def predict_proba(
        self, x: Tensor, step: int | None = None, method: str = "quadrature"
    ) -> Tensor:
        r""":math:`\mathbb{E}_q[\sigma(f_*)]` of step ``step`` (default: the last) at ``x``."""
        mean, var = self.predict_latent(x, step)
        if method == "quadrature":
            return symmetric_response_expectation(torch.sigmoid, mean, var)
        if method == "probit":
            return probit_approximation(mean, var)
        raise ValueError(f"method must be 'quadrature' or 'probit', got {method!r}")
