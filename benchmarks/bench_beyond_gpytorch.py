"""Training an exact GP on flights at an N where GPyTorch's ExactGP does not fit in this machine's
memory: GPyTorch's own loop with the kernel wrapped in :class:`gpsd.ChunkedKernel`, within a
memory budget, beside the same loop on the plain kernel.

Both sides train an ``ExactGP`` (zero mean, ARD RBF on the six flights inputs, a
``GaussianLikelihood``) by ``ExactMarginalLogLikelihood`` and Adam (lr 0.1) for ``--iters``
iterations from lengthscales 1, outputscale 1, noise 0.1, on GPyTorch's default settings (CG,
SLQ, a pivoted-Cholesky preconditioner), the probes of iteration ``i`` drawn after
``torch.manual_seed(i)``. gpsd's side keeps at most ``--cache-gib`` of kernel rows and evaluates
``--chunk-size`` rows at a time. GPyTorch's side runs under an address-space limit of
``--cap-gib`` (``RLIMIT_AS``), so that running out of memory is an allocation error in that
process rather than the system's out-of-memory killer. Each side runs in its own process; the
table gives its seconds per iteration (the median after the first), CPU seconds per iteration,
peak resident set, and the loss at every iteration.

Usage::

    OMP_NUM_THREADS=2 python benchmarks/bench_beyond_gpytorch.py --n 30000 --iters 3 \\
        --out benchmarks/results/beyond_gpytorch_cpu.md
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
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


def run_side(args: argparse.Namespace) -> dict:
    """Train on one side; returns its timings, peak and losses."""
    if args.side == "gpytorch":
        cap = int(args.cap_gib * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    data = load_dataset("flights", n_train=args.n, n_test=10, seed=0, dtype=torch.float64)
    x, y = data.train_x, data.train_y
    base = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=x.shape[-1]))
    base.base_kernel.lengthscale = 1.0
    base.outputscale = 1.0
    kernel = base
    if args.side == "gpsd":
        cache = int(args.cache_gib * 2**30)
        kernel = gpsd.ChunkedKernel(base, chunk_size=args.chunk_size, cache_bytes=cache)
    likelihood = gpytorch.likelihoods.GaussianLikelihood()
    model = ExactRegressor(x, y, likelihood, kernel).double()
    likelihood.noise = 0.1
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(likelihood, model)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    out: dict = {"side": args.side, "wall": [], "cpu": [], "loss": []}
    reset_peak(torch.device("cpu"))
    model.train()
    try:
        for i in range(args.iters):
            torch.manual_seed(i)
            wall, cpu = time.perf_counter(), time.process_time()
            optimizer.zero_grad()
            loss = -mll(model(x), y)
            loss.backward()
            optimizer.step()
            out["loss"].append(loss.item())
            out["wall"].append(time.perf_counter() - wall)
            out["cpu"].append(time.process_time() - cpu)
    except (RuntimeError, MemoryError) as err:
        out["failed"] = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
    out["peak_gib"] = peak_gib(torch.device("cpu"))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=30_000)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--cache-gib", type=float, default=1.5)
    parser.add_argument("--chunk-size", type=int, default=512)
    parser.add_argument("--cap-gib", type=float, default=22.0)
    parser.add_argument("--out", default=None)
    parser.add_argument("--side", default=None, choices=["gpsd", "gpytorch"])
    args = parser.parse_args()
    if args.side is not None:
        print(json.dumps(run_side(args)))
        return
    results = []
    for side in ("gpsd", "gpytorch"):
        command = [sys.executable, __file__, "--side", side, *sys.argv[1:]]
        if "--out" in command:
            i = command.index("--out")
            del command[i : i + 2]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            results.append({"side": side, "failed": f"exit {done.returncode}: {last[:160]}"})
        else:
            results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    report = Report(args.out)
    report.add(
        f"# Training an exact GP on flights at N = {args.n:,}: gpsd's ChunkedKernel and "
        "GPyTorch's ExactGP",
        "",
        f"{cpu_name()}, {torch.get_num_threads()} threads, float64, ARD RBF on 6 inputs, Adam lr "
        f"0.1, GPyTorch's default settings; gpsd keeps at most {args.cache_gib:g} GiB of kernel "
        f"rows, {args.chunk_size} rows a chunk; GPyTorch under an address-space limit of "
        f"{args.cap_gib:g} GiB. torch {torch.__version__}, gpytorch {gpytorch.__version__}, gpsd "
        f"{gpsd.__version__}, Python {platform.python_version()}. Each side in its own process.",
        "",
        "| side | s / iteration | CPU s / iteration | peak RSS (GiB) | loss per iteration | outcome |",
        "|---|---:|---:|---:|---|---|",
    )
    for r in results:
        wall = r.get("wall", [])
        steady = wall[1:] or wall
        cpu = r.get("cpu", [])[1:] or r.get("cpu", [])
        cells = [
            f"{statistics.median(steady):.1f}" if steady else "–",
            f"{statistics.median(cpu):.1f}" if cpu else "–",
            f"{r['peak_gib']:.2f}" if "peak_gib" in r else "–",
            ", ".join(f"{v:.5f}" for v in r.get("loss", [])) or "–",
            r.get("failed", f"trained {len(wall)} iterations"),
        ]
        report.add(f"| {r['side']} | {' | '.join(cells)} |")
    report.close()


if __name__ == "__main__":
    main()
