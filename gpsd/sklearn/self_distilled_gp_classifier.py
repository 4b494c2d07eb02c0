r"""A scikit-learn classifier over :class:`~gpsd.DataCentricGPC`."""

from __future__ import annotations

import numbers

import numpy as np
import torch
from sklearn.base import BaseEstimator, ClassifierMixin
from sklearn.utils.multiclass import check_classification_targets, type_of_target
from sklearn.utils.validation import check_is_fitted, validate_data

from gpsd.distillation import DataCentricGPC
from gpsd.laplace import LaplaceGPClassifier, MulticlassLaplacePosterior
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
    scikit-learn classifier of :math:`K \ge 2` classes.

    :meth:`fit` maps the :math:`K` labels of ``y`` to :math:`0, \dots, K - 1` (:attr:`classes_`,
    sorted; for two classes the second is the positive class), builds the kernel
    :math:`s\,k_\ell` and, with ``optimize_hyperparameters``, fits :math:`\ell` and :math:`s` by
    the Laplace approximation of the marginal likelihood of the GPC of the labels: the
    Bernoulli-logistic one for two classes
    (:meth:`~gpsd.LaplaceGPClassifier.optimize_hyperparameters`), the softmax one of :math:`K`
    latent functions sharing the kernel for more
    (:meth:`~gpsd.laplace.MulticlassLaplacePosterior.log_marginal_likelihood`, per point,
    maximised by ``max_iter`` Adam iterations at learning rate ``lr``). It then fits
    :class:`~gpsd.DataCentricGPC` with ``num_steps`` steps (step 1 is the ordinary GPC; later steps
    fit the previous step's soft predictions with the continuous Bernoulli likelihood, or for
    :math:`K > 2` classes the continuous categorical) and predicts with step ``step`` (default:
    the last). For :math:`K > 2` classes the class probabilities are Monte Carlo averages over
    ``num_samples`` draws from a generator seeded with 0 (the same at every call).

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
    :param num_samples: Monte Carlo draws of the class probabilities for :math:`K > 2` classes.

    :ivar model_: the fitted :class:`~gpsd.DataCentricGPC` (labels :math:`0, \dots, K - 1`).
    :ivar classes_: the :math:`K` labels, sorted, ``(K,)``; for two, ``classes_[1]`` is the
        positive class.
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
        num_samples: int = 4096,
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
        self.num_samples = num_samples

    def fit(self, X, y) -> SelfDistilledGPClassifier:
        """Fit the hyperparameters (optionally) and every distillation step.

        :param X: training inputs, array-like ``(N, d)``.
        :param y: training labels, array-like ``(N,)``, at least two distinct values.
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
        num_samples = check_count(self.num_samples, "num_samples")
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
        if target_type not in ("binary", "multiclass"):
            raise ValueError(
                "Only binary and multiclass classification are supported. The type of the "
                f"target is {target_type}."
            )
        num_classes = len(self.classes_)
        train_x, train_y = to_tensor(X, self.dtype), to_tensor(labels, self.dtype)
        covar_module = make_kernel(self.kernel, self.lengthscale, self.outputscale, dtype)
        if self.optimize_hyperparameters and max_iter > 0 and num_classes == 2:
            LaplaceGPClassifier(train_x, train_y, covar_module).optimize_hyperparameters(
                max_iter=max_iter, lr=lr
            )
        elif self.optimize_hyperparameters and max_iter > 0:
            _maximise_softmax_evidence(train_x, train_y, covar_module, num_classes, max_iter, lr)
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
            num_classes=num_classes,
            num_samples=num_samples,
        )
        with torch.no_grad():
            model.fit()
        self.model_ = model
        self.step_ = num_steps if self.step is None else int(self.step)
        self.n_iter_ = max_iter if self.optimize_hyperparameters else 0
        return self

    def predict_proba(self, X) -> np.ndarray:
        """Class probabilities of step :attr:`step_` at ``X``, ``(M, K)``, columns in the order
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


def _maximise_softmax_evidence(
    train_x: torch.Tensor,
    labels: torch.Tensor,
    covar_module: torch.nn.Module,
    num_classes: int,
    max_iter: int,
    lr: float,
) -> None:
    r"""``max_iter`` Adam iterations at learning rate ``lr`` on ``covar_module``'s parameters,
    maximising the Laplace log marginal likelihood per point of the softmax GPC of ``labels``
    whose :math:`K` latent functions share the kernel (zero prior mean); each iteration's Newton
    run starts from the previous iteration's :math:`\mathbf a` (:math:`\mathbf f = \mathbf K
    \mathbf a`)."""
    optimizer = torch.optim.Adam(covar_module.parameters(), lr=lr)
    alpha = None
    for _ in range(max_iter):
        optimizer.zero_grad()
        covariance = covar_module(train_x).to_dense()
        posterior = MulticlassLaplacePosterior(
            0.0, covariance, "softmax", labels, num_classes=num_classes, init_alpha=alpha
        )
        alpha = posterior.alpha
        loss = -posterior.log_marginal_likelihood() / labels.shape[-1]
        loss.backward()
        optimizer.step()
