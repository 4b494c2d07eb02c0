"""All distillation steps at N = 1,000,000 on one GPU: time, peak memory, accuracy.

Fits :class:`gpsd.DataCentricGPR` (``backend="lanczos"``: matrix-free block Lanczos over row
chunks of the kernel, never forming K) to ``--n`` points uniform on [0, 10]^2 (targets
sin(x1) + sin(x2) + noise, float32 data, float64 factorisation), and predicts the means and
variances of all ``--steps`` steps at ``--m`` test points. Reports the wall times of the fit
and of the prediction (CUDA synchronised), the peak device memory, the Krylov rank, the order
of the complement series, the backend's error estimate, and the number of products with K
with the median time of one. Each product is timed on its own: one for the random start
block and one per Lanczos block, after the two probe products of the flat-spectrum check where
a dense backend would fit (none does at these N on a GPU). Every product's time is printed as
it ends, so a run cut short by a time limit still shows how far it got; each row is written as
soon as it is measured (``--out``). Several ``--n`` run in turn, so that the time per product
at smaller N predicts whether the largest fits the time at hand (it grows as N^2).

The accuracy check runs first, at ``--compare-n`` (default 32,768) with float64 data, where a
second matrix-free path, deflated CG (every solve to a relative residual of 1e-6), runs in
under half a minute on an H200: the largest relative differences of the means and variances
of all steps between the two paths, against the backends' tolerance ``rtol`` = 1e-6. There is
no dense reference at these N (K alone would take 4 TB at N = 1e6), and GPyTorch's KeOps
ExactGP needs pykeops, which this script does not install.

Usage (one GPU)::

    python benchmarks/bench_million.py --n 262144 524288 1000000 --compare-n 0 \\
        --out benchmarks/results/gpu_million.md
    # the agreement check alone
    python benchmarks/bench_million.py --n --compare-n 65536
    # a CPU smoke run
    python benchmarks/bench_million.py --device cpu --n 2048 4096 --m 500 --compare-n 2048

``--save-step-one PATH`` keeps step 1 of each ``--n`` (the posterior at noise 0.1), so that
``bench_keops_exactgp.py --reference PATH`` compares GPyTorch's KeOps posterior with it at the
same N without fitting gpsd a second time.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from dataclasses import dataclass

import gpytorch
import torch
from _engine import krylov_rank, series_order
from _problems import rbf_kernel, uniform_square_problem
from _timing import Report, device_name, peak_gib, reset_peak, sync

import gpsd
from gpsd import DataCentricGPR
from gpsd.linalg import ChunkedKernelOperator


@dataclass
class Run:
    """One fit + prediction of every step."""

    fit_seconds: float
    predict_seconds: float
    peak_gib: float
    #: Seconds of each product with K in the fit (synchronised before and after).
    product_seconds: list[float]
    #: Number of Lanczos blocks (the fit's callbacks); 0 for a backend without blocks.
    blocks: int
    prediction: object
    model: DataCentricGPR

    @property
    def seconds(self) -> float:
        return self.fit_seconds + self.predict_seconds


class ProductTimer:
    """Times every product of a :class:`~gpsd.linalg.ChunkedKernelOperator` while active (the
    benchmark's instrument: the operator itself keeps no clock), printing each as it ends."""

    def __init__(self, device: torch.device, label: str) -> None:
        self.device, self.label = device, label
        self.seconds: list[float] = []
        self._original = ChunkedKernelOperator._matmul

    def __enter__(self) -> ProductTimer:
        timer, original = self, self._original

        def timed(operator, rhs):
            sync(timer.device)
            start = time.perf_counter()
            out = original(operator, rhs)
            sync(timer.device)
            timer.seconds.append(time.perf_counter() - start)
            print(
                f"  {timer.label}: product {len(timer.seconds)} with K ({rhs.shape[-1]} columns) "
                f"{timer.seconds[-1]:.2f} s",
                flush=True,
            )
            return out

        ChunkedKernelOperator._matmul = timed
        return self

    def __exit__(self, *exc) -> None:
        ChunkedKernelOperator._matmul = self._original


def run(n, m, steps, backend, args, device, dtype) -> Run:
    """Fit (timing each product with K), then predict every step."""
    x, y, test_x = uniform_square_problem(n, m, device, dtype)
    kernel = rbf_kernel(args.lengthscale, device, dtype)
    noise = torch.linspace(0.1, 1.0, steps, dtype=dtype, device=device)
    reset_peak(device)
    blocks = 0

    def count(record) -> None:
        nonlocal blocks
        blocks += 1

    label = f"N = {n:,} {backend}"
    sync(device)
    start = time.perf_counter()
    with torch.no_grad(), gpsd.settings.test_chunk_size(args.test_chunk):
        with ProductTimer(device, label) as timer:
            model = DataCentricGPR(x, y, kernel, noise=noise, backend=backend, rtol=1e-6)
            model.fit(callback=count)
            sync(device)
        fitted = time.perf_counter()
        print(
            f"  {label}: fit {fitted - start:.1f} s, {len(timer.seconds)} products, "
            f"rank {krylov_rank(model)}, series order {series_order(model)}",
            flush=True,
        )
        prediction = model.predict(test_x)
    sync(device)
    done = time.perf_counter()
    return Run(
        fitted - start, done - fitted, peak_gib(device), timer.seconds, blocks, prediction, model
    )


def _products(result: Run) -> str:
    """The number of products with K in the fit, the Lanczos blocks among them, and the median
    seconds of one product."""
    if not result.product_seconds:
        return "— | — | —"
    median = statistics.median(result.product_seconds)
    return f"{len(result.product_seconds)} | {result.blocks} | {median:.2f}"


def _step_one(result: Run, args) -> dict:
    """Step 1 of a run at the test points of :func:`uniform_square_problem` (seed 0), on the CPU
    in float64, with what the run cost: the reference of ``bench_keops_exactgp.py --reference``."""
    return {
        "m": args.m,
        "steps": args.steps,
        "dtype": args.dtype,
        "mean": result.prediction.mean[..., 0, :].cpu().double(),
        "variance": result.prediction.variance[..., 0, :].cpu().double(),
        "seconds": result.seconds,
        "peak_gib": result.peak_gib,
    }


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--n",
        type=int,
        nargs="*",
        default=[1_000_000],
        help="sizes, run in this order (none: the agreement check alone)",
    )
    parser.add_argument("--m", type=int, default=10_000, help="test points")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--lengthscale", type=float, default=1.0)
    parser.add_argument(
        "--compare-n", type=int, default=32_768, help="N of the agreement check (0: none)"
    )
    parser.add_argument(
        "--test-chunk", type=int, default=1024, help="gpsd.settings.test_chunk_size"
    )
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--save-step-one",
        default=None,
        metavar="PATH",
        help="save step 1's means and variances of each --n, with the fit's time and peak, for "
        "bench_keops_exactgp.py --reference",
    )
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
        f"- device: {device_name(device)}; torch {torch.__version__}, gpytorch "
        f"{gpytorch.__version__}, Python {platform.python_version()}",
        f"- command: `python benchmarks/bench_million.py --n {sizes} --m {args.m} --steps "
        f"{args.steps} --compare-n {args.compare_n} --device {args.device} --dtype {args.dtype}`",
        f"- problem: inputs uniform on [0, 10]^2, RBF lengthscale {args.lengthscale}, noise "
        f"schedule linspace(0.1, 1, {args.steps}), {args.m} test points; one call each (the "
        "time includes the first evaluation of every kernel row); the fit's products with K "
        "are one for the random start block and one per Lanczos block (after two probes "
        "where a dense backend would fit), each timed alone (synchronised)",
        "",
        "| N | backend | fit (s) | predict (s) | peak (GiB) | products with K | Lanczos blocks "
        "| s per product | Krylov rank | series order | error estimate |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
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
                f"{result.predict_seconds:.1f} | {result.peak_gib:.1f} | {_products(result)} | "
                f"{krylov_rank(model)} | {series_order(model)} | {estimate} |"
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
    saved = {}
    for n in args.n:
        result = run(n, args.m, args.steps, "lanczos", args, device, dtype)
        prediction = result.prediction
        if args.save_step_one:
            saved[n] = _step_one(result, args)
            torch.save(saved, args.save_step_one)
        finite = bool(
            torch.isfinite(prediction.mean).all() and torch.isfinite(prediction.variance).all()
        )
        report.add(
            f"| {n:,} | lanczos | {result.fit_seconds:.1f} | {result.predict_seconds:.1f} | "
            f"{result.peak_gib:.1f} | {_products(result)} | {krylov_rank(result.model)} | "
            f"{series_order(result.model)} | {result.model.error_estimate:.1e} |",
        )
        if not finite:
            report.add("", f"- N = {n:,}: some means or variances are not finite.", "")
        del result, prediction


if __name__ == "__main__":
    main()
