"""ContinuousCategoricalTerms: the gradient (minus the mean) and the Hessian blocks (minus the
covariance) against mpmath divided differences and autograd, the continuous Bernoulli at K = 2,
float32, and the checks of the soft targets."""

from __future__ import annotations

import cc_reference
import mpmath
import pytest
import torch

from gpsd.laplace import ContinuousBernoulliTerms, ContinuousCategoricalTerms

DT = torch.float64


def _reference_moments(eta):
    """Mean and covariance of the continuous categorical in mpmath: the derivatives of
    exp[eta] in its nodes are divided differences with the node repeated, so
    E[x_j x_k] = (1 + [j = k]) exp[eta, eta_j, eta_k] / exp[eta]."""
    K = len(eta)
    with mpmath.workdps(40):
        base = cc_reference.log_normalizer(eta, 40)
        mean = [mpmath.exp(cc_reference.log_normalizer([*eta, e], 40) - base) for e in eta]
        covariance = [[None] * K for _ in range(K)]
        for j in range(K):
            for k in range(K):
                second = mpmath.exp(cc_reference.log_normalizer([*eta, eta[j], eta[k]], 40) - base)
                covariance[j][k] = float((2 if j == k else 1) * second - mean[j] * mean[k])
        return [float(m) for m in mean], covariance


@pytest.mark.parametrize(
    "eta",
    [
        [0.3, -1.2, 0.8],
        [0.0, 1e-9, -1e-9],
        [2.0, 2.0, -3.0, 0.5],
        [40.0, -25.0, 3.0],
        [0.0, 0.0, 0.0],
    ],
)
def test_gradient_and_hessian_are_the_moments_of_the_distribution(eta):
    terms = ContinuousCategoricalTerms()
    F = torch.tensor([eta], dtype=DT)
    Y = torch.full_like(F, 1.0 / len(eta))
    gradient, hessian = terms.derivatives(Y, F)
    mean, covariance = _reference_moments(eta)
    torch.testing.assert_close(Y[0] - gradient[0], torch.tensor(mean, dtype=DT), rtol=0, atol=1e-14)
    torch.testing.assert_close(
        terms.response(F)[0], torch.tensor(mean, dtype=DT), rtol=0, atol=1e-14
    )
    scale = max(abs(c) for row in covariance for c in row)
    torch.testing.assert_close(
        -hessian[0], torch.tensor(covariance, dtype=DT), rtol=0, atol=1e-12 * scale
    )
    torch.testing.assert_close(hessian[0], hessian[0].T, rtol=0, atol=0)


def test_hessian_blocks_match_autograd_of_log_prob():
    gen = torch.Generator().manual_seed(0)
    F = 2.0 * torch.randn(4, 3, generator=gen, dtype=DT)
    Y = torch.softmax(torch.randn(4, 3, generator=gen, dtype=DT), -1)
    terms = ContinuousCategoricalTerms()
    _, hessian = terms.derivatives(Y, F)
    for i in range(4):
        expected = torch.autograd.functional.hessian(lambda f, i=i: terms.log_prob(Y[i], f), F[i])
        torch.testing.assert_close(hessian[i], expected, rtol=0, atol=1e-12)


def test_hessian_is_differentiable_in_the_latents():
    # the evidence gradient needs the third derivative: autograd of the Hessian against
    # central differences of the Hessian
    F = torch.tensor([[0.4, -0.7, 1.1]], dtype=DT)
    Y = torch.tensor([[0.2, 0.3, 0.5]], dtype=DT)
    weights = torch.tensor([[1.0, 0.5, -0.3], [0.5, 2.0, 0.1], [-0.3, 0.1, 0.7]], dtype=DT)
    terms = ContinuousCategoricalTerms()

    def weighted(F):
        return (terms.derivatives(Y, F)[1] * weights).sum()

    moving = F.clone().requires_grad_(True)
    (gradient,) = torch.autograd.grad(weighted(moving), moving)
    h = 1e-5
    for k in range(3):
        step = torch.zeros_like(F)
        step[0, k] = h
        fd = (weighted(F + step) - weighted(F - step)) / (2 * h)
        assert abs(gradient[0, k].item() - fd.item()) < 1e-8


def test_two_classes_reduce_to_the_continuous_bernoulli_on_the_difference():
    F = torch.tensor(
        [[0.0, 0.0], [0.3, -0.2], [1e-7, 0.0], [4.0, -3.0], [-30.0, 20.0], [2.4, 0.0]], dtype=DT
    )
    Y = torch.tensor(
        [[0.5, 0.5], [0.1, 0.9], [0.7, 0.3], [0.0, 1.0], [1.0, 0.0], [0.4, 0.6]], dtype=DT
    )
    terms, binary = ContinuousCategoricalTerms(), ContinuousBernoulliTerms()
    difference = F[:, 1] - F[:, 0]
    torch.testing.assert_close(terms.log_prob(Y, F), binary.log_prob(Y[:, 1], difference))
    gradient, hessian = terms.derivatives(Y, F)
    d1, d2 = binary.derivatives(Y[:, 1], difference)
    torch.testing.assert_close(gradient, torch.stack([-d1, d1], -1), rtol=0, atol=1e-14)
    sign = torch.tensor([[1.0, -1.0], [-1.0, 1.0]], dtype=DT)
    torch.testing.assert_close(hessian, d2[:, None, None] * sign, rtol=0, atol=1e-14)


def test_float32_latents_give_float32_derivatives_close_to_float64():
    F = torch.tensor([[0.3, -1.2, 0.8, 0.0], [5.0, 5.0, -5.0, 1.0]], dtype=DT)
    Y = torch.full_like(F, 0.25)
    terms = ContinuousCategoricalTerms()
    double = terms.derivatives(Y, F)
    single = terms.derivatives(Y.float(), F.float())
    for got, expected in zip(single, double, strict=True):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), expected, rtol=0, atol=1e-7)
    assert terms.log_prob(Y.float(), F.float()).dtype == torch.float32


def test_soft_targets_are_checked():
    terms = ContinuousCategoricalTerms()
    with pytest.raises(ValueError, match=r"y must hold soft targets of shape \(\*batch, n, K\)"):
        terms.targets(torch.tensor([0.2, 0.8], dtype=DT), name="y")
    with pytest.raises(ValueError, match="negative values"):
        terms.targets(torch.tensor([[1.1, -0.1]], dtype=DT))
    with pytest.raises(ValueError, match="summing to 0.9"):
        terms.targets(torch.tensor([[0.4, 0.5]], dtype=DT))
    with pytest.raises(ValueError, match="must be finite"):
        terms.targets(torch.tensor([[float("nan"), 0.5]], dtype=DT))
    with pytest.raises(ValueError, match="has 2 classes .* prior covariances have 3"):
        terms.targets(torch.tensor([[0.5, 0.5]], dtype=DT), num_classes=3)
    Y = torch.tensor([[0.2, 0.3, 0.5]], dtype=DT)
    assert torch.equal(terms.targets(Y, num_classes=3), Y)
