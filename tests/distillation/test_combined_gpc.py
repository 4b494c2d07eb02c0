"""CombinedGPC against a naive chain of dense Laplace fits written out here, its two limits
(DataCentricGPC, DistributionCentricGPC), batches of schedules, the step grid and bad input."""

import contextlib
import copy
import functools
import math
import pickle

import pytest
import torch
from fit_triggers import COMMON_TRIGGERS, apply_common_trigger, predict_every_way, predictions_equal
from gpr_reference import rbf_kernel

import gpsd
from gpsd.data.toy import sine_classification
from gpsd.likelihoods.log_normalizer import cb_mean, cb_variance

N = 24
OUTPUTSCALE, LENGTHSCALE = 2.0, 1.2


@pytest.fixture
def toy():
    x, y, test_x = sine_classification(N, seed=3)
    return x, y, test_x[::15]  # 6 test points


def _kernel(dtype=torch.float64):
    return rbf_kernel(OUTPUTSCALE, LENGTHSCALE, dtype=dtype)


# ---------------------------------------------------------------------------- the naive chain


def _dense_rbf(a, b):
    """outputscale * exp(-|a - b|^2 / (2 lengthscale^2)) between the rows of a and b."""
    sq = ((a[:, None, :] - b[None, :, :]) ** 2).sum(-1)
    return OUTPUTSCALE * torch.exp(-0.5 * sq / LENGTHSCALE**2)


def _log_lik_derivatives(pieces, f):
    """First and second derivative in f of sum_j log p_j(y_j | f) over the (targets, soft)
    pieces: Bernoulli-logistic y f - log(1 + e^f), or continuous Bernoulli y f - A(f)."""
    grad, hess = torch.zeros_like(f), torch.zeros_like(f)
    for y, soft in pieces:
        if soft:
            grad += y - cb_mean(f)
            hess -= cb_variance(f)
        else:
            p = 1.0 / (1.0 + torch.exp(-f))
            grad += y - p
            hess -= p * (1.0 - p)
    return grad, hess


def _newton(m, K, pieces):
    """The mode of N(f; m, K) prod_j p_j(y_j | f) by plain Newton steps, to convergence."""
    f = m.clone()
    eye = torch.eye(len(m), dtype=m.dtype)
    for _ in range(200):
        grad, hess = _log_lik_derivatives(pieces, f)
        W = -hess
        # f_new = (K^-1 + W)^-1 (W f + grad + K^-1 m) = m + K (I + W K)^-1 (W (f - m) + grad)
        step = torch.linalg.solve(eye + W[:, None] * K, W * (f - m) + grad)
        f_new = m + K @ step
        done = float((f_new - f).abs().max()) < 1e-14
        f = f_new
        if done:
            break
    return f, -_log_lik_derivatives(pieces, f)[1]


def _laplace_update(mu, S, n, noise, pieces):
    """The Laplace posterior over all points Z of the prior N(mu, S) (the first n the training
    inputs, their covariance plus noise I): mode, posterior mean and covariance on Z."""
    eye = torch.eye(n, dtype=S.dtype)
    K = S[:n, :n] + noise * eye
    f, W = _newton(mu[:n], K, pieces)
    # R&W eqs. 3.21 and 3.24: K^-1 (f - m) is the log likelihood's gradient at the mode, and
    # (K + W^-1)^-1 = W^1/2 (I + W^1/2 K W^1/2)^-1 W^1/2 (no inverse of the ill-conditioned K)
    mean = mu + S[:, :n] @ _log_lik_derivatives(pieces, f)[0]
    sqrt_W = W.sqrt()
    B = eye + sqrt_W[:, None] * K * sqrt_W[None, :]
    correction = sqrt_W[:, None] * torch.linalg.solve(B, torch.diag(sqrt_W))
    cov = S - S[:, :n] @ correction @ S[:n, :]
    return f, mean, cov


def _probit(mean, var):
    return 1.0 / (1.0 + torch.exp(-mean / torch.sqrt(1.0 + math.pi * var / 8.0)))


