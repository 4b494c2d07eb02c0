"""What SSDPKL's variance regulariser pulls on: outputscale and noise too, unless frozen."""

import torch
from torch import nn

from gpsd.dpkl import SSDPKLRegressor


def _model(alpha=1.0):
    torch.manual_seed(0)
    x = torch.randn(20, 3, dtype=torch.float64)
    y = torch.sin(x.sum(-1))
    u = torch.randn(30, 3, dtype=torch.float64)
    net = lambda: nn.Sequential(nn.Linear(3, 2)).double()  # noqa: E731
    return SSDPKLRegressor(x, y, net, u, alpha=alpha, num_particles=3, num_random_features=20), u


def test_regulariser_grows_with_noise_and_outputscale():
    model, u = _model()
    model.train()
    with torch.no_grad():
        base = float(model.regulariser(u))
        model.likelihood.noise = float(model.likelihood.noise) * 2
        more_noise = float(model.regulariser(u))
        model.likelihood.noise = float(model.likelihood.noise) / 2
        model.covar_module.random_features.outputscale = 2.0
        more_scale = float(model.regulariser(u))
    assert more_noise > base and more_scale > base


def test_frozen_noise_and_outputscale_stay_put_in_fit():
    model, _ = _model(alpha=10.0)
    model.likelihood.raw_noise.requires_grad_(False)
    model.covar_module.random_features.raw_outputscale.requires_grad_(False)
    noise = model.likelihood.noise.clone()
    scale = model.covar_module.random_features.outputscale.clone()
    lengthscale = model.covar_module.random_features.lengthscale.clone()
    model.fit(num_steps=5, lr=0.05)
    assert torch.equal(model.likelihood.noise, noise)
    assert torch.equal(model.covar_module.random_features.outputscale, scale)
    assert not torch.equal(model.covar_module.random_features.lengthscale, lengthscale)
