r"""A scikit-learn binary classifier over :class:`~gpsd.DataCentricGPC`."""

from __future__ import annotations

import numbers

import numpy as np
import torch
from sklearn.base import BaseEstimator, ClassifierMixin
from sklearn.utils.multiclass import check_classification_targets, type_of_target
from sklearn.utils.validation import check_is_fitted, validate_data

from gpsd.distillation import DataCentricGPC
from gpsd.laplace import LaplaceGPClassifier
from gpsd.sklearn._common import (
    check_count,
    check_positive,
    make_kernel,
    numpy_dtype,
    to_numpy,
    to_tensor,
    torch_dtype,
)

__all__ = ["SelfDistilledGPClassifier"]


class SelfDistilledGPClassifier(ClassifierMixin, BaseEstimator):
    r"""Data-centric self-distillation of a Laplace GP classifier (Borup & Andersen, §4.1) as a
    scikit-learn binary classifier.

    :meth:`fit` maps the two labels of ``y`` to 0 and 1 (:attr:`classes_`, sorted, the second
    the positive class), builds the kernel :math:`s\,k_\ell` and, with
    ``optimize_hyperparameters``, fits :math:`\ell` and :math:`s` by the Laplace approximation of
    the marginal likelihood of the Bernoulli-logistic GPC
    (:meth:`~gpsd.LaplaceGPClassifier.optimize_hyperparameters`). It then fits
    :class:`~gpsd.DataCentricGPC` with ``num_steps`` steps (step 1 is the ordinary GPC; later steps
    fit the previous step's soft predictions with the continuous Bernoulli likelihood) and
    predicts with step ``step`` (default: the last).

    :param kernel: ``"rbf"``, ``"matern12"``, ``"matern32"`` or ``"matern52"``.
    :param lengthscale: :math:`\ell`, the start of the optimisation or the fixed value.
    :param outputscale: :math:`s`, the start of the optimisation or the fixed value.
    :param num_steps: the number of steps :math:`T`.
    :param step: the step in ``1..num_steps`` that predicts (``None``: the last).
    :param noise: :math:`\gamma_t` added to the kernel diagonal at every step: one number
        :math:`\ge 0` or a sequence of ``num_steps`` numbers.
    :param soft_target_likelihood: ``"continuous_bernoulli"`` or ``"bernoulli"`` for the steps
        :math:`t \ge 2`.
    :param optimize_hyperparameters: fit :math:`\ell` and :math:`s` before distilling.
    :param max_iter: Adam iterations of that fit.
    :param lr: Adam's learning rate.
    :param dtype: ``"float64"`` or ``"float32"``.

    :ivar model_: the fitted :class:`~gpsd.DataCentricGPC` (labels 0 and 1).
    :ivar classes_: the two labels, ``(2,)``; ``classes_[1]`` is the positive class.
    :ivar step_: the step that predicts, counted from 1.
    :ivar n_iter_: the Adam iterations run on the hyperparameters.
    :ivar n_features_in_: the number of input features.
    """

    def __init__(
        self,
        kernel: str = "rbf",
        lengthscale: float = 1.0,
        outputscale: float = 1.0,
        num_steps: int = 2,
        step: int | None = None,
        noise: object = 0.0,
        soft_target_likelihood: str = "continuous_bernoulli",
        optimize_hyperparameters: bool = True,
        max_iter: int = 20,
        lr: float = 0.1,
        dtype: str = "float64",
    ) -> None:
        self.kernel = kernel
        self.lengthscale = lengthscale
        self.outputscale = outputscale
        self.num_steps = num_steps
        self.step = step
        self.noise = noise
        self.soft_target_likelihood = soft_target_likelihood
        self.optimize_hyperparameters = optimize_hyperparameters
        self.max_iter = max_iter
        self.lr = lr
        self.dtype = dtype

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        # binary only: DataCentricGPC fits one latent function (Bernoulli likelihood), and
        # scikit-learn's checks then expect multiclass targets to be refused, as fit does
        tags.classifier_tags.multi_class = False
        return tags

    def fit(self, X, y) -> SelfDistilledGPClassifier:
        """Fit the hyperparameters (optionally) and every distillation step.

        :param X: training inputs, array-like ``(N, d)``.
        :param y: training labels, array-like ``(N,)``, two distinct values.
        :return: ``self``.
        """
        num_steps = check_count(self.num_steps, "num_steps")
        if self.step is not None and (
            isinstance(self.step, bool)
            or not isinstance(self.step, numbers.Integral)
            or not 1 <= self.step <= num_steps
        ):
            raise ValueError(f"step must be None or an int in 1..{num_steps}, got {self.step!r}")
        max_iter = check_count(self.max_iter, "max_iter", minimum=0)
        lr = check_positive(self.lr, "lr")
        dtype = torch_dtype(self.dtype)
        X, y = validate_data(self, X, y, dtype=numpy_dtype(self.dtype))
        check_classification_targets(y)
        target_type = type_of_target(y, input_name="y")
        self.classes_, labels = np.unique(y, return_inverse=True)
        if len(self.classes_) < 2:
            raise ValueError(
                f"y holds one class only ({self.classes_[0]!r}); the classifier needs two"
            )
        if target_type != "binary":
            raise ValueError(
                f"Only binary classification is supported. The type of the target is {target_type}."
            )
        train_x, train_y = to_tensor(X, self.dtype), to_tensor(labels, self.dtype)
        covar_module = make_kernel(self.kernel, self.lengthscale, self.outputscale, dtype)
        if self.optimize_hyperparameters and max_iter > 0:
            LaplaceGPClassifier(train_x, train_y, covar_module).optimize_hyperparameters(
                max_iter=max_iter, lr=lr
            )
        for parameter in covar_module.parameters():
            parameter.requires_grad_(False)
        noise = self.noise
        if not isinstance(noise, numbers.Real):
            noise = torch.as_tensor(np.asarray(noise, dtype=float), dtype=dtype)
            if noise.dim() > 1:  # one classifier: no batch of schedules
                raise ValueError(
                    "noise must be one number or a sequence of num_steps numbers, got shape "
                    f"{tuple(noise.shape)}"
                )
        model = DataCentricGPC(
            train_x,
            train_y,
            covar_module,
            num_steps=num_steps,
            noise=noise,
            soft_target_likelihood=self.soft_target_likelihood,
        )
        with torch.no_grad():
            model.fit()
        self.model_ = model
        self.step_ = num_steps if self.step is None else int(self.step)
        self.n_iter_ = max_iter if self.optimize_hyperparameters else 0
        return self

    def predict_proba(self, X) -> np.ndarray:
        """Class probabilities of step :attr:`step_` at ``X``, ``(M, 2)``, columns in the order
        of :attr:`classes_`."""
        check_is_fitted(self, "model_")
        X = validate_data(self, X, reset=False, dtype=numpy_dtype(self.dtype))
        with torch.no_grad():
            proba = self.model_.predict_proba(to_tensor(X, self.dtype), step=self.step_)
        return to_numpy(proba)

    def predict(self, X) -> np.ndarray:
        """The label of the larger probability at ``X``, ``(M,)``, from :attr:`classes_`."""
        proba = self.predict_proba(X)
        return self.classes_[np.argmax(proba, axis=1)]
