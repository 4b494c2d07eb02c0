import warnings

import gpytorch
import pytest
import torch
from gpr_reference import PlainGP, exact_settings, naive_data_centric, rbf_kernel, relative_error
from gpytorch.utils.warnings import NumericalWarning

import gpsd
from gpsd import DataCentricGPR, DistributionCentricGPR
from gpsd.data import xsinx_regression

DTYPE = torch.float64


@pytest.fixture
def problem():
    x, y = xsinx_regression(n=40, seed=1)
    x = x.unsqueeze(-1)
    test_x = torch.linspace(-1.0, 11.0, 23, dtype=DTYPE).unsqueeze(-1)
    return x, y, test_x


@pytest.mark.parametrize("backend", ["dense", "cholesky", "lanczos", "cg"])
@pytest.mark.parametrize("alpha", [0.0, 0.35])
def test_equals_naive_refit_loop(problem, backend, alpha):
    x, y, test_x = problem
    kernel = rbf_kernel()
    mean = gpytorch.means.ConstantMean().to(DTYPE)
    mean.constant.data.fill_(0.7)
    gammas = torch.linspace(0.1, 1.0, 10, dtype=DTYPE)
    targets, means, variances, train_vars = naive_data_centric(
        kernel, mean, x, y, gammas, test_x, alpha
    )
    # CG deflates only 8 Ritz pairs, so that its iterations do the work.
    options = {"rank": 8, "rtol": 1e-12} if backend == "cg" else {"rank": 40}
    model = DataCentricGPR(
        x, y, kernel, noise=gammas, alpha=alpha, mean_module=mean, backend=backend, **options
    )
    with torch.no_grad():
        path = model.predict(test_x)
        train_path = model.predict(x)
        got_targets = model.step_targets()
    assert path.mean.shape == (10, 23) and path.variance.shape == (10, 23)
    assert relative_error(got_targets, targets) < 1e-8
    assert relative_error(path.mean, means) < 1e-8
    assert relative_error(path.variance, variances) < 1e-8
    assert relative_error(train_path.variance, train_vars) < 1e-8


def test_forward_is_a_batch_of_mvns_and_full_covariance_matches(problem):
    x, y, test_x = problem
    kernel = rbf_kernel()
    gammas = torch.tensor([0.2, 0.5, 0.9], dtype=DTYPE)
    model = DataCentricGPR(x, y, kernel, noise=gammas, backend="dense")
    with torch.no_grad():
        mvn = model(test_x)
        full = model(test_x, full_cov=True)
    assert isinstance(mvn, gpytorch.distributions.MultivariateNormal)
    assert mvn.batch_shape == (3,) and mvn.event_shape == (23,)
    # Dense formula for step 2: K** - K*X (K + g I)^-1 KX*.
    k = kernel(x).to_dense()
    ks = kernel(test_x, x).to_dense()
    kss = kernel(test_x).to_dense()
    cov2 = kss - ks @ torch.linalg.solve(k + 0.5 * torch.eye(40, dtype=DTYPE), ks.T)
    assert relative_error(full.covariance_matrix[1], cov2) < 1e-10
    assert relative_error(mvn.variance, full.variance) < 1e-12


def test_batch_of_schedules_equals_separate_runs(problem):
    x, y, test_x = problem
    kernel = rbf_kernel()
    schedules = 0.05 + torch.rand(8, 6, dtype=DTYPE)
    batched = DataCentricGPR(x, y, kernel, noise=schedules, alpha=0.2, backend="dense")
    with torch.no_grad():
        path = batched.predict(test_x)
        gcv = batched.gcv()
        targets = batched.step_targets()
    assert path.mean.shape == (8, 6, 23) and gcv.shape == (8, 6) and targets.shape == (8, 6, 40)
    for i in range(8):
        single = DataCentricGPR(x, y, kernel, noise=schedules[i], alpha=0.2, backend="cholesky")
        with torch.no_grad():
            ref = single.predict(test_x)
            assert relative_error(path.mean[i], ref.mean) < 1e-9
            assert relative_error(path.variance[i], ref.variance) < 1e-9
            assert relative_error(gcv[i], single.gcv()) < 1e-9
            assert relative_error(targets[i], single.step_targets()) < 1e-9


