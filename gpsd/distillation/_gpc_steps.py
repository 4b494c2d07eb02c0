"""What the two GPC self-distillers share: predictions of every step and the choice of a step."""

from __future__ import annotations

import abc
import numbers
from collections.abc import Iterable

import numpy as np
import torch
from torch import Tensor

from gpsd._internal.validation import (
    as_float_tensor,
    check_int,
    check_same_device,
    check_test_inputs,
    check_vector,
)
from gpsd.laplace.predictive import binary_class_probabilities
from gpsd.prediction import Prediction

__all__ = ["StepwiseClassifier", "noise_schedule"]


def noise_schedule(value: object, num_steps: int, name: str = "noise") -> tuple[float, ...]:
    """``value`` as ``num_steps`` finite numbers >= 0: one number for every step, or one per step
    (a sequence, array or tensor of shape ``(num_steps,)``)."""
    if isinstance(value, numbers.Real) or (
        isinstance(value, (Tensor, np.ndarray)) and value.ndim == 0
    ):
        values = [float(value)] * num_steps
    elif isinstance(value, (Tensor, np.ndarray)) and value.ndim != 1:
        raise ValueError(
            f"{name} must be one number or have shape (num_steps,) = ({num_steps},), "
            f"got shape {tuple(value.shape)}"
        )
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
    return tuple(values)


class StepwiseClassifier(abc.ABC):
    """Predictions of a binary GP classifier distilled over steps ``1..T``.

    The owner implements :meth:`_fitted_steps` (how many steps, from step 1, the fit holds),
    :meth:`_latent_at_step` and :meth:`_positive_probability`.
    """

    num_steps: int
    train_inputs: Tensor

    @abc.abstractmethod
    def _fitted_steps(self) -> int:
        """How many steps, from step 1, the fit holds."""

    @abc.abstractmethod
    def _latent_at_step(self, x: Tensor, step: int) -> tuple[Tensor, Tensor]:
        """Latent mean and variance of step ``step`` at checked test inputs, ``(*batch, M)``."""

    @abc.abstractmethod
    def _positive_probability(self, mean: Tensor, variance: Tensor, method: str) -> Tensor:
        r""":math:`\mathbb{E}[r(f)]`, :math:`f \sim \mathcal N(\mu, s^2)`, by ``method``."""

    def _steps(self, step: int | None) -> list[int]:
        """The steps a prediction covers: ``[step]``, or every fitted step for ``None``."""
        fitted = self._fitted_steps()
        if fitted == 0:
            raise ValueError(
                "no step was kept: the fit stopped before a step whose posterior is stored; "
                "call fit() again to fit every step"
            )
        if step is None:
            return list(range(1, fitted + 1))
        step = check_int(step, "step")
        if step > self.num_steps:
            raise ValueError(f"step must be in 1..{self.num_steps} (num_steps), got {step}")
        if step > fitted:
            raise ValueError(
                f"step {step} was not fitted: the fit stopped after step {fitted} (a callback "
                "returned True); call fit() again to fit every step"
            )
        return [step]

    def _latent(self, test_x: Tensor, step: int | None) -> Prediction:
        x = check_test_inputs(test_x, self.train_inputs)
        steps = self._steps(step)
        moments = [self._latent_at_step(x, t) for t in steps]
        if step is not None:
            return Prediction(*moments[0])
        means, variances = zip(*moments, strict=True)
        return Prediction(torch.stack(means, dim=-2), torch.stack(variances, dim=-2))

    def predict_latent(self, test_x: Tensor, *, step: int | None = None) -> Prediction:
        """The latent predictive mean and variance at ``test_x``: of every step,
        ``(*batch, T, M)`` with row ``t - 1`` for step ``t``, or of step ``step`` alone,
        ``(*batch, M)``. Differentiable in ``test_x``; the hyperparameters are constants to them
        (the steps are fitted without autograd)."""
        return self._latent(test_x, step)

    def predict_proba(
        self, test_x: Tensor, *, step: int | None = None, method: str = "quadrature"
    ) -> Tensor:
        r"""The class probabilities at ``test_x``, column 1 :math:`\mathbb{E}_q[r(f_*)]` (:math:`r`
        the likelihood's response) and column 0 its complement: of every step,
        ``(*batch, T, M, 2)`` with row ``t - 1`` for step ``t``, or of step ``step`` alone,
        ``(*batch, M, 2)``.

        :param method: ``"quadrature"`` (accurate at any latent variance) or ``"probit"``
            (closed form: MacKay's approximation for a logistic response).
        """
        if method not in ("quadrature", "probit"):
            raise ValueError(f"method must be 'quadrature' or 'probit', got {method!r}")
        latent = self._latent(test_x, step)
        positive = self._positive_probability(latent.mean, latent.variance, method)
        return binary_class_probabilities(positive)

    def predict(self, test_x: Tensor, *, step: int | None = None) -> Tensor:
        """The predicted labels (``torch.long``, 1 where column 1 of :meth:`predict_proba` is
        above 1/2): of every step, ``(*batch, T, M)``, or of step ``step``, ``(*batch, M)``."""
        with torch.no_grad():
            return (self.predict_proba(test_x, step=step)[..., 1] > 0.5).long()

    def validation_log_loss(self, val_x: Tensor, val_y: Tensor) -> Tensor:
        r"""The mean log loss (cross-entropy) of every step on ``val_x, val_y``,
        ``(*batch, T)``, entry ``t - 1`` for step ``t``:

        .. math::

            \ell_t = -\frac1M \sum_{i=1}^M \bigl(y_i \log p_{t,i} + (1 - y_i)\log(1 - p_{t,i})\bigr),

        with :math:`p_{t,i}` column 1 of :meth:`predict_proba` at step :math:`t` (probabilities
        clamped to the smallest positive normal number before the logarithm).

        :param val_x: Validation inputs ``(M, d)`` or ``(M,)``.
        :param val_y: Validation targets ``(*batch, M)`` in :math:`[0, 1]` (labels or soft
            targets).
        """
        with torch.no_grad():
            proba = self.predict_proba(val_x)  # shape: (*batch, T, M, 2)
            y = as_float_tensor(val_y, "val_y", dtype=proba.dtype)
            check_same_device(proba, y, "val_y", "val_x")
            check_vector(y, "val_y", n=proba.shape[-2])
            if bool(((y < 0) | (y > 1)).any()):
                raise ValueError("val_y must hold targets in [0, 1]")
            log_p = proba.clamp_min(torch.finfo(proba.dtype).tiny).log()
            y = y.unsqueeze(-2)  # shape: (*batch, 1, M)
            loss = -(y * log_p[..., 1] + (1.0 - y) * log_p[..., 0])
            return loss.mean(-1)

    def best_step(
        self, criterion: str = "validation", *, val_x: Tensor, val_y: Tensor
    ) -> int | Tensor:
        """The step, counted from 1, with the smallest :meth:`validation_log_loss` on
        ``val_x, val_y``: an ``int``, or a ``long`` tensor of steps ``batch`` for batched models.

        :param criterion: ``"validation"`` (the only criterion of the classifiers).
        """
        if criterion != "validation":
            raise ValueError(f"criterion must be 'validation', got {criterion!r}")
        steps = self.validation_log_loss(val_x, val_y).argmin(-1) + 1
        return int(steps) if steps.dim() == 0 else steps
