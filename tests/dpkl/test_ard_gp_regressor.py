"""Tests of ARDGPRegressor."""

import math

import pytest
import torch

from gpsd.dpkl import (
    ARDGPRegressor,
)


def _data(n=12):
    torch.set_default_dtype(torch.float64)
    x = torch.randn(n, 3)
    return x, torch.sin(x[:, 0])


@pytest.mark.parametrize("value", ["1.0", True, torch.tensor([1.0, 2.0, 3.0])])
def test_ard_gp_names_a_bad_initial_lengthscale(value):
    # "1.0" gave TypeError('must be real number, not str'); a tensor of three lengthscales
    # gave ValueError('only one element tensors can be converted to Python scalars'); True
    # was taken as a lengthscale of 1.0
    x, y = _data()
    with pytest.raises(ValueError, match="initial_lengthscale"):
        ARDGPRegressor(x, y, initial_lengthscale=value)


def test_numpy_and_tensor_scalars_are_still_accepted():
    np = pytest.importorskip("numpy")
    x, y = _data()
    ARDGPRegressor(x, y, initial_lengthscale=np.float32(1.5)).fit(1, lr=np.float64(0.01))
    ARDGPRegressor(x, y, initial_lengthscale=torch.tensor(1.5)).fit(1, lr=torch.tensor(0.01))


def _data_m(n=30, d=4):
    torch.set_default_dtype(torch.float64)
    x = torch.randn(n, d)
    y = torch.sin(x[:, 0]) + 0.1 * torch.randn(n)
    return x, y


def test_ard_gp_matches_sklearn():
    sklearn_gp = pytest.importorskip("sklearn.gaussian_process")
    kernels = pytest.importorskip("sklearn.gaussian_process.kernels")
    x, y = _data_m(n=25, d=3)
    model = ARDGPRegressor(x, y)
    ls = torch.tensor([0.8, 1.5, 2.2])
    model.covar_module.base_kernel.lengthscale = ls
    model.covar_module.outputscale = 1.4
    model.likelihood.noise = 0.05
    model.mean_module.constant.data.fill_(0.0)
    xs = torch.randn(6, 3)
    mean, var = model.predict(xs, include_noise=False)
    k = kernels.ConstantKernel(1.4, "fixed") * kernels.RBF(ls.numpy(), "fixed")
    sk = sklearn_gp.GaussianProcessRegressor(k, alpha=0.05, optimizer=None).fit(
        x.numpy(), y.numpy()
    )
    m_ref, s_ref = sk.predict(xs.numpy(), return_std=True)
    torch.testing.assert_close(mean, torch.as_tensor(m_ref), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(var, torch.as_tensor(s_ref) ** 2, rtol=1e-5, atol=1e-6)
    hist = model.fit(num_steps=10, lr=0.05)
    assert hist["loss"][-1] < hist["loss"][0]


def test_ard_regressor_without_input_columns_names_the_inputs():
    # Before: "initial_lengthscale must be a positive float, got 0.0".
    with pytest.raises(ValueError, match="train_x must have at least one feature"):
        ARDGPRegressor(torch.randn(5, 0), torch.randn(5))


def test_ard_initial_lengthscale_is_not_rounded_to_float32():
    torch.set_default_dtype(torch.float32)
    x = torch.randn(10, 3, dtype=torch.float64)
    model = ARDGPRegressor(x, x[:, 0])
    lengthscale = model.covar_module.base_kernel.lengthscale
    assert lengthscale.dtype == torch.float64
    # was 1.732050784259756, sqrt(3) read as float32
    assert (lengthscale - math.sqrt(3)).abs().max() < 1e-15
