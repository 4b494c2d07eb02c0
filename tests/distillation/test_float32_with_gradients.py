"""float32 data with gradients enabled (the default outside ``torch.no_grad()``): the kernel
matrix and the test covariances are evaluated in ``linalg_dtype`` through differentiable casts
of the hyperparameters. They used to be evaluated in float32 to keep the graph, which left the
means 14 % (one step) to 58 % (three steps) off at gamma = 1e-6, N = 40, without a warning;
``linalg_dtype=None`` (float32 throughout) now warns where its rounding can cost that much."""

import warnings

import gpytorch
import pytest
import torch
from gpr_reference import dense_data_centric_means
from gpytorch.utils.warnings import NumericalWarning

from gpsd import DataCentricGPR, DistributionCentricGPR

X = torch.linspace(0, 10, 40).unsqueeze(-1)  # float32
Y = torch.sin(X.squeeze(-1)) + 0.1 * torch.randn(40, generator=torch.Generator().manual_seed(0))
TEST_X = torch.linspace(0.3, 9.7, 8).unsqueeze(-1)
GAMMA = [1e-6, 1e-6, 1e-6]


def _kernel(dtype=torch.float32):
    return gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).to(dtype)


def _reference_means():
    """The three data-centric steps by dense float64 solves on the float32-rounded data."""
    with torch.no_grad():
        return dense_data_centric_means(
            _kernel(torch.float64), X.double(), Y.double(), GAMMA, TEST_X.double()
        )


@pytest.mark.parametrize("backend", ["dense", "cholesky", "auto"])
def test_float32_means_with_gradients_enabled_are_float64_accurate(backend):
    model = DataCentricGPR(X, Y, _kernel(), noise=GAMMA, backend=backend)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NumericalWarning)
        mean = model.predict(TEST_X).mean
    assert mean.requires_grad and mean.dtype == torch.float32
    expected = _reference_means()
    torch.testing.assert_close(mean.detach().double(), expected, rtol=0, atol=1e-6)


def test_gradients_of_float32_hyperparameters_equal_the_float64_models():
    models = {
        dtype: DataCentricGPR(X.to(dtype), Y.to(dtype), _kernel(dtype), noise=[0.01, 0.02])
        for dtype in (torch.float32, torch.float64)
    }
    grads = {}
    for dtype, model in models.items():
        path = model.predict(TEST_X.to(dtype))
        loss = path.mean.square().sum() + path.variance.sum() + model.gcv().sum()
        params = [
            model.covar_module.raw_outputscale,
            model.covar_module.base_kernel.raw_lengthscale,
        ]
        grads[dtype] = torch.stack([g.sum() for g in torch.autograd.grad(loss, params)])
    assert grads[torch.float32].dtype == torch.float32
    torch.testing.assert_close(
        grads[torch.float32].double(), grads[torch.float64], rtol=2e-5, atol=0
    )


@pytest.mark.parametrize("cls", [DataCentricGPR, DistributionCentricGPR])
def test_float32_factorisation_warns_where_its_rounding_matters(cls):
    model = cls(X, Y, _kernel(), noise=[1e-6], backend="cholesky", linalg_dtype=None)
    with torch.no_grad(), pytest.warns(NumericalWarning, match="factored in torch.float32"):
        model.predict_mean(TEST_X)
    fine = cls(X, Y, _kernel(), noise=[0.1], backend="cholesky", linalg_dtype=None)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", NumericalWarning)
        fine.predict_mean(TEST_X)


def test_a_submodule_used_twice_keeps_its_parameter_and_its_gradient():
    # torch.func.functional_call swapped the shared submodule twice and left a float64 non-leaf
    # tensor in place of the parameter: training silently stopped updating it
    rbf = gpytorch.kernels.RBFKernel()
    kernel = gpytorch.kernels.AdditiveKernel(rbf, gpytorch.kernels.ScaleKernel(rbf))
    model = DataCentricGPR(X, Y, kernel, noise=[0.01, 0.02], backend="cholesky")
    loss = model.predict(TEST_X).mean.square().sum()
    loss.backward()
    param = rbf.raw_lengthscale
    assert isinstance(param, torch.nn.Parameter) and param.is_leaf
    assert param.dtype == torch.float32 and param.grad.dtype == torch.float32
    # the same model in float64 (one shared copy of the submodule there too)
    rbf64 = gpytorch.kernels.RBFKernel().double()
    kernel64 = gpytorch.kernels.AdditiveKernel(rbf64, gpytorch.kernels.ScaleKernel(rbf64))
    with torch.no_grad():
        rbf64.raw_lengthscale.copy_(param.double())
    model64 = DataCentricGPR(
        X.double(), Y.double(), kernel64, noise=[0.01, 0.02], backend="cholesky"
    )
    model64.predict(TEST_X.double()).mean.square().sum().backward()
    torch.testing.assert_close(param.grad.double(), rbf64.raw_lengthscale.grad, rtol=1e-5, atol=0)


def test_buffers_a_kernel_creates_in_the_call_keep_its_dtype():
    kernel = gpytorch.kernels.RFFKernel(num_samples=20)
    model = DataCentricGPR(X, Y, kernel, noise=[0.1], backend="dense")
    model.predict(TEST_X)  # gradients enabled: the cast path draws RFFKernel's weights
    assert kernel.randn_weights.dtype == torch.float32
    assert kernel(TEST_X).to_dense().dtype == torch.float32  # a plain float32 call still works
