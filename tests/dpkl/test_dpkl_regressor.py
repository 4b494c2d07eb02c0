"""Tests of DPKLRegressor: its loss, gradients and predictions against dense formulas over
stand-alone particles, its checks, and its rough edges (1-D inputs, a network giving NaN)."""

import copy
import io
import math

import gpytorch
import pytest
import torch
from conftest import requires_cuda
from dpkl_reference import (
    dense_kernel,
    dense_variance,
    loop_embeddings,
    loop_mean_features,
    noisy_sine_data,
    paper_dpkl,
    sum_sine_data,
    tanh_net,
)
from torch import nn

import gpsd
from gpsd.dpkl import (
    DKLRegressor,
    DPKLClassifier,
    DPKLRegressor,
    SSDPKLRegressor,
    SteinVariationalGradient,
    sample_spectral_frequencies,
)

DT = torch.float64


def _dropout_net():
    return nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Dropout(0.3), nn.Linear(16, 2))


def _batchnorm_net():
    return nn.Sequential(nn.Linear(3, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 2)).double()


def _pretrained_frozen_body():
    net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2))
    net[0].requires_grad_(False)  # a pretrained layer the user froze
    return net


def _dense_loss(model, x, y):
    phi = loop_mean_features(model, x)
    cov = phi @ phi.mT + model.likelihood.noise * torch.eye(x.shape[0])
    mean = model.mean_module.constant.expand(x.shape[0])
    return -torch.distributions.MultivariateNormal(mean, covariance_matrix=cov).log_prob(y)


def test_loss_and_particle_gradients_equal_dense():
    x, y = noisy_sine_data(n=40)
    model = paper_dpkl(x, y, tanh_net, num_particles=3, num_random_features=5)
    model.likelihood.noise = 0.2
    loss = model.training_loss() * x.shape[0]
    params = model.particle_parameters()
    g = torch.autograd.grad(loss, params)
    dense = _dense_loss(model, x, y)
    h = torch.autograd.grad(dense, params)
    assert abs(loss.item() - dense.item()) < 1e-8
    for a, b in zip(g, h, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-10)


def test_predictions_equal_dense_gp_formula():
    x, y = noisy_sine_data(n=25)
    model = paper_dpkl(x, y, tanh_net, num_particles=3, num_random_features=20).fit(max_iter=0)
    xs = torch.randn(7, 4)
    latent = model.predict(xs)
    observed = model.predict(xs, include_noise=True)
    with torch.no_grad():
        phi, phis = loop_mean_features(model, x), loop_mean_features(model, xs)
        noise, c = model.likelihood.noise, model.mean_module.constant
        kxx = phi @ phi.mT + noise * torch.eye(25)
        ks = phis @ phi.mT
        ref_mean = c + ks @ torch.linalg.solve(kxx, y - c)
        ref_var = (phis**2).sum(-1) - (ks * torch.linalg.solve(kxx, ks.mT).mT).sum(-1)
    for pred, add in ((latent, 0.0), (observed, noise)):
        torch.testing.assert_close(pred.mean, ref_mean, rtol=1e-7, atol=1e-9)
        torch.testing.assert_close(pred.variance, ref_var + add, rtol=1e-7, atol=1e-9)
    # model(test_x) is the latent MultivariateNormal
    with torch.no_grad():
        mvn = model(xs)
    assert isinstance(mvn, gpytorch.distributions.MultivariateNormal)
    torch.testing.assert_close(mvn.mean, ref_mean, rtol=1e-7, atol=1e-9)
    torch.testing.assert_close(mvn.variance, ref_var, rtol=1e-7, atol=1e-9)


def test_single_particle_functional_gradient_is_plain_gradient():
    x, y = noisy_sine_data(n=20)
    model = paper_dpkl(x, y, tanh_net, num_particles=1, num_random_features=10, update="svgd")
    model.training_loss().backward()
    params = model.particle_parameters()
    before = [p.grad.clone() for p in params]
    SteinVariationalGradient(params, repulsion=1.0).transform_()
    for a, b in zip(before, params, strict=True):
        torch.testing.assert_close(a, b.grad)


