"""DataCentricGPC against a naive chain of independent Laplace classifiers and scikit-learn, and
the estimator convention (lazy fit, every step along a step dimension, best_step, callbacks)."""

import contextlib
import copy
import functools
import math
import pickle

import gpytorch
import numpy as np
import pytest
import torch
from fit_triggers import (
    COMMON_TRIGGERS,
    apply_common_trigger,
    labels_of_classes,
    predict_every_way,
    predictions_equal,
)
from gpr_reference import rbf_kernel
from scipy import integrate
from sklearn.gaussian_process import GaussianProcessClassifier
from sklearn.gaussian_process.kernels import RBF, ConstantKernel

import gpsd
from gpsd.data.toy import sine_classification
from gpsd.distillation.data_centric_gpc import DataCentricGPC
from gpsd.laplace import LaplaceGPClassifier


def _kernel(outputscale=3.0, lengthscale=1.0):
    k = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).double()
    k.outputscale = outputscale
    k.base_kernel.lengthscale = lengthscale
    return k


@pytest.fixture
def toy():
    return sine_classification(30, seed=1)


def _soft_targets_dense(k, x, f_hat, noise, continuous):
    """E_q[sigmoid(f(x_i))] at the training inputs from dense formulas and scipy quadrature."""
    with torch.no_grad():
        K = k(x[:, None]).to_dense().numpy()
    f = f_hat.numpy()
    Kn = K + noise * np.eye(len(f))
    if continuous:  # W = A''(f) = 1/f^2 - e^f / (e^f - 1)^2 (no f near 0 here)
        W = 1 / f**2 - np.exp(f) / np.expm1(f) ** 2
    else:
        W = 1 / (1 + np.exp(-f)) * (1 / (1 + np.exp(f)))
    mean = K @ np.linalg.solve(Kn, f)
    var = np.diag(K - K @ np.linalg.solve(Kn + np.diag(1 / W), K))
    out = []
    for m, v in zip(mean, var, strict=True):

        def integrand(z, m=m, v=v):
            return (
                1
                / (1 + math.exp(-z))
                * math.exp(-0.5 * (z - m) ** 2 / v)
                / math.sqrt(2 * math.pi * v)
            )

        out.append(
            integrate.quad(integrand, m - 40 * math.sqrt(v), m + 40 * math.sqrt(v), epsabs=1e-13)[0]
        )
    return torch.tensor(out, dtype=torch.float64)


def test_step_one_matches_sklearn(toy):

    x, y, test_x = toy
    model = DataCentricGPC(x, y, _kernel(), num_steps=1).fit()
    gpc = GaussianProcessClassifier(ConstantKernel(3.0) * RBF(1.0), optimizer=None).fit(
        x.numpy()[:, None], y.numpy()
    )
    np.testing.assert_allclose(
        model.latent_modes(1).numpy(), gpc.base_estimator_.f_cached, atol=1e-6
    )


@pytest.mark.parametrize("likelihood", ["continuous_bernoulli", "bernoulli"])
def test_three_steps_match_naive_chain(toy, likelihood):
    x, y, test_x = toy
    noise = [0.0, 0.1, 0.3]
    model = DataCentricGPC(
        x, y, _kernel(), num_steps=3, noise=noise, soft_target_likelihood=likelihood
    ).fit()
    # naive chain: an independent Laplace classifier per step on targets computed densely
    targets = y
    f_prev = None
    for step in range(1, 4):
        if step > 1:
            continuous = step > 2 and likelihood == "continuous_bernoulli"
            targets = _soft_targets_dense(_kernel(), x, f_prev, noise[step - 2], continuous)
            torch.testing.assert_close(model.step_targets(step), targets, rtol=1e-8, atol=1e-9)
        lik = (
            "bernoulli_logit" if step == 1 or likelihood == "bernoulli" else "continuous_bernoulli"
        )
        if step > 1 and likelihood == "bernoulli":
            from gpsd.laplace import BernoulliLogitTerms

            class _SoftLogit(BernoulliLogitTerms):  # the misspecified model accepts soft targets
                def check_targets(self, y, name="train_y"):
                    pass

            lik = _SoftLogit()
        naive = LaplaceGPClassifier(
            x, targets, _kernel(), likelihood=lik, noise=noise[step - 1]
        ).fit()
        torch.testing.assert_close(model.latent_modes(step), naive.mode.f, rtol=1e-7, atol=1e-7)
        latent = model.predict_latent(test_x, step=step)
        mean, var = latent.mean, latent.variance
        latent = naive.predict_latent(test_x)
        n_mean, n_var = latent.mean, latent.variance
        torch.testing.assert_close(mean, n_mean.detach(), rtol=1e-7, atol=1e-7)
        torch.testing.assert_close(var, n_var.detach(), rtol=1e-7, atol=1e-7)
        f_prev = naive.mode.f


