"""Self-distillation of a GP classifier of K = 10 classes on the digits.

Run with no arguments::

    python examples/multiclass_self_distillation.py

It fits the kernel of the softmax Laplace GPC (the teacher, step 1) by its marginal likelihood on
a subset of the digits, then prints a Markdown table of test accuracy and log loss per step of
the data-centric chain (steps t >= 2 fit the previous step's class probabilities with the
continuous categorical) and of the tempered distribution-centric steps, each against the teacher.
"""

from __future__ import annotations

import argparse
import time

import gpytorch
import torch

from gpsd import DataCentricGPC, DistributionCentricGPC
from gpsd.data import load_dataset
from gpsd.laplace import MulticlassLaplacePosterior


def fitted_kernel(x: torch.Tensor, labels: torch.Tensor, num_classes: int, max_iter: int):
    """An RBF kernel shared by the classes, its hyperparameters maximising the Laplace marginal
    likelihood of the softmax GPC (Adam)."""
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).double()
    kernel.base_kernel.lengthscale = torch.tensor(float(x.shape[-1]) ** 0.5, dtype=torch.float64)
    kernel.outputscale = torch.tensor(5.0, dtype=torch.float64)
    optimizer = torch.optim.Adam(kernel.parameters(), lr=0.1)
    for _ in range(max_iter):
        optimizer.zero_grad()
        posterior = MulticlassLaplacePosterior(
            0.0, kernel(x).to_dense(), "softmax", labels, num_classes=num_classes
        )
        (-posterior.log_marginal_likelihood() / len(labels)).backward()
        optimizer.step()
    for parameter in kernel.parameters():
        parameter.requires_grad_(False)
    return kernel


def scores(proba: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Accuracy and mean log loss of every step, from ``proba`` ``(T, M, K)``."""
    accuracy = (proba.argmax(-1) == labels).double().mean(-1)
    picked = proba.gather(-1, labels.expand(proba.shape[0], -1).unsqueeze(-1)).squeeze(-1)
    return accuracy, -picked.clamp_min(1e-300).log().mean(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-train", type=int, default=200)
    parser.add_argument("--n-test", type=int, default=400)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--noise", type=float, default=0.05, help="gamma_t of steps t >= 2")
    args = parser.parse_args()

    data = load_dataset("digits", n_train=args.n_train, n_test=args.n_test, seed=0)
    K = int(data.train_y.max()) + 1
    start = time.perf_counter()
    kernel = fitted_kernel(data.train_x, data.train_y, K, max_iter=40)
    print(
        f"digits: {args.n_train} training and {args.n_test} test points, K = {K} classes; "
        f"lengthscale {kernel.base_kernel.lengthscale.item():.3g}, "
        f"outputscale {kernel.outputscale.item():.3g}"
    )
    # step 1 without noise: the teacher, the same model as the tempered chain's step 1
    schedule = [0.0] + [args.noise] * (args.steps - 1)
    data_centric = DataCentricGPC(
        data.train_x, data.train_y, kernel, num_steps=args.steps, noise=schedule
    )
    tempered = DistributionCentricGPC(
        data.train_x, data.train_y, kernel, num_steps=args.steps, method="tempered"
    )
    with torch.no_grad():
        dc_acc, dc_nll = scores(data_centric.predict_proba(data.test_x), data.test_y)
        tp_acc, tp_nll = scores(tempered.predict_proba(data.test_x), data.test_y)
    print()
    print(
        "| step | data-centric accuracy | data-centric log loss | tempered accuracy | "
        "tempered log loss |"
    )
    print("|---:|---:|---:|---:|---:|")
    for t in range(args.steps):
        name = "1 (teacher)" if t == 0 else str(t + 1)
        print(f"| {name} | {dc_acc[t]:.4f} | {dc_nll[t]:.4f} | {tp_acc[t]:.4f} | {tp_nll[t]:.4f} |")
    print()
    print(f"data-centric noise schedule gamma = {schedule}")
    print(f"total time {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