def test_fit_early_stopping_restores_the_best_checked_state_and_it_roundtrips():
    x, y = noisy_sine_data(n=40)
    xv, yv = noisy_sine_data(n=15)
    model = paper_dpkl(x, y, tanh_net, num_particles=4, num_random_features=20, update="svgd")
    first = model.training_loss().item()
    assert model.fit(max_iter=40, lr=0.02, val_x=xv, val_y=yv, check_every=10) is model
    hist = model.history
    assert len(hist["loss"]) == 40 and len(hist["val_nll"]) == 5
    assert hist["val_iteration"] == [0, 10, 20, 30, 40]
    assert hist["loss"][-1] < first
    # the restored state is the best checked one
    assert math.isclose(model.nll(xv, yv), min(hist["val_nll"]), rel_tol=1e-9)
    pred = model.predict(xv)
    assert pred.mean.shape == (15,) and (pred.variance > 0).all()
    other = paper_dpkl(x, y, tanh_net, num_particles=4, num_random_features=20)
    other.load_state_dict(model.state_dict())  # a trained state: the model is fitted
    torch.testing.assert_close(other.predict(xv).mean, pred.mean)
    assert model.embed(xv).shape == (4, 15, 2)


def test_float32_and_orthogonal_matern_variant():
    torch.set_default_dtype(torch.float32)
    x = torch.randn(30, 4)
    y = torch.randn(30)
    model = paper_dpkl(
        x, y, tanh_net, num_particles=3, num_random_features=8, orthogonal=True, nu=1.5
    )
    model.fit(max_iter=3)
    pred = model.predict(x[:5])
    assert pred.mean.dtype == torch.float32 and torch.isfinite(pred.variance).all()


def test_constructor_names_the_bad_argument():
    x, y = noisy_sine_data(n=20)
    with pytest.raises(ValueError, match="num_particles"):
        paper_dpkl(x, y, tanh_net, num_particles=0)
    with pytest.raises(ValueError, match="R"):
        paper_dpkl(x, y, tanh_net, num_random_features=0)
    with pytest.raises(ValueError, match="latent_dim"):
        paper_dpkl(x, y, lambda: tanh_net(4, 3), latent_dim=2)
    with pytest.raises(ValueError, match="bandwidth"):
        paper_dpkl(x, y, tanh_net, bandwidth=-2.0)
    with pytest.raises(ValueError, match="repulsion"):
        paper_dpkl(x, y, tanh_net, update="svgd", repulsion=-1.0)
    bad = x.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="train_x"):
        paper_dpkl(bad, y, tanh_net)
    bad_y = y.clone()
    bad_y[3] = float("inf")
    with pytest.raises(ValueError, match="train_y"):
        paper_dpkl(x, bad_y, tanh_net)
    with pytest.raises(ValueError, match="train_y"):
        paper_dpkl(x, y[:-1], tanh_net)
    with pytest.raises(ValueError, match="update"):
        paper_dpkl(x, y, tanh_net, update="adam")
    with pytest.raises(TypeError, match="mean_module"):
        paper_dpkl(x, y, tanh_net, mean_module=gpytorch.kernels.RBFKernel())
    model = paper_dpkl(x, y, tanh_net, num_particles=2, num_random_features=5).fit(max_iter=1)
    with pytest.raises(ValueError, match="test_x must have 4 features"):
        model.predict(torch.randn(3, 5))


