"""Tests of ProbabilisticEmbeddingKernel."""

import gpytorch
import torch
from dpkl_reference import loop_mean_features, noisy_sine_data, paper_dpkl, tanh_net
from torch import nn


def _net():
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


def test_rff_mll_is_exact_when_2r_reaches_n_above_the_cholesky_size():
    # n = 820 > gpytorch.settings.max_cholesky_size (800) and 2R = 840 >= n. As a plain root
    # operator K(Z, Z) would be solved by conjugate gradients with a stochastic Lanczos log
    # determinant (a random loss, 6 % off the dense one); Woodbury is exact and repeatable.
    torch.set_default_dtype(torch.float64)
    n = 820
    assert n > gpytorch.settings.max_cholesky_size.value()
    x = torch.randn(n, 3)
    y = torch.sin(2 * x[:, 0]) + 0.1 * torch.randn(n)
    model = paper_dpkl(x, y, _net, num_particles=2, num_random_features=420)
    model.likelihood.noise = 0.01
    model.covar_module.random_features.lengthscale = 0.3
    losses = [model.training_loss() for _ in range(2)]
    with torch.no_grad():
        phi = model.covar_module.mean_features(x)  # shape: (n, 2R)
        cov = phi @ phi.mT + 0.01 * torch.eye(n)
        mean = model.mean_module.constant.expand(n)
        ref = -torch.distributions.MultivariateNormal(mean, cov).log_prob(y) / n
    for loss in losses:
        torch.testing.assert_close(loss.detach(), ref, rtol=1e-8, atol=1e-10)


def test_mean_features_equal_particle_loop():
    x, y = noisy_sine_data()
    model = paper_dpkl(x, y, tanh_net, num_particles=4, num_random_features=6)
    torch.testing.assert_close(model.covar_module.mean_features(x), loop_mean_features(model, x))
