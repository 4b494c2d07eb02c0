"""Tests of ChunkedKernel: an ExactGP with it equals one with the kernel it wraps (marginal
likelihood, gradients and predictions), without forming the training covariance."""

import gpytorch
import pytest
import torch

from gpsd.kernels import ChunkedKernel
from gpsd.linalg import ChunkedKernelOperator

DT = torch.float64


class GP(gpytorch.models.ExactGP):
    def __init__(self, x, y, covar_module):
        super().__init__(x, y, gpytorch.likelihoods.GaussianLikelihood())
        self.mean_module = gpytorch.means.ConstantMean()
        self.covar_module = covar_module

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def models(n=80):
    gen = torch.Generator().manual_seed(0)
    x = 3 * torch.rand(n, 2, generator=gen, dtype=DT)
    y = torch.sin(2 * x).sum(-1) + 0.1 * torch.randn(n, generator=gen, dtype=DT)
    plain = GP(x, y, gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())).to(DT)
    chunked = GP(x, y, ChunkedKernel(gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())))
    chunked = chunked.to(DT)
    chunked.covar_module.chunk_size = 16
    return x, y, plain, chunked


def loss_and_grads(model, x, y):
    model.train()
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(model.likelihood, model)
    loss = -mll(model(x), y)
    return loss, torch.autograd.grad(loss, list(model.parameters()))


def test_the_training_covariance_is_a_chunked_operator_and_cross_blocks_are_dense():
    x, _, _, chunked = models()
    kernel = chunked.covar_module
    with gpytorch.settings.lazily_evaluate_kernels(False):
        assert isinstance(kernel(x), ChunkedKernelOperator)
        assert isinstance(kernel(x, x[:5]).to_dense(), torch.Tensor)
    dense = kernel.base_kernel(x).to_dense()
    torch.testing.assert_close(kernel(x, x[:5]).to_dense(), dense[:, :5], rtol=1e-12, atol=0)
    torch.testing.assert_close(kernel(x, diag=True), dense.diagonal(), rtol=1e-12, atol=0)


@pytest.mark.parametrize("route", ["cholesky", "cg"])
def test_exact_marginal_likelihood_and_gradients_equal_the_plain_kernels(route):
    x, y, plain, chunked = models()
    n = x.shape[0]
    with (
        gpytorch.settings.max_cholesky_size(10_000 if route == "cholesky" else 0),
        gpytorch.settings.cg_tolerance(1e-12),
        gpytorch.settings.max_cg_iterations(10 * n),
        gpytorch.settings.max_preconditioner_size(n),
        gpytorch.settings.preconditioner_tolerance(1e-15),
        gpytorch.settings.min_preconditioning_size(1),
    ):
        loss, grads = loss_and_grads(chunked, x, y)
    with gpytorch.settings.max_cholesky_size(10_000):
        expected, expected_grads = loss_and_grads(plain, x, y)
    torch.testing.assert_close(loss, expected, rtol=1e-9, atol=1e-10)
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-7, atol=1e-8)


def test_predictions_in_eval_mode_equal_the_plain_kernels():
    x, _, plain, chunked = models()
    test_x = torch.rand(7, 2, dtype=DT, generator=torch.Generator().manual_seed(5))
    out = []
    for model in (plain, chunked):
        model.eval()
        with torch.no_grad(), gpytorch.settings.max_cholesky_size(10_000):
            prediction = model(test_x)
            out.append((prediction.mean, prediction.variance))
    torch.testing.assert_close(out[1][0], out[0][0], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out[1][1], out[0][1], rtol=1e-8, atol=1e-10)


def test_arguments_are_checked():
    with pytest.raises(TypeError, match="base_kernel must be a gpytorch.kernels.Kernel"):
        ChunkedKernel(torch.ones(3))
    with pytest.raises(ValueError, match="chunk_size"):
        ChunkedKernel(gpytorch.kernels.RBFKernel(), chunk_size=0)
    with pytest.raises(TypeError, match="process_group must be"):
        ChunkedKernel(gpytorch.kernels.RBFKernel(), process_group="world")


def test_float32_training_step_agrees_with_gpytorchs_own_float32_evaluation():
    """The matrix-free route in float32 (CG, probes, the closed-form RBF gradient accumulated
    in float64) against GPyTorch's formed float32 matrix on the same probe vectors."""
    x, y, plain, chunked = models(n=200)
    x, y = x.float(), y.float()
    results = []
    for model in (plain.float(), chunked.float()):
        model.set_train_data(x, y, strict=False)
        torch.manual_seed(0)
        with gpytorch.settings.max_cholesky_size(0), gpytorch.settings.cg_tolerance(1e-4):
            loss, grads = loss_and_grads(model, x, y)
        assert loss.dtype == torch.float32 and all(g.dtype == torch.float32 for g in grads)
        results.append((loss, grads))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-4, atol=1e-5)
    for got, want in zip(results[1][1], results[0][1], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-3)
