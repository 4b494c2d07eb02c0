"""The Laplace predictive functions: laplace_latent_predictive against dense formulas (batched
modes, diagonals), and class probabilities E[r(f)], f ~ N(mu, s^2), at every latent variance
(the Gauss-Laguerre split of symmetric_response_expectation against adaptive quadrature, the
exact probit formula, closed forms), with gradients and through the classifiers' predict_proba."""

from __future__ import annotations

import functools
import math

import gpytorch
import pytest
import torch
from scipy import integrate, special

from gpsd import LaplaceGPClassifier
from gpsd.data.toy import sine_classification
from gpsd.distillation import DataCentricGPC, DistributionCentricGPC
from gpsd.laplace import (
    AutogradLikelihoodTerms,
    BernoulliLogitTerms,
    BernoulliProbitTerms,
    ContinuousBernoulliTerms,
    closed_form_probability,
    expected_response,
    find_laplace_mode,
    gauss_hermite_expectation,
    laplace_latent_predictive,
    probit_approximation,
    resolve_likelihood_terms,
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


DT = torch.float64


def _problem(batch: int, m: int):
    x, y, test_x = sine_classification(20, seed=1)
    kernel = gpytorch.kernels.RBFKernel().to(DT)
    kernel.lengthscale = torch.tensor(0.6, dtype=DT)
    with torch.no_grad():
        K = kernel(x).to_dense()
        K_cross = kernel(test_x[:m], x).to_dense()
        K_test = kernel(test_x[:m]).to_dense()
    # a batch of label sets: y, its flip, then shifted copies
    ys = torch.stack([torch.roll(y, i) if i % 2 == 0 else 1 - y for i in range(batch)])
    mode = find_laplace_mode(K, ys, resolve_likelihood_terms("logit"))
    return K, K_cross, K_test, mode


def _dense(K, K_cross, K_test, alpha, W):
    mean = K_cross @ alpha
    cov = K_test - K_cross @ torch.linalg.solve(K + torch.diag(1.0 / W), K_cross.T)
    return mean, cov


@pytest.mark.parametrize(("batch", "m"), [(3, 5), (4, 7)])
def test_batched_modes_with_one_test_set(batch, m):
    # a (batch, m) diagonal next to an unbatched (m, n) K_cross has as many dimensions as K_cross
    # and must not be taken for a full matrix
    K, K_cross, K_test, mode = _problem(batch, m)
    diag = torch.diagonal(K_test).expand(batch, m)
    mean, var = laplace_latent_predictive(mode, K_cross, diag)
    _, cov = laplace_latent_predictive(mode, K_cross, K_test.expand(batch, m, m))
    assert var.shape == (batch, m) and cov.shape == (batch, m, m)
    for i in range(batch):
        ref_mean, ref_cov = _dense(K, K_cross, K_test, mode.alpha[i], mode.W[i])
        torch.testing.assert_close(mean[i], ref_mean, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(cov[i], ref_cov, rtol=1e-9, atol=1e-11)
        torch.testing.assert_close(var[i], torch.diagonal(ref_cov), rtol=1e-9, atol=1e-11)


def test_explicit_diag_settles_a_batch_of_m_diagonals():
    batch = m = 4
    K, K_cross, K_test, mode = _problem(batch, m)
    diag = torch.diagonal(K_test).expand(batch, m)
    _, var = laplace_latent_predictive(mode, K_cross, diag, diag=True)
    for i in range(batch):
        _, ref_cov = _dense(K, K_cross, K_test, mode.alpha[i], mode.W[i])
        torch.testing.assert_close(var[i], torch.diagonal(ref_cov), rtol=1e-9, atol=1e-11)


def test_a_k_test_of_the_wrong_size_is_named():
    K, K_cross, K_test, mode = _problem(2, 5)
    with pytest.raises(ValueError, match=r"K_test must end in shape \(5,\).*got shape \(2, 6\)"):
        laplace_latent_predictive(mode, K_cross, torch.ones(2, 6, dtype=DT))
    with pytest.raises(ValueError, match=r"K_test must end in shape \(5, 5\)"):
        laplace_latent_predictive(mode, K_cross, torch.ones(5, 6, dtype=DT), diag=False)


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


MEAN = torch.tensor([1.0, -0.5], dtype=DT)


FUNCTIONS = {
    "probit_approximation": lambda v: probit_approximation(MEAN, v),
    "closed_form_probability": lambda v: closed_form_probability(BernoulliProbitTerms(), MEAN, v),
    "expected_response": lambda v: expected_response(BernoulliLogitTerms(), MEAN, v),
    "gauss_hermite_expectation": lambda v: gauss_hermite_expectation(torch.sigmoid, MEAN, v),
}


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_a_negative_variance_beyond_rounding_is_refused(name):
    with pytest.raises(ValueError, match="variance must hold latent variances >= 0"):
        FUNCTIONS[name](torch.tensor([0.3, -10.0], dtype=DT))


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_a_rounding_negative_variance_counts_as_zero(name):
    got = FUNCTIONS[name](torch.tensor([0.3, -1e-13], dtype=DT))
    expected = FUNCTIONS[name](torch.tensor([0.3, 0.0], dtype=DT))
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    # at zero variance every rule is the response at the mean
    response = torch.special.ndtr if name == "closed_form_probability" else torch.sigmoid
    torch.testing.assert_close(got[1], response(MEAN[1]), rtol=1e-12, atol=1e-12)


def test_variances_are_not_branched_on_under_vmap():
    variances = torch.tensor([[0.1, 1.0, 4.0], [0.0, 2.0, 9.0]], dtype=DT)
    means = torch.tensor([[0.5, -1.0, 2.0], [0.0, 1.0, -3.0]], dtype=DT)
    got = torch.func.vmap(probit_approximation)(means, variances)
    # MacKay's formula, written out
    expected = torch.sigmoid(means / torch.sqrt(1 + math.pi * variances / 8))
    torch.testing.assert_close(got, expected, rtol=1e-14, atol=1e-15)


def test_multiclass_expectation_of_a_lognormal_matches_its_closed_form():
    # E[exp(f_1)] = exp(mu_1 + Sigma_11 / 2) for f ~ N(mu, Sigma)
    from gpsd.laplace import multiclass_expectation

    mean = torch.tensor([[0.3, -0.2, 0.1], [-0.5, 0.4, 0.0]], dtype=torch.float64)
    a = torch.tensor([[1.0, 0.3, 0.0], [0.3, 0.8, 0.2], [0.0, 0.2, 0.5]], dtype=torch.float64)
    covariance = torch.stack([a @ a.T, 0.5 * a @ a.T])
    got = multiclass_expectation(torch.exp, mean, covariance, num_samples=200_000)
    want = torch.exp(mean + torch.diagonal(covariance, dim1=-2, dim2=-1) / 2)
    torch.testing.assert_close(got, want, rtol=1e-2, atol=0)


def test_multiclass_expectation_of_a_point_does_not_depend_on_the_others():
    from gpsd.laplace import multiclass_expectation

    gen = torch.Generator().manual_seed(3)
    mean = torch.randn(5, 4, generator=gen, dtype=torch.float64)
    root = torch.randn(5, 4, 4, generator=gen, dtype=torch.float64)
    covariance = root @ root.mT
    softmax = functools.partial(torch.softmax, dim=-1)
    every = multiclass_expectation(softmax, mean, covariance, num_samples=512)
    order = torch.tensor([3, 0, 4])
    some = multiclass_expectation(softmax, mean[order], covariance[order], num_samples=512)
    torch.testing.assert_close(some, every[order], rtol=0, atol=1e-14)
    torch.testing.assert_close(every.sum(-1), torch.ones(5, dtype=torch.float64))
    with pytest.raises(TypeError, match="generator"):
        multiclass_expectation(softmax, mean, covariance, generator=0)
