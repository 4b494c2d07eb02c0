r"""The continuous categorical likelihood for GP models with K latent functions and soft targets
on the simplex."""

from __future__ import annotations

from typing import Any

import torch
from gpytorch import settings
from gpytorch.likelihoods import Likelihood
from torch import Tensor
from torch.distributions import Distribution

from gpsd._internal.validation import check_int
from gpsd.likelihoods.cc_log_normalizer import cc_log_normalizer, cc_mean
from gpsd.likelihoods.continuous_categorical import ContinuousCategorical

__all__ = ["ContinuousCategoricalLikelihood"]


class ContinuousCategoricalLikelihood(Likelihood):
    r"""A continuous categorical likelihood over :math:`K` latent functions for soft targets
    :math:`\mathbf y` on the simplex (a teacher's class probabilities, say).

    .. math::

        p(\mathbf y \mid \mathbf f) = \exp\bigl(\mathbf f^\top \mathbf y - A(\mathbf f)\bigr),
        \qquad A(\mathbf f) = \log \sum_{k=1}^K \frac{e^{f_k}}{\prod_{i \ne k} (f_k - f_i)},

    the :class:`~gpsd.likelihoods.ContinuousCategorical` with natural parameters :math:`\mathbf f`,
    the :math:`K` latent function values at an input. It is the :math:`K`-class counterpart of
    the :class:`~gpsd.likelihoods.ContinuousBernoulliLikelihood` (which it equals at
    :math:`K = 2` with :math:`f = f_2 - f_1`); :math:`\log p` is concave in :math:`\mathbf f`
    and depends only on the differences of its entries.

    For SVGP models with :math:`K` outputs (``IndependentMultitaskVariationalStrategy`` or
    ``LMCVariationalStrategy`` with ``num_tasks=K``), whose ``model(x)`` is a
    ``MultitaskMultivariateNormal`` with event shape ``(n, K)``: ``likelihood(f_samples)`` with
    samples of shape ``(..., n, K)`` is the distribution of the targets, and
    :meth:`expected_log_prob` gives ``VariationalELBO`` its term. ``likelihood(model(x))`` and
    ``log_marginal`` sample as GPyTorch's own likelihoods do
    (``gpytorch.settings.num_likelihood_samples``).

    The likelihood has no learnable parameters.

    :param num_classes: :math:`K \ge 2`, the number of latent functions and of target entries.

    Example:

        >>> likelihood = ContinuousCategoricalLikelihood(num_classes=3)
        >>> mll = gpytorch.mlls.VariationalELBO(likelihood, model, num_data=soft_y.shape[0])
        >>> loss = -mll(model(x), soft_y)  # soft_y: (n, 3), rows on the simplex
    """

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.num_classes = check_int(num_classes, "num_classes", minimum=2)

    def _check_latents(self, latents: Tensor, name: str) -> None:
        if latents.dim() < 1 or latents.shape[-1] != self.num_classes:
            raise ValueError(
                f"{name} must have shape (..., {self.num_classes}), one value per latent "
                f"function of the {self.num_classes} classes, got shape {tuple(latents.shape)}"
            )

    def forward(self, function_samples: Tensor, *args: Any, **kwargs: Any) -> ContinuousCategorical:
        self._check_latents(function_samples, "function_samples")
        return ContinuousCategorical(logits=function_samples)

    def expected_log_prob(
        self, observations: Tensor, function_dist: Distribution, *args: Any, **kwargs: Any
    ) -> Tensor:
        r""":math:`\mathbb E_{q(\mathbf f)}[\log p(\mathbf y \mid \mathbf f)]` for each input.

        .. math::

            \mathbb E_q[\log p(\mathbf y \mid \mathbf f)] = \boldsymbol\mu^\top \mathbf y
            - \mathbb E_q[A(\mathbf f)],

        the first term exact, the second by Monte Carlo with ``num_likelihood_samples``
        reparameterised draws :math:`\mathbf f_s = \boldsymbol\mu + \boldsymbol\sigma \odot
        \boldsymbol\varepsilon_s` from the marginals of :math:`q` at each input, with the
        linearisation of :math:`A` at :math:`\boldsymbol\mu` as control variate:

        .. math::

            \mathbb E_q[A(\mathbf f)] \approx \frac1S \sum_{s=1}^S \Bigl(A(\mathbf f_s)
            - \nabla A(\boldsymbol\mu)^\top (\mathbf f_s - \boldsymbol\mu)\Bigr),

        unbiased (the control variate has mean zero, and :math:`\nabla A(\boldsymbol\mu)` is
        held constant), with an error that vanishes as the latent variance does. The :math:`K`
        latents at an input are taken as independent given their marginals: exact for
        ``IndependentMultitaskVariationalStrategy``; for ``LMCVariationalStrategy`` their
        correlation is left out, as GPyTorch's own likelihoods do when training.

        :param observations: Targets on the simplex, shape ``(*batch, n, K)``.
        :param function_dist: :math:`q(\mathbf f)` with mean and variance of shape
            ``(*batch, n, K)``, such as a ``MultitaskMultivariateNormal``.
        :return: Shape ``(*batch, n)``.
        """
        mean, variance = function_dist.mean, function_dist.variance
        self._check_latents(mean, "the mean of function_dist")
        observations = torch.as_tensor(observations, dtype=mean.dtype, device=mean.device)
        self._check_latents(observations, "observations")
        ContinuousCategorical(mean.detach())._validate_sample(observations)
        num_samples = settings.num_likelihood_samples.value()
        noise = torch.randn(
            (num_samples, *mean.shape), dtype=mean.dtype, device=mean.device
        )  # shape: (S, *batch, n, K)
        deviation = variance.clamp_min(0.0).sqrt() * noise
        slope = cc_mean(mean)  # detached
        normaliser = cc_log_normalizer(mean + deviation) - (slope * deviation).sum(-1)
        return (mean * observations).sum(-1) - normaliser.mean(0)