def test_continuous_bernoulli_is_more_extreme_than_misspecified_bernoulli(toy):
    x, y, test_x = toy
    cb = DataCentricGPC(x, y, _kernel(), num_steps=2).fit()
    bern = DataCentricGPC(x, y, _kernel(), num_steps=2, soft_target_likelihood="bernoulli").fit()
    p_cb, p_b = cb.predict_proba(x), bern.predict_proba(x)
    assert (p_cb - 0.5).abs().mean() > (p_b - 0.5).abs().mean()
    # noise on the kernel diagonal regularises the C-GPC (Fig. 5)
    reg = DataCentricGPC(x, y, _kernel(), num_steps=2, noise=[0.0, 1.0]).fit()
    assert (reg.predict_proba(x) - 0.5).abs().mean() < (p_cb - 0.5).abs().mean()


def test_thresholded_targets_and_warm_start(toy):
    x, y, _ = toy
    thr = DataCentricGPC(x, y, _kernel(), num_steps=3, threshold_targets=True).fit()
    assert set(thr.step_targets()[1:].unique().tolist()) <= {0.0, 1.0}
    warm = DataCentricGPC(x, y, _kernel(), num_steps=4, noise=0.1).fit()
    cold = DataCentricGPC(x, y, _kernel(), num_steps=4, noise=0.1, warm_start=False).fit()
    torch.testing.assert_close(warm.latent_modes(), cold.latent_modes(), rtol=1e-8, atol=1e-8)
    assert sum(warm.newton_iterations[1:]) < sum(cold.newton_iterations[1:])


def test_state_dict_round_trip(toy):
    x, y, test_x = toy
    model = DataCentricGPC(x, y, _kernel(), num_steps=2, noise=0.1).fit()
    probs = model.predict_proba(test_x)
    other = DataCentricGPC(x, y, _kernel(1.0, 2.0), num_steps=2, noise=0.1)
    other.load_state_dict(model.state_dict())
    torch.testing.assert_close(other.predict_proba(test_x), probs)


def test_bad_input(toy):
    x, y, test_x = toy
    with pytest.raises(ValueError, match="train_y must hold binary labels"):
        DataCentricGPC(x, y * 0.3, _kernel())
    nan_y = y.clone()
    nan_y[2] = float("nan")
    with pytest.raises(ValueError, match="train_y must be finite"):
        DataCentricGPC(x, nan_y, _kernel())
    with pytest.raises(ValueError, match="train_y must have 30 entries"):
        DataCentricGPC(x, y[:5], _kernel())
    with pytest.raises(ValueError, match="num_steps"):
        DataCentricGPC(x, y, _kernel(), num_steps=0)
    with pytest.raises(ValueError, match="num_steps=3 does not match the 2 steps of the noise"):
        DataCentricGPC(x, y, _kernel(), num_steps=3, noise=[0.1, 0.2])
    with pytest.raises(ValueError, match="noise must hold finite numbers >= 0"):
        DataCentricGPC(x, y, _kernel(), num_steps=2, noise=[0.1, -0.2])
    with pytest.raises(ValueError, match="soft_target_likelihood"):
        DataCentricGPC(x, y, _kernel(), soft_target_likelihood="beta")
    model = DataCentricGPC(x, y, _kernel(), num_steps=2)
    with pytest.raises(ValueError, match="step must lie in 1..2"):
        model.predict_proba(test_x, step=3)
    with pytest.raises(ValueError, match="step must be a positive int"):
        model.predict_proba(test_x, step=1.7)  # not rounded to step 1


def test_float32_close_to_float64(toy):
    x, y, test_x = toy
    ref = DataCentricGPC(x, y, _kernel(), num_steps=3, noise=0.1).fit().predict_proba(test_x)
    k32 = _kernel().float()
    model = DataCentricGPC(x.float(), y.float(), k32, num_steps=3, noise=0.1).fit()
    p32 = model.predict_proba(test_x.float())
    assert p32.dtype == torch.float32
    torch.testing.assert_close(p32.double(), ref, rtol=1e-3, atol=1e-3)


