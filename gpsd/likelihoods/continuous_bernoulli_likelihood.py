r"""The continuous Bernoulli likelihood for GP models with targets in [0, 1]."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from gpytorch.likelihoods.likelihood import _OneDimensionalLikelihood
from torch import Tensor
from torch.distributions import Distribution

from gpsd.likelihoods.continuous_bernoulli import ContinuousBernoulli

__all__ = ["ContinuousBernoulliLikelihood"]


class ContinuousBernoulliLikelihood(_OneDimensionalLikelihood):
    r"""A continuous Bernoulli likelihood (logit link) for soft targets :math:`y \in [0, 1]`.

    .. math::

        p(y \mid f) = \exp\bigl(y f - A(f)\bigr), \qquad A(f) = \log \frac{e^f - 1}{f},

    which, with :math:`\lambda = \sigma(f)`, is the Bernoulli density :math:`\lambda^y(1-\lambda)^{1-y}`
    times the normalising constant :math:`C(\lambda)` of Loaiza-Ganem & Cunningham (2019); Borup &
    Andersen (§4.1) use it to distil a GP classifier on its own soft predictions. The mean of
    :math:`y` is :math:`A'(f)` (not :math:`\sigma(f)`) and the variance :math:`A''(f) > 0`, so the
    log-likelihood is strictly concave in :math:`f`.

    The likelihood has no learnable parameters. It is a
    :class:`~gpytorch.likelihoods.likelihood._OneDimensionalLikelihood`, so ``VariationalELBO``,
    ``PredictiveLogLikelihood``, ``likelihood(f_samples)`` and ``likelihood(mvn)`` (the marginal, by
    sampling) work as for GPyTorch's own likelihoods; its values come from the stable
    :class:`~gpsd.likelihoods.ContinuousBernoulli`, not from ``torch.distributions`` (which clamps).

    :meth:`expected_log_prob` and :meth:`log_marginal` use Gauss-Hermite quadrature with as many
    nodes as GPyTorch's (``gpytorch.settings.num_gauss_hermite_locs`` at construction), but with the
    nodes and weights in the dtype and on the device of the latent distribution (GPyTorch's are
    float32 unless the likelihood itself is converted, which limits a float64 ELBO to float32
    accuracy), and :meth:`log_marginal` sums in log space, so that it stays finite where every
    :math:`p(y \mid f)` at the nodes underflows.

    Example:

        >>> likelihood = ContinuousBernoulliLikelihood()
        >>> mll = gpytorch.mlls.VariationalELBO(likelihood, model, num_data=soft_y.numel())
        >>> loss = -mll(model(x), soft_y)
    """

    def __init__(self) -> None:
        super().__init__()

    def forward(self, function_samples: Tensor, *args: Any, **kwargs: Any) -> ContinuousBernoulli:
        return ContinuousBernoulli(logits=function_samples)

    def _log_prob_at_nodes(
        self, observations: Tensor, function_dist: Distribution, *args: Any, **kwargs: Any
    ) -> tuple[Tensor, Tensor]:
        r""":math:`\log p(y \mid f_j)` at the Gauss-Hermite nodes :math:`f_j = \mu + \sqrt{2} s x_j`,
        shape ``(J, *batch, n)``, and the log weights :math:`\log(w_j / \sqrt\pi)`, shape ``(J, 1, ...)``."""
        mean, variance = function_dist.mean, function_dist.variance  # shape: (*batch, n)
        nodes, weights = np.polynomial.hermite.hermgauss(self.quadrature.num_locs)
        singletons = (1,) * mean.dim()
        nodes = torch.as_tensor(nodes, dtype=mean.dtype, device=mean.device).view(-1, *singletons)
        log_weights = torch.as_tensor(
            np.log(weights) - 0.5 * math.log(math.pi), dtype=mean.dtype, device=mean.device
        ).view(-1, *singletons)
        points = mean + torch.sqrt(2.0 * variance) * nodes  # shape: (J, *batch, n)
        return self.forward(points, *args, **kwargs).log_prob(observations), log_weights

    def expected_log_prob(
        self, observations: Tensor, function_dist: Distribution, *args: Any, **kwargs: Any
    ) -> Tensor:
        r""":math:`\mathbb{E}_{q(f)}[\log p(y \mid f)]` elementwise, by Gauss-Hermite quadrature.

        :param observations: Targets :math:`y \in [0, 1]`, shape ``(*batch, n)``.
        :param function_dist: :math:`q(f)`, a ``MultivariateNormal`` (its marginal variances are used)
            or a ``torch.distributions.Normal``.
        :return: Shape ``(*batch, n)``.
        """
        log_prob, log_weights = self._log_prob_at_nodes(
            observations, function_dist, *args, **kwargs
        )
        return (log_prob * log_weights.exp()).sum(0)

    def log_marginal(
        self, observations: Tensor, function_dist: Distribution, *args: Any, **kwargs: Any
    ) -> Tensor:
        r""":math:`\log \mathbb{E}_{q(f)}[p(y \mid f)]` elementwise, by Gauss-Hermite quadrature in log
        space (``PredictiveLogLikelihood``).

        :param observations: Targets :math:`y \in [0, 1]`, shape ``(*batch, n)``.
        :param function_dist: :math:`q(f)`, as for :meth:`expected_log_prob`.
        :return: Shape ``(*batch, n)``.
        """
        log_prob, log_weights = self._log_prob_at_nodes(
            observations, function_dist, *args, **kwargs
        )
        return torch.logsumexp(log_prob + log_weights, dim=0)
