"""ContinuousBernoulliLikelihood's expectations at every latent variance, against mpmath.

Plain Gauss-Hermite quadrature (GPyTorch's rule, which this likelihood used before) misses the
unit-width bend of the log-normaliser at f = 0 once the latent standard deviation is large: the
last test shows it off by more than 1e-3 at variance 100 and the likelihood within 1e-11.
"""

import functools

import gpytorch
import pytest
import torch
from cb_reference import cb_gaussian_expectations
from conftest import requires_cuda
from gpytorch.likelihoods.likelihood import _OneDimensionalLikelihood

from gpsd.likelihoods import ContinuousBernoulliLikelihood, cb_log_density

# (y, mean, variance), all exact in float32: both Gauss-Hermite regimes, the split rules of
# expected_log_prob (|mean| < 7 s) and of log_marginal (tilt y + mean / variance in [-2.5, 3.5]),
# the mode-centred rule of log_marginal beyond, and extremes of variance and mean
POINTS = [
    (0.25, -1.0, 0.5),
    (0.125, 0.5, 2.125),
    (0.0, 2.0, 2.875),
    (0.75, 0.0, 3.5),
    (0.5, 0.25, 10.0),
    (1.0, -3.0, 100.0),
    (0.0625, 25.0, 100.0),
    (0.9375, -30.0, 1e3),
    (0.5, 0.0, 1e4),
    (0.0, 70.0, 100.0),
    (0.0625, 400.0, 100.0),
    (1.0, -300.0, 100.0),
    (1.0, 1e3, 10.0),
    (0.6875, 0.0, 1e10),
    (0.25, 1e5, 1e9),
    (0.0, -7.5e7, 3.0),
]
FIELDS = (
    "expected_log_prob",
    "log_marginal",
    "expected_log_prob_dmean",
    "expected_log_prob_dvariance",
    "log_marginal_dmean",
    "log_marginal_dvariance",
)


@functools.cache
def _references() -> torch.Tensor:
    """mpmath values at the points, shape ``(len(POINTS), 6)``."""
    assert torch.tensor(POINTS, dtype=torch.float32).double().tolist() == [list(p) for p in POINTS]
    return torch.tensor([cb_gaussian_expectations(*p) for p in POINTS], dtype=torch.float64)


def _ours(dtype: torch.dtype) -> torch.Tensor:
    y, mean, variance = torch.tensor(POINTS, dtype=dtype).unbind(-1)
    mean.requires_grad_(True)
    variance.requires_grad_(True)
    likelihood = ContinuousBernoulliLikelihood()
    dist = torch.distributions.Normal(mean, variance.sqrt())
    elp = likelihood.expected_log_prob(y, dist)
    elp_grads = torch.autograd.grad(elp.sum(), (mean, variance))
    dist = torch.distributions.Normal(mean, variance.sqrt())
    lm = likelihood.log_marginal(y, dist)
    lm_grads = torch.autograd.grad(lm.sum(), (mean, variance))
    assert elp.dtype == lm.dtype == dtype
    return torch.stack([elp, lm, *elp_grads, *lm_grads], dim=-1).detach().double()


@pytest.mark.parametrize(
    "dtype,value_tol,grad_tol", [(torch.float64, 2e-12, 1e-11), (torch.float32, 2e-6, 5e-5)]
)
def test_values_and_gradients_match_mpmath(dtype, value_tol, grad_tol):
    ref = _references()
    got = _ours(dtype)
    error = (got - ref).abs() / ref.abs().clamp_min(1.0)
    tolerances = [value_tol] * 2 + [grad_tol] * 4
    for k, (name, tol) in enumerate(zip(FIELDS, tolerances, strict=True)):
        worst = int(error[:, k].argmax())
        assert error[worst, k] <= tol, (
            f"{name} off by {error[worst, k]:.2e} at (y, mean, variance) = {POINTS[worst]}: "
            f"{got[worst, k]} vs {ref[worst, k]}"
        )


def test_gradients_match_finite_differences():
    # the analytic derivative of log g (and its continued fraction) against central differences
    y, mean, variance = torch.tensor(POINTS[:13], dtype=torch.float64).unbind(-1)
    likelihood = ContinuousBernoulliLikelihood()
    for method in (likelihood.expected_log_prob, likelihood.log_marginal):

        def fn(m, v, method=method):
            return method(y, torch.distributions.Normal(m, v.sqrt()))

        assert torch.autograd.gradcheck(
            fn, (mean.clone().requires_grad_(), variance.clone().requires_grad_()), atol=1e-6
        )


