"""One matrix-free product K B at large N: gpsd's RBF rows against GPyTorch's evaluation.

Every product of the matrix-free backends at large N evaluates all N^2 kernel entries afresh
(no row fits in memory at N = 10^6), so the evaluation of a chunk of rows is the cost of a
Lanczos or CG fit there. This script times one product of a scaled RBF kernel matrix (float64,
the factorisation's dtype) with B of ``--columns`` columns, chunk by chunk over 2048 rows, in
two ways, in the same process:

- ``gpytorch``: ``to_dense(kernel(x[i:j], x)) @ B`` per chunk, what the operator does for any
  GPyTorch kernel (squared distances, clamp, halve, exponential, scale: five operations over the
  block, the last into a new tensor);
- ``gpsd``: :class:`gpsd.linalg.ChunkedKernelOperator` with no row kept, which evaluates RBF rows
  as one matrix product of augmented inputs (accumulated in float64), capped at the log
  outputscale and exponentiated in place: three operations over the block.

The two products are checked against each other (relative difference, float64) before timing.
Median of ``--repeats`` after one warm-up, synchronised on CUDA.

Usage::

    python benchmarks/bench_kernel_rows.py --device cpu --n 16384 32768 \\
        --out benchmarks/results/kernel_rows_cpu.md
    python benchmarks/bench_kernel_rows.py --device cuda --n 262144 524288 \\
        --out benchmarks/results/kernel_rows_h200.md
"""

from __future__ import annotations

import argparse
import platform

import gpytorch
import torch
from _problems import rbf_kernel, uniform_square_problem
from _timing import Report, cpu_name, cuda_missing, median_time
from linear_operator import to_dense

from gpsd.linalg import ChunkedKernelOperator

CHUNK = 2048


def gpytorch_product(kernel, x: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    """K B by GPyTorch's evaluation of each chunk of rows."""
    out = torch.empty_like(rhs)
    with torch.no_grad():
        for start in range(0, x.shape[0], CHUNK):
            rows = x[start : start + CHUNK]
            out[start : start + rows.shape[0]] = to_dense(kernel(rows, x)) @ rhs
    return out


def measure(n: int, columns: int, repeats: int, device: torch.device) -> tuple:
    """Median seconds of GPyTorch's and gpsd's product at ``n``, and their relative difference."""
    x, _, _ = uniform_square_problem(n, 1, device, torch.float64)
    kernel = rbf_kernel(1.0, device, torch.float64)
    rhs = torch.randn(n, columns, dtype=torch.float64, device=device)
    operator = ChunkedKernelOperator(x, covar_module=kernel, chunk_size=CHUNK)
    with torch.no_grad():
        reference = gpytorch_product(kernel, x, rhs)
        ours = operator @ rhs
        difference = float((ours - reference).abs().max() / reference.abs().max())
        del reference, ours
        slow = median_time(lambda: gpytorch_product(kernel, x, rhs), repeats, device)
        fast = median_time(lambda: operator @ rhs, repeats, device)
    return slow, fast, difference


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, nargs="+", default=[16384, 32768])
    parser.add_argument("--columns", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    if cuda_missing(device):
        return
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    report = Report(args.out)
    sizes = " ".join(str(n) for n in args.n)
    report.add(
        "# One product K B (float64, scaled RBF on [0, 10]^2, no row kept): gpsd's RBF rows "
        "against GPyTorch's evaluation",
        "",
        f"- device: {name}; torch {torch.__version__}, gpytorch {gpytorch.__version__}, Python "
        f"{platform.python_version()}, {torch.get_num_threads()} threads",
        f"- command: `python benchmarks/bench_kernel_rows.py --device {args.device} --n {sizes} "
        f"--columns {args.columns} --repeats {args.repeats}`",
        f"- B has {args.columns} columns; chunks of {CHUNK} rows; median of {args.repeats} "
        "after one warm-up",
        "",
        "| N | GPyTorch rows (s) | gpsd rows (s) | GPyTorch ÷ gpsd | entries/s (gpsd) "
        "| relative difference |",
        "|---:|---:|---:|---:|---:|---:|",
    )
    for n in args.n:
        slow, fast, difference = measure(n, args.columns, args.repeats, device)
        report.add(
            f"| {n:,} | {slow:.3f} | {fast:.3f} | {slow / fast:.2f} | {n * n / fast:.2e} "
            f"| {difference:.1e} |"
        )
    report.close()


if __name__ == "__main__":
    main()
