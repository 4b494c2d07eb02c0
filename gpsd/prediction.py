"""The one result type of every ``predict`` in gpsd."""

from __future__ import annotations

from dataclasses import dataclass

from gpytorch.distributions import MultivariateNormal
from linear_operator.operators import DiagLinearOperator
from torch import Tensor

__all__ = ["Prediction"]


@dataclass(frozen=True)
class Prediction:
    r"""Predictive means and variances (and, on request, covariances) at test inputs.

    Every regressor's ``predict`` and every classifier's ``predict_latent`` returns one. A
    distiller's prediction holds every step along a leading step dimension, after the batch:
    ``mean`` and ``variance`` of shape ``(*batch, T, M)``, row ``t - 1`` for step ``t``
    (``predict(..., step=t)`` returns that row alone, ``(*batch, M)``). Other models return
    ``(*batch, M)``.

    :param mean: :math:`\mu_*`, shape ``(*batch, [T,] M)``.
    :param variance: :math:`\sigma^2_*`, the same shape; latent unless the prediction was asked
        for with ``include_noise=True``.
    :param covariance: :math:`\Sigma_*`, shape ``(*batch, [T,] M, M)``, where asked for
        (``full_cov=True``); else ``None``.
    """

    mean: Tensor
    variance: Tensor
    covariance: Tensor | None = None

    @property
    def stddev(self) -> Tensor:
        r""":math:`\sigma_* = \sqrt{\sigma^2_*}`, the shape of :attr:`mean`."""
        return self.variance.clamp_min(0).sqrt()

    def to_distribution(self) -> MultivariateNormal:
        """The prediction as a GPyTorch ``MultivariateNormal`` (diagonal without covariances)."""
        if self.covariance is not None:
            return MultivariateNormal(self.mean, self.covariance)
        return MultivariateNormal(self.mean, DiagLinearOperator(self.variance))

    def select(self, index: int, dim: int) -> Prediction:
        """The prediction with ``index`` taken along dimension ``dim`` of :attr:`mean` (counted
        from the end for negative ``dim``; covariances indexed to match)."""
        dim = dim % self.mean.dim()
        covariance = None
        if self.covariance is not None:
            covariance = self.covariance.select(dim, index)
        return Prediction(
            self.mean.select(dim, index), self.variance.select(dim, index), covariance
        )

    def __repr__(self) -> str:
        cov = "" if self.covariance is None else f", covariance={tuple(self.covariance.shape)}"
        return (
            f"Prediction(mean={tuple(self.mean.shape)}, variance={tuple(self.variance.shape)}"
            f"{cov}, dtype={self.mean.dtype}, device={self.mean.device})"
        )
