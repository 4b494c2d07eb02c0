"""Tests of SSDPKLRegressor: the regulariser and the loss against dense posterior variances,
what the regulariser reaches, and its unlabelled data."""

import pytest
import torch
from dpkl_reference import (
    dense_kernel,
    dense_variance,
    loop_embeddings,
    loop_mean_features,
    noisy_sine_data,
    sum_sine_data,
    tanh_net,
)
from torch import nn

from gpsd.dpkl import (
    DPKLRegressor,
    SSDPKLRegressor,
)


def test_ssdpkl_regulariser_equals_dense_posterior_variance():
    x, y = noisy_sine_data(n=30)
    xu = torch.randn(12, 4)
    model = SSDPKLRegressor(
        x, y, tanh_net, unlabelled_x=xu, num_particles=3, num_random_features=10, alpha=0.5
    )
    model.likelihood.noise = 0.15
    got = model.latent_posterior_variance(xu)
    phi, phiu = loop_mean_features(model, x), loop_mean_features(model, xu)
    kxx = phi @ phi.mT + 0.15 * torch.eye(30)
    ks = phiu @ phi.mT  # k_star^T
    kss = (phiu**2).sum(-1)  # the true prior variance ||phi-bar(x)||^2
    ref = kss - (ks * torch.linalg.solve(kxx, ks.mT).mT).sum(-1)
    torch.testing.assert_close(got, ref, rtol=1e-7, atol=1e-10)
    torch.testing.assert_close(model.regulariser(xu), ref.mean())
    # the training loss adds alpha times the regulariser (all 12 rows fit in one batch)
    dpkl_part = DPKLRegressor.training_loss(model)
    torch.testing.assert_close(model.training_loss(), dpkl_part + 0.5 * ref.mean())
    # the exact-kernel path agrees with its own dense formula too
    model_exact = SSDPKLRegressor(
        x, y, tanh_net, unlabelled_x=xu, num_particles=2, embedding_kernel="exact"
    )
    ke = model_exact.covar_module
    kxx = ke(x).to_dense() + model_exact.likelihood.noise * torch.eye(30)
    ks = ke(xu, x).to_dense()
    ref = ke(xu, diag=True) - (ks * torch.linalg.solve(kxx, ks.mT).mT).sum(-1)
    torch.testing.assert_close(model_exact.latent_posterior_variance(xu), ref)


def _net_v(d_in=3, d_out=2):
    return nn.Sequential(nn.Linear(d_in, 8), nn.Tanh(), nn.Linear(8, d_out))


def _data_v(n=24):
    torch.set_default_dtype(torch.float64)
    x = torch.randn(n, 3)
    return x, torch.sin(x[:, 0])


def test_ssdpkl_rejects_infinite_alpha():
    # an infinite alpha would make the training loss inf at the first iteration of fit
    x, y = _data_v(10)
    for alpha in (float("inf"), float("nan"), -1.0, True):
        with pytest.raises(ValueError, match="alpha must be a finite float"):
            SSDPKLRegressor(x, y, _net_v, unlabelled_x=torch.randn(5, 3), alpha=alpha)


def test_ssdpkl_state_dict_holds_no_data():
    # unlabelled_x is data, not state: a model built with another unlabelled set (of another
    # size) loads a saved one
    x, y = _data_v(12)
    model = SSDPKLRegressor(x, y, _net_v, unlabelled_x=torch.randn(9, 3), num_particles=2)
    model.fit(max_iter=2)
    assert "unlabelled_x" not in model.state_dict()
    fresh = SSDPKLRegressor(x, y, _net_v, unlabelled_x=torch.randn(4, 3), num_particles=2)
    fresh.load_state_dict(model.state_dict())
    got, want = fresh.predict(x[:5]), model.predict(x[:5])
    torch.testing.assert_close(got.mean, want.mean)
    torch.testing.assert_close(got.variance, want.variance)
    assert fresh.unlabelled_x.shape == (4, 3)


def _batchnorm_net():
    return nn.Sequential(nn.Linear(3, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 2))


def _batchnorm_model(kernel, **kwargs):
    """SSDPKL with the BatchNorm network on 24 labelled and 15 unlabelled rows in 3-D."""
    x, y = sum_sine_data()
    xu = torch.randn(15, 3)
    model = SSDPKLRegressor(
        x,
        y,
        _batchnorm_net,
        unlabelled_x=xu,
        num_particles=3,
        num_random_features=30,
        embedding_kernel=kernel,
        **kwargs,
    )
    return model, x, y, xu