def test_one_dimensional_train_x_is_one_feature():
    torch.set_default_dtype(torch.float64)
    x = torch.linspace(-2, 2, 20)
    y = torch.sin(x)
    torch.manual_seed(1)
    flat = paper_dpkl(x, y, lambda: tanh_net(1), num_particles=2, num_random_features=6)
    torch.manual_seed(1)
    column = paper_dpkl(x[:, None], y, lambda: tanh_net(1), num_particles=2, num_random_features=6)
    assert flat.train_inputs[0].shape == (20, 1)
    flat.fit(max_iter=2)
    column.fit(max_iter=2)
    xs = torch.linspace(-1, 1, 5)
    torch.testing.assert_close(flat.predict(xs).mean, column.predict(xs[:, None]).mean)
    torch.testing.assert_close(flat.predict(xs).variance, column.predict(xs[:, None]).variance)


class _SqrtNet(nn.Module):
    """A network whose output is NaN where its linear layer is negative."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 2)

    def forward(self, x):
        return self.linear(x).sqrt()


@pytest.mark.parametrize("kernel", ["rff", "exact"])
def test_a_network_that_gives_nan_is_named_in_fit_and_predict(kernel):
    x, y = sum_sine_data(n=20)
    model = paper_dpkl(
        x, y, _SqrtNet, num_particles=2, num_random_features=6, embedding_kernel=kernel
    )
    with pytest.raises(ValueError, match=r"feature_extractor produced NaN or inf .* iteration 1"):
        model.fit(max_iter=3)
    healthy = paper_dpkl(
        x, y, tanh_net(3), num_particles=2, num_random_features=6, embedding_kernel=kernel
    )
    healthy.fit(max_iter=1)
    with torch.no_grad():  # a network that turns NaN after training
        healthy.covar_module.feature_extractor.particle_parameters["2__bias"].fill_(math.nan)
    with pytest.raises(ValueError, match="feature_extractor produced NaN or inf"):
        healthy.predict(x[:3])
    with pytest.raises(ValueError, match="feature_extractor produced NaN or inf"):
        with torch.no_grad():
            healthy(x[:3])


def test_a_network_that_turns_nan_during_fit_names_the_iteration():
    x, y = sum_sine_data(n=20)
    model = paper_dpkl(x, y, tanh_net(3), num_particles=2, num_random_features=6)

    def poison(record):
        if record.iteration == 2:
            with torch.no_grad():
                model.covar_module.feature_extractor.particle_parameters["0__weight"].fill_(
                    math.inf
                )

    with pytest.raises(ValueError, match=r"feature_extractor .* at iteration 3\)"):
        model.fit(max_iter=5, callback=poison)


@requires_cuda
def test_cuda():
    x, y = noisy_sine_data(n=30)
    model = paper_dpkl(x.cuda(), y.cuda(), tanh_net, num_particles=3, num_random_features=8)
    model.fit(max_iter=3)
    mean = model.predict(x[:4].cuda()).mean
    assert mean.device.type == "cuda"
    cpu = paper_dpkl(x, y, tanh_net, num_particles=3, num_random_features=8)
    cpu.load_state_dict({k: v.cpu() for k, v in model.state_dict().items()})
    torch.testing.assert_close(cpu.predict(x[:4]).mean, mean.cpu(), rtol=1e-6, atol=1e-6)


def test_regressors_name_a_feature_extractor_of_the_wrong_input_width():
    x, y = sum_sine_data(10)
    wide = torch.randn(10, 4)
    net = lambda: tanh_net(3)  # noqa: E731
    for make in (
        lambda: paper_dpkl(wide, y, net),
        lambda: DKLRegressor(wide, y, net),
        lambda: SSDPKLRegressor(wide, y, net, unlabelled_x=torch.randn(5, 4)),
    ):
        with pytest.raises(ValueError, match="train_x with 4 features does not fit"):
            make()


def test_bad_nu_is_a_value_error():
    x, y = sum_sine_data(10)
    for kernel in ("rff", "exact"):
        with pytest.raises(ValueError, match="nu must be"):
            paper_dpkl(x, y, lambda: tanh_net(3), embedding_kernel=kernel, nu=0.7)
    # nu = 0 or inf would give NaN frequencies, a negative nu a shape error
    for nu in (0.0, -1.0, float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match="nu must be"):
            sample_spectral_frequencies(5, 2, nu=nu)
    for bad in (2.5, True, 0):
        with pytest.raises(ValueError, match="num_features"):
            sample_spectral_frequencies(bad, 2)
    freq = sample_spectral_frequencies(5, 2, nu=0.75, generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(freq).all()


def test_fits_leave_frozen_parameters_alone():
    x, y = sum_sine_data(24)
    net = _pretrained_frozen_body()
    model = paper_dpkl(x, y, net, num_particles=3, num_random_features=5)
    params = model.covar_module.feature_extractor.stacked_parameters()
    body, head = params["0.weight"].detach().clone(), params["2.weight"].detach().clone()
    model.fit(max_iter=3, lr=1e-2)
    torch.testing.assert_close(params["0.weight"], body, rtol=0, atol=0)
    assert not torch.equal(params["2.weight"], head)

    labels = (x[:, 0] > 0).long()
    clf = DPKLClassifier(x, labels, net, num_particles=3, num_weight_particles=2)
    params = clf.feature_extractor.stacked_parameters()
    body, head = params["0.weight"].detach().clone(), params["2.weight"].detach().clone()
    clf.fit(max_iter=1, batch_size=12, lr=1e-2)
    torch.testing.assert_close(params["0.weight"], body, rtol=0, atol=0)
    assert not torch.equal(params["2.weight"], head)
    net.requires_grad_(False)  # nothing trainable in the extractor: the classifier still fits
    clf = DPKLClassifier(x, labels, net, num_particles=2, num_weight_particles=2)
    weights = clf.class_weights.detach().clone()
    clf.fit(max_iter=1, batch_size=12, lr=1e-2)
    assert not torch.equal(clf.class_weights, weights)


def test_embed_runs_the_networks_in_evaluation_mode():
    torch.manual_seed(0)
    x, y = torch.randn(40, 5, dtype=DT), torch.randn(40, dtype=DT)

    def net():
        return nn.Sequential(
            nn.Linear(5, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 2)
        ).to(DT)

    model = paper_dpkl(x, y, net, num_particles=3, num_random_features=20)
    model.train()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    first, second = model.embed(x), model.embed(x)
    assert torch.equal(first, second)  # no dropout
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
    assert model.training and model.covar_module.feature_extractor.training
    # an independent evaluation: each particle's network on its own, in evaluation mode
    ensemble = model.covar_module.feature_extractor
    for i in range(3):
        particle = ensemble.particle_module(i).eval()
        with torch.no_grad():
            torch.testing.assert_close(first[i], particle(x), rtol=1e-12, atol=1e-12)


def test_batchnorm_network_constructs_fits_and_predicts():
    torch.manual_seed(0)
    x = torch.randn(30, 3, dtype=torch.float64)
    y = torch.sin(x.sum(-1))
    # the one-row width check runs in evaluation mode, where BatchNorm takes one row
    model = paper_dpkl(x, y, _batchnorm_net, num_particles=3, num_random_features=20)
    assert model.covar_module.feature_extractor.training  # the check left training mode on
    stats = model.covar_module.feature_extractor.state_dict()
    stats = {k: v.clone() for k, v in stats.items() if "running" in k}
    assert all(torch.equal(v, torch.zeros_like(v)) for k, v in stats.items() if "mean" in k)
    model.fit(max_iter=3, lr=0.01)
    pred = model.predict(torch.randn(7, 3, dtype=torch.float64))
    assert torch.isfinite(pred.mean).all() and (pred.variance > 0).all()


@pytest.mark.parametrize("kernel", ["exact", "rff"])
def test_training_mode_dropout_variance_is_one_psd_pass(kernel):
    # k_xx, k_xt and k_tt are blocks of one kernel matrix from one extractor pass (one dropout
    # mask per row): with three passes sigma^2 reached -128 with the exact kernel (noise 1e-3)
    x, y = sum_sine_data()
    xq = torch.randn(10, 3)
    model = paper_dpkl(
        x, y, _dropout_net, num_particles=3, num_random_features=30, embedding_kernel=kernel
    )
    model.likelihood.noise = 1e-3
    model.train()
    for seed in range(3):
        torch.manual_seed(seed)
        with torch.no_grad():
            got = model.latent_posterior_variance(xq)
            torch.manual_seed(seed)  # the same dropout masks, one pass over all rows
            z = model.covar_module.feature_extractor(torch.cat([x, xq]))
        ref = dense_variance(dense_kernel(model, z), x.shape[0], 1e-3)
        assert got.min() > -1e-10
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-10)


def test_training_loss_in_eval_mode_is_the_marginal_likelihood():
    # in evaluation mode GPyTorch's model(train_x) is the posterior; the loss stays the prior's
    x, y = sum_sine_data()
    model = paper_dpkl(x, y, _dropout_net, num_particles=3, num_random_features=30)
    model.eval()
    z = loop_embeddings(model, x, training=False)
    n, noise, c = x.shape[0], model.likelihood.noise.detach(), model.mean_module.constant.detach()
    cov = dense_kernel(model, z) + noise * torch.eye(n)
    ref = -torch.distributions.MultivariateNormal(c.expand(n), cov).log_prob(y) / n
    torch.testing.assert_close(model.training_loss().detach(), ref, rtol=1e-8, atol=1e-12)


def test_not_fitted_error_is_a_gpsd_error_and_a_runtime_error():
    x, y = noisy_sine_data(n=10)
    model = paper_dpkl(x, y, tanh_net, num_particles=2, num_random_features=4)
    with pytest.raises(gpsd.NotFittedError, match=r"call fit\(\)") as info:
        model.predict(x)
    assert isinstance(info.value, RuntimeError) and isinstance(info.value, gpsd.GpsdError)


def _dense_validation_nll(model, x, y, xv, yv):
    """Gaussian predictive NLL per point at ``xv`` given ``(x, y)``, from the kernel matrix of
    the model's current parameters formed and solved densely."""
    with torch.no_grad():
        z = loop_embeddings(model, torch.cat([x, xv]), training=False)
        k = dense_kernel(model, z)
        if model.input_kernel is not None:
            both = torch.cat([x, xv])
            ell = model.input_kernel.base_kernel.lengthscale.reshape(-1)
            diff = (both.unsqueeze(-2) - both.unsqueeze(-3)) / ell
            k = k + model.input_kernel.outputscale * torch.exp(-0.5 * diff.pow(2).sum(-1))
        n, noise, c = x.shape[0], model.likelihood.noise, model.mean_module.constant
        k_tt = k[:n, :n] + noise * torch.eye(n)
        k_vt = k[n:, :n]
        mean = c + k_vt @ torch.linalg.solve(k_tt, y - c)
        var = k[n:, n:].diagonal() - (k_vt * torch.linalg.solve(k_tt, k_vt.mT).mT).sum(-1) + noise
        return float((0.5 * (yv - mean) ** 2 / var + 0.5 * torch.log(2 * math.pi * var)).mean())