@pytest.mark.parametrize(
    "where",
    [
        "variance 3 (expected_log_prob rule)",
        "variance 2 (log_marginal rule)",
        "|mean| = 7 s",
        "tilt -2.5",
        "tilt 3.5",
    ],
)
def test_continuous_across_regime_boundaries(where):
    rows = []
    for y in (0.0, 0.4, 1.0):
        for base in (-2.0, 0.0, 1.5, 5.0):
            mean, variance = base, 2.0 if where.startswith("variance 2") else 3.0
            if where == "|mean| = 7 s":
                variance = 4.0 + base**2
                mean = 7.0 * variance**0.5
            elif where.startswith("tilt"):
                variance = 5.0 + base**2
                mean = (float(where.split()[1]) - y) * variance
            rows.append((y, mean, variance))
    y, mean, variance = torch.tensor(rows, dtype=torch.float64).unbind(-1)
    # one side of the boundary and the other, 1e-9 relative apart
    moved = variance if where.startswith("variance") else mean
    sides = [moved * (1 - 1e-9), moved * (1 + 1e-9)]
    likelihood = ContinuousBernoulliLikelihood()
    for method in (likelihood.expected_log_prob, likelihood.log_marginal):
        values, slopes = [], []
        for side in sides:
            side = side.clone().requires_grad_(True)
            m, v = (mean, side) if where.startswith("variance") else (side, variance)
            value = method(y, torch.distributions.Normal(m, v.sqrt()))
            (slope,) = torch.autograd.grad(value.sum(), side)
            values.append(value.detach())
            slopes.append(slope)
        # the change predicted by the trapezoid rule on the slopes is exact to O(1e-18); a switch
        # of rule at the boundary shows as the difference of the two rules' errors
        predicted = 0.5 * (slopes[0] + slopes[1]) * (sides[1] - sides[0])
        torch.testing.assert_close(values[1] - values[0], predicted, rtol=0, atol=1e-11)


def test_batched_multivariate_normal_with_broadcast_targets():
    generator = torch.Generator().manual_seed(3)
    mean = 10 * torch.randn(2, 3, 5, generator=generator, dtype=torch.float64)
    variance = torch.exp(6 * torch.rand(2, 3, 5, generator=generator, dtype=torch.float64))
    y = torch.rand(5, generator=generator, dtype=torch.float64)
    mvn = gpytorch.distributions.MultivariateNormal(mean, torch.diag_embed(variance))
    likelihood = ContinuousBernoulliLikelihood()
    for method in (likelihood.expected_log_prob, likelihood.log_marginal):
        got = method(y, mvn)
        assert got.shape == (2, 3, 5)
        for index in ((0, 0), (1, 2)):
            one = gpytorch.distributions.MultivariateNormal(
                mean[index], torch.diag(variance[index])
            )
            torch.testing.assert_close(got[index], method(y, one), rtol=1e-14, atol=1e-14)


def test_targets_outside_the_support_raise():
    likelihood = ContinuousBernoulliLikelihood()
    dist = torch.distributions.Normal(torch.zeros(3), 10 * torch.ones(3))
    with pytest.raises(ValueError, match="support"):
        likelihood.expected_log_prob(torch.tensor([0.2, 1.5, 0.3]), dist)
    with pytest.raises(ValueError, match="support"):
        likelihood.log_marginal(torch.tensor([-0.1, 0.5, 0.3]), dist)


def test_log_density_is_exact_at_large_logits_in_float32_and_differentiable_at_zero():
    f = torch.tensor([-3e3, -1e3, 1e3, 3e3])
    y = torch.tensor([0.3, 0.7, 0.3, 0.7])
    f64, y64 = f.double(), y.double()
    # y f - A(f) with A(f) = max(f, 0) + log(1 - e^{-|f|}) - log|f| in float64
    exact = y64 * f64 - (f64.clamp_min(0) + torch.log(-torch.expm1(-f64.abs())) - f64.abs().log())
    # y f - A(f) in float32 lost 1e-4 here (A(f) ~ f rounds to 6e-5 at 1e3)
    torch.testing.assert_close(cb_log_density(y, f).double(), exact, rtol=2e-7, atol=1e-6)
    # d/df log p = y - A'(f) and A'(0) = 1/2; the |f| of the stable form has no slope at 0
    zero = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([0.0, 0.3, 1.0], dtype=torch.float64)
    cb_log_density(targets, zero).sum().backward()
    torch.testing.assert_close(zero.grad, targets - 0.5, rtol=0, atol=1e-15)


def test_plain_gauss_hermite_was_wrong_at_large_variance():
    y, mean, variance = torch.tensor([(0.5, 0.25, 100.0)], dtype=torch.float64).unbind(-1)
    ref = cb_gaussian_expectations(0.5, 0.25, 100.0)
    likelihood = ContinuousBernoulliLikelihood().double()  # GPyTorch's nodes in float64
    dist = torch.distributions.Normal(mean, variance.sqrt())
    plain = _OneDimensionalLikelihood.expected_log_prob(likelihood, y, dist)
    ours = likelihood.expected_log_prob(y, dist)
    assert abs(plain.item() - ref.expected_log_prob) > 1e-3
    assert abs(ours.item() - ref.expected_log_prob) < 1e-11


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cuda_matches_cpu(dtype):
    y, mean, variance = torch.tensor(POINTS, dtype=dtype).unbind(-1)
    likelihood = ContinuousBernoulliLikelihood()
    for method in (likelihood.expected_log_prob, likelihood.log_marginal):
        cpu = method(y, torch.distributions.Normal(mean, variance.sqrt()))
        cuda = method(y.cuda(), torch.distributions.Normal(mean.cuda(), variance.sqrt().cuda()))
        assert cuda.device.type == "cuda"
        tol = 1e-12 if dtype == torch.float64 else 1e-5
        torch.testing.assert_close(cuda.cpu(), cpu, rtol=tol, atol=tol)
