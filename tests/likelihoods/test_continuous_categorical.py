"""The continuous categorical distribution against mpmath, numerical integration over the simplex
and the continuous Bernoulli."""

import cc_reference
import mpmath
import numpy as np
import pytest
import torch
from scipy import stats

from gpsd.likelihoods import ContinuousBernoulli, ContinuousCategorical


def test_log_prob_against_mpmath_at_large_and_close_parameters():
    # dyadic points sum to 1 exactly, so the reference eta.x - A is the density on the simplex
    cases = [
        ([1e4, 1e4 - 1e-6, 1e4 + 3.0], [0.5, 0.25, 0.25]),
        ([-3.0, 0.2, 0.2, 0.2 + 1e-12], [0.125, 0.375, 0.25, 0.25]),
        ([0.0] * 6, [0.0, 0.0, 0.5, 0.5, 0.0, 0.0]),
        ([5.0, -70.0, 12.5, 0.001, -0.001], [0.0625, 0.0625, 0.75, 0.0625, 0.0625]),
    ]
    for eta, x in cases:
        dist = ContinuousCategorical(torch.tensor(eta, dtype=torch.float64))
        value = dist.log_prob(torch.tensor(x, dtype=torch.float64)).item()
        eta_stored = torch.tensor(eta, dtype=torch.float64).tolist()
        with mpmath.workdps(50):
            exact = sum(mpmath.mpf(a) * b for a, b in zip(eta_stored, x, strict=True))
            exact -= cc_reference.log_normalizer(eta_stored)
        # the only rounding before the log-normaliser is eta - max(eta)
        assert abs(value - exact) <= 8e-16 * max(abs(exact), 1.0) + 2e-16 * max(map(abs, eta)), (
            eta,
            value,
            exact,
        )


@pytest.mark.parametrize("eta", [[0.3, -1.2, 2.0], [4.0, 4.0, 4.0], [-9.0, 0.0, 0.5]])
def test_density_integrates_to_one_and_mean_is_its_first_moment(eta):
    # Lebesgue measure on (x_1, x_2), x_3 = 1 - x_1 - x_2: Gauss-Legendre in u and v with
    # x_1 = u, x_2 = (1 - u) v (Jacobian 1 - u); the integrands are entire, 60 nodes are exact
    nodes, weights = np.polynomial.legendre.leggauss(60)
    nodes, weights = torch.tensor((nodes + 1) / 2), torch.tensor(weights / 2)
    u, v = nodes.unsqueeze(-1), nodes.unsqueeze(0)
    x1, x2 = u.expand(60, 60), (1 - u) * v
    x = torch.stack([x1, x2, 1 - x1 - x2], dim=-1)
    w = weights.unsqueeze(-1) * weights.unsqueeze(0) * (1 - u)
    dist = ContinuousCategorical(torch.tensor(eta, dtype=torch.float64))
    density = dist.log_prob(x).exp() * w
    assert abs(density.sum().item() - 1.0) < 1e-13
    torch.testing.assert_close(
        (density.unsqueeze(-1) * x).sum((0, 1)), dist.mean, rtol=1e-13, atol=0
    )


def test_two_categories_are_the_continuous_bernoulli():
    # x = (1 - y, y) with eta = (eta_0, eta_1) has the density of y under the logit eta_1 - eta_0
    eta0 = torch.tensor([0.0, 2.0, -1.0, 300.0, 0.5], dtype=torch.float64)
    f = torch.tensor([0.0, 1e-5, 3.0, -25.0, 1.0], dtype=torch.float64)
    y = torch.tensor([0.5, 0.1, 0.9, 0.01, 1.0], dtype=torch.float64)
    cc = ContinuousCategorical(torch.stack([eta0, eta0 + f], dim=-1))
    cb = ContinuousBernoulli(logits=f)
    torch.testing.assert_close(
        cc.log_prob(torch.stack([1 - y, y], dim=-1)), cb.log_prob(y), rtol=1e-13, atol=1e-13
    )
    torch.testing.assert_close(cc.mean[..., 1], cb.mean, rtol=1e-14, atol=1e-15)
    torch.testing.assert_close(cc.mean[..., 0], 1 - cb.mean, rtol=1e-14, atol=1e-15)


def test_score_is_the_point_minus_the_mean():
    logits = torch.tensor([[0.5, -0.5, 2.0, 2.0], [1e3, 0.0, -1e3, 1e3]], dtype=torch.float64)
    logits.requires_grad_(True)
    x = torch.tensor([[0.25, 0.25, 0.25, 0.25], [0.0, 1.0, 0.0, 0.0]], dtype=torch.float64)
    dist = ContinuousCategorical(logits)
    (grad,) = torch.autograd.grad(dist.log_prob(x).sum(), logits)
    torch.testing.assert_close(grad, x - dist.mean, rtol=1e-12, atol=1e-15)


