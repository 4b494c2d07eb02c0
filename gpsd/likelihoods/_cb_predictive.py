r"""Predictive moments of a continuous Bernoulli target under a Gaussian latent.

For :math:`f \sim \mathcal N(\mu, s^2)` and :math:`y \mid f` continuous Bernoulli with logit
:math:`f`,

.. math::

    \mathbb E[y] = \mathbb E[A'(f)], \qquad
    \operatorname{Var}[y] = \mathbb E[A''(f)] + \mathbb E[A'(f)^2] - \mathbb E[A'(f)]^2,

both as integrals over the standardised latent :math:`z = (f - \mu) / s` on
:math:`[-8.5, 8.5]` (the mass outside is below :math:`10^{-16}`) by composite Gauss-Legendre
rules. :math:`A'` and :math:`A''` are analytic with their nearest poles at :math:`f = \pm 2\pi i`,
but bend within a few units of :math:`f = 0`, which on the scale :math:`s \gg 1` of the latent is
a step that Gauss-Hermite nodes straddle; one panel therefore covers :math:`|f| \le 20` (where
it meets the range), and the panels either side hold the smooth tails.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch
from torch import Tensor

from gpsd.likelihoods.log_normalizer import cb_mean, cb_variance

_Z_MAX = 8.5  # P(|Z| > 8.5) < 2e-17
_BEND = 20.0  # the panel around f = 0 covers |f| <= _BEND
_NUM_NODES = 48  # per panel


@lru_cache(maxsize=16)
def _legendre(dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor]:
    x, w = np.polynomial.legendre.leggauss(_NUM_NODES)
    return (
        torch.as_tensor(x, dtype=dtype, device=device),
        torch.as_tensor(w, dtype=dtype, device=device),
    )


def predictive_moments(mean: Tensor, variance: Tensor) -> tuple[Tensor, Tensor]:
    r""":math:`\mathbb E[y]` and :math:`\operatorname{Var}[y]` for latents
    :math:`\mathcal N(\text{mean}, \text{variance})`, elementwise (broadcast shapes)."""
    mean, variance = torch.broadcast_tensors(mean, variance)
    s = variance.clamp_min(0).sqrt()
    x, w = _legendre(mean.dtype, mean.device)
    # panel edges in z: [-Z, a], [a, b], [b, Z] with [a, b] the part of |f| <= _BEND in range
    with torch.no_grad():
        safe = torch.where(s > 0, s, torch.ones_like(s))
        lower = ((-_BEND - mean) / safe).clamp(-_Z_MAX, _Z_MAX)
        upper = ((_BEND - mean) / safe).clamp(-_Z_MAX, _Z_MAX)
        lower = torch.where(s > 0, lower, torch.full_like(s, -_Z_MAX))
        upper = torch.where(s > 0, upper, torch.full_like(s, -_Z_MAX))
    edges = torch.stack(
        [torch.full_like(s, -_Z_MAX), lower, upper, torch.full_like(s, _Z_MAX)], dim=-1
    )  # shape: (*shape, 4)
    left, right = edges[..., :-1, None], edges[..., 1:, None]  # shape: (*shape, 3, 1)
    z = 0.5 * (left + right) + 0.5 * (right - left) * x  # shape: (*shape, 3, n)
    weight = 0.5 * (right - left) * w * torch.exp(-0.5 * z.square()) / np.sqrt(2 * np.pi)
    total = weight.sum((-2, -1))  # 1 up to the truncation; divides it out
    f = mean[..., None, None] + s[..., None, None] * z
    first = cb_mean(f)
    expected = (weight * first).sum((-2, -1)) / total
    second = (weight * (cb_variance(f) + first.square())).sum((-2, -1)) / total
    return expected, (second - expected.square()).clamp_min(0)
