"""Block Lanczos with a rank that is not a multiple of the block size: the last block is narrower
and the basis reaches every direction, as a dense eigendecomposition does."""

import gpytorch
import pytest
import torch

from gpsd import DataCentricGPR
from gpsd.linalg import KernelSpectrum

DT = torch.float64


def _kernel_matrix(n: int) -> torch.Tensor:
    x = torch.linspace(0, 10, n, dtype=DT).unsqueeze(-1)
    kernel = gpytorch.kernels.RBFKernel().to(DT)
    kernel.lengthscale = torch.tensor(0.8, dtype=DT)
    with torch.no_grad():
        return kernel(x).to_dense()


@pytest.mark.parametrize(("n", "block_size"), [(15, None), (37, 8), (10, 3)])
def test_full_rank_lanczos_resolves_every_eigenpair(n, block_size):
    # 15 inputs with the default blocks of 4 stopped at 12 columns: three eigenpairs were left
    # to the complement (norm 1.66 here), whose series diverged for noise 0.1
    K = _kernel_matrix(n)
    generator = torch.Generator().manual_seed(0)
    spectrum = KernelSpectrum.from_lanczos(
        K, rank=n, block_size=block_size, residual_tol=1e-9, generator=generator
    )
    ref = torch.linalg.eigvalsh(K).flip(-1)  # descending
    got = spectrum.eigenvalues.sort(descending=True).values
    assert got.shape[-1] >= n
    torch.testing.assert_close(got[:n], ref, rtol=0, atol=1e-10)
    assert spectrum.error_estimate(0.1) <= 1e-8


def test_data_centric_lanczos_at_fifteen_inputs_equals_the_dense_path():
    x = torch.linspace(0, 10, 15, dtype=DT).unsqueeze(-1)
    y = torch.sin(x).squeeze(-1)
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).to(DT)
    gamma = torch.linspace(0.1, 1.0, 5, dtype=DT)
    test_x = torch.linspace(-1, 11, 7, dtype=DT).unsqueeze(-1)
    with torch.no_grad():
        got = DataCentricGPR(x, y, kernel, noise=gamma, backend="lanczos").predict(test_x)
        ref = DataCentricGPR(x, y, kernel, noise=gamma, backend="dense").predict(test_x)
    torch.testing.assert_close(got.mean, ref.mean, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(got.variance, ref.variance, rtol=1e-9, atol=1e-12)
