"""Independent references for the regression distillers: refitted GPyTorch GPs, dense algebra."""

import warnings

import gpytorch
import torch
from gpytorch.utils.warnings import GPInputWarning


class PlainGP(gpytorch.models.ExactGP):
    def __init__(self, x, y, likelihood, mean, kernel):
        super().__init__(x, y, likelihood)
        self.mean_module = mean
        self.covar_module = kernel

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def explicit_targets(k, gammas, alpha=0.0):
    """F_t(K) for t = 1..T as explicit matrices, one dense solve per step:
    F_t = alpha I + (1 - alpha) K (K + g_t I)^-1 F_{t-1}, F_0 = I; shape (T, N, N)."""
    eye = torch.eye(k.shape[-1], dtype=k.dtype)
    f, out = eye, []
    for g in gammas:
        f = alpha * eye + (1 - alpha) * k @ torch.linalg.solve(k + g * eye, f)
        out.append(f)
    return torch.stack(out)


def exact_settings():
    """GPyTorch with Cholesky everywhere (no CG, no Lanczos variances)."""
    return gpytorch.settings.fast_computations(False, False, False)


def matern_teacher(dtype=torch.float64):
    """An exact GP in eval mode on 30 noisy sines in [0, 4]^2: a linear mean and a scaled ARD
    Matern kernel (lengthscales 0.7 and 1.3, outputscale 1.5), noise 0.05."""
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(30, 2, generator=gen, dtype=dtype) * 4
    y = torch.sin(x).sum(-1) + 0.1 * torch.randn(30, generator=gen, dtype=dtype)
    likelihood = gpytorch.likelihoods.GaussianLikelihood().to(dtype)
    likelihood.noise = 0.05
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(ard_num_dims=2)).to(dtype)
    kernel.base_kernel.lengthscale = torch.tensor([[0.7, 1.3]], dtype=dtype)
    kernel.outputscale = 1.5
    mean = gpytorch.means.LinearMean(2).to(dtype)
    mean.weights.data = torch.tensor([[0.3], [-0.2]], dtype=dtype)
    return PlainGP(x, y, likelihood, mean, kernel).eval()


def rbf_gram(x, lengthscale=1.0):
    """The unit-outputscale RBF Gram matrix of the points in the column ``x`` (shape (..., n, 1))."""
    return torch.exp(-0.5 * (x - x.mT).square() / lengthscale**2)


def random_rbf_matrix(n, lengthscale=1.0, seed=0, batch=()):
    """:func:`rbf_gram` of n float64 points drawn uniformly from [0, 10] (seeded)."""
    gen = torch.Generator().manual_seed(seed)
    x = 10 * torch.rand(*batch, n, 1, generator=gen, dtype=torch.float64)
    return rbf_gram(x, lengthscale)


def naive_data_centric(kernel, mean, x, y, gammas, test_x, alpha=0.0):
    """Refit a fresh exact GP on the previous step's mean predictions, step by step.

    Returns (targets (T, N), test means (T, M), test variances (T, M), train variances (T, N)),
    row ``t - 1`` for step ``t``; the targets are those step ``t`` is fitted to (``y`` for step 1).
    """
    targets, means, variances, train_vars = [], [], [], []
    prev = y
    for g in gammas:
        targets.append(prev)
        likelihood = gpytorch.likelihoods.GaussianLikelihood().to(x)
        likelihood.noise = g
        model = PlainGP(x, prev, likelihood, mean, kernel).eval()
        with (
            torch.no_grad(),
            exact_settings(),
            gpytorch.settings.fast_pred_var(False),
            warnings.catch_warnings(),
        ):
            # Predicting at the training inputs is the point here: the next step's targets.
            warnings.simplefilter("ignore", GPInputWarning)
            test_post = model(test_x)
            train_post = model(x)
        means.append(test_post.mean)
        variances.append(test_post.variance)
        train_vars.append(train_post.variance)
        prev = alpha * y + (1 - alpha) * train_post.mean
    return tuple(torch.stack(v) for v in (targets, means, variances, train_vars))


def dense_data_centric_means(kernel, x, y, gammas, test_x):
    """Data-centric means of every step by dense solves, with the kernel's autograd graph (any
    noise: no GaussianLikelihood lower bound); shape (T, M)."""
    k, ks = kernel(x).to_dense(), kernel(test_x, x).to_dense()
    eye = torch.eye(x.shape[0], dtype=k.dtype)
    means, targets = [], y
    for g in gammas:
        weights = torch.linalg.solve(k + g * eye, targets)
        means.append(ks @ weights)
        targets = k @ weights
    return torch.stack(means)


def rbf_kernel(outputscale=4.0, lengthscale=1.5, dtype=torch.float64, **kwargs):
    """A scaled RBF kernel whose hyperparameters are set in ``dtype`` (no float32 rounding)."""
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(**kwargs)).to(dtype)
    # a tensor in dtype: a Python float would pass through the default dtype (float32) first
    kernel.outputscale = torch.as_tensor(outputscale, dtype=dtype)
    kernel.base_kernel.lengthscale = torch.as_tensor(lengthscale, dtype=dtype)
    return kernel


def relative_error(a, b):
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max())


def matern_regression_problem():
    """150 inputs on [0, 10], targets sin(x), a float64 Matérn-3/2 kernel of lengthscale 1 (a
    slowly decaying spectrum) and 8 test inputs: ``(kernel, x, y, test_x)``."""
    gen = torch.Generator().manual_seed(0)
    x = 10 * torch.rand(150, 1, generator=gen, dtype=torch.float64)
    y = torch.sin(x[:, 0])
    kernel = gpytorch.kernels.MaternKernel(nu=1.5).double()
    kernel.lengthscale = torch.tensor(1.0, dtype=torch.float64)
    return kernel, x, y, 10 * torch.rand(8, 1, generator=gen, dtype=torch.float64)


def wiggly_data(n=300, seed=0):
    """n points uniform in [0, 10] (a column), sin(3x) plus noise of sd 0.05, and 77 test
    points spanning [0, 10]; float64."""
    gen = torch.Generator().manual_seed(seed)
    x = 10 * torch.rand(n, 1, generator=gen, dtype=torch.float64)
    y = torch.sin(3 * x.squeeze(-1)) + 0.05 * torch.randn(n, generator=gen, dtype=torch.float64)
    return x, y, torch.linspace(0, 10, 77, dtype=torch.float64).unsqueeze(-1)
