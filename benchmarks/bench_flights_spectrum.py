"""How the Lanczos backend's truncation grows with N on the flights, at learnt hyperparameters.

The hyperparameters are learnt once, on a random ``--pretrain``-point subset by the exact
marginal likelihood (:func:`pretrained_ard_rbf`, Wang et al.'s 2019 start), then held fixed
while N grows. For each ``--sizes`` N, ``DataCentricGPR(backend="lanczos")`` fits ``--steps``
steps at the learnt noise with Lanczos' default budget (:class:`gpsd.settings.max_lanczos_rank`
Krylov columns); the table gives the Ritz pairs it resolved, the norm of the complement it
leaves, the order of the Taylor series that carries the complement (each two orders one
product with K per test column at prediction), the backend's error estimate against ``rtol``,
and the fit's and a prediction's time. Where the complement reaches the noise the series
diverges and Lanczos fails: ``backend="auto"`` then deflates CG with the Ritz pairs.

The point of the table is the trend: how far the default Lanczos budget carries an exact GP on
real data, and so what the GPU's all-of-flights run (``gpu_suite.sh 8``) meets.

Usage (from the repository root)::

    OMP_NUM_THREADS=2 python benchmarks/bench_flights_spectrum.py \\
        --out benchmarks/results/flights_spectrum_cpu.md
"""

from __future__ import annotations

import argparse
import platform
import time

import gpytorch
import torch
from _engine import engine_of, krylov_rank, series_order
from _problems import ard_rbf_kernel, pretrained_ard_rbf
from _timing import Report, device_name, peak_gib, reset_peak, sync

import gpsd
from gpsd import DataCentricGPR
from gpsd.data import load_dataset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[5_000, 10_000, 20_000, 40_000])
    parser.add_argument("--pretrain", type=int, default=3_000, help="subset the start is learnt on")
    parser.add_argument("--pretrain-iters", type=int, default=60)
    parser.add_argument("--m", type=int, default=500, help="test points predicted")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rtol", type=float, default=1e-6)
    parser.add_argument("--cache-gib", type=float, default=3.0, help="kernel rows kept, GiB")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    largest = load_dataset("flights", n_train=max(args.sizes), n_test=args.m, seed=args.seed)
    start = pretrained_ard_rbf(
        largest.train_x.to(device),
        largest.train_y.to(device),
        args.pretrain,
        args.pretrain_iters,
        seed=args.seed,
    )
    report = Report(args.out)
    lengthscales = ", ".join(f"{v:.2f}" for v in start["lengthscale"])
    report.add(
        "# The Lanczos backend's truncation against N on the flights",
        "",
        f"{device_name(device)}, "
        f"{torch.get_num_threads()} threads, float64; ARD RBF on the six flights inputs with the "
        f"hyperparameters learnt on {args.pretrain:,} random training rows by "
        f"{args.pretrain_iters} exact Adam iterations ({start['seconds']:.0f} s): lengthscales "
        f"{lengthscales}, outputscale {start['outputscale']:.3f}, noise {start['noise']:.4f}. "
        f"`DataCentricGPR(backend='lanczos', rtol={args.rtol:g})`, {args.steps} steps at that "
        f"noise, at most {gpsd.settings.max_lanczos_rank.value()} Krylov columns, kernel rows "
        f"kept within {args.cache_gib:g} GiB; the prediction: means and variances of every step "
        f"at {args.m} test points. torch {torch.__version__}, gpytorch {gpytorch.__version__}, "
        f"gpsd {gpsd.__version__}, Python {platform.python_version()}.",
        "",
        "| N | Krylov columns | Ritz pairs resolved | complement norm | complement / noise "
        "| series order | error estimate | fit (s) | predict (s) | peak (GiB) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    )
    for n in sorted(args.sizes):
        rows = slice(0, n)  # the first n of the largest draw: each N holds the smaller ones
        x = largest.train_x[rows].to(device)
        y = largest.train_y[rows].to(device)
        model = DataCentricGPR(
            x,
            y,
            ard_rbf_kernel(len(start["lengthscale"]), torch.float64, device, start),
            noise=start["noise"],
            num_steps=args.steps,
            backend="lanczos",
            rtol=args.rtol,
            kernel_cache_bytes=int(args.cache_gib * 2**30),
        )
        reset_peak(device)
        try:
            sync(device)
            begin = time.perf_counter()
            with torch.no_grad():
                model.fit()
                sync(device)
                fitted = time.perf_counter()
                model.predict(largest.test_x.to(device))
                sync(device)
        except ValueError as err:  # the complement series diverges
            report.add(f"| {n:,} | failed: {err} |" + " |" * 8)
            continue
        done = time.perf_counter()
        engine = engine_of(model)
        norm = engine.complement_norm
        report.add(
            f"| {n:,} | {krylov_rank(model)} | {int(engine.num_resolved.max())} | {norm:.2e} "
            f"| {norm / start['noise']:.1e} | {series_order(model)} "
            f"| {model.error_estimate:.1e} | {fitted - begin:.1f} | {done - fitted:.1f} "
            f"| {peak_gib(device):.2f} |"
        )
    report.close()


if __name__ == "__main__":
    main()
