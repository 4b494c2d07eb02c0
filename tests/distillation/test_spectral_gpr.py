"""Behaviour both regression distillers share: the convention (fit, Prediction, steps from 1,
best_step, include_noise), the errors, and the cached factorisation."""

import gpytorch
import pytest
import torch
from gpr_reference import rbf_kernel, relative_error

import gpsd
import gpsd.linalg
from gpsd import DataCentricGPR, DistributionCentricGPR, Prediction

DT = torch.float64
CLASSES = [DataCentricGPR, DistributionCentricGPR]
NOISE = [0.1, 0.3, 0.05]


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
        torch.testing.assert_close(noisy.variance - latent.variance, noise[..., None].expand(2, 3, 9))
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
        by_validation = model.best_step("validation", test_x, val_y)
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
            model.best_step("gcv", test_x, val_y)


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
def test_a_dense_request_that_cannot_fit_fails_before_allocating(cls, backend, monkeypatch):
    def no_factorisation(*args, **kwargs):
        raise AssertionError("make_engine was called")

    free = []

    def little_memory(device, wanted=None):
        free.append(wanted)
        return 10_000

    monkeypatch.setattr(gpsd.linalg, "make_engine", no_factorisation)
    monkeypatch.setattr(gpsd.linalg, "free_memory_bytes", little_memory)
    x, y, test_x = _problem(n=30)
    model = cls(x, y, rbf_kernel(), noise=NOISE, backend=backend)
    # dense: K, its eigenvectors and workspace, 4 x 30 x 30 float64; cholesky: K and a factor
    needed = 4 * 30 * 30 * 8 if backend == "dense" else 2 * 30 * 30 * 8
    message = rf"needs about {needed} bytes.*10000 bytes are free.*backend='lanczos' or backend='cg'"
    with pytest.raises(gpsd.InsufficientMemoryError, match=message):
        model.predict(test_x)
    assert free == [needed]
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
