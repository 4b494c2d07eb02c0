"""DataCentricGPC against a naive chain of independent Laplace classifiers and scikit-learn, and
the estimator convention (lazy fit, every step along a step dimension, best_step, callbacks)."""

import math

import gpytorch
import numpy as np
import pytest
import torch
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
        model.latent_modes[0].numpy(), gpc.base_estimator_.f_cached, atol=1e-6
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
            torch.testing.assert_close(model.step_targets[step - 1], targets, rtol=1e-8, atol=1e-9)
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
        torch.testing.assert_close(model.latent_modes[step - 1], naive.mode.f, rtol=1e-7, atol=1e-7)
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
    assert set(thr.step_targets[1:].unique().tolist()) <= {0.0, 1.0}
    warm = DataCentricGPC(x, y, _kernel(), num_steps=4, noise=0.1).fit()
    cold = DataCentricGPC(x, y, _kernel(), num_steps=4, noise=0.1, warm_start=False).fit()
    torch.testing.assert_close(warm.latent_modes, cold.latent_modes, rtol=1e-8, atol=1e-8)
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
    with pytest.raises(ValueError, match="noise must have num_steps=3 entries"):
        DataCentricGPC(x, y, _kernel(), num_steps=3, noise=[0.1, 0.2])
    with pytest.raises(ValueError, match="noise must hold finite numbers >= 0"):
        DataCentricGPC(x, y, _kernel(), num_steps=2, noise=[0.1, -0.2])
    with pytest.raises(ValueError, match="soft_target_likelihood"):
        DataCentricGPC(x, y, _kernel(), soft_target_likelihood="beta")
    model = DataCentricGPC(x, y, _kernel(), num_steps=2)
    with pytest.raises(ValueError, match="step must be in 1..2"):
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
    # step 1 is the ordinary classifier on the labels (row 0 of step_targets)
    torch.testing.assert_close(model.step_targets[0], y)
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
    model.fit(callback=lambda r: records.append(r) or r.iteration == 2)
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
