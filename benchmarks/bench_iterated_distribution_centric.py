"""Time of the iterated distribution-centric recursion against the number of steps T.

``DistributionCentricGPR(..., method="iterated")`` conditions the GP on the data once per step;
its time should grow linearly in T. Prints the median of ``--repeats`` predictions (means and
variances of every step, after one warm-up) for each T, and the ratio to T = 1, on inputs
uniform on [0, 1]^d with targets sum(sin(x)) and a constant noise 0.1.

Usage::

    python benchmarks/bench_iterated_distribution_centric.py --out benchmarks/results/iterated_distribution_centric_cpu.md
    python benchmarks/bench_iterated_distribution_centric.py --quick
"""

from __future__ import annotations

import argparse
import platform

import gpytorch
import torch
from _timing import cpu_name, median_time, write_report

from gpsd import DistributionCentricGPR


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[200, 400], help="N")
    parser.add_argument("--steps", type=int, nargs="+", default=[1, 2, 4, 8, 10, 32])
    parser.add_argument("--d", type=int, default=5)
    parser.add_argument("--m", type=int, default=100, help="test points")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="N = 200, T up to 8, 3 repeats")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.quick:
        args.sizes, args.steps, args.repeats = [200], [1, 2, 4, 8], 3
    device = torch.device("cpu")
    lines = [
        "# Iterated distribution-centric GPR: time against the number of steps",
        "",
        f"- machine: {cpu_name()}, {torch.get_num_threads()} torch threads",
        f"- torch {torch.__version__}, gpytorch {gpytorch.__version__}, Python "
        f"{platform.python_version()}; float64",
        f"- inputs uniform on [0, 1]^{args.d}, {args.m} test points, noise 0.1 at every step; "
        f"median of {args.repeats} predictions (means and variances of every step) after a "
        "warm-up",
        "",
        "| N | T | time (ms) | time / time at T = 1 |",
        "|---:|---:|---:|---:|",
    ]
    for n in args.sizes:
        gen = torch.Generator().manual_seed(0)
        x = torch.rand(n, args.d, generator=gen, dtype=torch.float64)
        y = torch.sin(x).sum(-1)
        test_x = torch.rand(args.m, args.d, generator=gen, dtype=torch.float64)
        kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).double()
        base = None
        for steps in args.steps:
            model = DistributionCentricGPR(x, y, kernel, noise=[0.1] * steps, method="iterated")

            def predict(model=model, test_x=test_x):
                with torch.no_grad():
                    return model.predict(test_x)

            seconds = median_time(predict, args.repeats, device)
            base = base if base is not None else seconds
            lines.append(f"| {n} | {steps} | {1e3 * seconds:.1f} | {seconds / base:.1f} |")
    write_report("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
