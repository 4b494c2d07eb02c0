"""Tests of the RBF kernel rows evaluated by one matrix product and an exponential: against an
independent formula (cdist), the kernels that take GPyTorch's path instead, and the chunked
operator's products through them."""

import pytest
import torch
from gpytorch.kernels import MaternKernel, RBFKernel, ScaleKernel

from gpsd.linalg import ChunkedKernelOperator
from gpsd.linalg._rbf_rows import RBFRows


def _scaled_rbf(lengthscale, outputscale, dtype, ard=None):
    kernel = ScaleKernel(RBFKernel(ard_num_dims=ard)).to(dtype)
    kernel.base_kernel.lengthscale = torch.as_tensor(lengthscale, dtype=dtype)
    kernel.outputscale = torch.tensor(outputscale, dtype=dtype)
    return kernel


def _reference(x, lengthscale, outputscale):
    """s exp(-|(x - x') / l|^2 / 2) from the differences themselves, in float64: no GPyTorch
    code, and no expansion of the square (whose cancellation far from the origin is what the
    rows' centring must avoid)."""
    z = x.double() / torch.as_tensor(lengthscale, dtype=torch.float64)
    squared = (z.unsqueeze(-2) - z.unsqueeze(-3)).square().sum(-1)
    return outputscale * torch.exp(-0.5 * squared)


@pytest.mark.parametrize(
    ("dtype", "rtol"), [(torch.float64, 1e-12), (torch.float32, 2e-5)], ids=["f64", "f32"]
)
@pytest.mark.parametrize(
    ("lengthscale", "ard"), [(0.8, None), ([[0.5, 2.0, 1.3]], 3)], ids=["iso", "ard"]
)
@pytest.mark.parametrize("offset", [0.0, 1000.0], ids=["origin", "far"])
def test_rows_equal_the_kernel_formula_to_rounding(dtype, rtol, lengthscale, ard, offset):
    gen = torch.Generator().manual_seed(0)
    x = (offset + 4 * torch.rand(60, 3, generator=gen, dtype=torch.float64)).to(dtype)
    kernel = _scaled_rbf(lengthscale, 1.7, dtype, ard)
    rows = RBFRows.for_kernel(kernel, x)
    block = rows.block(10, 35)
    expected = _reference(x, lengthscale, 1.7)[10:35]
    assert block.shape == (25, 60) and block.dtype == dtype
    assert float((block.double() - expected).abs().max()) <= rtol * 1.7


def test_a_plain_rbf_kernel_has_outputscale_one():
    x = torch.rand(20, 2, dtype=torch.float64)
    kernel = RBFKernel().to(torch.float64)
    kernel.lengthscale = torch.tensor(0.3, dtype=torch.float64)
    block = RBFRows.for_kernel(kernel, x).block(0, 20)
    torch.testing.assert_close(block, _reference(x, 0.3, 1.0), rtol=1e-12, atol=1e-12)


class _WiderRBF(RBFKernel):
    def forward(self, x1, x2, **params):
        return super().forward(2 * x1, 2 * x2, **params)


def _replaced_forward():
    kernel = RBFKernel().double()
    kernel.forward = lambda x1, x2, **params: RBFKernel.forward(kernel, x1, x2, **params)
    return kernel


@pytest.mark.parametrize(
    "make",
    [
        lambda: MaternKernel().double(),
        lambda: ScaleKernel(MaternKernel()).double(),
        lambda: _WiderRBF().double(),
        lambda: RBFKernel(active_dims=[0]).double(),
        lambda: ScaleKernel(RBFKernel(), active_dims=[1]).double(),
        lambda: RBFKernel(batch_shape=torch.Size([2])).double(),
        lambda: ScaleKernel(RBFKernel(), batch_shape=torch.Size([2])).double(),
        _replaced_forward,
    ],
    ids=[
        "matern",
        "scaled-matern",
        "subclass",
        "active-dims",
        "scale-active-dims",
        "batched",
        "batched-scale",
        "replaced-forward",
    ],
)
def test_other_kernels_take_gpytorchs_path(make):
    assert RBFRows.for_kernel(make(), torch.rand(10, 2, dtype=torch.float64)) is None


def test_batched_inputs_take_gpytorchs_path():
    kernel = RBFKernel().double()
    assert RBFRows.for_kernel(kernel, torch.rand(2, 10, 2, dtype=torch.float64)) is None


@pytest.mark.parametrize("cache_bytes", [0, 10**7])
def test_the_chunked_operator_multiplies_rbf_rows_without_gpytorchs_forward(
    cache_bytes, monkeypatch
):
    gen = torch.Generator().manual_seed(1)
    x = 5 * torch.rand(90, 2, generator=gen, dtype=torch.float64)
    rhs = torch.randn(90, 4, generator=gen, dtype=torch.float64)
    kernel = _scaled_rbf(0.6, 2.5, torch.float64)
    expected = _reference(x, 0.6, 2.5) @ rhs

    forward = RBFKernel.forward

    def refuse(self, x1, x2, diag=False, **kwargs):
        if not diag:  # the diagonal k(x_i, x_i) is GPyTorch's, as the dense kernel(x) has it
            raise AssertionError("GPyTorch's RBF forward evaluated a block of rows")
        return forward(self, x1, x2, diag=diag, **kwargs)

    op = ChunkedKernelOperator(x, covar_module=kernel, chunk_size=32, cache_bytes=cache_bytes)
    with torch.no_grad():
        monkeypatch.setattr(RBFKernel, "forward", refuse)
        with pytest.raises(AssertionError, match="forward evaluated"):  # the patch is live
            kernel(x[:3], x).to_dense()
        products = [op @ rhs for _ in range(2)]
        block_of_rows = (
            ChunkedKernelOperator(x, covar_module=kernel, chunk_size=16, rows=slice(20, 70)) @ rhs
        )
    for product in products:
        torch.testing.assert_close(product, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(block_of_rows, expected[20:70], rtol=1e-12, atol=1e-12)
