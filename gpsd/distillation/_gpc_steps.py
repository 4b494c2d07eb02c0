"""What the two GPC self-distillers share: predictions of every step and the choice of a step."""

from __future__ import annotations

import abc
import copy
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from gpsd._internal.module_state import checked_setting, fixed_setting
from gpsd._internal.validation import (
    as_float_tensor,
    check_int,
    check_positive_float,
    check_same_device,
    check_test_inputs,
    check_vector,
)
from gpsd.distillation._multiclass_steps import (
    class_latent,
    class_log_loss,
    class_probabilities,
    refuse_for_classes,
)
from gpsd.distillation._step_distiller import StepDistiller
from gpsd.laplace import (
    BernoulliLogitTerms,
    LaplaceGPClassifier,
    LaplaceLikelihoodTerms,
    LaplacePosterior,
    binary_class_probabilities,
)
from gpsd.prediction import Prediction
from gpsd.progress import Callback

__all__ = [
    "FittedModules",
    "SoftBernoulliLogitTerms",
    "StepwiseClassifier",
    "check_refit_flag",
    "check_refit_options",
    "check_trainable",
    "refit_step_modules",
]


class SoftBernoulliLogitTerms(BernoulliLogitTerms):
    """The Bernoulli-logistic terms on soft targets in [0, 1] (the misspecified model of the
    data-centric steps :math:`t \\ge 2`, Fig. 4), whose targets are checked as such."""

    def check_targets(self, y: Tensor, name: str = "train_y") -> None:
        LaplaceLikelihoodTerms.check_targets(self, y, name)
        if bool(((y < 0) | (y > 1)).any()):
            raise ValueError(f"{name} must hold soft targets in [0, 1]")


@dataclass
class FittedModules:
    """The kernel and prior mean of one fitted step, and the losses of its refit (empty where
    the hyperparameters were not refitted)."""

    covar_module: torch.nn.Module
    mean_module: torch.nn.Module
    history: list[float] = field(default_factory=list)


