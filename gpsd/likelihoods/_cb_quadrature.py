r"""Gaussian expectations of the continuous Bernoulli log-density and density, at any latent variance.

For :math:`f \sim \mathcal{N}(\mu, s^2)` and :math:`y \in [0, 1]` this module computes

.. math::

    \mathbb{E}[\log p(y \mid f)] = y\mu - \mathbb{E}[A(f)], \qquad
    \log \mathbb{E}[p(y \mid f)], \qquad p(y \mid f) = e^{y f - A(f)} = e^{y f} \frac{f}{e^f - 1},

used by :class:`~gpsd.likelihoods.ContinuousBernoulliLikelihood`. :math:`A(f) = \max(f, 0) +
A(-|f|)` is a rounded kink of width 1 at :math:`f = 0` with a :math:`-\log|f|` tail, so
Gauss-Hermite nodes spaced on the scale :math:`s \gg 1` miss it; both quantities are therefore split
into closed forms and integrals that are smooth on the scale of the rule that integrates them.

Notation: :math:`m = \mu / s`, :math:`\varphi, \Phi` the standard normal density and CDF,
:math:`D(z) = P(|Z + m| \le z) = \Phi(z - m) - \Phi(-z - m)` for :math:`Z \sim \mathcal{N}(0, 1)`,
and :math:`g(x) = \int_0^\infty v e^{-xv - v^2/2} dv = 1 - x \bar\Phi(x) / \varphi(x)`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import lru_cache
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from gpsd._internal.mills_ratio import mills_ratio_fraction
from gpsd.likelihoods.log_normalizer import cb_log_density, cb_mean, cb_variance

#: latent variances above which the split rules replace Gauss-Hermite (20 nodes), near where their
#: errors cross (1e-12 for expected_log_prob, 3e-13 for log_marginal)
ELP_SPLIT_VARIANCE = 3.0
LM_SPLIT_VARIANCE = 2.0
#: expected_log_prob: |mu| / s below which the split is used (beyond, the kink at 0 is so far in
#: the tail that Gauss-Hermite is exact to rounding)
ELP_MAX_STANDARDISED_MEAN = 7.0
#: log_marginal: at most this many exponentials are peeled off exactly before the Laguerre rule
LM_MAX_PEELED = 3
#: log_marginal: smallest decay rate left to the Laguerre rule
LM_MIN_RATE = 0.5

_LEGENDRE_PAD = 8.5  # z_max = |m| + pad: P(|Z + m| > z_max) < 1e-17
#: nodes of (the Laguerre and Legendre rules of expected_log_prob, the Laguerre rule of
#: log_marginal) in float64 and in lower precisions
_NUM_NODES_FLOAT64 = (40, 32, 32)
_NUM_NODES_FLOAT32 = (20, 20, 16)
_CF_TERMS = 60
_CF_FROM = 3.0  # g by continued fraction from here on (its cancellation-free range)
_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)
_INV_SQRT2 = 1.0 / math.sqrt(2.0)


@lru_cache(maxsize=64)
def _rule(name: str, num: int, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor]:
    """Nodes and (transformed) weights of a quadrature rule, computed in float64 and cached per
    dtype and device (never modified in place)."""
    if name == "hermite":  # nodes x_j, log(w_j / sqrt(pi))
        x, w = np.polynomial.hermite.hermgauss(num)
        nodes, weights = x, np.log(w) - 0.5 * math.log(math.pi)
    elif name == "hermite_adaptive":  # nodes x_j, log(w_j) + x_j^2 (the ratio to N(c, tau^2))
        x, w = np.polynomial.hermite.hermgauss(num)
        nodes, weights = x, np.log(w) + x**2
    elif name == "laguerre_ell":  # u_j, -w_j / (1 - e^{-u_j}): E[log(1 - e^{-|f|})]
        u, w = np.polynomial.laguerre.laggauss(num)
        nodes, weights = u, -w / -np.expm1(-u)
    elif name == "legendre_log":  # (1 + x_j) / 2, w_j / (1 + x_j): int_0^zmax D(z) / z dz
        x, w = np.polynomial.legendre.leggauss(num)
        nodes, weights = 0.5 * (1.0 + x), w / (1.0 + x)
    elif name == "laguerre":
        nodes, weights = np.polynomial.laguerre.laggauss(num)
    else:  # pragma: no cover
        raise ValueError(name)
    return (
        torch.as_tensor(nodes, dtype=dtype, device=device).unsqueeze(-1),
        torch.as_tensor(weights, dtype=dtype, device=device).unsqueeze(-1),
    )


def _counts(dtype: torch.dtype) -> tuple[int, int, int]:
    return _NUM_NODES_FLOAT64 if dtype == torch.float64 else _NUM_NODES_FLOAT32


def _ndtr(x: Tensor) -> Tensor:
    r""":math:`\Phi(x)` through ``erfc`` (1.4 times faster than ``torch.special.ndtr`` on a CPU)."""
    return 0.5 * torch.erfc(-x * _INV_SQRT2)


def _npdf(x: Tensor) -> Tensor:
    return torch.exp(-0.5 * x.square() - _HALF_LOG_2PI)


class _LogG(torch.autograd.Function):
    r""":math:`\log g(x)` for :math:`x \ge 0`, with its derivative :math:`x - R(x)/g(x)`,
    :math:`R = \bar\Phi/\varphi` (from :math:`R' = xR - 1`).

    Below 3, :math:`g = 1 - x R(x)` (a cancellation of at most :math:`1/g(3) \approx 12` ulps).
    From 3 on, Laplace's continued fraction :math:`R = 1/(x + T)`, :math:`T = 1/(x + U)`,
    :math:`U = 2/(x + 3/(x + \dots))` (60 terms, converged to rounding there), which gives
    :math:`g = T/(x + T)` and the derivative :math:`-U` without cancellation. One value per element,
    so lower precisions are evaluated in float64 where the device has it (in float32 the
    cancellation, with the rounding of ``erfc`` and ``exp``, cost up to :math:`1.1 \times 10^{-5}`
    absolute on :math:`[0, 40]`, against :math:`3.5 \times 10^{-7}` this way). The derivative is
    analytic rather than taped through the 60 steps (a taped forward and backward took 7 times as
    long on a CPU), so it is differentiable once.
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        x64 = x.double() if x.dtype != torch.float64 and x.device.type != "mps" else x
        x_low = x64.clamp(max=_CF_FROM)
        mills = 0.5 * torch.erfc(x_low * _INV_SQRT2) / _npdf(x_low)
        g_low = 1.0 - x_low * mills
        x_high = x64.clamp(min=_CF_FROM)
        t, u = mills_ratio_fraction(x_high, _CF_TERMS)
        low = x64 < _CF_FROM
        value = torch.where(low, torch.log(g_low), torch.log(t) - torch.log(x_high + t))
        slope = torch.where(low, x_low - mills / g_low, -u)
        ctx.save_for_backward(slope.to(x.dtype))
        return value.to(x.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        (slope,) = ctx.saved_tensors
        return grad * slope


def _log_g(x: Tensor) -> Tensor:
    r""":math:`\log g(x)`, :math:`g(x) = \int_0^\infty v e^{-xv - v^2/2} dv`, for :math:`x \ge 0`
    (see :class:`_LogG`)."""
    return _LogG.apply(x)


# ----------------------------------------------------------------------------------------------
# E[log p(y | f)]
# ----------------------------------------------------------------------------------------------


def _elp_hermite(y: Tensor, mean: Tensor, variance: Tensor, num_locs: int) -> Tensor:
    nodes, log_weights = _rule("hermite", num_locs, mean.dtype, mean.device)
    f = mean + torch.sqrt(2.0 * variance) * nodes  # shape: (J, n)
    return (cb_log_density(y, f) * log_weights.exp()).sum(0)


def _elp_split(y: Tensor, mean: Tensor, variance: Tensor) -> Tensor:
    r""":math:`y\mu - \mathbb{E}[\max(f, 0)] - \mathbb{E}[\log(1 - e^{-|f|})] + \mathbb{E}[\log|f|]`,
    each in closed form or by a rule on its own scale (see :func:`expected_log_prob`)."""
    s = variance.sqrt()
    m = mean / s
    # |m| with gradient +1 at 0, matching the tilt y - 1 chosen there (the sum is smooth at 0)
    nonnegative = m >= 0
    a = torch.where(nonnegative, m, -m)
    # y mu - E[max(f, 0)] = s [(y - [m >= 0]) m - phi(m) g(|m|)], no cancellation in either sign
    linear = s * (torch.where(nonnegative, y - 1.0, y) * m - _npdf(m) * torch.exp(_log_g(a)))
    # E[log(1 - e^{-|f|})] = -int_0^inf D(t / s) / (e^t - 1) dt, Gauss-Laguerre
    u, ell_weights = _rule("laguerre_ell", _counts(mean.dtype)[0], mean.dtype, mean.device)
    z = u / s
    ell = (
        ell_weights * 0.5 * (torch.erf((z + a) * _INV_SQRT2) + torch.erf((z - a) * _INV_SQRT2))
    ).sum(0)
    # E[log|f|] = log s + log z_max - int_0^z_max D(z) / z dz, Gauss-Legendre
    frac, log_weights = _rule("legendre_log", _counts(mean.dtype)[1], mean.dtype, mean.device)
    z_max = a + _LEGENDRE_PAD
    z = z_max * frac
    inner = (
        log_weights * 0.5 * (torch.erf((z + a) * _INV_SQRT2) + torch.erf((z - a) * _INV_SQRT2))
    ).sum(0)
    return linear - ell + torch.log(s) + torch.log(z_max) - inner


def expected_log_prob(y: Tensor, mean: Tensor, variance: Tensor, num_locs: int) -> Tensor:
    r""":math:`\mathbb{E}_{\mathcal{N}(f; \mu, s^2)}[\log p(y \mid f)]` elementwise (1-D inputs of one
    shape).

    Gauss-Hermite with ``num_locs`` nodes for :math:`s^2 \le 3` or :math:`|\mu| \ge 7 s`; otherwise,
    with :math:`A(f) = \max(f, 0) + \log(1 - e^{-|f|}) - \log|f|`,

    .. math::

        \mathbb{E}[\log p] = s\bigl[(y - [m > 0])\, m - \varphi(m) g(|m|)\bigr]
        + \int_0^\infty \frac{D(t/s)}{e^t - 1} dt + \log s + \log z_{\max}
        - \int_0^{z_{\max}} \frac{D(z)}{z} dz,

    the two integrals (by parts; :math:`D(z)/z` is entire) by 40-node Gauss-Laguerre and 32-node
    Gauss-Legendre on :math:`[0, |m| + 8.5]`.
    """
    tiny = torch.finfo(mean.dtype).tiny
    variance = variance.clamp_min(tiny)
    with torch.no_grad():
        split = (variance > ELP_SPLIT_VARIANCE) & (
            mean.abs() < ELP_MAX_STANDARDISED_MEAN * variance.sqrt()
        )
    return _by_regime(
        [split, ~split],
        [_elp_split, lambda *t: _elp_hermite(*t, num_locs)],
        y,
        mean,
        variance,
    )


# ----------------------------------------------------------------------------------------------
# log E[p(y | f)]
# ----------------------------------------------------------------------------------------------


def _lm_hermite(y: Tensor, mean: Tensor, variance: Tensor, num_locs: int) -> Tensor:
    nodes, log_weights = _rule("hermite", num_locs, mean.dtype, mean.device)
    f = mean + torch.sqrt(2.0 * variance) * nodes  # shape: (J, n)
    return torch.logsumexp(cb_log_density(y, f) + log_weights, dim=0)


def _lm_adaptive_hermite(y: Tensor, mean: Tensor, variance: Tensor, num_locs: int) -> Tensor:
    r"""Gauss-Hermite centred on the mode :math:`c` of :math:`p(y \mid f) \mathcal{N}(f; \mu, s^2)`
    with :math:`\tau^2 = 1 / (A''(c) + 1/s^2)`, for :math:`\alpha = y + \mu / s^2 \notin
    [-2.5, 3.5]`, where :math:`|c| > 2.5 s^2` and :math:`A'(c) \approx [c > 0] - 1/c`: the mode of
    that approximation and two Newton steps. :math:`c, \tau` are constants of the rule (the
    quadrature is consistent for any), so they are found without gradients."""
    with torch.no_grad():
        # the offset d = c - mu of the mode (not c itself: in float32 c - mu cancels when |mu| is
        # many ulps of s), first of the approximation, whose mode solves c^2 - b c - s^2 = 0
        alpha_minus_one = (y - 1.0) + mean / variance
        positive = alpha_minus_one > 0
        b = torch.where(positive, alpha_minus_one, alpha_minus_one + 1.0) * variance
        root = 2.0 * variance / (b.abs() + torch.sqrt(b.square() + 4.0 * variance))
        offset = torch.where(positive, (y - 1.0) * variance + root, y * variance - root)
        for _ in range(2):
            mode = mean + offset
            grad = y - cb_mean(mode) - offset / variance
            offset = offset + grad / (cb_variance(mode) + 1.0 / variance)
        tau = torch.rsqrt(cb_variance(mean + offset) + 1.0 / variance)
    nodes, log_weights = _rule("hermite_adaptive", num_locs, mean.dtype, mean.device)
    step = offset + math.sqrt(2.0) * tau * nodes  # f - mu at the nodes, shape: (J, n)
    log_prior = -0.5 * (step / variance.sqrt()).square()
    total = torch.logsumexp(log_weights + cb_log_density(y, mean + step) + log_prior, dim=0)
    return total + torch.log(tau) - 0.5 * torch.log(variance) - 0.5 * math.log(math.pi)


def _lm_peel_counts(y: Tensor, mean: Tensor, variance: Tensor) -> tuple[Tensor, Tensor]:
    r"""Number :math:`K \ge 1` of exponentials peeled off for each tilt
    :math:`\lambda \in \{\alpha, 1 - \alpha\}` so that the Laguerre rate :math:`K + \lambda \ge
    1/2`."""
    s = variance.sqrt()
    lam1 = (y * s + mean / s) / s
    lam2 = ((1.0 - y) * s - mean / s) / s
    k1 = torch.ceil(LM_MIN_RATE - lam1).clamp_min(1.0)
    k2 = torch.ceil(LM_MIN_RATE - lam2).clamp_min(1.0)
    return k1, k2


def _lm_split(y: Tensor, mean: Tensor, variance: Tensor) -> Tensor:
    r"""The split of :func:`log_marginal` in log space; see there."""
    s = variance.sqrt()
    log_s = torch.log(s)
    m = mean / s
    base = -0.5 * m.square() - _HALF_LOG_2PI  # log phi(m)
    peel = torch.stack(_lm_peel_counts(y, mean, variance))  # shape: (2, n)
    # tilts alpha = y + mu/s^2 (f < 0, sign +1) and 1 - alpha (f > 0, sign -1)
    shift = torch.stack([y, 1.0 - y])  # shape: (2, n)
    sign = torch.tensor([1.0, -1.0], dtype=mean.dtype, device=mean.device).unsqueeze(-1)
    # peeled terms s^2 g(x), x = (k + lambda) s = c + sign m, c = (shift + k) s: shape (K, 2, n)
    k = torch.arange(LM_MAX_PEELED, dtype=mean.dtype, device=mean.device).view(-1, 1, 1)
    c = (shift + k) * s
    x = c + sign * m
    # x >= 0: log s + log phi(m) + log g(x)
    positive = log_s + base + _log_g(x.clamp_min(0.0))
    # x < 0: log s + (x^2 - m^2)/2 + log(phi(x) + |x| Phi(|x|)), the square difference factored
    xa = (-x).clamp_min(0.0)
    negative = log_s + 0.5 * c * (c + 2.0 * sign * m) + torch.log(_npdf(xa) + xa * _ndtr(xa))
    peeled = torch.where(x >= 0, positive, negative)
    peeled = torch.where(k < peel, peeled, torch.full_like(peeled, -math.inf))
    # remainders int_0^inf e^{-rho t} q(t) e^{-t^2 / 2s^2} dt, rho = K + lambda, by Gauss-Laguerre
    # of rate kappa = rho + 1/s (which also resolves the Gaussian factor when s is small)
    u, weights = _rule("laguerre", _counts(mean.dtype)[2], mean.dtype, mean.device)
    rate = peel + shift + sign * (m / s)  # shape: (2, n)
    inv_kappa = 1.0 / (rate + 1.0 / s)
    neg_t = u.unsqueeze(-1) * -inv_kappa  # -t at the nodes, shape: (J, 2, n)
    v = u.unsqueeze(-1) * (inv_kappa / s)  # t / s
    # q(t) e^{v - v^2/2}, with q(t) = t / (1 - e^{-t}) = -t / expm1(-t)
    integrand = neg_t / torch.expm1(neg_t) * torch.exp(torch.addcmul(v, v, v, value=-0.5))
    remainder = (weights.mT @ integrand.flatten(1)).view_as(inv_kappa) * inv_kappa
    remainder = torch.log(remainder) + base - log_s
    return torch.logsumexp(torch.cat([peeled.flatten(0, 1), remainder]), dim=0)


def log_marginal(y: Tensor, mean: Tensor, variance: Tensor, num_locs: int) -> Tensor:
    r""":math:`\log \mathbb{E}_{\mathcal{N}(f; \mu, s^2)}[p(y \mid f)]` elementwise (1-D inputs of one
    shape).

    Gauss-Hermite in log space (``num_locs`` nodes at :math:`\mu + \sqrt2 s x_j`) for
    :math:`s^2 \le 3`. Otherwise, with :math:`\alpha = y + \mu/s^2` and
    :math:`q(t) = t / (1 - e^{-t}) = \sum_{k \ge 0} t e^{-kt}`, completing the square on each half
    line gives

    .. math::

        \mathbb{E}[p(y \mid f)] = \frac{\varphi(m)}{s} \bigl[Q(\alpha) + Q(1 - \alpha)\bigr], \qquad
        Q(\lambda) = \int_0^\infty q(t) e^{-\lambda t - t^2/2s^2} dt
        = \sum_{k < K} s^2 g\bigl((k + \lambda) s\bigr)
        + \int_0^\infty e^{-(K + \lambda) t} q(t) e^{-t^2/2s^2} dt,

    with :math:`K \ge 1` the least such that :math:`K + \lambda \ge 1/2`, and the remainder by
    32-node Gauss-Laguerre of rate :math:`K + \lambda + 1/s`; used for :math:`\alpha \in
    [-2.5, 3.5]` (:math:`K \le 3`). Beyond, the mode of the integrand is further than
    :math:`2.5 s^2` from the kink at 0 and Gauss-Hermite centred on it is used
    (:func:`_lm_adaptive_hermite`).
    """
    tiny = torch.finfo(mean.dtype).tiny
    variance = variance.clamp_min(tiny)
    with torch.no_grad():
        large = variance > LM_SPLIT_VARIANCE
        k1, k2 = _lm_peel_counts(y, mean, variance)
        split = large & (k1 <= LM_MAX_PEELED) & (k2 <= LM_MAX_PEELED)
        adaptive = large & ~split
    return _by_regime(
        [~large, split, adaptive],
        [
            lambda *t: _lm_hermite(*t, num_locs),
            _lm_split,
            lambda *t: _lm_adaptive_hermite(*t, num_locs),
        ],
        y,
        mean,
        variance,
    )


def _by_regime(
    masks: list[Tensor],
    functions: list[Callable[[Tensor, Tensor, Tensor], Tensor]],
    y: Tensor,
    mean: Tensor,
    variance: Tensor,
) -> Tensor:
    """Each function on the elements of its mask only (the masks partition the elements)."""
    parts = []
    for mask, function in zip(masks, functions, strict=True):
        index = mask.nonzero().squeeze(-1)
        if index.numel() == mean.numel():  # one regime for all: no gather or scatter
            return function(y, mean, variance)
        if index.numel() > 0:
            parts.append((index, function(y[index], mean[index], variance[index])))
    out = torch.zeros_like(mean)
    for index, values in parts:
        out = out.index_put((index,), values)
    return out
