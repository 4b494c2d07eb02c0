"""Tests of ARDGPRegressor: predictions against scikit-learn, its kernel and its checks."""

import math

import gpytorch
import pytest
import torch
from dpkl_reference import noisy_sine_data

from gpsd.dpkl import (
    ARDGPRegressor,
)


def _data(n=12):
    torch.set_default_dtype(torch.float64)
    x = torch.randn(n, 3)
    return x, torch.sin(x[:, 0])


@pytest.mark.parametrize("value", ["1.0", True, torch.tensor([1.0, 2.0, 3.0])])
def test_ard_gp_names_a_bad_initial_lengthscale(value):
    # a string, a bool (not a lengthscale of 1.0) and a tensor of three lengthscales
    x, y = _data()
    with pytest.raises(ValueError, match="initial_lengthscale"):
        ARDGPRegressor(x, y, initial_lengthscale=value)


def test_numpy_and_tensor_scalars_are_still_accepted():
    np = pytest.importorskip("numpy")
    x, y = _data()
    ARDGPRegressor(x, y, initial_lengthscale=np.float32(1.5)).fit(max_iter=1, lr=np.float64(0.01))
    ARDGPRegressor(x, y, initial_lengthscale=torch.tensor(1.5)).fit(
        max_iter=1, lr=torch.tensor(0.01)
    )


def test_ard_gp_matches_sklearn():
    sklearn_gp = pytest.importorskip("sklearn.gaussian_process")
    kernels = pytest.importorskip("sklearn.gaussian_process.kernels")
    x, y = noisy_sine_data(n=25, d=3)
    model = ARDGPRegressor(x, y)
    ls = torch.tensor([0.8, 1.5, 2.2])
    model.covar_module.base_kernel.lengthscale = ls
    model.covar_module.outputscale = 1.4
    model.likelihood.noise = 0.05
    model.mean_module.constant.data.fill_(0.0)
    model.fit(max_iter=0)  # the hyperparameters set above
    xs = torch.randn(6, 3)
    pred = model.predict(xs)  # latent, as scikit-learn's std with alpha
    k = kernels.ConstantKernel(1.4, "fixed") * kernels.RBF(ls.numpy(), "fixed")
    sk = sklearn_gp.GaussianProcessRegressor(k, alpha=0.05, optimizer=None).fit(
        x.numpy(), y.numpy()
    )
    m_ref, s_ref = sk.predict(xs.numpy(), return_std=True)
    torch.testing.assert_close(pred.mean, torch.as_tensor(m_ref), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(pred.variance, torch.as_tensor(s_ref) ** 2, rtol=1e-5, atol=1e-6)
    model.fit(max_iter=10, lr=0.05)
    assert model.history["loss"][-1] < model.history["loss"][0]


def test_ard_regressor_without_input_columns_names_the_inputs():
    # the inputs are named, not the default lengthscale sqrt(0) derived from them
    with pytest.raises(ValueError, match="train_x must have at least one feature"):
        ARDGPRegressor(torch.randn(5, 0), torch.randn(5))


def test_ard_initial_lengthscale_is_not_rounded_to_float32():
    torch.set_default_dtype(torch.float32)
    x = torch.randn(10, 3, dtype=torch.float64)
    model = ARDGPRegressor(x, x[:, 0])
    lengthscale = model.covar_module.base_kernel.lengthscale
    assert lengthscale.dtype == torch.float64
    # sqrt(3) read as float32 would be 1.732050784259756
    assert (lengthscale - math.sqrt(3)).abs().max() < 1e-15


def test_a_covar_module_replaces_the_ard_kernel():
    x, y = _data()
    kernel = gpytorch.kernels.MaternKernel(nu=1.5)
    model = ARDGPRegressor(x, y, covar_module=kernel).fit(max_iter=2)
    assert model.covar_module is kernel
    with pytest.raises(ValueError, match="initial_lengthscale"):
        ARDGPRegressor(x, y, covar_module=kernel, initial_lengthscale=1.0)
    with pytest.raises(TypeError, match="covar_module"):
        ARDGPRegressor(x, y, covar_module=torch.nn.Linear(3, 1))
    default = ARDGPRegressor(x, y)
    assert default.covar_module.base_kernel.lengthscale.shape == (1, 3)  # one per input
