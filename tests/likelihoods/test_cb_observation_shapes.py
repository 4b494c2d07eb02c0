"""ContinuousBernoulliLikelihood needs one target per latent function value: ``(n, 1)`` targets
against ``n`` latents used to broadcast to an ``(n, n)`` term (an ELBO five times too large here,
silently), and targets of another length failed inside torch."""

import math

import gpytorch
import pytest
import torch
from scipy import integrate

from gpsd import ContinuousBernoulliLikelihood
from gpsd.likelihoods import cb_log_density

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
    # IndependentMultitaskVariationalStrategy: the ELBO used to come back with shape (n,), and
    # its .sum() counted the KL divergence n times
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
