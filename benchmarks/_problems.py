"""The problems and models shared by the benchmarks."""

from __future__ import annotations

import gpytorch
import torch
from torch import nn


def uniform_square_problem(
    n: int, m: int, device: torch.device, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``n`` inputs uniform on [0, 10]^2, targets sin(x1) + sin(x2) + N(0, 0.3^2) noise, and
    ``m`` test inputs. Drawn on the CPU in float64, then moved, so every device and dtype sees
    the same points."""
    gen = torch.Generator().manual_seed(seed)
    x = 10 * torch.rand(n, 2, generator=gen, dtype=torch.float64)
    y = torch.sin(x).sum(-1) + 0.3 * torch.randn(n, generator=gen, dtype=torch.float64)
    test_x = 10 * torch.rand(m, 2, generator=gen, dtype=torch.float64)
    return x.to(device, dtype), y.to(device, dtype), test_x.to(device, dtype)


def rbf_kernel(
    lengthscale: float, device: torch.device, dtype: torch.dtype
) -> gpytorch.kernels.Kernel:
    """A scaled RBF kernel (outputscale 1) with the given lengthscale."""
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).to(device, dtype)
    kernel.base_kernel.lengthscale = torch.tensor(lengthscale, dtype=dtype, device=device)
    return kernel


def dpkl_network(d_in: int, latent: int = 2) -> nn.Module:
    """The D-100-50-50-d ReLU network of Jean et al. and Mallick et al. (the models cast it to
    the data's dtype)."""
    return nn.Sequential(
        nn.Linear(d_in, 100),
        nn.ReLU(),
        nn.Linear(100, 50),
        nn.ReLU(),
        nn.Linear(50, 50),
        nn.ReLU(),
        nn.Linear(50, latent),
    )


class ExactRegressor(gpytorch.models.ExactGP):
    """GPyTorch's ``ExactGP`` with the given kernel and a zero mean (``constant_mean``: a learnt
    constant): the model the benchmarks give GPyTorch's own loop."""

    def __init__(self, x, y, likelihood, kernel, constant_mean: bool = False):
        super().__init__(x, y, likelihood)
        means = gpytorch.means
        self.mean_module = means.ConstantMean() if constant_mean else means.ZeroMean()
        self.covar_module = kernel

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))
