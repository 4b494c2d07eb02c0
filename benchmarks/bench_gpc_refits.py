"""GPC self-distillation with and without per-step hyperparameter refits (Borup & Andersen, Fig. 4).

Fig. 4 of the paper fits every model's kernel hyperparameters to its own targets (the Laplace
marginal likelihood); gpsd's GPC distillers share one kernel across the steps unless
``refit_hyperparameters=True``. This script runs both ways from the same starting kernel:

* **fixed**: the kernel's hyperparameters are fitted once, to the step-1 GPC on the labels
  (``LaplaceGPClassifier.optimize_hyperparameters``), and every step shares them;
* **refit**: ``refit_hyperparameters=True``, each step optimises its own copy from the same
  starting values with the same optimiser (Adam, ``--refit-iter`` iterations, ``--lr``).

Step 1 is therefore the same model both ways. Tables:

1. Fig. 4 on the §4.3 toy data (``n = 50``): each step's hyperparameters, and the predicted
   probability against the truth :math:`\\sigma(2\\sin(\\pi x/2))` (mean absolute error on
   [0, 5]) and on 2,000 fresh labelled points (accuracy, log loss); ``--figure`` draws the curves.
2. The same toy setting over ``--seeds`` data sets, ``T = --steps`` steps: mean +- standard error.
3. Breast cancer (``gpsd.data.load_dataset``), ``--bc-n`` training points, the rest held out.

Usage::

    python benchmarks/bench_gpc_refits.py --out benchmarks/results/gpc_refits.md \\
        --figure benchmarks/results/gpc_refits.png
    python benchmarks/bench_gpc_refits.py --quick     # a smoke run
"""

from __future__ import annotations

import argparse
import math
import platform
import shlex
import sys
import time

import gpytorch
import numpy as np
import torch
from _timing import Report, cpu_name

from gpsd import DataCentricGPC, DistributionCentricGPC, LaplaceGPClassifier
from gpsd.data.real import load_dataset
from gpsd.data.toy import sine_classification


def start_kernel(dims: int | None = None) -> gpytorch.kernels.Kernel:
    """ScaleKernel(RBF) at outputscale 1, lengthscale 1 (ARD over ``dims`` inputs if given)."""
    k = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=dims)).double()
    k.outputscale = 1.0
    k.base_kernel.lengthscale = 1.0
    return k


def step_one_kernel(x, y, iters: int, lr: float) -> gpytorch.kernels.Kernel:
    """The kernel of the step-1 GPC fitted to the labels (the "fixed" setting's shared kernel)."""
    model = LaplaceGPClassifier(x, y, start_kernel())
    model.optimize_hyperparameters(max_iter=iters, lr=lr)
    kernel = model.covar_module
    for p in kernel.parameters():
        p.requires_grad_(False)
    return kernel


METHODS = {
    "data-centric C-GPC": lambda x, y, k, T, **o: DataCentricGPC(x, y, k, num_steps=T, **o),
    "data-centric Bernoulli on soft targets": lambda x, y, k, T, **o: DataCentricGPC(
        x, y, k, num_steps=T, soft_target_likelihood="bernoulli", **o
    ),
    "distribution-centric tempered": lambda x, y, k, T, **o: DistributionCentricGPC(
        x, y, k, num_steps=T, method="tempered", **o
    ),
}


def fit_both(name, x, y, T, iters, lr):
    """The method ``name`` fixed (step-1 kernel shared) and refitted; with their fit times."""
    make = METHODS[name]
    out = {}
    start = time.perf_counter()
    fixed = make(x, y, step_one_kernel(x, y, iters, lr), T).fit()
    out["fixed"] = (fixed, time.perf_counter() - start)
    start = time.perf_counter()
    options = {"refit_hyperparameters": True, "refit_max_iter": iters, "refit_lr": lr}
    refit = make(x, y, start_kernel(), T, **options).fit()
    out["refit"] = (refit, time.perf_counter() - start)
    return out


def scores(model, test_x, test_y) -> tuple[np.ndarray, np.ndarray]:
    """Accuracy and log loss of every step, ``(T,)`` each."""
    with torch.no_grad():
        p = model.predict_proba(test_x)[..., 1].clamp(1e-12, 1 - 1e-12)  # shape: (T, M)
    acc = ((p > 0.5).double() == test_y).double().mean(-1)
    loss = -(test_y * p.log() + (1 - test_y) * (1 - p).log()).mean(-1)
    return acc.numpy(), loss.numpy()


