r"""Numerically stable log-normaliser of the continuous Bernoulli distribution in its logit.

The continuous Bernoulli distribution (Loaiza-Ganem & Cunningham, 2019) with logit :math:`f` is an
exponential family on :math:`[0, 1]`:

.. math::

    \log p(y \mid f) = y f - A(f), \qquad A(f) = \log \frac{e^f - 1}{f}, \qquad A(0) = 0,

with mean :math:`A'(f)` and variance :math:`A''(f) > 0`. In the parameterisation of Borup & Andersen
(eq. 20) by :math:`\lambda = \sigma(f)` the density is :math:`C(\lambda) \lambda^y (1 - \lambda)^{1-y}`,
so :math:`\log C(\sigma(f)) = \operatorname{softplus}(f) - A(f) = \log(f \coth(f / 2))`
(Proposition 4.1).

A Bernoulli-number series is used for small :math:`|f|` (where the closed forms cancel) and forms
that neither overflow nor cancel elsewhere. Measured against mpmath on a dense grid of
:math:`|f| \le 6` (2500 points in each of the regions just above the series cut-offs, where the
closed forms take over) and a log-uniform one up to :math:`10^3`, every function has a relative
error below :math:`6 \epsilon` (:math:`|\hat v - v| \le 6 \epsilon |v|`, with :math:`\epsilon`
the machine epsilon of the dtype; up to twice as many ulps of :math:`v`) in float32 and
float64. The largest errors: :func:`cb_entropy` :math:`5.1 \epsilon` (float32, near
:math:`|f| = 2.7`), :func:`log_cb_normalizing_constant_grad` :math:`4.7 \epsilon` (near
:math:`|a| = 1.36`), :func:`cb_variance` :math:`3.1 \epsilon` (near :math:`|f| = 2.6`), the
others below :math:`1.5 \epsilon`. The exception is :func:`log_cb_normalizing_constant_hessian`,
which changes sign at :math:`|a| \approx 2.678`: its absolute error stays below 1.3 machine
epsilons (its value at 0 is 1/6). All functions are built from differentiable torch operations with both branches
kept finite, so autograd derivatives of any order are correct.
"""

from __future__ import annotations

import math
from fractions import Fraction

import torch
from torch import Tensor

__all__ = [
    "cb_entropy",
    "cb_log_density",
    "cb_log_normalizer",
    "cb_mean",
    "cb_variance",
    "log_cb_normalizing_constant",
    "log_cb_normalizing_constant_grad",
    "log_cb_normalizing_constant_hessian",
]


def _bernoulli_numbers(n_max: int) -> list[Fraction]:
    """Bernoulli numbers :math:`B_0, ..., B_{n_max}` (convention :math:`B_1 = -1/2`)."""
    numbers = [Fraction(0)] * (n_max + 1)
    for m in range(n_max + 1):
        a = [Fraction(0)] * (m + 1)
        for j in range(m + 1):
            a[j] = Fraction(1, j + 1)
            for k in range(j, 0, -1):
                a[k - 1] = k * (a[k - 1] - a[k])
        numbers[m] = a[0]
    numbers[1] = -numbers[1]  # Akiyama-Tanigawa gives B_1 = +1/2; the sign is unused below.
    return numbers