def test_shapes_and_expand():
    logits = torch.randn(2, 3, 4)
    dist = ContinuousCategorical(logits)
    assert dist.batch_shape == (2, 3) and dist.event_shape == (4,)
    value = torch.full((5, 2, 3, 4), 0.25)
    assert dist.log_prob(value).shape == (5, 2, 3)
    assert dist.log_prob(value).dtype == torch.float32
    assert dist.mean.shape == (2, 3, 4)
    expanded = dist.expand((7, 2, 3))
    assert expanded.log_prob(value[0]).shape == (7, 2, 3)
    torch.testing.assert_close(expanded.mean[4], dist.mean)


def test_rejects_bad_values_and_parameters():
    dist = ContinuousCategorical(torch.zeros(3))
    with pytest.raises(ValueError, match=r"value must have shape \(\.\.\., 3\)"):
        dist.log_prob(torch.tensor([0.5, 0.5]))
    with pytest.raises(ValueError, match="support"):
        dist.log_prob(torch.tensor([0.5, 0.6, 0.1]))
    with pytest.raises(ValueError, match="support"):
        dist.log_prob(torch.tensor([1.5, -0.25, -0.25]))
    with pytest.raises(ValueError, match="logits must have shape"):
        ContinuousCategorical(torch.zeros(4, 1))
    with pytest.raises(ValueError, match="logits must be finite"):
        ContinuousCategorical(torch.tensor([0.0, float("inf")]))


def _standard_errors(samples: torch.Tensor) -> torch.Tensor:
    return samples.std(0) / len(samples) ** 0.5


@pytest.mark.parametrize(
    "eta",
    [
        [0.0, 0.0, 0.0, 0.0],
        [0.0, -0.5, -100.0, -100.0],
        [1.0, 2.0, 3.0, 4.0],
        [1e4, -1e4, 0.0, 5.0],
    ],
)
def test_sample_mean_agrees_with_the_mean(eta):
    torch.manual_seed(5)
    dist = ContinuousCategorical(torch.tensor(eta, dtype=torch.float64))
    samples = dist.sample((20000,))
    assert samples.shape == (20000, 4)
    assert (samples >= 0).all()
    torch.testing.assert_close(samples.sum(-1), torch.ones(20000, dtype=torch.float64))
    error = (samples.mean(0) - dist.mean).abs()
    assert (error <= 5 * _standard_errors(samples) + 1e-12).all(), error


def test_sample_second_moments_agree_with_quadrature():
    # E[x_k x_l] for K = 3 by the Gauss-Legendre rule on the triangle of the density test
    torch.manual_seed(6)
    eta = torch.tensor([0.3, -1.2, 2.0], dtype=torch.float64)
    dist = ContinuousCategorical(eta)
    nodes, weights = np.polynomial.legendre.leggauss(60)
    nodes, weights = torch.tensor((nodes + 1) / 2), torch.tensor(weights / 2)
    u, v = nodes.unsqueeze(-1), nodes.unsqueeze(0)
    x1, x2 = u.expand(60, 60), (1 - u) * v
    x = torch.stack([x1, x2, 1 - x1 - x2], dim=-1)
    w = weights.unsqueeze(-1) * weights.unsqueeze(0) * (1 - u) * dist.log_prob(x).exp()
    exact = torch.einsum("ij,ijk,ijl->kl", w, x, x)
    samples = dist.sample((40000,))
    products = samples.unsqueeze(-1) * samples.unsqueeze(-2)
    error = (products.mean(0) - exact).abs()
    assert (error <= 5 * _standard_errors(products)).all(), error


@pytest.mark.parametrize("f", [0.0, 1e-4, 3.0, -40.0])
def test_samples_of_two_categories_follow_the_continuous_bernoulli(f):
    # Kolmogorov-Smirnov against the continuous Bernoulli's CDF, at a fixed seed
    torch.manual_seed(7)
    logits = torch.tensor([0.25, 0.25 + f], dtype=torch.float64)
    y = ContinuousCategorical(logits).sample((4000,))[:, 1]
    cdf = ContinuousBernoulli(logits=torch.tensor(f, dtype=torch.float64)).cdf
    result = stats.kstest(y.numpy(), lambda z: cdf(torch.as_tensor(z)).numpy())
    assert result.pvalue > 1e-3


def test_sample_shapes_and_dtype():
    torch.manual_seed(8)
    dist = ContinuousCategorical(torch.randn(2, 3, 5))
    samples = dist.sample((4, 6))
    assert samples.shape == (4, 6, 2, 3, 5) and samples.dtype == torch.float32
    assert dist.support.check(samples).all()
    assert dist.sample().shape == (2, 3, 5)
