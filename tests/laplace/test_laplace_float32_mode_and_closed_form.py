"""Float32 Laplace modes against float64 ones, and the closed-form class probability of an autograd
likelihood with a probit response against the exact formula."""

import math

import gpytorch
import pytest
import torch
from scipy import integrate, special

from gpsd.data.toy import sine_classification
from gpsd.laplace import (
    AutogradLikelihoodTerms,
    LaplaceGPClassifier,
    closed_form_probability,
    resolve_likelihood_terms,
)
from gpsd.laplace.newton import find_laplace_mode


def _kernel_matrix(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y, _ = sine_classification(40, seed=seed)
    k = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).double()
    k.outputscale = 10.0
    k.base_kernel.lengthscale = 0.8
    K = k(x).to_dense().detach() + 0.01 * torch.eye(40, dtype=torch.float64)
    return K, y


@pytest.mark.parametrize(
    ("seed", "likelihood", "temperature"), [(0, "logit", 1.0), (3, "probit", 3.0)]
)
def test_float32_mode_is_not_stopped_a_newton_step_early(seed, likelihood, temperature):
    # a full Newton step that changed psi by less than the line search's slack (1e-3 |psi| in
    # float32) counted as converged: the float32 modes were 1.5e-2 (logit) and 3.9e-2 (probit, tau=3)
    # off the float64 ones; one more Newton step brings them to ~3e-5
    K, y = _kernel_matrix(seed)
    terms = resolve_likelihood_terms(likelihood)
    ref = find_laplace_mode(K, y, terms, temperature=temperature)
    got = find_laplace_mode(K.float(), y.float(), terms, temperature=temperature)
    torch.testing.assert_close(got.f.double(), ref.f, rtol=0, atol=2e-4)
    assert got.log_marginal_likelihood.item() == pytest.approx(
        ref.log_marginal_likelihood.item(), abs=1e-4
    )


def test_closed_form_probability_of_an_autograd_probit_response_is_exact():
    # a probit response given to AutogradLikelihoodTerms got MacKay's logistic approximation:
    # 0.7139 for E[Phi(f)], f ~ N(1, 0.5), whose value is Phi(1 / sqrt(1.5)) = 0.7929
    terms = AutogradLikelihoodTerms(
        gpytorch.likelihoods.BernoulliLikelihood(), response=torch.special.ndtr
    )
    mean = torch.tensor([1.0, -0.4, 3.0], dtype=torch.float64)
    var = torch.tensor([0.5, 4.0, 0.0], dtype=torch.float64)
    ref = [
        integrate.quad(
            lambda f, m=m, v=v: (
                special.ndtr(f) * math.exp(-0.5 * (f - m) ** 2 / v) / math.sqrt(2 * math.pi * v)
            ),
            -60,
            60,
            epsabs=1e-14,
        )[0]
        if v > 0
        else special.ndtr(m)
        for m, v in zip(mean.tolist(), var.tolist(), strict=True)
    ]
    got = closed_form_probability(terms, mean, var)
    torch.testing.assert_close(got, torch.tensor(ref, dtype=torch.float64), rtol=0, atol=1e-10)
    x, y, test_x = sine_classification(30, seed=3)
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).double()
    model = LaplaceGPClassifier(x, y, kernel, likelihood=terms)
    torch.testing.assert_close(
        model.predict_proba(test_x, method="probit")[..., 1],
        model.predict_proba(test_x)[..., 1],
        atol=1e-9,
        rtol=0,
    )


def test_closed_form_probability_refuses_an_unknown_autograd_response():
    terms = AutogradLikelihoodTerms(
        gpytorch.likelihoods.BernoulliLikelihood(), response=lambda f: torch.sigmoid(f) ** 2
    )
    with pytest.raises(ValueError, match="logistic or probit response"):
        closed_form_probability(terms, torch.zeros(2), torch.ones(2))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_logit_terms_in_the_correctly_classified_tail_against_mpmath(dtype):
    # y f - softplus(f) rounded softplus(f) to f above 20: log p(1 | 25) was 0 instead of -1.39e-11
    # (float64), and y - sigma(f) cancelled: d/df log p(1 | 30) was 9.348e-14 instead of 9.358e-14,
    # and 0 in float32 from f = 17 on
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
    # response="probit" was accepted and failed at predict time with "'str' object is not callable"
    with pytest.raises(TypeError, match=f"{arg} must be callable"):
        AutogradLikelihoodTerms(gpytorch.likelihoods.BernoulliLikelihood(), **{arg: "probit"})
