r"""The continuous Bernoulli likelihood for GP models with targets in [0, 1]."""

from __future__ import annotations

from typing import Any

import torch
from gpytorch.distributions import MultitaskMultivariateNormal
from gpytorch.likelihoods.likelihood import _OneDimensionalLikelihood
from torch import Tensor
from torch.distributions import Distribution

from gpsd.likelihoods import _cb_quadrature
from gpsd.likelihoods._cb_predictive import predictive_moments
from gpsd.likelihoods.continuous_bernoulli import ContinuousBernoulli
from gpsd.prediction import Prediction

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
        >>> soft = likelihood.predictive_moments(model(test_x)).mean  # E[y], shape (M,)

    ``likelihood(model(test_x))``, GPyTorch's marginal, is a batch of
    :class:`~gpsd.likelihoods.ContinuousBernoulli` over latent samples (its ``mean`` has shape
    ``(samples, M)``); :meth:`predictive_moments` gives the predictive mean and variance of
    :math:`y` themselves, by quadrature.
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

    def predictive_moments(self, function_dist: Distribution) -> Prediction:
        r"""The predictive mean and variance of the target :math:`y` at each latent marginal.

        .. math::

            \mathbb E[y] = \mathbb E_{q(f)}[A'(f)], \qquad
            \operatorname{Var}[y] = \mathbb E_{q(f)}[A''(f)] + \operatorname{Var}_{q(f)}[A'(f)],

        for :math:`q(f) = \mathcal N(\mu, s^2)` at each point. The mean is the predicted soft
        label, the probability of class 1 that the soft targets encode. It is neither
        :math:`\sigma(\mu)` (the Bernoulli's mean at the latent mean) nor :math:`A'(\mu)`:
        :math:`A'(f) \ne \sigma(f)`, and the latent's variance pulls :math:`\mathbb E[y]` towards
        1/2. Unlike ``likelihood(function_dist).mean`` (GPyTorch's marginal by sampling, shape
        ``(samples, M)``), it is deterministic, of the latent's shape, and accurate at any latent
        variance: composite Gauss-Legendre rules over :math:`\mu \pm 8.5 s`, with a panel on the
        bend of :math:`A'` at :math:`f = 0` (to about :math:`10^{-12}` in float64 against adaptive
        quadrature). Differentiable in :math:`\mu` and :math:`s^2`.

        :param function_dist: :math:`q(f)` with ``mean`` and ``variance`` (a ``MultivariateNormal``,
            whose marginal variances are used, or a ``torch.distributions.Normal``), shape
            ``(*batch, M)``.
        :return: A :class:`~gpsd.Prediction` with ``mean`` :math:`\mathbb E[y] \in (0, 1)` and
            ``variance`` :math:`\operatorname{Var}[y]`, shape ``(*batch, M)``.
        :raises TypeError: ``function_dist`` has no ``mean`` and ``variance``.
        :raises ValueError: a mean or variance is not finite, or a variance is negative.
        """
        if not (hasattr(function_dist, "mean") and hasattr(function_dist, "variance")):
            raise TypeError(
                "function_dist must be a distribution with mean and variance (a "
                f"MultivariateNormal), got {type(function_dist).__name__}"
            )
        mean, variance = function_dist.mean, function_dist.variance
        if not (torch.isfinite(mean).all() and torch.isfinite(variance).all()):
            raise ValueError("function_dist has a non-finite mean or variance")
        if (variance < 0).any():
            raise ValueError("function_dist has a negative variance")
        return Prediction(*predictive_moments(mean, variance))


def _sum_tasks(values: Tensor, function_dist: Distribution) -> Tensor:
    """``values`` of shape ``(*batch, n, T)`` summed over the ``T`` tasks of a
    ``MultitaskMultivariateNormal`` (GPyTorch's ELBO sums only over the data points)."""
    if isinstance(function_dist, MultitaskMultivariateNormal):
        return values.sum(-1)
    return values
