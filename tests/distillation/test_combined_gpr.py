"""CombinedGPR: against nested loops of refitted GPyTorch GPs with posterior priors, dense loops
written from the definition, and its two limits (data-centric and distribution-centric)."""

import warnings

import gpytorch
import pytest
import torch
from gpr_reference import PlainGP, exact_settings, rbf_kernel, relative_error
from gpytorch.constraints import GreaterThan
from gpytorch.utils.warnings import GPInputWarning

from gpsd import CombinedGPR, DataCentricGPR, DistributionCentricGPR
from gpsd.data import xsinx_regression
from gpsd.kernels import PosteriorKernel
from gpsd.means import PosteriorMean

DTYPE = torch.float64
GRID = [[0.3, 0.1], [0.7, 0.2], [0.5, 1.0]]  # outer_steps = 3, inner_steps = 2


@pytest.fixture
def problem():
    x, y = xsinx_regression(n=25, seed=2)
    return x.unsqueeze(-1), y, torch.linspace(-1.0, 11.0, 19, dtype=DTYPE).unsqueeze(-1)


def _constant_mean(value=-0.4):
    mean = gpytorch.means.ConstantMean().to(DTYPE)
    mean.constant.data.fill_(value)
    return mean


def nested_exact_gps(kernel, mean, x, y, grid, test_x, alpha=0.0):
    """The combined chain from its definition, as GPyTorch models: an outer loop whose prior is
    the previous outer step's last posterior (PosteriorMean, PosteriorKernel), around an inner loop
    that refits a fresh ExactGP to the previous inner step's fit, starting from ``y``.

    Returns (targets (T, N), test means (T, M), test variances (T, M)), outer step by outer step.
    """
    targets, means, variances = [], [], []
    prior_mean, prior_kernel = mean, kernel
    for row in grid:
        fitted_to = y
        for gamma in row:
            targets.append(fitted_to)
            likelihood = gpytorch.likelihoods.GaussianLikelihood(
                noise_constraint=GreaterThan(1e-6)
            ).to(DTYPE)
            likelihood.noise = gamma
            model = PlainGP(x, fitted_to, likelihood, prior_mean, prior_kernel).eval()
            with (
                torch.no_grad(),
                exact_settings(),
                gpytorch.settings.fast_pred_var(False),
                warnings.catch_warnings(),
            ):
                warnings.simplefilter("ignore", GPInputWarning)  # the training inputs: the point
                test_post = model(test_x)
                train_post = model(x)
            means.append(test_post.mean)
            variances.append(test_post.variance)
            fitted_to = alpha * y + (1 - alpha) * train_post.mean
        prior_mean, prior_kernel = PosteriorMean(model), PosteriorKernel(model)
    return tuple(torch.stack(v) for v in (targets, means, variances))


def dense_smoothers(k, grid, alpha=0.0):
    """The fit at the training inputs of every step as a matrix S_t (mu_t = S_t y, zero prior
    mean), from the definition by dense solves: the prior of each outer step is carried as the
    matrices of its mean (a linear map of y) and its covariance at the training inputs."""
    n = k.shape[-1]
    eye = torch.eye(n, dtype=k.dtype)
    prior_mean, prior_cov = torch.zeros_like(k), k
    out = []
    for row in grid:
        targets = eye
        for gamma in row:
            solve = torch.linalg.solve(
                prior_cov + gamma * eye, torch.cat([targets - prior_mean, prior_cov], -1)
            )
            fit = prior_mean + prior_cov @ solve[:, :n]
            out.append(fit)
            targets = alpha * eye + (1 - alpha) * fit
        prior_mean, prior_cov = fit, prior_cov - prior_cov @ solve[:, n:]
    return torch.stack(out)


# ---------------------------------------------------------------------------- the closed form


@pytest.mark.parametrize("alpha", [0.0, 0.3])
@pytest.mark.parametrize("backend", ["dense", "cholesky"])
def test_every_step_equals_nested_refitted_exact_gps_with_posterior_priors(problem, alpha, backend):
    x, y, test_x = problem
    mean = _constant_mean()
    model = CombinedGPR(
        x, y, rbf_kernel(), noise=GRID, mean_module=mean, alpha=alpha, backend=backend
    )
    want_targets, want_mean, want_var = nested_exact_gps(
        rbf_kernel(), _constant_mean(), x, y, torch.tensor(GRID, dtype=DTYPE), test_x, alpha
    )
    with torch.no_grad():
        got = model.predict(test_x)
        targets = model.step_targets()
    assert got.mean.shape == got.variance.shape == (6, 19)
    assert relative_error(got.mean, want_mean) < 1e-10
    assert relative_error(got.variance, want_var) < 1e-10
    assert relative_error(targets, want_targets) < 1e-10


