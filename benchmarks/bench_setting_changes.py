"""A prediction after changing a setting that leaves the kernel matrix alone, against the first.

A fitted :class:`gpsd.DataCentricGPR` keeps its factorisation of K apart from the targets'
coordinates: changing ``alpha`` or the noise schedule (same length and smallest value) recomputes
only the latter, and so does changing ``method`` of a :class:`gpsd.DistributionCentricGPR`. For each
backend this script times the first ``predict`` of a fresh model (factorisation included), then a
``predict`` after each change, every one under ``torch.no_grad()``, and reports their ratio.

Data: N = 1,500 inputs uniform on [0, 10]^3, targets sum(sin(x)) plus noise, RBF lengthscale 1,
T = 10 steps with noise linspace(0.1, 1, 10), 1,000 test points. Median of ``--repeats`` fresh
models (after one warm-up model).

Usage::

    python benchmarks/bench_setting_changes.py --out benchmarks/results/setting_changes_cpu.md
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time

import gpytorch
import torch
from _timing import Report, cpu_name, load_line

from gpsd import DataCentricGPR, DistributionCentricGPR

N, M, T = 1500, 1000, 10


def data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = 10 * torch.rand(N + M, 3, generator=gen, dtype=torch.float64)
    y = torch.sin(x[:N]).sum(-1) + 0.3 * torch.randn(N, generator=gen, dtype=torch.float64)
    return x[:N], y, x[N:]


def kernel() -> gpytorch.kernels.Kernel:
    k = gpytorch.kernels.RBFKernel().to(torch.float64)
    k.lengthscale = 1.0
    return k


def seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def one_round(backend: str) -> dict[str, float]:
    """The first prediction of fresh models and the predictions after each change."""
    x, y, test_x = data()
    noise = torch.linspace(0.1, 1.0, T, dtype=torch.float64)
    times = {}
    with torch.no_grad():
        model = DataCentricGPR(x, y, kernel(), noise=noise, backend=backend)
        times["data-centric: first predict"] = seconds(lambda: model.predict(test_x))
        model.alpha = 0.3
        times["data-centric: after alpha = 0.3"] = seconds(lambda: model.predict(test_x))
        model.noise.copy_(torch.linspace(0.1, 0.5, T, dtype=torch.float64))
        times["data-centric: after a new schedule"] = seconds(lambda: model.predict(test_x))
        model = DistributionCentricGPR(x, y, kernel(), noise=noise, backend=backend)
        times["distribution-centric: first predict"] = seconds(lambda: model.predict(test_x))
        model.method = "iterated"
        model.method = "collapsed"  # back: the targets' coordinates of this method again
        times["distribution-centric: after method changes"] = seconds(lambda: model.predict(test_x))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs="+", default=["auto", "dense", "cholesky"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    report = Report(args.out)
    report.add(
        "# A prediction after changing alpha, the schedule or the method, against the first",
        "",
        f"- machine: {cpu_name()}, {torch.get_num_threads()} torch threads; device: cpu; "
        "dtype: float64",
        f"- torch {torch.__version__}, gpytorch {gpytorch.__version__}, Python "
        f"{platform.python_version()}",
        f"- command: `python benchmarks/bench_setting_changes.py {' '.join(sys.argv[1:])}`",
        f"- N = {N} inputs uniform on [0, 10]^3, RBF lengthscale 1, T = {T} steps, M = {M} "
        "test points, means and variances of every step under `torch.no_grad()`; median of "
        f"{args.repeats} fresh models after a warm-up",
        "",
        "| backend | prediction | time (s) | × first predict |",
        "|---|---|---:|---:|",
    )
    for backend in args.backends:
        one_round(backend)  # warm-up
        rounds = [one_round(backend) for _ in range(args.repeats)]
        medians = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
        for key, value in medians.items():
            family = key.split(":")[0]
            first = medians[f"{family}: first predict"]
            report.add(f"| {backend} | {key} | {value:.4f} | {value / first:.3f} |")
    report.add("", load_line())
    report.close()


if __name__ == "__main__":
    main()
