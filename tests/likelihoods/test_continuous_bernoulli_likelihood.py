"""ContinuousBernoulliLikelihood: GPyTorch's likelihood test suite, its expectations at every
latent variance against mpmath, observation shapes, and variational models (SVGP on soft labels)."""

import functools
import math
import unittest

import gpytorch
import pytest
import torch
from cb_reference import cb_gaussian_expectations
from conftest import requires_cuda
from gpytorch.likelihoods.likelihood import _OneDimensionalLikelihood
from gpytorch.test.base_likelihood_test_case import BaseLikelihoodTestCase
from scipy import integrate

from gpsd.likelihoods import ContinuousBernoulli, ContinuousBernoulliLikelihood, cb_log_density


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
        (torch.float64, 800.0, 0.01, 0.0, 1e-12),  # the naive form: -inf
        (torch.float64, -750.0, 1.0, 1.0, 1e-12),  # naive: 0.05 nats off
        (torch.float32, 120.0, 1.0, 0.0, 1e-6),  # was -inf
        (torch.float32, -95.0, 0.2, 1.0, 1e-6),  # naive: a NaN gradient
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
    # PredictiveLogLikelihood is built on it: its loss must be finite and its gradients too
    mean_param = torch.tensor([mean], dtype=dtype, requires_grad=True)
    mvn = gpytorch.distributions.MultivariateNormal(
        mean_param, torch.tensor([[variance]], dtype=dtype)
    )
    likelihood.log_marginal(torch.tensor([y], dtype=dtype), mvn).sum().backward()
    assert mean_param.grad.item() == pytest.approx(ref.log_marginal_dmean, rel=max(rtol, 1e-7) * 10)


DT = torch.float64
MEAN = torch.tensor([0.3, -1.2, 2.0, 0.0, 4.5], dtype=DT)
VAR = torch.tensor([0.5, 2.0, 0.1, 3.0, 1.0], dtype=DT)
LATENT = gpytorch.distributions.MultivariateNormal(MEAN, torch.diag(VAR))
TARGETS = torch.tensor([0.1, 0.9, 0.3, 0.6, 0.5], dtype=DT)


@pytest.mark.parametrize("method", ["expected_log_prob", "log_marginal"])
@pytest.mark.parametrize(
    "targets, message",
    [
        (TARGETS.unsqueeze(-1), r"observations must have shape \(\*batch, 5\).*\(5, 1\)"),
        (TARGETS[:3], r"observations must have shape \(\*batch, 5\).*\(3,\)"),
        (TARGETS.expand(3, 2, 5), r"batch shape of observations \(3, 2, 5\) does not broadcast"),
    ],
)
def test_targets_of_another_shape_are_refused(method, targets, message):
    latent = gpytorch.distributions.MultivariateNormal(
        MEAN.expand(2, 2, 5), torch.diag_embed(VAR.expand(2, 2, 5))
    )
    with pytest.raises(ValueError, match=message):
        getattr(ContinuousBernoulliLikelihood(), method)(targets, latent)


def _expected_log_density(y, mean, var):
    """E[log p(y|f)], f ~ N(mean, var), by adaptive quadrature."""

    def integrand(f):
        density = math.exp(-0.5 * (f - mean) ** 2 / var) / (2 * math.pi * var) ** 0.5
        return float(cb_log_density(torch.tensor(y, dtype=DT), torch.tensor(f, dtype=DT)) * density)

    sd = var**0.5
    return integrate.quad(integrand, mean - 12 * sd, mean + 12 * sd, epsabs=1e-13)[0]


def test_a_batch_of_targets_against_one_latent_is_the_loop_over_targets():
    batch = torch.stack([TARGETS, 1 - TARGETS])  # shape: (2, 5)
    got = ContinuousBernoulliLikelihood().expected_log_prob(batch, LATENT)
    assert got.shape == (2, 5)
    expected = torch.tensor(
        [
            [
                _expected_log_density(float(y), float(m), float(v))
                for y, m, v in zip(row, MEAN, VAR, strict=True)
            ]
            for row in batch
        ],
        dtype=DT,
    )
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-10)


def test_one_latent_value_against_several_targets_broadcasts():
    latent = torch.distributions.Normal(torch.tensor(0.7, dtype=DT), torch.tensor(1.3, dtype=DT))
    got = ContinuousBernoulliLikelihood().expected_log_prob(TARGETS, latent)
    expected = torch.tensor(
        [_expected_log_density(float(y), 0.7, 1.3**2) for y in TARGETS], dtype=DT
    )
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-10)


