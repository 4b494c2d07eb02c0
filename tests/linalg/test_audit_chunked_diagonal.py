"""ChunkedKernelOperator against the dense kernel matrix for kernels that are not smooth at 0."""

import pytest
import torch
from gpytorch.kernels import MaternKernel, RBFKernel, ScaleKernel

from gpsd.linalg import ChunkedKernelOperator


def _kernels(dtype: torch.dtype):
    torch.manual_seed(0)
    batched = ScaleKernel(RBFKernel(batch_shape=torch.Size([2])), batch_shape=torch.Size([2]))
    batched.outputscale = torch.tensor([0.7, 1.9])
    return {
        "matern12": MaternKernel(nu=0.5),
        "scaled_matern12_ard": ScaleKernel(MaternKernel(nu=0.5, ard_num_dims=3)),
        "sum": ScaleKernel(RBFKernel()) + ScaleKernel(MaternKernel(nu=0.5)),
        "batched": batched,
    }


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", ["matern12", "scaled_matern12_ard", "sum", "batched"])
@pytest.mark.parametrize("cache_bytes", [0, 10**8])
def test_chunked_operator_matches_dense_kernel(dtype, name, cache_bytes):
    # Row chunks that are not the whole input (chunk_size 5 of N = 37, last chunk 2 rows)
    # evaluated k(x_i, x_i) from a rounding-size distance: the Matern-1/2 diagonal was
    # 1 - 4.2e-8 in float64 (1 - 1.4e-3 in float32) where kernel(x) and the exact value give 1,
    # and K @ B was off by 2e-8 (float32: 2e-3). Now both agree to rounding.
    kernel = _kernels(dtype)[name].to(dtype)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(37, 3, generator=gen, dtype=torch.float64).to(dtype)
    op = ChunkedKernelOperator(x, kernel=kernel, chunk_size=5, cache_bytes=cache_bytes)
    with torch.no_grad():
        dense = kernel(x).to_dense()  # shape: (*b, 37, 37)
        rhs = torch.randn(*dense.shape[:-1], 4, generator=gen, dtype=torch.float64).to(dtype)
        rtol = 1e-12 if dtype == torch.float64 else 2e-6
        scale = float(dense.abs().max())
        for _ in range(2):  # the second product reads the kept rows where cache_bytes > 0
            product = op @ rhs
            ref = (dense.double() @ rhs.double()).to(dtype)
            assert float((product - ref).abs().max()) <= rtol * scale * rhs.abs().sum(-2).max()
        chunked = op.to_dense()
        exact_diag = kernel(x, diag=True)  # shape: (*b, 37)
        assert float((chunked.diagonal(dim1=-2, dim2=-1) - exact_diag).abs().max()) <= (
            rtol * scale
        )
        assert float((chunked - dense).abs().max()) <= rtol * scale * 10


def test_diagonal_of_a_batched_kernel_on_as_many_points_as_batch_entries():
    # A ScaleKernel with batch shape (2,) on 2 unbatched points: GPyTorch's diag=True gave the
    # output scales, shape (2,), so the operator's diagonal was (0.7, 1.9) and its trace (what
    # KernelSpectrum.from_lanczos reads for its complement bound) 2.6 instead of (1.4, 3.8).
    kernel = ScaleKernel(RBFKernel(batch_shape=torch.Size([2])), batch_shape=torch.Size([2]))
    kernel = kernel.to(torch.float64)
    kernel.outputscale = torch.tensor([0.7, 1.9], dtype=torch.float64)
    x = torch.randn(2, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    op = ChunkedKernelOperator(x, kernel=kernel)
    with torch.no_grad():
        diagonal = op.diagonal(dim1=-2, dim2=-1)
    expected = torch.tensor([[0.7, 0.7], [1.9, 1.9]], dtype=torch.float64)  # outputscale * 1
    assert diagonal.shape == (2, 2)
    torch.testing.assert_close(diagonal, expected)
