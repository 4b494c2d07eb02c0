"""DistributionCentricGPR: against the literal recursion of posterior modules, Theorem 3.3 and
dense formulas."""

import contextlib
import warnings

import gpytorch
import pytest
import torch
from gpr_reference import PlainGP, exact_settings, rbf_kernel, relative_error
from gpytorch.utils.warnings import GPInputWarning, NumericalWarning

import gpsd
from gpsd import DistributionCentricGPR
from gpsd.data import xsinx_regression

DTYPE = torch.float64


@pytest.fixture
def problem():
    x, y = xsinx_regression(n=25, seed=2)
    return x.unsqueeze(-1), y, torch.linspace(-1.0, 11.0, 19, dtype=DTYPE).unsqueeze(-1)


def test_iterated_recursion_equals_theorem_3_3_closed_form(problem):
    x, y, test_x = problem
    gammas = torch.tensor([0.3, 0.1, 0.7, 0.2, 1.0], dtype=DTYPE)
    mean = gpytorch.means.ConstantMean().to(DTYPE)
    mean.constant.data.fill_(-0.4)
    kwargs = dict(mean_module=mean)
    collapsed = DistributionCentricGPR(x, y, rbf_kernel(), noise=gammas, **kwargs)
    iterated = DistributionCentricGPR(x, y, rbf_kernel(), noise=gammas, method="iterated", **kwargs)
    with torch.no_grad(), exact_settings():
        a = collapsed.predict(test_x, full_cov=True)
        b = iterated.predict(test_x, full_cov=True)
    assert a.mean.shape == (5, 19) and a.covariance.shape == (5, 19, 19)
    assert relative_error(a.mean, b.mean) < 1e-8
    assert relative_error(a.variance, b.variance) < 1e-8
    assert relative_error(a.covariance, b.covariance) < 1e-8


def test_closed_form_is_an_ordinary_gp_with_harmonic_noise(problem):
    """Theorem 3.3 checked against a GPyTorch GP with noise 1 / sum(1 / gamma_s)."""
    x, y, test_x = problem
    gammas = torch.tensor([[0.3, 0.1, 0.7], [0.5, 0.5, 0.5]], dtype=DTYPE)
    model = DistributionCentricGPR(x, y, rbf_kernel(), noise=gammas, backend="dense")
    with torch.no_grad():
        path = model.predict(test_x)
    for s in range(2):
        for t in range(3):
            likelihood = gpytorch.likelihoods.GaussianLikelihood().to(DTYPE)
            likelihood.noise = 1.0 / (1.0 / gammas[s, : t + 1]).sum()
            gp = PlainGP(x, y, likelihood, gpytorch.means.ZeroMean(), rbf_kernel()).eval()
            with torch.no_grad(), exact_settings(), gpytorch.settings.fast_pred_var(False):
                post = gp(test_x)
            assert relative_error(path.mean[s, t], post.mean) < 1e-9
            assert relative_error(path.variance[s, t], post.variance) < 1e-9


def test_corollary_3_4_data_duplication(problem):
    """t steps with a constant gamma equal one GP fitted to t copies of the data."""
    x, y, test_x = problem
    gamma, t = 0.4, 4
    model = DistributionCentricGPR(x, y, rbf_kernel(), noise=[gamma] * t, backend="cholesky")
    likelihood = gpytorch.likelihoods.GaussianLikelihood().to(DTYPE)
    likelihood.noise = gamma
    gp = PlainGP(x.repeat(t, 1), y.repeat(t), likelihood, gpytorch.means.ZeroMean(), rbf_kernel())
    gp.eval()
    with torch.no_grad(), exact_settings(), gpytorch.settings.fast_pred_var(False):
        post = gp(test_x)
        path = model.predict(test_x, full_cov=True)
        # Eq. (12)-(13): the posterior at the duplicated training inputs is block-constant.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", GPInputWarning)  # the training inputs, on purpose
            train_post = gp(x.repeat(t, 1))
    assert relative_error(path.mean[t - 1], post.mean) < 1e-8
    assert relative_error(path.covariance[t - 1], post.covariance_matrix) < 1e-8
    blocks = train_post.covariance_matrix.reshape(t, 25, t, 25)
    assert relative_error(blocks[0, :, 2, :], blocks[1, :, 1, :]) < 1e-8
    assert relative_error(train_post.mean[:25], train_post.mean[25:50]) < 1e-8


@pytest.mark.parametrize("backend", ["dense", "cholesky", "lanczos", "cg"])
def test_backends_agree(problem, backend):
    x, y, test_x = problem
    gammas = torch.linspace(0.2, 1.0, 6, dtype=DTYPE)
    ref = DistributionCentricGPR(x, y, rbf_kernel(), noise=gammas, method="iterated")
    options = {"rank": 4, "rtol": 1e-12} if backend == "cg" else {"rank": 25}
    model = DistributionCentricGPR(x, y, rbf_kernel(), noise=gammas, backend=backend, **options)
    # cg forced on this spectrum warns that "auto" would be faster: intended here
    forced = pytest.warns(NumericalWarning, match="slowly decaying spectrum")
    with torch.no_grad(), exact_settings(), forced if backend == "cg" else contextlib.nullcontext():
        a, b = model.predict(test_x), ref.predict(test_x)
    assert relative_error(a.mean, b.mean) < 1e-8
    assert relative_error(a.variance, b.variance) < 1e-8


