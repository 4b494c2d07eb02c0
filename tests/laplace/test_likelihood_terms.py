"""The likelihood terms of the Laplace approximation (logit, probit, autograd): values and
derivatives in the far tails against mpmath, and the checks of their arguments."""

import gpytorch
import pytest
import torch

from gpsd.laplace import (
    AutogradLikelihoodTerms,
    BernoulliProbitTerms,
    resolve_likelihood_terms,
)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_logit_terms_in_the_correctly_classified_tail_against_mpmath(dtype):
    # y f - softplus(f) as written rounds softplus(f) to f above 20 (log p(1 | 25) = 0 instead
    # of -1.39e-11 in float64), and y - sigma(f) cancels (d/df log p(1 | 30) = 9.348e-14 instead
    # of 9.358e-14, and 0 in float32 from f = 17 on)
    mpmath = pytest.importorskip("mpmath")
    mpmath.mp.dps = 40
    f = [17.0, 20.5, 25.0, 30.0, 60.0, 100.0]
    terms = resolve_likelihood_terms("logit")
    for y, sign in ((1.0, 1.0), (0.0, -1.0)):
        ft = sign * torch.tensor(f, dtype=dtype)
        yt = torch.full_like(ft, y)
        lp = terms.log_prob(yt, ft)
        d1, d2 = terms.derivatives(yt, ft)
        ref_lp = [-float(mpmath.log1p(mpmath.exp(-v))) for v in f]
        ref_d1 = [sign * float(1 / (1 + mpmath.exp(v))) for v in f]
        ref_d2 = [-float(mpmath.exp(v) / (1 + mpmath.exp(v)) ** 2) for v in f]
        for got, ref in ((lp, ref_lp), (d1, ref_d1), (d2, ref_d2)):
            ref = torch.tensor(ref, dtype=torch.float64).to(dtype)
            rtol = 1e-5 if dtype == torch.float32 else 1e-12
            # float32 holds e^-100 as a subnormal: absolute accuracy only
            torch.testing.assert_close(got, ref, rtol=rtol, atol=torch.finfo(dtype).tiny)


@pytest.mark.parametrize("arg", ["response", "target_check"])
def test_autograd_terms_name_a_callable_argument_that_is_not(arg):
    # response="probit" (not a callable) is refused at construction, naming the argument
    with pytest.raises(TypeError, match=f"{arg} must be callable"):
        AutogradLikelihoodTerms(gpytorch.likelihoods.BernoulliLikelihood(), **{arg: "probit"})


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_probit_curvature_in_the_far_tail_against_mpmath(dtype):
    mpmath = pytest.importorskip("mpmath")
    mpmath.mp.dps = 50
    z = [-1e4, -300.0, -50.0, -10.0, -5.01, -4.99, -1.0, 0.0, 3.0]
    if dtype == torch.float32:
        z = z[1:]  # -1e4 squared overflows float32's exponent range in the density
    d1, d2 = BernoulliProbitTerms().derivatives(
        torch.ones(len(z), dtype=dtype), torch.tensor(z, dtype=dtype)
    )
    ref1, ref2 = [], []
    for v in z:
        r = mpmath.npdf(v) / mpmath.ncdf(v)
        ref1.append(float(r))
        ref2.append(float(-r * (r + v)))
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(
        d1.double(), torch.tensor(ref1, dtype=torch.float64), rtol=400 * eps, atol=0
    )
    # the naive form is 61 % off at z = -1e4 in float64, of the wrong sign at z = -300 in float32
    torch.testing.assert_close(
        d2.double(), torch.tensor(ref2, dtype=torch.float64), rtol=1e4 * eps, atol=0
    )