_NUM_TERMS = 22
_B = _bernoulli_numbers(2 * _NUM_TERMS + 2)
# A(f) - f/2 = sum_k B_2k f^2k / (2k (2k)!)
_A_COEFFS = [float(_B[2 * k] / (2 * k * math.factorial(2 * k))) for k in range(1, _NUM_TERMS + 1)]
# A'(f) - 1/2 = sum_k B_2k f^(2k-1) / (2k)!
_DA_COEFFS = [float(_B[2 * k] / math.factorial(2 * k)) for k in range(1, _NUM_TERMS + 1)]
# A''(f) = sum_k B_2k (2k - 1) f^(2k-2) / (2k)!
_D2A_COEFFS = [
    float(_B[2 * k] * (2 * k - 1) / math.factorial(2 * k)) for k in range(1, _NUM_TERMS + 1)
]
# A(f) - f A'(f) = sum_k B_2k (1 - 2k) f^2k / (2k (2k)!)
_H_COEFFS = [
    float(_B[2 * k] * (1 - 2 * k) / (2 * k * math.factorial(2 * k)))
    for k in range(1, _NUM_TERMS + 1)
]
# 1/a - csch(a) = -sum_k 2 (1 - 2^(2k-1)) B_2k a^(2k-1) / (2k)!
_CSCH = [
    float(-2 * (1 - 2 ** (2 * k - 1)) * _B[2 * k] / math.factorial(2 * k))
    for k in range(1, _NUM_TERMS + 1)
]
_LOGC_COEFFS = [c / (2 * k) for k, c in enumerate(_CSCH, start=1)]  # log C - log 2, in a^(2k)
_DLOGC_COEFFS = _CSCH  # in a^(2k-1)
_D2LOGC_COEFFS = [c * (2 * k - 1) for k, c in enumerate(_CSCH, start=1)]  # in a^(2k-2)

# |f| below which the series is used. The A-series converges for |f| < 2 pi and the csch-series for
# |a| < pi; with 22 terms the truncation error at these thresholds is below 1e-17 relative. Lower
# thresholds cost accuracy: the closed forms of A'' and H (at 1) and of 1/a - csch(a) (at 0.5)
# cancel by factors of 10 to 25.
_SERIES_CUTOFF = 2.5
_LOGC_SERIES_CUTOFF = 1.25


def _even_series(x2: Tensor, coeffs: list[float]) -> Tensor:
    """Horner evaluation of ``sum_k coeffs[k] * x2**k`` (k from 0)."""
    out = torch.full_like(x2, coeffs[-1])
    for c in reversed(coeffs[:-1]):
        out = out * x2 + c
    return out


def _split(f: Tensor, cutoff: float) -> tuple[Tensor, Tensor, Tensor]:
    """Mask of small entries and two copies of ``f`` that are safe for each branch."""
    small = f.abs() < cutoff
    f_small = torch.where(small, f, torch.zeros_like(f))
    f_large = torch.where(small, torch.full_like(f, 2.0 * cutoff), f)
    return small, f_small, f_large


def _check_tensor(f: Tensor, name: str = "f") -> Tensor:
    if not isinstance(f, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(f)}")
    if not f.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {f.dtype}")
    return f


def cb_log_normalizer(f: Tensor) -> Tensor:
    r"""The log-normaliser :math:`A(f) = \log((e^f - 1) / f)` of the continuous Bernoulli.

    .. math::

        A(f) = \begin{cases}
            \tfrac{f}{2} + \sum_{k \ge 1} \tfrac{B_{2k}}{2k (2k)!} f^{2k} & |f| < 2.5, \\
            \max(f, 0) + \log(-\operatorname{expm1}(-|f|)) - \log |f| & \text{otherwise.}
        \end{cases}

    :param f: Logits, any shape.
    :return: :math:`A(f)`, same shape as ``f``.
    """
    f = _check_tensor(f)
    small, fs, fl = _split(f, _SERIES_CUTOFF)
    series = 0.5 * fs + fs.square() * _even_series(fs.square(), _A_COEFFS)
    abs_fl = fl.abs()
    closed = fl.clamp_min(0.0) + torch.log(-torch.expm1(-abs_fl)) - torch.log(abs_fl)
    return torch.where(small, series, closed)