def hyper(kernel) -> str:
    ls = kernel.base_kernel.lengthscale.detach().flatten()
    ls_text = f"{ls.item():.3f}" if ls.numel() == 1 else f"median {ls.median().item():.3f}"
    return f"{kernel.outputscale.item():.3f} / {ls_text}"


def fresh_toy_test(seed: int, m: int = 2000):
    gen = torch.Generator().manual_seed(10_000 + seed)
    x = 5.0 * torch.rand(m, generator=gen, dtype=torch.float64)
    y = torch.bernoulli(torch.sigmoid(2.0 * torch.sin(math.pi * x / 2.0)), generator=gen)
    return x, y


def fig4(report: Report, args) -> dict:
    x, y, grid = sine_classification(50, seed=0)
    tx, ty = fresh_toy_test(0)
    inside = (grid >= 0) & (grid <= 5)
    truth = torch.sigmoid(2.0 * torch.sin(math.pi * grid / 2.0))
    report.add(
        "## 1. Fig. 4: ordinary GPC (step 1) and one data-centric step (step 2), toy n = 50\n",
        "Hyperparameters: outputscale / lengthscale. MAE: mean |p(x) - sigma(2 sin(pi x / 2))| "
        "on the 51 grid points in [0, 5]; accuracy and log loss on 2,000 fresh labelled points.\n",
        "| model | hyperparameters | step | outputscale / lengthscale | MAE to truth | accuracy "
        "| log loss | fit time (s) |",
        "|---|---|---|---|---|---|---|---|",
    )
    curves = {}
    for name in list(METHODS)[:2]:
        for how, (model, seconds) in fit_both(name, x, y, 2, args.refit_iter, args.lr).items():
            acc, loss = scores(model, tx, ty)
            with torch.no_grad():
                p = model.predict_proba(grid)[..., 1]
            curves[(name, how)] = p
            for t in (1, 2):
                mae = (p[t - 1] - truth)[inside].abs().mean().item()
                kernel = model.step_covar_modules[t - 1]
                report.add(
                    f"| {name} | {how} | {t} | {hyper(kernel)} | {mae:.4f} | {acc[t - 1]:.4f} "
                    f"| {loss[t - 1]:.4f} | {seconds:.2f} |"
                )
    report.add("")
    return {"grid": grid, "truth": truth, "x": x, "y": y, "curves": curves}


def draw(fig_data: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5), sharey=True)
    grid = fig_data["grid"]
    for ax, how in zip(axes, ("fixed", "refit"), strict=True):
        ax.plot(grid, fig_data["truth"], "k:", label="truth: sigma(2 sin(pi x / 2))")
        ax.scatter(fig_data["x"], fig_data["y"], s=12, c="k", alpha=0.5, marker="|")
        cb = fig_data["curves"][("data-centric C-GPC", how)]
        bern = fig_data["curves"][("data-centric Bernoulli on soft targets", how)]
        ax.plot(grid, cb[0], label="step 1: GPC (Bernoulli, labels)")
        ax.plot(grid, cb[1], label="step 2: C-GPC (continuous Bernoulli)")
        ax.plot(grid, bern[1], label="step 2: Bernoulli on soft targets")
        title = {
            "fixed": "hyperparameters fitted once (step 1), shared by step 2",
            "refit": "hyperparameters refitted at every step (paper's Fig. 4)",
        }[how]
        ax.set_title(f"Fig. 4, {title}\ntoy data, n = 50", fontsize=10)
        ax.set_xlabel("input x")
        ax.set_ylim(-0.05, 1.05)
    axes[0].set_ylabel("predicted P(y = 1 | x)")
    axes[1].legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def mean_se(values: list[float]) -> str:
    a = np.asarray(values)
    se = a.std(ddof=1) / math.sqrt(len(a)) if len(a) > 1 else float("nan")
    return f"{a.mean():.4f} ± {se:.4f}"