def test_fit_returns_self_and_the_model_fits_lazily(toy):
    x, y, test_x = toy
    model = DataCentricGPC(x, y, _kernel(), num_steps=2)
    assert model.fit() is model
    lazy = DataCentricGPC(x, y, _kernel(), num_steps=2)  # no fit(): the first prediction fits
    torch.testing.assert_close(lazy.predict_proba(test_x), model.predict_proba(test_x))
    with pytest.raises(TypeError):
        DataCentricGPC(x, y, _kernel(), gpytorch.means.ZeroMean())


def test_every_step_along_a_step_dimension_and_step_t_is_row_t_minus_1(toy):
    x, y, test_x = toy
    model = DataCentricGPC(x, y, _kernel(), num_steps=3, noise=[0.0, 0.1, 0.2])
    proba = model.predict_proba(test_x)
    M = test_x.shape[0]
    assert proba.shape == (3, M, 2)
    torch.testing.assert_close(proba.sum(-1), torch.ones(3, M, dtype=torch.float64))
    latent = model.predict_latent(test_x)
    assert isinstance(latent, gpsd.Prediction) and latent.mean.shape == (3, M)
    labels = model.predict(test_x)
    assert labels.dtype == torch.long and labels.shape == (3, M)
    torch.testing.assert_close(labels, (proba[..., 1] > 0.5).long())
    for t in (1, 2, 3):
        torch.testing.assert_close(model.predict_proba(test_x, step=t), proba[t - 1])
        one = model.predict_latent(test_x, step=t)
        torch.testing.assert_close(
            (one.mean, one.variance), (latent.mean[t - 1], latent.variance[t - 1])
        )
        torch.testing.assert_close(model.predict(test_x, step=t), labels[t - 1])
    # step 1 is the ordinary classifier on the labels (row 0 of step_targets())
    torch.testing.assert_close(model.step_targets(1), y)
    reference = LaplaceGPClassifier(x, y, _kernel(), noise=0.0)
    torch.testing.assert_close(proba[0], reference.predict_proba(test_x).detach())
    # the noise is one value per step, entry t - 1 for step t
    assert model.noise.shape == (3,) and model.noise[1].item() == 0.1


def test_a_batch_of_label_sets_puts_the_step_after_the_batch(toy):
    x, y, test_x = toy
    labels = torch.stack([y, 1 - y])  # shape: (2, n)
    model = DataCentricGPC(x, labels, _kernel(), num_steps=3)
    proba = model.predict_proba(test_x)
    assert proba.shape == (2, 3, test_x.shape[0], 2)
    single = DataCentricGPC(x, 1 - y, _kernel(), num_steps=3)
    torch.testing.assert_close(proba[1], single.predict_proba(test_x))
    assert model.predict_proba(test_x, step=2).shape == (2, test_x.shape[0], 2)


def test_best_step_is_the_1_based_step_of_the_smallest_validation_log_loss(toy):
    x, y, test_x = toy
    val_x, val_y, _ = sine_classification(40, seed=7)
    model = DataCentricGPC(x, y, _kernel(), num_steps=4, noise=0.05)
    losses = model.validation_log_loss(val_x, val_y)
    assert losses.shape == (4,)
    p = model.predict_proba(val_x)[..., 1]
    by_hand = -(val_y * p.log() + (1 - val_y) * (1 - p).log()).mean(-1)
    torch.testing.assert_close(losses, by_hand)
    step = model.best_step("validation", val_x=val_x, val_y=val_y)
    assert isinstance(step, int) and step == int(by_hand.argmin()) + 1
    with pytest.raises(ValueError, match="criterion"):
        model.best_step("gcv", val_x=val_x, val_y=val_y)
    with pytest.raises(ValueError, match="val_y"):
        model.validation_log_loss(val_x, val_y[:3])


