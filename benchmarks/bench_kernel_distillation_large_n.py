"""Kernel distillation at large n: time and peak memory, with K_XX never formed.

Distils an RBF kernel on ``n`` synthetic 2-D points (inputs uniform on [0, 10]^2, the setting of
``bench_gpu.py``) into a sparse low-rank student (K-means, top-b neighbours, least squares and
two line-search gradient steps), then predicts ``--test`` points. It runs once (no warm-up: at
this size one run is minutes on a CPU) and reports the peak memory: the process's peak resident
set on the CPU, ``torch.cuda.max_memory_allocated`` on CUDA, next to the size K_XX would take,
the time of each phase, and the root-mean-square entry error ||K_XX - W K_UU W^T||_F / n
before and after the gradient steps.

Usage::

    python benchmarks/bench_kernel_distillation_large_n.py --n 65536 --device cpu \\
        --out benchmarks/results/kernel_distillation_large_n_cpu.md
"""

from __future__ import annotations

import argparse
import platform
import sys
import time

import gpytorch
import torch
from _timing import cpu_name, cuda_missing, peak_rss_kib, sync, write_report

from gpsd import KernelDistillation


def peak_gib(device: torch.device) -> float:
    """Peak memory so far: CUDA allocator, or this process's peak resident set on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return peak_rss_kib() / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=65536)
    parser.add_argument("--m", type=int, default=1000, help="inducing points")
    parser.add_argument("--b", type=int, default=30, help="non-zeros per row of W")
    parser.add_argument("--test", type=int, default=10000, help="test points")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument("--lengthscale", type=float, default=1.0, help="RBF lengthscale")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--quick", action="store_true", help="N = 4096, m = 200, b = 10, 1000 test points"
    )
    args = parser.parse_args()
    if args.quick:
        args.n, args.m, args.b, args.test = 4096, 200, 10, 1000
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if cuda_missing(device):
        return
    gen = torch.Generator(device=device).manual_seed(0)
    x = 10 * torch.rand(args.n, 2, generator=gen, device=device, dtype=dtype)
    noise = 0.3 * torch.randn(args.n, generator=gen, device=device, dtype=dtype)
    y = torch.sin(x).sum(-1) + noise
    test_x = 10 * torch.rand(args.test, 2, generator=gen, device=device, dtype=dtype)
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).to(device, dtype)
    kernel.base_kernel.lengthscale = torch.tensor(args.lengthscale, device=device, dtype=dtype)

    sync(device)
    start = time.perf_counter()
    kd = KernelDistillation.from_data(
        x, y, kernel, noise=0.1, num_inducing=args.m, sparsity=args.b, max_iter=2
    )
    student = kd.fit().student
    sync(device)
    t_distil = time.perf_counter() - start
    phases = kd.timings  # K-means and top-b, least-squares initialisation, gradient steps, student
    rms_init, rms_final = (e / args.n for e in (kd.frobenius_errors[0], kd.frobenius_errors[-1]))
    start = time.perf_counter()
    prediction = student.predict(test_x)
    mean, variance = prediction.mean, prediction.variance
    sync(device)
    t_predict = time.perf_counter() - start
    finite = bool(torch.isfinite(mean).all() and torch.isfinite(variance).all())
    k_xx_gib = args.n**2 * torch.finfo(dtype).bits / 8 / 2**30
    device_name = (
        torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu, {cpu_name()}"
    )
    lines = [
        "# Kernel distillation at large n",
        "",
        f"- command: `python benchmarks/bench_kernel_distillation_large_n.py {' '.join(sys.argv[1:])}`",
        f"- device: {device_name} ({torch.get_num_threads()} CPU threads), dtype {args.dtype}, "
        f"torch {torch.__version__}, gpytorch {gpytorch.__version__}, "
        f"Python {platform.python_version()}",
        "- one run, no warm-up; peak memory: CPU resident set (VmHWM) or CUDA max_memory_allocated",
        "",
        "| n | m | b | distil (s) | predict test points (s) | peak memory (GiB) | "
        "K_XX would take (GiB) | outputs finite |",
        "|---:|---:|---:|---:|---:|---:|---:|---|",
        f"| {args.n} | {args.m} | {args.b} | {t_distil:.1f} | {t_predict:.3f} ({args.test}) | "
        f"{peak_gib(device):.2f} | {k_xx_gib:.1f} | {finite} |",
        "",
        "| K-means + top-b (s) | least-squares init (s) | 2 gradient steps (s) | student (s) | "
        "RMS entry error of W K_UU Wᵀ, init → after 2 steps |",
        "|---:|---:|---:|---:|---|",
        f"| {phases['kmeans']:.1f} | {phases['initialisation']:.1f} | "
        f"{phases['optimisation']:.1f} | {phases['student']:.1f} | "
        f"{rms_init:.3e} → {rms_final:.3e} |",
    ]
    write_report("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