@pytest.mark.parametrize("alpha", [0.0, 0.4])
def test_gcv_equals_the_dense_smoothers_of_the_definition(problem, alpha):
    x, y, _ = problem
    kernel = rbf_kernel()
    model = CombinedGPR(x, y, kernel, noise=GRID, alpha=alpha, backend="dense")
    with torch.no_grad():
        smoothers = dense_smoothers(kernel(x).to_dense(), GRID, alpha)
        fits = smoothers @ y
        n = y.shape[0]
        want = (
            n
            * (y - fits).square().sum(-1)
            / (n - smoothers.diagonal(dim1=-2, dim2=-1).sum(-1)) ** 2
        )
        got = model.gcv()
    assert relative_error(got, want) < 1e-10
    assert model.best_step() == int(want.argmin()) + 1


def test_effective_noise_is_the_precision_of_the_last_inner_steps_before_plus_its_own():
    grid = torch.tensor(GRID, dtype=DTYPE)
    model = CombinedGPR(
        torch.rand(5, 1, dtype=DTYPE), torch.rand(5, dtype=DTYPE), rbf_kernel(), noise=grid
    )
    want = []
    for o in range(3):
        before = sum(1.0 / float(grid[p, -1]) for p in range(o))
        want += [1.0 / (before + 1.0 / float(g)) for g in grid[o]]
    torch.testing.assert_close(
        model.effective_noise, torch.tensor(want, dtype=DTYPE), rtol=1e-14, atol=0
    )


def test_include_noise_adds_the_effective_noise(problem):
    x, y, test_x = problem
    model = CombinedGPR(x, y, rbf_kernel(), noise=GRID, backend="dense")
    with torch.no_grad():
        latent, noisy = model.predict(test_x), model.predict(test_x, include_noise=True)
    torch.testing.assert_close(
        noisy.variance - latent.variance, model.effective_noise.unsqueeze(-1).expand(6, 19)
    )


# ---------------------------------------------------------------------------- the two limits


@pytest.mark.parametrize("alpha", [0.0, 0.3])
def test_one_outer_step_is_data_centric_distillation(problem, alpha):
    x, y, test_x = problem
    gammas = [0.3, 0.1, 0.7, 0.2]
    mean = _constant_mean()
    combined = CombinedGPR(
        x, y, rbf_kernel(), noise=[gammas], mean_module=mean, alpha=alpha, backend="dense"
    )
    data = DataCentricGPR(
        x, y, rbf_kernel(), noise=gammas, mean_module=mean, alpha=alpha, backend="dense"
    )
    with torch.no_grad():
        a, b = (
            combined.predict(test_x, include_noise=True),
            data.predict(test_x, include_noise=True),
        )
        assert relative_error(a.mean, b.mean) < 1e-12
        assert relative_error(a.variance, b.variance) < 1e-12
        assert relative_error(combined.gcv(), data.gcv()) < 1e-12
        assert relative_error(combined.step_targets(), data.step_targets()) < 1e-12


def test_one_inner_step_is_distribution_centric_distillation(problem):
    x, y, test_x = problem
    gammas = [0.3, 0.1, 0.7, 0.2]
    mean = _constant_mean()
    combined = CombinedGPR(
        x, y, rbf_kernel(), noise=[[g] for g in gammas], mean_module=mean, backend="dense"
    )
    distribution = DistributionCentricGPR(
        x, y, rbf_kernel(), noise=gammas, mean_module=mean, backend="dense"
    )
    with torch.no_grad():
        a = combined.predict(test_x, include_noise=True)
        b = distribution.predict(test_x, include_noise=True)
        assert relative_error(a.mean, b.mean) < 1e-12
        assert relative_error(a.variance, b.variance) < 1e-12
        assert relative_error(combined.gcv(), distribution.gcv()) < 1e-12
    torch.testing.assert_close(combined.effective_noise, distribution.effective_noise)


