r"""Bernoulli likelihood with the probit link for the Laplace engine."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from gpsd._internal.mills_ratio import mills_ratio_fraction
from gpsd.laplace.bernoulli_logit_terms import check_binary_targets
from gpsd.laplace.likelihood_terms import LaplaceLikelihoodTerms

__all__ = ["BernoulliProbitTerms"]


class BernoulliProbitTerms(LaplaceLikelihoodTerms):
    r"""Bernoulli-probit likelihood, targets :math:`y \in \{0, 1\}` (GPyTorch's ``BernoulliLikelihood``).

    With :math:`s = 2y - 1`, :math:`z = s f` and :math:`r = \mathcal{N}(z) / \Phi(z)` (evaluated
    through ``log_ndtr`` so that it stays finite in the far tail):

    .. math::

        \log p(y \mid f) = \log \Phi(z), \quad \partial_f = s\, r, \quad \partial_f^2 = -r^2 - z r.
    """

    name = "Bernoulli-probit"
    symmetric_response = True

    def log_prob(self, y: Tensor, f: Tensor) -> Tensor:
        return torch.special.log_ndtr((2.0 * y - 1.0) * f)

    def derivatives(self, y: Tensor, f: Tensor) -> tuple[Tensor, Tensor]:
        s = 2.0 * y - 1.0
        z = s * f
        log_pdf = -0.5 * z.square() - 0.5 * math.log(2.0 * math.pi)
        r = torch.exp(log_pdf - torch.special.log_ndtr(z))
        # For z < -5, r + z cancels (r ~ -z); the continued fraction gives it directly.
        tail = z < -_TAIL_START
        t = (-z).clamp_min(_TAIL_START)
        r_plus_z = _mills_tail(t)
        r = torch.where(tail, t + r_plus_z, r)
        r_plus_z = torch.where(tail, r_plus_z, r + z)
        return s * r, -r * r_plus_z

    def response(self, f: Tensor) -> Tensor:
        return torch.special.ndtr(f)

    def check_targets(self, y: Tensor, name: str = "train_y") -> None:
        check_binary_targets(y, name)


#: Below ``z = -_TAIL_START`` the probit curvature uses :func:`_mills_tail`.
_TAIL_START = 5.0


def _mills_tail(t: Tensor, terms: int = 40) -> Tensor:
    r""":math:`r(-t) - t` for :math:`t \ge 5`, with :math:`r(z) = \phi(z) / \Phi(z)`: the tail
    :math:`T` of Laplace's continued fraction (:func:`~gpsd._internal.mills_ratio.mills_ratio_fraction`),
    which 40 terms evaluate to float64 rounding for :math:`t \ge 5` (checked against mpmath)."""
    return mills_ratio_fraction(t, terms)[0]