def test_a_multitask_latent_gives_one_term_per_point_and_a_scalar_elbo():
    # IndependentMultitaskVariationalStrategy: the ELBO is a scalar (an ELBO of shape (n,)
    # would count the KL divergence n times in its .sum())
    torch.manual_seed(0)
    n, tasks, m = 40, 3, 8
    x = torch.rand(n, 1, dtype=DT) * 4 - 2
    soft = torch.stack([torch.sigmoid(2 * torch.sin(k * x[:, 0])) for k in (1, 2, 3)], -1)
    batch = torch.Size([tasks])

    class Multitask(gpytorch.models.ApproximateGP):
        def __init__(self):
            z = torch.linspace(-2, 2, m, dtype=DT).view(1, m, 1).repeat(tasks, 1, 1)
            dist = gpytorch.variational.CholeskyVariationalDistribution(m, batch_shape=batch)
            strategy = gpytorch.variational.IndependentMultitaskVariationalStrategy(
                gpytorch.variational.VariationalStrategy(self, z, dist), num_tasks=tasks
            )
            super().__init__(strategy)
            self.mean_module = gpytorch.means.ConstantMean(batch_shape=batch)
            self.covar_module = gpytorch.kernels.ScaleKernel(
                gpytorch.kernels.RBFKernel(batch_shape=batch), batch_shape=batch
            )

        def forward(self, x):
            return gpytorch.distributions.MultivariateNormal(
                self.mean_module(x), self.covar_module(x)
            )

    model = Multitask().to(DT)
    model(x)  # the first call initialises q(u) from the prior
    with torch.no_grad():  # a variational distribution away from the prior: KL > 0
        strategy = model.variational_strategy.base_variational_strategy
        strategy._variational_distribution.variational_mean.fill_(1.5)
    likelihood = ContinuousBernoulliLikelihood()
    latent = model(x)
    elbo = gpytorch.mlls.VariationalELBO(likelihood, model, num_data=n)(latent, soft)
    assert elbo.shape == ()
    # independently: each task's marginal Normal, one expected log density per entry
    mean, var = latent.mean, latent.variance  # shape: (n, tasks)
    terms = ContinuousBernoulliLikelihood().expected_log_prob(
        soft.T, torch.distributions.Normal(mean.T, var.T.sqrt())
    )  # shape: (tasks, n)
    kl = model.variational_strategy.kl_divergence().sum()
    assert kl > 1.0
    torch.testing.assert_close(elbo, (terms.sum() - kl) / n, rtol=1e-12, atol=1e-12)
    predictive = gpytorch.mlls.PredictiveLogLikelihood(likelihood, model, num_data=n)
    assert predictive(latent, soft).shape == ()


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


sklearn = pytest.importorskip("sklearn")


class _BernoulliLogitLikelihood(gpytorch.likelihoods.likelihood._OneDimensionalLikelihood):
    """The misspecified alternative: Bernoulli-logistic log-density y f - log(1 + e^f) on y in [0, 1]."""

    def forward(self, function_samples, *args, **kwargs):
        f = function_samples

        class _Soft(torch.distributions.Distribution):
            arg_constraints = {}

            def __init__(self):
                super().__init__(batch_shape=f.shape, validate_args=False)

            def log_prob(self, y):
                return y * f - torch.nn.functional.softplus(f)

        return _Soft()


class _SVGP(gpytorch.models.ApproximateGP):
    def __init__(self, inducing):
        strategy = gpytorch.variational.VariationalStrategy(
            self,
            inducing,
            gpytorch.variational.CholeskyVariationalDistribution(inducing.shape[0]),
            learn_inducing_locations=False,
        )
        super().__init__(strategy)
        self.mean_module = gpytorch.means.ConstantMean()
        self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())
        self.covar_module.base_kernel.lengthscale = 4.0
        self.covar_module.outputscale = 4.0

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def _fit(likelihood, x, y, inducing, iters=40):
    torch.manual_seed(0)
    model = _SVGP(inducing).double()
    mll = gpytorch.mlls.VariationalELBO(likelihood, model, num_data=y.numel())
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    for _ in range(iters):
        opt.zero_grad()
        (-mll(model(x), y)).backward()
        opt.step()
    return model


def test_svgp_with_continuous_bernoulli_recovers_probabilities_better():
    from sklearn.datasets import load_breast_cancer
    from sklearn.linear_model import LogisticRegression

    data = load_breast_cancer()
    x = torch.as_tensor(data.data, dtype=torch.float64)
    x = (x - x.mean(0)) / x.std(0)
    labels = torch.as_tensor(data.target, dtype=torch.float64)
    # real-data latent: a regularised logistic regression on the real labels
    clf = LogisticRegression(C=0.02, max_iter=1000).fit(x.numpy(), labels.numpy())
    g = torch.as_tensor(clf.decision_function(x.numpy()), dtype=torch.float64).clamp(-6, 6)
    gen = torch.Generator().manual_seed(0)
    perm = torch.randperm(x.shape[0], generator=gen)
    train, test = perm[:200], perm[200:]
    torch.manual_seed(1)
    soft = ContinuousBernoulli(g[train]).sample()  # soft labels in [0, 1] drawn given the latent
    inducing = x[train][:25].clone()
    results = {}
    for name, likelihood in [
        ("cb", ContinuousBernoulliLikelihood()),
        ("bern", _BernoulliLogitLikelihood()),
    ]:
        model = _fit(likelihood, x[train], soft, inducing)
        model.eval()
        with torch.no_grad():
            post = model(x[test])
            nodes = torch.randn(2000, 1, dtype=torch.float64, generator=gen)
            prob = torch.sigmoid(post.mean + post.variance.sqrt() * nodes).mean(0)
        results[name] = (prob - torch.sigmoid(g[test])).square().mean().sqrt().item()
    print(results)
    assert results["cb"] < 0.8 * results["bern"], results


