"""Self-distillation for GP classification (Borup & Andersen §4): Fig. 4, 5, 6, 10 and a real data set.

Run with no arguments::

    python examples/classification_self_distillation.py

It writes PNGs to ``examples/output/`` and prints Markdown tables: the Fig. 6b error curves
(iterated distribution-centric distillation against the tempered-likelihood and the scaled-kernel
approximations) and, on the breast-cancer data, test accuracy, log loss and calibration per step.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import gpytorch
import matplotlib
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from gpsd import DataCentricGPC, DistributionCentricGPC, LaplaceGPClassifier  # noqa: E402
from gpsd.data.toy import sine_classification  # noqa: E402

OUTPUT = Path(__file__).resolve().parent / "output"


def scaled_rbf(outputscale: float = 1.0, lengthscale: float = 1.0) -> gpytorch.kernels.Kernel:
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).double()
    kernel.outputscale = outputscale
    kernel.base_kernel.lengthscale = lengthscale
    return kernel


def fitted_kernel(x: torch.Tensor, y: torch.Tensor, max_iter: int = 60) -> gpytorch.kernels.Kernel:
    """Kernel hyperparameters maximising the Laplace marginal likelihood of the step-1 GPC."""
    model = LaplaceGPClassifier(x, y, scaled_rbf(1.0, 1.0))
    model.optimize_hyperparameters(max_iter=max_iter, lr=0.05)
    kernel = model.covar_module
    for p in kernel.parameters():
        p.requires_grad_(False)
    return kernel


def toy_figures(n: int, seed: int) -> list[str]:
    x, y, test_x = sine_classification(n, seed=seed)
    truth = torch.sigmoid(2.0 * torch.sin(math.pi * test_x / 2.0))
    kernel = fitted_kernel(x, y)
    ls = kernel.base_kernel.lengthscale.item()
    os_ = kernel.outputscale.item()
    print(f"toy: n={n}, Laplace-ML kernel: outputscale={os_:.3f}, lengthscale={ls:.3f}\n")

    data_name = f"toy data: y ~ Bernoulli(sigma(2 sin(pi x / 2))), n = {n}"

    def plot_base(ax, title):
        ax.plot(test_x, truth, "k:", label="truth: sigma(2 sin(pi x / 2))")
        ax.scatter(x, y, s=12, c="k", alpha=0.5, marker="|", label="training labels (0 or 1)")
        ax.set_title(f"{title}\n{data_name}", fontsize=10)
        ax.set_xlabel("input x")
        ax.set_ylabel("predicted P(y = 1 | x)")
        ax.set_ylim(-0.05, 1.05)

    # Fig. 4: ordinary GPC and one distillation step with CB and (misspecified) Bernoulli
    cb = DataCentricGPC(x, y, kernel, num_steps=2).fit()
    bern = DataCentricGPC(x, y, kernel, num_steps=2, soft_target_likelihood="bernoulli").fit()
    fig, ax = plt.subplots(figsize=(10, 4))
    plot_base(ax, "Fig. 4: data-centric GPC, one distillation step")
    ax.plot(test_x, cb.predict_proba(test_x, step=1)[:, 1], label="step 1: GPC (Bernoulli)")
    ax.plot(
        test_x, cb.predict_proba(test_x, step=2)[:, 1], label="step 2: C-GPC (continuous Bernoulli)"
    )
    ax.plot(
        test_x, bern.predict_proba(test_x, step=2)[:, 1], label="step 2: Bernoulli on soft targets"
    )
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    files = [str(OUTPUT / "classification_fig4.png")]
    fig.savefig(files[-1], dpi=120)
    plt.close(fig)

    # Fig. 5: the noise gamma on the kernel diagonal regularises the C-GPC. The curves of small
    # gamma lie within a line width of each other; the lower panel shows their differences.
    fig, (ax, diff) = plt.subplots(
        2, 1, figsize=(10, 6.5), sharex=True, gridspec_kw={"height_ratios": [3, 2]}
    )
    plot_base(ax, "Fig. 5: C-GPC step 2 with noise gamma on the kernel diagonal")
    ax.set_xlabel("")
    ax.plot(test_x, cb.predict_proba(test_x, step=1)[:, 1], "k", lw=1, label="step 1: GPC")
    reference = None
    for gamma in (0.0, 0.1, 0.5, 2.0):
        model = DataCentricGPC(x, y, kernel, num_steps=2, noise=[0.0, gamma]).fit()
        p = model.predict_proba(test_x, step=2)[:, 1]
        ax.plot(test_x, p, label=f"step 2: C-GPC, gamma = {gamma}")
        if reference is None:
            reference = p
            diff.plot([], [])  # keep the colours of the upper panel
        else:
            diff.plot(test_x, p - reference, label=f"gamma = {gamma}")
    diff.axhline(0.0, color="0.6", lw=0.8)
    diff.set_xlabel("input x")
    diff.set_ylabel("P(y = 1 | x) minus\nthat of gamma = 0")
    diff.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    files.append(str(OUTPUT / "classification_fig5.png"))
    fig.savefig(files[-1], dpi=120)
    plt.close(fig)

    # Fig. 10: thresholded targets (dashed) against soft targets
    fig, ax = plt.subplots(figsize=(10, 4))
    plot_base(ax, "Fig. 10: soft (solid) vs thresholded (dashed) targets")
    for likelihood, colour in (("continuous_bernoulli", "C1"), ("bernoulli", "C2")):
        for threshold, style in ((False, "-"), (True, "--")):
            model = DataCentricGPC(
                x,
                y,
                kernel,
                num_steps=2,
                soft_target_likelihood=likelihood,
                threshold_targets=threshold,
            ).fit()
            ax.plot(
                test_x,
                model.predict_proba(test_x, step=2)[:, 1],
                style,
                color=colour,
                label=f"step 2: {likelihood.replace('_', ' ')}, "
                + ("thresholded targets" if threshold else "soft targets"),
            )
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    files.append(str(OUTPUT / "classification_fig10.png"))
    fig.savefig(files[-1], dpi=120)
    plt.close(fig)

    # Fig. 6: distribution-centric, 10 steps
    T = 10
    models = {
        m: DistributionCentricGPC(x, y, kernel, num_steps=T, method=m).fit()
        for m in ("iterated", "tempered", "scaled_kernel")
    }
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    plot_base(axes[0], "Fig. 6a: distribution-centric GPC, iterated, t = 1..10")
    cmap = plt.get_cmap("viridis")
    for t in range(1, T + 1):
        axes[0].plot(
            test_x,
            models["iterated"].predict_proba(test_x, step=t)[:, 1],
            color=cmap((t - 1) / (T - 1)),
            lw=1,
        )
    axes[0].legend(fontsize=8, loc="lower left")
    bar = fig.colorbar(
        plt.cm.ScalarMappable(cmap=cmap, norm=matplotlib.colors.Normalize(1, T)), ax=axes[0]
    )
    bar.set_label("distillation step t (line colour)")
    rows = []
    errors = {key: [] for key in ("tempered", "scaled_kernel")}
    for t in range(1, T + 1):
        latent = models["iterated"].predict_latent(test_x, step=t)
        mi, vi = latent.mean, latent.variance
        pi = models["iterated"].predict_proba(test_x, step=t)[:, 1]
        row = [t]
        for key in ("tempered", "scaled_kernel"):
            latent = models[key].predict_latent(test_x, step=t)
            ma, va = latent.mean, latent.variance
            pa = models[key].predict_proba(test_x, step=t)[:, 1]
            e = (
                (mi - ma).square().mean().item(),
                (vi - va).square().mean().item(),
                (pi - pa).square().mean().item(),
            )
            errors[key].append(e)
            row += list(e)
        rows.append(row)
    steps = list(range(2, T + 1))  # at t = 1 all three are the ordinary GPC (differences ~1e-30)
    quantities = (("latent mean", "C0"), ("latent var", "C1"), ("probability", "C2"))
    # The two approximations share the latent mean: markers keep both curves visible.
    for key, style, marker in (("tempered", "-", "o"), ("scaled_kernel", "--", "x")):
        for j, (what, colour) in enumerate(quantities):
            values = [e[j] for e in errors[key][1:]]
            axes[1].semilogy(
                steps, values, style, color=colour, marker=marker, ms=5,
                label=f"{key.replace('_', ' ')}: {what}",
            )  # fmt: skip
    axes[1].set_title(
        f"Fig. 6b: mean squared difference to the iterated solution\n{data_name}, "
        f"{len(test_x)} test points",
        fontsize=10,
    )
    axes[1].set_xlabel("distillation step t")
    axes[1].set_ylabel("mean squared difference (latent or probability units²)")
    axes[1].set_ylim(top=1e5)  # room for the key above the curves
    axes[1].legend(fontsize=7, ncol=2, loc="upper left")
    fig.tight_layout()
    files.append(str(OUTPUT / "classification_fig6.png"))
    fig.savefig(files[-1], dpi=120)
    plt.close(fig)

    print(
        "### Fig. 6b: mean squared difference to iterated distribution-centric GPC (90 test points)\n"
    )
    print(
        "| t | tempered: mean | tempered: var | tempered: prob "
        "| scaled kernel: mean | scaled kernel: var | scaled kernel: prob |"
    )
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row[0]} | " + " | ".join(f"{v:.2e}" for v in row[1:]) + " |")
    print()
    return files


def calibration_error(probs: torch.Tensor, labels: torch.Tensor, bins: int = 10) -> float:
    """Expected calibration error of the positive-class probability (equal-width bins)."""
    edges = torch.linspace(0, 1, bins + 1, dtype=probs.dtype)
    ece = 0.0
    for lo, hi in zip(edges[:-1], edges[1:], strict=True):
        mask = (probs >= lo) & ((probs < hi) if hi < 1 else (probs <= hi))
        if mask.any():
            ece += mask.double().mean().item() * abs(
                probs[mask].mean().item() - labels[mask].mean().item()
            )
    return ece


def breast_cancer(num_steps: int, noise: float) -> None:
    from sklearn.datasets import load_breast_cancer

    data = load_breast_cancer()
    x = torch.as_tensor(data.data, dtype=torch.float64)
    y = torch.as_tensor(data.target, dtype=torch.float64)
    perm = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(0))
    train, test = perm[:400], perm[400:]
    mu, sd = x[train].mean(0), x[train].std(0)
    x = (x - mu) / sd
    start = time.perf_counter()
    kernel = fitted_kernel(x[train], y[train], max_iter=40)
    print(
        f"### Breast cancer (n_train=400, n_test={len(test)}), Laplace-ML kernel: outputscale="
        f"{kernel.outputscale.item():.3f}, lengthscale={kernel.base_kernel.lengthscale.item():.3f} "
        f"({time.perf_counter() - start:.1f} s)\n"
    )
    models = {
        "data-centric C-GPC (gamma=0)": DataCentricGPC(
            x[train], y[train], kernel, num_steps=num_steps
        ),
        f"data-centric C-GPC (gamma={noise})": DataCentricGPC(
            x[train], y[train], kernel, num_steps=num_steps, noise=[0.0] + [noise] * (num_steps - 1)
        ),
        "data-centric Bernoulli on soft targets": DataCentricGPC(
            x[train], y[train], kernel, num_steps=num_steps, soft_target_likelihood="bernoulli"
        ),
        "distribution-centric iterated": DistributionCentricGPC(
            x[train], y[train], kernel, num_steps=num_steps, method="iterated"
        ),
        "distribution-centric tempered": DistributionCentricGPC(
            x[train], y[train], kernel, num_steps=num_steps, method="tempered"
        ),
        "distribution-centric scaled kernel": DistributionCentricGPC(
            x[train], y[train], kernel, num_steps=num_steps, method="scaled_kernel"
        ),
    }
    print("| method | step | test accuracy | test log loss | ECE (10 bins) |")
    print("|---|---|---|---|---|")
    yt = y[test]
    for name, model in models.items():
        model.fit()
        for t in range(1, num_steps + 1):
            p = model.predict_proba(x[test], step=t)[:, 1].clamp(1e-12, 1 - 1e-12)
            acc = ((p > 0.5).double() == yt).double().mean().item()
            logloss = -(yt * p.log() + (1 - yt) * (1 - p).log()).mean().item()
            print(f"| {name} | {t} | {acc:.4f} | {logloss:.4f} | {calibration_error(p, yt):.4f} |")
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=50, help="training points of the toy setting")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=5, help="distillation steps on breast cancer")
    parser.add_argument(
        "--noise", type=float, default=0.5, help="gamma_t for steps >= 2 (real data)"
    )
    args = parser.parse_args()
    OUTPUT.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    files = toy_figures(args.n, args.seed)
    breast_cancer(args.steps, args.noise)
    print("wrote " + ", ".join(files))


if __name__ == "__main__":
    main()
