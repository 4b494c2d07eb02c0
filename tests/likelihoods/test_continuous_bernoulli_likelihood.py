"""ContinuousBernoulli distribution and ContinuousBernoulliLikelihood."""

import math
import unittest

import cb_reference
import gpytorch
import pytest
import torch
from cb_reference import cb_gaussian_expectations
from conftest import requires_cuda
from gpytorch.test.base_likelihood_test_case import BaseLikelihoodTestCase
from scipy import integrate

from gpsd.likelihoods import ContinuousBernoulli, ContinuousBernoulliLikelihood


class TestContinuousBernoulliLikelihoodGPyTorchSuite(BaseLikelihoodTestCase, unittest.TestCase):
    """GPyTorch's own likelihood test suite, adapted as GPyTorch does for BetaLikelihood."""

    seed = 1

    def _create_targets(self, batch_shape=torch.Size()):  # noqa: B008 (as in GPyTorch)
        return torch.sigmoid(torch.randn(*batch_shape, 5)).float()

    def create_likelihood(self):
        return ContinuousBernoulliLikelihood()

    # The continuous-Bernoulli log-density is close to 0 for many (target, latent) pairs, so the
    # suite's comparison with 512 Monte-Carlo samples at rtol=0.25 is dominated by Monte-Carlo noise.
    # Same comparisons (quadrature vs GPyTorch's default sampling implementation) with 40000 samples.
    def _compare_with_default(self, method: str, batch_shape):
        likelihood = self.create_likelihood()
        likelihood.max_plate_nesting += len(batch_shape)
        function_dist = self._create_marginal_input(batch_shape)
        target = self._create_targets(batch_shape)
        output = getattr(likelihood, method)(target, function_dist)
        self.assertTrue(torch.is_tensor(output))
        self.assertEqual(output.shape, batch_shape + torch.Size([5]))
        with gpytorch.settings.num_likelihood_samples(40000):
            default = getattr(gpytorch.likelihoods.Likelihood, method)(
                likelihood, target, function_dist
            )
        self.assertAllClose(output, default, rtol=0.05, atol=0.01)

    def _test_log_marginal(self, batch_shape):
        self._compare_with_default("log_marginal", batch_shape)

    def _test_log_prob(self, batch_shape):
        self._compare_with_default("expected_log_prob", batch_shape)

    # The marginal is a batch of conditionals over latent samples (as for GPyTorch's Beta, whose
    # suite run fails the same shape check in this GPyTorch version): compare sample-averaged means.
    def _test_marginal(self, batch_shape):
        likelihood = self.create_likelihood()
        likelihood.max_plate_nesting += len(batch_shape)
        function_dist = self._create_marginal_input(batch_shape)
        with gpytorch.settings.num_likelihood_samples(20000):
            output = likelihood(function_dist)
            default = gpytorch.likelihoods.Likelihood.marginal(likelihood, function_dist)
        self.assertIsInstance(output, torch.distributions.Distribution)
        self.assertEqual(output.sample().shape[-len(batch_shape) - 1 :], batch_shape + (5,))
        self.assertAllClose(output.mean.mean(0), default.mean.mean(0), rtol=0.05, atol=0.02)


@pytest.mark.parametrize("f", [-300.0, -20.0, -2.0, -1e-7, 0.0, 1e-5, 0.7, 5.0, 40.0, 300.0])
def test_density_integrates_to_one_and_moments(f):
    dist = ContinuousBernoulli(torch.tensor(f, dtype=torch.float64))

    def density(y):
        return math.exp(dist.log_prob(torch.tensor(y, dtype=torch.float64)).item())

    points = [1e-3, 1 - 1e-3] if abs(f) > 50 else None
    mass = integrate.quad(density, 0, 1, points=points, epsabs=1e-13, epsrel=1e-11, limit=200)[0]
    first = integrate.quad(lambda y: y * density(y), 0, 1, points=points, epsabs=1e-13, limit=200)[
        0
    ]
    second = integrate.quad(
        lambda y: y * y * density(y), 0, 1, points=points, epsabs=1e-13, limit=200
    )[0]
    assert mass == pytest.approx(1.0, rel=1e-8)
    assert dist.mean.item() == pytest.approx(first, rel=1e-7, abs=1e-12)
    assert dist.variance.item() == pytest.approx(second - first**2, rel=1e-6, abs=1e-12)

    def neg_plogp(y):
        lp = dist.log_prob(torch.tensor(y, dtype=torch.float64)).item()
        return -math.exp(lp) * lp

    entropy = integrate.quad(neg_plogp, 0, 1, points=points, epsabs=1e-12, limit=200)[0]
    assert dist.entropy().item() == pytest.approx(entropy, rel=1e-6, abs=1e-9)


