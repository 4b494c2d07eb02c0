"""Behaviour both regression distillers share: the convention (fit, Prediction, steps from 1, best_step, include_noise), the errors, the cached factorisation, devices, dtypes, batches and students."""

import contextlib
import copy
import functools
import pickle
import warnings

import gpytorch
import pytest
import torch
from fit_triggers import COMMON_TRIGGERS, apply_common_trigger, predictions_equal
from gpr_reference import PlainGP, dense_data_centric_means, rbf_kernel, relative_error
from gpytorch.utils.warnings import NumericalWarning

import gpsd
import gpsd.linalg
import gpsd.linalg.backend as backend_module
from gpsd import (
    DataCentricGPR,
    DistributionCentricGPR,
    PosteriorKernel,
    Prediction,
)
from gpsd.linalg import SpectralFilter
from gpsd.linalg._shifted_solve import ShiftedSolveEngine

DT = torch.float64


CLASSES = [DataCentricGPR, DistributionCentricGPR]


NOISE = [0.1, 0.3, 0.05]

#: Tests that force ``backend="cg"`` on a few points, where its warning about a slowly decaying
#: spectrum is expected (the warning itself is tested in tests/linalg/test_backend.py).
_CG_ON_A_SMALL_PROBLEM = pytest.mark.filterwarnings(
    "ignore:backend='cg' on a slowly decaying spectrum"
)


