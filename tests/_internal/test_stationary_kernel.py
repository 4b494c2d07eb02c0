"""Tests of the plain-tensor stationary kernels against float64 references."""

import gpytorch
import pytest
import torch

from gpsd._internal.stationary_kernel import (
    STATIONARY_KERNEL_TYPES,
    evaluate_kernel,
    stationary_kernel_block,
    stationary_kernel_from_squared_distance,
    stationary_kernel_parameters,
)


@pytest.mark.parametrize("n", [300, 5000])  # 5000 x 300 products go in row blocks on a CPU
def test_affine_squared_distances_round_once_to_float32(n):
    from gpsd._internal.stationary_kernel import affine_squared_distances

    gen = torch.Generator().manual_seed(0)
    x = 100.0 + 10.0 * torch.rand(n, 3, generator=gen)  # far from the origin: hard for ||x||^2
    z = x[:300]
    lengthscale = torch.tensor([0.2, 0.5, 1.0])
    exact = torch.cdist(x.double() / lengthscale.double(), z.double() / lengthscale.double())
    exact = exact.square()  # shape: (n, 300); cdist's differences are exact here in float64
    r2 = affine_squared_distances(x, z, lengthscale)
    assert r2.dtype == torch.float32
    assert float(r2.diagonal().max()) < 1e-12  # the points themselves: float64 rounding only
    off = exact > 0
    rel = ((r2.double() - exact).abs() / exact)[off]
    assert float(rel.max()) < 4 * torch.finfo(torch.float32).eps
    offset = torch.tensor(0.3)
    e = affine_squared_distances(x, z, lengthscale, -0.5, offset)
    torch.testing.assert_close(e.double(), (0.3 - 0.5 * exact), rtol=2e-7, atol=2e-7)


def _direct(kind, x1, x2, lengthscale, outputscale):
    """The kernel in float64 from direct differences and the textbook formulas."""
    diff = (x1.double().unsqueeze(-2) - x2.double().unsqueeze(-3)) / lengthscale.double()
    r = diff.pow(2).sum(-1).sqrt()
    if kind == "rbf":
        return outputscale * torch.exp(-0.5 * r**2)
    if kind == "matern12":
        return outputscale * torch.exp(-r)
    if kind == "matern32":
        return outputscale * (1 + 3**0.5 * r) * torch.exp(-(3**0.5) * r)
    return outputscale * (1 + 5**0.5 * r + 5 * r**2 / 3) * torch.exp(-(5**0.5) * r)


def _scaled(kind, lengthscale, outputscale, dtype):
    base = (
        gpytorch.kernels.RBFKernel(ard_num_dims=2)
        if kind == "rbf"
        else gpytorch.kernels.MaternKernel(
            nu={"matern12": 0.5, "matern32": 1.5, "matern52": 2.5}[kind], ard_num_dims=2
        )
    )
    kernel = gpytorch.kernels.ScaleKernel(base).to(dtype)
    kernel.base_kernel.lengthscale = lengthscale.to(dtype)
    kernel.outputscale = outputscale
    return kernel


@pytest.mark.parametrize("kind", STATIONARY_KERNEL_TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_evaluate_kernel_equals_the_direct_formula(kind, dtype):
    gen = torch.Generator().manual_seed(0)
    x1 = (3 * torch.rand(70, 2, generator=gen, dtype=torch.float64)).to(dtype)
    x2 = (3 * torch.rand(40, 2, generator=gen, dtype=torch.float64)).to(dtype)
    lengthscale = torch.tensor([0.4, 0.9], dtype=torch.float64)
    kernel = _scaled(kind, lengthscale, 1.7, dtype)
    params = stationary_kernel_parameters(kernel)
    assert params[0] == kind
    torch.testing.assert_close(params[1].double(), lengthscale.to(dtype).double())
    got = evaluate_kernel(kernel, x1, x2)
    assert got.dtype == dtype and got.shape == (70, 40)
    # the kernel's own outputscale: GPyTorch's setter rounds 1.7 through float32
    outputscale = params[2].double()
    want = _direct(kind, x1, x2, params[1], outputscale)
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
    r2 = ((x1.double().unsqueeze(-2) - x2.double().unsqueeze(-3)) / params[1].double()).pow(2)
    from_r2 = stationary_kernel_from_squared_distance(kind, r2.sum(-1), outputscale)
    torch.testing.assert_close(from_r2, want, rtol=1e-12, atol=1e-12)


class _WiderRBF(gpytorch.kernels.RBFKernel):
    def forward(self, x1, x2, **params):
        return super().forward(2 * x1, 2 * x2, **params)


class _DoubledScale(gpytorch.kernels.ScaleKernel):
    def forward(self, x1, x2, **params):
        return 2 * super().forward(x1, x2, **params)


def _replaced_forward():
    kernel = gpytorch.kernels.RBFKernel()
    kernel.forward = lambda x1, x2, **params: (
        3 * gpytorch.kernels.RBFKernel.forward(kernel, x1, x2, **params)
    )
    return kernel


@pytest.mark.parametrize(
    "kernel",
    [
        gpytorch.kernels.PeriodicKernel(),
        gpytorch.kernels.RBFKernel(active_dims=[0]),
        gpytorch.kernels.RBFKernel(batch_shape=torch.Size([2])),
        gpytorch.kernels.ScaleKernel(gpytorch.kernels.RQKernel()),
        gpytorch.kernels.RBFKernel() + gpytorch.kernels.LinearKernel(),
        _WiderRBF(),
        _DoubledScale(gpytorch.kernels.RBFKernel()),
        _replaced_forward(),
    ],
    ids=[
        "periodic",
        "active-dims",
        "batch",
        "scaled-rq",
        "sum",
        "rbf-subclass",
        "scale-subclass",
        "replaced-forward",
    ],
)
def test_other_kernels_are_left_to_gpytorch(kernel):
    assert stationary_kernel_parameters(kernel) is None
    x = torch.randn(6, 1, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    kernel = kernel.double()
    assert stationary_kernel_block(kernel, x, x) is None
    if not kernel.batch_shape:
        with torch.no_grad():
            want = kernel(x, x).to_dense()
        torch.testing.assert_close(evaluate_kernel(kernel, x, x), want)
