r"""Predictions of a Laplace-approximated GP classifier: latent mean and variance (Borup & Andersen,
eqs. 2-3) and class probabilities by Gauss-Hermite quadrature or the probit approximation."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

from gpsd._validation import check_int
from gpsd.laplace.bernoulli_probit_terms import BernoulliProbitTerms
from gpsd.laplace.newton import LaplaceMode

__all__ = [
    "closed_form_probability",
    "gauss_hermite_expectation",
    "laplace_latent_predictive",
    "probit_approximation",
]


def laplace_latent_predictive(
    mode: LaplaceMode,
    K_cross: Tensor,
    K_test: Tensor,
    test_prior_mean: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    r"""Latent predictive mean and covariance (or variance) at test inputs.

    .. math::

        \mu_* = m(\mathbf x_*) + \mathbf k_*^\top \mathbf a, \qquad
        \Sigma_* = k(\mathbf x_*, \mathbf x_*) - \mathbf v^\top \mathbf v, \quad
        \mathbf v = \mathbf L^{-1} \mathbf W^{1/2} \mathbf k_*,

    where :math:`\mathbf a = \mathbf K^{-1}(\hat{\mathbf f} - \mathbf m)` and
    :math:`\mathbf v^\top\mathbf v = \mathbf k_*^\top (\mathbf K + \mathbf W^{-1})^{-1} \mathbf k_*`.

    :param mode: The converged :class:`LaplaceMode`.
    :param K_cross: :math:`k(\mathbf x_*, \mathbf X)`, shape ``(*batch, m, n)``.
    :param K_test: :math:`k(\mathbf x_*, \mathbf x_*)` as a full matrix ``(*batch, m, m)`` (full
        covariance returned) or its diagonal ``(*batch, m)`` (variances returned).
    :param test_prior_mean: :math:`m(\mathbf x_*)`, shape ``(*batch, m)`` (default 0).
    :return: ``(mean, covariance_or_variance)``.
    """
    mean = (K_cross @ mode.alpha.unsqueeze(-1)).squeeze(-1)  # shape: (*batch, m)
    if test_prior_mean is not None:
        mean = mean + test_prior_mean
    scaled = mode.sqrt_W.unsqueeze(-1) * K_cross.transpose(-1, -2)  # shape: (*batch, n, m)
    v = torch.linalg.solve_triangular(mode.chol_B, scaled, upper=False)
    if K_test.dim() == K_cross.dim():
        cov = K_test - v.transpose(-1, -2) @ v
    else:
        cov = K_test - v.square().sum(-2)
    return mean, cov


def gauss_hermite_expectation(
    function: Callable[[Tensor], Tensor], mean: Tensor, variance: Tensor, num_points: int = 64
) -> Tensor:
    r""":math:`\mathbb{E}[g(f)]`, :math:`f \sim \mathcal{N}(\mu, s^2)`, by Gauss-Hermite quadrature.

    .. math::

        \mathbb{E}[g(f)] \approx \frac{1}{\sqrt\pi} \sum_{j=1}^J w_j\, g(\mu + \sqrt{2} s\, x_j),

    exact for polynomials :math:`g` of degree :math:`< 2J`.

    :param function: Elementwise :math:`g`.
    :param mean: :math:`\mu`, any shape.
    :param variance: :math:`s^2 \ge 0`, same shape as ``mean``.
    :param num_points: :math:`J`.
    """
    num_points = check_int(num_points, "num_points")
    nodes, weights = np.polynomial.hermite.hermgauss(num_points)
    nodes = torch.as_tensor(nodes, dtype=mean.dtype, device=mean.device)
    weights = torch.as_tensor(weights, dtype=mean.dtype, device=mean.device) / math.sqrt(math.pi)
    std = variance.clamp_min(0.0).sqrt()
    points = mean.unsqueeze(-1) + math.sqrt(2.0) * std.unsqueeze(-1) * nodes  # shape: (..., J)
    return (function(points) * weights).sum(-1)


def closed_form_probability(terms: object, mean: Tensor, variance: Tensor) -> Tensor:
    r""":math:`\mathbb{E}[r(f)]`, :math:`f \sim \mathcal{N}(\mu, s^2)`, in closed form.

    Exact for a probit response, :math:`\mathbb{E}[\Phi(f)] = \Phi(\mu / \sqrt{1 + s^2})`;
    MacKay's :func:`probit_approximation` for a logistic one (``terms`` of any other likelihood).
    """
    if isinstance(terms, BernoulliProbitTerms):
        return torch.special.ndtr(mean / torch.sqrt(1.0 + variance.clamp_min(0.0)))
    return probit_approximation(mean, variance)


def probit_approximation(mean: Tensor, variance: Tensor) -> Tensor:
    r"""MacKay's probit approximation :math:`\mathbb{E}[\sigma(f)] \approx
    \sigma\bigl(\mu / \sqrt{1 + \pi s^2 / 8}\bigr)` (Rasmussen & Williams, eq. 3.25 footnote)."""
    return torch.sigmoid(mean / torch.sqrt(1.0 + math.pi * variance.clamp_min(0.0) / 8.0))
