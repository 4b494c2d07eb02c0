"""Tests of what the DPKL-family regressors share (fit, predict, set_train_data, settings)."""

import copy
import math

import numpy as np
import pytest
import torch
from conftest import requires_cuda
from torch import nn

from gpsd.dpkl import (
    DPKLClassifier,
    DPKLRegressor,
    SSDPKLRegressor,
    SteinVariationalGradient,
)


def _data(n=12):
    torch.set_default_dtype(torch.float64)
    x = torch.randn(n, 3)
    return x, torch.sin(x[:, 0])


@pytest.mark.parametrize("lr", ["0.01", True, torch.tensor([0.1, 0.2])])
def test_regressor_fit_names_a_bad_lr(lr):
    # "0.01" gave TypeError('must be real number, not str'), naming nothing; True was taken as
    # a learning rate of 1.0 and trained; a 2-element tensor gave ValueError('only one element
    # tensors can be converted to Python scalars')
    x, y = _data()
    model = DPKLRegressor(x, y, lambda: nn.Linear(3, 2), num_particles=2, num_random_features=3)
    with pytest.raises(ValueError, match="lr"):
        model.fit(1, lr=lr)


def _net(d_in=4, d_out=2):
    return nn.Sequential(nn.Linear(d_in, 8), nn.Tanh(), nn.Linear(8, d_out))


def _data_m(n=30, d=4):
    torch.set_default_dtype(torch.float64)
    x = torch.randn(n, d)
    y = torch.sin(x[:, 0]) + 0.1 * torch.randn(n)
    return x, y


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_steps=-1), "num_steps must be a non-negative int"),
        (dict(num_steps=2.0), "num_steps"),
        (dict(num_steps=True), "num_steps"),
        (dict(lr=0.0), "lr must be a positive float"),
        (dict(lr=float("nan")), "lr"),
        (dict(val_x=torch.zeros(3, 4, dtype=torch.float64)), "val_x and val_y"),
        (dict(check_every=0), "check_every must be a positive int"),
        (dict(check_every=2.5), "check_every"),
        (
            dict(val_x=torch.zeros(3, 5, dtype=torch.float64), val_y=torch.zeros(3)),
            "val_x must have 4 features",
        ),
        (
            dict(val_x=torch.zeros(3, 4, dtype=torch.float64), val_y=torch.zeros(2)),
            "val_y",
        ),
    ],
)
def test_fit_names_the_bad_argument(kwargs, match):
    x, y = _data_m(n=20)
    model = DPKLRegressor(x, y, _net, num_particles=2, num_random_features=5)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=match):
        model.fit(**kwargs)
    for name, value in model.state_dict().items():  # nothing was trained
        torch.testing.assert_close(value, before[name], rtol=0, atol=0)


def test_rmse_and_nll_equal_their_formulas():
    x, y = _data_m(n=25)
    model = DPKLRegressor(x, y, _net, num_particles=3, num_random_features=10)
    model.fit(num_steps=3)
    test_x, test_y = x[:7] + 0.1, y[:7]
    mean, var = model.predict(test_x)
    rmse = math.sqrt(sum((float(a) - float(b)) ** 2 for a, b in zip(test_y, mean, strict=True)) / 7)
    nll = (
        sum(
            0.5 * (float(a) - float(m)) ** 2 / float(v) + 0.5 * math.log(2 * math.pi * float(v))
            for a, m, v in zip(test_y, mean, var, strict=True)
        )
        / 7
    )
    assert model.rmse(test_x, test_y) == pytest.approx(rmse, rel=1e-12)
    assert model.nll(test_x, test_y) == pytest.approx(nll, rel=1e-12)


def _dropout_net(d_in=3, d_out=2):
    return nn.Sequential(nn.Linear(d_in, 16), nn.Tanh(), nn.Dropout(0.5), nn.Linear(16, d_out))


def _data_v(n=24):
    torch.set_default_dtype(torch.float64)
    x = torch.randn(n, 3)
    return x, torch.sin(x[:, 0])


def test_regressor_predictions_with_dropout_are_deterministic():
    x, y = _data_v()
    model = DPKLRegressor(x, y, _dropout_net, num_particles=3, num_random_features=5)
    model.fit(2)
    mean1, var1 = model.predict(x[:7])
    mean2, var2 = model.predict(x[:7])
    torch.testing.assert_close(mean1, mean2, rtol=0, atol=0)
    torch.testing.assert_close(var1, var2, rtol=0, atol=0)


def _data_s(n=24, d=3):
    torch.set_default_dtype(torch.float64)
    x = torch.randn(n, d)
    return x, torch.sin(x.sum(-1))


def _dropout_net_s():
    return nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Dropout(0.3), nn.Linear(16, 2))


def _small_regressor(x, y):
    net = lambda: nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2))  # noqa: E731
    return DPKLRegressor(x, y, net, num_particles=3, num_random_features=10)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda x, y: (x.masked_fill(x > 1.5, math.nan), y), "inputs must be finite"),
        (lambda x, y: (x, y.masked_fill(y > 0.5, math.inf)), "targets must be finite"),
        (lambda x, y: (x, y[:, None]), r"targets must have shape \(24,\)"),
        (lambda x, y: (x, y[:20]), r"targets must have shape \(24,\)"),
        (lambda x, y: (x[:, :2], y), "inputs must have 3 features"),
    ],
)
def test_set_train_data_checks_as_at_construction(change, message):
    x, y = _data_s()
    model = _small_regressor(x, y)
    new_x, new_y = change(x, y)
    with pytest.raises(ValueError, match=message):
        model.set_train_data(new_x, new_y, strict=False)
    with pytest.raises(ValueError, match="strict=True"):
        model.set_train_data(x[:20], y[:20])