# ---------------------------------------------------------------------------- batches, backends


def test_a_batch_of_schedules_equals_each_schedule_alone(problem):
    x, y, test_x = problem
    grids = torch.tensor([GRID, [[0.1, 0.1], [0.1, 0.1], [0.1, 0.1]]], dtype=DTYPE)  # (2, 3, 2)
    batch = CombinedGPR(x, y, rbf_kernel(), noise=grids, backend="dense")
    with torch.no_grad():
        every = batch.predict(test_x)
        scores = batch.gcv()
        assert every.mean.shape == (2, 6, 19) and scores.shape == (2, 6)
        for s in range(2):
            alone = CombinedGPR(x, y, rbf_kernel(), noise=grids[s], backend="dense")
            one = alone.predict(test_x)
            assert relative_error(every.mean[s], one.mean) < 1e-12
            assert relative_error(every.variance[s], one.variance) < 1e-12
            assert relative_error(scores[s], alone.gcv()) < 1e-12
    best = batch.best_step()
    assert best.shape == (2,)
    outer, inner = batch.grid_step(best)
    torch.testing.assert_close((outer - 1) * 2 + inner, best)


@pytest.mark.parametrize("backend", ["lanczos", "cg"])
def test_matrix_free_backends_agree_with_dense(problem, backend):
    x, y, test_x = problem
    grids = torch.tensor([GRID, [[0.1, 0.1], [0.1, 0.1], [0.1, 0.1]]], dtype=DTYPE)  # (2, 3, 2)
    kwargs = dict(noise=grids, alpha=0.2, mean_module=_constant_mean())
    dense = CombinedGPR(x, y, rbf_kernel(), backend="dense", **kwargs)
    other = CombinedGPR(x, y, rbf_kernel(), backend=backend, rtol=1e-8, **kwargs)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the advice to use dense on a matrix this small
        a, b = dense.predict(test_x), other.predict(test_x)
        targets, dense_targets = other.step_targets(), dense.step_targets()
        scores, errors, exact = other.gcv(), other.gcv_standard_error(), dense.gcv()
    assert b.mean.shape == (2, 6, 19)
    assert relative_error(b.mean, a.mean) < 1e-6
    assert relative_error(b.variance, a.variance) < 1e-6
    assert relative_error(targets, dense_targets) < 1e-6
    assert bool(((scores - exact).abs() <= 4 * errors + 1e-6 * exact).all())


def test_a_truncated_lanczos_spectrum_predicts_and_scores_as_the_dense_one():
    """A rank that leaves part of the spectrum to the filters' power series."""
    gen = torch.Generator().manual_seed(1)
    x = 10 * torch.rand(300, 1, generator=gen, dtype=DTYPE)
    y = torch.sin(x[:, 0]) + 0.1 * torch.randn(300, generator=gen, dtype=DTYPE)
    test_x = torch.linspace(0, 10, 23, dtype=DTYPE).unsqueeze(-1)
    grid = [[0.1, 0.3], [0.3, 0.2]]
    kernel = rbf_kernel(outputscale=1.0, lengthscale=1.0)
    with torch.no_grad():
        dense = CombinedGPR(x, y, kernel, noise=grid, alpha=0.2, backend="dense")
        model = CombinedGPR(x, y, kernel, noise=grid, alpha=0.2, backend="lanczos", rank=64)
        want, got = dense.predict(test_x), model.predict(test_x)
        assert model._current_fit().engine.is_truncated
        assert relative_error(got.mean, want.mean) < 1e-6
        assert relative_error(got.variance, want.variance) < 1e-6
        torch.testing.assert_close(model.gcv(), dense.gcv(), rtol=1e-6, atol=0)


# ---------------------------------------------------------------------------- students, steps


@pytest.mark.parametrize("step", [1, 2, 3, 6])
def test_student_is_an_ordinary_exact_gp_equal_to_its_step(problem, step):
    x, y, test_x = problem
    model = CombinedGPR(x, y, rbf_kernel(), noise=GRID, alpha=0.3, mean_module=_constant_mean())
    student = model.student(step)
    with torch.no_grad(), exact_settings(), gpytorch.settings.fast_pred_var(False):
        post = student(test_x)
        want = model.predict(test_x, step=step)
    assert isinstance(student.mean_module, gpytorch.means.ConstantMean)
    torch.testing.assert_close(student.likelihood.noise.squeeze(), model.effective_noise[step - 1])
    assert relative_error(post.mean, want.mean) < 1e-10
    assert relative_error(post.variance, want.variance) < 1e-10