def test_fit_reports_each_step_and_a_callback_stops_it(toy):
    x, y, test_x = toy
    model = DataCentricGPC(x, y, _kernel(), num_steps=4, noise=0.1)
    records = []

    def stop_after_step_two(record):  # the steps' records; the refits' have a phase
        if record.phase is None:
            records.append(record)
            return record.iteration == 2

    model.fit(callback=stop_after_step_two)
    assert [r.iteration for r in records] == [1, 2]
    assert records[0].task == "DataCentricGPC.fit" and records[0].total == 4
    assert len(model.newton_iterations) == 2
    assert model.predict_proba(test_x).shape[0] == 2  # the steps the fit reached
    with pytest.raises(ValueError, match="not fitted"):
        model.predict_proba(test_x, step=3)
    full = DataCentricGPC(x, y, _kernel(), num_steps=4, noise=0.1).fit(progress=True)
    torch.testing.assert_close(
        model.predict_proba(test_x, step=2), full.predict_proba(test_x, step=2)
    )
    model.fit()
    assert model.predict_proba(test_x).shape[0] == 4


@pytest.fixture
def toy_for_refits():
    return sine_classification(25, seed=4)


def test_data_centric_gpc_follows_hyperparameters_and_settings(toy_for_refits):
    x, y, test_x = toy_for_refits
    model = DataCentricGPC(x, y, rbf_kernel(3.0, 1.0), num_steps=3).fit()
    model.predict_proba(test_x)
    model.covar_module.outputscale = 8.0
    model.covar_module.base_kernel.lengthscale = 0.6
    model.threshold_targets = True
    # the modes of the first kernel were combined with the new one: probabilities far off
    fresh = DataCentricGPC(x, y, rbf_kernel(8.0, 0.6), num_steps=3, threshold_targets=True).fit()
    for step in (1, 3):
        torch.testing.assert_close(
            model.predict_proba(test_x, step=step), fresh.predict_proba(test_x, step=step)
        )
        torch.testing.assert_close(
            model.predict_latent(test_x, step=step).mean,
            fresh.predict_latent(test_x, step=step).mean,
        )


# ------------------------------------------------------------------ per-step hyperparameter refits

REFIT = {"refit_max_iter": 15, "refit_lr": 0.1}


def _refit_kernel(batch_shape=()):
    batch_shape = torch.Size(batch_shape)
    k = gpytorch.kernels.ScaleKernel(
        gpytorch.kernels.RBFKernel(batch_shape=batch_shape), batch_shape=batch_shape
    ).double()
    k.outputscale = 1.0
    k.base_kernel.lengthscale = 1.0
    return k


def _naive_refit_chain(x, y, test_x, noise, likelihood, num_steps, kernel=_refit_kernel):
    """An independent LaplaceGPClassifier per step, its hyperparameters optimised on the step's
    targets from the same start; the next targets are its probabilities at the inputs."""
    from gpsd.laplace import BernoulliLogitTerms

    class _SoftLogit(BernoulliLogitTerms):  # the misspecified model accepts soft targets
        def check_targets(self, y, name="train_y"):
            pass

    targets, out = y, []
    for step in range(1, num_steps + 1):
        if step == 1:
            lik = "bernoulli_logit"
        else:
            lik = "continuous_bernoulli" if likelihood == "continuous_bernoulli" else _SoftLogit()
        naive = LaplaceGPClassifier(x, targets, kernel(), likelihood=lik, noise=noise[step - 1])
        naive.optimize_hyperparameters(max_iter=REFIT["refit_max_iter"], lr=REFIT["refit_lr"])
        with torch.no_grad():
            out.append((targets, naive, naive.predict_latent(test_x)))
            targets = naive.predict_proba(x)[..., 1]
    return out


