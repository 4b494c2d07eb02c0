"""Self-distillation of GP regression: Borup & Andersen's Fig. 3, the GCV path, and real data.

Run with no arguments:

    python examples/regression_self_distillation.py

1. The toy setting of §3.3: g(z) = z sin z, 10 equally spaced inputs on [0, 10], N(0, 1) noise, a
   scaled RBF kernel with fixed hyperparameters and noise = (0.1, 0.2, ..., 1.0). Ten steps of
   data-centric and distribution-centric distillation, each step's mean and 2.5/97.5 percentiles
   (Fig. 3), written to examples/output/fig3_regression_self_distillation.png.
2. The generalised cross-validation path of the data-centric steps, read off the same
   eigendecomposition (examples/output/gcv_path.png).
3. The diabetes data set (442 x 10): a teacher ExactGP with an ARD RBF kernel trained by maximum
   marginal likelihood, then 30 data-centric and distribution-centric steps with the teacher's
   noise, a table of test RMSE per step, and the step GCV picks.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import gpytorch
import matplotlib
import torch

from gpsd import DataCentricGPR, DistributionCentricGPR
from gpsd.data import load_dataset, xsinx_regression

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

OUT = Path(__file__).resolve().parent / "output"
Z975 = 1.959963984540054


class TeacherGP(gpytorch.models.ExactGP):
    """An ordinary GPyTorch exact GP: constant mean, scaled ARD RBF kernel."""

    def __init__(self, x, y, likelihood):
        super().__init__(x, y, likelihood)
        self.mean_module = gpytorch.means.ConstantMean()
        self.covar_module = gpytorch.kernels.ScaleKernel(
            gpytorch.kernels.RBFKernel(ard_num_dims=x.shape[-1])
        )

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def toy_figure() -> None:
    x, y = xsinx_regression(n=10, seed=0)
    x = x.unsqueeze(-1)
    grid = torch.linspace(-0.5, 10.5, 300, dtype=x.dtype).unsqueeze(-1)
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).to(x.dtype)
    kernel.outputscale = 25.0  # sigma_f = 5
    kernel.base_kernel.lengthscale = 1.5
    noise = torch.linspace(0.1, 1.0, 10, dtype=x.dtype)
    models = {
        "data-centric": DataCentricGPR(x, y, kernel, noise=noise),
        "distribution-centric": DistributionCentricGPR(x, y, kernel, noise=noise),
    }
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    colours = plt.cm.viridis(torch.linspace(0, 1, 10).numpy())
    for ax, (name, model) in zip(axes, models.items(), strict=True):
        with torch.no_grad():
            prediction = model.fit().predict(grid)  # row t - 1 holds step t
        for t in range(10):
            mean, std = prediction.mean[t], prediction.stddev[t]
            ax.plot(grid, mean, color=colours[t], lw=1.2, label=f"t={t + 1}")
            ax.fill_between(
                grid.squeeze(-1), mean - Z975 * std, mean + Z975 * std, color=colours[t], alpha=0.06
            )
        ax.plot(grid, grid * torch.sin(grid), "k--", lw=1, label="g(z) = z sin z")
        ax.scatter(x, y, color="crimson", zorder=5, s=18, label="data")
        ax.set_title(f"{name}, noise = 0.1 .. 1.0")
        ax.set_xlabel("z")
    axes[0].legend(ncol=2, fontsize=7)
    fig.tight_layout()
    fig.savefig(OUT / "fig3_regression_self_distillation.png", dpi=120)
    plt.close(fig)

    # GCV path of 50 data-centric steps with the same kernel and a constant noise.
    model = DataCentricGPR(x, y, kernel, noise=0.5, num_steps=50)
    with torch.no_grad():
        gcv = model.gcv()
        best_step = model.best_step("gcv")
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(range(1, 51), gcv, marker=".")
    ax.set_xlabel("distillation step t")
    ax.set_ylabel("GCV(t)")
    ax.set_title(f"GCV picks t = {best_step}")
    fig.tight_layout()
    fig.savefig(OUT / "gcv_path.png", dpi=120)
    plt.close(fig)
    print(f"toy: wrote {OUT / 'fig3_regression_self_distillation.png'} and {OUT / 'gcv_path.png'}")


def train_teacher(x: torch.Tensor, y: torch.Tensor, iterations: int) -> TeacherGP:
    likelihood = gpytorch.likelihoods.GaussianLikelihood().to(x.dtype)
    teacher = TeacherGP(x, y, likelihood).to(x.dtype)
    teacher.train()
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(likelihood, teacher)
    optimizer = torch.optim.Adam(teacher.parameters(), lr=0.05)
    for _ in range(iterations):
        optimizer.zero_grad()
        loss = -mll(teacher(x), y)
        loss.backward()
        optimizer.step()
    return teacher.eval()


def real_data(name: str, steps: int, iterations: int) -> None:
    split = load_dataset(name, seed=0)
    teacher = train_teacher(split.train_x, split.train_y, iterations)
    noise = float(teacher.likelihood.noise.detach())
    data_centric = DataCentricGPR.from_teacher(teacher, num_steps=steps)
    distribution_centric = DistributionCentricGPR.from_teacher(teacher, num_steps=steps)
    with torch.no_grad():
        dc = data_centric.predict(split.test_x)
        dist = distribution_centric.predict(split.test_x)
        gcv = data_centric.gcv()
        best = data_centric.best_step("gcv")

    def nlpd(prediction, t):
        # the teacher's noise: the observation noise of new data, for every step
        var = prediction.variance[t] + noise
        resid = split.test_y - prediction.mean[t]
        return float((0.5 * (resid.square() / var + var.log() + 1.8378770664093453)).mean())

    print(
        f"\n{name}: n_train={split.train_x.shape[0]}, n_test={split.test_x.shape[0]}, "
        f"teacher noise={noise:.4f} (standardised units)"
    )
    print(
        "\n| step t | data-centric RMSE | data-centric NLPD | distribution-centric RMSE | "
        "distribution-centric NLPD | GCV(t) |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    for t in list(range(min(steps, 10))) + list(range(14, steps, 5)):
        print(
            f"| {t + 1} | {split.rmse(dc.mean[t]):.3f} | {nlpd(dc, t):.3f} | "
            f"{split.rmse(dist.mean[t]):.3f} | {nlpd(dist, t):.3f} | {float(gcv[t]):.4f} |"
        )
    print(
        f"\nGCV picks data-centric step t = {best} (test RMSE {split.rmse(dc.mean[best - 1]):.3f}; "
        f"the teacher, t = 1: {split.rmse(dc.mean[0]):.3f}); RMSE in the target's original units."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dataset", default="diabetes", help="a regression data set of gpsd.data")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--iterations", type=int, default=150, help="teacher training steps")
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    toy_figure()
    real_data(args.dataset, args.steps, args.iterations)


if __name__ == "__main__":
    main()