def _problem(n=30, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = 10 * torch.rand(n, 1, generator=gen, dtype=DT)
    y = torch.sin(x[:, 0]) + 0.1 * torch.randn(n, generator=gen, dtype=DT)
    return x, y, torch.linspace(0, 10, 9, dtype=DT).unsqueeze(-1)


def _step_noise(model):
    """The noise of each step, from the papers' definitions (not the model's own helper)."""
    if isinstance(model, DataCentricGPR):
        return model.noise
    return 1.0 / torch.cumsum(1.0 / model.noise, dim=-1)  # Theorem 3.3


@pytest.fixture
def count_factorisations(monkeypatch):
    """Counts the calls of :func:`gpsd.linalg.make_engine` (each factors K once)."""
    calls = []
    make_engine = gpsd.linalg.make_engine

    def counting(*args, **kwargs):
        calls.append(1)
        return make_engine(*args, **kwargs)

    monkeypatch.setattr(gpsd.linalg, "make_engine", counting)
    return calls


@pytest.mark.parametrize("cls", CLASSES)
def test_fit_returns_the_model_and_factors_now(cls, count_factorisations):
    x, y, test_x = _problem()
    model = cls(x, y, rbf_kernel(), noise=NOISE, backend="dense")
    assert count_factorisations == []  # nothing before fit() or first use
    with torch.no_grad():
        assert model.fit() is model
        assert len(count_factorisations) == 1
        model.predict(test_x)
    assert len(count_factorisations) == 1


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("trainable", [True, False], ids=["trainable", "frozen"])
def test_a_fit_under_grad_mode_serves_predictions_under_no_grad(cls, trainable, count_calls):
    x, y, test_x = _problem()
    kernel = rbf_kernel()
    kernel.requires_grad_(trainable)
    factorisations = count_calls(gpsd.linalg, "make_engine")
    model = cls(x, y, kernel, noise=NOISE, backend="dense").fit()  # grad mode
    with torch.no_grad():
        got = model.predict(test_x)
    assert factorisations == [1]
    assert not got.mean.requires_grad
    with torch.no_grad():  # a model fitted under no_grad alone, as reference
        reference = cls(x, y, rbf_kernel(), noise=NOISE, backend="dense").predict(test_x)
    torch.testing.assert_close(got.mean, reference.mean, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(got.variance, reference.variance, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("cls", CLASSES)
def test_a_fit_without_a_graph_refits_once_a_gradient_is_needed(cls, count_calls):
    x, y, test_x = _problem()
    kernel = rbf_kernel()
    kernel.requires_grad_(False)
    factorisations = count_calls(gpsd.linalg, "make_engine")
    model = cls(x, y, kernel, noise=NOISE, backend="dense").fit()  # grad mode, but no graph
    kernel.requires_grad_(True)
    model.predict_mean(test_x).sum().backward()
    assert factorisations == [2]
    # the gradient through the refitted factorisation, against central differences
    raw = kernel.base_kernel.raw_lengthscale
    step = 1e-6
    with torch.no_grad():
        raw += step
        up = cls(x, y, kernel, noise=NOISE, backend="dense").predict_mean(test_x).sum()
        raw -= 2 * step
        down = cls(x, y, kernel, noise=NOISE, backend="dense").predict_mean(test_x).sum()
        raw += step
    assert float(raw.grad.sum()) == pytest.approx(float(up - down) / (2 * step), rel=1e-5)


@pytest.mark.parametrize("cls", CLASSES)
def test_the_constructor_takes_data_then_the_kernel_and_names_its_attributes(cls):
    x, y, _ = _problem()
    kernel, mean = rbf_kernel(), gpytorch.means.ConstantMean().to(DT)
    model = cls(x, y, kernel, noise=0.2, num_steps=4, mean_module=mean)
    assert model.covar_module is kernel and model.mean_module is mean
    assert model.num_steps == 4
    torch.testing.assert_close(model.noise, torch.full((4,), 0.2, dtype=DT))
    assert "noise" in dict(model.named_buffers())
    assert cls(x, y, kernel, noise=0.2).num_steps == 1
    assert cls(x, y, kernel, noise=NOISE, num_steps=3).num_steps == 3
    with pytest.raises(ValueError, match="num_steps=2 does not match the 3 steps"):
        cls(x, y, kernel, noise=NOISE, num_steps=2)
    with pytest.raises(ValueError, match="num_steps"):
        cls(x, y, kernel, noise=0.2, num_steps=0)
    with pytest.raises(TypeError, match="covar_module must be a gpytorch.kernels.Kernel"):
        cls(x, y, "rbf", noise=0.2)


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("backend", ["dense", "cholesky", "lanczos"])
def test_predict_returns_a_prediction_whose_row_t_minus_1_is_step_t(cls, backend):
    x, y, test_x = _problem()
    model = cls(x, y, rbf_kernel(), noise=NOISE, backend=backend, rtol=1e-10)
    with torch.no_grad():
        every = model.predict(test_x)
        full = model.predict(test_x, full_cov=True)
        means = model.predict_mean(test_x)
        assert isinstance(every, Prediction)
        assert every.mean.shape == every.variance.shape == (3, 9)
        assert full.covariance.shape == (3, 9, 9)
        for step in (1, 2, 3):
            one = model.predict(test_x, step=step)
            assert one.mean.shape == one.variance.shape == (9,)
            torch.testing.assert_close(one.mean, every.mean[step - 1], rtol=0, atol=0)
            torch.testing.assert_close(one.variance, every.variance[step - 1], rtol=0, atol=0)
            torch.testing.assert_close(model.predict_mean(test_x, step=step), means[step - 1])
            cov = model.predict(test_x, step=step, full_cov=True).covariance
            torch.testing.assert_close(cov, full.covariance[step - 1])
        for step in (0, 4, -1):
            with pytest.raises(ValueError, match="step"):
                model.predict(test_x, step=step)
            with pytest.raises(ValueError, match="step"):
                model.predict_mean(test_x, step=step)


@pytest.mark.parametrize("cls", CLASSES)
def test_step_t_equals_an_exact_gp_with_that_steps_noise_from_dense_solves(cls):
    x, y, test_x = _problem()
    kernel = rbf_kernel()
    model = cls(x, y, kernel, noise=NOISE, backend="dense")
    with torch.no_grad():
        k = kernel(x).to_dense()
        ks, kss = kernel(test_x, x).to_dense(), kernel(test_x).to_dense()
        for step in (1, 2, 3):
            noise = float(_step_noise(model)[step - 1])
            targets = model.step_targets(step)
            solve = torch.linalg.solve(k + noise * torch.eye(30, dtype=DT), ks.T)
            got = model.predict(test_x, step=step, include_noise=True, full_cov=True)
            assert relative_error(got.mean, solve.T @ targets) < 1e-9
            want = kss - ks @ solve + noise * torch.eye(9, dtype=DT)
            assert relative_error(got.covariance, want) < 1e-9
            assert relative_error(got.variance, want.diagonal()) < 1e-9


@pytest.mark.parametrize("cls", CLASSES)
def test_include_noise_adds_each_steps_noise(cls):
    x, y, test_x = _problem()
    schedules = torch.tensor([NOISE, [0.2, 0.2, 0.2]], dtype=DT)  # a batch of two
    model = cls(x, y, rbf_kernel(), noise=schedules, backend="dense")
    with torch.no_grad():
        latent = model.predict(test_x, full_cov=True)
        noisy = model.predict(test_x, include_noise=True, full_cov=True)
        noise = _step_noise(model)  # shape: (2, 3)
        torch.testing.assert_close(noisy.mean, latent.mean, rtol=0, atol=0)
        torch.testing.assert_close(
            noisy.variance - latent.variance, noise[..., None].expand(2, 3, 9)
        )
        diagonal = (noisy.covariance - latent.covariance).diagonal(dim1=-2, dim2=-1)
        torch.testing.assert_close(diagonal, noise[..., None].expand(2, 3, 9))
        step_2 = model.predict(test_x, step=2, include_noise=True).variance
        torch.testing.assert_close(step_2, latent.variance[:, 1] + noise[:, 1:2])


@pytest.mark.parametrize("cls", CLASSES)
def test_calling_the_model_gives_the_latent_distribution_of_every_step(cls):
    x, y, test_x = _problem()
    model = cls(x, y, rbf_kernel(), noise=NOISE, backend="dense")
    with torch.no_grad():
        mvn = model(test_x)
        prediction = model.predict(test_x)
    assert isinstance(mvn, gpytorch.distributions.MultivariateNormal)
    assert mvn.batch_shape == (3,) and mvn.event_shape == (9,)
    torch.testing.assert_close(mvn.mean, prediction.mean)
    torch.testing.assert_close(mvn.variance, prediction.variance)


@pytest.mark.parametrize("cls", CLASSES)
def test_best_step_counts_from_one_and_is_the_argmin_of_the_scores(cls):
    x, y, test_x = _problem()
    val_y = torch.sin(test_x[:, 0])
    model = cls(x, y, rbf_kernel(), noise=[1.0, 0.5, 2.0, 0.05, 3.0], backend="dense")
    with torch.no_grad():
        gcv = model.gcv()
        best = model.best_step()
        assert isinstance(best, int) and best == int(gcv.argmin()) + 1
        assert model.best_step("gcv") == best
        mse = model.validation_mse(test_x, val_y)
        by_validation = model.best_step("validation", val_x=test_x, val_y=val_y)
        assert isinstance(by_validation, int) and by_validation == int(mse.argmin()) + 1
        # a batch of schedules: one step per schedule, a long tensor
        batched = cls(x, y, rbf_kernel(), noise=torch.tensor([[1.0, 0.1], [0.1, 1.0]], dtype=DT))
        steps = batched.best_step()
        assert steps.dtype == torch.long and steps.shape == (2,)
        torch.testing.assert_close(steps, batched.gcv().argmin(-1) + 1)
        with pytest.raises(ValueError, match="criterion must be one of"):
            model.best_step("aic")
        with pytest.raises(ValueError, match="needs val_x and val_y"):
            model.best_step("validation")
        with pytest.raises(ValueError, match="criterion='validation' only"):
            model.best_step("gcv", val_x=test_x, val_y=val_y)


@pytest.mark.parametrize("cls", CLASSES)
def test_step_targets_row_0_is_train_y(cls):
    x, y, _ = _problem()
    model = cls(x, y, rbf_kernel(), noise=NOISE, alpha=0.3) if cls is DataCentricGPR else None
    model = model or cls(x, y, rbf_kernel(), noise=NOISE)
    with torch.no_grad():
        targets = model.step_targets()
        assert targets.shape == (3, 30)
        torch.testing.assert_close(targets[0], y, rtol=0, atol=0)
        torch.testing.assert_close(model.step_targets(1), y, rtol=0, atol=0)
        torch.testing.assert_close(model.step_targets(3), targets[2])
        with pytest.raises(ValueError, match="step must lie in 1..3"):
            model.step_targets(4)


def test_data_centric_step_targets_are_the_previous_steps_fit_at_the_training_inputs():
    x, y, _ = _problem()
    model = DataCentricGPR(x, y, rbf_kernel(), noise=NOISE, alpha=0.3, backend="dense")
    with torch.no_grad():
        targets = model.step_targets()
        for step in (2, 3):
            fit = model.predict_mean(x, step=step - 1)
            torch.testing.assert_close(targets[step - 1], 0.3 * y + 0.7 * fit)


@_CG_ON_A_SMALL_PROBLEM
@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("backend", ["lanczos", "cg"])
def test_a_backward_pass_through_a_matrix_free_backend_names_the_backends_that_can(cls, backend):
    x, y, test_x = _problem()
    kernel = rbf_kernel()
    model = cls(x, y, kernel, noise=NOISE, backend=backend, rtol=1e-10)
    dense = cls(x, y, kernel, noise=NOISE, backend="dense")
    got, want = model.predict(test_x), dense.predict(test_x)
    assert relative_error(got.mean.detach(), want.mean.detach()) < 1e-7  # forward unchanged
    with pytest.raises(gpsd.BackendError, match=rf"backend='{backend}'.*'dense' or 'cholesky'"):
        got.mean.sum().backward()
    with pytest.raises(gpsd.BackendError):
        model.predict_mean(test_x).sum().backward()
    want.mean.sum().backward()
    assert kernel.base_kernel.raw_lengthscale.grad is not None
    with torch.no_grad():
        assert not model.predict(test_x).mean.requires_grad


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("backend", ["dense", "cholesky"])
def test_a_dense_request_that_cannot_fit_fails_before_allocating(
    cls, backend, monkeypatch, use_setting
):
    def no_kernel_matrix(*args, **kwargs):
        raise AssertionError("the kernel matrix was evaluated")

    monkeypatch.setattr(backend_module, "kernel_in_dtype", no_kernel_matrix)
    use_setting(gpsd.settings.memory_limit(cpu=10_000))
    x, y, test_x = _problem(n=30)
    model = cls(x, y, rbf_kernel(), noise=NOISE, backend=backend)
    # dense: K, its eigenvectors and workspace, 4 x 30 x 30 float64; cholesky: K, a shifted
    # matrix and its factor
    needed = 4 * 30 * 30 * 8 if backend == "dense" else 3 * 30 * 30 * 8
    message = (
        rf"needs about {needed} bytes.*10000 bytes .*are\s+free.*backend='lanczos' or backend='cg'"
    )
    with pytest.raises(gpsd.InsufficientMemoryError, match=message):
        model.predict(test_x)
    with pytest.raises(MemoryError):  # the built-in a caller may catch
        model.fit()


def test_changing_alpha_reuses_the_factorisation(count_factorisations):
    x, y, test_x = _problem()
    model = DataCentricGPR(x, y, rbf_kernel(), noise=NOISE, backend="dense")
    with torch.no_grad():
        model.predict(test_x)
        model.alpha = 0.4
        got = model.predict(test_x)
        model.set_train_data(targets=2 * y)  # new targets: the same K
        doubled = model.predict(test_x)
        assert len(count_factorisations) == 1
        want = DataCentricGPR(x, y, rbf_kernel(), noise=NOISE, alpha=0.4, backend="dense")
        torch.testing.assert_close(got.mean, want.predict(test_x).mean)
        torch.testing.assert_close(doubled.mean, 2 * got.mean)
        model.covar_module.base_kernel.lengthscale = 0.5  # a new K: refactored
        model.predict(test_x)
    assert len(count_factorisations) == 3  # the reference model, and the new K


def test_changing_method_reuses_the_factorisation(count_factorisations):
    x, y, test_x = _problem()
    model = DistributionCentricGPR(x, y, rbf_kernel(), noise=NOISE, backend="dense")
    with torch.no_grad():
        collapsed = model.predict(test_x)
        model.method = "iterated"
        iterated = model.predict(test_x)
        model.method = "collapsed"
        model.predict(test_x)
    assert len(count_factorisations) == 1
    torch.testing.assert_close(iterated.mean, collapsed.mean)
    torch.testing.assert_close(iterated.variance, collapsed.variance)


@pytest.mark.parametrize("cls", CLASSES)
def test_modules_on_another_device_than_the_data_are_named(cls):
    x, y, test_x = _problem()
    model = cls(x, y, rbf_kernel(), noise=NOISE, backend="dense")
    model.covar_module.to("meta")
    with pytest.raises(ValueError, match="covar_module is on meta but the model's training data"):
        model.predict(test_x)
    model = cls(x, y, rbf_kernel(), noise=NOISE, mean_module=gpytorch.means.ConstantMean())
    model.mean_module.to("meta")
    with pytest.raises(ValueError, match="mean_module is on meta"):
        model.fit()
    with pytest.raises(ValueError, match="test_x is on meta but the model's training data"):
        cls(x, y, rbf_kernel(), noise=NOISE).predict(test_x.to("meta"))
    with pytest.raises(ValueError, match="val_x is on meta"):
        cls(x, y, rbf_kernel(), noise=NOISE).validation_mse(test_x.to("meta"), test_x[:, 0])


# ------------ A batch of targets or of prior means on unbatched inputs

N, M = 16, 5


GAMMA = [0.1, 0.3, 0.05]


CONSTANTS = [0.5, -1.0]


def _data():
    gen = torch.Generator().manual_seed(3)
    x = 3 * torch.rand(N, 1, generator=gen, dtype=DT)
    y = torch.sin(2 * x[:, 0]) + 0.2 * torch.randn(3, N, generator=gen, dtype=DT) + 1.0
    test_x = 3 * torch.rand(M, 1, generator=gen, dtype=DT)
    return x, y, test_x


def _kernel():
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).to(DT)
    kernel.base_kernel.lengthscale = 0.6
    kernel.outputscale = 1.4
    return kernel


def _batched_mean():
    mean = gpytorch.means.ConstantMean(batch_shape=torch.Size([2])).to(DT)
    mean.constant.data = torch.tensor(CONSTANTS, dtype=DT)
    return mean


def _reference(kernel, x, y, test_x, gamma, data_centric, constant=0.0):
    """Means, variances and covariances ``(T, M[, M])`` of every step for one target vector:
    data-centric refits on the previous step's fitted values; distribution-centric conditions
    the current posterior (train and test points jointly) on the same data again."""
    with torch.no_grad():
        z = torch.cat([x, test_x])
        joint = kernel(z).to_dense()
    eye = torch.eye(N, dtype=DT)
    mean = torch.full((N + M,), constant, dtype=DT)
    cov, targets = joint.clone(), y.clone()
    means, covs = [], []
    for g in gamma:
        if data_centric:  # a fresh GP with prior (constant, k) fitted to the current targets
            mean, cov = torch.full((N + M,), constant, dtype=DT), joint.clone()
        solve = torch.linalg.solve(
            cov[:N, :N] + g * eye, torch.cat([(targets - mean[:N])[:, None], cov[:N]], 1)
        )
        mean = mean + cov[:, :N] @ solve[:, 0]
        cov = cov - cov[:, :N] @ solve[:, 1:]
        means.append(mean[N:])
        covs.append(cov[N:, N:])
        if data_centric:
            targets = mean[:N]
    covs = torch.stack(covs)
    return torch.stack(means), covs.diagonal(dim1=-2, dim2=-1), covs


@pytest.mark.parametrize("cls", [DataCentricGPR, DistributionCentricGPR])
def test_variances_and_covariances_have_the_batch_of_the_targets(cls):
    # Variances do not depend on the targets, and the closed form returned them without the
    # targets' batch: shape (3, 5) (steps, test points) beside means of shape (3, 3, 5), so that
    # path.variance[b] was the variances of step b + 1, and method="iterated" gave (3, 3, 5).
    x, y, test_x = _data()
    kernel = _kernel()
    path = cls(x, y, kernel, noise=GAMMA, backend="dense").predict(test_x, full_cov=True)
    assert path.mean.shape == (3, 3, M)
    assert path.variance.shape == (3, 3, M)
    assert path.covariance.shape == (3, 3, M, M)
    for b in range(3):
        mean, var, cov = _reference(kernel, x, y[b], test_x, GAMMA, cls is DataCentricGPR)
        torch.testing.assert_close(path.mean[b], mean, rtol=1e-9, atol=1e-10)
        torch.testing.assert_close(path.variance[b], var, rtol=1e-9, atol=1e-10)
        torch.testing.assert_close(path.covariance[b], cov, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("cls", [DataCentricGPR, DistributionCentricGPR])
def test_students_of_a_batch_of_targets_predict_their_step(cls):
    # The student was an ExactGP with unbatched train_x and batched targets, which GPyTorch
    # cannot predict with: "shape '[5]' is invalid for input of size 15". Step 2 of each member
    # of the batch must equal the literal refit.
    x, y, test_x = _data()
    kernel = _kernel()
    student = cls(x, y, kernel, noise=GAMMA, backend="dense").student(2)
    with torch.no_grad(), gpytorch.settings.fast_pred_var(False):
        post = student(test_x)
    assert post.mean.shape == (3, M)
    for b in range(3):
        mean, var, _ = _reference(kernel, x, y[b], test_x, GAMMA, cls is DataCentricGPR)
        torch.testing.assert_close(post.mean[b], mean[1], rtol=1e-9, atol=1e-10)
        torch.testing.assert_close(post.variance[b], var[1], rtol=1e-8, atol=1e-10)


def test_iterated_recursion_with_a_batch_of_targets():
    # method="iterated" failed with "shape '[5]' is invalid for input of size 15".
    x, y, test_x = _data()
    kernel = _kernel()
    path = DistributionCentricGPR(x, y, kernel, noise=GAMMA, method="iterated").predict(test_x)
    assert path.mean.shape == path.variance.shape == (3, 3, M)
    for b in range(3):
        mean, var, _ = _reference(kernel, x, y[b], test_x, GAMMA, data_centric=False)
        torch.testing.assert_close(path.mean[b], mean, rtol=1e-9, atol=1e-10)
        torch.testing.assert_close(path.variance[b], var, rtol=1e-8, atol=1e-10)


def test_iterated_recursion_and_students_with_a_batch_of_prior_means():
    # A ConstantMean with batch shape (2,) on unbatched data: method="iterated" failed in
    # GPyTorch ("mat2 must be a matrix, got 3-D tensor"), and so did the students.
    x, y, test_x = _data()
    kernel, y0 = _kernel(), y[0]
    iterated = DistributionCentricGPR(
        x, y0, kernel, noise=GAMMA, mean_module=_batched_mean(), method="iterated"
    ).predict(test_x)
    collapsed = DistributionCentricGPR(
        x, y0, kernel, noise=GAMMA, mean_module=_batched_mean(), backend="dense"
    ).predict(test_x)
    student = DataCentricGPR(
        x, y0, kernel, noise=GAMMA, mean_module=_batched_mean(), backend="dense"
    ).student(3)
    with torch.no_grad(), gpytorch.settings.fast_pred_var(False):
        post = student(test_x)
    for b, constant in enumerate(CONSTANTS):
        mean, var, _ = _reference(kernel, x, y0, test_x, GAMMA, False, constant)
        for path in (iterated, collapsed):
            torch.testing.assert_close(path.mean[b], mean, rtol=1e-9, atol=1e-10)
            torch.testing.assert_close(path.variance[b], var, rtol=1e-8, atol=1e-10)
        mean, var, _ = _reference(kernel, x, y0, test_x, GAMMA, True, constant)
        torch.testing.assert_close(post.mean[b], mean[2], rtol=1e-9, atol=1e-10)
        torch.testing.assert_close(post.variance[b], var[2], rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("cls", [DataCentricGPR, DistributionCentricGPR])
def test_a_batch_of_schedules_that_does_not_fit_the_targets_is_named(cls):
    # noise of shape (2, 3) next to targets of shape (3, 16) was accepted and failed at the
    # first prediction: "The size of tensor a (2) must match the size of tensor b (3)".
    x, y, _ = _data()
    gamma = torch.tensor([GAMMA, GAMMA], dtype=DT)
    with pytest.raises(ValueError, match=r"noise of shape \(2, 3\).*train_y of shape \(3, 16\)"):
        cls(x, y, _kernel(), noise=gamma)


# ------------ An empty training set and malformed settings

DTYPE = torch.float64


def _scaled_rbf():
    return gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).to(DTYPE)


EMPTY_X = torch.empty(0, 1, dtype=DTYPE)


EMPTY_Y = torch.empty(0, dtype=DTYPE)


@pytest.mark.parametrize("cls", [DataCentricGPR, DistributionCentricGPR])
@pytest.mark.parametrize("backend", ["auto", "dense", "cholesky"])
def test_regression_refuses_an_empty_training_set(cls, backend):
    with pytest.raises(ValueError, match=r"train_x must hold at least one input .*\(0, 1\)"):
        cls(EMPTY_X, EMPTY_Y, _scaled_rbf(), noise=[0.1], backend=backend)


X = torch.linspace(0, 1, 12, dtype=DTYPE).unsqueeze(-1)


Y = torch.sin(6 * X).squeeze(-1)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(linalg_dtype="float64"), TypeError, "linalg_dtype must be a floating-point"),
        (dict(linalg_dtype=torch.int64), TypeError, "linalg_dtype must be a floating-point"),
        (dict(rtol="1e-6"), ValueError, "rtol must be a positive float"),
        (dict(rtol=0.0), ValueError, "rtol must be a positive float"),
        (dict(rank=0), ValueError, "rank must be a positive integer or None"),
    ],
)
@pytest.mark.parametrize("cls", [DataCentricGPR, DistributionCentricGPR])
def test_bad_settings_are_refused_at_construction(cls, kwargs, error, message):
    with pytest.raises(error, match=message):
        cls(X, Y, _scaled_rbf(), noise=[0.1, 0.2], **kwargs)


