"""The Laplace classifiers at a short lengthscale, where most kernel entries are far below rounding.

On a CPU they set entries below eps^2 * max to zero before their matrix products (the x86 slow
path for subnormal numbers); sklearn, in numpy float64 with every entry kept, is the reference.
"""

import gpytorch
import numpy as np
import pytest
import torch
from sklearn.gaussian_process import GaussianProcessClassifier
from sklearn.gaussian_process.kernels import RBF, ConstantKernel

from gpsd.distillation.data_centric_gpc import DataCentricGPC
from gpsd.distillation.distribution_centric_gpc import DistributionCentricGPC
from gpsd.laplace import LaplaceGPClassifier

LENGTHSCALE, OUTPUTSCALE = 0.08, 3.0


@pytest.fixture(scope="module")
def problem():
    gen = np.random.default_rng(4)
    x = np.sort(gen.uniform(0, 12, 150))
    y = (np.sin(2 * x) + 0.3 * gen.standard_normal(150) > 0).astype(float)
    test_x = np.linspace(0, 12, 61)
    gpc = GaussianProcessClassifier(
        ConstantKernel(OUTPUTSCALE) * RBF(LENGTHSCALE), optimizer=None, max_iter_predict=500
    ).fit(x[:, None], y)
    base = gpc.base_estimator_
    K = base.kernel_(x[:, None])
    # the case at hand: entries that are positive yet negligible, many of them subnormal
    assert ((K > 0) & (K < np.finfo(float).eps ** 2 * K.max())).mean() > 0.1
    assert ((K > 0) & (K < np.finfo(float).tiny)).any()
    mean, var = base.latent_mean_and_variance(test_x[:, None])
    return x, y, test_x, base, mean, var


def _kernel(dtype):
    k = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).to(dtype)
    k.outputscale = torch.tensor(OUTPUTSCALE, dtype=dtype)
    k.base_kernel.lengthscale = torch.tensor(LENGTHSCALE, dtype=dtype)
    return k


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_laplace_classifier_matches_sklearn(problem, dtype):
    x, y, test_x, base, mean, var = problem
    tol = 1e-7 if dtype == torch.float64 else 2e-3  # float32: 5e-4 with or without dropping
    t = lambda a: torch.as_tensor(a, dtype=dtype)  # noqa: E731
    model = LaplaceGPClassifier(t(x), t(y), _kernel(dtype)).fit()
    np.testing.assert_allclose(model.mode.f.double().numpy(), base.f_cached, atol=tol)
    latent = model.predict_latent(t(test_x))
    m, v = latent.mean, latent.variance
    np.testing.assert_allclose(m.detach().double().numpy(), mean, atol=tol)
    np.testing.assert_allclose(v.detach().double().numpy(), var, atol=tol)
    lml = model.log_marginal_likelihood()
    assert float(lml.detach()) == pytest.approx(base.log_marginal_likelihood_value_, rel=tol)
    lml.backward()  # the gradient passes through the kept entries
    grads = [p.grad for p in model.covar_module.parameters()]
    assert all(g is not None and bool(torch.isfinite(g).all()) for g in grads)


def test_data_centric_first_step_matches_sklearn(problem):
    x, y, test_x, base, mean, var = problem
    t = lambda a: torch.as_tensor(a, dtype=torch.float64)  # noqa: E731
    model = DataCentricGPC(t(x), t(y), _kernel(torch.float64), num_steps=2).fit()
    np.testing.assert_allclose(model.latent_modes[0].numpy(), base.f_cached, atol=1e-7)
    latent = model.predict_latent(t(test_x), step=1)
    m, v = latent.mean, latent.variance
    np.testing.assert_allclose(m.numpy(), mean, atol=1e-7)
    np.testing.assert_allclose(v.numpy(), var, atol=1e-7)


def test_distribution_centric_first_step_matches_sklearn(problem):
    x, y, test_x, base, mean, var = problem
    t = lambda a: torch.as_tensor(a, dtype=torch.float64)  # noqa: E731
    model = DistributionCentricGPC(t(x), t(y), _kernel(torch.float64), num_steps=2).fit()
    latent = model.predict_latent(t(test_x), step=1)
    m, v = latent.mean, latent.variance
    np.testing.assert_allclose(m.numpy(), mean, atol=1e-7)
    np.testing.assert_allclose(v.numpy(), var, atol=1e-7)
