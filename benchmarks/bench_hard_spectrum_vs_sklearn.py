"""All 100 data-centric steps against one scikit-learn GP fit + predict, on spectra that decay slowly.

For each setting, N = 2,000 training and 1,000 test points, an RBF kernel with fixed
hyperparameters, the noise schedule linspace(0.1, 1, 100), and every step's means and variances
predicted under ``torch.no_grad()`` (GPyTorch's idiom for predictions): scikit-learn's
``GaussianProcessRegressor`` (``optimizer=None``, ``alpha`` the smallest noise) fit + predict with
standard deviations, then :class:`gpsd.DataCentricGPR` with ``backend="auto"`` and each forced
backend, and the dense eigendecomposition through ``torch.linalg.eigh`` (what the dense backend
uses where an autograd graph is kept) for comparison. Settings:

- ``1d``: inputs uniform on [0, 10], lengthscale 1 (a fast-decaying spectrum);
- ``3d``: inputs uniform on [0, 10]^3, lengthscale 1;
- ``48d``: standard normal inputs in 48 dimensions, lengthscale 6 (every eigenvalue above 1e-7);
- ``deliveries``: the 30 standardised inputs of the deliveries data, lengthscale 6.

Each cell runs in a fresh process (so that no library's idle worker threads from the previous
cell take a core), once as a warm-up, then ``--repeats`` times; the median is reported; a cell is
stopped after ``--max-seconds``. The relative
error column compares every gpsd row with the dense eigendecomposition's means and variances.

Usage::

    python benchmarks/bench_hard_spectrum_vs_sklearn.py --out benchmarks/results/hard_spectrum_vs_sklearn_cpu.md
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import platform
import statistics
import subprocess
import sys
import time
from unittest import mock

import gpytorch
import numpy as np
import sklearn
import torch
from _timing import Report, cpu_name, load_line
from sklearn.gaussian_process import GaussianProcessRegressor
from sklearn.gaussian_process.kernels import RBF

import gpsd.linalg.backend as backend_module
from gpsd import DataCentricGPR
from gpsd.data import load_dataset
from gpsd.linalg import KernelSpectrum

SETTINGS = ("1d", "3d", "48d", "deliveries")
BACKENDS = ("auto", "dense", "dense (eigh)", "cholesky", "lanczos", "cg")
N, M, T = 2000, 1000, 100


def problem(name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """Training inputs, targets, test inputs and the RBF lengthscale of a setting."""
    gen = torch.Generator().manual_seed(0)
    if name == "deliveries":
        split = load_dataset("deliveries", n_train=N, n_test=M, seed=0)
        return split.train_x, split.train_y, split.test_x, 6.0
    if name == "48d":
        x = torch.randn(N + M, 48, generator=gen, dtype=torch.float64)
        lengthscale = 6.0
    else:
        d = int(name[0])
        x = 10 * torch.rand(N + M, d, generator=gen, dtype=torch.float64)
        lengthscale = 1.0
    y = torch.sin(x[:N]).sum(-1) + 0.3 * torch.randn(N, generator=gen, dtype=torch.float64)
    return x[:N], y, x[N:], lengthscale


def kernel(lengthscale: float) -> gpytorch.kernels.Kernel:
    k = gpytorch.kernels.RBFKernel().to(torch.float64)
    k.lengthscale = lengthscale
    return k


def gpsd_run(name: str, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    x, y, test_x, lengthscale = problem(name)
    noise = torch.linspace(0.1, 1.0, T, dtype=torch.float64)
    forced = "dense" if backend == "dense (eigh)" else backend
    model = DataCentricGPR(x, y, kernel(lengthscale), noise=noise, backend=forced)
    with torch.no_grad():
        prediction = model.predict(test_x)
    return prediction.mean, prediction.variance


def sklearn_run(name: str) -> None:
    x, y, test_x, lengthscale = problem(name)
    gp = GaussianProcessRegressor(RBF(lengthscale), alpha=0.1, optimizer=None)
    gp.fit(x.numpy(), y.numpy())
    gp.predict(test_x.numpy(), return_std=True)


def timed(fn, repeats: int) -> tuple[float, object]:
    out = fn()  # warm-up
    times = []
    for _ in range(repeats):
        gc.collect()  # the previous model's factorisation (a Cholesky chain holds T factors)
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def eigh_only():
    """The dense backend with ``torch.linalg.eigh`` in place of the tridiagonal reduction."""
    return mock.patch.object(
        backend_module,
        "_full_spectrum",
        lambda dense, dtype, keep_graph: KernelSpectrum.from_dense(dense, dtype=dtype),
    )


def child(name: str, backend: str, repeats: int) -> None:
    """Run one cell and print its time (and gpsd's results) as JSON, for the parent: every cell
    runs in a fresh process, so that no library's idle worker threads (OpenBLAS spins for a
    while after each call) take cores from the next cell."""
    if backend == "scikit-learn":
        seconds, _ = timed(lambda: sklearn_run(name), repeats)
        print(json.dumps({"seconds": seconds}))
        return
    if backend == "dense (eigh)":
        with eigh_only():
            seconds, (mean, variance) = timed(lambda: gpsd_run(name, "dense"), repeats)
    else:
        seconds, (mean, variance) = timed(lambda: gpsd_run(name, backend), repeats)
    print(json.dumps({"seconds": seconds, "mean": mean.tolist(), "variance": variance.tolist()}))


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got - ref).abs().max() / ref.abs().max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=SETTINGS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-seconds", type=float, default=120.0)
    parser.add_argument("--out", default=None)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child, args.repeats)
        return
    report = Report(args.out)
    report.add(
        "# Every data-centric step against one scikit-learn fit + predict (slowly decaying spectra)",
        "",
        f"- machine: {cpu_name()}, {torch.get_num_threads()} torch threads; device: cpu; "
        "dtype: float64",
        f"- torch {torch.__version__}, gpytorch {gpytorch.__version__}, scikit-learn "
        f"{sklearn.__version__}, numpy {np.__version__}, Python {platform.python_version()}",
        f"- command: `python benchmarks/bench_hard_spectrum_vs_sklearn.py "
        f"{' '.join(sys.argv[1:])}`",
        f"- N = {N} training points, M = {M} test points, T = {T} steps, noise "
        "linspace(0.1, 1, 100); gpsd predicts every step's means and variances under "
        "`torch.no_grad()`; scikit-learn fits once (alpha = 0.1, optimizer=None) and predicts "
        "means and standard deviations",
        f"- median of {args.repeats} after a warm-up, each cell in a fresh process stopped after "
        f"{args.max_seconds:.0f} s",
        "",
    )
    for name in args.settings:
        rows, reference, sk_seconds = [], None, math.nan
        for backend in ("scikit-learn", *BACKENDS):
            command = [sys.executable, __file__, "--child", name, backend]
            command += ["--repeats", str(args.repeats)]
            try:
                done = subprocess.run(
                    command, capture_output=True, text=True, timeout=args.max_seconds
                )
            except subprocess.TimeoutExpired:
                rows.append((backend, math.inf, None, f"> {args.max_seconds:.0f} (stopped)"))
                continue
            if done.returncode != 0:  # the backend refused the problem: say why
                reason = done.stderr.strip().splitlines()[-1][:160]
                rows.append((backend, math.inf, None, f"failed: {reason}"))
                continue
            result = json.loads(done.stdout.strip().splitlines()[-1])
            if backend == "scikit-learn":
                sk_seconds = result["seconds"]
                continue
            seconds = result["seconds"]
            mean = torch.tensor(result["mean"], dtype=torch.float64)
            variance = torch.tensor(result["variance"], dtype=torch.float64)
            if backend == "dense (eigh)":
                reference = (mean, variance)
            rows.append((backend, seconds, mean, variance))
        best = min(s for b, s, *_ in rows if b not in ("auto", "dense (eigh)"))
        report.add(
            f"## {name}",
            "",
            f"scikit-learn fit + predict: {sk_seconds:.3f} s",
            "",
            "| gpsd backend | time (s) | × scikit-learn | × best forced | rel. error of means "
            "/ variances vs eigh |",
            "|---|---:|---:|---:|---|",
        )
        for backend, seconds, mean, variance in rows:
            if math.isinf(seconds):
                report.add(f"| {backend} | {variance} | — | — | — |")
                continue
            errors = (
                f"{relative_error(mean, reference[0]):.1e} / "
                f"{relative_error(variance, reference[1]):.1e}"
            )
            report.add(
                f"| {backend} | {seconds:.3f} | {seconds / sk_seconds:.2f} | "
                f"{seconds / best:.2f} | {errors} |"
            )
        report.add("")
    report.add(load_line())
    report.close()


if __name__ == "__main__":
    main()