def test_kernel_batch_dimensions(problem):
    x, y, test_x = problem
    kernel = rbf_kernel(batch_shape=torch.Size([2]))
    kernel.base_kernel.lengthscale = torch.tensor([[[1.0]], [[2.5]]], dtype=DTYPE)
    ys = torch.stack([y, -0.5 * y])
    xs = x.expand(2, -1, -1)
    gammas = torch.tensor([0.3, 0.6], dtype=DTYPE)
    model = DataCentricGPR(xs, ys, kernel, noise=gammas, backend="dense")
    with torch.no_grad():
        path = model.predict(test_x.expand(2, -1, -1))
    assert path.mean.shape == (2, 2, 23)
    for b in range(2):
        k_b = rbf_kernel(lengthscale=[1.0, 2.5][b])
        ref = naive_data_centric(k_b, gpytorch.means.ZeroMean(), x, ys[b], gammas, test_x)
        assert relative_error(path.mean[b], ref[1]) < 1e-9
        assert relative_error(path.variance[b], ref[2]) < 1e-9


def test_gcv_matches_explicit_smoother(problem):
    x, y, _ = problem
    kernel = rbf_kernel()
    gammas = torch.tensor([0.1, 0.4, 0.4, 1.0], dtype=DTYPE)
    alpha = 0.25
    n = 40
    k = kernel(x).to_dense().detach()
    eye = torch.eye(n, dtype=DTYPE)
    # Explicit matrices: y_t = F_t y with F_t = alpha I + (1 - alpha) K (K + g I)^-1 F_{t-1}.
    f_prev = eye
    expected = []
    for g in gammas:
        fitted = k @ torch.linalg.solve(k + g * eye, f_prev)  # the step's mean at training inputs
        resid = y - fitted @ y
        expected.append(n * resid.square().sum() / (n - torch.trace(fitted)) ** 2)
        f_prev = alpha * eye + (1 - alpha) * fitted
    for backend in ["dense", "cholesky", "lanczos"]:
        model = DataCentricGPR(x, y, kernel, noise=gammas, alpha=alpha, backend=backend, rank=40)
        with torch.no_grad():
            assert relative_error(model.gcv(), torch.stack(expected)) < 1e-8, backend


def test_validation_mse(problem):
    x, y, test_x = problem
    kernel = rbf_kernel()
    model = DataCentricGPR(x, y, kernel, noise=[0.2, 0.4], backend="dense")
    val_y = test_x.squeeze(-1) * torch.sin(test_x.squeeze(-1))
    with torch.no_grad():
        mse = model.validation_mse(test_x, val_y)
        mean = model.predict(test_x).mean
    torch.testing.assert_close(mse, (mean - val_y).square().mean(-1))
    with pytest.raises(ValueError, match="val_y"):
        model.validation_mse(test_x, val_y[:-1])


def test_student_is_a_plain_exact_gp_equal_to_step_t(problem):
    x, y, test_x = problem
    kernel = rbf_kernel()
    gammas = torch.tensor([[0.1, 0.3, 0.6], [0.2, 0.2, 0.2]], dtype=DTYPE)
    model = DataCentricGPR(x, y, kernel, noise=gammas, backend="dense")
    with torch.no_grad():
        path = model.predict(test_x)
    for t in (1, 3):
        student = model.student(t, schedule=(1,))
        assert isinstance(student, gpytorch.models.ExactGP)
        assert float(student.likelihood.noise.detach()) == pytest.approx(0.2)
        with torch.no_grad(), exact_settings(), gpytorch.settings.fast_pred_var(False):
            post = student(test_x)
        assert relative_error(post.mean, path.mean[1, t - 1]) < 1e-9
        assert relative_error(post.variance, path.variance[1, t - 1]) < 1e-9
    with pytest.raises(ValueError, match="step must lie in 1..3"):
        model.student(4)
    for t in (2.5, 2.0, 0):
        with pytest.raises(ValueError, match="step must be an integer"):
            model.student(t)


