r"""The continuous Bernoulli likelihood for GP models with targets in [0, 1]."""

from __future__ import annotations

from typing import Any

from gpytorch.likelihoods.likelihood import _OneDimensionalLikelihood
from torch import Tensor

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

    Example:

        >>> likelihood = ContinuousBernoulliLikelihood()
        >>> mll = gpytorch.mlls.VariationalELBO(likelihood, model, num_data=soft_y.numel())
        >>> loss = -mll(model(x), soft_y)
    """

    def __init__(self) -> None:
        super().__init__()

    def forward(self, function_samples: Tensor, *args: Any, **kwargs: Any) -> ContinuousBernoulli:
        return ContinuousBernoulli(logits=function_samples)
