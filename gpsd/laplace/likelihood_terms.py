r"""The interface the Laplace engine needs from a 1-D likelihood: :math:`\log p(y \mid f)` and its
first two derivatives in :math:`f`, evaluated pointwise."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import Tensor

__all__ = ["LaplaceLikelihoodTerms"]


class LaplaceLikelihoodTerms(ABC):
    r"""Pointwise log-likelihood :math:`\ell(y, f) = \log p(y \mid f)` and its derivatives in :math:`f`.

    Subclasses implement :meth:`log_prob`, :meth:`derivatives` (:math:`\partial_f \ell`,
    :math:`\partial_f^2 \ell`) and :meth:`response` (the class probability as a function of the
    latent value), and check their targets in :meth:`check_targets`. All methods work elementwise
    on tensors of shape ``(*batch, n)`` and must be built from differentiable torch operations: the
    gradient of the Laplace log marginal likelihood differentiates :math:`\partial_f^2 \ell` once more
    in :math:`f` (the third derivative of Rasmussen & Williams, eq. 5.23) by autograd.

    The Laplace engine needs :math:`\partial_f^2 \ell \le 0` (a log-concave likelihood).
    """

    #: a short name used in messages
    name: str = "likelihood"
    #: whether :math:`r(-f) = 1 - r(f)`, which lets class probabilities use
    #: :func:`~gpsd.laplace.symmetric_response_expectation` (accurate at any latent variance)
    symmetric_response: bool = False

    @abstractmethod
    def log_prob(self, y: Tensor, f: Tensor) -> Tensor:
        r""":math:`\log p(y_i \mid f_i)` elementwise, shape ``(*batch, n)``."""

    @abstractmethod
    def derivatives(self, y: Tensor, f: Tensor) -> tuple[Tensor, Tensor]:
        r"""(:math:`\partial_f \log p(y \mid f)`, :math:`\partial_f^2 \log p(y \mid f)`) elementwise."""

    @abstractmethod
    def response(self, f: Tensor) -> Tensor:
        r"""The class probability (or the soft-target prediction) as a function of :math:`f`."""

    def check_targets(self, y: Tensor, name: str = "train_y") -> None:
        """Raise a ``ValueError`` naming ``name`` when ``y`` is outside the likelihood's support.

        The default only checks that ``y`` is finite.
        """
        if not torch.isfinite(y).all():
            raise ValueError(f"{name} must be finite, but it holds NaN or infinite values")