def _naive_chain(x, y, test_x, noise_grid, method):
    """Per flat step: targets, mode, test mean and variance, from nested loops of dense fits."""
    n = len(y)
    Z = torch.cat([x[:, None], test_x[:, None]])
    prior_mu, prior_S = torch.zeros(len(Z), dtype=torch.float64), _dense_rbf(Z, Z)
    out = []
    earlier = []  # the likelihood pieces of the earlier outer steps' last inner steps
    O, I = noise_grid.shape
    for o in range(O):
        targets = y
        for i in range(I):
            piece = (targets, i > 0)
            if method == "iterated":
                f, mean, cov = _laplace_update(prior_mu, prior_S, n, noise_grid[o, i], [piece])
            else:  # one fit of every piece under GP(0, k)
                mu0, S0 = torch.zeros_like(prior_mu), _dense_rbf(Z, Z)
                f, mean, cov = _laplace_update(mu0, S0, n, 0.0, [*earlier, piece])
            var = torch.diagonal(cov)
            out.append((targets, f, mean[n:], var[n:]))
            targets = _probit(mean[:n], var[:n])
        prior_mu, prior_S = mean, cov
        earlier.append(piece)
    return out


@pytest.mark.parametrize(
    ("method", "noise"),
    [
        ("iterated", [[0.0, 0.3, 0.1], [0.2, 0.0, 0.05]]),
        ("iterated", [[0.0, 0.0], [0.0, 0.0], [0.0, 0.0]]),
        ("tempered", [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]),
        ("tempered", [[0.0, 0.0], [0.0, 0.0], [0.0, 0.0]]),
    ],
)
def test_every_step_equals_a_naive_chain_of_dense_laplace_fits(toy, method, noise):
    x, y, test_x = toy
    grid = torch.tensor(noise, dtype=torch.float64)
    model = gpsd.CombinedGPC(
        x, y, _kernel(), noise=grid, method=method, target_method="probit"
    ).fit()
    naive = _naive_chain(x, y, test_x, grid, method)
    latent = model.predict_latent(test_x)
    assert latent.mean.shape == (grid.numel(), len(test_x))
    for t, (targets, f, mean, var) in enumerate(naive, start=1):
        torch.testing.assert_close(model.step_targets(t), targets, rtol=0, atol=1e-10)
        torch.testing.assert_close(model.latent_modes(t), f, rtol=0, atol=1e-10)
        torch.testing.assert_close(latent.mean[t - 1], mean, rtol=0, atol=1e-10)
        torch.testing.assert_close(latent.variance[t - 1], var, rtol=0, atol=1e-10)


def _same_predictions(model, reference, test_x):
    """The latent predictions and class probabilities of two classifiers agree to 1e-10."""
    ours, theirs = model.predict_latent(test_x), reference.predict_latent(test_x)
    torch.testing.assert_close(ours.mean, theirs.mean, rtol=0, atol=1e-10)
    torch.testing.assert_close(ours.variance, theirs.variance, rtol=0, atol=1e-10)
    torch.testing.assert_close(
        model.predict_proba(test_x), reference.predict_proba(test_x), rtol=0, atol=1e-10
    )


def test_one_outer_step_is_data_centric_distillation(toy):
    x, y, test_x = toy
    schedule = torch.tensor([0.0, 0.2, 0.05], dtype=torch.float64)
    model = gpsd.CombinedGPC(x, y, _kernel(), noise=schedule[None])
    reference = gpsd.DataCentricGPC(x, y, _kernel(), noise=schedule)
    torch.testing.assert_close(model.step_targets(), reference.step_targets(), rtol=0, atol=1e-10)
    torch.testing.assert_close(model.latent_modes(), reference.latent_modes(), rtol=0, atol=1e-10)
    _same_predictions(model, reference, test_x)


@pytest.mark.parametrize("method", ["iterated", "tempered"])
def test_one_inner_step_is_distribution_centric_distillation(toy, method):
    x, y, test_x = toy
    model = gpsd.CombinedGPC(x, y, _kernel(), outer_steps=4, inner_steps=1, method=method)
    reference = gpsd.DistributionCentricGPC(x, y, _kernel(), num_steps=4, method=method)
    torch.testing.assert_close(model.latent_modes(), reference.latent_modes(), rtol=0, atol=1e-10)
    _same_predictions(model, reference, test_x)
    torch.testing.assert_close(model.step_targets(), y.expand(4, N))


def test_a_batch_of_schedules_equals_each_schedule_alone(toy):
    x, y, test_x = toy
    grids = torch.tensor([[[0.0, 0.1], [0.0, 0.3]], [[0.2, 0.0], [0.05, 0.0]]], dtype=torch.float64)
    batch = gpsd.CombinedGPC(x, y, _kernel(), noise=grids)
    proba = batch.predict_proba(test_x)
    assert proba.shape == (2, 4, len(test_x), 2)
    assert batch.latent_modes().shape == batch.step_targets().shape == (2, 4, N)
    val_y = (test_x > 2.5).double()
    best = batch.best_step(val_x=test_x, val_y=val_y)
    for s in range(2):
        alone = gpsd.CombinedGPC(x, y, _kernel(), noise=grids[s])
        torch.testing.assert_close(proba[s], alone.predict_proba(test_x), rtol=0, atol=1e-12)
        torch.testing.assert_close(
            batch.latent_modes()[s], alone.latent_modes(), rtol=0, atol=1e-12
        )
        assert int(best[s]) == alone.best_step(val_x=test_x, val_y=val_y)


