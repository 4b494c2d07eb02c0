"""mpmath references for the continuous categorical (tests only).

The log-normaliser :math:`A(\\boldsymbol\\eta) = \\log \\sum_k e^{\\eta_k} / \\prod_{i \\ne k}
(\\eta_k - \\eta_i)` by the closed form, at a working precision chosen from the node spacing so
that its cancellation leaves 50 correct digits. Repeated parameters are first moved apart by
multiples of :math:`10^{-60}`, which changes :math:`A` by less than :math:`K^2 \\cdot 10^{-60}`
(its gradient, the mean, lies in the simplex).
"""

from __future__ import annotations

import math

import mpmath

_TIE_OFFSET = mpmath.mpf(10) ** -60


def log_normalizer(eta: list[float], digits: int = 50) -> mpmath.mpf:
    """:math:`A(\\boldsymbol\\eta)` to ``digits`` significant digits (as an mpf)."""
    K = len(eta)
    with mpmath.workdps(200):  # exact for floats up to 1e100 plus the offsets
        nodes = sorted(mpmath.mpf(x) for x in eta)
        for k in range(1, K):  # ties (sorted, so equal values are adjacent) moved apart
            if nodes[k] <= nodes[k - 1]:
                nodes[k] = nodes[k - 1] + _TIE_OFFSET
        min_gap = min(nodes[k] - nodes[k - 1] for k in range(1, K))
        spread = nodes[-1] - nodes[0]
        # each term is at most min_gap^-(K-1), the sum at least spread^-(K-1) / (e (K-1)!)
        lost = (K - 1) * float(mpmath.log10(max(spread, 1) / min_gap))
    lost += math.log10(math.factorial(K)) + 1
    with mpmath.workdps(digits + int(lost) + 20):
        top = nodes[-1]
        total = mpmath.mpf(0)
        for k, a in enumerate(nodes):
            term = mpmath.exp(a - top)
            for i, b in enumerate(nodes):
                if i != k:
                    term /= a - b
            total += term
        return top + mpmath.log(total)


def mean(eta: list[float], digits: int = 50) -> list[mpmath.mpf]:
    """:math:`\\mathbb E[x_k] = \\exp[\\boldsymbol\\eta, \\eta_k] / \\exp[\\boldsymbol\\eta]`."""
    with mpmath.workdps(digits + 10):
        base = log_normalizer(eta, digits + 10)
        return [mpmath.exp(log_normalizer([*eta, x], digits + 10) - base) for x in eta]
