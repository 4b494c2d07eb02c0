"""The DPKL regressors' ``predict`` after a change of state in evaluation mode.

GPyTorch's ExactGP keeps the prediction cache it built at its first evaluation-mode call; before,
``predict`` went on using it after the noise was set by hand, the random features were resampled
or a state dict was loaded, while ``latent_posterior_variance`` used the new values.
Each case is checked against a dense float64 posterior in the regressor's mean features.
"""

import math

import torch
from torch import nn

from gpsd.dpkl import ARDGPRegressor, DPKLRegressor


def _net():
    return nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2))


def _dense_posterior(model, x, xs):
    """Mean and latent variance by solves with Phi Phi^T + noise I (the features' kernel)."""
    with torch.no_grad():
        phi = model.covar_module.mean_features(x)
        phi_s = model.covar_module.mean_features(xs)
        noise = model.likelihood.noise.squeeze(-1)
        mean_c = model.mean_module.constant
        k = phi @ phi.mT + noise * torch.eye(x.shape[0], dtype=x.dtype)
        k_s = phi_s @ phi.mT
        mean = mean_c + k_s @ torch.linalg.solve(k, model.train_targets - mean_c)
        var = (phi_s * phi_s).sum(-1) - (k_s * torch.linalg.solve(k, k_s.mT).mT).sum(-1)
        return mean, var


def _model():
    torch.manual_seed(0)
    x = torch.randn(40, 3, dtype=torch.float64)
    y = torch.sin(x[:, 0])
    model = DPKLRegressor(x, y, _net, num_particles=3, num_random_features=20)
    model.fit(num_steps=3, lr=0.01)  # leaves the model in evaluation mode
    return model, x, torch.randn(6, 3, dtype=torch.float64)


def _check(model, x, xs):
    mean, var = model.predict(xs, include_noise=False)
    want_mean, want_var = _dense_posterior(model, x, xs)
    torch.testing.assert_close(mean, want_mean, rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(var, want_var, rtol=1e-8, atol=1e-11)
    return var


def test_predict_uses_a_noise_set_after_the_first_prediction():
    model, x, xs = _model()
    before = _check(model, x, xs)
    model.likelihood.noise = 0.5
    after = _check(model, x, xs)  # before the fix: the variances of the old noise
    assert (after - before).abs().max() > 1e-3
    torch.testing.assert_close(after, model.latent_posterior_variance(xs).detach())


def test_predict_uses_resampled_features_and_loaded_state():
    model, x, xs = _model()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    first = _check(model, x, xs)
    model.covar_module.random_features.resample(torch.Generator().manual_seed(3))
    assert (_check(model, x, xs) - first).abs().max() > 1e-6
    model.load_state_dict(saved)
    torch.testing.assert_close(_check(model, x, xs), first, rtol=0, atol=0)


def test_ard_initial_lengthscale_is_not_rounded_to_float32():
    torch.set_default_dtype(torch.float32)
    x = torch.randn(10, 3, dtype=torch.float64)
    model = ARDGPRegressor(x, x[:, 0])
    lengthscale = model.covar_module.base_kernel.lengthscale
    assert lengthscale.dtype == torch.float64
    # was 1.732050784259756, sqrt(3) read as float32
    assert (lengthscale - math.sqrt(3)).abs().max() < 1e-15