def test_steps_are_flat_outer_by_outer_and_selected_by_step(toy):
    x, y, test_x = toy
    model = gpsd.CombinedGPC(x, y, _kernel(), outer_steps=3, inner_steps=2)
    assert (model.num_steps, model.outer_steps, model.inner_steps) == (6, 3, 2)
    assert model.noise_grid.shape == (3, 2)
    every = model.predict_proba(test_x)
    assert every.shape == (6, len(test_x), 2)
    for outer in (1, 2, 3):
        for inner in (1, 2):
            t = model.flat_step(outer, inner)
            assert model.grid_step(t) == (outer, inner)
            torch.testing.assert_close(model.predict_proba(test_x, step=t), every[t - 1])
            torch.testing.assert_close(model.latent_modes(t), model.latent_modes()[t - 1])
    # the first inner step of every outer step fits the labels
    torch.testing.assert_close(model.step_targets()[::2], y.expand(3, N))
    labels = model.predict(test_x)
    assert labels.dtype == torch.long and torch.equal(labels, (every[..., 1] > 0.5).long())
    val_y = (test_x > 2.5).double()
    best = model.best_step(val_x=test_x, val_y=val_y)
    assert best == int(model.validation_log_loss(test_x, val_y).argmin()) + 1


def test_fit_reports_a_phase_per_outer_step_and_a_callback_stops_it(toy):
    x, y, test_x = toy
    model = gpsd.CombinedGPC(x, y, _kernel(), outer_steps=2, inner_steps=3)
    records = []
    assert model.fit(callback=records.append) is model
    assert [(r.phase, r.iteration, r.total) for r in records] == [
        (f"outer step {o}", i, 3) for o in (1, 2) for i in (1, 2, 3)
    ]
    assert [r.info["step"] for r in records] == list(range(1, 7))
    assert all(r.task == "CombinedGPC.fit" and r.loss is not None for r in records)
    model.fit(callback=lambda r: r.info["step"] == 4)
    assert model.predict_proba(test_x).shape == (4, len(test_x), 2)
    assert model.step_targets().shape == (4, N)
    with pytest.raises(ValueError, match="step 5 was not fitted"):
        model.predict_proba(test_x, step=5)


def test_a_change_of_noise_method_or_kernel_refits_on_use(toy):
    x, y, test_x = toy
    model = gpsd.CombinedGPC(x, y, _kernel(), outer_steps=2, inner_steps=2)
    before = model.predict_proba(test_x)
    model.noise = 0.5
    noisy = gpsd.CombinedGPC(x, y, _kernel(), noise=0.5, outer_steps=2, inner_steps=2)
    torch.testing.assert_close(model.predict_proba(test_x), noisy.predict_proba(test_x))
    model.noise = 0.0
    torch.testing.assert_close(model.predict_proba(test_x), before)
    model.method = "tempered"
    tempered = gpsd.CombinedGPC(x, y, _kernel(), outer_steps=2, inner_steps=2, method="tempered")
    torch.testing.assert_close(model.predict_proba(test_x), tempered.predict_proba(test_x))
    model.covar_module.outputscale = 0.5
    assert not torch.allclose(model.predict_proba(test_x), tempered.predict_proba(test_x))


