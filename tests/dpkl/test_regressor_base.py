"""Tests of what the DPKL-family regressors share (``_regressor_base``): the convention of
``fit`` and ``predict`` on all four, argument checks, ``set_train_data``, predictions after a
change of state, and the settings that ``fit`` reads."""

import copy
import io
import math

import gpytorch
import numpy as np
import pytest
import torch
from dpkl_reference import paper_dpkl, sum_sine_data
from torch import nn

import gpsd
from gpsd.dpkl import (
    ARDGPRegressor,
    DKLRegressor,
    DPKLClassifier,
    SSDPKLRegressor,
    SteinVariationalGradient,
)


def _net(d_in=3, d_out=2):
    return nn.Sequential(nn.Linear(d_in, 8), nn.Tanh(), nn.Linear(8, d_out))


def _dropout_net(d_in=3, d_out=2):
    return nn.Sequential(nn.Linear(d_in, 16), nn.Tanh(), nn.Dropout(0.5), nn.Linear(16, d_out))


def _small_regressor(x, y):
    return paper_dpkl(x, y, _net, num_particles=3, num_random_features=10)


_MAKERS = {
    "DPKLRegressor": lambda x, y: paper_dpkl(x, y, _net, num_particles=2, num_random_features=6),
    "SSDPKLRegressor": lambda x, y: SSDPKLRegressor(
        x, y, _net, unlabelled_x=x + 0.5, num_particles=2, num_random_features=6
    ),
    "DKLRegressor": lambda x, y: DKLRegressor(x, y, _net),
    "ARDGPRegressor": lambda x, y: ARDGPRegressor(x, y),
}
_REGRESSORS = pytest.mark.parametrize("name", list(_MAKERS))


# ---------------------------------------------------------------------- the convention
@_REGRESSORS
def test_fit_returns_the_model_and_keeps_a_history(name):
    x, y = sum_sine_data(n=16)
    model = _MAKERS[name](x, y)
    assert model.history["loss"] == []
    assert model.fit(max_iter=3, lr=0.01) is model
    assert len(model.history["loss"]) == 3 and model.history["val_nll"] == []
    assert not model.training  # left in evaluation mode


@_REGRESSORS
def test_predicting_before_fit_raises_not_fitted_error(name):
    x, y = sum_sine_data(n=12)
    model = _MAKERS[name](x, y)
    xs = x + 0.1
    for call in (
        lambda: model.predict(xs),
        lambda: model.nll(xs, y),
        lambda: model.rmse(xs, y),
        lambda: model.eval()(xs),
    ):
        with pytest.raises(gpsd.NotFittedError, match=r"call fit\(\)"):
            call()
    model.train()
    model.fit(max_iter=1)
    assert model.predict(xs).mean.shape == (12,)


@_REGRESSORS
def test_predict_is_latent_by_default_and_include_noise_adds_the_noise(name):
    x, y = sum_sine_data(n=16)
    model = _MAKERS[name](x, y).fit(max_iter=2)
    xs = torch.randn(5, 3)
    latent = model.predict(xs)
    observed = model.predict(xs, include_noise=True)
    assert isinstance(latent, gpsd.Prediction) and latent.mean.shape == (5,)
    noise = model.likelihood.noise.detach().expand(5)
    torch.testing.assert_close(observed.mean, latent.mean, rtol=0, atol=0)
    torch.testing.assert_close(observed.variance, latent.variance + noise)
    torch.testing.assert_close(latent.stddev, latent.variance.sqrt())
    with torch.no_grad():
        mvn = model(xs)
    assert isinstance(mvn, gpytorch.distributions.MultivariateNormal)
    torch.testing.assert_close(mvn.mean, latent.mean)
    torch.testing.assert_close(mvn.variance, latent.variance)


@_REGRESSORS
def test_a_callback_returning_true_stops_fit_after_that_iteration(name):
    x, y = sum_sine_data(n=16)
    model = _MAKERS[name](x, y)
    records = []

    def callback(record):
        records.append(record)
        return record.iteration == 3

    model.fit(max_iter=10, callback=callback)
    assert [r.iteration for r in records] == [1, 2, 3]
    assert all(r.total == 10 and r.task == f"{name}.fit" for r in records)
    assert [r.loss for r in records] == model.history["loss"]
    assert model.predict(x + 0.1).mean.shape == (16,)  # fitted with what it reached


def test_a_callback_stop_with_validation_keeps_the_best_checked_state():
    x, y = sum_sine_data(n=20)
    xv, yv = sum_sine_data(n=10)
    model = _small_regressor(x, y)
    records = []
    model.fit(
        max_iter=20,
        lr=0.05,
        val_x=xv,
        val_y=yv,
        check_every=2,
        callback=lambda r: records.append(r) or r.iteration == 5,
    )
    assert [r.iteration for r in records] == [1, 2, 3, 4, 5]
    assert [("val_nll" in r.info) for r in records] == [False, True, False, True, False]
    assert model.history["val_iteration"] == [0, 2, 4, 5]  # a last check where it stopped
    assert records[1].info["val_nll"] == model.history["val_nll"][1]
    assert math.isclose(model.nll(xv, yv), min(model.history["val_nll"]), rel_tol=1e-9)