@pytest.mark.parametrize("kernel", ["exact", "rff"])
def test_batchnorm_regulariser_sees_the_unlabelled_rows_in_one_batch(kernel):
    # the unlabelled rows are normalised in one batch with the labelled ones, so shifting them
    # changes the regulariser (normalised on their own, the shift would vanish)
    model, x, y, xu = _batchnorm_model(kernel)
    noise = model.likelihood.noise.detach()
    model.train()
    values = []
    for shift in (0.0, 5.0):
        z = loop_embeddings(model, torch.cat([x, xu + shift]), training=True)
        ref = dense_variance(dense_kernel(model, z), x.shape[0], noise).mean()
        with torch.no_grad():
            values.append(model.regulariser(xu + shift))
        torch.testing.assert_close(values[-1], ref, rtol=1e-7, atol=1e-12)
    assert values[1] > 1.5 * values[0]
    # in evaluation mode (running statistics) the result is the dense formula too
    model.eval()
    z = loop_embeddings(model, torch.cat([x, xu]), training=False)
    ref = dense_variance(dense_kernel(model, z), x.shape[0], noise)
    with torch.no_grad():
        torch.testing.assert_close(model.latent_posterior_variance(xu), ref, rtol=1e-7, atol=1e-12)


@pytest.mark.parametrize("kernel", ["exact", "rff"])
def test_ssdpkl_training_loss_is_one_joint_pass_per_step(kernel):
    # one extractor pass over the labelled and unlabelled rows per step: BatchNorm's running
    # statistics are updated once per step
    model, x, y, xu = _batchnorm_model(kernel, alpha=0.7)
    ensemble = model.covar_module.feature_extractor
    calls = []
    ensemble.register_forward_hook(lambda module, args, out: calls.append(args[0].shape[0]))
    z = loop_embeddings(model, torch.cat([x, xu]), training=True)
    k = dense_kernel(model, z)
    n, noise, c = x.shape[0], model.likelihood.noise.detach(), model.mean_module.constant.detach()
    cov = k[:n, :n] + noise * torch.eye(n)
    nll = -torch.distributions.MultivariateNormal(c.expand(n), cov).log_prob(y) / n
    ref = nll + 0.7 * dense_variance(k, n, noise).mean()
    torch.testing.assert_close(model.training_loss().detach(), ref, rtol=1e-8, atol=1e-12)
    assert calls == [n + 15]
    model.fit(max_iter=2, lr=0.01)
    assert calls == [n + 15] * 3
    tracked = [v for k, v in ensemble.state_dict().items() if "num_batches_tracked" in k]
    assert all(bool((t == 3).all()) for t in tracked)


def _model(alpha=1.0):
    torch.manual_seed(0)
    x = torch.randn(20, 3, dtype=torch.float64)
    y = torch.sin(x.sum(-1))
    u = torch.randn(30, 3, dtype=torch.float64)
    net = lambda: nn.Sequential(nn.Linear(3, 2)).double()  # noqa: E731
    return SSDPKLRegressor(
        x, y, net, unlabelled_x=u, alpha=alpha, num_particles=3, num_random_features=20
    ), u


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
    model.fit(max_iter=5, lr=0.05)
    assert torch.equal(model.likelihood.noise, noise)
    assert torch.equal(model.covar_module.random_features.outputscale, scale)
    assert not torch.equal(model.covar_module.random_features.lengthscale, lengthscale)


def test_constructor_names_the_bad_unlabelled_data_and_alpha():
    x, y = noisy_sine_data(n=20)
    with pytest.raises(ValueError, match="unlabelled_x"):
        SSDPKLRegressor(x, y, tanh_net, unlabelled_x=torch.randn(5, 3))
    with pytest.raises(ValueError, match="alpha"):
        SSDPKLRegressor(x, y, tanh_net, unlabelled_x=torch.randn(5, 4), alpha=-1.0)
    with pytest.raises(TypeError, match="positional"):
        SSDPKLRegressor(x, y, tanh_net, torch.randn(5, 4))  # keyword-only


def test_one_dimensional_inputs_are_one_feature():
    torch.set_default_dtype(torch.float64)
    x, xu = torch.linspace(-2, 2, 15), torch.linspace(-3, 3, 8)
    model = SSDPKLRegressor(
        x,
        torch.sin(x),
        lambda: tanh_net(1),
        unlabelled_x=xu,
        num_particles=2,
        num_random_features=6,
    )
    assert model.unlabelled_x.shape == (8, 1)
    assert model.fit(max_iter=2) is model
    assert model.predict(xu).mean.shape == (8,)
