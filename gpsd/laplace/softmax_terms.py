r"""The softmax (multinomial logistic) likelihood for the multiclass Laplace engine."""

from __future__ import annotations

import torch
from torch import Tensor

from gpsd._internal.validation import check_int
from gpsd.laplace.multiclass_likelihood_terms import MulticlassLikelihoodTerms

__all__ = ["SoftmaxTerms"]


class SoftmaxTerms(MulticlassLikelihoodTerms):
    r"""The softmax likelihood of labels :math:`y_i \in \{0, \dots, K - 1\}` (Rasmussen &
    Williams §3.5), with :math:`\mathbf y_i` the one-hot row of the label and
    :math:`\boldsymbol\pi_i = \operatorname{softmax}(\mathbf f_i)`:

    .. math::

        \log p(y_i \mid \mathbf f_i) = \mathbf y_i^\top \log \boldsymbol\pi_i, \quad
        \nabla = \mathbf y_i - \boldsymbol\pi_i, \quad
        \nabla^2 = -\bigl(\operatorname{diag}(\boldsymbol\pi_i)
        - \boldsymbol\pi_i \boldsymbol\pi_i^\top\bigr).

    The Hessian blocks annihilate :math:`\mathbf 1` (adding a constant to the :math:`K` latents
    leaves :math:`\boldsymbol\pi_i` unchanged). :meth:`response` is :math:`\boldsymbol\pi`.
    """

    name = "softmax"

    def targets(self, y: Tensor, num_classes: int | None = None, name: str = "train_y") -> Tensor:
        """One-hot rows ``(*batch, n, K)`` of labels ``y`` of shape ``(*batch, n)``, which must be
        integers in ``0 ... K - 1``; ``num_classes`` (:math:`K \\ge 2`) is required."""
        if num_classes is None:
            raise ValueError(
                f"the number of classes is needed to read the labels {name}: pass num_classes "
                "(or one prior covariance per class)"
            )
        num_classes = check_int(num_classes, "num_classes", minimum=2)
        if y.dim() < 1:
            raise ValueError(f"{name} must hold labels of shape (*batch, n), got a scalar")
        if not torch.isfinite(y).all():
            raise ValueError(f"{name} must be finite, but it holds NaN or infinite values")
        bad = (y != y.round()) | (y < 0) | (y > num_classes - 1)
        if bad.any():
            values = y[bad].flatten()[:3].tolist()
            raise ValueError(
                f"{name} must hold integer class labels in 0 ... {num_classes - 1} "
                f"(num_classes={num_classes}), got values such as {values}"
            )
        return torch.nn.functional.one_hot(y.long(), num_classes).to(y.dtype)

    def log_prob(self, Y: Tensor, F: Tensor) -> Tensor:
        return (Y * torch.log_softmax(F, dim=-1)).sum(-1)

    def derivatives(self, Y: Tensor, F: Tensor) -> tuple[Tensor, Tensor]:
        pi = torch.softmax(F, dim=-1)  # shape: (*batch, n, K)
        hessian = pi.unsqueeze(-1) * pi.unsqueeze(-2) - torch.diag_embed(pi)
        return Y - pi, hessian

    def response(self, F: Tensor) -> Tensor:
        return torch.softmax(F, dim=-1)
