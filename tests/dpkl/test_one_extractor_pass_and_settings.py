"""Review s23 of the DPKL models: one extractor pass for the posterior variance and SSDPKL's loss,
checked ``set_train_data``, validated attributes, the classifier's dtype and device."""

import copy
import math

import numpy as np
import pytest
import torch
from conftest import requires_cuda
from torch import nn

from gpsd.dpkl import (
    ARDGPRegressor,
    DPKLClassifier,
    DPKLRegressor,
    SSDPKLRegressor,
    SteinVariationalGradient,
)
from gpsd.dpkl._feature_kernel import FeatureKernel


def _data(n=24, d=3):
    torch.set_default_dtype(torch.float64)
    x = torch.randn(n, d)
    return x, torch.sin(x.sum(-1))


def _dropout_net():
    return nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Dropout(0.3), nn.Linear(16, 2))


def _batchnorm_net():
    return nn.Sequential(nn.Linear(3, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 2))


def _loop_embeddings(model, x, training):
    """``(m, n, d)`` by stand-alone copies of the particles in the given mode."""
    ensemble = model.covar_module.feature_extractor
    with torch.no_grad():
        return torch.stack(
            [ensemble.particle_module(i).train(training)(x) for i in range(ensemble.num_particles)]
        )


def _dense_kernel(model, z):
    """The prior kernel matrix of the rows of embeddings ``z`` (``(m, N, d)``), written out."""
    m, num_rows, _ = z.shape
    if model.kernel_type == "rff":
        rf = model.covar_module.random_features
        proj = (z / rf.lengthscale) @ rf.base_frequencies.mT  # shape: (m, N, R)
        f = torch.cat([proj.cos(), proj.sin()], -1) * (rf.outputscale / rf.num_features).sqrt()
        phi = f.mean(0)
        return phi @ phi.mT
    scaled = model.covar_module.base_kernel
    s, ell = scaled.outputscale, scaled.base_kernel.lengthscale
    flat = z.reshape(m * num_rows, -1)
    k = s * torch.exp(-torch.cdist(flat, flat).pow(2) / (2 * ell**2))
    return k.reshape(m, num_rows, m, num_rows).mean((0, 2))


def _dense_variance(k, n, noise):
    """diag(K_qq) - diag(K_qt (K_tt + noise I)^-1 K_tq) for the first n rows as training rows."""
    k_tt = k[:n, :n] + noise * torch.eye(n)
    k_qt = k[n:, :n]
    return k[n:, n:].diagonal() - (k_qt * torch.linalg.solve(k_tt, k_qt.mT).mT).sum(-1)


@pytest.mark.parametrize("kernel", ["exact", "rff"])
def test_training_mode_dropout_variance_is_one_psd_pass(kernel):
    # Before: k_xx, k_xt and k_tt came from three extractor passes with their own dropout masks:
    # sigma^2 down to -128 with the exact kernel (noise 1e-3), and an SSDPKL fit ran away
    # (loss 1.311 -> -1790 in 150 steps).
    x, y = _data()
    xq = torch.randn(10, 3)
    model = DPKLRegressor(
        x, y, _dropout_net, num_particles=3, num_random_features=30, kernel=kernel
    )
    model.likelihood.noise = 1e-3
    model.train()
    for seed in range(3):
        torch.manual_seed(seed)
        with torch.no_grad():
            got = model.latent_posterior_variance(xq)
            torch.manual_seed(seed)  # the same dropout masks, one pass over all rows
            z = model.covar_module.feature_extractor(torch.cat([x, xq]))
        ref = _dense_variance(_dense_kernel(model, z), x.shape[0], 1e-3)
        assert got.min() > -1e-10
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-10)


@pytest.mark.parametrize("kernel", ["exact", "rff"])
def test_batchnorm_regulariser_sees_the_unlabelled_rows_in_one_batch(kernel):
    # Before (rff): the unlabelled rows were normalised by their own batch statistics, so the
    # regulariser was 0.0556 whether they were shifted by 0, 5 or 50 (one joint batch: 0.0555,
    # 0.2405, 0.2311).
    x, y = _data()
    xu = torch.randn(15, 3)
    model = SSDPKLRegressor(
        x, y, _batchnorm_net, xu, num_particles=3, num_random_features=30, kernel=kernel
    )
    noise = model.likelihood.noise.detach()
    model.train()
    values = []
    for shift in (0.0, 5.0):
        z = _loop_embeddings(model, torch.cat([x, xu + shift]), training=True)
        ref = _dense_variance(_dense_kernel(model, z), x.shape[0], noise).mean()
        with torch.no_grad():
            values.append(model.regulariser(xu + shift))
        torch.testing.assert_close(values[-1], ref, rtol=1e-7, atol=1e-12)
    assert values[1] > 1.5 * values[0]
    # in evaluation mode (running statistics) the result is the dense formula as before
    model.eval()
    z = _loop_embeddings(model, torch.cat([x, xu]), training=False)
    ref = _dense_variance(_dense_kernel(model, z), x.shape[0], noise)
    with torch.no_grad():
        torch.testing.assert_close(model.latent_posterior_variance(xu), ref, rtol=1e-7, atol=1e-12)


