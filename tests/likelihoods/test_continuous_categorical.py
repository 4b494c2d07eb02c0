"""The continuous categorical distribution against mpmath, numerical integration over the simplex
and the continuous Bernoulli."""

import cc_reference
import mpmath
import numpy as np
import pytest
import torch

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