def test_from_teacher_starts_at_the_teacher(problem):
    x, y, test_x = problem
    likelihood = gpytorch.likelihoods.GaussianLikelihood().to(DTYPE)
    likelihood.noise = 0.2
    teacher = PlainGP(x, y, likelihood, _constant_mean(), rbf_kernel()).eval()
    model = CombinedGPR.from_teacher(teacher, outer_steps=2, inner_steps=3)
    assert model.noise_grid.shape == (2, 3)
    with torch.no_grad(), exact_settings(), gpytorch.settings.fast_pred_var(False):
        post = teacher(test_x)
        first = model.predict(test_x, step=1)
    assert relative_error(first.mean, post.mean) < 1e-10
    assert relative_error(first.variance, post.variance) < 1e-10


def test_flat_and_grid_steps_convert_both_ways():
    model = CombinedGPR(
        torch.rand(4, 1, dtype=DTYPE),
        torch.rand(4, dtype=DTYPE),
        rbf_kernel(),
        noise=0.1,
        outer_steps=3,
        inner_steps=2,
    )
    pairs = [model.grid_step(t) for t in range(1, 7)]
    assert pairs == [(1, 1), (1, 2), (2, 1), (2, 2), (3, 1), (3, 2)]
    assert [model.flat_step(o, i) for o, i in pairs] == list(range(1, 7))
    with pytest.raises(ValueError, match="outer"):
        model.flat_step(4, 1)
    with pytest.raises(ValueError, match="step"):
        model.grid_step(7)
    with pytest.raises(ValueError, match="step"):
        model.grid_step(torch.tensor([0, 1]))


def test_differentiates_through_the_dense_backend_as_finite_differences(problem):
    x, y, test_x = problem

    def step_mean(outputscale):
        kernel = rbf_kernel()
        kernel.raw_outputscale.requires_grad_(False)
        kernel.outputscale = outputscale
        return (
            CombinedGPR(x, y, kernel, noise=GRID, alpha=0.2, backend="dense")
            .predict_mean(test_x)[4]
            .sum()
        )

    kernel = rbf_kernel()
    model = CombinedGPR(x, y, kernel, noise=GRID, alpha=0.2, backend="dense")
    model.predict_mean(test_x)[4].sum().backward()
    # d/d raw_outputscale = d/d outputscale * sigmoid'(raw) (softplus)
    grad = kernel.raw_outputscale.grad
    h = 1e-6
    with torch.no_grad():
        fd = (
            step_mean(torch.tensor(4.0 + h, dtype=DTYPE))
            - step_mean(torch.tensor(4.0 - h, dtype=DTYPE))
        ) / (2 * h)
    chain = torch.sigmoid(kernel.raw_outputscale.detach())
    torch.testing.assert_close(grad, fd * chain, rtol=1e-6, atol=1e-9)


# ---------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(noise=0.1), "outer_steps and inner_steps"),
        (dict(noise=0.1, outer_steps=2), "outer_steps and inner_steps"),
        (dict(noise=[0.1, 0.2]), r"grid of shape \(\*s, outer_steps, inner_steps\)"),
        (dict(noise=GRID, outer_steps=2), "outer_steps=2"),
        (dict(noise=GRID, inner_steps=3), "inner_steps=3"),
        (dict(noise=[[0.1, -0.2]]), "noise must hold finite numbers > 0 for CombinedGPR"),
        (dict(noise=[[0.1, float("nan")]]), "noise must hold finite numbers > 0 for CombinedGPR"),
        (dict(noise=0.1, outer_steps=0, inner_steps=2), "outer_steps must be a positive integer"),
        (dict(noise=0.1, outer_steps=2, inner_steps=1.5), "inner_steps must be a positive integer"),
        (dict(noise=GRID, alpha=1.0), r"alpha must lie in \[0, 1\)"),
    ],
)
def test_bad_arguments_are_named(problem, kwargs, message):
    x, y, _ = problem
    with pytest.raises(ValueError, match=message):
        CombinedGPR(x, y, rbf_kernel(), **kwargs)