def test_gradients_match_finite_differences(problem):
    x, y, test_x = problem
    gammas = torch.tensor([0.2, 0.5, 0.5], dtype=DTYPE)

    def loss_for(raw_lengthscale, backend):
        kernel = rbf_kernel()
        kernel.base_kernel.raw_lengthscale.data.fill_(raw_lengthscale)
        model = DataCentricGPR(x, y, kernel, noise=gammas, backend=backend)
        path = model.predict(test_x)
        loss = path.mean.square().sum() + path.variance.sum() + model.gcv().sum()
        return loss, kernel

    for backend in ["dense", "cholesky"]:
        loss, kernel = loss_for(0.3, backend)
        loss.backward()
        grad = float(kernel.base_kernel.raw_lengthscale.grad)
        h = 1e-6
        with torch.no_grad():
            fd = (float(loss_for(0.3 + h, backend)[0]) - float(loss_for(0.3 - h, backend)[0])) / (
                2 * h
            )
        assert grad == pytest.approx(fd, rel=1e-6), backend


def test_lanczos_agrees_with_dense_at_n_2000_within_its_estimate():
    gen = torch.Generator().manual_seed(0)
    x = 10 * torch.rand(2000, 1, generator=gen, dtype=DTYPE)
    y = torch.sin(x.squeeze(-1)) + 0.3 * torch.randn(2000, generator=gen, dtype=DTYPE)
    test_x = torch.linspace(0, 10, 100, dtype=DTYPE).unsqueeze(-1)
    kernel = rbf_kernel(outputscale=1.0, lengthscale=1.0)
    gammas = torch.linspace(0.1, 1.0, 5, dtype=DTYPE)
    dense = DataCentricGPR(x, y, kernel, noise=gammas, backend="dense")
    lanczos = DataCentricGPR(x, y, kernel, noise=gammas, backend="lanczos", rank=128)
    with torch.no_grad():
        ref, got = dense.predict(test_x), lanczos.predict(test_x)
        estimate = lanczos.error_estimate
    assert estimate < 1e-6
    assert relative_error(got.mean, ref.mean) < max(estimate, 1e-10) * 10
    assert relative_error(got.variance, ref.variance) < max(estimate, 1e-10) * 10


def test_lanczos_error_estimate_bounds_the_error_with_an_active_complement():
    """A rank too small to resolve the spectrum: the Taylor complement does the rest."""
    gen = torch.Generator().manual_seed(1)
    x = 10 * torch.rand(300, 1, generator=gen, dtype=DTYPE)
    y = torch.sin(x.squeeze(-1)) + 0.3 * torch.randn(300, generator=gen, dtype=DTYPE)
    test_x = torch.linspace(0, 10, 50, dtype=DTYPE).unsqueeze(-1)
    kernel = rbf_kernel(outputscale=1.0, lengthscale=0.7)
    gammas = torch.linspace(0.5, 1.0, 5, dtype=DTYPE)
    dense = DataCentricGPR(x, y, kernel, noise=gammas, backend="dense")
    with torch.no_grad():
        ref = dense.predict(test_x)
        for rank in (24, 32):
            lanczos = DataCentricGPR(
                x, y, kernel, noise=gammas, backend="lanczos", rank=rank, rtol=1.0
            )
            spectrum = lanczos._state()["engine"]
            assert spectrum.complement_norm > 1e-8  # the complement is really used
            got = lanczos.predict(test_x)
            err = max(
                relative_error(got.mean, ref.mean), relative_error(got.variance, ref.variance)
            )
            assert err < 2 * lanczos.error_estimate
            # and the complement correction matters: the plain truncation is much worse
            truncated = spectrum.eigenvectors @ (
                spectrum.eigenvectors.mT @ lanczos._state()["centred"]
            )
            assert float((truncated.squeeze(-1) - y).abs().max()) > 10 * err


def test_float32_data_and_default_float64_factorisation(problem):
    x, y, test_x = problem
    kernel = rbf_kernel(dtype=torch.float32)
    model = DataCentricGPR(x.float(), y.float(), kernel, noise=[0.1, 0.2], backend="dense")
    with torch.no_grad():
        path = model.predict(test_x.float())
    assert path.mean.dtype == torch.float32
    ref = DataCentricGPR(x, y, kernel.double(), noise=[0.1, 0.2], backend="dense")
    with torch.no_grad():
        assert relative_error(path.mean.double(), ref.predict(test_x).mean) < 1e-5