def test_set_train_data_then_predict_equals_a_model_built_on_the_new_data():
    x, y = _data_s()
    model = _small_regressor(x, y)
    xs = torch.randn(5, 3)
    model.predict(xs)  # builds GPyTorch's prediction cache
    new_x, new_y = torch.randn(30, 3), torch.randn(30)
    # NumPy arrays, float32: converted to the model's dtype with strict=False
    model.set_train_data(new_x.float().numpy(), new_y.float().numpy(), strict=False)
    fresh = _small_regressor(new_x.float().double(), new_y.float().double())
    fresh.load_state_dict(model.state_dict())
    for a, b in zip(model.predict(xs), fresh.predict(xs), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    model.set_train_data(targets=-model.train_targets)  # strict: same shape, dtype, device
    fresh.set_train_data(targets=-fresh.train_targets)
    torch.testing.assert_close(model.predict(xs)[0], fresh.predict(xs)[0], rtol=1e-10, atol=1e-12)


def test_update_set_after_construction_sets_the_default_repulsion():
    # Before: fit read only the repulsion that the constructor derived from update, so
    # update = "svgd" set afterwards gave the same particles as "paper".
    x, y = _data_s(n=20)
    paper = _small_regressor(x, y)
    svgd, explicit = copy.deepcopy(paper), copy.deepcopy(paper)
    svgd.update = "svgd"
    explicit.repulsion = 1.0
    for model in (paper, svgd, explicit):
        model.fit(num_steps=3, optimizer=torch.optim.SGD(model.parameters(), lr=0.05))
    flat = [m.covar_module.feature_extractor.flat_parameters() for m in (paper, svgd, explicit)]
    torch.testing.assert_close(flat[1], flat[2], rtol=0, atol=0)
    assert (flat[0] - flat[1]).abs().max() > 1e-6
    explicit.repulsion = 0.5  # a value set by hand stays when update changes
    explicit.update = "paper"
    assert explicit.repulsion == 0.5
    explicit.repulsion = None  # back to the default of the current update
    assert explicit.repulsion == 0.0


def test_attributes_that_fit_reads_are_checked_when_set():
    x, y = _data_s(n=20)
    regressor = SSDPKLRegressor(x, y, _dropout_net_s, x, num_particles=2, num_random_features=5)
    classifier = DPKLClassifier(lambda: nn.Linear(3, 2), 3, num_particles=2)
    bad = [
        (regressor, "update", "adam"),
        (regressor, "repulsion", -1.0),
        (regressor, "bandwidth", 0.0),
        (regressor, "alpha", -5.0),
        (regressor, "alpha", math.nan),
        (classifier, "update", "adam"),
        (classifier, "bandwidth", "mean"),
    ]
    for model, name, value in bad:
        with pytest.raises(ValueError, match=name):
            setattr(model, name, value)
    regressor.alpha = np.float32(0.5)
    assert regressor.alpha == 0.5 and type(regressor.alpha) is float


def test_bandwidth_and_repulsion_accept_real_scalars():
    # Before: np.float32(2.0) and torch.tensor(2.0) were refused, unlike alpha, lr, prior_std.
    torch.manual_seed(0)
    params = [torch.randn(4, 3, requires_grad=True)]
    params[0].grad = torch.randn(4, 3)
    plain = SteinVariationalGradient(params, bandwidth=2.0, repulsion=0.5)
    scalars = SteinVariationalGradient(
        params, bandwidth=np.float32(2.0), repulsion=torch.tensor(0.5)
    )
    flat = params[0].detach()
    torch.testing.assert_close(
        scalars.direction(flat, params[0].grad), plain.direction(flat, params[0].grad)
    )
    x, y = _data_s(n=12)
    model = DPKLRegressor(
        x, y, _dropout_net_s, num_particles=2, bandwidth=torch.tensor(2.0), repulsion=np.int64(1)
    )
    assert model.bandwidth == 2.0 and model.repulsion == 1.0


def test_classifier_takes_the_extractors_device_and_a_buffer_only_extractor():
    # Before: the class weights and lengthscale were made on the CPU whatever the extractor's
    # device, and an extractor without parameters raised a bare StopIteration.
    meta = DPKLClassifier(nn.Linear(3, 2, device="meta"), 3, num_particles=1)
    assert meta.class_weights.device.type == "meta"
    assert meta.raw_lengthscale.device.type == "meta"
    buffers_only = DPKLClassifier(
        nn.BatchNorm1d(2, affine=False).to(torch.float64), 3, num_particles=2
    )
    assert buffers_only.class_weights.dtype == torch.float64
    p = buffers_only.predict_proba(torch.randn(4, 2))
    torch.testing.assert_close(p.sum(-1), torch.ones(4, dtype=torch.float64))


@requires_cuda
def test_classifier_on_cuda_keeps_its_parameters_there():
    classifier = DPKLClassifier(nn.Linear(3, 2).cuda(), 3, num_particles=2)
    assert classifier.class_weights.is_cuda and classifier.raw_lengthscale.is_cuda
    assert classifier.predict_proba(torch.randn(4, 3)).is_cuda


def _net_p():
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
    model = DPKLRegressor(x, y, _net_p, num_particles=3, num_random_features=20)
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
