"""Squared Euclidean distances by the expansion that matrix products make fast, centred first;
and when a kernel's two inputs may share one evaluation."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["same_inputs", "squared_distances"]


def same_inputs(x1: Tensor, x2: Tensor) -> bool:
    """Whether a kernel may evaluate ``x1`` once and use it for ``x2`` too.

    True for one tensor, or for equal values where no gradient has to reach the two apart: with
    ``x1`` and ``x2`` distinct leaves, a shared evaluation sends ``x2``'s gradient to ``x1``.
    """
    if x1 is x2:
        return True
    if x1.requires_grad or x2.requires_grad or x1.shape != x2.shape:
        return False
    return torch.equal(x1, x2)


def squared_distances(x1: Tensor, x2: Tensor) -> Tensor:
    r"""Squared Euclidean distances :math:`\|x_i - z_j\|^2`, shape ``(n1, n2)``, clamped at 0.

    Both sets are first centred at the mean of ``x2``: the expansion
    :math:`\|x\|^2 + \|z\|^2 - 2 x^\top z` loses about :math:`\epsilon \|x\|^2` to rounding, so
    inputs far from the origin (years, say, in float32) would otherwise lose every digit of the
    distances between them.
    """
    if x2.shape[-2] > 0:
        centre = x2.mean(-2, keepdim=True)  # shape: (1, d)
        x1, x2 = x1 - centre, x2 - centre
    # shape: (n1, n2)
    d2 = x1.pow(2).sum(-1, keepdim=True) - 2.0 * x1 @ x2.transpose(-1, -2)
    return (d2 + x2.pow(2).sum(-1).unsqueeze(-2)).clamp_min_(0.0)