def test_matches_torch_distribution_where_torch_is_accurate():
    logits = torch.linspace(-8, 8, 33, dtype=torch.float64)
    y = torch.rand(33, dtype=torch.float64)
    ours = ContinuousBernoulli(logits)
    ref = torch.distributions.ContinuousBernoulli(logits=logits, lims=(0.4999, 0.5001))
    torch.testing.assert_close(ours.log_prob(y), ref.log_prob(y), rtol=1e-8, atol=1e-8)
    torch.testing.assert_close(ours.mean, ref.mean, rtol=1e-8, atol=1e-8)


def test_cdf_icdf_and_sampling():
    logits = torch.tensor([-200.0, -10.0, -0.5, 0.0, 1e-8, 2.0, 30.0, 200.0], dtype=torch.float64)
    dist = ContinuousBernoulli(logits)
    u = torch.tensor([0.05, 0.3, 0.5, 0.77, 0.95], dtype=torch.float64).unsqueeze(-1)
    y = dist.icdf(u)
    torch.testing.assert_close(dist.cdf(y), u.expand_as(y), rtol=1e-9, atol=1e-12)
    samples = dist.sample(torch.Size([40000]))
    assert samples.shape == (40000, 8)
    assert ((samples >= 0) & (samples <= 1)).all()
    se = (dist.variance / 40000).sqrt()
    assert ((samples.mean(0) - dist.mean).abs() < 5 * se + 1e-12).all()


def test_rsample_is_differentiable():
    logits = torch.tensor([-3.0, 0.5, 4.0], dtype=torch.float64, requires_grad=True)
    torch.manual_seed(3)
    y = ContinuousBernoulli(logits).rsample(torch.Size([50000]))
    y.mean(0).sum().backward()
    # d mean / d f = A''(f) = variance, by the reparameterisation gradient
    expected = ContinuousBernoulli(logits.detach()).variance
    torch.testing.assert_close(logits.grad, expected, rtol=0.05, atol=2e-3)


def test_float32_large_logits_are_exact_where_torch_is_not():
    f = torch.tensor([-30.0, -20.0, 20.0, 30.0])
    y = torch.tensor([0.5, 0.5, 0.5, 0.5])
    ours = ContinuousBernoulli(f).log_prob(y).double()
    f64 = f.double()
    exact = y.double() * f64 - (
        f64.clamp_min(0) + torch.log(-torch.expm1(-f64.abs())) - f64.abs().log()
    )
    torch.testing.assert_close(ours, exact, rtol=1e-6, atol=1e-6)


def test_validation_of_support():
    dist = ContinuousBernoulli(torch.zeros(2), validate_args=True)
    with pytest.raises(ValueError):
        dist.log_prob(torch.tensor([0.5, 1.5]))


def test_likelihood_batch_shapes_and_state_dict():
    likelihood = ContinuousBernoulliLikelihood()
    f = torch.randn(4, 3, 7, dtype=torch.float64)
    out = likelihood(f)
    assert out.batch_shape == f.shape
    mvn = gpytorch.distributions.MultivariateNormal(
        torch.zeros(2, 7, dtype=torch.float64), torch.eye(7, dtype=torch.float64).expand(2, 7, 7)
    )
    y = torch.rand(2, 7, dtype=torch.float64)
    assert likelihood.expected_log_prob(y, mvn).shape == (2, 7)
    other = ContinuousBernoulliLikelihood()
    other.load_state_dict(likelihood.state_dict())
    assert likelihood.to(torch.float32) is likelihood


