"""The GPC distillers with a float64 kernel on float32 data (the GPR distillers accept it)."""

import gpytorch
import pytest
import torch

from gpsd import DataCentricGPC, DistributionCentricGPC

N = 12


def _problem():
    gen = torch.Generator().manual_seed(5)
    x = 4 * torch.rand(N, 1, generator=gen)  # float32 data
    y = (torch.sin(2 * x[:, 0]) > 0).float()
    test_x = 4 * torch.rand(5, 1, generator=gen)
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).double()
    kernel.base_kernel.lengthscale = 0.7
    kernel.outputscale = 2.0
    return x, y, test_x, kernel


def _laplace_reference(kernel, x, y, test_x):
    """Step 1 (an ordinary logistic Laplace GPC) by Rasmussen & Williams, Algorithm 3.1/3.2, in
    float64 at the float32 inputs."""
    x, y, test_x = x.double(), y.double(), test_x.double()
    with torch.no_grad():
        K, Ks = kernel(x).to_dense(), kernel(test_x, x).to_dense()
        kss = kernel(test_x, diag=True)
    f = torch.zeros(N, dtype=torch.float64)
    for _ in range(100):
        pi = torch.sigmoid(f)
        sw = (pi * (1 - pi)).sqrt()
        L = torch.linalg.cholesky(torch.eye(N, dtype=torch.float64) + sw[:, None] * K * sw)
        b = sw**2 * f + (y - pi)
        a = b - sw * torch.cholesky_solve((sw * (K @ b))[:, None], L)[:, 0]
        f = K @ a
    pi = torch.sigmoid(f)
    sw = (pi * (1 - pi)).sqrt()
    L = torch.linalg.cholesky(torch.eye(N, dtype=torch.float64) + sw[:, None] * K * sw)
    v = torch.linalg.solve_triangular(L, sw[:, None] * Ks.T, upper=False)
    return Ks @ (y - pi), kss - v.square().sum(0)


@pytest.mark.parametrize(
    "build",
    [
        lambda x, y, k: DataCentricGPC(x, y, k, num_steps=2, noise=[0.0, 0.05]),
        lambda x, y, k: DistributionCentricGPC(x, y, k, num_steps=2),
        lambda x, y, k: DistributionCentricGPC(x, y, k, num_steps=2, method="scaled_kernel"),
    ],
)
def test_a_float64_kernel_on_float32_data(build):
    # fit() raised "expected m1 and m2 to have the same dtype, but got: double != float"; the
    # steps are now computed in the data's dtype, and step 1 matches the float64 reference.
    x, y, test_x, kernel = _problem()
    model = build(x, y, kernel).fit()
    latent = model.predict_latent(test_x, step=1)
    mean, var = latent.mean, latent.variance
    assert mean.dtype == var.dtype == torch.float32
    ref_mean, ref_var = _laplace_reference(kernel, x, y, test_x)
    torch.testing.assert_close(mean.double(), ref_mean, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(var.double(), ref_var, rtol=1e-4, atol=1e-4)
    proba = model.predict_proba(test_x)  # the last step, in float32 as well
    assert proba.dtype == torch.float32 and torch.isfinite(proba).all()