def check_refit_flag(value: object) -> bool:
    """``refit_hyperparameters`` checked: ``True`` or ``False`` (a ``TypeError`` otherwise)."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"refit_hyperparameters must be True or False, got {value!r}")
    return bool(value)


def check_refit_options(
    refit_hyperparameters: object, refit_max_iter: object, refit_lr: object
) -> tuple[bool, int, float]:
    """The three refit keywords checked: a ``bool``, an ``int >= 1`` and a positive float."""
    return (
        check_refit_flag(refit_hyperparameters),
        check_int(refit_max_iter, "refit_max_iter"),
        check_positive_float(refit_lr, "refit_lr"),
    )


def check_trainable(covar_module: torch.nn.Module, mean_module: torch.nn.Module) -> None:
    """Raise a ``ValueError`` naming ``refit_hyperparameters`` where neither module has a
    parameter that requires a gradient (nothing to refit)."""
    params = [*covar_module.parameters(), *mean_module.parameters()]
    if not any(p.requires_grad for p in params):
        raise ValueError(
            "refit_hyperparameters=True needs a kernel or prior mean with parameters that "
            "require gradients (the refit optimises those and keeps the others fixed); none of "
            "covar_module's and mean_module's parameters do"
        )


def refit_step_modules(
    train_x: Tensor,
    targets: Tensor,
    covar_module: torch.nn.Module,
    mean_module: torch.nn.Module,
    terms: LaplaceLikelihoodTerms,
    *,
    noise: float = 0.0,
    temperature: float = 1.0,
    max_iter: int = 100,
    refit_max_iter: int = 50,
    refit_lr: float = 0.05,
    callback: Callback | None = None,
) -> tuple[FittedModules, LaplacePosterior]:
    r"""Copies of ``covar_module`` and ``mean_module`` whose hyperparameters maximise the Laplace
    marginal likelihood of one step's model on its targets, and that model's Laplace posterior
    there.

    The step's model is the :class:`~gpsd.LaplaceGPClassifier` of ``targets`` with the likelihood
    ``terms`` raised to ``temperature`` and the noise ``noise`` on the kernel diagonal; its
    :meth:`~gpsd.LaplaceGPClassifier.optimize_hyperparameters` runs ``refit_max_iter`` Adam
    iterations at learning rate ``refit_lr`` from the modules' current values (a parameter that
    does not require a gradient stays fixed). The copies' parameters are constants afterwards
    (``requires_grad`` off): the step is fitted. A likelihood's own parameters stay fixed.

    :param train_x: Training inputs ``(*b, n, d)``.
    :param targets: The step's targets ``(*batch, n)``.
    :param callback: Called after every Adam iteration of the refit (:mod:`gpsd.progress`);
        returning ``True`` ends the refit there.
    :return: The fitted modules (with the loss of every Adam iteration) and the Laplace
        posterior of the step's model at them.
    """
    kernel = copy.deepcopy(covar_module)
    mean = copy.deepcopy(mean_module)
    terms = copy.deepcopy(terms)
    frozen = getattr(terms, "likelihood", None)
    if isinstance(frozen, torch.nn.Module):
        for p in frozen.parameters():
            p.requires_grad_(False)
    with torch.enable_grad():
        model = LaplaceGPClassifier(
            train_x,
            targets,
            kernel,
            mean_module=mean,
            likelihood=terms,
            noise=noise,
            temperature=temperature,
            max_iter=max_iter,
        )
        model.optimize_hyperparameters(max_iter=refit_max_iter, lr=refit_lr, callback=callback)
    for p in [*kernel.parameters(), *mean.parameters()]:
        p.requires_grad_(False)
    return FittedModules(kernel, mean, list(model.history)), model.posterior()


class StepwiseClassifier(StepDistiller, abc.ABC):
    """Predictions of a GP classifier distilled over steps ``1..T``.

    The owner implements :meth:`_fitted_steps` (how many steps, from step 1, the fit holds),
    :meth:`_latent_at_step` and :meth:`_positive_probability` (two classes), and, where it takes
    :math:`K > 2` classes (``_num_classes``), ``_class_posterior(step)``: the step's
    :class:`~gpsd.laplace.MulticlassLaplacePosterior` and modules, reached only for
    :math:`K > 2`.
    """

    _criteria = {"validation": ("validation_log_loss", True)}

    train_inputs: Tensor

    refit_hyperparameters = checked_setting(
        "refit_hyperparameters",
        check_refit_flag,
        "Whether every step refits the kernel's and prior mean's hyperparameters; a new value "
        "refits on use.",
    )
    refit_max_iter = checked_setting(
        "refit_max_iter",
        lambda v: check_int(v, "refit_max_iter"),
        "Adam iterations of each step's refit; a new value refits on use.",
    )
    refit_lr = checked_setting(
        "refit_lr",
        lambda v: check_positive_float(v, "refit_lr"),
        "Adam's learning rate of each step's refit; a new value refits on use.",
    )

    _num_classes = 2
    num_classes = fixed_setting(
        "num_classes", ":math:`K`, the number of classes (fixed at construction)."
    )
    num_samples = checked_setting(
        "num_samples",
        lambda v: check_int(v, "num_samples"),
        "Monte Carlo draws of the class probabilities for :math:`K > 2` classes; a new value "
        "refits on use where the targets are class probabilities.",
    )

    @abc.abstractmethod
    def _fitted_steps(self) -> int:
        """How many steps, from step 1, the fit holds."""

    @abc.abstractmethod
    def _latent_at_step(self, x: Tensor, step: int) -> tuple[Tensor, Tensor]:
        """Latent mean and variance of step ``step`` at checked test inputs, ``(*batch, M)``."""

    @abc.abstractmethod
    def _positive_probability(self, mean: Tensor, variance: Tensor, method: str) -> Tensor:
        r""":math:`\mathbb{E}[r(f)]`, :math:`f \sim \mathcal N(\mu, s^2)`, by ``method``."""

    def _schedule_batch(self, kernel_batch: torch.Size | tuple | None = None) -> torch.Size:
        """The batch of the steps: the schedules' (``noise`` ``(*s, T)``), the labels' and
        ``kernel_batch`` (default: the kernel's batch shape) broadcast, or a ``ValueError``
        naming the three shapes."""
        if kernel_batch is None:
            kernel_batch = self.covar_module.batch_shape
        try:
            return torch.broadcast_shapes(
                self.noise.shape[:-1], self.train_targets.shape[:-1], kernel_batch
            )
        except RuntimeError:
            raise ValueError(
                f"the batch of schedules (noise of shape {tuple(self.noise.shape)}) must "
                f"broadcast with the batch of the labels (train_y of shape "
                f"{tuple(self.train_targets.shape)}) and of covar_module (batch shape "
                f"{tuple(self.covar_module.batch_shape)})"
            ) from None

    def _steps(self, step: int | None) -> list[int]:
        """The steps a prediction covers: ``[step]``, or every fitted step for ``None``."""
        step = self._check_step(step)
        fitted = self._fitted_steps()
        if fitted == 0:
            raise ValueError(
                "no step was kept: the fit stopped before a step whose posterior is stored; "
                "call fit() again to fit every step"
            )
        if step is None:
            return list(range(1, fitted + 1))
        if step > fitted:
            raise ValueError(
                f"step {step} was not fitted: the fit stopped after step {fitted} (a callback "
                "returned True); call fit() again to fit every step"
            )
        return [step]

    def _rows_of_steps(self, rows: list[Tensor], step: int | None) -> Tensor:
        """``rows`` (one ``(*batch, N)`` tensor per step of :meth:`_steps`, ``(*batch, N, K)`` for
        :math:`K > 2` classes) on the step axis, ``(*batch, k, N[, K])``, or the one row for
        ``step=t``: copies."""
        if step is not None:
            return rows[0].clone()
        return torch.stack(rows, dim=-3 if self.num_classes > 2 else -2)

    def _latent(self, test_x: Tensor, step: int | None) -> Prediction:
        x = check_test_inputs(test_x, self.train_inputs)
        steps = self._steps(step)
        if self.num_classes > 2:
            rows = [class_latent(self, *self._class_posterior(t), x) for t in steps]
            if step is not None:
                return rows[0]
            return Prediction(
                torch.stack([r.mean for r in rows], dim=-3),
                torch.stack([r.variance for r in rows], dim=-3),
                torch.stack([r.covariance for r in rows], dim=-4),
            )
        moments = [self._latent_at_step(x, t) for t in steps]
        if step is not None:
            return Prediction(*moments[0])
        means, variances = zip(*moments, strict=True)
        return Prediction(torch.stack(means, dim=-2), torch.stack(variances, dim=-2))

    def predict_latent(self, test_x: Tensor, *, step: int | None = None) -> Prediction:
        """The latent predictive mean and variance at ``test_x``: of every step,
        ``(*batch, T, M)`` with row ``t - 1`` for step ``t``, or of step ``step`` alone,
        ``(*batch, M)``. For :math:`K > 2` classes, the mean and the variances of the :math:`K`
        latent functions, ``(*batch, T, M, K)``, and the covariance between them at each point,
        ``covariance`` of shape ``(*batch, T, M, K, K)`` (``step=t`` drops the step axis).
        Differentiable in ``test_x``; the hyperparameters are constants to them (the steps are
        fitted without autograd)."""
        return self._latent(test_x, step)

    def predict_proba(
        self, test_x: Tensor, *, step: int | None = None, method: str = "quadrature"
    ) -> Tensor:
        r"""The class probabilities at ``test_x``, column 1 :math:`\mathbb{E}_q[r(f_*)]` (:math:`r`
        the likelihood's response) and column 0 its complement: of every step,
        ``(*batch, T, M, 2)`` with row ``t - 1`` for step ``t``, or of step ``step`` alone,
        ``(*batch, M, 2)``. For :math:`K > 2` classes, column :math:`c` is class :math:`c`'s
        probability :math:`\mathbb{E}_q[\operatorname{softmax}(\mathbf f_*)_c]`, ``(*batch, T,
        M, K)``, the Monte Carlo average over :attr:`num_samples` draws from the latent
        predictive, the same draws at every call and for every point (a generator seeded with
        0), so that a point's probabilities do not depend on the other points predicted with it;
        standard error at most :math:`0.5/\sqrt S` per entry.

        :param method: ``"quadrature"`` (accurate at any latent variance) or ``"probit"``
            (closed form: MacKay's approximation for a logistic response); for :math:`K > 2`
            classes, ``"quadrature"`` alone (the Monte Carlo average).
        """
        if method not in ("quadrature", "probit"):
            raise ValueError(f"method must be 'quadrature' or 'probit', got {method!r}")
        if self.num_classes > 2:
            if method != "quadrature":
                allowed = "the class probabilities are a Monte Carlo average: leave method at "
                refuse_for_classes(self.num_classes, "method", method, allowed + "'quadrature'")
            x = check_test_inputs(test_x, self.train_inputs)
            rows = [
                class_probabilities(self, *self._class_posterior(t), x) for t in self._steps(step)
            ]
            return self._rows_of_steps(rows, step)
        latent = self._latent(test_x, step)
        positive = self._positive_probability(latent.mean, latent.variance, method)
        return binary_class_probabilities(positive)

    def predict(self, test_x: Tensor, *, step: int | None = None) -> Tensor:
        """The predicted labels (``torch.long``, 1 where column 1 of :meth:`predict_proba` is
        above 1/2; for :math:`K > 2` classes the column of the largest probability): of every
        step, ``(*batch, T, M)``, or of step ``step``, ``(*batch, M)``."""
        with torch.no_grad():
            if self.num_classes > 2:
                return self.predict_proba(test_x, step=step).argmax(-1)
            return (self.predict_proba(test_x, step=step)[..., 1] > 0.5).long()

    def validation_log_loss(self, val_x: Tensor, val_y: Tensor) -> Tensor:
        r"""The mean log loss (cross-entropy) of every step on ``val_x, val_y``,
        ``(*batch, T)``, entry ``t - 1`` for step ``t``:

        .. math::

            \ell_t = -\frac1M \sum_{i=1}^M \bigl(y_i \log p_{t,i} + (1 - y_i)\log(1 - p_{t,i})\bigr),

        with :math:`p_{t,i}` column 1 of :meth:`predict_proba` at step :math:`t` (probabilities
        clamped to the smallest positive normal number before the logarithm).
        For :math:`K > 2` classes, :math:`\ell_t = -\frac1M \sum_i \log p_{t,i,y_i}` with the
        class probabilities :math:`p_{t,i,c}` of :meth:`predict_proba`.

        :param val_x: Validation inputs ``(M, d)`` or ``(M,)``.
        :param val_y: Validation targets ``(*batch, M)`` in :math:`[0, 1]` (labels or soft
            targets); for :math:`K > 2` classes, labels in ``0 ... K - 1``.
        """
        with torch.no_grad():
            proba = self.predict_proba(val_x)  # shape: (*batch, T, M, C)
            if self.num_classes > 2:
                return class_log_loss(proba, val_y)
            y = as_float_tensor(val_y, "val_y", dtype=proba.dtype)
            check_same_device(proba, y, "val_y", "val_x")
            check_vector(y, "val_y", n=proba.shape[-2])
            if bool(((y < 0) | (y > 1)).any()):
                raise ValueError("val_y must hold targets in [0, 1]")
            log_p = proba.clamp_min(torch.finfo(proba.dtype).tiny).log()
            y = y.unsqueeze(-2)  # shape: (*batch, 1, M)
            loss = -(y * log_p[..., 1] + (1.0 - y) * log_p[..., 0])
            return loss.mean(-1)
