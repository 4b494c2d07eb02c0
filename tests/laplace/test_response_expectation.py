"""Class probabilities E[r(f)], f ~ N(mu, s^2), at every latent variance: the Gauss-Laguerre split
of symmetric_response_expectation against adaptive quadrature (logistic) and the exact probit
formula, in float64 and float32, with gradients, and through the classifiers' predict_proba."""

from __future__ import annotations

import math

import gpytorch
import pytest
import torch
from scipy import integrate, special

from gpsd.distillation import DataCentricGPC, DistributionCentricGPC
from gpsd.laplace import (
    AutogradLikelihoodTerms,
    BernoulliLogitTerms,
    BernoulliProbitTerms,
    ContinuousBernoulliTerms,
    LaplaceGPClassifier,
    expected_response,
    gauss_hermite_expectation,
    symmetric_response_expectation,
)

MEANS = [0.0, 0.3, -1.7, 4.0, -12.0, 50.0]
VARIANCES = [0.3, 1.0, 2.0, 2.001, 5.0, 30.0, 100.0, 1e3, 1e5]


def logistic_normal_reference(mean: float, variance: float) -> float:
    """E[sigmoid(f)] = P(L < f) = E_L[Phi((mean - L) / s)] with L standard logistic, integrated over
    L by adaptive quadrature; the integrand is smooth away from L = mean, given as a break point."""
    s = math.sqrt(variance)

    def integrand(l: float) -> float:
        return special.expit(l) * special.expit(-l) * special.ndtr((mean - l) / s)

    points = [mean] if abs(mean) < 60 else None
    value, _ = integrate.quad(integrand, -60, 60, points=points, limit=500, epsabs=1e-15)
    return value  # the logistic density beyond |L| = 60 holds less than 1e-26


def _grid(dtype=torch.float64):
    mean, var = torch.meshgrid(
        torch.tensor(MEANS, dtype=dtype), torch.tensor(VARIANCES, dtype=dtype), indexing="ij"
    )
    return mean, var


def test_logistic_matches_adaptive_quadrature_at_every_variance():
    mean, var = _grid()
    got = symmetric_response_expectation(torch.sigmoid, mean, var)
    ref = torch.tensor(
        [[logistic_normal_reference(m, v) for v in VARIANCES] for m in MEANS], dtype=torch.float64
    )
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-11)


def test_gauss_hermite_alone_misses_at_large_variance():
    # the reason for the split: 64 Gauss-Hermite nodes are off by more than 1e-3 at s^2 = 100
    mean = torch.tensor([3.0], dtype=torch.float64)
    var = torch.tensor([100.0], dtype=torch.float64)
    ref = logistic_normal_reference(3.0, 100.0)
    assert abs(gauss_hermite_expectation(torch.sigmoid, mean, var).item() - ref) > 1e-3
    assert abs(symmetric_response_expectation(torch.sigmoid, mean, var).item() - ref) < 1e-12


def test_probit_matches_the_exact_formula():
    mean, var = _grid()
    got = symmetric_response_expectation(torch.special.ndtr, mean, var)
    exact = torch.special.ndtr(mean / torch.sqrt(1.0 + var))
    torch.testing.assert_close(got, exact, rtol=0, atol=1e-11)


def test_zero_variance_is_the_response_itself():
    mean = torch.tensor(MEANS, dtype=torch.float64)
    got = symmetric_response_expectation(torch.sigmoid, mean, torch.zeros_like(mean))
    torch.testing.assert_close(got, torch.sigmoid(mean), rtol=0, atol=1e-15)


def test_float32_agrees_with_float64():
    mean, var = _grid()
    ref = symmetric_response_expectation(torch.sigmoid, mean, var)
    got = symmetric_response_expectation(torch.sigmoid, mean.float(), var.float())
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), ref, rtol=0, atol=2e-6)


