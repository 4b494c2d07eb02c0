"""The combined self-distillation chain for classification on breast cancer: the (outer, inner) grid.

Run with no arguments:

    python examples/combined_chain_classification.py

A Laplace GP classifier (scaled ARD RBF kernel, hyperparameters maximising the Laplace marginal
likelihood) on 300 training rows of the breast-cancer data, then one ``CombinedGPC`` with that
kernel for each outer method (``"iterated"`` and ``"tempered"``): 4 outer (distribution-centric)
steps, each of 4 inner (continuous-Bernoulli data-centric) steps. Prints the test log loss and
accuracy of every cell (row o = 1 is the data-centric chain, column i = 1 the
distribution-centric chain, cell (1, 1) the Laplace classifier) and the cell that the validation
log loss on 100 held-out training rows picks.
"""

from __future__ import annotations

import time

import gpytorch
import torch

from gpsd import CombinedGPC, LaplaceGPClassifier
from gpsd.data import load_dataset

OUTER, INNER = 4, 4


def grid_table(values: torch.Tensor, digits: int) -> str:
    """A Markdown table of an ``(O, I)`` grid, rows outer steps, columns inner steps."""
    outer, inner = values.shape
    lines = [
        "| o \\ i | " + " | ".join(str(i + 1) for i in range(inner)) + " |",
        "|---:|" + "---:|" * inner,
    ]
    for o in range(outer):
        lines.append(
            f"| {o + 1} | " + " | ".join(f"{float(v):.{digits}f}" for v in values[o]) + " |"
        )
    return "\n".join(lines)


def main() -> None:
    torch.manual_seed(0)
    split = load_dataset("breast_cancer", seed=0)
    x, y = split.train_x[:300], split.train_y[:300]
    val_x, val_y = split.train_x[300:400], split.train_y[300:400]
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=x.shape[-1]))
    kernel = kernel.to(x.dtype)
    LaplaceGPClassifier(x, y, kernel).optimize_hyperparameters(max_iter=60, lr=0.05)
    y_test = split.test_y
    for method in ("iterated", "tempered"):
        start = time.perf_counter()
        model = CombinedGPC(x, y, kernel, outer_steps=OUTER, inner_steps=INNER, method=method).fit()
        with torch.no_grad():
            proba = model.predict_proba(split.test_x)  # shape: (O * I, M, 2)
            best = model.best_step(val_x=val_x, val_y=val_y)
        seconds = time.perf_counter() - start
        p = proba[..., 1].clamp(1e-12, 1 - 1e-12)
        log_loss = -(y_test * p.log() + (1 - y_test) * (1 - p).log()).mean(-1)
        accuracy = ((p > 0.5).to(y_test) == y_test).to(p).mean(-1)
        print(f"\n## method={method!r} ({seconds:.1f} s for {OUTER * INNER} steps)\n")
        print("Test log loss, rows outer steps o, columns inner steps i:\n")
        print(grid_table(log_loss.unflatten(-1, (OUTER, INNER)), 4))
        print("\nTest accuracy:\n")
        print(grid_table(accuracy.unflatten(-1, (OUTER, INNER)), 3))
        outer, inner = model.grid_step(best)
        print(
            f"\nValidation picks (o, i) = ({outer}, {inner}): test log loss "
            f"{float(log_loss[best - 1]):.4f}, accuracy {float(accuracy[best - 1]):.3f} "
            f"(the Laplace classifier, cell (1, 1): {float(log_loss[0]):.4f}, "
            f"{float(accuracy[0]):.3f})"
        )


if __name__ == "__main__":
    main()
