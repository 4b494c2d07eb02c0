r"""A numerically stable continuous Bernoulli distribution parameterised by its logit."""

from __future__ import annotations

from numbers import Number

import torch
from torch import Tensor
from torch.distributions import Distribution, constraints
from torch.distributions.utils import broadcast_all

from gpsd.likelihoods.log_normalizer import (
    cb_entropy,
    cb_log_density,
    cb_log_normalizer,
    cb_mean,
    cb_variance,
)

__all__ = ["ContinuousBernoulli"]

_NO_SAMPLE_SHAPE = torch.Size()


class ContinuousBernoulli(Distribution):
    r"""The continuous Bernoulli distribution on :math:`[0, 1]` with logit :math:`f`.

    .. math::

        p(y \mid f) = \exp\bigl(y f - A(f)\bigr), \qquad A(f) = \log \frac{e^f - 1}{f},

    with :math:`\mathbb{E}[y] = A'(f)` and :math:`\operatorname{Var}[y] = A''(f)`. Unlike
    :class:`torch.distributions.ContinuousBernoulli` nothing is clamped: :math:`A`, :math:`A'` and
    :math:`A''` are evaluated stably for every finite logit (see :mod:`gpsd.likelihoods.log_normalizer`).
    In the parameterisation :math:`\lambda = \sigma(f)` this is :math:`C(\lambda)\lambda^y(1-\lambda)^{1-y}`.

    Sampling inverts the CDF :math:`F(y) = (e^{fy} - 1)/(e^f - 1)`; :meth:`rsample` is differentiable
    in the logits.

    :param logits: The logits :math:`f`, any shape (the batch shape).
    :param validate_args: Check the support of values passed to :meth:`log_prob`.
    """

    arg_constraints = {"logits": constraints.real}
    support = constraints.unit_interval
    has_rsample = True

    def __init__(self, logits: Tensor | Number, validate_args: bool | None = None) -> None:
        (self.logits,) = broadcast_all(logits)
        if not self.logits.is_floating_point():
            self.logits = self.logits.to(torch.get_default_dtype())
        super().__init__(batch_shape=self.logits.shape, validate_args=validate_args)

    def expand(self, batch_shape: torch.Size, _instance: ContinuousBernoulli | None = None):
        new = self._get_checked_instance(ContinuousBernoulli, _instance)
        new.logits = self.logits.expand(torch.Size(batch_shape))
        super(ContinuousBernoulli, new).__init__(torch.Size(batch_shape), validate_args=False)
        new._validate_args = self._validate_args
        return new

    @property
    def probs(self) -> Tensor:
        r""":math:`\lambda = \sigma(f)` (the parameter of Loaiza-Ganem & Cunningham, not the mean)."""
        return torch.sigmoid(self.logits)

    @property
    def mean(self) -> Tensor:
        return cb_mean(self.logits)

    @property
    def variance(self) -> Tensor:
        return cb_variance(self.logits)

    def log_prob(self, value: Tensor) -> Tensor:
        r""":math:`\log p(y \mid f) = y f - A(f)`, without cancellation at large :math:`|f|` (see
        :func:`~gpsd.likelihoods.cb_log_density`)."""
        if self._validate_args:
            self._validate_sample(value)
        value = torch.as_tensor(value, dtype=self.logits.dtype, device=self.logits.device)
        return cb_log_density(value, self.logits)

    def cdf(self, value: Tensor) -> Tensor:
        r"""The CDF :math:`F(y) = (e^{fy} - 1)/(e^f - 1)`, 0 below the support and 1 above it.

        For :math:`|f| < 1` it is evaluated as :math:`F(y) = y\, e^{A(fy) - A(f)}`, whose gradient in
        :math:`f` (through the series of :math:`A`) does not cancel near :math:`f = 0`.
        """
        value = torch.as_tensor(value, dtype=self.logits.dtype, device=self.logits.device)
        # clamped first: beyond the support exp(f (y - 1)) could overflow and give NaN gradients
        value = value.clamp(0.0, 1.0)
        # F(0) = 0 for every f; a stand-in value keeps log(0) out of the gradient there (a NaN
        # value is not replaced and gives NaN)
        zero = value <= 0
        value = torch.where(zero, torch.ones_like(value), value)
        small, f_small, pos, f_pos, f_neg = _logit_branches(self.logits)
        # F(y) = expm1(f y) / expm1(f), written without overflow for either sign of f
        log_pos = f_pos * (value - 1.0) + torch.log(-torch.expm1(-f_pos * value))
        log_pos = log_pos - torch.log(-torch.expm1(-f_pos))
        log_neg = torch.log(-torch.expm1(f_neg * value)) - torch.log(-torch.expm1(f_neg))
        out = torch.where(pos, torch.exp(log_pos), torch.exp(log_neg))
        near_zero = value * torch.exp(
            cb_log_normalizer(f_small * value) - cb_log_normalizer(f_small)
        )
        out = torch.where(small, near_zero, out)
        return torch.where(zero, torch.zeros_like(out), out).clamp(0.0, 1.0)

    def icdf(self, value: Tensor) -> Tensor:
        r"""The inverse CDF :math:`F^{-1}(u) = \log(1 + u(e^f - 1)) / f`, used by :meth:`rsample`.

        For :math:`|f| < 1` it is evaluated as :math:`F^{-1}(u) = u\, e^{A(f) - A(z)}` with
        :math:`z = f F^{-1}(u) = \operatorname{log1p}(u \operatorname{expm1}(f))` (so that
        :math:`\operatorname{expm1}(z) = u \operatorname{expm1}(f)`), whose gradient in :math:`f`
        does not cancel near :math:`f = 0`.
        """
        value = torch.as_tensor(value, dtype=self.logits.dtype, device=self.logits.device)
        # F^{-1}(0) = 0 and F^{-1}(1) = 1 for every f; a stand-in value keeps log(0) out of the
        # gradient there (log1p(u expm1(f)) is log1p(-1) = -inf at u = 1 once expm1(f) rounds to
        # -1; a NaN value gives NaN)
        zero, one = value <= 0, value >= 1
        value = torch.where(zero | one, torch.full_like(value, 0.5), value)
        small, f_small, pos, f_pos, f_neg = _logit_branches(self.logits)
        # f <= -1: log1p(u expm1(f)) / f.  f >= 1: 1 + log(u + (1 - u) e^{-f}) / f (no overflow)
        neg_branch = torch.log1p(value * torch.expm1(f_neg)) / f_neg
        pos_branch = 1.0 + torch.log(value + (1.0 - value) * torch.exp(-f_pos)) / f_pos
        out = torch.where(pos, pos_branch, neg_branch)
        z = torch.log1p(value * torch.expm1(f_small))
        near_zero = value * torch.exp(cb_log_normalizer(f_small) - cb_log_normalizer(z))
        out = torch.where(small, near_zero, out)
        out = torch.where(one, torch.ones_like(out), out)
        return torch.where(zero, torch.zeros_like(out), out).clamp(0.0, 1.0)

    def rsample(self, sample_shape: torch.Size = _NO_SAMPLE_SHAPE) -> Tensor:
        shape = self._extended_shape(sample_shape)
        u = torch.rand(shape, dtype=self.logits.dtype, device=self.logits.device)
        return self.icdf(u)

    def sample(self, sample_shape: torch.Size = _NO_SAMPLE_SHAPE) -> Tensor:
        with torch.no_grad():
            return self.rsample(sample_shape)

    def entropy(self) -> Tensor:
        r""":math:`H = A(f) - f A'(f)` (:func:`~gpsd.likelihoods.log_normalizer.cb_entropy`)."""
        return cb_entropy(self.logits)


def _logit_branches(f: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Masks and safe logits for formulas with branches for ``|f| < 1``, ``f >= 1`` and ``f <= -1``.

    Returns ``(small, f_small, pos, f_pos, f_neg)``: the mask ``|f| < 1`` (where formulas in
    :math:`A` are used), ``f`` there and 0 elsewhere, the mask ``f > 0``, and ``f`` on the branches
    ``f >= 1`` and ``f <= -1`` with a harmless placeholder (1 or -1) elsewhere, so that every branch
    stays finite (and its gradient too) when they are combined with ``torch.where``.
    """
    small = f.abs() < 1.0
    f_small = torch.where(small, f, torch.zeros_like(f))
    pos = f > 0
    f_pos = torch.where(pos & ~small, f, torch.ones_like(f))
    f_neg = torch.where(pos | small, -torch.ones_like(f), f)
    return small, f_small, pos, f_pos, f_neg
