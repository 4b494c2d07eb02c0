"""What a regression distiller's fit holds: the factorisation of K and the targets' coordinates."""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch
from gpytorch.kernels import Kernel
from torch import Tensor

from gpsd.linalg import SpectralEngine, SpectralFilter

__all__ = ["Factorisation", "SpectralFit"]


@dataclasses.dataclass(frozen=True, eq=False)
class Factorisation:
    r"""The part of a regression distiller's fit that new targets leave valid.

    :param engine: The backend's engine of :math:`\mathbf K` (its factorisation, spectrum or
        solver).
    :param test_kernel: The kernel and the training inputs for the test (cross-)covariances, in
        the factorisation's dtype.
    """

    engine: SpectralEngine
    test_kernel: tuple[Kernel, Tensor]

    def autograd_context(self):
        """``torch.no_grad()`` where the engine carries no autograd graph (the matrix-free
        backends): their results then carry none at all, rather than a partial graph through the
        cross-covariance or the prior mean alone, which would give wrong gradients."""
        return contextlib.nullcontext() if self.engine.supports_autograd else torch.no_grad()


@dataclasses.dataclass(frozen=True, eq=False)
class SpectralFit(Factorisation):
    r"""A regression distiller's fit: the :class:`Factorisation` and the targets in its
    coordinates.

    :param engine: As in :class:`Factorisation`.
    :param test_kernel: As in :class:`Factorisation`.
    :param prior_mean: The prior mean :math:`m` at the training inputs, ``(*b, N)``.
    :param centred: The centred targets :math:`\mathbf y - m`, ``(*b, N, 1)``.
    :param coords: The centred targets in the engine's coordinates
        (:meth:`~gpsd.linalg.SpectralEngine.project`).
    :param mean_filter: :math:`G_t`, the filter of the predictive means of every step.
    :param gcv_scores: The :meth:`~gpsd.DataCentricGPR.gcv` scores and their standard errors,
        ``(*batch, T)`` each, by the number of probes and their seed they were estimated with
        (filled on first request; kept only where they carry no autograd graph).
    """

    prior_mean: Tensor
    centred: Tensor
    coords: Tensor
    mean_filter: SpectralFilter
    gcv_scores: dict[tuple[int, int], tuple[Tensor, Tensor]] = dataclasses.field(
        default_factory=dict, repr=False
    )

    @functools.cached_property
    def mean_weights(self) -> Tensor:
        r""":math:`G_t(\mathbf K)(\mathbf y - m)` for every step, ``(*, T, N, 1)``, computed on
        first use."""
        with self.autograd_context():
            return self.engine.apply(self.mean_filter, self.coords)