def test_default_fit_checks_held_out_rows_with_the_model_fitted_on_the_others():
    x, y = noisy_sine_data(n=50, d=3)
    model = DPKLRegressor(x, y, lambda: tanh_net(3), num_particles=3, num_random_features=10)
    states = {}

    def snapshot(record):
        if record.phase == "training" and "val_nll" in record.info:
            states[record.iteration] = (record.info["val_nll"], copy.deepcopy(model.state_dict()))

    torch.manual_seed(5)
    model.fit(max_iter=30, lr=0.05, check_every=5, warm_start_iter=50, callback=snapshot)
    # the same draw of the 10 validation rows (20 % of 50), made again
    torch.manual_seed(5)
    perm = torch.randperm(50)
    val, tr = perm[:10], perm[10:]
    hist = model.history
    assert hist["val_iteration"] == [0, 5, 10, 15, 20, 25, 30]
    assert sorted(states) == [5, 10, 15, 20, 25, 30]
    for val_nll, state in states.values():
        model.load_state_dict(state)
        ref = _dense_validation_nll(model, x[tr], y[tr], x[val], y[val])
        assert math.isclose(ref, val_nll, rel_tol=1e-8)
    assert len(hist["warm_start_loss"]) == 50 and len(hist["refit_warm_start_loss"]) == 50
    # after fit the model conditions on every row it was given
    assert torch.equal(model.train_inputs[0], x) and torch.equal(model.train_targets, y)


