"""mpmath references for the continuous Bernoulli (tests only).

Closed forms of the log-normaliser :math:`A(f) = \\log((e^f - 1)/f)`, its derivatives, the
entropy, CDF and inverse CDF, and :math:`\\log C(\\sigma(a)) = \\log(a \\coth(a/2))`, each with
its limit at 0, evaluated at the caller's mpmath precision; and the Gaussian expectations that
``ContinuousBernoulliLikelihood.expected_log_prob`` and ``log_marginal`` compute, by adaptive
tanh-sinh quadrature at 25 digits, with break points on the scale of each integrand (the
latent's standard deviation, the width 1 of the kink of :math:`A` at 0, and for the log marginal
the width of :math:`p(y \\mid f) \\mathcal{N}(f)` around its mode). And a small Laplace problem
with continuous-Bernoulli targets.
"""

from __future__ import annotations

from typing import NamedTuple

import gpytorch
import mpmath
import torch


class CBExpectations(NamedTuple):
    """:math:`\\mathbb{E}[\\log p]`, :math:`\\log \\mathbb{E}[p]` and their derivatives."""

    expected_log_prob: float
    log_marginal: float
    expected_log_prob_dmean: float
    expected_log_prob_dvariance: float
    log_marginal_dmean: float
    log_marginal_dvariance: float


def cb_log_normalizer(f):
    """:math:`A(f) = \\log((e^f - 1) / f)`."""
    f = mpmath.mpf(f)
    return mpmath.log(mpmath.expm1(f) / f) if f != 0 else mpmath.mpf(0)


def cb_mean(f):
    """:math:`A'(f) = 1 / (1 - e^{-f}) - 1 / f`."""
    f = mpmath.mpf(f)
    return 1 / -mpmath.expm1(-f) - 1 / f if f != 0 else mpmath.mpf(1) / 2


def cb_variance(f):
    """:math:`A''(f) = 1 / f^2 - e^f / (e^f - 1)^2`."""
    f = mpmath.mpf(f)
    return 1 / f**2 - mpmath.exp(f) / mpmath.expm1(f) ** 2 if f != 0 else mpmath.mpf(1) / 12


def cb_entropy(f):
    """:math:`H(f) = A(f) - f A'(f)`."""
    return cb_log_normalizer(f) - mpmath.mpf(f) * cb_mean(f)


def cdf(f, y):
    """:math:`(e^{fy} - 1) / (e^f - 1)`."""
    f, y = mpmath.mpf(f), mpmath.mpf(y)
    return mpmath.expm1(f * y) / mpmath.expm1(f) if f != 0 else y


def icdf(f, u):
    """:math:`\\operatorname{log1p}(u \\operatorname{expm1}(f)) / f`."""
    f, u = mpmath.mpf(f), mpmath.mpf(u)
    return mpmath.log1p(u * mpmath.expm1(f)) / f if f != 0 else u


def log_cb_normalizing_constant(a):
    """:math:`\\log C(\\sigma(a)) = \\log(a \\coth(a / 2))` (Prop. 4.1 of the paper)."""
    a = mpmath.mpf(a)
    return mpmath.log(a * mpmath.coth(a / 2)) if a != 0 else mpmath.log(2)


def log_cb_normalizing_constant_grad(a):
    """:math:`1 / a - 1 / \\sinh a`."""
    a = mpmath.mpf(a)
    return 1 / a - 1 / mpmath.sinh(a) if a != 0 else mpmath.mpf(0)


def log_cb_normalizing_constant_hessian(a):
    """:math:`-1 / a^2 + \\coth a / \\sinh a`."""
    a = mpmath.mpf(a)
    return -1 / a**2 + mpmath.coth(a) / mpmath.sinh(a) if a != 0 else mpmath.mpf(1) / 6


def _breaks(points, lo, hi):
    return sorted({p for p in points if lo < p < hi} | {lo, hi})