def test_expected_log_prob_matches_dense_quadrature():
    likelihood = ContinuousBernoulliLikelihood()
    mean = torch.tensor([-2.0, 0.0, 3.0], dtype=torch.float64)
    var = torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64)
    mvn = gpytorch.distributions.MultivariateNormal(mean, torch.diag(var))
    y = torch.tensor([0.1, 0.5, 0.8], dtype=torch.float64)
    got = likelihood.expected_log_prob(y, mvn)
    for i in range(3):

        def integrand(f, i=i):
            lp = ContinuousBernoulli(torch.tensor(f, dtype=torch.float64)).log_prob(y[i]).item()
            dens = math.exp(-0.5 * (f - mean[i].item()) ** 2 / var[i].item())
            return lp * dens / math.sqrt(2 * math.pi * var[i].item())

        ref = integrate.quad(integrand, -40, 40, epsabs=1e-12)[0]
        assert got[i].item() == pytest.approx(ref, rel=1e-6)


@requires_cuda
def test_cuda():
    likelihood = ContinuousBernoulliLikelihood().cuda()
    f = torch.randn(5, device="cuda")
    y = torch.rand(5, device="cuda")
    lp = likelihood(f).log_prob(y)
    assert lp.device.type == "cuda"
    torch.testing.assert_close(lp.cpu(), ContinuousBernoulli(f.cpu()).log_prob(y.cpu()))