def test_student_and_effective_noise(problem):
    x, y, test_x = problem
    gammas = torch.tensor([0.2, 0.6, 0.3], dtype=DTYPE)
    model = DistributionCentricGPR(x, y, rbf_kernel(), noise=gammas)
    expected = torch.tensor([0.2, 1 / (5 + 1 / 0.6), 1 / (5 + 1 / 0.6 + 1 / 0.3)], dtype=DTYPE)
    torch.testing.assert_close(model.effective_noise, expected)
    student = model.student(3)
    assert float(student.likelihood.noise.detach()) == pytest.approx(float(expected[2]))
    with torch.no_grad(), exact_settings(), gpytorch.settings.fast_pred_var(False):
        post = student(test_x)
        path = model.predict(test_x)
    assert relative_error(post.mean, path.mean[2]) < 1e-9


def test_from_teacher_and_errors(problem):
    x, y, test_x = problem
    likelihood = gpytorch.likelihoods.GaussianLikelihood().to(DTYPE)
    likelihood.noise = 0.3
    teacher = PlainGP(x, y, likelihood, gpytorch.means.ZeroMean(), rbf_kernel()).eval()
    model = DistributionCentricGPR.from_teacher(teacher, num_steps=3)
    torch.testing.assert_close(model.effective_noise, torch.tensor([0.3, 0.15, 0.1], dtype=DTYPE))
    with pytest.raises(ValueError, match="method"):
        DistributionCentricGPR(x, y, rbf_kernel(), noise=0.1, method="lazy")
    with pytest.raises(ValueError, match="noise"):
        DistributionCentricGPR(x, y, rbf_kernel(), noise=[0.1, -0.1])
    with pytest.raises(ValueError, match="num_steps"):
        DistributionCentricGPR.from_teacher(teacher)
    with pytest.raises(ValueError, match="test_x"):
        model.predict(torch.zeros(3, 4, dtype=DTYPE))
    with pytest.raises(ValueError, match=r"step must lie in 1..3"):
        model.student(4)
    with pytest.raises(ValueError, match="step must be"):
        model.student(1.5)


@pytest.mark.filterwarnings("ignore:backend=.cg. on a slowly decaying")
def test_gcv_on_cg_is_within_a_few_standard_errors_of_one_gp_with_the_effective_noise():
    gen = torch.Generator().manual_seed(1)
    x = 5 * torch.rand(300, 2, generator=gen, dtype=DTYPE)
    y = torch.sin(x).sum(-1) + 0.3 * torch.randn(300, generator=gen, dtype=DTYPE)
    schedule = torch.tensor([0.2, 0.2, 0.4, 0.4], dtype=DTYPE)
    kernel = rbf_kernel(outputscale=1.0, lengthscale=0.8)
    with torch.no_grad(), gpsd.settings.cg_deflation_rank(24):
        model = DistributionCentricGPR(x, y, kernel, noise=schedule, backend="cg")
        got, error = model.gcv(), model.gcv_standard_error()
        k = kernel(x).to_dense()
        want = []
        for noise in 1.0 / torch.cumsum(1.0 / schedule, dim=0):
            smoother = k @ torch.linalg.inv(k + noise * torch.eye(300, dtype=DTYPE))
            residual = y - smoother @ y
            want.append(300 * residual.square().sum() / (300 - smoother.trace()) ** 2)
    want = torch.stack(want)
    assert bool((error > 0).all())
    assert bool(((got - want).abs() <= 5 * error).all()), (got, want, error)
    assert model.best_step() == int(want.argmin()) + 1


@pytest.mark.parametrize("backend", ["dense", "cholesky", "lanczos"])
def test_gcv_of_each_step_is_that_of_one_gp_with_the_effective_noise(backend):
    """Step t is one GP with noise 1 / sum_{s <= t} 1 / gamma_s (Theorem 3.3): its smoother
    S_t = K (K + noise I)^-1, and GCV(t) = N ||y - S_t y||^2 / (N - tr S_t)^2, by dense algebra."""
    gen = torch.Generator().manual_seed(0)
    x = 10 * torch.rand(200, 1, generator=gen, dtype=DTYPE)
    y = torch.sin(x[:, 0])
    schedule = torch.tensor([0.1, 0.2, 0.3], dtype=DTYPE)
    model = DistributionCentricGPR(x, y, rbf_kernel(), noise=schedule, backend=backend, rtol=1e-10)
    with torch.no_grad():
        got = model.gcv()
        k = rbf_kernel()(x).to_dense()
        want = []
        for noise in 1.0 / torch.cumsum(1.0 / schedule, dim=0):
            smoother = k @ torch.linalg.inv(k + noise * torch.eye(200, dtype=DTYPE))
            residual = y - smoother @ y
            want.append(200 * residual.square().sum() / (200 - smoother.trace()) ** 2)
    assert relative_error(got, torch.stack(want)) < 1e-9
    assert model.best_step() == int(torch.stack(want).argmin()) + 1


def test_iterated_models_chain_equals_the_iterated_recursion(problem):
    """The GPyTorch chain of PosteriorMean/PosteriorKernel priors (iterated_models) and the
    recursion on the joint inputs that method="iterated" predicts with are two computations of
    eqs. 6-7: every step agrees."""
    x, y, test_x = problem
    gammas = [0.3, 0.1, 0.2]
    model = DistributionCentricGPR(x, y, rbf_kernel(), noise=gammas, method="iterated")
    with torch.no_grad():
        path = model.predict(test_x)
        for t, student in enumerate(model.iterated_models(), start=1):
            with gpytorch.settings.fast_pred_var(False):
                post = student(test_x)
            torch.testing.assert_close(post.mean, path.mean[t - 1], rtol=1e-9, atol=1e-11)
            torch.testing.assert_close(post.variance, path.variance[t - 1], rtol=1e-8, atol=1e-11)
