"""The problems and models shared by the benchmarks."""

from __future__ import annotations

import time

import gpytorch
import torch
from torch import nn
from tqdm import tqdm


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


def ard_rbf_kernel(
    d: int, dtype: torch.dtype, device: torch.device, start: dict | None = None
) -> gpytorch.kernels.Kernel:
    """A scaled ARD RBF kernel on ``d`` inputs with unit lengthscales and outputscale, or the
    ``lengthscale`` (a list) and ``outputscale`` of ``start`` (:func:`pretrained_ard_rbf`)."""
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=d))
    kernel = kernel.to(device=device, dtype=dtype)
    lengthscale = torch.tensor(start["lengthscale"], dtype=dtype) if start else 1.0
    kernel.base_kernel.lengthscale = lengthscale
    kernel.outputscale = start["outputscale"] if start else 1.0
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


def pretrained_ard_rbf(
    train_x: torch.Tensor,
    train_y: torch.Tensor,
    size: int,
    iters: int,
    lr: float = 0.1,
    noise: float = 0.1,
    seed: int = 0,
    progress: bool = False,
) -> dict:
    """Wang et al.'s (2019) start for a large-N run: an ARD RBF kernel's lengthscales and
    outputscale and the noise, learnt on a random ``size``-point subset of the training set by
    ``iters`` Adam iterations (learning rate ``lr``) on GPyTorch's exact marginal likelihood
    (Cholesky, float64), from lengthscales 1, outputscale 1 and ``noise``. Returns the values
    as plain numbers (``lengthscale`` a list) and the ``seconds`` the iterations took."""
    device = train_x.device
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randperm(train_x.shape[0], generator=gen)[:size].to(device)
    x, y = train_x[rows].to(torch.float64), train_y[rows].to(torch.float64)
    kernel = ard_rbf_kernel(x.shape[-1], torch.float64, device)
    likelihood = gpytorch.likelihoods.GaussianLikelihood().to(device=device, dtype=torch.float64)
    likelihood.noise = noise
    model = ExactRegressor(x, y, likelihood, kernel)
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(likelihood, model)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    with gpytorch.settings.max_cholesky_size(x.shape[0]):
        for _ in tqdm(range(iters), desc="pretrain", disable=not progress):
            optimizer.zero_grad()
            loss = -mll(model(x), y)
            loss.backward()
            optimizer.step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return {
        "lengthscale": kernel.base_kernel.lengthscale.detach().reshape(-1).tolist(),
        "outputscale": float(kernel.outputscale.detach()),
        "noise": float(likelihood.noise.detach()),
        "seconds": time.perf_counter() - start,
    }
