"""The continuous categorical likelihood: its ELBO term against quadrature over the latent
Gaussian, the continuous Bernoulli at K = 2, and SVGP training with K latent functions."""

import gpytorch
import numpy as np
import pytest
import torch
from gpytorch.distributions import MultitaskMultivariateNormal, MultivariateNormal

from gpsd.likelihoods import (
    ContinuousBernoulliLikelihood,
    ContinuousCategorical,
    ContinuousCategoricalLikelihood,
)


def _independent(mean: torch.Tensor, variance: torch.Tensor) -> MultitaskMultivariateNormal:
    """q(f) with mean and variance of shape (n, K), every entry independent."""
    covariance = torch.diag_embed(variance.reshape(-1))  # interleaved: entry (i, k) at i K + k
    return MultitaskMultivariateNormal(mean, covariance)


def _gauss_hermite_expectation(y, mean, variance, num_nodes=16):
    """E_q[log p(y | f)] by a tensor Gauss-Hermite rule in the K = 3 latents of each input."""
    nodes, weights = np.polynomial.hermite_e.hermegauss(num_nodes)
    nodes = torch.tensor(nodes, dtype=torch.float64)
    weights = torch.tensor(weights / weights.sum(), dtype=torch.float64)
    grid = torch.stack(torch.meshgrid(nodes, nodes, nodes, indexing="ij"), -1).reshape(-1, 3)
    w = (weights[:, None, None] * weights[None, :, None] * weights[None, None, :]).reshape(-1)
    out = []
    for yi, mi, vi in zip(y, mean, variance, strict=True):
        f = mi + vi.sqrt() * grid  # shape: (num_nodes^3, 3)
        out.append((ContinuousCategorical(f).log_prob(yi) * w).sum())
    return torch.stack(out)


def test_expected_log_prob_agrees_with_quadrature_over_the_latent_gaussian():
    torch.manual_seed(0)
    mean = torch.tensor([[0.0, 0.0, 0.0], [1.0, -2.0, 0.5], [3.0, 3.0, -4.0], [0.2, 0.1, 0.0]])
    mean = mean.double()
    variance = torch.tensor([[1e-2] * 3, [1.0, 0.5, 0.25], [0.3, 1.0, 0.1], [1.0, 1.0, 1.0]])
    variance = variance.double()
    y = torch.tensor([[0.2, 0.3, 0.5], [0.7, 0.1, 0.2], [0.45, 0.45, 0.1], [1.0, 0.0, 0.0]])
    y = y.double()
    likelihood = ContinuousCategoricalLikelihood(num_classes=3)
    exact = _gauss_hermite_expectation(y, mean, variance)
    with gpytorch.settings.num_likelihood_samples(20000):
        value = likelihood.expected_log_prob(y, _independent(mean, variance))
    assert value.shape == (4,)
    # the Monte Carlo standard deviation is at most 5.4e-4 here: the tolerance is 4.6 of them
    torch.testing.assert_close(value, exact, rtol=0, atol=2.5e-3)


def test_expected_log_prob_at_zero_variance_is_the_log_density_at_the_mean():
    mean = torch.tensor([[0.5, -1.0, 2.0, 0.0], [1e3, 1e3, -1e3, 0.0]], dtype=torch.float64)
    y = torch.tensor([[0.25, 0.25, 0.25, 0.25], [0.5, 0.5, 0.0, 0.0]], dtype=torch.float64)
    likelihood = ContinuousCategoricalLikelihood(num_classes=4)
    point_mass = torch.distributions.Normal(mean, torch.zeros_like(mean), validate_args=False)
    value = likelihood.expected_log_prob(y, point_mass)
    torch.testing.assert_close(value, ContinuousCategorical(mean).log_prob(y), rtol=1e-14, atol=0)


def test_two_classes_agree_with_the_continuous_bernoulli_likelihood():
    # f_2 - f_1 ~ N(mu_2 - mu_1, s_1^2 + s_2^2), and y = x_2: the CB likelihood's quadrature
    torch.manual_seed(1)
    mean = torch.tensor([[0.0, 0.5], [2.0, -1.0], [-3.0, 3.0]], dtype=torch.float64)
    variance = torch.tensor([[0.2, 0.3], [1.0, 0.5], [0.05, 0.05]], dtype=torch.float64)
    soft = torch.tensor([0.3, 0.05, 0.99], dtype=torch.float64)
    y = torch.stack([1 - soft, soft], dim=-1)
    with gpytorch.settings.num_likelihood_samples(20000):
        value = ContinuousCategoricalLikelihood(2).expected_log_prob(
            y, _independent(mean, variance)
        )
    difference = MultivariateNormal(mean[:, 1] - mean[:, 0], torch.diag(variance.sum(-1)))
    reference = ContinuousBernoulliLikelihood().expected_log_prob(soft, difference)
    # the CC term adds f_1 (y_1 + y_2) - f_1 = 0 to the CB one: they agree up to Monte Carlo
    torch.testing.assert_close(value, reference, rtol=0, atol=2e-3)


