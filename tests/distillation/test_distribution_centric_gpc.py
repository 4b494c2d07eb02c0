"""DistributionCentricGPC: the recursion against dense formulas, data duplication, Prop. 4.2,
scikit-learn for step 1, and the estimator convention (every step along a step dimension,
best_step, callbacks)."""

import contextlib
import copy
import functools
import pickle

import gpytorch
import numpy as np
import pytest
import torch
from fit_triggers import COMMON_TRIGGERS, apply_common_trigger, labels_of_classes, predictions_equal
from gpr_reference import rbf_kernel
from scipy import optimize
from sklearn.gaussian_process import GaussianProcessClassifier
from sklearn.gaussian_process.kernels import RBF, ConstantKernel

import gpsd
from gpsd.data.toy import sine_classification
from gpsd.distillation.distribution_centric_gpc import DistributionCentricGPC
from gpsd.laplace import AutogradLikelihoodTerms, LaplaceGPClassifier


def _kernel(outputscale=3.0, lengthscale=1.0):
    k = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).double()
    k.outputscale = outputscale
    k.base_kernel.lengthscale = lengthscale
    return k


@pytest.fixture
def toy():
    return sine_classification(25, seed=2)


def _dense_recursion(x, y, test_x, steps):
    """Eqs. 14-15 on the joint [X; X*] with dense inverses; modes by BFGS (whitened)."""
    z = torch.cat([x, test_x])[:, None]
    with torch.no_grad():
        C = _kernel()(z).to_dense().numpy()
    n = len(x)
    mean = np.zeros(len(z))
    yv = y.numpy()
    out = []
    for _ in range(steps):
        Kt, mt = C[:n, :n], mean[:n]
        L = np.linalg.cholesky(Kt + 1e-12 * np.eye(n))

        def nlp(u, L=L, mt=mt):
            f = mt + L @ u
            val = 0.5 * u @ u - np.sum(yv * f - np.logaddexp(0, f))
            g = u - L.T @ (yv - 1 / (1 + np.exp(-f)))
            return val, g

        res = optimize.minimize(nlp, np.zeros(n), jac=True, method="BFGS", options={"gtol": 1e-11})
        f_hat = mt + L @ res.x
        W = 1 / (1 + np.exp(-f_hat)) / (1 + np.exp(f_hat))
        Czx = C[:, :n]
        # K_t^{-1}(f_hat - m_t) = y - sigmoid(f_hat) at the mode (avoids the ill-conditioned solve)
        mean = mean + Czx @ (yv - 1 / (1 + np.exp(-f_hat)))
        C = C - Czx @ np.linalg.solve(Kt + np.diag(1 / W), Czx.T)
        out.append((mean[n:].copy(), np.diag(C)[n:].copy()))
    return out


def test_iterated_matches_dense_recursion(toy):
    x, y, test_x = toy
    test_x = test_x[::9]
    model = DistributionCentricGPC(x, y, _kernel(), num_steps=3, method="iterated").fit()
    for step, (mean, var) in enumerate(_dense_recursion(x, y, test_x, 3), start=1):
        latent = model.predict_latent(test_x, step=step)
        m, v = latent.mean, latent.variance
        np.testing.assert_allclose(m.numpy(), mean, atol=1e-6)
        np.testing.assert_allclose(v.numpy(), var, atol=1e-6)


@pytest.mark.parametrize("method", ["iterated", "tempered", "scaled_kernel"])
def test_step_one_is_the_ordinary_gpc(toy, method):

    x, y, test_x = toy
    model = DistributionCentricGPC(x, y, _kernel(), num_steps=1, method=method).fit()
    base = (
        GaussianProcessClassifier(ConstantKernel(3.0) * RBF(1.0), optimizer=None)
        .fit(x.numpy()[:, None], y.numpy())
        .base_estimator_
    )
    mean, var = base.latent_mean_and_variance(test_x.numpy()[:, None])
    latent = model.predict_latent(test_x, step=1)
    m, v = latent.mean, latent.variance
    np.testing.assert_allclose(m.numpy(), mean, atol=1e-6)
    np.testing.assert_allclose(v.numpy(), var, atol=1e-6)