def test_float32_follows_float64(toy):
    x, y, test_x = toy
    p64 = gpsd.CombinedGPC(x, y, _kernel(), outer_steps=2, inner_steps=2).predict_proba(test_x)
    model = gpsd.CombinedGPC(
        x.float(), y.float(), _kernel(torch.float32), outer_steps=2, inner_steps=2
    )
    p32 = model.predict_proba(test_x.float())
    assert p32.dtype == torch.float32 and model.latent_modes().dtype == torch.float32
    torch.testing.assert_close(p32.double(), p64, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"noise": -0.1, "outer_steps": 2, "inner_steps": 2}, ValueError, "noise must hold"),
        ({"noise": 0.1}, ValueError, "give outer_steps and inner_steps"),
        ({"noise": [0.1, 0.2]}, ValueError, "grid of shape"),
        ({"noise": [[0.0, 0.1]], "outer_steps": 2}, ValueError, "outer_steps=2"),
        ({"outer_steps": 0, "inner_steps": 2}, ValueError, "outer_steps"),
        ({"outer_steps": 2, "inner_steps": 2, "method": "scaled_kernel"}, ValueError, "method"),
        (
            {"noise": 0.1, "outer_steps": 2, "inner_steps": 2, "method": "tempered"},
            ValueError,
            "method='tempered' takes noise 0",
        ),
        ({"outer_steps": 2, "inner_steps": 2, "target_method": "mc"}, ValueError, "target_method"),
        ({"outer_steps": 2, "inner_steps": 2, "max_iter": 0}, ValueError, "max_iter"),
        (
            {"noise": torch.zeros(3, 2, 2)},
            ValueError,
            "must broadcast with the batch of the labels",
        ),
    ],
)
def test_bad_arguments_are_named(toy, kwargs, error, message):
    x, y, _ = toy
    with pytest.raises(error, match=message):
        gpsd.CombinedGPC(x, y.expand(2, N), _kernel(), **kwargs)


def test_bad_labels_steps_and_assignments_are_named(toy):
    x, y, test_x = toy
    with pytest.raises(ValueError, match="train_y must hold binary labels"):
        gpsd.CombinedGPC(x, y * 0.5, _kernel(), outer_steps=2, inner_steps=2)
    model = gpsd.CombinedGPC(x, y, _kernel(), outer_steps=2, inner_steps=2)
    for bad in (0, 5):
        with pytest.raises(ValueError, match="step"):
            model.predict_proba(test_x, step=bad)
    with pytest.raises(ValueError, match="outer must lie in 1..2"):
        model.flat_step(3, 1)
    with pytest.raises(ValueError, match="num_steps=4 does not match"):
        model.noise = [0.1, 0.2]
    model.method = "tempered"
    with pytest.raises(ValueError, match="method='tempered' takes noise 0"):
        model.noise = 0.1
    model.method = "iterated"
    model.noise = 0.1
    model.method = "tempered"
    with pytest.raises(ValueError, match="method='tempered' takes noise 0"):
        model.predict_proba(test_x)


def test_predictions_are_differentiable_in_the_test_inputs(toy):
    x, y, test_x = toy
    model = gpsd.CombinedGPC(x, y, _kernel(), noise=[[0.0, 0.1], [0.0, 0.0]])
    z = test_x[:3].clone().requires_grad_(True)
    model.predict_proba(z)[..., 1].sum().backward()
    h = 1e-6
    with torch.no_grad():
        up = model.predict_proba(test_x[:3] + h)[..., 1].sum((0,))
        down = model.predict_proba(test_x[:3] - h)[..., 1].sum((0,))
    torch.testing.assert_close(z.grad, (up - down) / (2 * h), rtol=1e-5, atol=1e-7)


def test_a_saved_state_loads_into_a_model_of_the_same_grid_alone(toy):
    x, y, test_x = toy
    model = gpsd.CombinedGPC(x, y, _kernel(), outer_steps=2, inner_steps=2)
    proba = model.predict_proba(test_x)
    copy = gpsd.CombinedGPC(x, y, _kernel(), outer_steps=2, inner_steps=2)
    copy.load_state_dict(model.state_dict())
    torch.testing.assert_close(copy.predict_proba(test_x), proba)
    torch.testing.assert_close(copy.latent_modes(), model.latent_modes())
    other = gpsd.CombinedGPC(x, y, _kernel(), outer_steps=3, inner_steps=2)
    with pytest.raises(ValueError, match="num_steps=4"):
        other.load_state_dict(model.state_dict())


@pytest.mark.parametrize(("method", "working"), [("iterated", 16), ("tempered", 14)])
def test_a_fit_beyond_the_free_memory_is_refused_before_allocating(
    monkeypatch, toy, method, working
):
    from gpsd._internal import memory_check

    x, y, test_x = toy
    needed = (working + 2 * 4) * N * N * 8  # working matrices and two per step, float64
    monkeypatch.setattr(memory_check, "free_memory_bytes", lambda device, wanted=None: needed - 1)
    model = gpsd.CombinedGPC(x, y, _kernel(), outer_steps=2, inner_steps=2, method=method)
    for attempt in (model.fit, lambda: model.predict_proba(test_x)):
        with pytest.raises(gpsd.InsufficientMemoryError) as raised:
            attempt()
        assert f"CombinedGPC.fit needs about {needed} bytes" in str(raised.value)
        assert "fewer steps" in str(raised.value)
    monkeypatch.setattr(memory_check, "free_memory_bytes", lambda device, wanted=None: needed)
    model.fit()


