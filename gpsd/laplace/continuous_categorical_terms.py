r"""The continuous categorical likelihood of soft targets on the simplex for the multiclass
Laplace engine."""

from __future__ import annotations

import torch
from torch import Tensor

from gpsd.laplace.multiclass_likelihood_terms import MulticlassLikelihoodTerms
from gpsd.likelihoods.cc_log_normalizer import cc_log_normalizer, cc_mean

__all__ = ["ContinuousCategoricalTerms"]


def _mean_and_covariance(F: Tensor) -> tuple[Tensor, Tensor]:
    r""":math:`\nabla A` and :math:`\nabla^2 A` at the rows of ``F`` (``(*batch, K)``), by autograd
    of :func:`~gpsd.likelihoods.cc_log_normalizer` in float64, in the dtype of ``F``;
    differentiable in ``F`` where ``F`` requires a gradient."""
    keep_graph = F.requires_grad
    with torch.enable_grad():
        eta = F.to(torch.float64)
        if not keep_graph:
            eta = eta.detach().requires_grad_(True)
        (mean,) = torch.autograd.grad(cc_log_normalizer(eta).sum(), eta, create_graph=True)
        rows = [
            torch.autograd.grad(
                mean[..., k].sum(), eta, create_graph=keep_graph, retain_graph=True
            )[0]
            for k in range(F.shape[-1])
        ]
    covariance = torch.stack(rows, dim=-2)  # shape: (*batch, K, K)
    covariance = 0.5 * (covariance + covariance.transpose(-1, -2))
    if not keep_graph:
        mean, covariance = mean.detach(), covariance.detach()
    return mean.to(F.dtype), covariance.to(F.dtype)


class ContinuousCategoricalTerms(MulticlassLikelihoodTerms):
    r"""The continuous categorical likelihood of soft targets :math:`\mathbf y_i` on the simplex
    (a teacher's class probabilities), the :math:`K`-class counterpart of
    :class:`~gpsd.laplace.ContinuousBernoulliTerms`:

    .. math::

        \log p(\mathbf y_i \mid \mathbf f_i) = \mathbf f_i^\top \mathbf y_i - A(\mathbf f_i),
        \quad \nabla = \mathbf y_i - \nabla A(\mathbf f_i), \quad
        \nabla^2 = -\nabla^2 A(\mathbf f_i),

    with :math:`A` the log-normaliser (:func:`~gpsd.likelihoods.cc_log_normalizer`). Its
    gradient is the mean and its Hessian the covariance of the continuous categorical, positive
    semi-definite with null vector :math:`\mathbf 1` (:math:`A(\mathbf f + c\mathbf 1) =
    A(\mathbf f) + c`). Both are computed by autograd of :math:`A`'s float64 computation,
    accurate where the latents are close or tied (where the closed form of :math:`A` cancels);
    the Hessian is symmetrised. :meth:`response` is the mean :math:`\nabla A(\mathbf f)`, the
    expected soft target.

    At :math:`K = 2` it is the continuous Bernoulli of :math:`y_{i2}` with logit
    :math:`f_{i2} - f_{i1}`.
    """

    name = "continuous categorical"

    def targets(self, y: Tensor, num_classes: int | None = None, name: str = "train_y") -> Tensor:
        """Soft targets ``y`` of shape ``(*batch, n, K)``, checked: finite, non-negative, rows
        summing to 1 (within the square root of the dtype's machine epsilon), :math:`K \\ge 2`,
        and :math:`K` equal to ``num_classes`` where that is given."""
        if y.dim() < 2 or y.shape[-1] < 2:
            raise ValueError(
                f"{name} must hold soft targets of shape (*batch, n, K) with K >= 2 classes, got "
                f"shape {tuple(y.shape)}"
            )
        if num_classes is not None and y.shape[-1] != num_classes:
            raise ValueError(
                f"{name} has {y.shape[-1]} classes in its last dimension but the prior "
                f"covariances have {num_classes}"
            )
        if not torch.isfinite(y).all():
            raise ValueError(f"{name} must be finite, but it holds NaN or infinite values")
        if (y < 0).any():
            raise ValueError(
                f"{name} must hold soft targets on the simplex, got negative values such as "
                f"{y[y < 0].flatten()[:3].tolist()}"
            )
        sums = y.sum(-1)
        tolerance = torch.finfo(y.dtype).eps ** 0.5
        off = (sums - 1.0).abs()
        if (off > tolerance).any():
            worst = float(sums.flatten()[off.flatten().argmax()])
            raise ValueError(
                f"{name} must hold soft targets on the simplex (each row summing to 1), got a row "
                f"summing to {worst:.6g} (tolerance {tolerance:.1g})"
            )
        return y

    def log_prob(self, Y: Tensor, F: Tensor) -> Tensor:
        # shifted by the largest latent: the same on the simplex, without subtracting two terms
        # of the size of max(f)
        shifted = (F - F.amax(-1, keepdim=True)).to(torch.float64)
        value = (shifted * Y.to(torch.float64)).sum(-1) - cc_log_normalizer(shifted)
        return value.to(F.dtype)

    def derivatives(self, Y: Tensor, F: Tensor) -> tuple[Tensor, Tensor]:
        mean, covariance = _mean_and_covariance(F)
        return Y - mean, -covariance

    def response(self, F: Tensor) -> Tensor:
        return cc_mean(F)