def many(report: Report, title: str, splits, T: int, args) -> None:
    """Per-step accuracy and log loss over ``splits`` (a list of train/test tuples)."""
    rows: dict = {}
    for x, y, tx, ty in splits:
        for name in METHODS:
            for how, (model, seconds) in fit_both(name, x, y, T, args.refit_iter, args.lr).items():
                acc, loss = scores(model, tx, ty)
                ls = [
                    k.base_kernel.lengthscale.detach().median().item()
                    for k in model.step_covar_modules
                ]
                for t in range(1, T + 1):
                    row = rows.setdefault((name, how, t), {"acc": [], "loss": [], "ls": []})
                    row["acc"].append(acc[t - 1])
                    row["loss"].append(loss[t - 1])
                    row["ls"].append(ls[t - 1])
                rows.setdefault((name, how, "time"), []).append(seconds)
    report.add(
        title,
        "| method | hyperparameters | step | test accuracy | test log loss | lengthscale (mean) "
        "| fit time (s, mean) |",
        "|---|---|---|---|---|---|---|",
    )
    for name in METHODS:
        for how in ("fixed", "refit"):
            seconds = np.mean(rows[(name, how, "time")])
            for t in range(1, T + 1):
                row = rows[(name, how, t)]
                report.add(
                    f"| {name} | {how} | {t} | {mean_se(row['acc'])} | {mean_se(row['loss'])} "
                    f"| {np.mean(row['ls']):.3f} | {seconds:.2f} |"
                )
    report.add("")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=10, help="toy data sets (table 2)")
    parser.add_argument("--steps", type=int, default=4, help="steps T of tables 2 and 3")
    parser.add_argument("--refit-iter", type=int, default=50, help="Adam iterations per fit")
    parser.add_argument("--lr", type=float, default=0.05, help="Adam's learning rate")
    parser.add_argument("--bc-n", type=int, default=200, help="breast-cancer training points")
    parser.add_argument("--bc-seeds", type=int, default=3, help="breast-cancer splits")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    parser.add_argument("--out", default=None, help="also write the tables to this file")
    parser.add_argument("--figure", default=None, help="draw the Fig. 4 curves to this PNG")
    args = parser.parse_args()
    if args.quick:
        args.seeds, args.steps, args.refit_iter, args.bc_n, args.bc_seeds = 2, 2, 5, 60, 1
    torch.set_num_threads(args.threads)
    report = Report(args.out)
    report.add(
        "# GPC self-distillation with and without per-step hyperparameter refits\n",
        f"- machine: 2-core x86_64 CPU shared with other jobs (busy), {cpu_name()}, "
        f"{torch.get_num_threads()} torch thread(s), {platform.system()} {platform.release()}",
        "- device: cpu, dtype: float64",
        f"- torch {torch.__version__}, gpytorch {gpytorch.__version__}, "
        f"python {platform.python_version()}",
        f"- command: `python {shlex.join(sys.argv)}`",
        f"- starting kernel: ScaleKernel(RBF), outputscale 1, lengthscale 1; Adam, "
        f"{args.refit_iter} iterations, learning rate {args.lr} for every hyperparameter fit",
        "- fixed: the step-1 GPC's fitted kernel shared by every step; refit: "
        "`refit_hyperparameters=True`, every step fitted from the same start (step 1 is the same "
        "model both ways; distribution-centric tempered step t refits on the likelihood raised "
        "to the power t)\n",
    )
    fig_data = fig4(report, args)
    if args.figure:
        draw(fig_data, args.figure)
        report.add(f"Figure: `{args.figure}`\n")
    splits = []
    for seed in range(args.seeds):
        x, y, _ = sine_classification(50, seed=seed)
        splits.append((x, y, *fresh_toy_test(seed)))
    many(
        report,
        f"## 2. Toy data, n = 50, {args.seeds} data sets, T = {args.steps}: mean ± s.e. on "
        "2,000 fresh points each\n",
        splits,
        args.steps,
        args,
    )
    splits = []
    for seed in range(args.bc_seeds):
        data = load_dataset("breast_cancer", n_train=args.bc_n, seed=seed)
        splits.append((data.train_x, data.train_y.double(), data.test_x, data.test_y.double()))
    many(
        report,
        f"## 3. Breast cancer, n_train = {args.bc_n}, the other "
        f"{569 - args.bc_n} rows held out, {args.bc_seeds} splits, T = {args.steps}: "
        "mean ± s.e. (isotropic RBF)\n",
        splits,
        args.steps,
        args,
    )
    report.close()


if __name__ == "__main__":
    main()
