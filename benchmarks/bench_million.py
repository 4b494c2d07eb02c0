"""All distillation steps at N = 1,000,000 on one GPU: time, peak memory, accuracy.

Fits :class:`gpsd.DataCentricGPR` (``backend="lanczos"``: matrix-free block Lanczos over row
chunks of the kernel, never forming K) to ``--n`` points uniform on [0, 10]^2 (targets
sin(x1) + sin(x2) + noise, float32 data, float64 factorisation), and predicts the means and
variances of all ``--steps`` steps at ``--m`` test points. Reports the wall times of the fit
and of the prediction (CUDA synchronised), the number of Lanczos blocks and the median time of
one (from the fit's ``callback``: one product with K each), the peak device memory, the Krylov
rank and the backend's error estimate, and writes each row as soon as it is measured
(``--out``). Several ``--n`` run in turn, so that the time per block at smaller N predicts
whether the largest fits the time at hand.

The accuracy check runs first, at ``--compare-n`` (default 131,072) with float64 data, where a
second matrix-free path, deflated CG (every solve to a relative residual of 1e-6), still runs in
seconds: the largest relative differences of the means and variances of all steps between the
two paths, against the backends' tolerance ``rtol`` = 1e-6. There is no dense reference at
these N (K alone would take 4 TB at N = 1e6), and GPyTorch's KeOps ExactGP needs pykeops, which
this script does not install.

Usage (one GPU)::

    python benchmarks/bench_million.py --n 262144 524288 1000000 --compare-n 0 \\
        --out benchmarks/results/gpu_million.md
    # a CPU smoke run
    python benchmarks/bench_million.py --device cpu --n 2048 4096 --m 500 --compare-n 2048
"""

from __future__ import annotations

import argparse
import gc
import platform
import statistics
import time
from dataclasses import dataclass

import gpytorch
import torch
from _problems import rbf_kernel, uniform_square_problem
from _timing import Report, cpu_name, peak_rss_kib, start_peak_rss, sync

import gpsd
from gpsd import DataCentricGPR


def _device_line(device: torch.device) -> str:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return f"{props.name}, {props.total_memory / 2**30:.1f} GiB"
    return cpu_name()


