r"""A scikit-learn regressor over :class:`~gpsd.DataCentricGPR` and
:class:`~gpsd.DistributionCentricGPR`."""

from __future__ import annotations

import numbers

import numpy as np
import torch
from sklearn.base import BaseEstimator, RegressorMixin
from sklearn.utils.validation import check_is_fitted, validate_data

from gpsd.distillation import DataCentricGPR, DistributionCentricGPR
from gpsd.sklearn._common import (
    check_count,
    check_positive,
    numpy_dtype,
    regression_data,
    teacher_kernel,
    to_numpy,
    to_tensor,
    torch_device,
    torch_dtype,
)

__all__ = ["SelfDistilledGPRegressor"]

METHODS = {"data_centric": DataCentricGPR, "distribution_centric": DistributionCentricGPR}


class SelfDistilledGPRegressor(RegressorMixin, BaseEstimator):
    r"""Self-distilled GP regression (Borup & Andersen) as a scikit-learn regressor.

    :meth:`fit` builds the kernel :math:`s\,k_\ell` (``kernel``, ``lengthscale``,
    ``outputscale``); with ``optimize_hyperparameters`` it first fits an exact GP teacher to the
    data, maximising the exact log marginal likelihood over :math:`\ell`, :math:`s` and the noise
    :math:`\sigma^2` (Adam, ``max_iter`` iterations, learning rate ``lr``). It then distils
    ``num_steps`` steps with :class:`~gpsd.DataCentricGPR` (``method="data_centric"``) or
    :class:`~gpsd.DistributionCentricGPR` (``method="distribution_centric"``) at the noise
    schedule ``noise`` (default: the teacher's :math:`\sigma^2` at every step), and keeps one
    step: the one with the smallest generalised cross-validation score (``step="gcv"``,
    :meth:`~gpsd.DataCentricGPR.best_step`) or the given ``step``. :meth:`predict` returns that
    step's latent predictive mean (and standard deviation), as scikit-learn's
    ``GaussianProcessRegressor`` does.

    :param kernel: ``"rbf"``, ``"matern12"``, ``"matern32"`` or ``"matern52"``.
    :param lengthscale: :math:`\ell`, the start of the optimisation or the fixed value.
    :param outputscale: :math:`s`, the start of the optimisation or the fixed value.
    :param noise: the noise schedule :math:`\gamma_1, \dots, \gamma_T`: one positive number
        (every step), a sequence of ``num_steps`` numbers, or ``None`` for the teacher's noise
        (learnt with ``optimize_hyperparameters``, else 0.1).
    :param num_steps: the number of distillation steps :math:`T`.
    :param step: ``"gcv"`` or a step in ``1..num_steps``.
    :param method: ``"data_centric"`` or ``"distribution_centric"``.
    :param alpha: weight of the original targets in every step (data-centric only).
    :param normalize_y: standardise the targets before fitting (predictions are scaled back).
    :param optimize_hyperparameters: fit :math:`\ell`, :math:`s` and :math:`\sigma^2` by the
        exact marginal likelihood before distilling.
    :param max_iter: Adam iterations of that fit.
    :param lr: Adam's learning rate.
    :param backend: the distiller's backend (``"auto"``, ``"dense"``, ``"cholesky"``,
        ``"lanczos"``, ``"cg"``); the matrix-free ones estimate the GCV scores (see
        :meth:`~gpsd.DataCentricGPR.gcv`).
    :param dtype: ``"float64"`` or ``"float32"``, the dtype of the model and of the predictions.
    :param ard: one lengthscale per input feature (automatic relevance determination), each
        started at ``lengthscale``; ``False``: one for all features.
    :param device: where the model is fitted and predicts (``"cpu"``, ``"cuda"``, ``"cuda:1"``);
        :meth:`predict` returns NumPy arrays wherever it runs.

    :ivar model_: the fitted :class:`~gpsd.DataCentricGPR` or :class:`~gpsd.DistributionCentricGPR`
        (on standardised targets with ``normalize_y``).
    :ivar step_: the step :meth:`predict` uses, counted from 1.
    :ivar gcv_: the GCV score of every step, ``(num_steps,)``.
    :ivar gcv_standard_error_: the standard error of each score, ``(num_steps,)``: 0 where the
        backend computes the trace exactly, positive where it estimates it from
        :class:`gpsd.settings.trace_probes` probe vectors.
    :ivar noise_: the noise schedule used, ``(num_steps,)``.
    :ivar n_iter_: the Adam iterations run on the teacher's hyperparameters.
    :ivar n_features_in_: the number of input features.

    Example:
        >>> from sklearn.model_selection import GridSearchCV
        >>> search = GridSearchCV(SelfDistilledGPRegressor(), {"num_steps": [1, 2, 4]}, cv=3)
        >>> search.fit(X, y).best_params_
    """

    def __init__(
        self,
        kernel: str = "rbf",
        lengthscale: float = 1.0,
        outputscale: float = 1.0,
        noise: object = None,
        num_steps: int = 5,
        step: object = "gcv",
        method: str = "data_centric",
        alpha: float = 0.0,
        normalize_y: bool = True,
        optimize_hyperparameters: bool = True,
        max_iter: int = 50,
        lr: float = 0.1,
        backend: str = "auto",
        dtype: str = "float64",
        ard: bool = False,
        device: str = "cpu",
    ) -> None:
        self.kernel = kernel
        self.lengthscale = lengthscale
        self.outputscale = outputscale
        self.noise = noise
        self.num_steps = num_steps
        self.step = step
        self.method = method
        self.alpha = alpha
        self.normalize_y = normalize_y
        self.optimize_hyperparameters = optimize_hyperparameters
        self.max_iter = max_iter
        self.lr = lr
        self.backend = backend
        self.dtype = dtype
        self.ard = ard
        self.device = device

    def _noise_schedule(self, teacher_noise: float, num_steps: int) -> list[float]:
        if self.noise is None:
            return [teacher_noise] * num_steps
        if isinstance(self.noise, numbers.Real) and not isinstance(self.noise, bool):
            return [check_positive(self.noise, "noise")] * num_steps
        schedule = [check_positive(g, "noise") for g in np.asarray(self.noise).reshape(-1)]
        if len(schedule) != num_steps:
            raise ValueError(
                f"noise holds {len(schedule)} values but num_steps is {num_steps}; give one "
                "value per step"
            )
        return schedule

    def fit(self, X, y) -> SelfDistilledGPRegressor:
        """Fit the teacher's hyperparameters (optionally), distil and choose the step.

        :param X: training inputs, array-like ``(N, d)``.
        :param y: training targets, array-like ``(N,)``.
        :return: ``self``.
        """
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {sorted(METHODS)}, got {self.method!r}")
        num_steps = check_count(self.num_steps, "num_steps")
        step_given = isinstance(self.step, numbers.Integral) and not isinstance(self.step, bool)
        if not (isinstance(self.step, str) and self.step == "gcv") and not (
            step_given and 1 <= self.step <= num_steps
        ):
            raise ValueError(f"step must be 'gcv' or an int in 1..{num_steps}, got {self.step!r}")
        dtype = torch_dtype(self.dtype)
        device = torch_device(self.device)
        if not isinstance(self.ard, (bool, np.bool_)):
            raise ValueError(f"ard must be True or False, got {self.ard!r}")
        train_x, train_y = regression_data(self, X, y, device)
        max_iter = check_count(self.max_iter, "max_iter", minimum=0)
        covar_module, teacher_noise = teacher_kernel(
            self, train_x, train_y, max_iter, ard=bool(self.ard)
        )
        schedule = self._noise_schedule(teacher_noise, num_steps)
        options = {"alpha": self.alpha} if self.method == "data_centric" else {}
        model = METHODS[self.method](
            train_x,
            train_y,
            covar_module,
            noise=torch.tensor(schedule, dtype=dtype, device=device),
            num_steps=num_steps,
            backend=self.backend,
            **options,
        )
        with torch.no_grad():
            model.fit()
            # every backend scores: exactly, or by probes with a standard error
            self.gcv_ = to_numpy(model.gcv())
            self.gcv_standard_error_ = to_numpy(model.gcv_standard_error())
            self.step_ = int(self.step) if step_given else model.best_step("gcv")
        self.model_ = model
        self.n_iter_ = self.max_iter if self.optimize_hyperparameters else 0
        self.noise_ = np.asarray(schedule)
        return self

    def predict(self, X, return_std: bool = False):
        """The latent predictive mean of step :attr:`step_` at ``X``, ``(M,)``; with
        ``return_std``, also its standard deviation ``(M,)``."""
        check_is_fitted(self, "model_")
        X = validate_data(self, X, reset=False, dtype=numpy_dtype(self.dtype))
        with torch.no_grad():
            prediction = self.model_.predict(
                to_tensor(X, self.dtype, self.model_.train_x.device), step=self.step_
            )
        mean = to_numpy(prediction.mean) * self._y_std + self._y_mean
        if not return_std:
            return mean
        return mean, to_numpy(prediction.stddev) * self._y_std
