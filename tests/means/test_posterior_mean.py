"""PosteriorMean: the teacher's posterior mean as a prior mean; the teacher and its data are checked."""

import gpytorch
import pytest
import torch
from gpr_reference import PlainGP, exact_settings, matern_teacher

from gpsd import DataCentricGPR, PosteriorKernel, PosteriorMean

DTYPE = torch.float64


@pytest.fixture
def teacher():
    return matern_teacher()


def test_equal_the_teachers_posterior(teacher):
    gen = torch.Generator().manual_seed(1)
    x1 = torch.rand(11, 2, generator=gen, dtype=DTYPE) * 4
    x2 = torch.rand(7, 2, generator=gen, dtype=DTYPE) * 4
    pm, pk = PosteriorMean(teacher), PosteriorKernel(teacher)
    with torch.no_grad(), exact_settings(), gpytorch.settings.fast_pred_var(False):
        joint = teacher(torch.cat([x1, x2]))
        post = teacher(x1)
        mean = pm(x1)
        cov = pk(x1).to_dense()
        cross = pk(x1, x2).to_dense()
        diag = pk(x1, diag=True)
    torch.testing.assert_close(mean, post.mean, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(cov, post.covariance_matrix, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(cross, joint.covariance_matrix[:11, 11:], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(diag, post.variance, rtol=1e-10, atol=1e-10)


def test_state_dict_round_trip_and_dtype(teacher):
    pk, pm = PosteriorKernel(teacher), PosteriorMean(teacher)
    state = pk.state_dict()
    assert "cholesky" in state and "train_inputs" in state
    other = PosteriorKernel(teacher)
    other.load_state_dict(state)
    x = torch.rand(5, 2, dtype=DTYPE)
    torch.testing.assert_close(other(x).to_dense(), pk(x).to_dense())
    pk32 = pk.to(torch.float32)
    assert pk32(x.float()).to_dense().dtype == torch.float32
    assert pm.to(torch.float32)(x.float()).dtype == torch.float32


def test_errors(teacher):
    pk, pm = PosteriorKernel(teacher), PosteriorMean(teacher)
    with pytest.raises(ValueError, match="features"):
        pm(torch.zeros(3, 5, dtype=DTYPE))
    with pytest.raises(ValueError, match="device"):
        pk(torch.zeros(3, 2, device="meta")).to_dense()  # kernels evaluate lazily
    bad = PlainGP(
        teacher.train_inputs[0],
        teacher.train_targets,
        teacher.likelihood,
        teacher.mean_module,
        teacher.covar_module,
    )
    bad.likelihood = gpytorch.likelihoods.BernoulliLikelihood()
    with pytest.raises(ValueError, match="Gaussian"):
        PosteriorMean(bad)
    with pytest.raises(TypeError, match="ExactGP"):
        PosteriorKernel(teacher.covar_module)


# ------------ The teacher's data and the inputs are checked


def _teacher(x, y):
    likelihood = gpytorch.likelihoods.GaussianLikelihood().to(DTYPE)
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).to(DTYPE)
    return PlainGP(x, y, likelihood, gpytorch.means.ConstantMean().to(DTYPE), kernel).eval()


X = torch.linspace(0, 1, 20, dtype=DTYPE).unsqueeze(-1)


Y = torch.sin(6 * X).squeeze(-1)


@pytest.mark.parametrize("module", [PosteriorMean, PosteriorKernel, DataCentricGPR.from_teacher])
@pytest.mark.parametrize(
    "targets, message",
    [
        (Y.unsqueeze(-1), r"teacher.train_targets must have 20 entries .* got shape \(20, 1\)"),
        (Y[:-2], r"teacher.train_targets must have 20 entries"),
        (torch.where(torch.arange(20) == 3, torch.nan, Y), "teacher.train_targets must be finite"),
    ],
)
def test_a_teacher_with_bad_targets_is_refused(module, targets, message):
    with pytest.raises(ValueError, match=message):
        module(_teacher(X, targets))


def test_a_teacher_without_training_inputs_is_refused():
    with pytest.raises(ValueError, match="teacher.train_inputs.* at least one input"):
        PosteriorMean(_teacher(X[:0], Y[:0]))


def test_nan_test_inputs_are_refused():
    teacher = _teacher(X, Y)
    bad = X[:5].clone()
    bad[2] = torch.nan
    with pytest.raises(ValueError, match="x must be finite"):
        PosteriorMean(teacher)(bad)
    with pytest.raises(ValueError, match="x1 must be finite"):
        PosteriorKernel(teacher)(bad).to_dense()
    with pytest.raises(ValueError, match="x2 must be finite"):
        PosteriorKernel(teacher)(X[:5], bad).to_dense()


def test_a_good_teacher_still_gives_its_posterior():
    teacher = _teacher(X, Y)
    test_x = torch.linspace(0, 1, 7, dtype=DTYPE).unsqueeze(-1)
    with torch.no_grad(), gpytorch.settings.fast_computations(False, False, False):
        posterior = teacher(test_x)
        mean = PosteriorMean(teacher)(test_x)
    assert mean.shape == (7,)
    torch.testing.assert_close(mean, posterior.mean, rtol=1e-10, atol=1e-10)


def test_a_student_with_posterior_prior_modules_has_only_its_own_parameters(teacher):
    """The teacher's copies are buffers: an optimiser of the student never sees them, and
    ``state_dict`` still carries them."""
    x, y = teacher.train_inputs[0], teacher.train_targets
    likelihood = gpytorch.likelihoods.GaussianLikelihood().to(DTYPE)
    student = PlainGP(x, y, likelihood, PosteriorMean(teacher), PosteriorKernel(teacher))
    assert [name for name, _ in student.named_parameters()] == ["likelihood.noise_covar.raw_noise"]
    state = student.state_dict()
    assert "mean_module.prior_mean.weights" in state
    assert "covar_module.prior_covar.base_kernel.raw_lengthscale" in state
    # the copies are constants: a prediction carries no graph to them, and equals the teacher's
    with torch.no_grad(), exact_settings(), gpytorch.settings.fast_pred_var(False):
        x_new = x[:5] + 0.1
        torch.testing.assert_close(student.mean_module(x_new), teacher(x_new).mean)


@pytest.mark.parametrize("module", [PosteriorMean, PosteriorKernel])
def test_the_teacher_is_checked_as_kernel_distillation_checks_it(module, teacher):
    with pytest.raises(TypeError, match="teacher must be a gpytorch.models.ExactGP"):
        module(teacher.covar_module)
    empty = PlainGP(None, None, teacher.likelihood, teacher.mean_module, teacher.covar_module)
    with pytest.raises(ValueError, match="teacher has no training data"):
        module(empty)
    without_covar = PlainGP(
        *teacher.train_inputs,
        teacher.train_targets,
        teacher.likelihood,
        teacher.mean_module,
        teacher.covar_module,
    )
    del without_covar.covar_module
    with pytest.raises(ValueError, match="teacher.covar_module must be a gpytorch.kernels.Kernel"):
        module(without_covar)
