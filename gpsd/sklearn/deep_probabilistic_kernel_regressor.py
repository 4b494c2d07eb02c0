r"""A scikit-learn regressor over :class:`~gpsd.DPKLRegressor` (deep probabilistic kernel
learning)."""

from __future__ import annotations

import numbers
import warnings

import torch
from gpytorch.utils.warnings import GPInputWarning
from sklearn.base import BaseEstimator, RegressorMixin
from sklearn.utils.validation import check_is_fitted, validate_data
from torch import nn

from gpsd.dpkl import DPKLRegressor
from gpsd.sklearn._common import (
    check_count,
    check_positive,
    numpy_dtype,
    regression_data,
    seed_from,
    to_numpy,
    to_tensor,
    torch_dtype,
    torch_seed,
)

__all__ = ["DeepProbabilisticKernelRegressor"]


def _network(in_features: int, hidden_layer_sizes: tuple[int, ...], latent_dim: int) -> nn.Module:
    """A multilayer perceptron ``in_features -> hidden_layer_sizes -> latent_dim`` with tanh."""
    layers: list[nn.Module] = []
    width = in_features
    for hidden in hidden_layer_sizes:
        layers += [nn.Linear(width, hidden), nn.Tanh()]
        width = hidden
    layers.append(nn.Linear(width, latent_dim))
    return nn.Sequential(*layers)


class DeepProbabilisticKernelRegressor(RegressorMixin, BaseEstimator):
    r"""Deep probabilistic kernel learning (Mallick et al., 2021) as a scikit-learn regressor.

    The scikit-learn face of :class:`~gpsd.DPKLRegressor` (named apart from it, so that both
    can be imported side by side): ``num_particles`` copies of a multilayer perceptron
    ``n_features -> hidden_layer_sizes -> latent_dim`` (tanh activations) embed each input as a
    distribution of particles, an exact GP on the random-feature kernel between these
    distributions models the targets, and :meth:`fit` trains the particles, the kernel's
    hyperparameters and the noise with Adam (``max_iter`` iterations, learning rate ``lr``;
    see :meth:`~gpsd.DPKLRegressor.fit`).

    :param hidden_layer_sizes: the widths of the hidden layers (``()``: a linear map).
    :param latent_dim: :math:`d`, the width of the embedding.
    :param num_particles: :math:`m`, the number of networks.
    :param num_random_features: :math:`R` (``2R`` random Fourier features).
    :param update: ``"paper"`` (Prop. 1) or ``"svgd"``.
    :param normalize_y: standardise the targets before fitting (predictions are scaled back).
    :param max_iter: Adam iterations.
    :param lr: Adam's learning rate.
    :param random_state: seeds the networks' initialisation and the random features (``None``,
        an ``int`` or a ``RandomState``); torch's global generator is left as it was.
    :param dtype: ``"float64"`` or ``"float32"``.

    :ivar model_: the fitted :class:`~gpsd.DPKLRegressor` (on standardised targets with
        ``normalize_y``).
    :ivar n_iter_: the Adam iterations run.
    :ivar n_features_in_: the number of input features.
    """

    def __init__(
        self,
        hidden_layer_sizes: tuple[int, ...] = (16,),
        latent_dim: int = 2,
        num_particles: int = 4,
        num_random_features: int = 32,
        update: str = "paper",
        normalize_y: bool = True,
        max_iter: int = 60,
        lr: float = 0.03,
        random_state: object = None,
        dtype: str = "float64",
    ) -> None:
        self.hidden_layer_sizes = hidden_layer_sizes
        self.latent_dim = latent_dim
        self.num_particles = num_particles
        self.num_random_features = num_random_features
        self.update = update
        self.normalize_y = normalize_y
        self.max_iter = max_iter
        self.lr = lr
        self.random_state = random_state
        self.dtype = dtype

    def fit(self, X, y) -> DeepProbabilisticKernelRegressor:
        """Build the particles and train the model.

        :param X: training inputs, array-like ``(N, D)``.
        :param y: training targets, array-like ``(N,)``.
        :return: ``self``.
        """
        if isinstance(self.hidden_layer_sizes, numbers.Integral):
            hidden = (check_count(self.hidden_layer_sizes, "hidden_layer_sizes"),)
        else:
            hidden = tuple(check_count(h, "hidden_layer_sizes") for h in self.hidden_layer_sizes)
        latent_dim = check_count(self.latent_dim, "latent_dim")
        max_iter = check_count(self.max_iter, "max_iter", minimum=0)
        lr = check_positive(self.lr, "lr")
        dtype = torch_dtype(self.dtype)
        seed = seed_from(self.random_state)
        train_x, train_y = regression_data(self, X, y)
        in_features = train_x.shape[1]
        with torch_seed(seed):
            model = DPKLRegressor(
                train_x,
                train_y,
                lambda: _network(in_features, hidden, latent_dim).to(dtype),
                num_particles=check_count(self.num_particles, "num_particles"),
                latent_dim=latent_dim,
                num_random_features=check_count(self.num_random_features, "num_random_features"),
                update=self.update,
            )
            model.fit(max_iter=max_iter, lr=lr)
        self.model_ = model
        self.n_iter_ = max_iter
        return self

    def predict(self, X, return_std: bool = False):
        """The latent predictive mean at ``X``, ``(M,)``; with ``return_std``, also its
        standard deviation ``(M,)``."""
        check_is_fitted(self, "model_")
        X = validate_data(self, X, reset=False, dtype=numpy_dtype(self.dtype))
        with torch.no_grad(), warnings.catch_warnings():
            # predicting at the training inputs (score on the training set) is intended here
            warnings.simplefilter("ignore", GPInputWarning)
            prediction = self.model_.predict(to_tensor(X, self.dtype))
        mean = to_numpy(prediction.mean) * self._y_std + self._y_mean
        if not return_std:
            return mean
        return mean, to_numpy(prediction.stddev) * self._y_std
