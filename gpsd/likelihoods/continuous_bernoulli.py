r"""A numerically stable continuous Bernoulli distribution parameterised by its logit."""

from __future__ import annotations

import math
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
        r"""The inverse CDF :math:`F^{-1}(u) = \operatorname{log1p}(u \operatorname{expm1}(f)) / f`,
        used by :meth:`rsample`.

        Written so that neither the value nor its gradient in :math:`f` cancels. With
        :math:`v = 1 - u` and :math:`M(p, f) = \log(1 + p \operatorname{expm1}(f))`
        (:func:`_log_mix`), for :math:`|f| \ge 1`

        .. math::

            F^{-1}(u) = \frac{M(u, f)}{f} = 1 + \frac{M(v, -f)}{f}

        (the symmetry :math:`F_f^{-1}(u) = 1 - F_{-f}^{-1}(v)`): the first form where the quantile
        is at most 1/2, the second above, so that a quantile near 1 is not the ratio of nearly
        equal terms (whose gradient in :math:`f` cancels). For :math:`|f| < 1`,

        .. math::

            F^{-1}(u) = u\, e^{A(f) - A(M(u, f))} = 1 - v\, e^{A(-f) - A(M(v, -f))}

        (as :math:`\operatorname{expm1}(M(u, f)) = u \operatorname{expm1}(f)`), the first for
        :math:`u \le 1/2`: neither divides by a small :math:`f`. Where
        :math:`\operatorname{expm1}(f)` overflows, the second form is used throughout; it
        cancels only where :math:`u e^f` is not large, for :math:`u` below the smallest normal
        number there.
        """
        value = torch.as_tensor(value, dtype=self.logits.dtype, device=self.logits.device)
        # F^{-1}(0) = 0 and F^{-1}(1) = 1 for every f; a stand-in value keeps log(0) out of the
        # gradient there (a NaN value gives NaN)
        zero, one = value <= 0, value >= 1
        u = torch.where(zero | one, torch.full_like(value, 0.5), value)
        v = 1.0 - u  # exact for u >= 1/2, the only place where it is small
        small, f_small, pos, f_pos, f_neg = _logit_branches(self.logits)
        A = cb_log_normalizer
        near_zero_low = u * torch.exp(A(f_small) - A(_log_mix(u, v, f_small)))
        near_zero_high = 1.0 - v * torch.exp(A(-f_small) - A(_log_mix(v, u, -f_small)))
        near_zero = torch.where(u <= 0.5, near_zero_low, near_zero_high)
        # |f| >= 1 (a placeholder elsewhere); expm1(|f|) above the cap overflows, or its derivative
        f_far = torch.where(pos, f_pos, f_neg)
        cap = math.log(torch.finfo(f_far.dtype).max) - 1.0
        f_low, f_high = f_far.clamp_max(cap), f_far.clamp_min(-cap)
        low = _log_mix(u, v, f_low) / f_low
        high = 1.0 + _log_mix(v, u, -f_high) / f_high
        # decided on the form that does not overflow: high for f > 0 (and beyond the cap), low below
        use_high = torch.where(pos, (high >= 0.5) | (f_far > cap), low > 0.5)
        out = torch.where(small, near_zero, torch.where(use_high, high, low))
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


def _log_mix(p: Tensor, q: Tensor, f: Tensor) -> Tensor:
    r""":math:`M(p, f) = \log(1 + p \operatorname{expm1}(f)) = \log(q + p e^f)` for
    :math:`p \in (0, 1)` and :math:`q = 1 - p` (given, as it may be known more accurately than
    :math:`1 - p`), without cancellation: the first form for :math:`p \le 1/2`, the second above.
    Each form gets :math:`p = q = 1/2` where it is not used, so that its gradient stays finite
    (``log1p(p * expm1(f))`` is ``log1p(-1)`` once ``p`` and ``-expm1(f)`` round to 1).
    """
    low = p <= 0.5
    half = torch.full_like(p, 0.5)
    p_low = torch.where(low, p, half)
    p_high = torch.where(low, half, p)
    q_high = torch.where(low, half, q)
    return torch.where(
        low, torch.log1p(p_low * torch.expm1(f)), torch.log(q_high + p_high * torch.exp(f))
    )


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
