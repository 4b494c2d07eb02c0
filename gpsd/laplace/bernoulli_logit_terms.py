r"""Bernoulli likelihood with the logistic link for the Laplace engine."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from gpsd.laplace.likelihood_terms import LaplaceLikelihoodTerms

__all__ = ["BernoulliLogitTerms"]


def check_binary_targets(y: Tensor, name: str) -> None:
    if not torch.isfinite(y).all():
        raise ValueError(f"{name} must be finite, but it holds NaN or infinite values")
    if not ((y == 0) | (y == 1)).all():
        bad = y[(y != 0) & (y != 1)].flatten()[:3].tolist()
        raise ValueError(f"{name} must hold binary labels in {{0, 1}}, got values such as {bad}")


class BernoulliLogitTerms(LaplaceLikelihoodTerms):
    r"""Bernoulli-logistic likelihood, targets :math:`y \in \{0, 1\}`.

    .. math::

        \log p(y \mid f) = y f - \log(1 + e^f), \quad
        \partial_f = y - \sigma(f), \quad \partial_f^2 = -\sigma(f)(1 - \sigma(f)).
    """

    name = "Bernoulli-logistic"
    symmetric_response = True

    def log_prob(self, y: Tensor, f: Tensor) -> Tensor:
        # y log sigma(f) + (1 - y) log sigma(-f) equals y f - log(1 + e^f) for any y, and neither
        # cancels nor (like softplus above its threshold of 20) rounds the tail away for y in {0, 1}
        return y * F.logsigmoid(f) + (1.0 - y) * F.logsigmoid(-f)

    def derivatives(self, y: Tensor, f: Tensor) -> tuple[Tensor, Tensor]:
        p, q = torch.sigmoid(f), torch.sigmoid(-f)
        return y * q - (1.0 - y) * p, -p * q  # y - sigma(f) without cancellation at y = 1

    def response(self, f: Tensor) -> Tensor:
        return torch.sigmoid(f)

    def check_targets(self, y: Tensor, name: str = "train_y") -> None:
        check_binary_targets(y, name)
