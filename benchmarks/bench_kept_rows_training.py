"""How many kernel rows to keep while training: time per iteration and peak memory of
GPyTorch's own training loop over a :class:`gpsd.ChunkedKernel`, for several ``cache_bytes``.

An ``ExactGP`` with an ARD RBF kernel on ``--n`` training flights (:func:`gpsd.data.load_dataset`
``"flights"``), wrapped in ``gpsd.ChunkedKernel(chunk_size=--chunk, cache_bytes=...)``, trained
by Adam on GPyTorch's ``ExactMarginalLogLikelihood`` at its default settings (CG and SLQ), the
probes of iteration ``i`` drawn after seeding ``i``. Each budget runs in a process of its own,
so that its peak resident memory (``VmHWM``) is its own; the first iteration is timed apart
(warm-up), the table gives the median of the others. A budget changes which rows are read
rather than evaluated, and the products only by rounding (kept rows have their negligible
entries zeroed); at GPyTorch's training tolerance (``cg_tolerance`` 1) CG turns such differences
into differences of the losses in the third decimal after a few iterations.

Usage (from the repository root)::

    OMP_NUM_THREADS=2 python benchmarks/bench_kept_rows_training.py --n 20000 \\
        --cache-gib 0 1.5 2.5 3 --out benchmarks/results/kept_rows_training_cpu.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import gpytorch
import torch
from _problems import ExactRegressor
from _timing import Report, cpu_name, peak_gib, reset_peak

import gpsd
from gpsd.data import load_dataset


def run_one(args: argparse.Namespace) -> dict:
    """Train ``args.iters`` iterations with ``args.one`` GiB of kept rows; the seconds of each
    iteration, the losses and the peak resident memory."""
    data = load_dataset("flights", n_train=args.n, n_test=100, seed=0, dtype=torch.float64)
    x, y = data.train_x, data.train_y
    base = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=x.shape[-1]))
    base = base.to(torch.float64)
    kernel = gpsd.ChunkedKernel(base, chunk_size=args.chunk, cache_bytes=int(args.one * 2**30))
    likelihood = gpytorch.likelihoods.GaussianLikelihood().to(torch.float64)
    likelihood.noise = 0.1
    model = ExactRegressor(x, y, likelihood, kernel)
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(likelihood, model)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model.train()
    reset_peak(torch.device("cpu"))
    seconds, losses = [], []
    for i in range(args.iters):
        start = time.perf_counter()
        torch.manual_seed(i)
        optimizer.zero_grad()
        loss = -mll(model(x), y)
        loss.backward()
        optimizer.step()
        seconds.append(time.perf_counter() - start)
        losses.append(loss.item())
    return {"seconds": seconds, "losses": losses, "peak": peak_gib(torch.device("cpu"))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=20_000, help="training flights")
    parser.add_argument("--cache-gib", type=float, nargs="+", default=[0.0, 1.5, 2.5, 3.0])
    parser.add_argument("--chunk", type=int, default=1024, help="rows evaluated at once")
    parser.add_argument("--iters", type=int, default=3, help="Adam iterations (the first: warm-up)")
    parser.add_argument("--out", default=None, help="also write the Markdown report here")
    parser.add_argument("--one", type=float, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.iters < 2:
        parser.error("--iters must be at least 2 (the first iteration is the warm-up)")
    if args.one is not None:
        print(json.dumps(run_one(args)))
        return
    kernel_gib = args.n**2 * 8 / 2**30
    report = Report(args.out)
    report.add(
        f"# Kept kernel rows while training: N = {args.n:,} flights",
        "",
        f"{cpu_name()}, {torch.get_num_threads()} threads, float64, ARD RBF on 6 inputs, "
        f"GPyTorch's loop over gpsd.ChunkedKernel(chunk_size={args.chunk}), Adam lr 0.1, "
        f"{args.iters} iterations (the first a warm-up); K itself is {kernel_gib:.2f} GiB. "
        f"torch {torch.__version__}, gpytorch {gpytorch.__version__}, gpsd {gpsd.__version__}, "
        f"Python {platform.python_version()}. Each budget in its own process.",
        "",
        "| kept rows (GiB) | share of K | s / iteration (median after the first) | first (s) "
        "| peak RSS (GiB) | last loss |",
        "|---:|---:|---:|---:|---:|---:|",
    )
    for gib in args.cache_gib:
        command = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--one", str(gib)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            report.add(f"| {gib:g} | failed: {done.stderr.strip().splitlines()[-1]} | | | | |")
            continue
        r = json.loads(done.stdout.strip().splitlines()[-1])
        share = min(1.0, gib / kernel_gib)
        report.add(
            f"| {gib:g} | {share:.0%} | {statistics.median(r['seconds'][1:]):.1f} "
            f"| {r['seconds'][0]:.1f} | {r['peak']:.2f} | {r['losses'][-1]:.6f} |"
        )
    report.close()


if __name__ == "__main__":
    main()
