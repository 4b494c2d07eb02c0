r"""The continuous Bernoulli likelihood for GP models with targets in [0, 1]."""

from __future__ import annotations

from typing import Any

import torch
from gpytorch.distributions import MultitaskMultivariateNormal
from gpytorch.likelihoods.likelihood import _OneDimensionalLikelihood
from torch import Tensor
from torch.distributions import Distribution

from gpsd.likelihoods import _cb_quadrature
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

    :meth:`expected_log_prob` and :meth:`log_marginal` are accurate at every latent variance.
    Gauss-Hermite quadrature alone, as GPyTorch's ``_OneDimensionalLikelihood`` does it, places its
    nodes on the scale :math:`s` of the latent, so once :math:`s^2 \gg 1` (early in SVGP
    training, or under a prior with a large output scale) the unit-width bend of :math:`A` at
    :math:`f = 0` falls between nodes: with 20 nodes, the largest error in each of three draws of
    20 to 60 latents with :math:`s^2 \in [3, 10^4]` was 0.24 to 0.76 nats for the ELBO term and
    2.2 to 8.5 nats for the log marginal (against mpmath; ``benchmarks/bench_cb_likelihood.py``). Here Gauss-Hermite, with as many nodes as GPyTorch's
    (``gpytorch.settings.num_gauss_hermite_locs`` at construction) and computed in the latent's
    dtype and on its device, is kept for :math:`s^2 \le 3` (:math:`\le 2` for the log marginal).
    Above, each quantity is split into closed forms in :math:`\Phi` and :math:`\varphi` plus
    integrals that are smooth on the scale of the Gauss-Laguerre or Gauss-Legendre rule that
    computes them (see ``gpsd/likelihoods/_cb_quadrature.py`` for the formulas); the log marginal
    stays in log space throughout, so it is finite where every :math:`p(y \mid f)` underflows.
    Against mpmath at 25 digits (errors relative to :math:`\max(|\text{exact}|, 1)`, for
    :math:`s^2` from :math:`10^{-4}` to :math:`10^{10}`, :math:`|\mu|` up to :math:`10^8` and
    :math:`y \in [0, 1]`) values and their gradients in the latent mean and variance agree to
    :math:`3 \times 10^{-12}` in float64; in float32 values agree to :math:`10^{-6}` and gradients
    in the mean to :math:`2 \times 10^{-5}`. Both are differentiable once (the analytic derivative
    of one special function replaces a taped 60-step continued fraction).

    Example:

        >>> likelihood = ContinuousBernoulliLikelihood()
        >>> mll = gpytorch.mlls.VariationalELBO(likelihood, model, num_data=soft_y.numel())
        >>> loss = -mll(model(x), soft_y)
    """

    def __init__(self) -> None:
        super().__init__()

    def forward(self, function_samples: Tensor, *args: Any, **kwargs: Any) -> ContinuousBernoulli:
        return ContinuousBernoulli(logits=function_samples)

    def _prepare(
        self, observations: Tensor, function_dist: Distribution
    ) -> tuple[Tensor, Tensor, Tensor, torch.Size]:
        """Targets, means and variances broadcast and flattened, in the latent dtype and device."""
        mean, variance = function_dist.mean, function_dist.variance  # shape: (*batch, n)
        observations = torch.as_tensor(observations, dtype=mean.dtype, device=mean.device)
        n = mean.shape[-1] if mean.dim() else 1
        if observations.dim() and observations.shape[-1] != n and n != 1:
            # (n, 1) targets against n latents would broadcast to an (n, n) term without this;
            # one latent value against n targets broadcasts as intended
            raise ValueError(
                f"observations must have shape (*batch, {n}), one target per latent function "
                f"value, got shape {tuple(observations.shape)}"
            )
        try:
            observations, mean, variance = torch.broadcast_tensors(observations, mean, variance)
        except RuntimeError:
            raise ValueError(
                f"the batch shape of observations {tuple(observations.shape)} does not broadcast "
                f"against the latent distribution's {tuple(mean.shape)}"
            ) from None
        dist = self.forward(mean.detach())
        if dist._validate_args:  # the support check of log_prob: targets outside [0, 1] raise
            dist._validate_sample(observations)
        shape = mean.shape
        return observations.reshape(-1), mean.reshape(-1), variance.reshape(-1), shape

    def expected_log_prob(
        self, observations: Tensor, function_dist: Distribution, *args: Any, **kwargs: Any
    ) -> Tensor:
        r""":math:`\mathbb{E}_{q(f)}[\log p(y \mid f)]` elementwise, accurate at any latent variance.

        See the class description for the method and its accuracy.

        :param observations: Targets :math:`y \in [0, 1]`, shape ``(*batch, n)``, or
            ``(*batch, n, T)`` for a ``MultitaskMultivariateNormal`` of ``T`` tasks.
        :param function_dist: :math:`q(f)`, a ``MultivariateNormal`` (its marginal variances are used),
            a ``MultitaskMultivariateNormal`` or a ``torch.distributions.Normal``.
        :return: Shape ``(*batch, n)`` (the broadcast shape of targets and latents), summed over
            the tasks of a ``MultitaskMultivariateNormal`` (one term per data point, as
            ``VariationalELBO`` expects).
        """
        y, mean, variance, shape = self._prepare(observations, function_dist)
        num_locs = self.quadrature.num_locs
        out = _cb_quadrature.expected_log_prob(y, mean, variance, num_locs).reshape(shape)
        return _sum_tasks(out, function_dist)

    def log_marginal(
        self, observations: Tensor, function_dist: Distribution, *args: Any, **kwargs: Any
    ) -> Tensor:
        r""":math:`\log \mathbb{E}_{q(f)}[p(y \mid f)]` elementwise (``PredictiveLogLikelihood``),
        accurate at any latent variance and in log space throughout.

        See the class description for the method and its accuracy.

        :param observations: Targets :math:`y \in [0, 1]`, as for :meth:`expected_log_prob`.
        :param function_dist: :math:`q(f)`, as for :meth:`expected_log_prob`.
        :return: Shape ``(*batch, n)`` (the broadcast shape of targets and latents), summed over
            the tasks of a ``MultitaskMultivariateNormal``: the log marginal of each point's
            tasks taken as independent given their marginals (exact for independent tasks, as
            with ``IndependentMultitaskVariationalStrategy``).
        """
        y, mean, variance, shape = self._prepare(observations, function_dist)
        num_locs = self.quadrature.num_locs
        out = _cb_quadrature.log_marginal(y, mean, variance, num_locs).reshape(shape)
        return _sum_tasks(out, function_dist)


def _sum_tasks(values: Tensor, function_dist: Distribution) -> Tensor:
    """``values`` of shape ``(*batch, n, T)`` summed over the ``T`` tasks of a
    ``MultitaskMultivariateNormal`` (GPyTorch's ELBO sums only over the data points)."""
    if isinstance(function_dist, MultitaskMultivariateNormal):
        return values.sum(-1)
    return values