def _parameters_seen_before_the_choice(x, y):
    """Every parameter of a default fit after each step of its warm start and its training
    (the phases before the choice), and the fitted model."""
    model = DPKLRegressor(x, y, lambda: tanh_net(3), num_particles=2, num_random_features=8)
    seen = []

    def snapshot(record):
        if record.phase in ("warm start", "training"):
            seen.append([p.detach().clone() for p in model.parameters()])

    torch.manual_seed(3)
    model.fit(max_iter=12, lr=0.05, check_every=4, warm_start_iter=20, callback=snapshot)
    return seen, model


def test_the_validation_rows_cannot_influence_the_candidates_before_the_choice():
    x, y = noisy_sine_data(n=30, d=3)
    torch.manual_seed(3)
    val = torch.randperm(30)[:6]  # the rows the fit holds out under the same seed
    wild = y.clone()
    wild[val] += 100.0 * torch.randn(6, generator=torch.Generator().manual_seed(0))
    seen, model = _parameters_seen_before_the_choice(x, y)
    seen_wild, model_wild = _parameters_seen_before_the_choice(x, wild)
    assert len(seen) == len(seen_wild) == 20 + 12
    for step, step_wild in zip(seen, seen_wild, strict=True):
        for p, p_wild in zip(step, step_wild, strict=True):
            assert torch.equal(p, p_wild)
    # the perturbed rows were the validation rows: their NLL differs
    for nll, nll_wild in zip(model.history["val_nll"], model_wild.history["val_nll"], strict=True):
        assert nll_wild > nll + 10.0


