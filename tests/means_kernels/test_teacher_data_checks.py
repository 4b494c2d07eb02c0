"""PosteriorMean / PosteriorKernel check the teacher's data and the inputs they are given, as
DataCentricGPR.from_teacher does: a bad teacher used to give a mean of the wrong shape or NaN."""

import gpytorch
import pytest
import torch
from gpr_reference import PlainGP

from gpsd import DataCentricGPR, PosteriorKernel, PosteriorMean

DTYPE = torch.float64


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
