"""Timing of self-distillation for GP classification (Borup & Andersen, Appendix D.2, Fig. 15 right).

Prints Markdown tables; ``--out FILE`` also writes them with a header naming the machine.

1. Fig. 15 (right) protocol: the time to fit T = 1..100 steps relative to one scikit-learn
   ``GaussianProcessClassifier`` fit with the same fixed kernel (``optimizer=None``), on the §4.3 toy
   setting, for data-centric GPC with and without warm starts, and distribution-centric GPC
   (iterated recursion, tempered likelihood, scaled kernel). The plain gpsd Laplace classifier
   (one fit) is listed next to scikit-learn.
2. Fit time against N for T = 10 steps, next to one scikit-learn fit and one gpsd Laplace fit.

Each number is the median of ``--repeats`` runs after one warm-up run.

Usage::

    python benchmarks/bench_classification.py                # full run (a few minutes on 2 cores)
    python benchmarks/bench_classification.py --quick        # a smoke run
    python benchmarks/bench_classification.py --device cuda --dtype float32
    python benchmarks/bench_classification.py --threads 1   # when other processes share the CPU
    python benchmarks/bench_classification.py --lengthscale 0.05 --skip-protocol --sizes 800 1600 3200
        # a short lengthscale: most kernel entries far below rounding (the CPU's subnormal path)
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from collections.abc import Callable

import gpytorch
import numpy as np
import torch
from _timing import cpu_name, cuda_missing, load_line, median_time

from gpsd import DataCentricGPC, DistributionCentricGPC, LaplaceGPClassifier
from gpsd.data.toy import sine_classification

OUTPUTSCALE, LENGTHSCALE = 2.0, 1.0


def kernel(device: torch.device, dtype: torch.dtype) -> gpytorch.kernels.Kernel:
    k = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).to(device=device, dtype=dtype)
    k.outputscale = torch.tensor(OUTPUTSCALE, dtype=dtype, device=device)
    k.base_kernel.lengthscale = torch.tensor(LENGTHSCALE, dtype=dtype, device=device)
    for p in k.parameters():
        p.requires_grad_(False)
    return k


def sklearn_fit(x: np.ndarray, y: np.ndarray) -> Callable[[], object]:
    from sklearn.gaussian_process import GaussianProcessClassifier
    from sklearn.gaussian_process.kernels import RBF, ConstantKernel

    def fit():
        GaussianProcessClassifier(
            ConstantKernel(OUTPUTSCALE) * RBF(LENGTHSCALE), optimizer=None
        ).fit(x[:, None], y)

    return fit


def methods(x: torch.Tensor, y: torch.Tensor, T: int, device, dtype) -> dict[str, Callable]:
    return {
        "data-centric (warm start)": lambda: DataCentricGPC(
            x, y, kernel(device, dtype), num_steps=T, noise=0.1
        ).fit(),
        "data-centric (cold start)": lambda: DataCentricGPC(
            x, y, kernel(device, dtype), num_steps=T, noise=0.1, warm_start=False
        ).fit(),
        "distribution-centric iterated": lambda: DistributionCentricGPC(
            x, y, kernel(device, dtype), num_steps=T, method="iterated"
        ).fit(),
        "distribution-centric tempered": lambda: DistributionCentricGPC(
            x, y, kernel(device, dtype), num_steps=T, method="tempered"
        ).fit(),
        "distribution-centric scaled kernel": lambda: DistributionCentricGPC(
            x, y, kernel(device, dtype), num_steps=T, method="scaled_kernel"
        ).fit(),
    }


def protocol_table(n: int, steps: list[int], repeats: int, device, dtype) -> list[str]:
    x, y, _ = sine_classification(n, seed=0, dtype=torch.float64)
    xd, yd = x.to(device=device, dtype=dtype), y.to(device=device, dtype=dtype)
    names = list(methods(xd, yd, 1, device, dtype))
    lines = [
        f"### Fit time relative to one scikit-learn GaussianProcessClassifier fit (N = {n})",
        "",
        "Each row re-measures the scikit-learn fit (CPU, float64) right before its methods, so that "
        "load changes on a shared machine affect numerator and denominator alike. Cells: ratio "
        "(absolute time).",
        "",
        "| T | scikit-learn fit | gpsd LaplaceGPClassifier (1 fit) | " + " | ".join(names) + " |",
        "|---|" + "---|" * (len(names) + 2),
    ]
    print("\n".join(lines), flush=True)
    for T in steps:
        base = median_time(sklearn_fit(x.numpy(), y.numpy()), repeats, torch.device("cpu"))
        plain = median_time(
            lambda: LaplaceGPClassifier(xd, yd, kernel(device, dtype)).fit(), repeats, device
        )
        cells = [f"{base * 1e3:.1f} ms", f"{plain / base:.2f} ({plain * 1e3:.1f} ms)"]
        for fn in methods(xd, yd, T, device, dtype).values():
            t = median_time(fn, repeats, device)
            cells.append(f"{t / base:.2f} ({t * 1e3:.1f} ms)")
        lines.append(f"| {T} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    return lines


def scaling_table(sizes: list[int], T: int, repeats: int, device, dtype) -> list[str]:
    names = ["scikit-learn GPC (1 fit)", "gpsd LaplaceGPClassifier (1 fit)"]
    names += list(methods(torch.zeros(2), torch.zeros(2), 1, device, dtype))
    lines = [
        f"### Fit time (seconds) against N, T = {T} steps",
        "",
        "| N | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    print("\n".join(lines), flush=True)
    for n in sizes:
        x, y, _ = sine_classification(n, seed=0, dtype=torch.float64)
        cells = [median_time(sklearn_fit(x.numpy(), y.numpy()), repeats, torch.device("cpu"))]
        xd, yd = x.to(device=device, dtype=dtype), y.to(device=device, dtype=dtype)
        cells.append(
            median_time(
                lambda xd=xd, yd=yd: LaplaceGPClassifier(xd, yd, kernel(device, dtype)).fit(),
                repeats,
                device,
            )
        )
        for fn in methods(xd, yd, T, device, dtype).values():
            cells.append(median_time(fn, repeats, device))
        lines.append(f"| {n} | " + " | ".join(f"{c:.4f}" for c in cells) + " |")
        print(lines[-1], flush=True)
    return lines


def main() -> None:
    global LENGTHSCALE
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float64", choices=["float32", "float64"])
    parser.add_argument("--quick", action="store_true", help="a smoke run (well under a minute)")
    parser.add_argument("--n", type=int, default=200, help="N for the Fig. 15 protocol")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--lengthscale", type=float, default=LENGTHSCALE, help="RBF lengthscale")
    parser.add_argument("--sizes", type=int, nargs="+", default=None, help="N of the N table")
    parser.add_argument("--skip-protocol", action="store_true", help="only the N table")
    parser.add_argument("--out", default=None, help="also write the tables to this Markdown file")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for torch and BLAS (use 1 when other processes share the cores: "
        "oversubscribed torch threads slow small factorisations down by 100x)",
    )
    args = parser.parse_args()
    LENGTHSCALE = args.lengthscale
    if args.threads is not None:
        import scipy.linalg  # noqa: F401  (load scipy's BLAS first: limits apply to loaded libraries)
        import sklearn.gaussian_process  # noqa: F401
        from threadpoolctl import threadpool_limits

        torch.set_num_threads(args.threads)
        threadpool_limits(args.threads)
    device = torch.device(args.device)
    if cuda_missing(device):
        return
    dtype = getattr(torch, args.dtype)
    if args.quick:
        steps, sizes, repeats = [1, 5, 20], [100, 200], args.repeats or 2
    else:
        steps, sizes, repeats = (
            [1, 2, 5, 10, 20, 50, 100],
            [100, 200, 400, 800, 1600],
            args.repeats or 5,
        )
    sizes = args.sizes or sizes
    header = [
        "# Classification self-distillation timings",
        "",
        f"- machine: {os.cpu_count()}-core CPU, {torch.get_num_threads()} torch thread(s), "
        f"processor `{cpu_name()}`, "
        f"{platform.system()} {platform.release()}",
        f"- device: {device}, dtype: {args.dtype}; scikit-learn always runs on CPU in float64",
        f"- torch {torch.__version__}, gpytorch {gpytorch.__version__}, python {platform.python_version()}",
        f"- command: `python {' '.join(sys.argv)}`",
        f"- fixed kernel: outputscale {OUTPUTSCALE} x RBF(lengthscale {LENGTHSCALE}); data-centric "
        "uses gamma_t = 0.1 on the kernel diagonal; §4.3 toy data (x ~ U(0, 5))",
        f"- median of {repeats} runs after one warm-up",
        "",
    ]
    print("\n".join(header), flush=True)
    lines = list(header)
    if not args.skip_protocol:
        lines += protocol_table(args.n, steps, repeats, device, dtype) + [""]
    lines += scaling_table(sizes, 10, repeats, device, dtype) + [""]
    lines.insert(0, load_line() + "\n")
    print(lines[0], flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write("\n".join(lines) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
