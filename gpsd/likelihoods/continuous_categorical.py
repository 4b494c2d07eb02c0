r"""The continuous categorical distribution on the simplex, parameterised by its natural parameters."""

from __future__ import annotations

from numbers import Number

import torch
from torch import Tensor
from torch.distributions import Distribution, constraints

from gpsd.likelihoods.cc_log_normalizer import _check_eta, cc_log_normalizer, cc_mean

__all__ = ["ContinuousCategorical"]


class ContinuousCategorical(Distribution):
    r"""The continuous categorical distribution (Gordon-Rodriguez, Loaiza-Ganem & Cunningham, 2020)
    on the simplex :math:`\Delta = \{\mathbf x \in [0, 1]^K : \sum_k x_k = 1\}`.

    .. math::

        p(\mathbf x \mid \boldsymbol\eta) = \exp\bigl(\boldsymbol\eta^\top \mathbf x
        - A(\boldsymbol\eta)\bigr), \qquad
        A(\boldsymbol\eta) = \log \int_\Delta e^{\boldsymbol\eta^\top \mathbf x}\, d\mathbf x
        = \log \sum_{k=1}^K \frac{e^{\eta_k}}{\prod_{i \ne k} (\eta_k - \eta_i)},

    a density with respect to Lebesgue measure on the first :math:`K - 1` coordinates. It is the
    exponential family on the simplex with sufficient statistic :math:`\mathbf x`, so
    :math:`\mathbb E[\mathbf x] = \nabla A(\boldsymbol\eta)`; adding a constant to every
    :math:`\eta_k` leaves it unchanged. In the parameterisation of Gordon-Rodriguez et al. by a
    point :math:`\boldsymbol\lambda` of the simplex, :math:`p \propto \prod_k \lambda_k^{x_k}`, the
    natural parameters are :math:`\eta_k = \log \lambda_k` (up to that constant).

    With :math:`K = 2` it is the continuous Bernoulli: :math:`x_2 = y` has the density
    :math:`\exp(y f - A_{\mathrm{CB}}(f))` of :class:`~gpsd.likelihoods.ContinuousBernoulli` with
    logit :math:`f = \eta_2 - \eta_1`, that is :math:`\lambda = \sigma(\eta_2 - \eta_1)`.

    :math:`A` and the mean are computed without cancellation for every finite
    :math:`\boldsymbol\eta` (:func:`~gpsd.likelihoods.cc_log_normalizer`). No sampler is provided.

    :param logits: The natural parameters :math:`\boldsymbol\eta`, shape ``(*batch, K)`` with
        :math:`K \ge 2`, finite.
    :param validate_args: Check that values passed to :meth:`log_prob` lie on the simplex.
    """

    arg_constraints = {"logits": constraints.real_vector}
    support = constraints.simplex

    def __init__(self, logits: Tensor | Number, validate_args: bool | None = None) -> None:
        logits = torch.as_tensor(logits)
        if not logits.is_floating_point():
            logits = logits.to(torch.get_default_dtype())
        self.logits = _check_eta(logits, "logits")
        super().__init__(
            batch_shape=logits.shape[:-1], event_shape=logits.shape[-1:], validate_args=False
        )
        self._validate_args = (
            validate_args if validate_args is not None else Distribution._validate_args
        )

    def expand(self, batch_shape: torch.Size, _instance: ContinuousCategorical | None = None):
        new = self._get_checked_instance(ContinuousCategorical, _instance)
        batch_shape = torch.Size(batch_shape)
        new.logits = self.logits.expand(batch_shape + self.event_shape)
        super(ContinuousCategorical, new).__init__(batch_shape, self.event_shape, False)
        new._validate_args = self._validate_args
        return new

    @property
    def mean(self) -> Tensor:
        r""":math:`\mathbb E[\mathbf x] = \nabla A(\boldsymbol\eta)`, shape ``(*batch, K)``
        (:func:`~gpsd.likelihoods.cc_mean`; not differentiable)."""
        return cc_mean(self.logits)

    def log_prob(self, value: Tensor) -> Tensor:
        r""":math:`\log p(\mathbf x \mid \boldsymbol\eta) = \mathbf d^\top \mathbf x - A(\mathbf d)`
        with :math:`\mathbf d = \boldsymbol\eta - \max_k \eta_k`, which equals
        :math:`\boldsymbol\eta^\top \mathbf x - A(\boldsymbol\eta)` on the simplex without
        subtracting two terms of the size of :math:`\max_k \eta_k`.

        :param value: Points of the simplex, shape ``(*sample, *batch, K)`` (broadcast against
            the batch shape).
        :return: Shape ``(*sample, *batch)``.
        """
        value = torch.as_tensor(value, dtype=self.logits.dtype, device=self.logits.device)
        K = self.event_shape[0]
        if value.dim() == 0 or value.shape[-1] != K:
            raise ValueError(
                f"value must have shape (..., {K}), one entry per category of the {K} the "
                f"logits have, got shape {tuple(value.shape)}"
            )
        if self._validate_args:
            self._validate_sample(value)
        shifted = self.logits - self.logits.amax(-1, keepdim=True)
        return (shifted * value).sum(-1) - cc_log_normalizer(shifted)