def test_bad_settings_are_refused_when_set_and_good_ones_take_effect():
    model = DataCentricGPR(
        X, Y, _scaled_rbf(), noise=[0.1, 0.2], backend="dense", linalg_dtype=None
    )
    with pytest.raises(TypeError, match="linalg_dtype"):
        model.linalg_dtype = "float32"
    with pytest.raises(ValueError, match="rtol"):
        model.rtol = -1.0
    with pytest.raises(ValueError, match="rank"):
        model.rank = 2.5
    assert model.linalg_dtype is None and model.rank is None
    model.rtol = 1e-4
    assert model.rtol == 1e-4
    # the factorisation dtype follows the setting: float32 data factored in float64 agree with
    # the float64 model, in float32 they carry float32 rounding of K's eigendecomposition
    ref = DataCentricGPR(X, Y, _scaled_rbf(), noise=[0.1, 0.2], backend="dense").predict_mean(X)
    single = DataCentricGPR(
        X.float(),
        Y.float(),
        _scaled_rbf().float(),
        noise=[0.1, 0.2],
        backend="dense",
        linalg_dtype=None,
    )
    with torch.no_grad():
        single.linalg_dtype = torch.float64
        torch.testing.assert_close(single.predict_mean(X.float()).double(), ref, rtol=0, atol=1e-6)


