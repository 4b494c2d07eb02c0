"""Accuracy of the regression distillers on float32 data against the float64 answer.

For float32 inputs and targets, ``DataCentricGPR`` and ``DistributionCentricGPR`` factor in
float64 by default (``linalg_dtype``). This script compares their float32 predictions with a
float64 dense model on the same (float32-valued) data: max |error| / max |float64| of the means
and variances over every step and test point, for every backend.

Data: inputs uniform on [0, 10]^2, targets sin(x1) + sin(x2) + N(0, 0.3^2), RBF lengthscale 1.0
(smooth) and 0.1 (slowly decaying spectrum), T = 10 noises from 0.1 to 1.

Usage::

    python benchmarks/bench_float32_accuracy.py --out benchmarks/results/float32_accuracy_cpu.md
"""

from __future__ import annotations

import argparse
import platform
import sys

import gpytorch
import torch
from _problems import rbf_kernel, uniform_square_problem
from _timing import cpu_name, write_report

from gpsd import DataCentricGPR, DistributionCentricGPR


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref).abs().max() / ref.abs().max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=2048, help="training points")
    parser.add_argument("--m", type=int, default=500, help="test points")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", help="also write the Markdown report here")
    parser.add_argument("--quick", action="store_true", help="N = 512, 200 test points")
    args = parser.parse_args()
    if args.quick:
        args.n, args.m = 512, 200
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("CUDA is not available: nothing to measure on the GPU.")
        return
    x, y, test_x = uniform_square_problem(args.n, args.m, device, torch.float32)
    gamma = torch.linspace(0.1, 1.0, 10, device=device)
    lines = [
        f"# float32 data against the float64 answer ({device.type})",
        "",
        f"- command (in `benchmarks/`): `python {' '.join(sys.argv)}`",
        f"- machine: {cpu_name()}, torch {torch.__version__}, gpytorch "
        f"{gpytorch.__version__}, Python {platform.python_version()}",
        f"- N = {args.n}, {args.m} test points, T = 10 noises from 0.1 to 1; reference: the same "
        "float32 values in float64, backend='dense'",
        "",
        "| model | lengthscale | backend | mean rel. err | variance rel. err |",
        "|---|---:|---|---:|---:|",
    ]
    for cls in (DataCentricGPR, DistributionCentricGPR):
        for lengthscale in (1.0, 0.1):
            with torch.no_grad():
                kernel64 = rbf_kernel(lengthscale, device, torch.float64)
                ref = cls(x.double(), y.double(), kernel64, noise=gamma.double(), backend="dense")
                ref = ref.predict(test_x.double())
                for backend in ("dense", "cholesky", "cg"):
                    kernel = rbf_kernel(lengthscale, device, torch.float32)
                    got = cls(x, y, kernel, noise=gamma, backend=backend).predict(test_x)
                    errors = (
                        relative_error(got.mean, ref.mean),
                        relative_error(got.variance, ref.variance),
                    )
                    lines.append(
                        f"| {cls.__name__} | {lengthscale} | {backend} | {errors[0]:.1e} | "
                        f"{errors[1]:.1e} |"
                    )
                    print(lines[-1], flush=True)
    write_report("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