@pytest.mark.parametrize("weight", [0.25, 0.5, 2.0 / 3.0])
def test_the_tempered_chains_mixed_likelihood_has_its_derivatives_by_autograd(weight):
    from gpsd.distillation.combined_gpc import _chain_terms

    terms = _chain_terms(weight)
    gen = torch.Generator().manual_seed(0)
    y = torch.rand(8, generator=gen, dtype=torch.float64)
    f = (4 * torch.randn(8, generator=gen, dtype=torch.float64)).requires_grad_(True)
    # the log-likelihood written out: y f - (1 - w) log(1 + e^f) - w A(f), A(f) = log((e^f - 1) / f)
    written = y * f - (1 - weight) * torch.nn.functional.softplus(f)
    written = written - weight * torch.log(torch.expm1(f) / f)
    (grad,) = torch.autograd.grad(written.sum(), f, create_graph=True)
    (hess,) = torch.autograd.grad(grad.sum(), f)
    torch.testing.assert_close(terms.log_prob(y, f), written, rtol=1e-12, atol=1e-12)
    first, second = terms.derivatives(y, f.detach())
    torch.testing.assert_close(first, grad.detach(), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(second, hess, rtol=1e-8, atol=1e-10)


def test_a_batch_of_labels_equals_each_labelling_alone(toy):
    x, y, test_x = toy
    labels = torch.stack([y, 1.0 - y])
    batch = gpsd.CombinedGPC(x, labels, _kernel(), noise=[[0.0, 0.2], [0.1, 0.0]])
    proba = batch.predict_proba(test_x)
    assert proba.shape == (2, 4, len(test_x), 2)
    for b in range(2):
        alone = gpsd.CombinedGPC(x, labels[b], _kernel(), noise=[[0.0, 0.2], [0.1, 0.0]])
        torch.testing.assert_close(proba[b], alone.predict_proba(test_x), rtol=0, atol=1e-12)
        torch.testing.assert_close(
            batch.step_targets()[b], alone.step_targets(), rtol=0, atol=1e-12
        )


def test_new_training_data_refit_on_use(toy):
    x, y, test_x = toy
    model = gpsd.CombinedGPC(x, y, _kernel(), outer_steps=2, inner_steps=2)
    model.predict_proba(test_x)
    model.set_train_data(x[:20], y[:20], strict=False)
    fewer = gpsd.CombinedGPC(x[:20], y[:20], _kernel(), outer_steps=2, inner_steps=2)
    torch.testing.assert_close(model.predict_proba(test_x), fewer.predict_proba(test_x))
    assert model.latent_modes().shape == (4, 20)


@pytest.mark.parametrize(
    "trigger", [*COMMON_TRIGGERS, "model setting", "set_train_data", "noise assignment"]
)
def test_each_refit_trigger_refits_and_predictions_do_not(toy, trigger, count_calls):
    x, y, test_x = toy
    build = functools.partial(gpsd.CombinedGPC, x, y, inner_steps=2, outer_steps=2, noise=0.1)
    model = build(_kernel()).fit()
    fits = count_calls(gpsd.CombinedGPC, "_compute_fit")
    predict_every_way(model, test_x)
    assert fits == [0]
    setting = contextlib.nullcontext()
    if trigger in COMMON_TRIGGERS:
        rival = functools.partial(build, rbf_kernel(1.0, 0.5))
        test_x, setting = apply_common_trigger(trigger, model, rival, test_x)
    elif trigger == "model setting":
        model.target_method = "probit"
    elif trigger == "set_train_data":
        model.set_train_data(targets=1 - y)
    else:
        model.noise = 0.2
    with setting:
        model.predict_proba(test_x)
    assert fits == [1]


def test_a_state_dict_round_trip_and_copies_predict_identically(toy, count_calls):
    x, y, test_x = toy
    build = functools.partial(gpsd.CombinedGPC, x, y, inner_steps=2, outer_steps=2, noise=0.1)
    model = build(_kernel()).fit()
    want = model.predict_latent(test_x)
    loaded = build(rbf_kernel(1.0, 0.5))
    loaded.predict_latent(test_x)  # fitted at its own state: the load makes it stale
    loaded.load_state_dict(model.state_dict())
    fits = count_calls(gpsd.CombinedGPC, "_compute_fit")
    for other in (loaded, copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        predictions_equal(other.predict_latent(test_x), want)
        torch.testing.assert_close(other.step_targets(), model.step_targets(), rtol=0, atol=1e-12)
    assert fits == [3]