class _SVGP(gpytorch.models.ApproximateGP):
    def __init__(self, num_classes, lmc=False):
        num_latents = 2 if lmc else num_classes
        batch = torch.Size([num_latents])
        inducing = torch.linspace(0, 1, 8, dtype=torch.float64).repeat(num_latents, 2, 1)
        inducing = inducing.transpose(-1, -2)  # shape: (L, 8, 2)
        distribution = gpytorch.variational.CholeskyVariationalDistribution(8, batch_shape=batch)
        base = gpytorch.variational.VariationalStrategy(self, inducing, distribution)
        if lmc:
            strategy = gpytorch.variational.LMCVariationalStrategy(
                base, num_tasks=num_classes, num_latents=num_latents, latent_dim=-1
            )
        else:
            strategy = gpytorch.variational.IndependentMultitaskVariationalStrategy(
                base, num_tasks=num_classes
            )
        super().__init__(strategy)
        self.mean_module = gpytorch.means.ConstantMean(batch_shape=batch)
        self.covar_module = gpytorch.kernels.ScaleKernel(
            gpytorch.kernels.RBFKernel(batch_shape=batch), batch_shape=batch
        )

    def forward(self, x):
        return MultivariateNormal(self.mean_module(x), self.covar_module(x))


def _soft_targets(n=30):
    generator = torch.Generator().manual_seed(2)
    x = torch.rand(n, 2, generator=generator, dtype=torch.float64)
    logits = torch.stack([3 * torch.sin(3 * x[:, 0]), 3 * torch.cos(2 * x[:, 1]), 2 * x.sum(-1)])
    return x, torch.softmax(logits.T, dim=-1)


def test_svgp_training_loop_with_independent_multitask_strategy():
    torch.manual_seed(3)
    x, y = _soft_targets()
    model, likelihood = _SVGP(3).double(), ContinuousCategoricalLikelihood(3)
    mll = gpytorch.mlls.VariationalELBO(likelihood, model, num_data=len(y))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    losses = []
    for _ in range(25):
        optimizer.zero_grad()
        loss = -mll(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert np.isfinite(losses).all()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.1
    model.eval()
    with torch.no_grad():
        predictive = likelihood(model(x))  # the conditional at sampled latents
    assert predictive.batch_shape[-1] == len(y) and predictive.event_shape == (3,)


def test_svgp_elbo_with_lmc_strategy_is_finite_and_differentiable():
    torch.manual_seed(4)
    x, y = _soft_targets(12)
    model, likelihood = _SVGP(3, lmc=True).double(), ContinuousCategoricalLikelihood(3)
    loss = -gpytorch.mlls.VariationalELBO(likelihood, model, num_data=len(y))(model(x), y)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_rejects_bad_input():
    with pytest.raises(ValueError, match="num_classes must be an integer >= 2"):
        ContinuousCategoricalLikelihood(1)
    likelihood = ContinuousCategoricalLikelihood(3)
    q = _independent(torch.zeros(2, 3, dtype=torch.float64), torch.ones(2, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"observations must have shape \(\.\.\., 3\)"):
        likelihood.expected_log_prob(torch.full((2, 4), 0.25), q)
    with pytest.raises(ValueError, match="support"):
        likelihood.expected_log_prob(torch.tensor([[0.5, 0.5, 0.5], [1.0, 0.0, 0.0]]), q)
    with pytest.raises(ValueError, match=r"function_samples must have shape \(\.\.\., 3\)"):
        likelihood(torch.zeros(5, 2))
    wrong = _independent(
        torch.zeros(2, 4, dtype=torch.float64), torch.ones(2, 4, dtype=torch.float64)
    )
    with pytest.raises(ValueError, match="the mean of function_dist must have shape"):
        likelihood.expected_log_prob(torch.full((2, 3), 1 / 3), wrong)