def test_cache_is_refreshed_when_hyperparameters_change(problem):
    x, y, test_x = problem
    kernel = rbf_kernel()
    model = DataCentricGPR(x, y, kernel, noise=[0.3], backend="dense")
    with torch.no_grad():
        before = model.predict(test_x).mean
        kernel.base_kernel.lengthscale = 0.5
        after = model.predict(test_x).mean
        fresh = DataCentricGPR(x, y, rbf_kernel(lengthscale=0.5), noise=[0.3]).predict(test_x)
    assert relative_error(after, fresh.mean) < 1e-10
    assert relative_error(after, before) > 1e-3


def test_state_dict_round_trip_and_to(problem):
    x, y, test_x = problem
    f32 = torch.float32
    model = DataCentricGPR(x.float(), y.float(), rbf_kernel(dtype=f32), noise=[0.1, 0.5], alpha=0.1)
    model.covar_module.base_kernel.lengthscale = 0.8
    clone = DataCentricGPR(x.float(), y.float(), rbf_kernel(dtype=f32), noise=[1.0, 1.0], alpha=0.1)
    clone.load_state_dict(model.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(
            clone.predict(test_x.float()).mean, model.predict(test_x.float()).mean
        )
        model64 = model.to(torch.float64)
        assert model64.predict(test_x).mean.dtype == torch.float64


def test_from_teacher_uses_teacher_noise_and_modules(problem):
    x, y, test_x = problem
    likelihood = gpytorch.likelihoods.GaussianLikelihood().to(DTYPE)
    likelihood.noise = 0.25
    mean = gpytorch.means.ConstantMean().to(DTYPE)
    teacher = PlainGP(x, y, likelihood, mean, rbf_kernel()).eval()
    model = DataCentricGPR.from_teacher(teacher, num_steps=3)
    torch.testing.assert_close(model.noise, torch.full((3,), 0.25, dtype=DTYPE))
    with torch.no_grad(), exact_settings(), gpytorch.settings.fast_pred_var(False):
        post = teacher(test_x)
        path = model.predict(test_x)
    # Step 1 is the teacher itself.
    assert relative_error(path.mean[0], post.mean) < 1e-9
    assert relative_error(path.variance[0], post.variance) < 1e-9


def test_bad_input_raises_clear_errors(problem):
    x, y, test_x = problem
    kernel = rbf_kernel()
    for gamma in (0.0, -1.0, float("nan"), [0.1, float("inf")], []):
        with pytest.raises(ValueError, match="noise"):
            DataCentricGPR(x, y, kernel, noise=gamma)
    for alpha in (-0.1, 1.0, 1.5):
        with pytest.raises(ValueError, match="alpha"):
            DataCentricGPR(x, y, kernel, noise=0.1, alpha=alpha)
    with pytest.raises(ValueError, match="train_y"):
        DataCentricGPR(x, y[:-1], kernel, noise=0.1)
    bad_y = y.clone()
    bad_y[3] = float("nan")
    with pytest.raises(ValueError, match="train_y"):
        DataCentricGPR(x, bad_y, kernel, noise=0.1)
    bad_x = x.clone()
    bad_x[0, 0] = float("inf")
    with pytest.raises(ValueError, match="train_x"):
        DataCentricGPR(bad_x, y, kernel, noise=0.1)
    with pytest.raises(ValueError, match="backend must be one of"):
        DataCentricGPR(x, y, kernel, noise=0.1, backend="svd")  # at construction, not at predict
    settable = DataCentricGPR(x, y, kernel, noise=0.1)
    with pytest.raises(ValueError, match="backend must be one of"):
        settable.backend = "svd"  # and when set later
    for rank in (0, -3, 2.5):
        with pytest.raises(ValueError, match="rank must be a positive integer or None"):
            DataCentricGPR(x, y, kernel, noise=0.1, backend="lanczos", rank=rank)
    model = DataCentricGPR(x, y, kernel, noise=0.1)
    with pytest.raises(ValueError, match="test_x"):
        model.predict(torch.zeros(5, 2, dtype=DTYPE))
    with pytest.raises(ValueError, match="device"):
        model.predict(test_x.to("meta"))
    with pytest.raises(TypeError, match="kernel"):
        DataCentricGPR(x, y, "rbf", noise=0.1)
    # A teacher whose likelihood is not Gaussian.
    teacher = PlainGP(
        x, y, gpytorch.likelihoods.GaussianLikelihood(), gpytorch.means.ZeroMean(), kernel
    )
    teacher.likelihood = gpytorch.likelihoods.BernoulliLikelihood()
    with pytest.raises(ValueError, match="GaussianLikelihood"):
        DataCentricGPR.from_teacher(teacher, num_steps=2)
    with pytest.raises(TypeError, match="ExactGP"):
        DataCentricGPR.from_teacher(kernel, num_steps=2)


def test_chunked_test_points_equal_one_pass(problem):
    x, y, test_x = problem
    model = DataCentricGPR(x, y, rbf_kernel(), noise=[0.2, 0.4], backend="lanczos")
    with torch.no_grad():
        whole = model.predict(test_x)
        with gpsd.settings.test_chunk_size(5):
            chunked = model.predict(test_x)
    torch.testing.assert_close(chunked.mean, whole.mean)
    torch.testing.assert_close(chunked.variance, whole.variance)


def test_out_of_memory_names_the_backend_to_use(problem, monkeypatch):
    x, y, test_x = problem

    def no_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("simulated")

    monkeypatch.setattr(torch.linalg, "eigh", no_memory)
    model = DataCentricGPR(x, y, rbf_kernel(), noise=[0.1] * 50, backend="dense")
    with pytest.raises(MemoryError, match="backend='lanczos'"):
        model.predict(test_x)


@pytest.mark.parametrize("backend", ["lanczos", "cg"])
def test_matrix_free_with_float32_data_reaches_the_float64_factorisation(backend):
    """Matrix-free products run in the factorisation's dtype, so Ritz pairs and CG converge."""
    gen = torch.Generator().manual_seed(0)
    x = 10 * torch.rand(300, 2, generator=gen)
    y = torch.sin(x).sum(-1)
    kernel = rbf_kernel(outputscale=1.0, lengthscale=1.0, dtype=torch.float32)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", NumericalWarning)
        # CG needs only a weak preconditioner, and reaches a tolerance Lanczos could not here.
        options = {"rank": 32, "rtol": 1e-9} if backend == "cg" else {}
        model = DataCentricGPR(x, y, kernel, noise=[0.1, 0.2], backend=backend, **options)
        got = model.predict(x[:40])
        ref = DataCentricGPR(x, y, kernel, noise=[0.1, 0.2], backend="dense").predict(x[:40])
    assert got.mean.dtype == torch.float32
    assert relative_error(got.mean, ref.mean) < 1e-5
    assert relative_error(got.variance, ref.variance) < 1e-4


@pytest.mark.parametrize("cls", [DataCentricGPR, DistributionCentricGPR])
@pytest.mark.parametrize("backend", ["dense", "cholesky", "cg"])
def test_float32_data_predicts_to_float32_rounding_of_the_float64_answer(backend, cls):
    """The test covariances are evaluated in the factorisation's dtype: the variance
    k** - k*^T R k* cancels, and float32 entries of k* alone would cost about 1e-4 here."""
    gen = torch.Generator().manual_seed(5)
    x = 10 * torch.rand(400, 2, generator=gen)
    y = torch.sin(x).sum(-1)
    test_x = 10 * torch.rand(60, 2, generator=gen)
    gammas = [0.1, 0.2, 0.4]
    with torch.no_grad():
        kernel = rbf_kernel(outputscale=1.0, lengthscale=0.1, dtype=torch.float32)
        got = cls(x, y, kernel, noise=gammas, backend=backend, rtol=1e-10).predict(test_x)
        # the same float32 values, in float64 throughout
        kernel64 = rbf_kernel(outputscale=1.0, lengthscale=0.1)
        ref = cls(x.double(), y.double(), kernel64, noise=gammas, backend="dense")
        ref = ref.predict(test_x.double())
    assert got.mean.dtype == got.variance.dtype == torch.float32
    assert relative_error(got.mean.double(), ref.mean) < 1e-6
    assert relative_error(got.variance.double(), ref.variance) < 1e-6