def _cb_mean_numpy(f: float) -> float:
    """A'(f) = 1 / (1 - e^{-f}) - 1 / f, with its series near 0 (float64)."""
    if abs(f) < 1e-3:
        return 0.5 + f / 12.0
    if f < 0:
        return 1.0 - _cb_mean_numpy(-f)  # the symmetry A'(-f) = 1 - A'(f); no overflow
    return 1.0 / -math.expm1(-f) - 1.0 / f


@pytest.mark.parametrize(
    ("mu", "s"),
    [(2.0, 1.0), (0.3, 30.0), (5.0, 100.0), (-40.0, 3.0), (25.0, 10.0), (0.0, 1e4), (3.0, 1e-3)],
)
def test_predictive_mean_is_the_gaussian_integral_of_the_cb_mean(mu, s):
    """E[y] = int A'(f) N(f; mu, s^2) df, by scipy's adaptive quadrature, split at the bend."""
    likelihood = ContinuousBernoulliLikelihood()
    latent = torch.distributions.Normal(
        torch.tensor([mu], dtype=torch.float64), torch.tensor([s], dtype=torch.float64)
    )
    got = likelihood.predictive_moments(latent).mean

    def integrand(f):
        return (
            _cb_mean_numpy(f) * math.exp(-0.5 * ((f - mu) / s) ** 2) / (s * math.sqrt(2 * math.pi))
        )

    lo, hi = mu - 12 * s, mu + 12 * s
    points = [0.0] if lo < 0.0 < hi else None
    expected, _ = integrate.quad(integrand, lo, hi, points=points, limit=500, epsabs=1e-14)
    assert float(got) == pytest.approx(expected, abs=1e-12)


def test_predictive_moments_are_those_of_sampled_soft_targets():
    """Monte Carlo with torch's own continuous Bernoulli: f ~ N(mu, s^2), then y | f."""
    torch.set_default_dtype(torch.float64)
    mu, var = torch.tensor([-1.5, 0.4, 2.0]), torch.tensor([0.5, 9.0, 2.0])
    likelihood = ContinuousBernoulliLikelihood()
    moments = likelihood.predictive_moments(torch.distributions.Normal(mu, var.sqrt()))
    gen = torch.Generator().manual_seed(0)
    f = mu + var.sqrt() * torch.randn(400_000, 3, generator=gen)
    u = torch.rand(400_000, 3, generator=gen)
    # y | f by its inverse CDF, y = log(1 + u (e^f - 1)) / f (torch's ContinuousBernoulli clamps)
    y = torch.log1p(u * torch.expm1(f)) / f
    torch.testing.assert_close(moments.mean, y.mean(0), rtol=0, atol=2e-3)
    torch.testing.assert_close(moments.variance, y.var(0), rtol=0, atol=2e-3)
    # neither the Bernoulli's mean at the latent mean nor A' there
    assert (moments.mean - torch.sigmoid(mu)).abs().min() > 0.05


def test_predictive_moments_keep_the_latent_shape_and_are_differentiable():
    torch.set_default_dtype(torch.float64)
    likelihood = ContinuousBernoulliLikelihood()
    mean, covar = torch.randn(2, 6), torch.eye(6).expand(2, 6, 6) * 4.0
    moments = likelihood.predictive_moments(gpytorch.distributions.MultivariateNormal(mean, covar))
    assert moments.mean.shape == moments.variance.shape == (2, 6)
    assert bool(((moments.mean > 0) & (moments.mean < 1)).all())
    mu = torch.tensor([0.7, -3.0], requires_grad=True)
    var = torch.tensor([2.0, 40.0], requires_grad=True)

    def moments_of(m, v):
        out = likelihood.predictive_moments(torch.distributions.Normal(m, v.sqrt()))
        return out.mean, out.variance

    assert torch.autograd.gradcheck(moments_of, (mu, var))


def test_predictive_moments_refuse_what_is_not_a_finite_gaussian():
    likelihood = ContinuousBernoulliLikelihood()
    with pytest.raises(TypeError, match="function_dist"):
        likelihood.predictive_moments(torch.zeros(3))
    bad = torch.distributions.Normal(
        torch.tensor([float("nan")]), torch.tensor([1.0]), validate_args=False
    )
    with pytest.raises(ValueError, match="non-finite"):
        likelihood.predictive_moments(bad)