def test_a_rejected_network_leaves_the_ard_gp_refitted_on_all_rows():
    x, y = noisy_sine_data(n=40, d=3)
    model = DPKLRegressor(x, y, lambda: tanh_net(3), num_particles=2, num_random_features=8)
    model.fit(max_iter=0, warm_start_iter=40)
    assert model.network_kept_ is False
    gp = gpsd.ARDGPRegressor(x, y).fit(max_iter=40, lr=0.1)
    torch.testing.assert_close(
        model.input_kernel.base_kernel.lengthscale, gp.covar_module.base_kernel.lengthscale
    )
    torch.testing.assert_close(model.likelihood.noise, gp.likelihood.noise)
    emb = model.embedding_kernel.random_features.outputscale
    torch.testing.assert_close(
        emb, model.embedding_scale_ratio * gp.covar_module.outputscale.detach()
    )
    assert model.history["refit_warm_start_loss"] == gp.history["loss"]
    assert model.history["refit_loss"] == []


def test_a_kept_network_is_refitted_on_all_rows_for_the_chosen_iterations(monkeypatch):
    x, y = noisy_sine_data(n=30, d=3)
    # validation NLLs that fall until the check after iteration 8 and rise after it
    nlls = iter([5.0, 4.0, 3.0, 6.0, 7.0])
    monkeypatch.setattr(DPKLRegressor, "nll", lambda self, vx, vy: next(nlls))
    torch.manual_seed(0)
    model = DPKLRegressor(x, y, lambda: tanh_net(3), num_particles=2, num_random_features=8)
    records = []
    model.fit(max_iter=16, lr=0.05, check_every=4, warm_start_iter=10, callback=records.append)
    assert model.history["val_iteration"] == [0, 4, 8, 12, 16]
    assert model.network_kept_ is True
    assert [(r.phase, r.total) for r in records if r.phase.startswith("refit")] == [
        ("refit warm start", 10)
    ] * 10 + [("refit training", 8)] * 8
    # independently: the same model trained on all rows for 8 iterations, with no rows held out
    torch.manual_seed(0)
    ref = DPKLRegressor(x, y, lambda: tanh_net(3), num_particles=2, num_random_features=8)
    ref.fit(max_iter=8, lr=0.05, warm_start_iter=10, val_fraction=0.0)
    assert model.history["refit_loss"] == ref.history["loss"]
    for (name, p), p_ref in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, p_ref, msg=name)
    assert torch.equal(model.train_inputs[0], x)


