r"""A scikit-learn regressor that distils an exact GP into a
:class:`~gpsd.SparseLowRankStudent` (:class:`~gpsd.KernelDistillation`)."""

from __future__ import annotations

import numpy as np
import torch
from sklearn.base import BaseEstimator, RegressorMixin
from sklearn.utils.validation import check_is_fitted, validate_data

from gpsd.kernel_distillation import KernelDistillation
from gpsd.sklearn._common import (
    check_count,
    numpy_dtype,
    regression_data,
    seed_from,
    teacher_kernel,
    to_numpy,
    to_tensor,
)

__all__ = ["KernelDistilledRegressor"]


class KernelDistilledRegressor(RegressorMixin, BaseEstimator):
    r"""Kernel distillation (Song & Sun) of an exact GP teacher, as a scikit-learn regressor.

    :meth:`fit` builds the kernel :math:`s\,k_\ell`, fits the teacher's :math:`\ell`, :math:`s`
    and noise :math:`\sigma^2` by the exact marginal likelihood (with
    ``optimize_hyperparameters``; Adam, ``max_iter`` iterations, learning rate ``lr``), then
    approximates :math:`K_{XX} \approx W K_{UU} W^\top` with ``num_inducing`` K-means inducing
    points :math:`U` and a ``sparsity``-sparse :math:`W` (:class:`~gpsd.KernelDistillation`,
    ``distillation_max_iter`` descent iterations). :meth:`predict` uses the
    :class:`~gpsd.SparseLowRankStudent`, whose cost per test point does not grow with :math:`N`.
    ``num_inducing`` and ``sparsity`` are capped at the number of training points.

    :param kernel: ``"rbf"``, ``"matern12"``, ``"matern32"`` or ``"matern52"``.
    :param lengthscale: :math:`\ell`, the start of the optimisation or the fixed value.
    :param outputscale: :math:`s`, the start of the optimisation or the fixed value.
    :param num_inducing: :math:`m`, the number of inducing points.
    :param sparsity: :math:`b \le m`, the non-zeros per row of :math:`W`.
    :param normalize_y: standardise the targets before fitting (predictions are scaled back).
    :param optimize_hyperparameters: fit the teacher's hyperparameters first (else the noise is
        0.1).
    :param max_iter: Adam iterations of the teacher's fit.
    :param lr: Adam's learning rate.
    :param distillation_max_iter: descent iterations of the distillation (default 0: the
        least-squares :math:`W`; see :class:`~gpsd.KernelDistillation`'s ``max_iter``).
    :param random_state: seeds the k-means++ initialisation (``None``, an ``int`` or a
        ``RandomState``).
    :param dtype: ``"float64"`` or ``"float32"``.

    :ivar distiller_: the fitted :class:`~gpsd.KernelDistillation`.
    :ivar student_: its :class:`~gpsd.SparseLowRankStudent`, which predicts.
    :ivar n_iter_: the Adam iterations run on the teacher's hyperparameters.
    :ivar n_features_in_: the number of input features.
    """

    def __init__(
        self,
        kernel: str = "rbf",
        lengthscale: float = 1.0,
        outputscale: float = 1.0,
        num_inducing: int = 32,
        sparsity: int = 8,
        normalize_y: bool = True,
        optimize_hyperparameters: bool = True,
        max_iter: int = 50,
        lr: float = 0.1,
        distillation_max_iter: int = 0,
        random_state: object = None,
        dtype: str = "float64",
    ) -> None:
        self.kernel = kernel
        self.lengthscale = lengthscale
        self.outputscale = outputscale
        self.num_inducing = num_inducing
        self.sparsity = sparsity
        self.normalize_y = normalize_y
        self.optimize_hyperparameters = optimize_hyperparameters
        self.max_iter = max_iter
        self.lr = lr
        self.distillation_max_iter = distillation_max_iter
        self.random_state = random_state
        self.dtype = dtype

    def fit(self, X, y) -> KernelDistilledRegressor:
        """Fit the teacher (optionally) and distil its kernel.

        :param X: training inputs, array-like ``(N, d)``.
        :param y: training targets, array-like ``(N,)``.
        :return: ``self``.
        """
        num_inducing = check_count(self.num_inducing, "num_inducing")
        sparsity = check_count(self.sparsity, "sparsity")
        if sparsity > num_inducing:
            raise ValueError(f"sparsity ({sparsity}) must not exceed num_inducing ({num_inducing})")
        max_iter = check_count(self.max_iter, "max_iter", minimum=0)
        distillation_max_iter = check_count(
            self.distillation_max_iter, "distillation_max_iter", minimum=0
        )
        seed = seed_from(self.random_state)
        train_x, train_y = regression_data(self, X, y)
        covar_module, noise = teacher_kernel(self, train_x, train_y, max_iter)
        n = train_x.shape[0]
        num_inducing = min(num_inducing, n)
        with torch.no_grad():
            distiller = KernelDistillation.from_data(
                train_x,
                train_y,
                covar_module,
                noise=noise,
                num_inducing=num_inducing,
                sparsity=min(sparsity, num_inducing),
                max_iter=distillation_max_iter,
                seed=seed,
            ).fit()
        self.distiller_ = distiller
        self.student_ = distiller.student
        self.n_iter_ = max_iter if self.optimize_hyperparameters else 0
        return self

    def predict(self, X, return_std: bool = False):
        """The student's latent predictive mean at ``X``, ``(M,)``; with ``return_std``, also
        its standard deviation ``(M,)``."""
        check_is_fitted(self, "student_")
        X = validate_data(self, X, reset=False, dtype=numpy_dtype(self.dtype))
        prediction = self.student_.predict(to_tensor(X, self.dtype))
        mean = to_numpy(prediction.mean) * self._y_std + self._y_mean
        if not return_std:
            return mean
        return mean, np.sqrt(np.clip(to_numpy(prediction.variance), 0.0, None)) * self._y_std
