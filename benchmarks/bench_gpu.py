"""GPU benchmark suite for large N (issue: "Large N on one GPU").

Skips cleanly (exit 0) where CUDA is absent. For N in a doubling sequence up to ``--max-n`` (or the
largest size that fits), prints Markdown tables of wall time (CUDA events, median of repeats after
a warm-up) and peak device memory (``torch.cuda.max_memory_allocated``) for:

* one plain GPyTorch ``ExactGP`` fit + prediction (fixed hyperparameters);
* data-centric GPR for T = 1, 10, 100 with each backend (dense, cholesky, lanczos) and the
  distribution-centric closed form, with the relative error of the Lanczos path against the dense
  one where both run;
* the dense factorisations' achieved fraction of the GPU's measured matmul rate.

A cell that runs out of memory reads "OOM"; larger sizes of that method are skipped.

Usage::

    python benchmarks/bench_gpu.py --dtype float32 --out benchmarks/results/gpu_float32.md
    python benchmarks/bench_gpu.py --dtype float64 --max-n 65536
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys

import gpytorch
import torch

from gpsd import DataCentricGPR, DistributionCentricGPR


def cuda_time(fn, repeats: int, warmup: int = 1) -> float:
    """Median wall time in seconds of ``fn()`` measured with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def measure(fn, repeats: int) -> tuple[float, float]:
    """(median seconds, peak GiB) of ``fn``, or raises ``torch.OutOfMemoryError``/``MemoryError``."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    seconds = cuda_time(fn, repeats)
    return seconds, torch.cuda.max_memory_allocated() / 2**30


def matmul_rate(dtype: torch.dtype, n: int = 8192) -> float:
    """Measured dense matmul rate in FLOP/s (random operands)."""
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    seconds = cuda_time(lambda: a @ b, repeats=10, warmup=3)
    return 2 * n**3 / seconds


def problem(n: int, m: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = 10 * torch.rand(n, 2, generator=gen, device="cuda", dtype=dtype)
    y = torch.sin(x).sum(-1) + 0.3 * torch.randn(n, generator=gen, device="cuda", dtype=dtype)
    test_x = 10 * torch.rand(m, 2, generator=gen, device="cuda", dtype=dtype)
    return x, y, test_x


def rbf(dtype: torch.dtype) -> gpytorch.kernels.Kernel:
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).to("cuda", dtype)
    kernel.base_kernel.lengthscale = 1.0
    return kernel


def exact_gp(x, y, test_x):
    class GP(gpytorch.models.ExactGP):
        def __init__(self):
            likelihood = gpytorch.likelihoods.GaussianLikelihood().to(x)
            likelihood.noise = 0.1
            super().__init__(x, y, likelihood)
            self.mean_module = gpytorch.means.ZeroMean()
            self.covar_module = rbf(x.dtype)

        def forward(self, z):
            return gpytorch.distributions.MultivariateNormal(
                self.mean_module(z), self.covar_module(z)
            )

    def run():
        model = GP().eval()
        with (
            torch.no_grad(),
            gpytorch.settings.fast_pred_var(False),
            gpytorch.settings.max_cholesky_size(10**9),
        ):
            post = model(test_x)
            return post.mean, post.variance

    return run


def regression_table(args, dtype: torch.dtype) -> str:
    methods = (
        ["gpytorch ExactGP"]
        + [f"{kind} T={t}" for kind in ("dense", "cholesky", "lanczos") for t in args.steps]
        + [f"distribution-centric T={max(args.steps)}"]
    )
    failed: set[str] = set()
    rows = [
        "| N | method | time (s) | peak (GiB) | rel. err vs dense |",
        "|---:|---|---:|---:|---:|",
    ]
    n = args.min_n
    while n <= args.max_n:
        x, y, test_x = problem(n, args.m, dtype)
        dense_out = {}
        for method in methods:
            if method in failed:
                continue
            if method == "gpytorch ExactGP":
                fn = exact_gp(x, y, test_x)
            else:
                kind, t = method.rsplit(" T=", 1)
                gammas = torch.linspace(0.1, 1.0, int(t), device="cuda", dtype=dtype)
                cls = DistributionCentricGPR if kind == "distribution-centric" else DataCentricGPR
                backend = "auto" if kind == "distribution-centric" else kind

                def fn(cls=cls, backend=backend, gammas=gammas, x=x, y=y, test_x=test_x):
                    with torch.no_grad():
                        model = cls(rbf(dtype), x, y, gammas, backend=backend)
                        return model.predict(test_x)

            try:
                seconds, peak = measure(fn, args.repeats)
            except (torch.OutOfMemoryError, MemoryError):
                failed.add(method)
                rows.append(f"| {n} | {method} | OOM | — | — |")
                continue
            err = "—"
            if method.startswith("dense"):
                dense_out[method.split(" T=")[1]] = fn()
            if method.startswith("lanczos") and method.split(" T=")[1] in dense_out:
                ref, got = dense_out[method.split(" T=")[1]], fn()
                err = f"{float((got.mean - ref.mean).abs().max() / ref.mean.abs().max()):.1e}"
            rows.append(f"| {n} | {method} | {seconds:.4f} | {peak:.2f} | {err} |")
            print(rows[-1], flush=True)
        n *= 2
    return "\n".join(rows)


def factorisation_rate_table(args, dtype: torch.dtype, rate: float) -> str:
    """Achieved FLOP/s of the dense factorisations: eigh (about 9 N^3) and Cholesky (N^3 / 3)."""
    rows = [
        "| N | eigh (s) | eigh fraction of matmul rate | cholesky (s) | cholesky fraction |",
        "|---:|---:|---:|---:|---:|",
    ]
    n = args.min_n
    while n <= min(args.max_n, args.max_dense_n):
        x, _, _ = problem(n, 1, dtype)
        k = rbf(dtype)(x).to_dense().detach() + 0.1 * torch.eye(n, device="cuda", dtype=dtype)
        t_eigh = cuda_time(lambda k=k: torch.linalg.eigh(k), repeats=3)
        t_chol = cuda_time(lambda k=k: torch.linalg.cholesky(k), repeats=3)
        rows.append(
            f"| {n} | {t_eigh:.4f} | {9 * n**3 / t_eigh / rate:.3f} | {t_chol:.4f} | "
            f"{n**3 / 3 / t_chol / rate:.3f} |"
        )
        n *= 2
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument("--min-n", type=int, default=1024)
    parser.add_argument("--max-n", type=int, default=131072)
    parser.add_argument("--max-dense-n", type=int, default=32768)
    parser.add_argument("--m", type=int, default=10000, help="test points")
    parser.add_argument("--steps", type=int, nargs="+", default=[1, 10, 100])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_gpu.py: no CUDA device here; nothing to measure (skipped).")
        return
    dtype = getattr(torch, args.dtype)
    rate = matmul_rate(dtype)
    header = "\n".join(
        [
            f"# GPU benchmark ({args.dtype})",
            "",
            f"- command: `python benchmarks/bench_gpu.py {' '.join(sys.argv[1:])}`",
            f"- device: {torch.cuda.get_device_name()}, CUDA {torch.version.cuda}, "
            f"torch {torch.__version__}, gpytorch {gpytorch.__version__}, "
            f"Python {platform.python_version()}",
            f"- measured {args.dtype} matmul rate: {rate / 1e12:.1f} TFLOP/s (8192^3, random)",
            "",
        ]
    )
    print(header, flush=True)
    parts = [header, "## Self-distillation for regression", "", regression_table(args, dtype)]
    parts += [
        "",
        "## Dense factorisations against the matmul rate",
        "",
        factorisation_rate_table(args, dtype, rate),
    ]
    text = "\n".join(parts)
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")


if __name__ == "__main__":
    main()