def _reset_peak(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    else:
        start_peak_rss()


def _peak_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return peak_rss_kib() / 2**20


@dataclass
class Run:
    """One fit + prediction of every step."""

    fit_seconds: float
    predict_seconds: float
    peak_gib: float
    #: Seconds between the Lanczos blocks' callbacks (one product with K each, with the
    #: block's orthogonalisation and Rayleigh-Ritz step); empty for a backend without blocks.
    block_seconds: list[float]
    prediction: object
    model: DataCentricGPR

    @property
    def seconds(self) -> float:
        return self.fit_seconds + self.predict_seconds


def run(n, m, steps, backend, args, device, dtype) -> Run:
    """Fit (timing each Lanczos block through the ``callback``), then predict every step."""
    x, y, test_x = uniform_square_problem(n, m, device, dtype)
    kernel = rbf_kernel(args.lengthscale, device, dtype)
    noise = torch.linspace(0.1, 1.0, steps, dtype=dtype, device=device)
    _reset_peak(device)
    marks = []

    def mark(record) -> None:
        sync(device)
        marks.append(time.perf_counter())

    sync(device)
    start = time.perf_counter()
    with torch.no_grad(), gpsd.settings.test_chunk_size(args.test_chunk):
        model = DataCentricGPR(x, y, kernel, noise=noise, backend=backend, rtol=1e-6)
        model.fit(callback=mark)
        sync(device)
        fitted = time.perf_counter()
        prediction = model.predict(test_x)
    sync(device)
    done = time.perf_counter()
    blocks = [b - a for a, b in zip([start, *marks[:-1]], marks, strict=True)]
    return Run(fitted - start, done - fitted, _peak_gib(device), blocks, prediction, model)


def _blocks(result: Run) -> str:
    """The number of Lanczos blocks and the median seconds of one."""
    if not result.block_seconds:
        return "— | —"
    return f"{len(result.block_seconds)} | {statistics.median(result.block_seconds):.2f}"


def _rank(model) -> int:
    engine = model._state()["engine"]
    return int(engine.ritz_values.shape[-1]) if hasattr(engine, "ritz_values") else 0


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--n", type=int, nargs="+", default=[1_000_000], help="sizes, run in this order"
    )
    parser.add_argument("--m", type=int, default=10_000, help="test points")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--lengthscale", type=float, default=1.0)
    parser.add_argument(
        "--compare-n", type=int, default=131_072, help="N of the agreement check (0: none)"
    )
    parser.add_argument(
        "--test-chunk", type=int, default=1024, help="gpsd.settings.test_chunk_size"
    )
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return
    dtype = getattr(torch, args.dtype)
    report = Report(args.out)
    sizes = " ".join(str(n) for n in args.n)
    report.add(
        f"# All {args.steps} data-centric steps at large N ({args.dtype} data, float64 "
        "factorisation)",
        "",
        f"- device: {_device_line(device)}; torch {torch.__version__}, gpytorch "
        f"{gpytorch.__version__}, Python {platform.python_version()}",
        f"- command: `python benchmarks/bench_million.py --n {sizes} --m {args.m} --steps "
        f"{args.steps} --compare-n {args.compare_n} --device {args.device} --dtype {args.dtype}`",
        f"- problem: inputs uniform on [0, 10]^2, RBF lengthscale {args.lengthscale}, noise "
        f"schedule linspace(0.1, 1, {args.steps}), {args.m} test points; one call each (the "
        "time includes the first evaluation of every kernel row); a Lanczos block is one "
        "product with K and its orthogonalisation, timed between the fit's callbacks",
        "",
        "| N | backend | fit (s) | predict (s) | peak (GiB) | Lanczos blocks | s per block "
        "| Krylov rank | error estimate |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    )
    if args.compare_n:
        rows = {}
        for backend in ("lanczos", "cg"):  # float64 data: agreement beyond float32 rounding
            result = run(args.compare_n, args.m, args.steps, backend, args, device, torch.float64)
            rows[backend] = result.prediction
            model = result.model
            estimate = f"{model.error_estimate:.1e}" if backend == "lanczos" else "(solves to 1e-6)"
            report.add(
                f"| {args.compare_n:,} (float64 data) | {backend} | {result.fit_seconds:.1f} | "
                f"{result.predict_seconds:.1f} | {result.peak_gib:.1f} | {_blocks(result)} | "
                f"{_rank(model)} | {estimate} |"
            )
            del result, model
        agreement = (
            f"- agreement at N = {args.compare_n:,} (float64 data, all {args.steps} steps, "
            f"{args.m} test points), Lanczos against CG: means "
            f"{_relative(rows['lanczos'].mean, rows['cg'].mean):.1e}, variances "
            f"{_relative(rows['lanczos'].variance, rows['cg'].variance):.1e} (largest "
            "difference over the largest value)."
        )
        del rows
        report.add("", agreement, "")
    for n in args.n:
        result = run(n, args.m, args.steps, "lanczos", args, device, dtype)
        prediction = result.prediction
        finite = bool(
            torch.isfinite(prediction.mean).all() and torch.isfinite(prediction.variance).all()
        )
        report.add(
            f"| {n:,} | lanczos | {result.fit_seconds:.1f} | {result.predict_seconds:.1f} | "
            f"{result.peak_gib:.1f} | {_blocks(result)} | {_rank(result.model)} | "
            f"{result.model.error_estimate:.1e} |",
        )
        if not finite:
            report.add("", f"- N = {n:,}: some means or variances are not finite.", "")
        del result, prediction


if __name__ == "__main__":
    main()