def test_progress_true_shows_a_bar_and_a_bar_of_ones_own_is_advanced(capsys):
    tqdm = pytest.importorskip("tqdm")
    x, y = sum_sine_data(n=12)
    model = _small_regressor(x, y)
    model.fit(max_iter=3, progress=True)
    assert "DPKLRegressor.fit" in capsys.readouterr().err
    bar = tqdm.tqdm(total=3, file=io.StringIO())
    model.fit(max_iter=3, progress=bar)
    assert bar.n == 3
    bar.close()
    with pytest.raises(TypeError, match="progress"):
        model.fit(max_iter=1, progress="yes")
    with pytest.raises(TypeError, match="callback"):
        model.fit(max_iter=1, callback=3)


def test_a_model_given_a_trained_state_is_fitted():
    x, y = sum_sine_data(n=16)
    trained = _small_regressor(x, y).fit(max_iter=2)
    fresh = _small_regressor(x, y)
    with pytest.raises(gpsd.NotFittedError):
        fresh.predict(x)
    fresh.load_state_dict(trained.state_dict())
    torch.testing.assert_close(fresh.predict(x + 0.1).mean, trained.predict(x + 0.1).mean)


def test_a_copy_predicts_as_the_original():
    x, y = sum_sine_data(n=16)
    model = _small_regressor(x, y).fit(max_iter=2)
    first = model.predict(x[:4])
    twin = copy.deepcopy(model)
    torch.testing.assert_close(twin.predict(x[:4]).mean, first.mean, rtol=0, atol=0)


# ---------------------------------------------------------------------- argument checks
@pytest.mark.parametrize("lr", ["0.01", True, torch.tensor([0.1, 0.2])])
def test_fit_names_a_bad_lr(lr):
    # a string, a bool (not a learning rate of 1.0) and a tensor of two elements
    x, y = sum_sine_data(n=12)
    model = paper_dpkl(x, y, lambda: nn.Linear(3, 2), num_particles=2, num_random_features=3)
    with pytest.raises(ValueError, match="lr"):
        model.fit(max_iter=1, lr=lr)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_iter=-1), "max_iter must be a non-negative int"),
        (dict(max_iter=2.0), "max_iter"),
        (dict(max_iter=True), "max_iter"),
        (dict(lr=0.0), "lr must be a positive float"),
        (dict(lr=float("nan")), "lr"),
        (dict(val_x=torch.zeros(3, 3, dtype=torch.float64)), "val_x and val_y"),
        (dict(check_every=0), "check_every must be a positive int"),
        (dict(check_every=2.5), "check_every"),
        (
            dict(val_x=torch.zeros(3, 5, dtype=torch.float64), val_y=torch.zeros(3)),
            "val_x must have 3 features",
        ),
        (
            dict(val_x=torch.zeros(3, 3, dtype=torch.float64), val_y=torch.zeros(2)),
            "val_y",
        ),
    ],
)
def test_fit_names_the_bad_argument(kwargs, match):
    x, y = sum_sine_data(n=20)
    model = paper_dpkl(x, y, _net, num_particles=2, num_random_features=5)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=match):
        model.fit(**kwargs)
    for name, value in model.state_dict().items():  # nothing was trained
        torch.testing.assert_close(value, before[name], rtol=0, atol=0)
    with pytest.raises(TypeError):
        model.fit(3)  # keyword-only


def test_rmse_and_nll_equal_their_formulas():
    x, y = sum_sine_data(n=25)
    model = _small_regressor(x, y).fit(max_iter=3)
    test_x, test_y = x[:7] + 0.1, y[:7]
    pred = model.predict(test_x, include_noise=True)
    mean, var = pred.mean, pred.variance
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


def test_predictions_with_dropout_are_deterministic():
    x, y = sum_sine_data()
    model = paper_dpkl(x, y, _dropout_net, num_particles=3, num_random_features=5)
    model.fit(max_iter=2)
    first, second = model.predict(x[:7]), model.predict(x[:7])
    torch.testing.assert_close(first.mean, second.mean, rtol=0, atol=0)
    torch.testing.assert_close(first.variance, second.variance, rtol=0, atol=0)


# ---------------------------------------------------------------------- set_train_data
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
    x, y = sum_sine_data()
    model = _small_regressor(x, y)
    new_x, new_y = change(x, y)
    with pytest.raises(ValueError, match=message):
        model.set_train_data(new_x, new_y, strict=False)
    with pytest.raises(ValueError, match="strict=True"):
        model.set_train_data(x[:20], y[:20])


