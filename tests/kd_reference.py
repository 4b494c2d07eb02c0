"""Shared data, kernels and teachers of the kernel-distillation tests."""

import gpytorch
import torch

from gpsd.kernel_distillation import KernelDistillation

DT = torch.float64


def reference_data(n=120, d=2, seed=0):
    """Gaussian inputs and noisy sines."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=gen, dtype=DT)
    y = torch.sin(2 * x).sum(-1) + 0.1 * torch.randn(n, generator=gen, dtype=DT)
    return x, y


def ard_kernel(d=2):
    """A scaled ARD RBF kernel, lengthscales 0.7 to 1.3, outputscale 1.5."""
    k = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=d)).to(DT)
    k.base_kernel.lengthscale = torch.linspace(0.7, 1.3, d, dtype=DT)
    k.outputscale = 1.5
    return k


def reference_distiller(n=120, m=20, b=5, **kw):
    """A distiller of :func:`ard_kernel` on :func:`reference_data`, noise 0.05."""
    x, y = reference_data(n)
    return KernelDistillation.from_data(
        x, y, ard_kernel(), noise=0.05, num_inducing=m, sparsity=b, **kw
    )


class Teacher(gpytorch.models.ExactGP):
    """An exact GP with :func:`ard_kernel` and a zero (or the given) mean."""

    def __init__(self, x, y, likelihood, mean=None):
        super().__init__(x, y, likelihood)
        self.mean_module = mean if mean is not None else gpytorch.means.ZeroMean()
        self.covar_module = ard_kernel(x.shape[-1] if x is not None else 2)

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def teacher_predictions(teacher, test_x):
    """The teacher's latent posterior mean and variance at ``test_x``."""
    teacher.eval()
    teacher.likelihood.eval()
    with torch.no_grad():
        post = teacher(test_x)
    return post.mean, post.variance


def unit_rbf(lengthscale, dtype=DT, ard_num_dims=None):
    """A scaled RBF kernel of outputscale 1."""
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=ard_num_dims))
    kernel = kernel.to(dtype)
    kernel.base_kernel.lengthscale = lengthscale
    kernel.outputscale = 1.0
    return kernel


def dense_unit_rbf(x1, x2, lengthscale):
    """The float64 RBF kernel of :func:`unit_rbf` from direct differences."""
    diff = (x1.to(DT).unsqueeze(-2) - x2.to(DT).unsqueeze(-3)) / lengthscale
    return torch.exp(-0.5 * diff.pow(2).sum(-1))


def offset_data(n=90, d=2, seed=0, offset=0.0):
    """Gaussian inputs and sines plus ``offset``, without noise."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=gen, dtype=DT)
    y = torch.sin(2 * x).sum(-1) + offset
    return x, y


def scaled_rbf():
    """GPyTorch's default scaled RBF kernel in float64."""
    return gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).to(DT)


#: 40 inputs on [0, 1] and a sine of them
LINE_X = torch.linspace(0, 1, 40, dtype=DT).unsqueeze(-1)
LINE_Y = torch.sin(6 * LINE_X).squeeze(-1)


def line_distiller(max_iter=5, **kwargs):
    """A distiller of :func:`scaled_rbf` on :data:`LINE_X`: m = 10, b = 3, noise 0.01."""
    return KernelDistillation.from_data(
        LINE_X, LINE_Y, scaled_rbf(), noise=0.01, num_inducing=10, sparsity=3,
        max_iter=max_iter, **kwargs,
    )  # fmt: skip


def sine_data(n=60, d=2, seed=0):
    """Gaussian inputs and sines, without noise."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=gen, dtype=DT)
    return x, torch.sin(2 * x).sum(-1)


def iso_kernel():
    """A scaled RBF kernel, lengthscale 0.8, outputscale 1.5."""
    k = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).to(DT)
    k.base_kernel.lengthscale = 0.8
    k.outputscale = 1.5
    return k


def mean_and_variance(prediction):
    """``(mean, variance)`` of a :class:`gpsd.Prediction`, to compare two field by field."""
    return prediction.mean, prediction.variance