# the irrelevant third input's lengthscale reaches scikit-learn's upper bound, as it should
@pytest.mark.filterwarnings("ignore:The optimal value found for dimension 2")
def test_default_is_not_worse_than_the_ard_gp_where_that_gp_is_right():
    # a smooth function of two of three inputs: the ARD GP is the right model, and the network
    # should be rejected by the held-out rows
    gp_module = pytest.importorskip("sklearn.gaussian_process")
    kernels = pytest.importorskip("sklearn.gaussian_process.kernels")
    torch.set_default_dtype(torch.float64)
    x, xs = torch.randn(80, 3), torch.randn(300, 3)

    def f(a):
        return torch.sin(1.5 * a[:, 0]) + 0.5 * a[:, 1]

    def rmse(mean):
        return float((mean - f(xs)).pow(2).mean().sqrt())

    y = f(x) + 0.1 * torch.randn(80)
    model = DPKLRegressor(x, y, lambda: tanh_net(3), num_particles=4, num_random_features=20)
    dpkl = rmse(model.fit(max_iter=60).predict(xs).mean)
    ard = rmse(gpsd.ARDGPRegressor(x, y).fit(max_iter=300, lr=0.1).predict(xs).mean)
    # scikit-learn's ARD GP (L-BFGS to convergence), computed independently
    kernel = kernels.ConstantKernel() * kernels.RBF([1.0] * 3) + kernels.WhiteKernel(0.1)
    sk = gp_module.GaussianProcessRegressor(kernel, normalize_y=True, random_state=0)
    reference = rmse(torch.as_tensor(sk.fit(x.numpy(), y.numpy()).predict(xs.numpy())))
    assert dpkl <= 1.02 * ard
    assert dpkl <= 1.5 * reference  # Adam's 300 warm-start steps leave the ARD GP near it


def test_paper_setting_is_the_papers_model_and_fit():
    x, y = noisy_sine_data(n=30, d=3)
    model = DPKLRegressor.paper_setting(x, y, lambda: tanh_net(3))
    assert model.input_kernel is None and model.num_particles == 10
    assert model.embedding_kernel.random_features.num_features == 100 and model.update == "paper"
    model.fit(max_iter=4, check_every=2)
    assert model.history["val_iteration"] == [0, 2, 4] and model.history["warm_start_loss"] == []
    assert model.train_inputs[0].shape == (30, 3)
    with pytest.raises(ValueError, match="num_random_features"):
        DPKLRegressor.paper_setting(x, y, lambda: tanh_net(3), num_random_features=10)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"val_fraction": 1.0}, "val_fraction"),
        ({"val_fraction": -0.1}, "val_fraction"),
        ({"val_fraction": "a"}, "val_fraction"),
        ({"warm_start_iter": -1}, "warm_start_iter"),
        (
            {"val_fraction": 0.2, "val_x": torch.zeros(2, 3), "val_y": torch.zeros(2)},
            "val_fraction",
        ),
    ],
)
def test_fit_names_a_bad_validation_or_warm_start_argument(kwargs, match):
    x, y = noisy_sine_data(n=20, d=3)
    model = DPKLRegressor(x, y, lambda: tanh_net(3), num_particles=2, num_random_features=5)
    with pytest.raises((ValueError, TypeError), match=match):
        model.fit(max_iter=1, **kwargs)


