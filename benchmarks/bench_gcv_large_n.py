"""The step GCV chooses on the matrix-free backends against the exact GCV of the dense path.

``gcv()`` on ``backend="cg"`` and ``"lanczos"`` estimates the trace of each step's residual
filter from ``gpsd.settings.trace_probes`` Rademacher vectors (deflated by the engine's
eigenpairs); ``"dense"`` reads it off the full eigendecomposition. For each seed this script
draws a problem, fits the same model on the dense path, on Lanczos and on CG at each deflation
rank, and records the step each one's ``best_step("gcv")`` chooses, the largest relative error
of the estimated scores, the largest relative standard error, and the time of ``fit()`` plus
``gcv()``.

Data: N inputs uniform on [0, 5]^2, targets sin(x1) + sin(x2) + 0.3 ε, a scaled RBF kernel with
lengthscale 0.8, data-centric distillation with T = 15 steps at noise 0.05 (GCV first falls,
then rises: the exact choice lies inside 1..T on most seeds). CG deflates the Ritz pairs of a
Lanczos run of each ``--deflation`` rank (default: gpsd's 256, where the Ritz vectors leave the
probes almost nothing, and 32, where the probes carry the estimate).

Usage::

    python benchmarks/bench_gcv_large_n.py --out benchmarks/results/gcv_large_n_cpu.md
    python benchmarks/bench_gcv_large_n.py --quick
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
import warnings

import gpytorch
import torch
from _timing import cpu_name, write_report

import gpsd

DTYPE = torch.float64


def problem(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = 5 * torch.rand(n, 2, generator=gen, dtype=DTYPE)
    y = torch.sin(x).sum(-1) + 0.3 * torch.randn(n, generator=gen, dtype=DTYPE)
    return x, y


def kernel() -> gpytorch.kernels.Kernel:
    k = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).to(DTYPE)
    k.base_kernel.lengthscale = torch.tensor(0.8, dtype=DTYPE)
    return k


def scores(x, y, noise, backend: str) -> dict:
    """The scores, standard errors and chosen step of one backend, with the time taken."""
    start = time.perf_counter()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the forced matrix-free backends warn on N this small
        model = gpsd.DataCentricGPR(x, y, kernel(), noise=noise, backend=backend).fit()
        fitted = time.perf_counter()
        gcv, error = model.gcv(), model.gcv_standard_error()
        step = model.best_step("gcv")
    engine = model._current_fit().engine
    return {
        "gcv": gcv,
        "error": error,
        "step": step,
        "fit": fitted - start,
        "gcv_time": time.perf_counter() - fitted,
        "exact": engine.exact_trace,
    }


def cells(got: dict, exact: dict) -> list[str]:
    """The step, the exact score's excess at that step over the exact minimum, the largest
    relative error of the scores, the largest relative standard error and the seconds of one
    backend's row."""
    relative = float(((got["gcv"] - exact["gcv"]).abs() / exact["gcv"]).max())
    spread = float((got["error"] / got["gcv"]).max())
    scores = exact["gcv"]
    excess = float(scores[got["step"] - 1] / scores.min() - 1)
    return [
        str(got["step"]),
        f"{excess:.1e}",
        f"{relative:.1e}",
        "exact" if got["exact"] else f"{spread:.1e}",
        f"{got['fit']:.2f} + {got['gcv_time']:.2f}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=2000, help="training points")
    parser.add_argument("--steps", type=int, default=15, help="distillation steps T")
    parser.add_argument("--noise", type=float, default=0.05, help="the noise of every step")
    parser.add_argument("--seeds", type=int, default=10, help="problems drawn")
    parser.add_argument(
        "--deflation",
        type=int,
        nargs="+",
        default=[gpsd.settings.cg_deflation_rank.value(), 32],
        help="CG's deflation ranks (default: gpsd's 256, and 32)",
    )
    parser.add_argument("--out", help="also write the Markdown report here")
    parser.add_argument("--quick", action="store_true", help="N = 300, 3 seeds")
    args = parser.parse_args()
    if args.quick:
        args.n, args.seeds = 300, 3
    noise = torch.full((args.steps,), args.noise, dtype=DTYPE)
    backends = ["lanczos"] + [f"cg{rank}" for rank in args.deflation]
    rows, agree = [], dict.fromkeys(backends, 0)
    for seed in range(args.seeds):
        x, y = problem(args.n, seed)
        exact = scores(x, y, noise, "dense")
        results = {"lanczos": scores(x, y, noise, "lanczos")}
        for rank in args.deflation:
            with gpsd.settings.cg_deflation_rank(rank):
                results[f"cg{rank}"] = scores(x, y, noise, "cg")
        row = [str(seed), str(exact["step"]), f"{exact['fit'] + exact['gcv_time']:.2f}"]
        for backend in backends:
            agree[backend] += results[backend]["step"] == exact["step"]
            row += cells(results[backend], exact)
        rows.append("| " + " | ".join(row) + " |")
        print(rows[-1], flush=True)
    names = {"lanczos": "Lanczos", **{f"cg{r}": f"CG (deflation {r})" for r in args.deflation}}
    header = ["seed", "dense step", "dense s"]
    for backend in backends:
        header += [
            f"{backend} step",
            f"{backend} excess",
            f"{backend} rel. error",
            f"{backend} rel. SE",
            f"{backend} s",
        ]
    agreement = ", ".join(f"{names[b]} {agree[b]} of {args.seeds}" for b in backends)
    lines = [
        f"# The step GCV chooses at N = {args.n}: matrix-free estimates against the exact GCV "
        "(cpu, float64)",
        "",
        f"- command (in `benchmarks/`): `python {' '.join(sys.argv)}`",
        f"- machine: {cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
        f"gpytorch {gpytorch.__version__}, Python {platform.python_version()}",
        f"- N = {args.n} inputs on [0, 5]², y = sin x₁ + sin x₂ + 0.3 ε, RBF lengthscale 0.8, "
        f"DataCentricGPR with T = {args.steps} steps at noise {args.noise}; "
        f"{gpsd.settings.trace_probes.value()} probes (seed "
        f"{gpsd.settings.trace_probe_seed.value()}); CG deflated by Lanczos runs of rank "
        f"{', '.join(map(str, args.deflation))}; Lanczos grown to its default rtol",
        "- columns per backend: the step chosen; the excess of the exact score at that step over "
        "the exact minimum (0 where the steps agree); the largest relative error of the scores "
        "against the exact ones; the largest relative standard error (`exact`: the engine "
        "needed no probes); seconds of `fit()` + `gcv()`",
        "",
        f"**Agreement with the dense path's step: {agreement}.**",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---:|" * len(header),
        *rows,
    ]
    write_report("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