def test_batch_shapes_broadcast_elementwise():
    gen = torch.Generator().manual_seed(0)
    mean = torch.randn(2, 3, 5, generator=gen, dtype=torch.float64) * 4
    var = torch.rand(2, 3, 5, generator=gen, dtype=torch.float64) * 50
    got = symmetric_response_expectation(torch.sigmoid, mean, var)
    assert got.shape == (2, 3, 5)
    one = symmetric_response_expectation(torch.sigmoid, mean[1, 2, 3:4], var[1, 2, 3:4])
    torch.testing.assert_close(got[1, 2, 3:4], one, rtol=0, atol=1e-15)


@pytest.mark.parametrize("variance", [0.7, 8.0, 300.0])
def test_gradients_match_finite_differences(variance):
    mean = torch.tensor([-2.0, 0.0, 0.4, 5.0], dtype=torch.float64, requires_grad=True)
    var = torch.full((4,), variance, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda m, v: symmetric_response_expectation(torch.sigmoid, m, v), (mean, var)
    )


def test_gradient_is_finite_at_zero_variance():
    mean = torch.tensor([0.5, -1.0], dtype=torch.float64, requires_grad=True)
    var = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    symmetric_response_expectation(torch.sigmoid, mean, var).sum().backward()
    assert torch.isfinite(mean.grad).all() and torch.isfinite(var.grad).all()
    torch.testing.assert_close(mean.grad, torch.sigmoid(mean) * torch.sigmoid(-mean))


def test_which_terms_use_the_split():
    assert BernoulliLogitTerms.symmetric_response
    assert BernoulliProbitTerms.symmetric_response
    assert ContinuousBernoulliTerms.symmetric_response
    bernoulli = gpytorch.likelihoods.BernoulliLikelihood()
    assert AutogradLikelihoodTerms(bernoulli).symmetric_response
    assert not AutogradLikelihoodTerms(bernoulli, response=torch.sigmoid).symmetric_response
    assert AutogradLikelihoodTerms(
        bernoulli, response=torch.special.ndtr, symmetric_response=True
    ).symmetric_response
    # a response that is not symmetric keeps Gauss-Hermite
    terms = AutogradLikelihoodTerms(bernoulli, response=lambda f: torch.sigmoid(f) ** 2)
    mean = torch.tensor([0.5], dtype=torch.float64)
    var = torch.tensor([0.8], dtype=torch.float64)
    torch.testing.assert_close(
        expected_response(terms, mean, var),
        gauss_hermite_expectation(lambda f: torch.sigmoid(f) ** 2, mean, var),
    )


def _far_from_data_problem():
    gen = torch.Generator().manual_seed(3)
    x = torch.rand(30, 1, generator=gen, dtype=torch.float64)
    y = (x.squeeze(-1) > 0.5).double()
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).double()
    kernel.outputscale = 400.0
    kernel.base_kernel.lengthscale = 0.2
    x_test = torch.tensor([[-3.0], [0.45], [0.55], [4.0]], dtype=torch.float64)
    return x, y, kernel, x_test


def _reference_probabilities(mean, var):
    return torch.tensor(
        [logistic_normal_reference(m, v) for m, v in zip(mean.tolist(), var.tolist(), strict=True)],
        dtype=torch.float64,
    )


def test_laplace_classifier_probabilities_far_from_the_data():
    x, y, kernel, x_test = _far_from_data_problem()
    model = LaplaceGPClassifier(x, y, kernel)
    latent = model.predict_latent(x_test)
    mean, var = latent.mean, latent.variance
    assert var.max() > 100  # the regime where Gauss-Hermite alone is off
    ref = _reference_probabilities(mean, var)
    torch.testing.assert_close(model.predict_proba(x_test)[..., 1], ref, rtol=0, atol=1e-10)


def test_distillers_predict_proba_use_the_split():
    x, y, kernel, x_test = _far_from_data_problem()
    for model in (
        DataCentricGPC(x, y, kernel, num_steps=2).fit(),
        DistributionCentricGPC(x, y, kernel, num_steps=2).fit(),
    ):
        latent = model.predict_latent(x_test, step=2)
        mean, var = latent.mean, latent.variance
        ref = _reference_probabilities(mean, var)
        proba = model.predict_proba(x_test, step=2)[..., 1]
        torch.testing.assert_close(proba, ref, rtol=0, atol=1e-10)