@pytest.mark.parametrize("likelihood", ["continuous_bernoulli", "bernoulli"])
def test_refits_give_each_step_an_independent_classifier_fitted_to_its_targets(toy, likelihood):
    x, y, test_x = toy
    noise = [0.0, 0.1, 0.3]
    start = _refit_kernel()
    model = DataCentricGPC(
        x,
        y,
        start,
        num_steps=3,
        noise=noise,
        soft_target_likelihood=likelihood,
        refit_hyperparameters=True,
        **REFIT,
    ).fit()
    chain = _naive_refit_chain(x, y, test_x, noise, likelihood, 3)
    lengthscales = []
    for step, (targets, naive, latent) in enumerate(chain, start=1):
        torch.testing.assert_close(model.step_targets(step), targets, rtol=1e-7, atol=1e-8)
        kernel = model.step_covar_modules[step - 1]
        for name in ("outputscale", "base_kernel.lengthscale"):
            ours, theirs = kernel, naive.covar_module
            for part in name.split("."):
                ours, theirs = getattr(ours, part), getattr(theirs, part)
            torch.testing.assert_close(ours, theirs.detach(), rtol=1e-6, atol=1e-8)
        assert len(model.refit_history[step - 1]) == REFIT["refit_max_iter"]
        np.testing.assert_allclose(model.refit_history[step - 1], naive.history, rtol=1e-6)
        ours = model.predict_latent(test_x, step=step)
        torch.testing.assert_close(ours.mean, latent.mean, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(ours.variance, latent.variance, rtol=1e-6, atol=1e-6)
        lengthscales.append(kernel.base_kernel.lengthscale.item())
    assert len(set(lengthscales)) == 3  # every step has hyperparameters of its own
    # the given kernel is the starting point, left as it is
    assert start.outputscale.item() == pytest.approx(1.0)
    assert start.base_kernel.lengthscale.item() == pytest.approx(1.0)


def test_without_refits_every_step_shares_the_given_modules(toy):
    x, y, _ = toy
    kernel = _kernel()
    model = DataCentricGPC(x, y, kernel, num_steps=3).fit()
    assert model.step_covar_modules == (kernel,) * 3
    assert model.step_mean_modules == (model.mean_module,) * 3
    assert model.refit_history == [[], [], []]


def test_refits_follow_their_settings_and_cache_the_fit(toy):
    x, y, test_x = toy
    model = DataCentricGPC(x, y, _refit_kernel(), num_steps=2, refit_hyperparameters=True, **REFIT)
    first = model.predict_proba(test_x)
    kernels = model.step_covar_modules
    model.predict_proba(test_x)
    assert model.step_covar_modules[1] is kernels[1]  # no refit while nothing changed
    model.refit_lr = 0.02
    again = DataCentricGPC(
        x,
        y,
        _refit_kernel(),
        num_steps=2,
        refit_hyperparameters=True,
        refit_max_iter=15,
        refit_lr=0.02,
    )
    torch.testing.assert_close(model.predict_proba(test_x), again.predict_proba(test_x))
    model.refit_hyperparameters = False
    plain = DataCentricGPC(x, y, _refit_kernel(), num_steps=2)
    torch.testing.assert_close(model.predict_proba(test_x), plain.predict_proba(test_x))
    assert not torch.allclose(first, plain.predict_proba(test_x))
    # a new starting point refits
    model.refit_hyperparameters = True
    model.covar_module.base_kernel.lengthscale = 0.5
    moved = _refit_kernel()
    moved.base_kernel.lengthscale = 0.5
    other = DataCentricGPC(x, y, moved, num_steps=2, refit_hyperparameters=True, refit_max_iter=15)
    other.refit_lr = 0.02
    torch.testing.assert_close(model.predict_proba(test_x), other.predict_proba(test_x))


def test_refits_report_each_step_and_a_callback_stops_them(toy):
    x, y, test_x = toy
    model = DataCentricGPC(x, y, _refit_kernel(), num_steps=3, refit_hyperparameters=True, **REFIT)
    records = []

    def stop_after_step_two(record):  # the steps' records; the refits' have a phase
        if record.phase is None:
            records.append(record)
            return record.iteration == 2

    model.fit(callback=stop_after_step_two)
    assert [r.iteration for r in records] == [1, 2]
    assert records[0].info["refit_iterations"] == REFIT["refit_max_iter"]
    assert len(model.step_covar_modules) == 2
    assert model.predict_proba(test_x).shape[0] == 2


def test_refits_of_a_batch_with_a_batched_kernel_fit_each_member_alone(toy):
    x, y, test_x = toy
    labels = torch.stack([y, 1 - y])  # shape: (2, n)
    model = DataCentricGPC(
        x,
        labels,
        _refit_kernel(torch.Size([2])),
        num_steps=2,
        noise=0.1,
        refit_hyperparameters=True,
        **REFIT,
    )
    proba = model.predict_proba(test_x)
    assert proba.shape == (2, 2, test_x.shape[0], 2)
    single = DataCentricGPC(
        x, 1 - y, _refit_kernel(), num_steps=2, noise=0.1, refit_hyperparameters=True, **REFIT
    )
    torch.testing.assert_close(proba[1], single.predict_proba(test_x), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(
        model.step_covar_modules[1].base_kernel.lengthscale[1].squeeze(),
        single.step_covar_modules[1].base_kernel.lengthscale.squeeze(),
        rtol=1e-6,
        atol=1e-8,
    )


def test_refits_in_float32_close_to_float64(toy):
    x, y, test_x = toy
    options = {"num_steps": 2, "noise": 0.1, "refit_hyperparameters": True, **REFIT}
    ref = DataCentricGPC(x, y, _refit_kernel(), **options).predict_proba(test_x)
    model = DataCentricGPC(x.float(), y.float(), _refit_kernel().float(), **options)
    p32 = model.predict_proba(test_x.float())
    assert p32.dtype == torch.float32
    torch.testing.assert_close(p32.double(), ref, rtol=2e-3, atol=2e-3)


def test_refit_predictions_are_differentiable_in_the_test_inputs(toy):
    x, y, test_x = toy
    model = DataCentricGPC(x, y, _refit_kernel(), num_steps=2, refit_hyperparameters=True, **REFIT)
    z = test_x[:3].clone().requires_grad_(True)
    model.predict_latent(z, step=2).mean.sum().backward()
    h = 1e-6
    with torch.no_grad():
        up = model.predict_latent(z + h, step=2).mean
        down = model.predict_latent(z - h, step=2).mean
    torch.testing.assert_close(z.grad, (up - down) / (2 * h), rtol=1e-5, atol=1e-7)


def test_refit_options_refuse_bad_values(toy):
    x, y, _ = toy
    with pytest.raises(TypeError, match="refit_hyperparameters must be True or False"):
        DataCentricGPC(x, y, _refit_kernel(), refit_hyperparameters="yes")
    with pytest.raises(ValueError, match="refit_max_iter"):
        DataCentricGPC(x, y, _refit_kernel(), refit_hyperparameters=True, refit_max_iter=0)
    with pytest.raises(ValueError, match="refit_lr"):
        DataCentricGPC(x, y, _refit_kernel(), refit_hyperparameters=True, refit_lr=-0.1)
    frozen = _refit_kernel()
    for p in frozen.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="refit_hyperparameters=True needs"):
        DataCentricGPC(x, y, frozen, refit_hyperparameters=True)
    model = DataCentricGPC(x, y, frozen)
    with pytest.raises(TypeError, match="refit_hyperparameters"):
        model.refit_hyperparameters = 1
    with pytest.raises(ValueError, match="refit_lr"):
        model.refit_lr = 0.0
    model.refit_hyperparameters = True
    with pytest.raises(ValueError, match="refit_hyperparameters=True needs"):
        model.fit()


def test_a_fit_beyond_the_free_memory_is_refused_naming_num_steps(use_setting, count_calls, toy):
    from gpsd.distillation import data_centric_gpc

    x, y, test_x = toy
    needed = (5 + 4) * 30 * 30 * 8  # 5 working matrices and one factor per step, float64
    evaluations = count_calls(data_centric_gpc, "prior_at_training")
    use_setting(gpsd.settings.memory_limit(cpu=needed - 1))
    model = DataCentricGPC(x, y, _kernel(), num_steps=4)
    for attempt in (model.fit, lambda: model.predict_proba(test_x)):
        with pytest.raises(gpsd.InsufficientMemoryError) as raised:
            attempt()
        assert f"DataCentricGPC.fit needs about {needed} bytes" in str(raised.value)
        assert "fewer num_steps" in str(raised.value)
    assert evaluations == [0]
    use_setting(gpsd.settings.memory_limit(cpu=needed))
    model.fit()


def test_a_refit_reports_every_adam_iteration_before_its_step(toy_for_refits):
    x, y, _ = toy_for_refits
    records = []
    model = DataCentricGPC(x, y, _refit_kernel(), num_steps=2, refit_hyperparameters=True, **REFIT)
    model.fit(callback=records.append)
    phases = [(r.phase, r.iteration) for r in records]
    refit = REFIT["refit_max_iter"]
    assert phases == (
        [("refit of step 1", i) for i in range(1, refit + 1)]
        + [(None, 1)]
        + [("refit of step 2", i) for i in range(1, refit + 1)]
        + [(None, 2)]
    )
    assert {r.task for r in records} == {"DataCentricGPC.fit"}
    # the refit's losses are the ones its history keeps
    torch.testing.assert_close(
        torch.tensor([r.loss for r in records[:refit]]),
        torch.tensor(model.refit_history[0], dtype=torch.float32),
    )


def test_a_callback_stopping_a_refit_ends_the_fit_after_that_step(toy_for_refits):
    x, y, _ = toy_for_refits
    records = []

    def stop_at_third(record):
        records.append(record)
        return record.phase == "refit of step 1" and record.iteration == 3

    model = DataCentricGPC(x, y, _refit_kernel(), num_steps=3, refit_hyperparameters=True, **REFIT)
    model.fit(callback=stop_at_third)
    assert [r.iteration for r in records] == [1, 2, 3]
    assert len(model.refit_history) == 1 and len(model.refit_history[0]) == 3


# ------------------------------------------------------------------ the fit lifecycle


#: Monte Carlo draws of the three-class models of the lifecycle tests
_LIFECYCLE_SAMPLES = 256


@pytest.mark.parametrize("num_classes", [2, 3])
@pytest.mark.parametrize(
    "trigger", [*COMMON_TRIGGERS, "model setting", "set_train_data", "noise assignment"]
)
def test_each_refit_trigger_refits_and_predictions_do_not(toy, trigger, num_classes, count_calls):
    x, y, test_x = toy
    labels = labels_of_classes(x, y, num_classes)
    build = functools.partial(
        DataCentricGPC, x, labels, num_steps=3, num_samples=_LIFECYCLE_SAMPLES
    )
    model = build(_kernel()).fit()
    fits = count_calls(DataCentricGPC, "_compute_fit")
    predict_every_way(model, test_x)
    assert fits == [0]
    setting = contextlib.nullcontext()
    if trigger in COMMON_TRIGGERS:
        rival = functools.partial(build, _kernel(1.0, 0.5))
        test_x, setting = apply_common_trigger(trigger, model, rival, test_x)
    elif trigger == "model setting" and num_classes == 2:
        model.target_method = "probit"
    elif trigger == "model setting":  # the draws of the soft targets
        model.num_samples = 2 * _LIFECYCLE_SAMPLES
    elif trigger == "set_train_data":
        model.set_train_data(targets=(labels + 1) % num_classes)
    else:
        model.noise = 0.1
    with setting:
        model.predict_proba(test_x)
    assert fits == [1]


def test_the_draws_of_a_binary_model_are_no_refit_trigger(toy, count_calls):
    x, y, test_x = toy
    model = DataCentricGPC(x, y, _kernel(), num_steps=2).fit()
    fits = count_calls(DataCentricGPC, "_compute_fit")
    model.num_samples = 2 * model.num_samples  # the binary steps take no draws
    model.predict_proba(test_x)
    assert fits == [0]


@pytest.mark.parametrize("num_classes", [2, 3])
def test_a_state_dict_round_trip_and_copies_predict_identically(toy, num_classes, count_calls):
    x, y, test_x = toy
    build = functools.partial(
        DataCentricGPC,
        x,
        labels_of_classes(x, y, num_classes),
        num_steps=3,
        num_samples=_LIFECYCLE_SAMPLES,
    )
    model = build(_kernel(), noise=[0.0, 0.1, 0.2]).fit()
    want = model.predict_latent(test_x)
    want_proba = model.predict_proba(test_x)
    loaded = build(_kernel(1.0, 0.5))
    loaded.predict_latent(test_x)  # fitted at its own state: the load makes it stale
    loaded.load_state_dict(model.state_dict())
    fits = count_calls(DataCentricGPC, "_compute_fit")
    for other in (loaded, copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        predictions_equal(other.predict_latent(test_x), want)
        torch.testing.assert_close(other.predict_proba(test_x), want_proba, rtol=0, atol=1e-12)
        torch.testing.assert_close(other.step_targets(), model.step_targets(), rtol=0, atol=1e-12)
    assert fits == [3]


def test_a_loaded_state_of_the_same_hyperparameters_keeps_the_fit_and_its_step_targets(toy):
    # the fitted buffers of an unfitted state are zeros: the fit, not the buffers, answers
    x, y, test_x = toy
    model = DataCentricGPC(x, y, _kernel(), num_steps=3).fit()
    want = model.step_targets()
    model.load_state_dict(DataCentricGPC(x, y, _kernel(), num_steps=3).state_dict())
    torch.testing.assert_close(model.step_targets(), want, rtol=0, atol=0)
    assert float(want[1].abs().sum()) > 0
