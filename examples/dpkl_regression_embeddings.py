"""DPKL on a real data set: 2-D mean embeddings coloured by the target (Mallick et al., Fig. 1c).

``deliveries`` (D = 35 after one-hot coding the weekday): n = 100 labelled rows (90 train + 10 validation for early stopping) and
1000 test rows. Trains DKL and DPKL in the paper's setting (``DPKLRegressor.paper_setting``: m = 10 particles of a D-100-50-50-2 ReLU network, R = 100
random Fourier features, the paper's functional gradient) and prints test RMSE (minutes) and
per-point NLL. Writes ``examples/output/dpkl_regression_embeddings.png``: the particle-mean
embeddings (1/m) sum_l g_{w_l}(x) of the test points for DPKL, and g_w(x) for DKL, coloured by the
delivery time; plus the particles of five test points (crosses, one colour per point) and their
mean (stars), to show the latent distributions.

Run: ``python examples/dpkl_regression_embeddings.py [--n 100] [--steps 100] [--dataset meats]``
"""

from __future__ import annotations

import argparse
import math
import os
import time

import matplotlib
import numpy as np
import torch
from torch import nn

from gpsd.data import load_arrays
from gpsd.dpkl import DKLRegressor, DPKLRegressor

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

OUTPUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "output")


def make_net(d_in: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(d_in, 100),
        nn.ReLU(),
        nn.Linear(100, 50),
        nn.ReLU(),
        nn.Linear(50, 50),
        nn.ReLU(),
        nn.Linear(50, 2),
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dataset", default="deliveries", choices=["deliveries", "meats"])
    parser.add_argument("--n", type=int, default=100)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    dtype = torch.float64
    x, y = load_arrays(args.dataset)
    perm = np.random.default_rng(args.seed).permutation(len(y))
    n_test = min(1000, len(y) - args.n)
    test, lab = perm[:n_test], perm[n_test : n_test + args.n]
    n_val = max(1, args.n // 10)
    val, tr = lab[:n_val], lab[n_val:]
    mu, sd = x[tr].mean(0), x[tr].std(0)
    sd[sd == 0] = 1.0
    ymu, ysd = y[tr].mean(), y[tr].std()

    def tx(idx):
        return torch.as_tensor((x[idx] - mu) / sd, dtype=dtype)

    def ty(idx):
        return torch.as_tensor((y[idx] - ymu) / ysd, dtype=dtype)

    d = x.shape[1]
    models = {
        "DKL": DKLRegressor(tx(tr), ty(tr), make_net(d)),
        "DPKL": DPKLRegressor.paper_setting(tx(tr), ty(tr), lambda: make_net(d)),
    }
    print(f"{args.dataset}: n = {args.n} labelled, {n_test} test, D = {d}\n")
    print("| model | test RMSE | test NLL | fit (s) |")
    print("|---|---|---|---|")
    yte = torch.as_tensor(y[test], dtype=dtype)
    for name, model in models.items():
        t0 = time.perf_counter()
        model.fit(max_iter=args.steps, lr=1e-2, val_x=tx(val), val_y=ty(val), check_every=20)
        fit_s = time.perf_counter() - t0
        pred = model.predict(tx(test), include_noise=True)  # of the observed targets
        mean, var = pred.mean, pred.variance
        mean, var = mean * ysd + ymu, var * ysd**2
        rmse = float((mean - yte).pow(2).mean().sqrt())
        nll = float((0.5 * (yte - mean) ** 2 / var + 0.5 * torch.log(2 * math.pi * var)).mean())
        print(f"| {name} | {rmse:.3f} | {nll:.3f} | {fit_s:.1f} |")

    target = "delivery time (minutes)" if args.dataset == "deliveries" else "target"
    fig, axes = plt.subplots(1, 2, figsize=(12, 5))
    marked = ("red", "magenta", "black", "darkorange", "cyan")
    for ax, (name, model) in zip(axes, models.items(), strict=True):
        z = model.embed(tx(test))  # shape: (m, n_test, 2)
        zbar = z.mean(0)
        sc = ax.scatter(zbar[:, 0], zbar[:, 1], c=y[test], s=8, cmap="viridis")
        if z.shape[0] > 1:  # the particles of five test points: the latent distributions
            for i, colour in enumerate(marked):
                ax.scatter(
                    z[:, i, 0], z[:, i, 1], s=22, marker="x", color=colour,
                    label=f"test point {i + 1}: its {z.shape[0]} particle embeddings",
                )  # fmt: skip
                ax.scatter(
                    zbar[i, 0], zbar[i, 1], s=200, marker="*", color=colour, zorder=5,
                    edgecolors="black", linewidths=0.8, label="star: the mean of those particles" if i == 0 else None,
                )  # fmt: skip
            ax.legend(fontsize=7, loc="best")
            what = f"particle-mean embeddings (1/m) Σ g_w_l(x), m = {z.shape[0]}"
        else:
            what = "embeddings g_w(x)"
        ax.set_title(
            f"{name}: {what}\nof {n_test} test points (dots, coloured by target)", fontsize=10
        )
        ax.set_xlabel("embedding dimension 1 (network output, no unit)")
        ax.set_ylabel("embedding dimension 2 (network output, no unit)")
        fig.colorbar(sc, ax=ax, label=target)
    fig.suptitle(f"{args.dataset} data set: n = {args.n} labelled rows, D = {d} inputs")
    fig.tight_layout()
    os.makedirs(OUTPUT, exist_ok=True)
    path = os.path.join(OUTPUT, "dpkl_regression_embeddings.png")
    fig.savefig(path, dpi=120)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
