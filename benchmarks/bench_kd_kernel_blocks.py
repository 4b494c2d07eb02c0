"""Kernel blocks K(X, X_cols) for kernel distillation: gpsd's evaluation against GPyTorch's.

Kernel distillation evaluates K_XX block by block in every pass (objective, gradient, line
search). gpsd evaluates RBF and Matérn blocks from squared distances formed in float64 and rounded
once (the RBF exponent log s - r^2/2 in the same product), and on a CPU zeroes RBF entries that
would be subnormal before the exponential; GPyTorch forms r^2 = ||x||^2 + ||z||^2 - 2 x^T z in the
input dtype. For each kernel, lengthscale and dtype this prints the median time of one block
(plus dropping the negligible entries, as the distiller does with either) and the largest
relative error of the entries above 1e-3 of the largest against a float64 reference from exact
differences; then the time of one objective-and-gradient pass of a distillation with each block
evaluation swapped in.

    python benchmarks/bench_kd_kernel_blocks.py [--n 16384] [--cols 256] [--device cpu]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time

import gpytorch
import torch
from _timing import cpu_name, cuda_missing, median_time, sync, write_report

from gpsd._internal.negligible import kernel_matrix
from gpsd.kernel_distillation import KernelDistillation
from gpsd.kernel_distillation import kernel_distillation as distillation_module

GPSD_BLOCK = distillation_module.evaluate_kernel


def gpytorch_block(kernel: gpytorch.kernels.Kernel, x1: torch.Tensor, x2: torch.Tensor):
    """What the distiller did before: GPyTorch's dense block, negligible entries dropped."""
    with torch.no_grad(), gpytorch.settings.lazily_evaluate_kernels(False):
        return kernel_matrix(kernel, x1, x2)


def make_kernel(name: str, lengthscale: float, dtype: torch.dtype, device: torch.device):
    base = (
        gpytorch.kernels.RBFKernel()
        if name == "RBF"
        else gpytorch.kernels.MaternKernel(nu={"Matérn-1/2": 0.5, "Matérn-5/2": 2.5}[name])
    )
    kernel = gpytorch.kernels.ScaleKernel(base).to(device, dtype)
    kernel.base_kernel.lengthscale = torch.tensor(lengthscale, device=device, dtype=dtype)
    return kernel


def reference_block(name: str, lengthscale: float, outputscale: float, x1, x2) -> torch.Tensor:
    """Float64 block from exact differences (no ||x||^2 expansion)."""
    r = torch.cdist(
        x1.double() / lengthscale,
        x2.double() / lengthscale,
        compute_mode="donot_use_mm_for_euclid_dist",
    )
    if name == "RBF":
        return outputscale * torch.exp(-0.5 * r.square())
    if name == "Matérn-1/2":
        return outputscale * torch.exp(-r)
    s = 5.0**0.5 * r
    return outputscale * (1.0 + s + s * s / 3.0) * torch.exp(-s)


def largest_relative_error(block: torch.Tensor, reference: torch.Tensor) -> float:
    keep = reference >= 1e-3 * reference.max()
    return float(((block.double() - reference).abs() / reference)[keep].max())


