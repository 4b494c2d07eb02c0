"""Self-distillation of GP regression: Borup & Andersen's Fig. 3, the GCV path, and real data.

Run with no arguments:

    python examples/regression_self_distillation.py

1. The toy setting of §3.3: g(z) = z sin z, 10 equally spaced inputs on [0, 10], N(0, 1) noise, a
   scaled RBF kernel with fixed hyperparameters and noise = (0.1, 0.2, ..., 1.0). Ten steps of
   data-centric and distribution-centric distillation, each step's mean and 2.5/97.5 percentiles
   (Fig. 3), written to examples/output/fig3_regression_self_distillation.png, with the change of
   each step's mean from step 1 and the width of each step's 95 % interval.
2. The diabetes data set (442 x 10): a teacher ExactGP with an ARD RBF kernel trained by maximum
   marginal likelihood, then 30 data-centric and distribution-centric steps with the teacher's
   noise, a table of test RMSE per step, and the step GCV picks; the GCV path beside the test
   RMSE of both chains (examples/output/gcv_path.png, the same data as the table).
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
    # Rows: each step's mean with the 95 % bands of steps 1 and 10; the mean's change from step 1
    # (the distribution-centric means move little, so the top row alone cannot show them); the
    # width of each step's 95 % interval (what distribution-centric distillation shrinks).
    fig, axes = plt.subplots(3, 2, figsize=(12, 10), sharex=True)
    cmap = plt.get_cmap("viridis")
    colours = cmap(torch.linspace(0, 1, 10).numpy())
    z = grid.squeeze(-1)
    for col, (name, model) in enumerate(models.items()):
        with torch.no_grad():
            prediction = model.fit().predict(grid)  # row t - 1 holds step t
        top, mid, bottom = axes[:, col]
        for t in range(10):
            mean, std = prediction.mean[t], prediction.stddev[t]
            top.plot(z, mean, color=colours[t], lw=1.2)
            if t in (0, 9):
                top.fill_between(
                    z, mean - Z975 * std, mean + Z975 * std, color=colours[t], alpha=0.15,
                    label=f"95 % interval, t = {t + 1}",
                )  # fmt: skip
            mid.plot(z, mean - prediction.mean[0], color=colours[t], lw=1.2)
            bottom.plot(z, 2 * Z975 * std, color=colours[t], lw=1.2)
        top.plot(z, z * torch.sin(z), "k--", lw=1, label="truth g(z) = z sin z")
        top.scatter(x, y, color="crimson", zorder=5, s=18, label="10 noisy observations")
        top.set_title(f"{name} distillation, steps t = 1..10\n(noise 0.1, 0.2, ..., 1.0)")
        top.set_ylabel("predictive mean of g(z)")
        mid.set_ylabel("mean at step t minus mean at t = 1")
        mid.axhline(0.0, color="0.6", lw=0.8)
        bottom.set_ylabel("width of the 95 % interval of g(z)")
        bottom.set_xlabel("input z")
        top.legend(fontsize=7, loc="lower left")
    fig.suptitle(
        "Toy data (Borup & Andersen §3.3): g(z) = z sin z, 10 inputs on [0, 10], N(0, 1) noise"
    )
    fig.tight_layout(rect=(0, 0, 0.92, 1))
    bar = fig.colorbar(
        plt.cm.ScalarMappable(cmap=cmap, norm=matplotlib.colors.Normalize(1, 10)),
        ax=axes, fraction=0.03, pad=0.02, shrink=0.6,
    )  # fmt: skip
    bar.set_label("distillation step t (line colour)")
    fig.savefig(OUT / "fig3_regression_self_distillation.png", dpi=110)
    plt.close(fig)
    print(f"toy: wrote {OUT / 'fig3_regression_self_distillation.png'}")


def gcv_figure(name: str, gcv: torch.Tensor, dc_rmse: list[float], dist_rmse: list[float]) -> None:
    """The GCV path of the data-centric steps beside the test RMSE of both chains on ``name``."""
    steps = range(1, len(gcv) + 1)
    best = int(torch.argmin(gcv)) + 1
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(steps, gcv, marker=".", label="GCV(t), training data only")
    left.axvline(best, color="C3", ls=":", label=f"GCV's choice, t = {best}")
    left.set_xlabel("distillation step t")
    left.set_ylabel("GCV(t) (standardised target units²)")
    left.set_title("generalised cross-validation, data-centric")
    left.legend()
    right.plot(steps, dc_rmse, marker=".", label="data-centric")
    right.plot(steps, dist_rmse, marker=".", label="distribution-centric")
    right.axvline(best, color="C3", ls=":", label=f"GCV's choice, t = {best}")
    right.set_xlabel("distillation step t")
    right.set_ylabel("test RMSE (target's original units)")
    right.set_title("held-out test error")
    right.legend()
    fig.suptitle(f"{name} data set: teacher ExactGP (ARD RBF), then distillation steps")
    fig.tight_layout()
    fig.savefig(OUT / "gcv_path.png", dpi=110)
    plt.close(fig)
    print(f"{name}: wrote {OUT / 'gcv_path.png'}")


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
    gcv_figure(
        name,
        gcv,
        [split.rmse(dc.mean[t]) for t in range(steps)],
        [split.rmse(dist.mean[t]) for t in range(steps)],
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
