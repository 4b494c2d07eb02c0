"""Kernel distillation, Appendix B (Fig. 3) of Song & Sun: a 1-D prediction example.

n = 1000 inputs from U(-10, 10), y = sin(x) exp(-x^2 / (2 * 5^2)) + eps, eps ~ N(0, 1). An exact GP
with an RBF kernel is trained (the teacher), then distilled with m = 100 inducing points and
sparsity b = 10; KISS-GP with 400 grid points is trained on the same data. Prints the error of
the predictive mean and variance of both against the exact GP and writes
``examples/output/kernel_distillation_1d.png``: the data and the exact GP, then the absolute error
of each approximation's predictive mean and variance against the exact GP along x (the three
predictive means themselves agree to within a line's width).

Run: ``python examples/kernel_distillation_1d.py``
"""

from __future__ import annotations

import os
import warnings

import gpytorch
import matplotlib
import torch

from gpsd.data import damped_sine_regression
from gpsd.kernel_distillation import KernelDistillation

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

OUTPUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "output")

warnings.filterwarnings("ignore", category=UserWarning)
DT = torch.float64


class Regressor(gpytorch.models.ExactGP):
    def __init__(self, x, y, likelihood, kernel):
        super().__init__(x, y, likelihood)
        self.mean_module = gpytorch.means.ZeroMean()
        self.covar_module = kernel

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def train(model, likelihood, x, y, iters):
    model.train()
    likelihood.train()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(likelihood, model)
    for _ in range(iters):
        opt.zero_grad()
        (-mll(model(x), y)).backward()
        opt.step()
    model.eval()
    likelihood.eval()


def main() -> None:
    torch.manual_seed(0)
    x, y = damped_sine_regression(1000, seed=0)
    test_x = torch.linspace(-10, 10, 400, dtype=DT).unsqueeze(-1)
    lik = gpytorch.likelihoods.GaussianLikelihood().to(DT)
    teacher = Regressor(x, y, lik, gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())).to(
        DT
    )
    with gpytorch.settings.max_cholesky_size(10**5):
        train(teacher, lik, x, y, 60)
        with torch.no_grad():
            post = teacher(test_x)
            exact_mean, exact_var = post.mean, post.variance

    distiller = KernelDistillation(teacher, num_inducing=100, sparsity=10, max_iter=20).fit()
    prediction = distiller.student.predict(test_x)
    kd_mean, kd_var = prediction.mean, prediction.variance

    kiss_lik = gpytorch.likelihoods.GaussianLikelihood().to(DT)
    kiss_kernel = gpytorch.kernels.ScaleKernel(
        gpytorch.kernels.GridInterpolationKernel(
            gpytorch.kernels.RBFKernel(), grid_size=400, num_dims=1
        )
    )
    kiss = Regressor(x, y, kiss_lik, kiss_kernel).to(DT)
    with gpytorch.settings.max_cholesky_size(0):
        train(kiss, kiss_lik, x, y, 60)
        with torch.no_grad(), gpytorch.settings.fast_pred_var():
            post = kiss(test_x)
            kiss_mean, kiss_var = post.mean, post.variance

    def rmse(a, b):
        return float((a - b).pow(2).mean().sqrt())

    print("## 1-D example (Appendix B, Fig. 3): error against the exact GP on 400 test points\n")
    print("| method | RMSE of mean | RMSE of variance |")
    print("|---|---|---|")
    print(
        f"| KISS-GP (400 grid points) | {rmse(kiss_mean, exact_mean):.2e} | {rmse(kiss_var, exact_var):.2e} |"
    )
    print(
        f"| distillation (m=100, b=10) | {rmse(kd_mean, exact_mean):.2e} | {rmse(kd_var, exact_var):.2e} |"
    )

    os.makedirs(OUTPUT, exist_ok=True)
    # The three predictive means agree to within the line width, so the figure shows the data and
    # the exact GP for orientation, then each approximation's error against the exact GP.
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    t = test_x.squeeze(-1)
    band = 1.959963984540054 * exact_var.sqrt()
    axes[0].scatter(x.squeeze(-1), y, s=2, c="0.7", label="1000 noisy observations")
    axes[0].plot(t, exact_mean, "k-", label="exact GP: mean")
    axes[0].fill_between(t, exact_mean - band, exact_mean + band, color="k", alpha=0.15,
                         label="exact GP: 95 % interval of f")  # fmt: skip
    axes[0].plot(t, torch.sin(t) * torch.exp(-t.square() / 50), "C2--", label="truth")
    axes[0].set_ylim(-1.5, 1.5)
    axes[0].set_xlabel("input x")
    axes[0].set_ylabel("y")
    axes[0].set_title("(a) data and the exact GP (the teacher)")
    axes[0].legend(fontsize=7, loc="lower left")
    for ax, got, exact, what in (
        (axes[1], (kiss_mean, kd_mean), exact_mean, "mean"),
        (axes[2], (kiss_var, kd_var), exact_var, "variance"),
    ):
        for value, label, style in zip(
            got,
            ("KISS-GP (400 grid points)", "distillation (m = 100, b = 10)"),
            ("C0-", "C3-"),
            strict=True,
        ):
            error = (value - exact).abs()
            ax.semilogy(t, error, style, lw=1, label=f"{label}: RMSE {rmse(value, exact):.1e}")
        ax.set_xlabel("input x")
        ax.set_ylabel(f"|predictive {what} − exact GP's {what}|")
        ax.set_title(f"({'b' if what == 'mean' else 'c'}) error of the predictive {what}")
        ax.legend(fontsize=7)
    fig.suptitle(
        "damped sine, n = 1000: y = sin(x) exp(-x²/50) + N(0, 1) noise, x ~ U(-10, 10); "
        "400 test points",
        fontsize=10,
    )
    fig.tight_layout()
    path = os.path.join(OUTPUT, "kernel_distillation_1d.png")
    fig.savefig(path, dpi=110)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