def test_tempered_equals_duplicated_data(toy):
    x, y, test_x = toy
    t = 3
    model = DistributionCentricGPC(x, y, _kernel(), num_steps=t, method="tempered").fit()
    dup = LaplaceGPClassifier(x.repeat(t), y.repeat(t), _kernel()).fit()
    latent = model.predict_latent(test_x, step=t)
    m, v = latent.mean, latent.variance
    latent = dup.predict_latent(test_x)
    dm, dv = latent.mean, latent.variance
    torch.testing.assert_close(m, dm.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(v, dv.detach(), rtol=1e-6, atol=1e-6)


def test_scaled_kernel_keeps_mean_and_scales_variance(toy):
    x, y, test_x = toy
    for t in (2, 5):
        tempered = DistributionCentricGPC(x, y, _kernel(), num_steps=t, method="tempered").fit()
        scaled = DistributionCentricGPC(x, y, _kernel(), num_steps=t, method="scaled_kernel").fit()
        torch.testing.assert_close(scaled.latent_modes(t), tempered.latent_modes(t))
        latent = tempered.predict_latent(test_x, step=t)
        m_t, v_t = latent.mean, latent.variance
        latent = scaled.predict_latent(test_x, step=t)
        m_s, v_s = latent.mean, latent.variance
        torch.testing.assert_close(m_s, m_t, rtol=1e-8, atol=1e-8)
        torch.testing.assert_close(v_s, t * v_t, rtol=1e-8, atol=1e-8)


def test_gaussian_likelihood_iterations_equal_tempering(toy):
    """For a Gaussian likelihood Laplace is exact, so t iterations = the likelihood to the power t."""
    x, _, test_x = toy
    y = torch.sin(x)
    gaussian = gpytorch.likelihoods.GaussianLikelihood().double()
    gaussian.noise = 0.3
    terms = AutogradLikelihoodTerms(gaussian)
    it = DistributionCentricGPC(x, y, _kernel(), num_steps=4, likelihood=terms).fit()
    tm = DistributionCentricGPC(x, y, _kernel(), num_steps=4, method="tempered", likelihood=terms)
    tm.fit()
    for step in (1, 2, 4):
        a, b = it.predict_latent(test_x, step=step), tm.predict_latent(test_x, step=step)
        torch.testing.assert_close(a.mean, b.mean, rtol=1e-7, atol=1e-7)
        torch.testing.assert_close(a.variance, b.variance, rtol=1e-7, atol=1e-7)


def test_lazy_steps_and_state_dict(toy):
    x, y, test_x = toy
    model = DistributionCentricGPC(x, y, _kernel(), num_steps=4, method="scaled_kernel").fit()
    assert model.computed_steps.tolist() == [False, False, False, True]
    p2 = model.predict_proba(test_x, step=2)
    ref = DistributionCentricGPC(x, y, _kernel(), num_steps=2, method="scaled_kernel").fit()
    torch.testing.assert_close(p2, ref.predict_proba(test_x, step=2), rtol=1e-8, atol=1e-8)
    other = DistributionCentricGPC(x, y, _kernel(1.0, 3.0), num_steps=4, method="scaled_kernel")
    other.load_state_dict(model.state_dict())
    torch.testing.assert_close(other.predict_proba(test_x, step=2), p2)


def test_bad_input(toy):
    x, y, test_x = toy
    with pytest.raises(ValueError, match="method must be one of"):
        DistributionCentricGPC(x, y, _kernel(), method="duplicated")
    with pytest.raises(ValueError, match="train_y must hold binary labels"):
        DistributionCentricGPC(x, y + 0.5, _kernel())
    with pytest.raises(ValueError, match="num_steps"):
        DistributionCentricGPC(x, y, _kernel(), num_steps=-1)
    model = DistributionCentricGPC(x, y, _kernel(), num_steps=2)
    with pytest.raises(ValueError, match="test_x must have 1 features"):
        model.fit().predict_latent(torch.zeros(2, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="step must be a positive int"):
        model.predict_latent(test_x, step=1.7)  # not rounded to step 1
    with pytest.raises(ValueError, match="step must lie in 1..2"):
        model.predict_latent(test_x, step=3)


@pytest.mark.parametrize("method", ["iterated", "scaled_kernel"])
def test_store_only_last_step(toy, method):
    x, y, test_x = toy
    full = DistributionCentricGPC(x, y, _kernel(), num_steps=3, method=method).fit()
    last = DistributionCentricGPC(
        x, y, _kernel(), num_steps=3, method=method, store_all_steps=False
    ).fit()
    assert last.covariance_corrections.shape[0] == 1
    a, b = last.predict_latent(test_x, step=3), full.predict_latent(test_x, step=3)
    torch.testing.assert_close((a.mean, a.variance), (b.mean, b.variance))
    if method == "iterated":
        with pytest.raises(ValueError, match="store_all_steps=True"):
            last.predict_latent(test_x, step=2)
        with pytest.raises(ValueError, match="store_all_steps=True"):
            last.predict_latent(test_x)  # every step
    else:
        a, b = last.predict_latent(test_x, step=2), full.predict_latent(test_x, step=2)
        torch.testing.assert_close((a.mean, a.variance), (b.mean, b.variance))
        a, b = last.predict_latent(test_x), full.predict_latent(test_x)
        torch.testing.assert_close((a.mean, a.variance), (b.mean, b.variance))


@pytest.mark.parametrize("method", ["iterated", "tempered", "scaled_kernel"])
def test_float32_close_to_float64(toy, method):
    x, y, test_x = toy
    ref = DistributionCentricGPC(x, y, _kernel(), num_steps=3, method=method).fit()
    model = DistributionCentricGPC(
        x.float(), y.float(), _kernel().float(), num_steps=3, method=method
    ).fit()
    p32 = model.predict_proba(test_x.float())
    assert p32.dtype == torch.float32
    torch.testing.assert_close(p32.double(), ref.predict_proba(test_x), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("method", ["iterated", "tempered", "scaled_kernel"])
def test_fit_returns_self_and_every_step_is_predicted_along_a_step_dimension(toy, method):
    x, y, test_x = toy
    model = DistributionCentricGPC(x, y, _kernel(), num_steps=3, method=method)
    lazy = DistributionCentricGPC(x, y, _kernel(), num_steps=3, method=method)  # fits on use
    assert model.fit() is model
    M = test_x.shape[0]
    proba = model.predict_proba(test_x)
    assert proba.shape == (3, M, 2)
    torch.testing.assert_close(proba.sum(-1), torch.ones(3, M, dtype=torch.float64))
    torch.testing.assert_close(lazy.predict_proba(test_x), proba)
    latent = model.predict_latent(test_x)
    assert isinstance(latent, gpsd.Prediction) and latent.mean.shape == (3, M)
    labels = model.predict(test_x)
    assert labels.dtype == torch.long and labels.shape == (3, M)
    for t in (1, 2, 3):
        torch.testing.assert_close(model.predict_proba(test_x, step=t), proba[t - 1])
        one = model.predict_latent(test_x, step=t)
        torch.testing.assert_close(
            (one.mean, one.variance), (latent.mean[t - 1], latent.variance[t - 1])
        )
    # step 1 is the ordinary classifier
    reference = LaplaceGPClassifier(x, y, _kernel()).predict_proba(test_x).detach()
    torch.testing.assert_close(proba[0], reference)
    with pytest.raises(TypeError):
        DistributionCentricGPC(x, y, _kernel(), gpytorch.means.ZeroMean())


def test_best_step_is_the_1_based_step_of_the_smallest_validation_log_loss(toy):
    x, y, _ = toy
    val_x, val_y, _ = sine_classification(40, seed=7)
    model = DistributionCentricGPC(x, y, _kernel(), num_steps=4)
    losses = model.validation_log_loss(val_x, val_y)
    p = model.predict_proba(val_x)[..., 1]
    by_hand = -(val_y * p.log() + (1 - val_y) * (1 - p).log()).mean(-1)
    torch.testing.assert_close(losses, by_hand)
    step = model.best_step(val_x=val_x, val_y=val_y)
    assert isinstance(step, int) and step == int(by_hand.argmin()) + 1


def test_fit_reports_each_iterated_step_and_a_callback_stops_it(toy):
    x, y, test_x = toy
    model = DistributionCentricGPC(x, y, _kernel(), num_steps=4)
    records = []

    def stop_after_step_two(record):  # the steps' records; the refits' have a phase
        if record.phase is None:
            records.append(record)
            return record.iteration == 2

    model.fit(callback=stop_after_step_two)
    assert [r.iteration for r in records] == [1, 2]
    assert records[0].task == "DistributionCentricGPC.fit" and records[0].total == 4
    assert model.predict_proba(test_x).shape[0] == 2  # the steps the fit reached
    with pytest.raises(ValueError):
        model.predict_proba(test_x, step=3)
    full = DistributionCentricGPC(x, y, _kernel(), num_steps=4).fit(progress=True)
    torch.testing.assert_close(
        model.predict_proba(test_x, step=2), full.predict_proba(test_x, step=2)
    )
    tempered = DistributionCentricGPC(x, y, _kernel(), num_steps=4, method="tempered")
    records = []
    tempered.fit(callback=records.append)
    assert [(r.iteration, r.total) for r in records] == [(1, 1)]  # one Laplace fit


@pytest.fixture
def toy_for_refits():
    return sine_classification(25, seed=4)


@pytest.mark.parametrize("method", ["iterated", "tempered", "scaled_kernel"])
def test_distribution_centric_gpc_follows_hyperparameters(toy_for_refits, method):
    x, y, test_x = toy_for_refits
    model = DistributionCentricGPC(x, y, rbf_kernel(3.0, 1.0), num_steps=3, method=method).fit()
    model.predict_proba(test_x)
    model.covar_module.outputscale = 8.0
    model.covar_module.base_kernel.lengthscale = 0.6
    fresh = DistributionCentricGPC(x, y, rbf_kernel(8.0, 0.6), num_steps=3, method=method).fit()
    torch.testing.assert_close(model.predict_proba(test_x), fresh.predict_proba(test_x))
    got, want = model.predict_latent(test_x), fresh.predict_latent(test_x)
    torch.testing.assert_close((got.mean, got.variance), (want.mean, want.variance))


def test_distribution_centric_gpc_refits_a_loaded_state_and_a_dtype_change_alone(
    toy_for_refits,
):
    x, y, test_x = toy_for_refits
    model = DistributionCentricGPC(x, y, rbf_kernel(3.0, 1.0), num_steps=3, method="iterated").fit()
    loaded = DistributionCentricGPC(x, y, rbf_kernel(1.0, 3.0), num_steps=3, method="iterated")
    loaded.load_state_dict(model.state_dict())
    torch.testing.assert_close(
        loaded.predict_proba(test_x), model.predict_proba(test_x), rtol=0, atol=1e-12
    )
    assert sorted(loaded.newton_iterations) == [1, 2, 3]  # refitted on first use
    # a conversion is a change: the converted model refits
    loaded.newton_iterations = {}
    loaded.float()
    loaded.predict_proba(test_x.float())
    assert sorted(loaded.newton_iterations) == [1, 2, 3]
    # a .to() that changes nothing keeps the fit
    loaded.newton_iterations = {}
    loaded.float()
    loaded.predict_proba(test_x.float())
    assert loaded.newton_iterations == {}


# ------------------------------------------------------------------ per-step hyperparameter refits

REFIT = {"refit_max_iter": 15, "refit_lr": 0.1}


def _start_kernel():
    return _kernel(1.0, 1.0)


def _fitted_classifier(x, y, kernel, temperature=1.0):
    """An independent LaplaceGPClassifier whose hyperparameters are optimised as the refits are."""
    model = LaplaceGPClassifier(x, y, kernel, temperature=temperature)
    model.optimize_hyperparameters(max_iter=REFIT["refit_max_iter"], lr=REFIT["refit_lr"])
    return model


def _scaled(kernel, scale):
    """``scale`` times ``kernel``: a ScaleKernel around it whose output scale is fixed."""
    outer = gpytorch.kernels.ScaleKernel(kernel).double()
    outer.outputscale = scale
    outer.raw_outputscale.requires_grad_(False)
    return outer


def _assert_same_hyperparameters(ours, theirs):
    torch.testing.assert_close(ours.outputscale, theirs.outputscale.detach(), rtol=1e-6, atol=0)
    torch.testing.assert_close(
        ours.base_kernel.lengthscale, theirs.base_kernel.lengthscale.detach(), rtol=1e-6, atol=0
    )


def test_tempered_refits_equal_an_independent_classifier_of_the_tempered_likelihood(toy):
    x, y, test_x = toy
    start = _start_kernel()
    model = DistributionCentricGPC(
        x, y, start, num_steps=3, method="tempered", refit_hyperparameters=True, **REFIT
    )
    proba = model.predict_proba(test_x)
    for t in (1, 2, 3):
        naive = _fitted_classifier(x, y, _start_kernel(), temperature=float(t))
        _assert_same_hyperparameters(model.step_covar_modules[t - 1], naive.covar_module)
        np.testing.assert_allclose(model.refit_history[t], naive.history, rtol=1e-6)
        with torch.no_grad():
            torch.testing.assert_close(
                proba[t - 1], naive.predict_proba(test_x), rtol=1e-6, atol=1e-7
            )
    assert start.base_kernel.lengthscale.item() == pytest.approx(1.0)  # the start is left alone


def test_scaled_kernel_refits_equal_an_independent_classifier_of_the_scaled_kernel(toy):
    x, y, test_x = toy
    model = DistributionCentricGPC(
        x,
        y,
        _start_kernel(),
        num_steps=3,
        method="scaled_kernel",
        refit_hyperparameters=True,
        **REFIT,
    )
    for t in (1, 3):
        naive = _fitted_classifier(x, y, _scaled(_start_kernel(), float(t)))
        _assert_same_hyperparameters(
            model.step_covar_modules[t - 1], naive.covar_module.base_kernel
        )
        ours = model.predict_latent(test_x, step=t)
        with torch.no_grad():
            theirs = naive.predict_latent(test_x)
        torch.testing.assert_close(ours.mean, theirs.mean, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(ours.variance, theirs.variance, rtol=1e-6, atol=1e-7)


def test_iterated_refits_run_the_recursion_with_the_tempered_evidence_hyperparameters(toy):
    x, y, test_x = toy
    model = DistributionCentricGPC(
        x, y, _start_kernel(), num_steps=3, method="iterated", refit_hyperparameters=True, **REFIT
    )
    proba = model.predict_proba(test_x)
    for t in (1, 2, 3):
        naive = _fitted_classifier(x, y, _start_kernel(), temperature=float(t))
        kernel = model.step_covar_modules[t - 1]
        _assert_same_hyperparameters(kernel, naive.covar_module)
        # step t is step t of the recursion without refits at step t's hyperparameters
        fixed = DistributionCentricGPC(x, y, naive.covar_module, num_steps=t, method="iterated")
        with torch.no_grad():
            torch.testing.assert_close(
                proba[t - 1], fixed.predict_proba(test_x, step=t), rtol=1e-6, atol=1e-7
            )


def test_without_refits_every_step_shares_the_given_kernel(toy):
    x, y, _ = toy
    kernel = _kernel()
    model = DistributionCentricGPC(x, y, kernel, num_steps=3).fit()
    assert model.step_covar_modules == (kernel,) * 3
    assert model.refit_history == {}


def test_refits_of_an_unkept_step_and_after_loading_and_moving(toy):
    x, y, test_x = toy
    options = {"num_steps": 3, "method": "tempered", "refit_hyperparameters": True, **REFIT}
    full = DistributionCentricGPC(x, y, _start_kernel(), **options)
    last = DistributionCentricGPC(x, y, _start_kernel(), store_all_steps=False, **options).fit()
    assert sorted(last.refit_history) == [3]
    torch.testing.assert_close(
        last.predict_proba(test_x, step=2), full.predict_proba(test_x, step=2)
    )
    loaded = DistributionCentricGPC(x, y, _start_kernel(), **options)
    loaded.load_state_dict(full.state_dict())  # the step modules are not saved: it refits
    torch.testing.assert_close(loaded.predict_proba(test_x), full.predict_proba(test_x))
    moved = full.to(torch.float32)
    p32 = moved.predict_proba(test_x.float())
    assert (
        p32.dtype == torch.float32
        and moved.step_covar_modules[0].outputscale.dtype == torch.float32
    )


def test_refits_report_each_iterated_step_and_a_callback_stops_them(toy):
    x, y, test_x = toy
    model = DistributionCentricGPC(
        x, y, _start_kernel(), num_steps=3, refit_hyperparameters=True, **REFIT
    )
    records = []

    def stop_after_step_two(record):  # the steps' records; the refits' have a phase
        if record.phase is None:
            records.append(record)
            return record.iteration == 2

    model.fit(callback=stop_after_step_two)
    assert [r.iteration for r in records] == [1, 2]
    assert records[1].info["refit_iterations"] == REFIT["refit_max_iter"]
    assert model.predict_proba(test_x).shape[0] == 2


def test_refit_options_refuse_bad_values(toy):
    x, y, _ = toy
    with pytest.raises(TypeError, match="refit_hyperparameters must be True or False"):
        DistributionCentricGPC(x, y, _kernel(), refit_hyperparameters=None)
    with pytest.raises(ValueError, match="refit_max_iter"):
        DistributionCentricGPC(x, y, _kernel(), refit_hyperparameters=True, refit_max_iter=1.5)
    with pytest.raises(ValueError, match="refit_lr"):
        DistributionCentricGPC(x, y, _kernel(), refit_lr=float("nan"))
    frozen = _kernel()
    for p in frozen.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="refit_hyperparameters=True needs"):
        DistributionCentricGPC(x, y, frozen, refit_hyperparameters=True)


@pytest.mark.parametrize("method", ["iterated", "tempered"])
def test_refits_of_a_batch_with_a_batched_kernel_fit_each_member_alone(toy, method):
    x, y, test_x = toy
    batch = torch.Size([2])
    kernel = gpytorch.kernels.ScaleKernel(
        gpytorch.kernels.RBFKernel(batch_shape=batch), batch_shape=batch
    ).double()
    kernel.outputscale, kernel.base_kernel.lengthscale = 1.0, 1.0
    options = {"num_steps": 2, "method": method, "refit_hyperparameters": True, **REFIT}
    model = DistributionCentricGPC(x, torch.stack([y, 1 - y]), kernel, **options)
    proba = model.predict_proba(test_x)
    assert proba.shape == (2, 2, test_x.shape[0], 2)
    single = DistributionCentricGPC(x, 1 - y, _start_kernel(), **options)
    torch.testing.assert_close(proba[1], single.predict_proba(test_x), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    ("method", "store_all_steps", "matrices"),
    [("iterated", True, 11 + 4), ("iterated", False, 11 + 1), ("tempered", True, 7 + 4)],
)
def test_a_model_beyond_the_free_memory_is_refused_before_its_buffers_are_allocated(
    use_setting, toy, method, store_all_steps, matrices
):
    x, y, test_x = toy
    needed = matrices * 25 * 25 * 8  # float64 matrices of 25 x 25
    use_setting(gpsd.settings.memory_limit(cpu=needed - 1))
    options = dict(num_steps=4, method=method, store_all_steps=store_all_steps)
    with pytest.raises(gpsd.InsufficientMemoryError) as raised:
        DistributionCentricGPC(x, y, _kernel(), **options)
    message = str(raised.value)
    assert f"DistributionCentricGPC needs about {needed} bytes" in message
    assert ("store_all_steps=False" in message) == store_all_steps
    use_setting(gpsd.settings.memory_limit(cpu=needed))
    model = DistributionCentricGPC(x, y, _kernel(), **options)
    # the data replaced by more rows than fit: refused again when fitted
    model.set_train_data(torch.cat([x, x]), torch.cat([y, y]), strict=False)
    with pytest.raises(gpsd.InsufficientMemoryError, match="DistributionCentricGPC.fit needs"):
        model.predict_proba(test_x)


@pytest.mark.parametrize(("method", "phases"), [("iterated", 2), ("tempered", 1)])
def test_refits_report_their_adam_iterations_in_named_phases(toy_for_refits, method, phases):
    x, y, _ = toy_for_refits
    records = []
    model = DistributionCentricGPC(
        x, y, _start_kernel(), num_steps=2, method=method, refit_hyperparameters=True, **REFIT
    )
    model.fit(callback=records.append)
    refit = REFIT["refit_max_iter"]
    names = ["refit of step 1", "refit of step 2"] if method == "iterated" else ["refit"]
    expected = []
    for k, name in enumerate(names[:phases], start=1):
        expected += [(name, i) for i in range(1, refit + 1)] + [(None, k)]
    assert [(r.phase, r.iteration) for r in records] == expected
    assert {r.task for r in records} == {"DistributionCentricGPC.fit"}


# ------------------------------------------------------------------ the fit lifecycle


@pytest.mark.parametrize("num_classes", [2, 3])
@pytest.mark.parametrize("trigger", [*COMMON_TRIGGERS, "model setting", "set_train_data"])
def test_each_refit_trigger_refits_and_predictions_do_not(toy, trigger, num_classes, count_calls):
    x, y, test_x = toy
    labels = labels_of_classes(x, y, num_classes)
    build = functools.partial(
        DistributionCentricGPC, x, labels, num_steps=3, method="tempered", num_samples=256
    )
    model = build(_kernel()).fit()
    model.predict_proba(test_x, step=2)  # an approximation's step, computed once on request
    fits = count_calls(DistributionCentricGPC, "_compute_fit")
    one_step = "_fit_class_step" if num_classes > 2 else "_fit_approximation"
    steps = count_calls(DistributionCentricGPC, one_step)
    model.predict_proba(test_x, step=2)
    model.latent_modes()
    with torch.no_grad():  # the fit was made under grad mode
        model.predict(test_x)
    assert fits == [0] and steps == [1]  # step 1 alone was not computed yet
    setting = contextlib.nullcontext()
    if trigger in COMMON_TRIGGERS:
        rival = functools.partial(build, _kernel(1.0, 0.5))
        test_x, setting = apply_common_trigger(trigger, model, rival, test_x)
    elif trigger == "model setting":
        model.max_iter = 50
    else:
        model.set_train_data(targets=(labels + 1) % num_classes)
    with setting:
        model.predict_proba(test_x, step=3)
    assert fits == [1]


@pytest.mark.parametrize(
    ("method", "num_classes"), [("iterated", 2), ("scaled_kernel", 2), ("tempered", 3)]
)
def test_a_state_dict_round_trip_and_copies_predict_identically(
    toy, method, num_classes, count_calls
):
    x, y, test_x = toy
    build = functools.partial(
        DistributionCentricGPC,
        x,
        labels_of_classes(x, y, num_classes),
        num_steps=3,
        method=method,
        num_samples=256,
    )
    model = build(_kernel()).fit()
    want = model.predict_latent(test_x)
    want_proba = model.predict_proba(test_x)
    loaded = build(_kernel(1.0, 0.5))
    loaded.predict_latent(test_x, step=3)  # fitted at its own state: the load makes it stale
    loaded.load_state_dict(model.state_dict())
    fits = count_calls(DistributionCentricGPC, "_compute_fit")
    for other in (loaded, copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        predictions_equal(other.predict_latent(test_x), want)
        torch.testing.assert_close(other.predict_proba(test_x), want_proba, rtol=0, atol=1e-12)
    assert fits == [3]