def test_works_with_predictive_log_likelihood_and_variational_elbo():
    class _SVGP(gpytorch.models.ApproximateGP):
        def __init__(self, inducing):
            dist = gpytorch.variational.CholeskyVariationalDistribution(inducing.shape[0])
            super().__init__(gpytorch.variational.VariationalStrategy(self, inducing, dist))
            self.mean_module = gpytorch.means.ZeroMean()
            self.covar_module = gpytorch.kernels.RBFKernel()

        def forward(self, x):
            return gpytorch.distributions.MultivariateNormal(
                self.mean_module(x), self.covar_module(x)
            )

    x = torch.linspace(0, 1, 12, dtype=torch.float64).unsqueeze(-1)
    y = torch.sigmoid(torch.sin(6 * x.squeeze(-1)))
    model = _SVGP(x[::3].clone()).double()
    likelihood = ContinuousBernoulliLikelihood()
    for mll_cls in (gpytorch.mlls.VariationalELBO, gpytorch.mlls.PredictiveLogLikelihood):
        mll = mll_cls(likelihood, model, num_data=12)
        loss = -mll(model(x), y)
        loss.backward()
        assert torch.isfinite(loss)
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("f", [2e-6, 1e-5, 1e-4, 1e-3, 0.5, 0.99, 1.01, -1e-3])
def test_icdf_near_zero_logits_against_mpmath(dtype, f):
    mpmath = pytest.importorskip("mpmath")
    mpmath.mp.dps = 40
    logit = torch.tensor(f, dtype=dtype)
    u = torch.tensor([1e-3, 0.1, 0.3, 0.5, 0.9, 0.999], dtype=dtype)
    got = ContinuousBernoulli(logit).icdf(u).double()
    ref = [float(cb_reference.icdf(float(logit), float(v))) for v in u]
    # float32 used to lose 2e-2 at f = 2e-6 (exp(-f) rounded, then divided by f)
    tol = 4 * torch.finfo(dtype).eps
    torch.testing.assert_close(got, torch.tensor(ref, dtype=torch.float64), rtol=0, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_mean_and_entropy_gradients_at_very_negative_logits(dtype):
    # d/df A'(f) = A''(f) ~ 1/f^2 there; exp(-f) overflowed and the gradient was NaN
    logits = torch.tensor([-100.0, -800.0, -1e4], dtype=dtype, requires_grad=True)
    ContinuousBernoulli(logits).mean.sum().backward()
    torch.testing.assert_close(logits.grad, 1 / logits.detach() ** 2, rtol=1e-5, atol=0)
    logits.grad = None
    # H = A(f) - f A'(f), dH/df = -f A''(f) ~ -1/f
    ContinuousBernoulli(logits).entropy().sum().backward()
    torch.testing.assert_close(logits.grad, -1 / logits.detach(), rtol=1e-5, atol=0)


def test_cdf_and_icdf_gradients_at_zero_are_zero():
    for f in (2.0, -3.0, 1e4):
        logit = torch.tensor(f, dtype=torch.float64, requires_grad=True)
        dist = ContinuousBernoulli(logit)
        (dist.cdf(torch.tensor(0.0, dtype=torch.float64)) + dist.icdf(torch.tensor(0.0))).backward()
        assert float(logit.grad) == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_icdf_at_one_is_one_with_zero_gradient(dtype):
    # F^{-1}(1) = 1 for every f; at f << 0 expm1(f) rounds to -1 and log1p(u expm1(f)) was -inf,
    # which gave the right value after clamping but a NaN gradient
    logits = torch.tensor([-1e4, -100.0, -3.0, 0.5, 3.0, 1e4], dtype=dtype, requires_grad=True)
    out = ContinuousBernoulli(logits).icdf(torch.ones(6, dtype=dtype))
    out.sum().backward()
    assert torch.equal(out.detach(), torch.ones(6, dtype=dtype))
    assert torch.equal(logits.grad, torch.zeros(6, dtype=dtype))


def test_float64_quadrature_is_float64_accurate_without_converting_the_likelihood():
    # GPyTorch's quadrature nodes are float32 until the likelihood itself is converted (models are
    # usually converted with .double(), likelihoods often not): both were off by up to 3e-8
    likelihood = ContinuousBernoulliLikelihood()
    mean = torch.tensor([-3.0, -0.4, 0.0, 0.7, 2.0, 5.0], dtype=torch.float64)
    var = torch.tensor([0.05, 1.0, 0.5, 0.8, 0.3, 1.0], dtype=torch.float64)
    y = torch.tensor([0.1, 0.5, 0.3, 0.0, 1.0, 0.8], dtype=torch.float64)
    mvn = gpytorch.distributions.MultivariateNormal(mean, torch.diag(var))
    elp = likelihood.expected_log_prob(y, mvn)
    log_marginal = likelihood.log_marginal(y, mvn)
    assert elp.dtype == log_marginal.dtype == torch.float64
    for i in range(6):
        ref = cb_gaussian_expectations(y[i].item(), mean[i].item(), var[i].item())
        assert elp[i].item() == pytest.approx(ref.expected_log_prob, rel=1e-12, abs=1e-14)
        assert log_marginal[i].item() == pytest.approx(ref.log_marginal, rel=1e-12, abs=1e-14)


@pytest.mark.parametrize(
    "dtype,mean,variance,y,rtol",
    [
        (torch.float64, 800.0, 0.01, 0.0, 1e-12),  # was -inf
        (torch.float64, -750.0, 1.0, 1.0, 1e-12),  # was -742.8306, 0.05 nats off
        (torch.float32, 120.0, 1.0, 0.0, 1e-6),  # was -inf
        (torch.float32, -95.0, 0.2, 1.0, 1e-6),  # was right, with a NaN gradient
    ],
)
def test_log_marginal_where_every_node_density_underflows(dtype, mean, variance, y, rtol):
    likelihood = ContinuousBernoulliLikelihood()
    mvn = gpytorch.distributions.MultivariateNormal(
        torch.tensor([mean], dtype=dtype), torch.tensor([[variance]], dtype=dtype)
    )
    got = likelihood.log_marginal(torch.tensor([y], dtype=dtype), mvn)
    assert torch.isfinite(got).all()
    ref = cb_gaussian_expectations(y, mean, variance)
    assert got.item() == pytest.approx(ref.log_marginal, rel=rtol)
    # PredictiveLogLikelihood is built on it: its loss was inf and its gradients NaN
    mean_param = torch.tensor([mean], dtype=dtype, requires_grad=True)
    mvn = gpytorch.distributions.MultivariateNormal(
        mean_param, torch.tensor([[variance]], dtype=dtype)
    )
    likelihood.log_marginal(torch.tensor([y], dtype=dtype), mvn).sum().backward()
    assert mean_param.grad.item() == pytest.approx(ref.log_marginal_dmean, rel=max(rtol, 1e-7) * 10)
