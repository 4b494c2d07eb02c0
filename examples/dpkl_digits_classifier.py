"""DPKL classifier on ``load_digits``: accuracy and NLL against the number of labelled points.

Balanced labelled sets of n in {50, 100, 200, 400} (10 % of them held out for early stopping on
validation accuracy, checked every 10 epochs), the 797 last rows of a fixed permutation as the
test set. Compared: the DPKL classifier (m = 10 particles of a 64-64-16 tanh network, 10 SVGD
particles of the class weights, the paper's functional gradient), DBLR (the same with one
deterministic network) and sklearn's multinomial logistic regression on the standardised
pixels. Prints a table and writes ``examples/output/dpkl_digits_classifier.png``.

Run: ``python examples/dpkl_digits_classifier.py [--epochs 60] [--ns 50 100 200 400]``
"""

from __future__ import annotations

import argparse
import os
import time

import matplotlib
import numpy as np
import torch
from torch import nn

from gpsd.dpkl import DPKLClassifier

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

OUTPUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "output")


def make_net() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 16))


def balanced(labels: np.ndarray, pool: np.ndarray, n: int, rng) -> np.ndarray:
    per = n // 10
    return np.concatenate(
        [rng.choice(pool[labels[pool] == c], per, replace=False) for c in range(10)]
    )


def main() -> None:
    from sklearn.datasets import load_digits
    from sklearn.linear_model import LogisticRegression

    parser = argparse.ArgumentParser()
    parser.add_argument("--ns", type=int, nargs="+", default=[50, 100, 200, 400])
    parser.add_argument("--epochs", type=int, default=60)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    x, y = load_digits(return_X_y=True)
    rng = np.random.default_rng(args.seed)
    perm = rng.permutation(len(y))
    test, pool = perm[1000:], perm[:1000]
    dtype = torch.float32
    results = {"DPKL (m=10)": [], "DBLR (m=1)": [], "logistic regression": []}
    print("| n | model | test accuracy | test NLL | fit (s) |")
    print("|---|---|---|---|---|")
    for n in args.ns:
        lab = balanced(y, pool, n, rng)
        rng.shuffle(lab)
        n_val = max(10, n // 10)
        val, tr = lab[:n_val], lab[n_val:]
        mu, sd = x[tr].mean(0), x[tr].std(0) + 1.0

        def tx(idx, mu=mu, sd=sd):
            return torch.as_tensor((x[idx] - mu) / sd, dtype=dtype)

        def ty(idx):
            return torch.as_tensor(y[idx])

        for name, m in (("DPKL (m=10)", 10), ("DBLR (m=1)", 1)):
            torch.manual_seed(args.seed)
            clf = DPKLClassifier(
                tx(tr),
                ty(tr),
                make_net,
                num_classes=10,
                num_particles=m,
                num_weight_particles=10,
                latent_dim=16,
            )
            t0 = time.perf_counter()
            clf.fit(max_iter=args.epochs, lr=args.lr, val_x=tx(val), val_y=ty(val))
            fit_s = time.perf_counter() - t0
            acc, nll = clf.accuracy(tx(test), ty(test)), clf.nll(tx(test), ty(test))
            results[name].append((acc, nll))
            print(f"| {n} | {name} | {acc:.3f} | {nll:.3f} | {fit_s:.1f} |", flush=True)
        t0 = time.perf_counter()
        lr = LogisticRegression(max_iter=2000).fit(tx(tr).numpy(), y[tr])
        proba = lr.predict_proba(tx(test).numpy())
        acc = float((proba.argmax(1) == y[test]).mean())
        nll = float(-np.log(np.clip(proba[np.arange(len(test)), y[test]], 1e-300, None)).mean())
        results["logistic regression"].append((acc, nll))
        print(
            f"| {n} | logistic regression | {acc:.3f} | {nll:.3f} | {time.perf_counter() - t0:.1f} |"
        )

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for name, vals in results.items():
        axes[0].plot(args.ns, [v[0] for v in vals], marker="o", label=name)
        axes[1].plot(args.ns, [v[1] for v in vals], marker="o", label=name)
    axes[0].set_ylabel("test accuracy (fraction correct)")
    axes[1].set_ylabel("test NLL (nats per image)")
    for ax in axes:
        ax.set_xlabel("labelled images n (10 %, at least 10, held out for early stopping)")
        ax.set_xscale("log")
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_xticks(args.ns, [str(n) for n in args.ns])
    axes[0].legend()
    fig.suptitle(
        f"scikit-learn load_digits (8 x 8 pixels, 10 classes): {len(test)} test images, "
        "balanced labelled sets"
    )
    fig.tight_layout()
    os.makedirs(OUTPUT, exist_ok=True)
    path = os.path.join(OUTPUT, "dpkl_digits_classifier.png")
    fig.savefig(path, dpi=120)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