def cb_gaussian_expectations(y: float, mean: float, variance: float) -> CBExpectations:
    """Expectations over :math:`f \\sim \\mathcal{N}(\\text{mean}, \\text{variance})`, variance > 0.

    Derivatives from Gaussian identities, not by differencing: :math:`\\partial_\\mu \\mathbb{E}[h]
    = \\mathbb{E}[h']`, :math:`\\partial_{s^2} \\mathbb{E}[h] = \\mathbb{E}[h''] / 2`, and for the
    log marginal the moments of the tilted density :math:`\\propto p(y \\mid f) \\mathcal{N}(f)`.
    """
    with mpmath.workdps(25):
        y, mu, var = mpmath.mpf(y), mpmath.mpf(mean), mpmath.mpf(variance)
        s = mpmath.sqrt(var)
        kink = [mpmath.mpf(t) for t in (-16, -4, -1, 0, 1, 4, 16)]
        pts = _breaks(
            [mu + k * s for k in (-12, -6, -3, -1, 0, 1, 3, 6, 12)] + kink, mu - 40 * s, mu + 40 * s
        )

        def npdf(f):
            return mpmath.npdf(f, mu, s)

        elp = mpmath.quad(lambda f: (y * f - cb_log_normalizer(f)) * npdf(f), pts)
        elp_dmean = mpmath.quad(lambda f: (y - cb_mean(f)) * npdf(f), pts)
        # E[A''(f)] = E[A'(f) (f - mu)] / s^2 (Stein's lemma)
        elp_dvar = -mpmath.quad(lambda f: cb_mean(f) * (f - mu) * npdf(f), pts) / (2 * var)

        def log_tilted(f):
            return y * f - cb_log_normalizer(f) - (f - mu) ** 2 / (2 * var)

        # its mode c (the log is concave) by bisection on the derivative, inside
        # [mu + (y - 1) s^2, mu + y s^2] as 0 < A' < 1
        lo, hi = mu + (y - 1) * var - 1, mu + y * var + 1
        for _ in range(200):
            c = (lo + hi) / 2
            if y - cb_mean(c) - (c - mu) / var > 0:
                lo = c
            else:
                hi = c
        width = 1 / mpmath.sqrt(1 / var + mpmath.diff(cb_mean, c))
        offsets = (-30, -12, -6, -3, -1, 0, 1, 3, 6, 12, 30)
        pts = _breaks([c + k * width for k in offsets] + kink, c - 60 * width, c + 60 * width)
        peak = log_tilted(c)
        moments = [
            mpmath.quad(lambda f, k=k: (f - mu) ** k * mpmath.exp(log_tilted(f) - peak), pts)
            for k in range(3)
        ]
        lm = peak + mpmath.log(moments[0]) - mpmath.log(s) - mpmath.log(2 * mpmath.pi) / 2
        return CBExpectations(
            float(elp),
            float(lm),
            float(elp_dmean),
            float(elp_dvar),
            float(moments[1] / moments[0] / var),
            float((moments[2] / moments[0] - var) / (2 * var**2)),
        )


def cb_laplace_problem(n=10, dtype=torch.float64, outputscale=1.0, batch=()):
    """A scaled RBF kernel matrix (jitter 1e-6 times the outputscale) on n points in [0, 3],
    uniform targets in (0, 1) of batch shape ``batch`` and a constant prior mean 1.5; built in
    float64, returned in ``dtype``."""
    g = torch.Generator().manual_seed(0)
    x = torch.rand(n, 1, generator=g, dtype=torch.float64) * 3
    y = torch.rand(*batch, n, generator=g, dtype=torch.float64)
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).double()
    kernel.outputscale = outputscale
    K = kernel(x).to_dense().detach() + 1e-6 * outputscale * torch.eye(n, dtype=torch.float64)
    m = torch.full((n,), 1.5, dtype=torch.float64)
    return K.to(dtype), y.to(dtype), m.to(dtype)
