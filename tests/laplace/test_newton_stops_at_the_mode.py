"""Newton's method may stop on round-off only at the mode: a stop short of it raises."""

import pytest
import torch

from gpsd.laplace import (
    BernoulliLogitTerms,
    BernoulliProbitTerms,
    LaplaceConvergenceError,
    find_laplace_mode,
)
from gpsd.laplace.newton import _newton_step_gain

DT = torch.float64


def _problem(n=40, outputscale=4.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = 5 * torch.rand(n, 1, generator=gen, dtype=DT)
    y = (x[:, 0] > 2.5).to(DT)
    y[[3, 17]] = 1 - y[[3, 17]]
    K = outputscale * torch.exp(-0.5 * torch.cdist(x, x) ** 2)
    return K, y


class _DerivativesOfAnotherLikelihood(BernoulliLogitTerms):
    """log_prob of the logistic likelihood, derivatives of a steeper probit: a custom-terms bug."""

    def derivatives(self, y, f):
        return BernoulliProbitTerms().derivatives(y, 3 * f)


def test_derivatives_that_disagree_with_log_prob_raise():
    # such terms used to "converge" in 2 iterations to a point 1.5 away from the logistic mode:
    # a shortened step that moved f by round-off was taken for convergence
    K, y = _problem()
    with pytest.raises(LaplaceConvergenceError, match="stopped short of the mode.*derivatives"):
        find_laplace_mode(K, y, _DerivativesOfAnotherLikelihood())


def test_consistent_terms_still_converge_to_the_mode():
    # the mode is the fixed point f = K grad log p(y | f) (K is too ill-conditioned to solve with)
    K, y = _problem()
    for terms in (BernoulliLogitTerms(), BernoulliProbitTerms()):
        mode = find_laplace_mode(K, y, terms)
        d1, _ = terms.derivatives(y, mode.f)
        torch.testing.assert_close(K @ d1, mode.f, rtol=0, atol=1e-9)


def test_newton_step_gain_against_the_dense_formula():
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(2, 7, 7, generator=gen, dtype=DT)
    K = a @ a.mT + 0.5 * torch.eye(7, dtype=DT)
    W = torch.rand(2, 7, generator=gen, dtype=DT)
    d = torch.randn(2, 7, generator=gen, dtype=DT)
    step_f = K @ d.unsqueeze(-1)  # shape: (2, 7, 1)
    H = torch.linalg.inv(K) + torch.diag_embed(W)
    want = 0.5 * (step_f.mT @ H @ step_f).squeeze(-1).squeeze(-1)
    torch.testing.assert_close(_newton_step_gain(K, W, d), want, rtol=1e-12, atol=0)


def test_an_indefinite_float32_kernel_names_its_precision():
    # outputscale 1e8 in float32: rounding leaves eigenvalues of about -1e2, and B is indefinite
    K, y = _problem(n=60, outputscale=1e8)
    with pytest.raises(LaplaceConvergenceError, match="float32 precision.*fit in float64"):
        find_laplace_mode(K.float(), y.float(), BernoulliLogitTerms())
    bad = K.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(LaplaceConvergenceError, match="holds NaN"):
        find_laplace_mode(bad, y, BernoulliLogitTerms())
