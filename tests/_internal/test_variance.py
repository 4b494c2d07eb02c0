"""Negative predictive variances: clamped at 0, with a warning where beyond rounding."""

import warnings

import gpytorch
import pytest
import torch
from gpr_reference import rbf_kernel
from gpytorch.utils.warnings import NumericalWarning

from gpsd._internal.variance import nonnegative_variance, warn_if_variance_error_large
from gpsd.data.toy import sine_classification
from gpsd.distillation.data_centric_gpc import DataCentricGPC
from gpsd.distillation.distribution_centric_gpc import DistributionCentricGPC
from gpsd.kernel_distillation import KernelDistillation
from gpsd.laplace import LaplaceGPClassifier


@pytest.mark.parametrize(
    "dtype, quiet, loud", [(torch.float64, -1e-9, -1e-4), (torch.float32, -1e-4, -1e-2)]
)
def test_rounding_is_clamped_quietly_and_more_is_reported(dtype, quiet, loud):
    scale = torch.tensor([2.0, 2.0, 2.0], dtype=dtype)
    values = torch.tensor([0.5, quiet * 2.0, 0.0], dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = nonnegative_variance(values, scale)
    assert torch.equal(out, torch.tensor([0.5, 0.0, 0.0], dtype=dtype))
    with pytest.warns(NumericalWarning, match=f"{-loud:.3g} times its prior variance"):
        out = nonnegative_variance(torch.tensor([0.5, loud * 2.0], dtype=dtype), scale[:2])
    assert torch.equal(out, torch.tensor([0.5, 0.0], dtype=dtype))


def _classification_data():
    x, y, test_x = sine_classification(30, seed=4)
    return x, y, rbf_kernel(outputscale=3.0, lengthscale=1.0), test_x


def _break_the_reduction(monkeypatch, module):
    """Make the latent predictive return a variance well below zero."""
    original = module.laplace_latent_predictive

    def broken(*args, **kwargs):
        mean, var = original(*args, **kwargs)
        return mean, var - 10.0

    monkeypatch.setattr(module, "laplace_latent_predictive", broken)


def test_laplace_classifier_reports_a_negative_variance(monkeypatch):
    import gpsd.laplace.laplace_posterior as module  # the classifier's predictive runs there

    x, y, kernel, test_x = _classification_data()
    model = LaplaceGPClassifier(x, y, kernel).fit()
    _break_the_reduction(monkeypatch, module)
    with pytest.warns(NumericalWarning, match="negative"):
        latent = model.predict_latent(test_x)
        _, var = latent.mean, latent.variance
    assert bool((var == 0).all())


def test_data_centric_classifier_reports_a_negative_variance(monkeypatch):
    import gpsd.distillation.data_centric_gpc as module

    x, y, kernel, test_x = _classification_data()
    model = DataCentricGPC(x, y, kernel, num_steps=2).fit()
    _break_the_reduction(monkeypatch, module)
    with pytest.warns(NumericalWarning, match="negative"):
        latent = model.predict_latent(test_x)
        _, var = latent.mean, latent.variance
    assert bool((var == 0).all())


def test_distribution_centric_classifier_reports_a_negative_variance():
    x, y, kernel, test_x = _classification_data()
    model = DistributionCentricGPC(x, y, kernel, num_steps=2).fit()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        latent = model.predict_latent(test_x)
        _, var = latent.mean, latent.variance
    assert bool((var > 0).all())
    for posterior in model._current_fit().steps.values():  # a corrupted fit: too large a reduction
        posterior.correction.mul_(100.0)
    with pytest.warns(NumericalWarning, match="negative"):
        latent = model.predict_latent(test_x)
        _, var = latent.mean, latent.variance
    assert bool((var >= 0).all()) and bool((var == 0).any())


def test_kernel_distillation_student_reports_a_negative_variance():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(80, 2, generator=gen, dtype=torch.float64)
    y = torch.sin(2 * x).sum(-1)
    kernel = gpytorch.kernels.RBFKernel().double()
    distiller = KernelDistillation.from_data(
        x, y, kernel, noise=0.05, num_inducing=15, sparsity=4, max_iter=2
    )
    student = distiller.fit().student
    test_x = torch.randn(10, 2, generator=gen, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        var = student.predict(test_x).variance
    assert bool((var > 0).all())
    student.predictive_covariance_correction.mul_(1e3)
    with pytest.warns(NumericalWarning, match="negative"):
        var = student.predict(test_x).variance
    assert bool((var >= 0).all())


def test_regression_distiller_reports_a_negative_variance():
    from gpsd import DataCentricGPR

    gen = torch.Generator().manual_seed(1)
    x = torch.rand(40, 1, generator=gen, dtype=torch.float64)
    y = torch.sin(6 * x.squeeze(-1))
    test_x = torch.rand(7, 1, generator=gen, dtype=torch.float64)
    model = DataCentricGPR(x, y, rbf_kernel(), noise=[0.1, 0.2], backend="dense")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        assert bool((model.predict(test_x).variance > 0).all())
        engine = model._current_fit().engine
        reduction = engine.quad_diag
        engine.quad_diag = lambda *args: 2 * reduction(*args) + 1.0  # a corrupted factorisation
    with torch.no_grad(), pytest.warns(NumericalWarning, match="negative"):
        variance = model.predict(test_x).variance
    assert bool((variance == 0).all())


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_an_error_bound_above_a_tenth_of_a_variance_is_reported(dtype):
    scale = torch.tensor([2.0, 2.0, 2.0], dtype=dtype)
    variance = torch.tensor([1.0, 1e-2, 0.0], dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # within 10 % of each variance, or below rounding of the prior variance (1e-6 * 2)
        warn_if_variance_error_large(variance, torch.tensor([0.09, 9e-4, 1e-6], dtype=dtype), scale)
    with pytest.warns(NumericalWarning, match="up to 2 times their value"):
        warn_if_variance_error_large(variance, torch.tensor([0.0, 2e-2, 0.0], dtype=dtype), scale)
    with pytest.warns(NumericalWarning, match="lower rtol"):  # a zero variance: vs its floor
        warn_if_variance_error_large(variance, torch.tensor([0.0, 0.0, 1e-3], dtype=dtype), scale)