def cb_log_density(y: Tensor, f: Tensor) -> Tensor:
    r"""The log-density :math:`\log p(y \mid f) = y f - A(f)` of the continuous Bernoulli.

    .. math::

        \log p(y \mid f) = (y - [f \ge 0])\, f - A(-|f|),

    which equals :math:`y f - A(f)` (as :math:`A(f) = \max(f, 0) + A(-|f|)`) without subtracting
    :math:`A(f) \approx f` from :math:`y f`: in float32 that subtraction loses :math:`10^{-4}`
    absolute at :math:`|f| = 10^3`. Its gradient in :math:`f` is :math:`y - A'(f)`, also at
    :math:`f = 0`.

    At infinite logits it is the limit: as :math:`f \to +\infty`,
    :math:`\log p(y \mid f) = (y - 1) f + \log f + \log(1 - e^{-f})`, which tends to
    :math:`-\infty` for :math:`y < 1` and to :math:`+\infty` for :math:`y = 1` (the density
    concentrates at 1); as :math:`f \to -\infty`, by the symmetry
    :math:`p(y \mid f) = p(1 - y \mid -f)`, to :math:`-\infty` for :math:`y > 0` and to
    :math:`+\infty` for :math:`y = 0`. Its gradient in an infinite logit is 0.

    :param y: Targets, broadcastable with ``f`` (not checked against the support).
    :param f: Logits, any shape.
    :return: :math:`\log p(y \mid f)`, the broadcast shape of ``y`` and ``f``.
    """
    f = _check_tensor(f)
    y = torch.as_tensor(y, dtype=f.dtype, device=f.device)
    infinite = torch.isinf(f)
    finite_f = torch.where(infinite, torch.zeros_like(f), f)  # keeps inf out of the gradient
    nonnegative = finite_f >= 0
    tilt = torch.where(nonnegative, y - 1.0, y)
    # -|f| written so that its gradient at 0 is -1, matching the tilt y - 1 chosen there
    out = tilt * finite_f - cb_log_normalizer(torch.where(nonnegative, -finite_f, finite_f))
    if not bool(infinite.any()):
        return out
    # the limits: -inf where y lies below 1 (f = +inf) or above 0 (f = -inf), else +inf
    away = torch.where(f > 0, y < 1.0, y > 0.0)
    inf = torch.full_like(out, float("inf"))
    limit = torch.where(away, -inf, inf)
    limit = torch.where(torch.isnan(y), torch.full_like(out, float("nan")), limit)
    return torch.where(infinite, limit, out)


def cb_mean(f: Tensor) -> Tensor:
    r"""The mean :math:`A'(f) = 1 / (1 - e^{-f}) - 1 / f` of the continuous Bernoulli (in (0, 1)).

    :param f: Logits, any shape.
    :return: :math:`\mathbb{E}[y \mid f] = A'(f)`, same shape as ``f``.
    """
    f = _check_tensor(f)
    small, fs, fl = _split(f, _SERIES_CUTOFF)
    series = 0.5 + fs * _even_series(fs.square(), _DA_COEFFS)
    # 1 / (1 - e^{-f}) in |f| alone: e^{-f} for f < 0 would overflow, and its gradient be NaN
    abs_fl = fl.abs()
    numerator = torch.where(fl > 0, -torch.ones_like(fl), torch.exp(-abs_fl))
    closed = numerator / torch.expm1(-abs_fl) - 1.0 / fl
    return torch.where(small, series, closed)


def cb_variance(f: Tensor) -> Tensor:
    r"""The variance :math:`A''(f) = 1/f^2 - e^{-|f|} / (1 - e^{-|f|})^2 > 0` of the continuous Bernoulli.

    :param f: Logits, any shape.
    :return: :math:`\operatorname{Var}[y \mid f] = A''(f)`, same shape as ``f``.
    """
    f = _check_tensor(f)
    small, fs, fl = _split(f, _SERIES_CUTOFF)
    series = _even_series(fs.square(), _D2A_COEFFS)
    abs_fl = fl.abs()
    closed = 1.0 / fl.square() - torch.exp(-abs_fl) / torch.expm1(-abs_fl).square()
    return torch.where(small, series, closed)


