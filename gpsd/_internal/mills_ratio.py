r"""Laplace's continued fraction for the Mills ratio of the standard normal distribution."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["mills_ratio_fraction"]


def mills_ratio_fraction(x: Tensor, terms: int) -> tuple[Tensor, Tensor]:
    r"""The tails :math:`(T, U)` of Laplace's continued fraction of the Mills ratio at ``x``.

    .. math::

        R(x) = \frac{\bar\Phi(x)}{\varphi(x)} = \cfrac{1}{x + T}, \qquad
        T = \cfrac{1}{x + U}, \qquad U = \cfrac{2}{x + \cfrac{3}{x + \cdots}},

    evaluated from the bottom with ``terms`` levels. Each level is a division of positive numbers,
    so nothing cancels; it converges faster the larger :math:`x` (40 levels reach float64 rounding
    from :math:`x = 5`, 60 from :math:`x = 3`). :math:`T = 1/R(x) - x` is what is left of
    :math:`\varphi/\bar\Phi` once its asymptote :math:`x` is taken off.

    :param x: Points, :math:`x > 0` for convergence; any shape.
    :param terms: Levels of the fraction (at least 2).
    :return: ``(T, U)``, each of the shape of ``x``.
    """
    u = torch.zeros_like(x)
    for k in range(terms, 1, -1):
        u = k / (x + u)
    return 1.0 / (x + u), u