@pytest.mark.parametrize("kernel", ["exact", "rff"])
def test_ssdpkl_training_loss_is_one_joint_pass_per_step(kernel):
    # Before: three extractor passes per step (labelled rows twice, unlabelled once), so the
    # BatchNorm running statistics were updated three times per step.
    x, y = _data()
    xu = torch.randn(15, 3)
    model = SSDPKLRegressor(
        x, y, _batchnorm_net, xu, num_particles=3, num_random_features=30, alpha=0.7, kernel=kernel
    )
    ensemble = model.covar_module.feature_extractor
    calls = []
    ensemble.register_forward_hook(lambda module, args, out: calls.append(args[0].shape[0]))
    z = _loop_embeddings(model, torch.cat([x, xu]), training=True)
    k = _dense_kernel(model, z)
    n, noise, c = x.shape[0], model.likelihood.noise.detach(), model.mean_module.constant.detach()
    cov = k[:n, :n] + noise * torch.eye(n)
    nll = -torch.distributions.MultivariateNormal(c.expand(n), cov).log_prob(y) / n
    ref = nll + 0.7 * _dense_variance(k, n, noise).mean()
    torch.testing.assert_close(model.training_loss().detach(), ref, rtol=1e-8, atol=1e-12)
    assert calls == [n + 15]
    model.fit(num_steps=2, lr=0.01)
    assert calls == [n + 15] * 3
    tracked = [v for k, v in ensemble.state_dict().items() if "num_batches_tracked" in k]
    assert all(bool((t == 3).all()) for t in tracked)


def test_training_loss_in_eval_mode_is_the_marginal_likelihood():
    # Before: in evaluation mode model(train_x) is GPyTorch's posterior, and the "loss" was not
    # the marginal likelihood.
    x, y = _data()
    model = DPKLRegressor(x, y, _dropout_net, num_particles=3, num_random_features=30)
    model.eval()
    z = _loop_embeddings(model, x, training=False)
    n, noise, c = x.shape[0], model.likelihood.noise.detach(), model.mean_module.constant.detach()
    cov = _dense_kernel(model, z) + noise * torch.eye(n)
    ref = -torch.distributions.MultivariateNormal(c.expand(n), cov).log_prob(y) / n
    torch.testing.assert_close(model.training_loss().detach(), ref, rtol=1e-8, atol=1e-12)


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
    x, y = _data()
    model = _small_regressor(x, y)
    new_x, new_y = change(x, y)
    with pytest.raises(ValueError, match=message):
        model.set_train_data(new_x, new_y, strict=False)
    with pytest.raises(ValueError, match="strict=True"):
        model.set_train_data(x[:20], y[:20])


def test_set_train_data_then_predict_equals_a_model_built_on_the_new_data():
    x, y = _data()
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
    x, y = _data(n=20)
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
    x, y = _data(n=20)
    regressor = SSDPKLRegressor(x, y, _dropout_net, x, num_particles=2, num_random_features=5)
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
    x, y = _data(n=12)
    model = DPKLRegressor(
        x, y, _dropout_net, num_particles=2, bandwidth=torch.tensor(2.0), repulsion=np.int64(1)
    )
    assert model.bandwidth == 2.0 and model.repulsion == 1.0


@pytest.mark.parametrize("value", [0.0, -1.0, math.nan, math.inf])
def test_classifier_lengthscale_must_be_positive_and_finite(value):
    # Before: lengthscale = 0 stored raw -inf and predict_proba returned NaN.
    classifier = DPKLClassifier(lambda: nn.Linear(3, 2), 3, num_particles=2)
    with pytest.raises(ValueError, match="lengthscale must be a positive float"):
        classifier.lengthscale = value
    assert classifier.lengthscale.item() == pytest.approx(1.0)


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


def test_ard_regressor_without_input_columns_names_the_inputs():
    # Before: "initial_lengthscale must be a positive float, got 0.0".
    with pytest.raises(ValueError, match="train_x must have at least one feature"):
        ARDGPRegressor(torch.randn(5, 0), torch.randn(5))


def test_feature_kernel_needs_features_and_their_covariance():
    """The shared base is abstract: a subclass without the two methods cannot be built."""

    class Incomplete(FeatureKernel):
        def features(self, x):
            return x

    for cls in (FeatureKernel, Incomplete):
        with pytest.raises(TypeError, match="feature_covariance"):
            cls()