def block_table(args, device: torch.device) -> str:
    rows = [
        f"One block of {args.n} x {args.cols} (inputs uniform on [0, 10]^2, outputscale as "
        f"initialised); median of {args.repeats} after warm-up; error: largest relative error "
        "of the entries at least 1e-3 of the largest, against float64 from exact differences. In "
        "float64, gpsd's Matérn blocks are GPyTorch's: those rows show the timing noise.",
        "",
        "| kernel | lengthscale | dtype | GPyTorch (ms) | gpsd (ms) | speed-up | "
        "GPyTorch error | gpsd error |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    gen = torch.Generator().manual_seed(0)
    x64 = 10 * torch.rand(args.n, 2, generator=gen, dtype=torch.float64)
    for name in ["RBF", "Matérn-1/2", "Matérn-5/2"]:
        for lengthscale in [1.0, 0.1]:
            for dtype in [torch.float32, torch.float64]:
                x = x64.to(device, dtype)
                cols = x[: args.cols]
                kernel = make_kernel(name, lengthscale, dtype, device)
                outputscale = float(kernel.outputscale.detach())
                ref = reference_block(name, lengthscale, outputscale, x.cpu(), cols.cpu())
                times, errors = [], []
                for block in (gpytorch_block, GPSD_BLOCK):
                    run = lambda b=block, k=kernel, x1=x, x2=cols: b(k, x1, x2)  # noqa: E731
                    times.append(median_time(run, args.repeats, device))
                    errors.append(largest_relative_error(block(kernel, x, cols).cpu(), ref))
                rows.append(
                    f"| {name} | {lengthscale} | {str(dtype)[6:]} | {1e3 * times[0]:.1f} | "
                    f"{1e3 * times[1]:.1f} | {times[0] / times[1]:.2f}x | {errors[0]:.1e} | "
                    f"{errors[1]:.1e} |"
                )
                print(rows[-1], flush=True)
    return "\n".join(rows)


def pass_table(args, device: torch.device) -> str:
    m = min(1000, max(1, args.n // 4))  # 1000 inducing points, fewer for a small --n
    b = min(30, m)
    rows = [
        f"One objective-and-gradient pass of a float32 distillation (n = {args.n}, m = {m}, "
        f"b = {b}, RBF), median of {args.pass_repeats} after warm-up, with each block "
        "evaluation swapped in (alternating).",
        "",
        "| lengthscale | GPyTorch blocks (s) | gpsd blocks (s) | speed-up |",
        "|---:|---:|---:|---:|",
    ]
    gen = torch.Generator().manual_seed(0)
    x = (10 * torch.rand(args.n, 2, generator=gen)).to(device)
    y = torch.sin(x).sum(-1)
    for lengthscale in [1.0, 0.1]:
        kernel = make_kernel("RBF", lengthscale, torch.float32, device)
        kd = KernelDistillation.from_data(
            x, y, kernel, noise=0.1, num_inducing=m, sparsity=b, max_iter=0
        )
        kd.prepare()
        samples: list[list[float]] = [[], []]
        try:  # alternate the two, one pass each, so that drifts in machine speed hit both
            for rep in range(1 + args.pass_repeats):
                for i, block in enumerate((gpytorch_block, GPSD_BLOCK)):
                    distillation_module.evaluate_kernel = block
                    sync(device)
                    start = time.perf_counter()
                    kd.objective_and_gradient(kd.weight_values)
                    sync(device)
                    if rep > 0:  # the first round warms up
                        samples[i].append(time.perf_counter() - start)
        finally:
            distillation_module.evaluate_kernel = GPSD_BLOCK
        times = [statistics.median(s) for s in samples]
        rows.append(
            f"| {lengthscale} | {times[0]:.3f} | {times[1]:.3f} | {times[0] / times[1]:.2f}x |"
        )
        print(rows[-1], flush=True)
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=16384)
    parser.add_argument("--cols", type=int, default=256, help="columns per block")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--pass-repeats", type=int, default=7)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=None)
    parser.add_argument("--quick", action="store_true", help="N = 2048, 5 repeats, 3 pass repeats")
    args = parser.parse_args()
    if args.quick:
        args.n, args.repeats, args.pass_repeats = 2048, 5, 3
    device = torch.device(args.device)
    if cuda_missing(device):
        return
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu, {cpu_name()}"
    header = "\n".join(
        [
            "# Kernel blocks for kernel distillation: gpsd against GPyTorch",
            "",
            f"- command: `python benchmarks/bench_kd_kernel_blocks.py {' '.join(sys.argv[1:])}`",
            f"- device: {name} ({torch.get_num_threads()} CPU threads), torch {torch.__version__}, "
            f"gpytorch {gpytorch.__version__}, Python {platform.python_version()}",
            "",
        ]
    )
    print(header, flush=True)
    parts = [header, block_table(args, device), "", pass_table(args, device)]
    write_report("\n".join(parts), args.out)


if __name__ == "__main__":
    main()