def test_set_train_data_then_predict_equals_a_model_built_on_the_new_data():
    x, y = sum_sine_data()
    model = _small_regressor(x, y).fit(max_iter=0)
    xs = torch.randn(5, 3)
    model.predict(xs)  # builds GPyTorch's prediction cache
    new_x, new_y = torch.randn(30, 3), torch.randn(30)
    # NumPy arrays, float32: converted to the model's dtype with strict=False
    model.set_train_data(new_x.float().numpy(), new_y.float().numpy(), strict=False)
    fresh = _small_regressor(new_x.float().double(), new_y.float().double())
    fresh.load_state_dict(model.state_dict())
    a, b = model.predict(xs), fresh.predict(xs)
    torch.testing.assert_close(a.mean, b.mean, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(a.variance, b.variance, rtol=1e-10, atol=1e-12)
    model.set_train_data(targets=-model.train_targets)  # strict: same shape, dtype, device
    fresh.set_train_data(targets=-fresh.train_targets)
    torch.testing.assert_close(
        model.predict(xs).mean, fresh.predict(xs).mean, rtol=1e-10, atol=1e-12
    )


# ---------------------------------------------------------------------- predictions after changes
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


def _trained_model():
    torch.manual_seed(0)
    x = torch.randn(40, 3, dtype=torch.float64)
    y = torch.sin(x[:, 0])
    model = paper_dpkl(x, y, _net, num_particles=3, num_random_features=20)
    model.fit(max_iter=3, lr=0.01)  # leaves the model in evaluation mode
    return model, x, torch.randn(6, 3, dtype=torch.float64)


def _check(model, x, xs):
    pred = model.predict(xs)
    want_mean, want_var = _dense_posterior(model, x, xs)
    torch.testing.assert_close(pred.mean, want_mean, rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(pred.variance, want_var, rtol=1e-8, atol=1e-11)
    return pred.variance


def test_predict_uses_a_noise_set_after_the_first_prediction():
    # GPyTorch's ExactGP would keep the prediction cache of its first evaluation-mode call
    model, x, xs = _trained_model()
    before = _check(model, x, xs)
    model.likelihood.noise = 0.5
    after = _check(model, x, xs)
    assert (after - before).abs().max() > 1e-3
    torch.testing.assert_close(after, model.latent_posterior_variance(xs).detach())


def test_predict_uses_resampled_features_and_loaded_state():
    model, x, xs = _trained_model()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    first = _check(model, x, xs)
    model.covar_module.random_features.resample(torch.Generator().manual_seed(3))
    assert (_check(model, x, xs) - first).abs().max() > 1e-6
    model.load_state_dict(saved)
    torch.testing.assert_close(_check(model, x, xs), first, rtol=0, atol=0)


def test_model_call_with_grad_differentiates_through_the_training_data():
    model, x, xs = _trained_model()
    for _ in range(2):  # a second backward pass needs a fresh graph, not the cached one
        model.zero_grad()
        model(xs).mean.sum().backward()
        grad = model.mean_module.constant.grad
        assert grad is not None and torch.isfinite(grad).all()


# ---------------------------------------------------------------------- settings fit reads
def test_update_set_after_construction_sets_the_default_repulsion():
    # fit reads update and repulsion when it is called: "svgd" set later repels the particles
    x, y = sum_sine_data(n=20)
    paper = _small_regressor(x, y)
    svgd, explicit = copy.deepcopy(paper), copy.deepcopy(paper)
    svgd.update = "svgd"
    explicit.repulsion = 1.0
    for model in (paper, svgd, explicit):
        model.fit(max_iter=3, optimizer=torch.optim.SGD(model.parameters(), lr=0.05))
    flat = [m.covar_module.feature_extractor.flat_parameters() for m in (paper, svgd, explicit)]
    torch.testing.assert_close(flat[1], flat[2], rtol=0, atol=0)
    assert (flat[0] - flat[1]).abs().max() > 1e-6
    explicit.repulsion = 0.5  # a value set by hand stays when update changes
    explicit.update = "paper"
    assert explicit.repulsion == 0.5
    explicit.repulsion = None  # back to the default of the current update
    assert explicit.repulsion == 0.0


def test_attributes_that_fit_reads_are_checked_when_set():
    x, y = sum_sine_data(n=20)
    regressor = SSDPKLRegressor(
        x, y, _dropout_net, unlabelled_x=x, num_particles=2, num_random_features=5
    )
    classifier = DPKLClassifier(x, torch.arange(20) % 3, lambda: nn.Linear(3, 2), num_particles=2)
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
    x, y = sum_sine_data(n=12)
    model = paper_dpkl(
        x, y, _dropout_net, num_particles=2, bandwidth=torch.tensor(2.0), repulsion=np.int64(1)
    )
    assert model.bandwidth == 2.0 and model.repulsion == 1.0
