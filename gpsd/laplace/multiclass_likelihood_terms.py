r"""The interface the multiclass Laplace engine needs from a :math:`K`-class likelihood:
:math:`\log p(\mathbf y_i \mid \mathbf f_i)`, its gradient and its Hessian in the :math:`K`
latents of each point."""

from __future__ import annotations

from abc import ABC, abstractmethod

from torch import Tensor

__all__ = ["MulticlassLikelihoodTerms"]


class MulticlassLikelihoodTerms(ABC):
    r"""Pointwise log-likelihood :math:`\ell(\mathbf y_i, \mathbf f_i) = \log p(\mathbf y_i \mid
    \mathbf f_i)` of :math:`K` latents per point and its derivatives in :math:`\mathbf f_i`.

    Targets are handled as a matrix :math:`\mathbf Y` of shape ``(*batch, n, K)`` (one-hot labels,
    or soft targets on the simplex), made from the user's targets by :meth:`targets`; latents
    :math:`\mathbf F` have the same shape. Subclasses implement :meth:`targets`,
    :meth:`log_prob`, :meth:`derivatives` (the gradient ``(*batch, n, K)`` and the Hessian blocks
    ``(*batch, n, K, K)``) and :meth:`response` (the class probabilities, or the expected soft
    target, as a function of the latents). The Hessian must be differentiable in
    :math:`\mathbf F` by autograd: the gradient of the Laplace log marginal likelihood
    differentiates it once more.

    The Laplace engine needs a log-concave likelihood, :math:`-\nabla^2 \ell \succeq 0`. Both
    likelihoods here depend on the latents only through their differences, so their Hessian
    blocks are singular along :math:`\mathbf 1`.
    """

    #: a short name used in messages
    name: str = "likelihood"

    @abstractmethod
    def targets(self, y: Tensor, num_classes: int | None = None, name: str = "train_y") -> Tensor:
        r"""The target matrix :math:`\mathbf Y`, shape ``(*batch, n, K)``, from the user's
        targets ``y`` (a floating-point tensor), after checking them against the likelihood's
        support; a ``ValueError`` naming ``name`` otherwise.

        :param y: The targets as given (labels ``(*batch, n)`` or soft targets
            ``(*batch, n, K)``), in the dtype the engine works in.
        :param num_classes: :math:`K`, where known from elsewhere (the prior covariances).
        :param name: The argument's name in messages.
        """

    @abstractmethod
    def log_prob(self, Y: Tensor, F: Tensor) -> Tensor:
        r""":math:`\log p(\mathbf y_i \mid \mathbf f_i)` per point, shape ``(*batch, n)``."""

    @abstractmethod
    def derivatives(self, Y: Tensor, F: Tensor) -> tuple[Tensor, Tensor]:
        r"""(:math:`\nabla_{\mathbf f_i} \log p`, :math:`\nabla^2_{\mathbf f_i} \log p`) per
        point, shapes ``(*batch, n, K)`` and ``(*batch, n, K, K)`` (symmetric blocks)."""

    @abstractmethod
    def response(self, F: Tensor) -> Tensor:
        r"""The class probabilities (or the expected soft target) at latents ``F``, shape
        ``(*batch, n, K)``, rows on the simplex."""
