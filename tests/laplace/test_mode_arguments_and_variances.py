"""The public Laplace functions check their arguments as the classifiers do: labels outside the
likelihood's support, targets of another shape and negative variances used to give a mode or a
probability silently, and mismatched shapes failed inside torch."""

import math

import pytest
import torch
from linear_operator.operators import DenseLinearOperator

from gpsd.laplace import (
    BernoulliLogitTerms,
    BernoulliProbitTerms,
    ContinuousBernoulliTerms,
    closed_form_probability,
    expected_response,
    find_laplace_mode,
    gauss_hermite_expectation,
    probit_approximation,
)

DT = torch.float64
K = torch.eye(4, dtype=DT) + 0.5
Y = torch.tensor([0.0, 1.0, 1.0, 0.0], dtype=DT)


@pytest.mark.parametrize(
    "y, terms, message",
    [
        (2 * Y - 1, BernoulliLogitTerms(), r"y must hold binary labels in \{0, 1\}"),
        (1.5 * Y, ContinuousBernoulliTerms(), r"y must hold soft targets in \[0, 1\]"),
        (Y.unsqueeze(-1), BernoulliLogitTerms(), r"y must have 4 entries .* \(4, 1\)"),
        (Y[:3], BernoulliLogitTerms(), "y must have 4 entries"),
    ],
)
def test_targets_outside_the_support_or_of_another_shape_are_refused(y, terms, message):
    with pytest.raises(ValueError, match=message):
        find_laplace_mode(K, y, terms)


def test_soft_targets_under_a_bernoulli_likelihood_need_check_targets_false():
    soft = torch.tensor([0.1, 0.8, 0.6, 0.3], dtype=DT)
    with pytest.raises(ValueError, match="binary labels"):
        find_laplace_mode(K, soft, BernoulliLogitTerms())
    mode = find_laplace_mode(K, soft, BernoulliLogitTerms(), check_targets=False)
    # at the mode, K^{-1} f = d/df log p(y|f) = y - sigmoid(f) (the cross-entropy's gradient)
    torch.testing.assert_close(
        torch.linalg.solve(K, mode.f), soft - torch.sigmoid(mode.f), rtol=1e-10, atol=1e-12
    )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(K=K[:3]), r"K must be a tensor of shape \(\*batch, n, n\), got \(3, 4\)"),
        (dict(init_f=torch.zeros(5, dtype=DT)), r"init_f must have shape \(\*batch, 4\)"),
        (dict(prior_mean=torch.zeros(3, dtype=DT)), r"prior_mean must have shape \(\*batch, 4\)"),
        (dict(prior_mean=torch.full((4,), math.nan, dtype=DT)), "prior_mean must be finite"),
    ],
)
def test_mismatched_arguments_are_named(kwargs, message):
    args = dict(K=K, y=Y, terms=BernoulliLogitTerms()) | kwargs
    with pytest.raises(ValueError, match=message):
        find_laplace_mode(**args)


def test_float32_targets_a_terms_name_and_a_scalar_prior_mean_are_taken():
    reference = find_laplace_mode(
        K, Y, BernoulliLogitTerms(), prior_mean=torch.full((4,), 0.5, dtype=DT)
    )
    for y, terms, mean in [
        (Y.float(), BernoulliLogitTerms(), torch.tensor(0.5, dtype=DT)),
        (Y, "bernoulli_logit", torch.full((4,), 0.5, dtype=DT)),
    ]:
        mode = find_laplace_mode(K, y, terms, prior_mean=mean)
        assert mode.f.dtype == DT
        torch.testing.assert_close(mode.f, reference.f, rtol=1e-12, atol=1e-12)


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


def test_prior_means_that_broadcast_and_a_kernel_operator_are_taken():
    y2 = torch.stack([Y, 1 - Y])  # shape: (2, 4)
    reference = find_laplace_mode(
        K, y2, BernoulliLogitTerms(), prior_mean=torch.tensor([[0.5] * 4, [-0.3] * 4], dtype=DT)
    )
    mode = find_laplace_mode(
        K, y2, BernoulliLogitTerms(), prior_mean=torch.tensor([[0.5], [-0.3]], dtype=DT)
    )
    torch.testing.assert_close(mode.f, reference.f, rtol=1e-12, atol=1e-12)
    single = find_laplace_mode(
        K, Y, BernoulliLogitTerms(), prior_mean=torch.tensor([0.5], dtype=DT)
    )
    torch.testing.assert_close(single.f, reference.f[0], rtol=1e-12, atol=1e-12)
    as_operator = find_laplace_mode(DenseLinearOperator(K), Y, BernoulliLogitTerms())
    torch.testing.assert_close(
        as_operator.f, find_laplace_mode(K, Y, BernoulliLogitTerms()).f, rtol=0, atol=0
    )


def test_variances_are_not_branched_on_under_vmap():
    variances = torch.tensor([[0.1, 1.0, 4.0], [0.0, 2.0, 9.0]], dtype=DT)
    means = torch.tensor([[0.5, -1.0, 2.0], [0.0, 1.0, -3.0]], dtype=DT)
    got = torch.func.vmap(probit_approximation)(means, variances)
    # MacKay's formula, written out
    expected = torch.sigmoid(means / torch.sqrt(1 + math.pi * variances / 8))
    torch.testing.assert_close(got, expected, rtol=1e-14, atol=1e-15)
