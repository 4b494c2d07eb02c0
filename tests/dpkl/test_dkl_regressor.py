"""Tests of DKLRegressor: one particle of DPKL is a hand-written GPyTorch deep-kernel GP."""

import copy

import gpytorch
import pytest
import torch
from dpkl_reference import noisy_sine_data, paper_dpkl, tanh_net

from gpsd.dpkl import (
    DKLRegressor,
)


class _HandDKL(gpytorch.models.ExactGP):
    def __init__(self, x, y, net):
        super().__init__(x, y, gpytorch.likelihoods.GaussianLikelihood())
        self.net = net
        self.mean_module = gpytorch.means.ConstantMean()
        self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())

    def forward(self, x):
        z = self.net(x)
        return gpytorch.distributions.MultivariateNormal(self.mean_module(z), self.covar_module(z))


@pytest.mark.parametrize("update", ["paper", "svgd"])
def test_single_particle_dpkl_is_dkl(update):
    """m = 1: same loss and same Adam trajectory as a hand-written GPyTorch deep-kernel GP."""
    x, y = noisy_sine_data(n=20)
    net = tanh_net()
    model = paper_dpkl(
        x, y, copy.deepcopy(net), num_particles=1, embedding_kernel="exact", update=update
    )
    hand = _HandDKL(x, y, copy.deepcopy(net))
    assert (
        abs(
            model.training_loss().item()
            - (-gpytorch.mlls.ExactMarginalLogLikelihood(hand.likelihood, hand)(hand(x), y)).item()
        )
        < 1e-10
    )
    model.fit(max_iter=5, lr=0.01)
    opt = torch.optim.Adam(hand.parameters(), lr=0.01)
    hand.train()
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(hand.likelihood, hand)
    for _ in range(5):
        opt.zero_grad()
        (-mll(hand(x), y)).backward()
        opt.step()
    stacked = model.covar_module.feature_extractor.stacked_parameters()
    for name, p in hand.net.named_parameters():
        torch.testing.assert_close(stacked[name][0], p, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(model.likelihood.noise, hand.likelihood.noise)
    dkl = DKLRegressor(x, y, copy.deepcopy(net))
    assert dkl.num_particles == 1 and dkl.kernel_type == "exact"


def test_dkl_regressor_fits_and_predicts_the_latent_function():
    x, y = noisy_sine_data(n=20)
    model = DKLRegressor(x[:, 0], y, lambda: tanh_net(1), mean_module=gpytorch.means.ZeroMean())
    assert isinstance(model.mean_module, gpytorch.means.ZeroMean)
    assert model.fit(max_iter=3) is model and len(model.history["loss"]) == 3
    latent, observed = model.predict(x[:4, 0]), model.predict(x[:4, 0], include_noise=True)
    torch.testing.assert_close(
        observed.variance - latent.variance, model.likelihood.noise.expand(4)
    )