def cb_entropy(f: Tensor) -> Tensor:
    r"""The entropy :math:`H(f) = A(f) - f A'(f) \le 0` of the continuous Bernoulli, an even function.

    .. math::

        H(f) = \begin{cases}
            \sum_{k \ge 1} \tfrac{(1 - 2k) B_{2k}}{2k (2k)!} f^{2k} & |f| < 2.5, \\
            \log(1 - e^{-t}) - \log t + 1 - \tfrac{t e^{-t}}{1 - e^{-t}}, \ t = |f|
            & \text{otherwise,}
        \end{cases}

    so that neither the :math:`f/2` of :math:`A` and :math:`f A'` near 0 nor their :math:`f` at
    large :math:`f` cancel.

    :param f: Logits, any shape.
    :return: :math:`H(f)`, same shape as ``f``.
    """
    f = _check_tensor(f)
    small, fs, fl = _split(f, _SERIES_CUTOFF)
    series = fs.square() * _even_series(fs.square(), _H_COEFFS)
    t = fl.abs()
    one_minus_e = -torch.expm1(-t)  # 1 - e^{-t}
    closed = torch.log(one_minus_e) - torch.log(t) + 1.0 - t * torch.exp(-t) / one_minus_e
    return torch.where(small, series, closed)


def log_cb_normalizing_constant(a: Tensor) -> Tensor:
    r"""Proposition 4.1: :math:`\log C(\sigma(a)) = \log(a \coth(a / 2))` (:math:`\log 2` at 0).

    Equals :math:`\operatorname{softplus}(a) - A(a)`; an even function, at least :math:`\log 2`.

    :param a: Logits, any shape.
    :return: :math:`\log C(\sigma(a))`, same shape as ``a``.
    """
    a = _check_tensor(a, "a")
    small, a_s, a_l = _split(a, _LOGC_SERIES_CUTOFF)
    series = math.log(2.0) + a_s.square() * _even_series(a_s.square(), _LOGC_COEFFS)
    abs_al = a_l.abs()
    closed = torch.log(abs_al) + torch.log1p(torch.exp(-abs_al)) - torch.log(-torch.expm1(-abs_al))
    return torch.where(small, series, closed)


def log_cb_normalizing_constant_grad(a: Tensor) -> Tensor:
    r"""Proposition 4.1: :math:`\frac{d}{da} \log C(\sigma(a)) = 1/a - 1/\sinh(a)` (0 at 0).

    :param a: Logits, any shape.
    :return: The first derivative, same shape as ``a``.
    """
    a = _check_tensor(a, "a")
    small, a_s, a_l = _split(a, _LOGC_SERIES_CUTOFF)
    series = a_s * _even_series(a_s.square(), _DLOGC_COEFFS)
    abs_al = a_l.abs()
    # 1/sinh(a) = sign(a) * 2 e^{-|a|} / (1 - e^{-2|a|}), no overflow
    csch = torch.sign(a_l) * 2.0 * torch.exp(-abs_al) / (-torch.expm1(-2.0 * abs_al))
    closed = 1.0 / a_l - csch
    return torch.where(small, series, closed)


def log_cb_normalizing_constant_hessian(a: Tensor) -> Tensor:
    r"""Proposition 4.1: :math:`\frac{d^2}{da^2} \log C(\sigma(a)) = -1/a^2 + \coth(a)/\sinh(a)` (1/6 at 0).

    Equals :math:`\sigma(a)(1 - \sigma(a)) - A''(a)`.

    :param a: Logits, any shape.
    :return: The second derivative, same shape as ``a``.
    """
    a = _check_tensor(a, "a")
    small, a_s, a_l = _split(a, _LOGC_SERIES_CUTOFF)
    series = _even_series(a_s.square(), _D2LOGC_COEFFS)
    abs_al = a_l.abs()
    e = torch.exp(-abs_al)
    # coth(a)/sinh(a) = cosh(a)/sinh(a)^2 = 2 e (1 + e^2) / (1 - e^2)^2 with e = exp(-|a|)
    closed = 2.0 * e * (1.0 + e.square()) / torch.expm1(-2.0 * abs_al).square() - 1.0 / a_l.square()
    return torch.where(small, series, closed)
