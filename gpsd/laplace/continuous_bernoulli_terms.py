r"""Continuous Bernoulli likelihood (logit link) for the Laplace engine."""

from __future__ import annotations

import torch
from torch import Tensor

from gpsd.laplace.likelihood_terms import LaplaceLikelihoodTerms
from gpsd.likelihoods.log_normalizer import cb_log_density, cb_mean, cb_variance

__all__ = ["ContinuousBernoulliTerms"]


class ContinuousBernoulliTerms(LaplaceLikelihoodTerms):
    r"""Continuous Bernoulli likelihood, soft targets :math:`y \in [0, 1]` (Borup & Andersen, A.2).

    .. math::

        \log p(y \mid f) = y f - A(f), \quad \partial_f = y - A'(f), \quad \partial_f^2 = -A''(f),

    which equals the paper's :math:`y f - \log(1 + e^f) + \log C(\sigma(f))` with gradient
    :math:`y - \sigma(f) + \nabla \log C` and Hessian :math:`-W + \nabla\nabla \log C`.
    :meth:`response` is :math:`\sigma(f)`, so that :math:`\mathbb{E}_q[\sigma(f)]` is the soft target
    that data-centric distillation passes on (§4.1).
    """

    name = "continuous Bernoulli"
    symmetric_response = True

    def log_prob(self, y: Tensor, f: Tensor) -> Tensor:
        return cb_log_density(y, f)

    def derivatives(self, y: Tensor, f: Tensor) -> tuple[Tensor, Tensor]:
        return y - cb_mean(f), -cb_variance(f)

    def response(self, f: Tensor) -> Tensor:
        return torch.sigmoid(f)

    def check_targets(self, y: Tensor, name: str = "train_y") -> None:
        if not torch.isfinite(y).all():
            raise ValueError(f"{name} must be finite, but it holds NaN or infinite values")
        if ((y < 0) | (y > 1)).any():
            bad = y[(y < 0) | (y > 1)].flatten()[:3].tolist()
            raise ValueError(f"{name} must hold soft targets in [0, 1], got values such as {bad}")