# ------------ float32 data with gradients enabled

X32 = torch.linspace(0, 10, 40).unsqueeze(-1)  # float32


Y32 = torch.sin(X32.squeeze(-1)) + 0.1 * torch.randn(40, generator=torch.Generator().manual_seed(0))


TEST_X = torch.linspace(0.3, 9.7, 8).unsqueeze(-1)


NOISE32 = [1e-6, 1e-6, 1e-6]


def _kernel32(dtype=torch.float32):
    return gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).to(dtype)


def _reference_means():
    """The three data-centric steps by dense float64 solves on the float32-rounded data."""
    with torch.no_grad():
        return dense_data_centric_means(
            _kernel32(torch.float64), X32.double(), Y32.double(), NOISE32, TEST_X.double()
        )


@pytest.mark.parametrize("backend", ["dense", "cholesky", "auto"])
def test_float32_means_with_gradients_enabled_are_float64_accurate(backend):
    model = DataCentricGPR(X32, Y32, _kernel32(), noise=NOISE32, backend=backend)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NumericalWarning)
        mean = model.predict(TEST_X).mean
    assert mean.requires_grad and mean.dtype == torch.float32
    expected = _reference_means()
    torch.testing.assert_close(mean.detach().double(), expected, rtol=0, atol=1e-6)


def test_gradients_of_float32_hyperparameters_equal_the_float64_models():
    models = {
        dtype: DataCentricGPR(X32.to(dtype), Y32.to(dtype), _kernel32(dtype), noise=[0.01, 0.02])
        for dtype in (torch.float32, torch.float64)
    }
    grads = {}
    for dtype, model in models.items():
        path = model.predict(TEST_X.to(dtype))
        loss = path.mean.square().sum() + path.variance.sum() + model.gcv().sum()
        params = [
            model.covar_module.raw_outputscale,
            model.covar_module.base_kernel.raw_lengthscale,
        ]
        grads[dtype] = torch.stack([g.sum() for g in torch.autograd.grad(loss, params)])
    assert grads[torch.float32].dtype == torch.float32
    torch.testing.assert_close(
        grads[torch.float32].double(), grads[torch.float64], rtol=2e-5, atol=0
    )


@pytest.mark.filterwarnings("ignore:A not p.d., added jitter")  # GPyTorch's float32 Cholesky
@pytest.mark.parametrize("cls", [DataCentricGPR, DistributionCentricGPR])
def test_float32_factorisation_warns_where_its_rounding_matters(cls):
    model = cls(X32, Y32, _kernel32(), noise=[1e-6], backend="cholesky", linalg_dtype=None)
    with torch.no_grad(), pytest.warns(NumericalWarning, match="factored in torch.float32"):
        model.predict_mean(TEST_X)
    fine = cls(X32, Y32, _kernel32(), noise=[0.1], backend="cholesky", linalg_dtype=None)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", NumericalWarning)
        fine.predict_mean(TEST_X)


def test_a_submodule_used_twice_keeps_its_parameter_and_its_gradient():
    # a submodule shared by two kernels is cast once (torch.func.functional_call would swap it
    # twice and leave a float64 non-leaf tensor in place of the parameter, never updated)
    rbf = gpytorch.kernels.RBFKernel()
    kernel = gpytorch.kernels.AdditiveKernel(rbf, gpytorch.kernels.ScaleKernel(rbf))
    model = DataCentricGPR(X32, Y32, kernel, noise=[0.01, 0.02], backend="cholesky")
    loss = model.predict(TEST_X).mean.square().sum()
    loss.backward()
    param = rbf.raw_lengthscale
    assert isinstance(param, torch.nn.Parameter) and param.is_leaf
    assert param.dtype == torch.float32 and param.grad.dtype == torch.float32
    # the same model in float64 (one shared copy of the submodule there too)
    rbf64 = gpytorch.kernels.RBFKernel().double()
    scale64 = gpytorch.kernels.ScaleKernel(rbf64)
    kernel64 = gpytorch.kernels.AdditiveKernel(rbf64, scale64).double()
    with torch.no_grad():
        rbf64.raw_lengthscale.copy_(param.double())
    model64 = DataCentricGPR(
        X32.double(), Y32.double(), kernel64, noise=[0.01, 0.02], backend="cholesky"
    )
    model64.predict(TEST_X.double()).mean.square().sum().backward()
    torch.testing.assert_close(param.grad.double(), rbf64.raw_lengthscale.grad, rtol=1e-5, atol=0)


def test_buffers_a_kernel_creates_in_the_call_keep_its_dtype():
    kernel = gpytorch.kernels.RFFKernel(num_samples=20)
    model = DataCentricGPR(X32, Y32, kernel, noise=[0.1], backend="dense")
    model.predict(TEST_X)  # gradients enabled: the cast path draws RFFKernel's weights
    assert kernel.randn_weights.dtype == torch.float32
    assert kernel(TEST_X).to_dense().dtype == torch.float32  # a plain float32 call still works


# ------------ GPU and KeOps paths (skipped where CUDA or pykeops are absent)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def data(n=300, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = 10 * torch.rand(n, 1, generator=gen, dtype=DTYPE)
    y = torch.sin(x.squeeze(-1)) + 0.2 * torch.randn(n, generator=gen, dtype=DTYPE)
    return x, y, torch.linspace(0, 10, 50, dtype=DTYPE).unsqueeze(-1)


@cuda
@pytest.mark.parametrize("backend", ["dense", "cholesky", "lanczos", "cg"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cuda_matches_cpu(backend, dtype):
    x, y, test_x = data()
    gammas = torch.linspace(0.1, 1.0, 10, dtype=DTYPE)
    ref = DataCentricGPR(x, y, rbf_kernel(), noise=gammas, backend="dense")
    kernel = rbf_kernel(dtype=dtype).cuda()
    options = {"rtol": 1e-12} if backend == "cg" else {}
    model = DataCentricGPR(
        x.to("cuda", dtype),
        y.to("cuda", dtype),
        kernel,
        noise=gammas.to(dtype),
        backend=backend,
        rank=64,
        **options,
    )
    with torch.no_grad():
        got = model.predict(test_x.to("cuda", dtype))
        expected = ref.predict(test_x)
    assert got.mean.device.type == "cuda"
    tol = 1e-8 if dtype == torch.float64 else 1e-4
    assert relative_error(got.mean.cpu().double(), expected.mean) < tol
    assert relative_error(got.variance.cpu().double(), expected.variance) < tol
    dist = DistributionCentricGPR(
        x.to("cuda", dtype), y.to("cuda", dtype), kernel, noise=gammas.to(dtype)
    )
    with torch.no_grad():
        assert dist.predict(test_x.to("cuda", dtype)).mean.device.type == "cuda"


def test_keops_lanczos_and_cg_agree_with_dense_at_n_2000():
    pytest.importorskip("pykeops", reason="the matrix-free KeOps path needs pykeops (gpsd[keops])")
    x, y, test_x = data(n=2000)
    gammas = torch.linspace(0.1, 1.0, 5, dtype=DTYPE)
    keops_kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.keops.RBFKernel()).to(DTYPE)
    keops_kernel.base_kernel.lengthscale = 1.5
    keops_kernel.outputscale = 4.0
    dense = DataCentricGPR(x, y, rbf_kernel(), noise=gammas, backend="dense")
    lanczos = DataCentricGPR(x, y, keops_kernel, noise=gammas, backend="lanczos", rank=128)
    with torch.no_grad():
        ref, got = dense.predict(test_x), lanczos.predict(test_x)
        tol = max(10 * lanczos.error_estimate, 1e-9)
    assert relative_error(got.mean, ref.mean) < tol
    assert relative_error(got.variance, ref.variance) < tol
    cg = DataCentricGPR(x, y, keops_kernel, noise=gammas, backend="cg", rank=16, rtol=1e-10)
    with torch.no_grad():
        got = cg.predict(test_x)
        # the one-run Krylov chain on KeOps products, against the step-by-step chain
        engine, centred = cg._current_fit().engine, cg._current_fit().centred
        weights = SpectralFilter.data_centric_weights(gammas)
        one_run = engine.krylov_apply(weights, centred)
        step_by_step = ShiftedSolveEngine.apply(engine, weights, centred)
    assert relative_error(got.mean, ref.mean) < 1e-7
    assert relative_error(got.variance, ref.variance) < 1e-7
    assert relative_error(one_run, step_by_step) < 1e-8
    # float32 data: the KeOps products still run in the float64 of the factorisation, so CG
    # reaches a residual that float32 products (rounding ~1e-7 per product) could not.
    cg = DataCentricGPR(
        x.float(),
        y.float(),
        keops_kernel.float(),
        noise=gammas.float(),
        backend="cg",
        rank=16,
        rtol=1e-10,
    )
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", NumericalWarning)
        cg.predict(test_x.float())
        engine = cg._current_fit().engine
    assert engine.kernel.dtype == torch.float64
    assert 0 < engine.max_relative_residual < 1e-9


# ------------ set_train_data

SET_TRAIN_DATA_NOISE = [0.1, 0.2, 0.3]


def _set_train_data_kernel():
    k = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).to(DT)
    k.base_kernel.lengthscale = 0.3
    return k