def test_the_callback_sees_every_warm_start_step_first_then_every_training_iteration():
    x, y = noisy_sine_data(n=30, d=3)
    model = DPKLRegressor(x, y, lambda: tanh_net(3), num_particles=2, num_random_features=6)
    records = []
    model.fit(max_iter=4, warm_start_iter=5, check_every=2, callback=records.append)
    # the first record is the first warm-start step, not the end of the warm start
    assert [(r.phase, r.iteration, r.total) for r in records] == [
        ("warm start", i, 5) for i in range(1, 6)
    ] + [("training", i, 4) for i in range(1, 5)] + [
        ("refit warm start", i, 5) for i in range(1, 6)
    ] + [
        ("refit training", i, k)
        for k in [len(model.history["refit_loss"])]
        for i in range(1, k + 1)
    ]
    assert all(r.task == "DPKLRegressor.fit" for r in records)
    assert [r.loss for r in records[:5]] == model.history["warm_start_loss"]
    assert [r.loss for r in records[5:9]] == model.history["loss"]
    assert [("val_nll" in r.info) for r in records[5:9]] == [False, True, False, True]
    assert [r.loss for r in records[9:14]] == model.history["refit_warm_start_loss"]


def test_a_callback_stopping_the_warm_start_leaves_the_ard_gp_it_reached_untrained():
    x, y = noisy_sine_data(n=30, d=3)
    model = DPKLRegressor(x, y, lambda: tanh_net(3), num_particles=2, num_random_features=6)
    records = []
    torch.manual_seed(2)
    model.fit(
        max_iter=10, warm_start_iter=50, callback=lambda r: records.append(r) or r.iteration == 3
    )
    assert [(r.phase, r.iteration) for r in records] == [("warm start", i) for i in (1, 2, 3)]
    assert len(model.history["warm_start_loss"]) == 3 and model.history["loss"] == []
    assert model.history["val_iteration"] == [0]  # the warm-started state, checked and kept
    assert model.history["refit_warm_start_loss"] == [] and model.network_kept_ is False
    # an ARD GP fitted for the same three steps on the 24 rows not held out, independently
    torch.manual_seed(2)
    tr = torch.randperm(30)[6:]
    gp = gpsd.ARDGPRegressor(x[tr], y[tr]).fit(max_iter=3, lr=0.1)
    torch.testing.assert_close(
        model.input_kernel.base_kernel.lengthscale, gp.covar_module.base_kernel.lengthscale
    )
    torch.testing.assert_close(model.likelihood.noise, gp.likelihood.noise)
    assert model.predict(x[:4]).mean.shape == (4,)


def test_progress_shows_a_bar_per_phase_and_advances_a_bar_of_ones_own_through_both(capsys):
    tqdm = pytest.importorskip("tqdm")
    x, y = noisy_sine_data(n=20, d=3)
    model = DPKLRegressor(x, y, lambda: tanh_net(3), num_particles=2, num_random_features=6)
    model.fit(max_iter=2, warm_start_iter=3, progress=True)
    err = capsys.readouterr().err
    assert "DPKLRegressor.fit (warm start)" in err and "DPKLRegressor.fit (training)" in err
    assert "DPKLRegressor.fit (refit warm start)" in err
    bar = tqdm.tqdm(total=10, file=io.StringIO())
    model.fit(max_iter=2, warm_start_iter=3, progress=bar)
    refit = len(model.history["refit_warm_start_loss"]) + len(model.history["refit_loss"])
    assert refit >= 3 and bar.n == 5 + refit
    bar.close()
    lengthscale = model.input_kernel.base_kernel.lengthscale.clone()
    with pytest.raises(TypeError, match="progress"):
        model.fit(max_iter=1, warm_start_iter=3, progress="yes")
    # refused before the warm start trained
    assert torch.equal(model.input_kernel.base_kernel.lengthscale, lengthscale)
