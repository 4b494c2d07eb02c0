r"""The softmax likelihood raised to a power (a tempered softmax) for the multiclass Laplace
engine."""

from __future__ import annotations

from torch import Tensor

from gpsd._internal.validation import check_positive_float
from gpsd.laplace.multiclass_likelihood_terms import MulticlassLikelihoodTerms
from gpsd.laplace.softmax_terms import SoftmaxTerms

__all__ = ["TemperedSoftmaxTerms"]


class TemperedSoftmaxTerms(MulticlassLikelihoodTerms):
    r"""The softmax likelihood of labels :math:`y_i \in \{0, \dots, K - 1\}` raised to the power
    :math:`\tau > 0` (:math:`\tau` copies of the data), with :math:`\mathbf y_i` the one-hot row of
    the label and :math:`\boldsymbol\pi_i = \operatorname{softmax}(\mathbf f_i)`:

    .. math::

        \ell(\mathbf y_i, \mathbf f_i) = \tau\, \mathbf y_i^\top \log \boldsymbol\pi_i, \quad
        \nabla = \tau (\mathbf y_i - \boldsymbol\pi_i), \quad
        \nabla^2 = -\tau \bigl(\operatorname{diag}(\boldsymbol\pi_i)
        - \boldsymbol\pi_i \boldsymbol\pi_i^\top\bigr).

    The Laplace posterior under these terms is the tempered posterior
    :math:`q_\tau(\mathbf f) \propto \prod_i p(y_i \mid \mathbf f_i)^\tau\, p(\mathbf f)`, whose
    covariance is :math:`(\mathbf K^{-1} + \tau \mathbf W)^{-1}`. Its targets are those of
    :class:`~gpsd.laplace.SoftmaxTerms` and :meth:`response` is :math:`\boldsymbol\pi`. At
    :math:`\tau = 1` it equals :class:`~gpsd.laplace.SoftmaxTerms`; for :math:`\tau \ne 1` its
    Hessian blocks are not the softmax's, so
    :class:`~gpsd.laplace.MulticlassLaplacePosterior` factors them densely (:math:`O(K^3 n^3)`).

    :param temperature: :math:`\tau > 0`.

    Example:

        >>> terms = TemperedSoftmaxTerms(3.0)
        >>> posterior = MulticlassLaplacePosterior(m, K, terms, labels, num_classes=4)
    """

    name = "tempered softmax"

    def __init__(self, temperature: float) -> None:
        self.temperature = check_positive_float(temperature, "temperature")
        self._softmax = SoftmaxTerms()

    def targets(self, y: Tensor, num_classes: int | None = None, name: str = "train_y") -> Tensor:
        """One-hot rows ``(*batch, n, K)`` of labels ``y`` ``(*batch, n)``, checked as
        :class:`~gpsd.laplace.SoftmaxTerms` checks them."""
        return self._softmax.targets(y, num_classes, name)

    def log_prob(self, Y: Tensor, F: Tensor) -> Tensor:
        return self.temperature * self._softmax.log_prob(Y, F)

    def derivatives(self, Y: Tensor, F: Tensor) -> tuple[Tensor, Tensor]:
        gradient, hessian = self._softmax.derivatives(Y, F)
        return self.temperature * gradient, self.temperature * hessian

    def response(self, F: Tensor) -> Tensor:
        return self._softmax.response(F)