def _set_train_data_problem(n, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(n, generator=gen, dtype=DT)
    return x, torch.sin(6 * x) + 0.1 * torch.randn(n, generator=gen, dtype=DT)


@_CG_ON_A_SMALL_PROBLEM
@pytest.mark.parametrize("cls", [DataCentricGPR, DistributionCentricGPR])
@pytest.mark.parametrize("backend", ["dense", "cholesky", "lanczos", "cg"])
def test_new_data_with_another_n_give_the_fresh_model(cls, backend):
    x, y = _set_train_data_problem(20, 0)
    x2, y2 = _set_train_data_problem(27, 1)
    test_x = torch.linspace(0, 1, 9, dtype=DT)
    kernel = _set_train_data_kernel()
    model = cls(x, y, kernel, noise=SET_TRAIN_DATA_NOISE, backend=backend)
    with torch.no_grad():
        model.predict(test_x)
        model.set_train_data(x2, y2, strict=False)
        got = model.predict(test_x)
        fresh = cls(x2, y2, kernel, noise=SET_TRAIN_DATA_NOISE, backend=backend).predict(test_x)
    assert model.train_x.shape == (27, 1)
    tol = 1e-10 if backend in ("dense", "cholesky") else 1e-6
    torch.testing.assert_close(got.mean, fresh.mean, rtol=tol, atol=tol)
    torch.testing.assert_close(got.variance, fresh.variance, rtol=tol, atol=tol)
    # step 1 of both is the GP with noise gamma_1 on the new data (dense formula)
    k = kernel(x2.unsqueeze(-1)).to_dense().detach()
    k_star = kernel(test_x.unsqueeze(-1), x2.unsqueeze(-1)).to_dense().detach()
    mean = k_star @ torch.linalg.solve(k + SET_TRAIN_DATA_NOISE[0] * torch.eye(27, dtype=DT), y2)
    torch.testing.assert_close(got.mean[0], mean, rtol=tol, atol=tol)


def test_targets_alone_and_checks():
    x, y = _set_train_data_problem(20, 0)
    model = DataCentricGPR(
        x, y, _set_train_data_kernel(), noise=SET_TRAIN_DATA_NOISE, backend="dense"
    )
    with torch.no_grad():
        model.set_train_data(targets=2 * y)
        twice = model.predict_mean(x)
        model.set_train_data(targets=y)
        once = model.predict_mean(x)
    torch.testing.assert_close(twice, 2 * once, rtol=1e-10, atol=1e-12)  # linear in the targets
    with pytest.raises(ValueError, match="targets must have the current shape, dtype"):
        model.set_train_data(targets=y.float())
    model.set_train_data(targets=y.float(), strict=False)  # converted to the model's dtype
    assert model.train_y.dtype == DT
    assert torch.equal(model.train_y, y.float().to(DT))
    with pytest.raises(ValueError, match="train_y must have 20 entries"):
        model.set_train_data(targets=y[:-1], strict=False)
    with pytest.raises(ValueError, match="train_y must be finite"):
        model.set_train_data(targets=y * torch.nan)
    with pytest.raises(ValueError, match="train_x must hold at least one input"):
        model.set_train_data(x[:0], y[:0], strict=False)
    batched = DataCentricGPR(
        x,
        y,
        _set_train_data_kernel(),
        noise=torch.tensor([SET_TRAIN_DATA_NOISE, SET_TRAIN_DATA_NOISE], dtype=DT),
    )
    with pytest.raises(ValueError, match="must broadcast"):
        batched.set_train_data(targets=y.expand(3, 20), strict=False)


@pytest.mark.parametrize("cls", [DataCentricGPR, DistributionCentricGPR])
def test_a_state_dict_of_another_n_loads(cls):
    x, y = _set_train_data_problem(20, 0)
    x2, y2 = _set_train_data_problem(27, 1)
    test_x = torch.linspace(0, 1, 9, dtype=DT)
    kernel = _set_train_data_kernel()
    model = cls(x, y, kernel, noise=SET_TRAIN_DATA_NOISE, backend="dense")
    with torch.no_grad():
        model.predict(test_x)
        model.load_state_dict(cls(x2, y2, kernel, noise=SET_TRAIN_DATA_NOISE).state_dict())
        got = model.predict(test_x)
        fresh = cls(x2, y2, kernel, noise=SET_TRAIN_DATA_NOISE, backend="dense").predict(test_x)
    torch.testing.assert_close(got.mean, fresh.mean, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(got.variance, fresh.variance, rtol=1e-10, atol=1e-10)


# ------------ The cache, the students and batches, against dense formulas


def _student_data(n=30, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = 10 * torch.rand(n, 1, generator=gen, dtype=DT)
    return x, torch.sin(x[:, 0]), torch.linspace(0, 10, 7, dtype=DT).unsqueeze(-1)


@pytest.mark.parametrize("backend", ["dense", "cholesky"])
def test_gradients_accumulate_over_two_backward_passes(backend):
    x, y, test_x = _student_data()
    gammas = [0.1, 0.2]
    kernel = rbf_kernel()
    model = DataCentricGPR(x, y, kernel, noise=gammas, backend=backend)
    model.predict(test_x[:3]).mean.sum().backward()
    model.predict(test_x[3:]).mean.sum().backward()  # a second backward: the cache refits
    got = [p.grad.clone() for p in kernel.parameters()]
    reference = rbf_kernel()
    dense_data_centric_means(reference, x, y, gammas, test_x).sum().backward()
    for g, r in zip(got, reference.parameters(), strict=True):
        torch.testing.assert_close(g, r.grad, rtol=1e-6, atol=1e-8)


def test_distribution_centric_gradients_after_a_backward_pass():
    x, y, test_x = _student_data()
    kernel = rbf_kernel()
    model = DistributionCentricGPR(x, y, kernel, noise=[0.2, 0.2], backend="dense")
    model.predict(test_x).variance.sum().backward()
    first = [p.grad.clone() for p in kernel.parameters()]
    kernel.zero_grad()
    model.predict(test_x).variance.sum().backward()
    for a, p in zip(first, kernel.parameters(), strict=True):
        torch.testing.assert_close(p.grad, a, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("noise", [1e-5, 3e-6])
def test_students_of_noise_below_gpytorchs_default_bound(noise):
    x, y, test_x = _student_data()
    kernel = rbf_kernel()
    student = DataCentricGPR(x, y, kernel, noise=[noise]).student(1)
    with torch.no_grad(), gpytorch.settings.fast_pred_var(False):
        got = student(test_x).mean
        k = kernel(x).to_dense() + noise * torch.eye(30, dtype=DT)
        ref = kernel(test_x, x).to_dense() @ torch.linalg.solve(k, y)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    assert float(student.likelihood.noise.detach()) == pytest.approx(noise, rel=1e-6)


def test_distribution_centric_student_and_iterated_chain_with_small_effective_noise():
    x, y, test_x = _student_data()
    model = DistributionCentricGPR(x, y, rbf_kernel(), noise=[1e-3] * 20)
    student = model.student(20)  # effective noise 5e-5
    assert float(student.likelihood.noise.detach()) == pytest.approx(5e-5, rel=1e-6)
    with torch.no_grad(), gpytorch.settings.fast_pred_var(False):
        got = student(test_x)
    path = model.predict(test_x)
    torch.testing.assert_close(got.mean, path.mean[-1], rtol=1e-6, atol=1e-7)
    iterated = DistributionCentricGPR(x, y, rbf_kernel(), noise=[5e-5], method="iterated")
    collapsed = DistributionCentricGPR(x, y, rbf_kernel(), noise=[5e-5])
    torch.testing.assert_close(
        iterated.predict(test_x).mean, collapsed.predict(test_x).mean, rtol=1e-6, atol=1e-7
    )


@pytest.mark.parametrize("cls", [DataCentricGPR, DistributionCentricGPR])
def test_students_of_a_batch_of_schedules(cls):
    x, y, test_x = _student_data()
    gamma = torch.tensor([[0.1, 0.2, 0.3], [0.5, 0.5, 0.5]], dtype=DT)
    model = cls(x, y, rbf_kernel(), noise=gamma)
    with pytest.raises(ValueError, match="schedule must index one schedule"):
        model.student(2, schedule=(0, 1))
    with pytest.raises(TypeError, match="schedule must be an int or a tuple"):
        model.student(2, schedule=1.0)
    path = model.predict(test_x)
    for schedule in (1, (0,)):
        student = model.student(3, schedule=schedule)
        with torch.no_grad(), gpytorch.settings.fast_pred_var(False):
            post = student(test_x)
        index = schedule if isinstance(schedule, int) else schedule[0]
        torch.testing.assert_close(post.mean, path.mean[index, 2], rtol=1e-7, atol=1e-9)
        torch.testing.assert_close(post.variance, path.variance[index, 2], rtol=1e-6, atol=1e-9)
    batched = cls(x.expand(2, -1, -1), y.expand(2, -1), rbf_kernel(), noise=gamma)
    with pytest.raises(ValueError, match="needs unbatched training data"):
        batched.student(1, schedule=0)
    kernels = gpytorch.kernels.RBFKernel(batch_shape=torch.Size([2])).to(DT)
    with pytest.raises(ValueError, match="needs unbatched training data, kernel"):
        cls(x, y, kernels, noise=gamma).student(1, schedule=0)


def _student_posterior(student, test_x):
    with torch.no_grad(), gpytorch.settings.fast_pred_var(False):
        post = student(test_x)
    return post.mean, post.variance


@pytest.mark.parametrize("cls", [DataCentricGPR, DistributionCentricGPR])
def test_student_of_the_whole_batch_equals_each_member(cls):
    """A batched model has a student of the whole batch, each member with its own kernel, targets
    and noise."""
    x, y, test_x = _student_data()
    gamma = torch.tensor([[0.1, 0.2, 0.3], [0.5, 0.05, 0.4]], dtype=DT)
    kernels = gpytorch.kernels.RBFKernel(batch_shape=torch.Size([2])).to(DT)
    kernels.lengthscale = torch.tensor([[[0.7]], [[1.5]]], dtype=DT)
    targets = torch.stack([y, 2 * y.cos()])
    cases = {
        "schedules": (rbf_kernel(), y),
        "schedules with targets": (rbf_kernel(), targets),
        "schedules with kernels": (kernels, y),
    }
    for name, (kernel, train_y) in cases.items():
        model = cls(x, train_y, kernel, noise=gamma)
        path = model.predict(test_x)
        for t in (1, 3):
            student = model.student(t)
            mean, var = _student_posterior(student, test_x)
            torch.testing.assert_close(mean, path.mean[:, t - 1], rtol=1e-7, atol=1e-9, msg=name)
            torch.testing.assert_close(var, path.variance[:, t - 1], rtol=1e-6, atol=1e-9)
            # each member against an exact GP of its own, from dense solves
            for i in range(2):
                k_i = kernel if kernel is not kernels else _member(kernels, i)
                if cls is DataCentricGPR:
                    noise = gamma[i, t - 1]
                else:  # Theorem 3.3: one GP with noise 1 / sum_s 1 / gamma_s
                    noise = 1.0 / (1.0 / gamma[i, :t]).sum()
                y_i = train_y if train_y.dim() == 1 else train_y[i]
                if cls is DataCentricGPR and t > 1:
                    y_i = model.step_targets(t)[i].detach()
                k = k_i(x).to_dense() + noise * torch.eye(x.shape[0], dtype=DT)
                ks = k_i(test_x, x).to_dense()
                want = ks @ torch.linalg.solve(k, y_i)
                torch.testing.assert_close(mean[i], want.detach(), rtol=1e-7, atol=1e-9)


def _member(kernels, i):
    member = gpytorch.kernels.RBFKernel().to(DT)
    member.lengthscale = kernels.lengthscale[i]
    return member


@pytest.mark.parametrize("cls", [DataCentricGPR, DistributionCentricGPR])
def test_student_of_a_batched_teacher(cls):
    """``from_teacher`` of a batched ExactGP: noise of shape (2, T) paired with (2, N) targets;
    every step has a student."""
    x, y, test_x = _student_data()
    batch = torch.Size([2])
    teacher = PlainGP(
        x.expand(2, -1, -1),
        torch.stack([y, -y]),
        gpytorch.likelihoods.GaussianLikelihood(batch_shape=batch),
        gpytorch.means.ZeroMean(),
        gpytorch.kernels.RBFKernel(batch_shape=batch),
    ).to(DT)
    teacher.likelihood.noise = torch.tensor([[0.05], [0.2]], dtype=DT)
    teacher.eval()
    model = cls.from_teacher(teacher, num_steps=3)
    path = model.predict(test_x)
    with torch.no_grad(), gpytorch.settings.fast_pred_var(False):
        taught = teacher(test_x.expand(2, -1, -1))
    torch.testing.assert_close(path.mean[:, 0], taught.mean, rtol=1e-7, atol=1e-9)
    for t in (1, 2, 3):
        mean, var = _student_posterior(model.student(t), test_x)
        torch.testing.assert_close(mean, path.mean[:, t - 1], rtol=1e-7, atol=1e-9)
        torch.testing.assert_close(var, path.variance[:, t - 1], rtol=1e-6, atol=1e-9)


def test_auto_backend_on_three_points():
    x, y, test_x = _student_data(n=3)
    with torch.no_grad():
        got = DataCentricGPR(x, y, rbf_kernel(), noise=[0.1] * 5).predict(test_x)
        ref = DataCentricGPR(x, y, rbf_kernel(), noise=[0.1] * 5, backend="dense").predict(test_x)
    torch.testing.assert_close(got.mean, ref.mean, rtol=1e-10, atol=1e-12)


@_CG_ON_A_SMALL_PROBLEM
def test_changing_alpha_or_backend_after_a_prediction_takes_effect():
    x, y, test_x = _student_data()
    model = DataCentricGPR(x, y, rbf_kernel(), noise=[0.1, 0.2])
    with torch.no_grad():
        model.predict(test_x)
        model.alpha = 0.5
        got = model.predict(test_x).mean
        ref = DataCentricGPR(x, y, rbf_kernel(), noise=[0.1, 0.2], alpha=0.5).predict(test_x).mean
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)
        model.backend = "cg"
        cg = model.predict(test_x).mean
    assert type(model._current_fit().engine).__name__ == "ShiftedCG"
    torch.testing.assert_close(cg, ref, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="alpha must lie in"):
        model.alpha = 1.0


def _batched_teacher(x, y, noises):
    batch = torch.Size([len(noises)])
    likelihood = gpytorch.likelihoods.GaussianLikelihood(batch_shape=batch).to(DT)
    likelihood.noise = torch.tensor(noises, dtype=DT).unsqueeze(-1)
    kernel = rbf_kernel(batch_shape=batch)
    teacher = PlainGP(
        x.expand(len(noises), -1, -1),
        y.expand(len(noises), -1),
        likelihood,
        gpytorch.means.ZeroMean(batch_shape=batch),
        kernel,
    )
    return teacher.eval()


def test_from_a_batched_teacher_keeps_every_members_noise():
    x, y, test_x = _student_data()
    teacher = _batched_teacher(x, y, [0.05, 0.8])
    model = DataCentricGPR.from_teacher(teacher, num_steps=2)
    assert model.noise.shape == (2, 2)
    path = model.predict(test_x)
    with torch.no_grad(), gpytorch.settings.fast_pred_var(False):
        post = teacher(test_x.expand(2, -1, -1))
    torch.testing.assert_close(path.mean[:, 0], post.mean, rtol=1e-7, atol=1e-9)
    torch.testing.assert_close(path.variance[:, 0], post.variance, rtol=1e-6, atol=1e-9)


def test_posterior_kernel_of_a_batched_teacher_on_unbatched_inputs():
    x, y, test_x = _student_data()
    teacher = _batched_teacher(x, y, [0.05, 0.8])
    with torch.no_grad(), gpytorch.settings.fast_pred_var(False):
        got = PosteriorKernel(teacher)(test_x).to_dense()
        ref = teacher(test_x.expand(2, -1, -1)).covariance_matrix
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("gamma_shape", [(2, 2), (2, 1, 2)])
def test_iterated_and_collapsed_agree_in_shape_with_batched_data_and_schedules(gamma_shape):
    x, y, test_x = _student_data()
    scales = torch.tensor([1.0, 0.5], dtype=DT).reshape(2, 1, 1)
    xb, yb = x.expand(2, -1, -1) * scales, y.expand(2, -1)
    gamma = torch.tensor([[0.1, 0.2], [0.5, 0.5]], dtype=DT).reshape(gamma_shape)
    collapsed = DistributionCentricGPR(xb, yb, rbf_kernel(), noise=gamma).predict(test_x)
    iterated = DistributionCentricGPR(xb, yb, rbf_kernel(), noise=gamma, method="iterated")
    got = iterated.predict(test_x)
    assert got.mean.shape == collapsed.mean.shape
    torch.testing.assert_close(got.mean, collapsed.mean, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(got.variance, collapsed.variance, rtol=1e-6, atol=1e-8)


def test_batch_mismatches_and_bad_validation_targets_are_named():
    x, y, test_x = _student_data()
    gamma = torch.full((3, 2), 0.1, dtype=DT)
    with pytest.raises(ValueError, match="noise of shape \\(3, 2\\).*train_x of shape"):
        DataCentricGPR(x.expand(2, -1, -1), y.expand(2, -1), rbf_kernel(), noise=gamma)
    with pytest.raises(ValueError, match="train_x .* and train_y .* must broadcast"):
        DataCentricGPR(x.expand(2, -1, -1), y.expand(3, -1), rbf_kernel(), noise=[0.1])
    model = DataCentricGPR(x, y, rbf_kernel(), noise=[0.1])
    with pytest.raises(ValueError, match="val_y"):
        model.validation_mse(test_x, torch.full((7,), float("nan"), dtype=DT))


# ------------ Prediction under torch.inference_mode()


def _inference_data():
    gen = torch.Generator().manual_seed(3)
    x = 10 * torch.rand(40, 1, generator=gen, dtype=DT)
    return x, torch.sin(x[:, 0]), torch.linspace(0, 10, 9, dtype=DT).unsqueeze(-1)


@_CG_ON_A_SMALL_PROBLEM
@pytest.mark.parametrize("backend", ["dense", "cholesky", "lanczos", "cg", "auto"])
@pytest.mark.parametrize("cls", [DataCentricGPR, DistributionCentricGPR])
def test_predictions_under_inference_mode_equal_those_under_no_grad(cls, backend):
    x, y, test_x = _inference_data()
    gamma = [0.1, 0.2, 0.1]
    with torch.no_grad():
        expected = cls(x, y, rbf_kernel(), noise=gamma, backend=backend).predict(test_x)
    model = cls(x, y, rbf_kernel(), noise=gamma, backend=backend)
    with torch.inference_mode():
        first = model.predict(test_x)
        again = model.predict(test_x)  # from the cached factorisation
    for got in (first, again):
        torch.testing.assert_close(got.mean, expected.mean, rtol=1e-9, atol=1e-11)
        torch.testing.assert_close(got.variance, expected.variance, rtol=1e-9, atol=1e-11)


@_CG_ON_A_SMALL_PROBLEM
def test_a_model_built_and_used_under_inference_mode():
    x, y, test_x = _inference_data()
    with torch.no_grad():
        expected = DataCentricGPR(x, y, rbf_kernel(), noise=[0.1, 0.2], backend="cg").predict(
            test_x
        )
    with torch.inference_mode():
        got = DataCentricGPR(x.clone(), y.clone(), rbf_kernel(), noise=[0.1, 0.2], backend="cg")
        got = got.predict(test_x)
    torch.testing.assert_close(got.mean, expected.mean, rtol=1e-7, atol=1e-9)


# ------------ Changed hyperparameters and settings; training data without a graph


def _regression_data(n=30, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = 10 * torch.rand(n, 1, generator=gen, dtype=DT)
    return x, torch.sin(x[:, 0]), torch.linspace(0, 10, 7, dtype=DT).unsqueeze(-1)


@pytest.mark.parametrize("cls", [DataCentricGPR, DistributionCentricGPR])
def test_inputs_and_targets_with_a_graph_are_stored_detached(cls):
    x, y, test_x = _regression_data()
    scale = torch.tensor(1.0, dtype=DT, requires_grad=True)  # a feature extractor, say
    model = cls(x * scale, y * scale, rbf_kernel(), noise=[0.1, 0.2], backend="dense")
    reference = cls(x, y, rbf_kernel(), noise=[0.1, 0.2], backend="dense")
    assert not model.train_x.requires_grad and not model.train_y.requires_grad
    for _ in range(2):  # the second backward pass ran into the first one's freed graph
        model.predict(test_x).mean.sum().backward()
        reference.predict(test_x).mean.sum().backward()
    for p, q in zip(
        model.covar_module.parameters(), reference.covar_module.parameters(), strict=True
    ):
        torch.testing.assert_close(p.grad, q.grad)
    assert scale.grad is None
    copied = copy.deepcopy(model)  # a non-leaf buffer cannot be deep-copied
    torch.testing.assert_close(copied.predict(test_x).mean, model.predict(test_x).mean)


def test_from_teacher_refuses_num_steps_that_contradict_the_noise_schedule():
    x, y, _ = _regression_data()
    likelihood = gpytorch.likelihoods.GaussianLikelihood().to(DT)
    teacher = PlainGP(x, y, likelihood, gpytorch.means.ZeroMean(), rbf_kernel()).eval()
    with pytest.raises(ValueError, match="num_steps=3 does not match the 2 steps of the noise"):
        DataCentricGPR.from_teacher(teacher, noise=[0.1, 0.2], num_steps=3)
    model = DataCentricGPR.from_teacher(teacher, noise=[0.1, 0.2], num_steps=2)
    assert model.num_steps == 2
    with pytest.raises(ValueError, match="num_steps must be a positive integer"):
        DataCentricGPR.from_teacher(teacher, num_steps=0)


@pytest.mark.parametrize("cls", CLASSES)
def test_modules_of_another_dtype_than_the_data_are_named(cls):
    x, y, test_x = _problem()
    model = cls(x, y, rbf_kernel(dtype=torch.float32), noise=NOISE, backend="lanczos")
    with pytest.raises(ValueError, match="covar_module has dtype torch.float32 but the model's"):
        model.predict(test_x)
    model = cls(x, y, rbf_kernel(), noise=NOISE, mean_module=gpytorch.means.ConstantMean())
    with pytest.raises(ValueError, match=r"mean_module has dtype torch.float32.*\.to\("):
        model.fit()
    model.to(torch.float32)  # the whole model in one dtype: fine
    with torch.no_grad():
        assert model.predict(test_x).mean.dtype == torch.float32


# ------------------------------------------------------------------ hyperparameters
def _training_problem(n=60, dtype=DT):
    gen = torch.Generator().manual_seed(2)
    x = 3 * torch.rand(n, 2, generator=gen, dtype=dtype)
    y = torch.sin(2 * x).sum(-1) + 0.1 * torch.randn(n, generator=gen, dtype=dtype)
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).to(dtype)
    return x, y, kernel


def _exact_cg():
    """Forced CG with an exact preconditioner: the matrix-free likelihood and its gradient are
    the dense ones to CG's tolerance (the probe terms cancel)."""
    import contextlib

    stack = contextlib.ExitStack()
    for setting in (
        gpytorch.settings.max_cholesky_size(0),
        gpytorch.settings.cg_tolerance(1e-12),
        gpytorch.settings.max_cg_iterations(600),
        gpytorch.settings.max_preconditioner_size(600),
        gpytorch.settings.preconditioner_tolerance(1e-10),
        gpytorch.settings.min_preconditioning_size(1),
    ):
        stack.enter_context(setting)
    return stack


@pytest.mark.parametrize("cls", CLASSES)
def test_log_marginal_likelihood_is_the_teachers_gaussian_density(cls):
    x, y, kernel = _training_problem()
    model = cls(x, y, kernel, noise=[0.2, 0.1], backend="dense")
    K = kernel(x).to_dense().detach()
    cov = K + 0.2 * torch.eye(x.shape[0], dtype=DT)
    expected = torch.distributions.MultivariateNormal(torch.zeros_like(y), cov).log_prob(y)
    torch.testing.assert_close(model.log_marginal_likelihood(), expected, rtol=1e-11, atol=1e-10)


@pytest.mark.parametrize("backend", ["lanczos", "cg"])
def test_matrix_free_log_marginal_likelihood_and_gradient_equal_the_dense_ones(backend):
    x, y, kernel = _training_problem()
    dense = DataCentricGPR(x, y, kernel, noise=0.1, num_steps=2, backend="dense")
    expected = dense.log_marginal_likelihood()
    expected_grads = torch.autograd.grad(expected, list(kernel.parameters()))
    model = DataCentricGPR(x, y, kernel, noise=0.1, num_steps=2, backend=backend)
    with _exact_cg():
        value = model.log_marginal_likelihood()
        grads = torch.autograd.grad(value, list(kernel.parameters()))
    torch.testing.assert_close(value, expected, rtol=1e-9, atol=1e-8)
    for g, e in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("cls", CLASSES)
def test_matrix_free_training_reaches_the_dense_hyperparameters(cls):
    results = {}
    for backend in ("dense", "cholesky", "lanczos", "cg"):
        x, y, kernel = _training_problem(n=40)
        model = cls(x, y, kernel, noise=[0.2, 0.2, 0.1], backend=backend)
        with _exact_cg():
            assert model.optimize_hyperparameters(max_iter=8, lr=0.1) is model
        results[backend] = (
            torch.cat([p.detach().reshape(-1) for p in kernel.parameters()]),
            model.noise,
        )
    for backend in ("cholesky", "lanczos", "cg"):
        torch.testing.assert_close(results[backend][0], results["dense"][0], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(results[backend][1], results["dense"][1], rtol=1e-6, atol=1e-9)


def test_matrix_free_training_keeps_rows_within_an_evaluation_without_changing_the_result(
    count_calls,
):
    import gpsd.linalg.chunked_kernel_operator as chunked

    results, blocks = {}, {}
    for cache_bytes in (0, 10**8):
        x, y, kernel = _training_problem(n=40)
        model = DataCentricGPR(
            x, y, kernel, noise=[0.2, 0.1], backend="cg", kernel_cache_bytes=cache_bytes
        )
        with _exact_cg():
            calls = count_calls(chunked.ChunkedKernelOperator, "_row_block")
            model.optimize_hyperparameters(max_iter=3, lr=0.1)
        blocks[cache_bytes] = calls[0]
        results[cache_bytes] = torch.cat([p.detach().reshape(-1) for p in kernel.parameters()])
    torch.testing.assert_close(results[10**8], results[0], rtol=1e-10, atol=1e-12)
    assert blocks[10**8] < blocks[0]


def test_training_raises_the_likelihood_scales_the_schedule_and_refits():
    x, y, kernel = _training_problem()
    model = DataCentricGPR(x, y, kernel, noise=[0.2, 0.2, 0.1], backend="cholesky").fit()
    before = model.log_marginal_likelihood().item()
    old_engine = model._current_fit().engine
    model.optimize_hyperparameters(max_iter=40, lr=0.1)
    assert model.log_marginal_likelihood().item() > before + 1.0
    assert len(model.history) == 40 and model.history[-1] < model.history[0]
    ratios = model.noise / torch.tensor([0.2, 0.2, 0.1], dtype=DT)
    torch.testing.assert_close(ratios, ratios[:1].expand(3), rtol=1e-12, atol=0)
    assert not torch.allclose(ratios, torch.ones(3, dtype=DT))
    # the next prediction refits: the same as a model built from the learnt values
    test_x = x[:5] + 0.01
    fresh = DataCentricGPR(x, y, kernel, noise=model.noise.clone(), backend="cholesky")
    torch.testing.assert_close(model.predict(test_x).mean, fresh.predict(test_x).mean)
    assert model._current_fit().engine is not old_engine


def test_learn_noise_false_leaves_the_schedule_and_callback_stops_training():
    x, y, kernel = _training_problem()
    model = DataCentricGPR(x, y, kernel, noise=[0.2, 0.1], backend="dense")
    records = []
    model.optimize_hyperparameters(
        max_iter=10, learn_noise=False, callback=lambda r: records.append(r) or r.iteration == 3
    )
    assert [r.iteration for r in records] == [1, 2, 3] and len(model.history) == 3
    assert records[0].task == "DataCentricGPR.optimize_hyperparameters"
    assert records[0].info["noise"] == pytest.approx(0.2)
    assert records[0].loss == pytest.approx(model.history[0])
    torch.testing.assert_close(model.noise, torch.tensor([0.2, 0.1], dtype=DT))


def test_float32_modules_train_in_the_factorisation_dtype_and_keep_their_own():
    x, y, kernel = _training_problem(dtype=torch.float32)
    model = DataCentricGPR(x, y, kernel, noise=0.2, num_steps=2, backend="dense")
    model.optimize_hyperparameters(max_iter=5, lr=0.1)
    kernel64 = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).to(DT)
    reference = DataCentricGPR(x.double(), y.double(), kernel64, noise=0.2, num_steps=2)
    reference.optimize_hyperparameters(max_iter=5, lr=0.1)
    assert all(p.dtype == torch.float32 for p in kernel.parameters())
    for p, q in zip(kernel.parameters(), kernel64.parameters(), strict=True):
        torch.testing.assert_close(p.double(), q, rtol=1e-5, atol=1e-6)
    assert model.noise.dtype == torch.float32


def test_training_arguments_are_checked():
    x, y, kernel = _training_problem(n=10)
    model = DataCentricGPR(x, y, kernel, noise=0.2, backend="dense")
    with pytest.raises(ValueError, match="lr"):
        model.optimize_hyperparameters(lr=0)
    with pytest.raises(ValueError, match="max_iter"):
        model.optimize_hyperparameters(max_iter=-1)
    kernel.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable hyperparameters"):
        model.optimize_hyperparameters(learn_noise=False)


@pytest.mark.parametrize(
    ("cls", "steps"),
    [
        *((cls, {"num_steps": 2}) for cls in CLASSES),
        (gpsd.CombinedGPR, {"outer_steps": 1, "inner_steps": 2}),
    ],
)
def test_from_teacher_with_a_chunked_kernel_shares_its_base_kernel(cls, steps):
    x, y, kernel = _training_problem(n=40)

    class Teacher(gpytorch.models.ExactGP):
        def __init__(self):
            super().__init__(x, y, gpytorch.likelihoods.GaussianLikelihood())
            self.mean_module = gpytorch.means.ZeroMean()
            self.covar_module = gpsd.ChunkedKernel(kernel, chunk_size=8)

        def forward(self, z):
            return gpytorch.distributions.MultivariateNormal(
                self.mean_module(z), self.covar_module(z)
            )

    teacher = Teacher().to(DT)
    teacher.likelihood.noise = 0.05
    model = cls.from_teacher(teacher, **steps, backend="dense")
    assert model.covar_module is kernel and model.process_group is None
    teacher.eval()
    test_x = x[:6] + 0.05
    with torch.no_grad(), gpytorch.settings.max_cholesky_size(10_000):
        expected = teacher(test_x).mean
    torch.testing.assert_close(model.predict(test_x, step=1).mean, expected, rtol=1e-9, atol=1e-10)


def test_a_batch_of_schedules_has_one_teacher_likelihood_per_schedule_on_every_backend():
    x, y, kernel = _training_problem(n=16)
    noise = torch.tensor([[0.2, 0.1], [0.05, 0.05]], dtype=DT)
    K = kernel(x).to_dense().detach()
    eye = torch.eye(16, dtype=DT)
    expected = torch.stack(
        [
            torch.distributions.MultivariateNormal(torch.zeros_like(y), K + g * eye).log_prob(y)
            for g in (0.2, 0.05)
        ]
    )
    for backend in ("dense", "cg"):
        model = DataCentricGPR(x, y, kernel, noise=noise, backend=backend)
        with _exact_cg():
            got = model.log_marginal_likelihood()
        torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-8)


# ------------------------------------------------------------------ the fit lifecycle


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize(
    "trigger",
    [*COMMON_TRIGGERS, "parameter step", "model setting", "set_train_data", "noise assignment"],
)
def test_each_refit_trigger_refits_and_the_refit_predicts_as_a_fresh_model(
    cls, trigger, count_calls
):
    x, y, test_x = _problem()
    model = cls(x, y, rbf_kernel(), noise=NOISE, backend="dense").fit()
    fits = count_calls(cls, "_compute_fit")
    setting = contextlib.nullcontext()
    if trigger in COMMON_TRIGGERS:
        rival = functools.partial(
            cls, x, y, rbf_kernel(lengthscale=0.7), noise=NOISE, backend="dense"
        )
        test_x, setting = apply_common_trigger(trigger, model, rival, test_x)
    elif trigger == "parameter step":
        optimizer = torch.optim.SGD(model.covar_module.parameters(), lr=0.1)
        model.predict_mean(test_x).sum().backward()
        optimizer.step()
    elif trigger == "model setting":
        model.backend = "cholesky"
    elif trigger == "set_train_data":
        model.set_train_data(targets=y + 1)
    else:
        model.noise = [0.2, 0.2, 0.1]
    with setting:
        got = model.predict(test_x)
        assert fits == [1]
        fresh = copy.deepcopy(model)  # the same state, fitted afresh
        predictions_equal(got, fresh.predict(test_x))


@pytest.mark.parametrize("cls", CLASSES)
def test_a_gpsd_setting_that_changes_results_refits_and_predictions_do_not(cls, count_calls):
    x, y, test_x = _problem()
    model = cls(x, y, rbf_kernel(), noise=NOISE, backend="dense").fit()
    fits = count_calls(cls, "_compute_fit")
    factorisations = count_calls(gpsd.linalg, "make_engine")
    with torch.no_grad():
        model.predict(test_x)
        model.predict_mean(test_x)
        model.step_targets()
        model.gcv()
        with gpsd.settings.test_chunk_size(4):  # memory alone: the fit stays
            model.predict(test_x)
    assert fits == [0] and factorisations == [0]
    with gpsd.settings.dense_max_n(cpu=5):
        model.predict(test_x)
    assert fits == [1] and factorisations == [1]


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("backend", ["dense", "lanczos"])
def test_a_state_dict_round_trip_predicts_identically(cls, backend):
    x, y, test_x = _problem()
    model = cls(x, y, rbf_kernel(), noise=NOISE, backend=backend, rank=30).fit()
    loaded = cls(x, y, rbf_kernel(lengthscale=3.0), noise=[1.0, 1.0, 1.0], backend=backend, rank=30)
    loaded.predict(test_x)  # fitted at its own state first: the load makes that fit stale
    loaded.load_state_dict(model.state_dict())
    predictions_equal(loaded.predict(test_x), model.predict(test_x))


@pytest.mark.parametrize("cls", CLASSES)
def test_copies_and_pickles_refit_on_first_use_and_predict_identically(cls, count_calls):
    x, y, test_x = _problem()
    model = cls(x, y, rbf_kernel(), noise=NOISE, backend="dense").fit()
    want = model.predict(test_x)
    factorisations = count_calls(gpsd.linalg, "make_engine")
    for other in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        predictions_equal(other.predict(test_x), want)
    assert factorisations == [2]


@pytest.mark.parametrize("cls", CLASSES)
def test_a_backward_pass_through_the_fit_refits_and_the_next_gradient_is_whole(cls, count_calls):
    x, y, test_x = _problem()
    model = cls(x, y, rbf_kernel(), noise=NOISE, backend="dense").fit()
    fits = count_calls(cls, "_compute_fit")
    factorisations = count_calls(gpsd.linalg, "make_engine")
    model.predict_mean(test_x).sum().backward()  # frees the fit's graph; no parameter changes
    first = model.covar_module.base_kernel.raw_lengthscale.grad.clone()
    model.covar_module.zero_grad()
    model.predict_mean(test_x).sum().backward()
    assert fits == [1] and factorisations == [1]
    torch.testing.assert_close(model.covar_module.base_kernel.raw_lengthscale.grad, first)
