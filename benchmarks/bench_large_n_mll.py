"""Training an exact GP at large N: gpsd's ChunkedKernel under GPyTorch's own loop against a
plain GPyTorch ExactGP, on the CPU.

Both train the same model, an ``ExactGP`` with a constant mean, ``ScaleKernel(RBFKernel(ARD))``
on 5 inputs and a ``GaussianLikelihood``, by ``ExactMarginalLogLikelihood`` with Adam (lr 0.1)
for ``--iters`` iterations from the same start, under GPyTorch's default settings (CG with
its training tolerance, 10 probe vectors, a pivoted-Cholesky preconditioner of rank 15;
``max_cholesky_size`` 800 is below every N here, so both take the matrix-free route). The
only difference is the kernel: the plain ``ScaleKernel`` (GPyTorch forms K and keeps its
autograd graph) or ``gpsd.kernels.ChunkedKernel`` around it (K never formed: row chunks, the
gradient by chunked bilinear derivatives), with ``cache_bytes=0`` (nothing kept) or
``cache_bytes`` = the size of K (the rows kept between the products of one iteration).

Each configuration runs in a fresh process (``--worker``), so that its peak resident set is its
own. Reported per N: the median seconds per training iteration (after one untimed; wall
clock, and the process's CPU time over both threads, which other processes on a busy machine
disturb less), the peak
RSS of the process (and its resident set before the first iteration: data, model, imports),
and the exact log marginal likelihood per point at the final
hyperparameters (by a dense Cholesky in float64, the same for every configuration).

Data: inputs uniform on [0, 1]^5, targets sin(2 pi x1) + x2^2 + 0.5 x3 + noise 0.1 (the other
two inputs are irrelevant), float64.

Usage::

    python benchmarks/bench_large_n_mll.py --n 5000 --iters 5 \\
        --out benchmarks/results/large_n_mll_cpu.md
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import subprocess
import sys
import time

import gpytorch
import torch
from _timing import Report, cpu_name, peak_rss_kib, start_peak_rss

import gpsd

CONFIGS = ("gpytorch", "gpsd_chunked", "gpsd_chunked_kept")
LABELS = {
    "gpytorch": "GPyTorch ExactGP (K formed)",
    "gpsd_chunked": "gpsd ChunkedKernel, nothing kept",
    "gpsd_chunked_kept": "gpsd ChunkedKernel, rows kept per iteration",
}


def data(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(n, 5, generator=gen, dtype=torch.float64)
    f = torch.sin(2 * math.pi * x[:, 0]) + x[:, 1] ** 2 + 0.5 * x[:, 2]
    return x, f + 0.1 * torch.randn(n, generator=gen, dtype=torch.float64)


class GP(gpytorch.models.ExactGP):
    def __init__(self, x, y, covar_module):
        super().__init__(x, y, gpytorch.likelihoods.GaussianLikelihood())
        self.mean_module = gpytorch.means.ConstantMean()
        self.covar_module = covar_module

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def exact_mll(model: GP, x: torch.Tensor, y: torch.Tensor) -> float:
    """The exact log marginal likelihood per point at the model's hyperparameters: a dense
    float64 Cholesky, whatever the kernel wrapper."""
    kernel = model.covar_module
    kernel = kernel.base_kernel if isinstance(kernel, gpsd.kernels.ChunkedKernel) else kernel
    with torch.no_grad():
        K = kernel(x).to_dense() + model.likelihood.noise * torch.eye(x.shape[0], dtype=x.dtype)
        residual = y - model.mean_module(x)
        chol = torch.linalg.cholesky(K)
        white = torch.linalg.solve_triangular(chol, residual.unsqueeze(-1), upper=False)
        log_det = 2 * chol.diagonal().log().sum()
        n = x.shape[0]
        return float(-0.5 * (white.square().sum() + log_det + n * math.log(2 * math.pi)) / n)


def worker(config: str, n: int, iters: int) -> dict:
    x, y = data(n)
    base = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=5))
    if config == "gpytorch":
        kernel = base
    else:
        cache = 8 * n * n if config == "gpsd_chunked_kept" else 0
        kernel = gpsd.kernels.ChunkedKernel(base, cache_bytes=cache)
    model = GP(x, y, kernel).double()
    model.train()
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(model.likelihood, model)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    baseline = (start_peak_rss() or peak_rss_kib()) / 2**20  # data, model, imports
    times, cpu_times = [], []
    for iteration in range(iters + 1):  # the first untimed
        torch.manual_seed(iteration)  # the same probe vectors for every configuration
        start, cpu_start = time.perf_counter(), time.process_time()
        optimizer.zero_grad()
        loss = -mll(model(x), y)
        loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
    peak = peak_rss_kib() / 2**20
    return {
        "seconds": sorted(times[1:])[len(times[1:]) // 2],
        "cpu_seconds": sorted(cpu_times[1:])[len(cpu_times[1:]) // 2],
        "peak_gib": peak,
        "baseline_gib": baseline,
        "mll": exact_mll(model, x, y),
        "loss": float(loss),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, nargs="+", default=[5000])
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    parser.add_argument("--out", default=None)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.n[0], args.iters)))
        return
    report = Report(args.out)
    report.add("# Training an exact GP at large N: gpsd's ChunkedKernel against GPyTorch's ExactGP")
    report.add("")
    report.add(
        f"- device: {cpu_name()}, {torch.get_num_threads()} threads; torch {torch.__version__}, "
        f"gpytorch {gpytorch.__version__}, gpsd {gpsd.__version__}, Python {platform.python_version()}"
    )
    report.add(f"- command: `python benchmarks/bench_large_n_mll.py {' '.join(sys.argv[1:])}`")
    report.add(
        "- float64, ARD RBF on 5 inputs, constant mean, Gaussian likelihood; Adam lr 0.1, "
        f"{args.iters} timed iterations after one untimed; GPyTorch's default settings; "
        "each configuration in its own process"
    )
    report.add("")
    report.add(
        "| N | configuration | s / iteration | CPU s / iteration | peak RSS (GiB) | "
        "of which before training | final exact MLL / N | final loss |"
    )
    report.add("|---:|---|---:|---:|---:|---:|---:|---:|")
    for n in args.n:
        for config in args.configs:
            command = [sys.executable, __file__, "--worker", config, "--n", str(n)]
            command += ["--iters", str(args.iters)]
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                tail = done.stderr.strip().splitlines()[-1:] or ["no output"]
                report.add(f"| {n:,} | {LABELS[config]} | failed: {tail[0][:80]} | | | | | |")
                continue
            r = json.loads(done.stdout.strip().splitlines()[-1])
            report.add(
                f"| {n:,} | {LABELS[config]} | {r['seconds']:.2f} | {r['cpu_seconds']:.2f} | "
                f"{r['peak_gib']:.2f} | "
                f"{r['baseline_gib']:.2f} | {r['mll']:.5f} | {r['loss']:.5f} |"
            )
    report.close()


if __name__ == "__main__":
    main()
