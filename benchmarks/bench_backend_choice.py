"""Calibration of ``backend="auto"``: every backend's time against N, T and dtype on one device.

For each N (doubling) and number of steps T, fits :class:`gpsd.DataCentricGPR` with each backend
(dense, cholesky, lanczos, cg) and with ``auto``, predicts every step's means and variances at
``--m`` test points, and reports each backend's wall time, the fastest, the backend ``auto``
chose, auto's time over the fastest, and auto's relative error against the dense backend. A second
table times the bare factorisations (``eigh`` and Cholesky of K + 0.1 I) in float32 and float64.
The report ends with where the Cholesky chain stops beating the dense eigendecomposition, which
sets the default of ``gpsd.settings.max_chain_factorisations``.

Data: inputs uniform on [0, 10]^2, targets sin(x1) + sin(x2) + noise, an RBF kernel with
``--lengthscale`` (1.0: a fast-decaying spectrum that Lanczos resolves; 0.1: a slowly decaying one,
deflated CG's case), noise schedule linspace(0.1, 1, T). Each cell runs once as a warm-up, then
``--repeats`` timed times (2 where the warm-up took 2 s or more); the median is reported.
A backend slower than ``--max-seconds`` in a cell is not run for larger T at that N or for that T
and larger at larger N (it would cost more still).

Usage::

    python benchmarks/bench_backend_choice.py --out benchmarks/results/backend_choice_cpu.md
    python benchmarks/bench_backend_choice.py --device cuda --sizes 4096 8192 16384 32768
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time

import gpytorch
import torch
from _problems import rbf_kernel as rbf
from _problems import uniform_square_problem as problem
from _timing import Report, cpu_name, cuda_missing, sync

from gpsd import DataCentricGPR
from gpsd.linalg import KernelSpectrum, ShiftedCG, ShiftedCholesky

BACKENDS = ("dense", "cholesky", "lanczos", "cg")


def seconds(fn, repeats: int, device: torch.device) -> tuple[float, object]:
    """Wall time of ``fn`` (see the module docstring) and its last result."""

    def once():
        sync(device)
        start = time.perf_counter()
        out = fn()
        sync(device)
        return time.perf_counter() - start, out

    first, out = once()  # the warm-up
    times = []
    for _ in range(repeats if first < 2.0 else min(repeats, 2)):
        out = None  # the previous model (its factorisation, its kept rows) freed before the next
        elapsed, out = once()
        times.append(elapsed)
    return statistics.median(times), out


def engine_name(model: DataCentricGPR) -> str:
    """The backend a model fitted under ``torch.no_grad()`` used (``auto`` may choose otherwise
    where a gradient is needed, so the engine is looked up in the same grad mode)."""
    with torch.no_grad():
        engine = model._current_fit().engine
    if isinstance(engine, ShiftedCholesky):
        return "cholesky"
    if isinstance(engine, ShiftedCG):
        return "cg"
    if isinstance(engine, KernelSpectrum) and engine.is_truncated:
        return "lanczos"
    return "dense"


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-300))


def choice_table(args, device: torch.device, data_dtype: torch.dtype, report: Report) -> list:
    """The per-(N, T) table (added to ``report`` row by row); returns the rows as tuples."""
    linalg_dtype = getattr(torch, args.linalg_dtype)
    header = "| N | T | " + " | ".join(BACKENDS) + " | fastest | auto chose | auto (s) | "
    header += "auto / fastest | auto mean err | auto var. err |"
    report.add(header, "|---:|---:|" + "---:|" * len(BACKENDS) + "---|---|---:|---:|---:|---:|")
    records = []
    too_slow: dict[str, int] = {}  # backend -> smallest T at which it exceeded --max-seconds
    failed: dict[tuple, str] = {}  # (N, T, backend) -> "OOM" or "fails"
    for n in args.sizes:
        x, y, test_x = problem(n, args.m, device, data_dtype)
        kernel = rbf(args.lengthscale, device, data_dtype)
        stopped_here: dict[str, int] = {}
        for t in args.steps:
            gammas = torch.linspace(0.1, 1.0, t, device=device, dtype=data_dtype)
            times: dict[str, float] = {}
            outputs = {}
            for backend in (*BACKENDS, "auto"):
                limit = min(too_slow.get(backend, 10**9), stopped_here.get(backend, 10**9))
                if t >= limit:
                    continue

                def fit_predict(backend=backend, data=(x, y, kernel), noise=gammas, test_x=test_x):
                    model = DataCentricGPR(
                        *data, noise=noise, backend=backend, linalg_dtype=linalg_dtype
                    )
                    with torch.no_grad():
                        return model, model.predict(test_x)

                try:
                    elapsed, (model, path) = seconds(fit_predict, args.repeats, device)
                except (torch.OutOfMemoryError, MemoryError, ValueError) as err:
                    # out of memory, or a Lanczos series that diverges (its error names cg)
                    print(f"N = {n}, T = {t}, {backend}: {type(err).__name__}", flush=True)
                    failed[(n, t, backend)] = "OOM" if "emory" in type(err).__name__ else "fails"
                    stopped_here[backend] = t
                    too_slow[backend] = min(too_slow.get(backend, 10**9), t)
                    continue
                times[backend], outputs[backend] = elapsed, (engine_name(model), path)
                del model  # its engine would shrink the free memory the next backend plans with
                if elapsed > args.max_seconds:
                    stopped_here[backend] = t
                    too_slow[backend] = min(too_slow.get(backend, 10**9), t)
            measured = {b: s for b, s in times.items() if b != "auto"}
            fastest = min(measured, key=measured.get) if measured else None
            cells = [
                f"{times[b]:.3f}" if b in times else failed.get((n, t, b), "—") for b in BACKENDS
            ]
            chose, auto_s, ratio, errs = "—", "—", "—", ["—", "—"]
            if "auto" in times:
                chose, path = outputs["auto"]
                auto_s = f"{times['auto']:.3f}"
                if fastest is not None:
                    ratio = f"{times['auto'] / measured[fastest]:.2f}"
                if "dense" in outputs:
                    ref = outputs["dense"][1]
                    errs = [
                        f"{relative_error(path.mean, ref.mean):.1e}",
                        f"{relative_error(path.variance, ref.variance):.1e}",
                    ]
            report.add(
                f"| {n} | {t} | {' | '.join(cells)} | {fastest or '—'} | {chose} | {auto_s} | "
                f"{ratio} | {errs[0]} | {errs[1]} |"
            )
            records.append((n, t, measured, fastest))
    return records


def factorisation_table(args, device: torch.device, report: Report) -> dict:
    """eigh and Cholesky of the same kernel matrix, float32 and float64 (added to ``report`` row
    by row); returns their ratios by dtype."""
    report.add(
        "| N | dtype | eigh (s) | cholesky (s) | eigh / cholesky |",
        "|---:|---|---:|---:|---:|",
    )
    ratios: dict[str, list[float]] = {}
    for n in args.sizes:
        for name in ("float32", "float64"):
            dtype = getattr(torch, name)
            x, _, _ = problem(n, 1, device, dtype)
            k = rbf(args.lengthscale, device, dtype)(x).to_dense().detach()
            k = k + 0.1 * torch.eye(n, device=device, dtype=dtype)
            try:
                t_eigh, _ = seconds(lambda k=k: torch.linalg.eigh(k), args.repeats, device)
                t_chol, _ = seconds(lambda k=k: torch.linalg.cholesky(k), args.repeats, device)
            except (torch.OutOfMemoryError, MemoryError):
                report.add(f"| {n} | {name} | OOM | OOM | — |")
                continue
            ratios.setdefault(name, []).append(t_eigh / t_chol)
            report.add(f"| {n} | {name} | {t_eigh:.4f} | {t_chol:.4f} | {t_eigh / t_chol:.1f} |")
            del k
    return ratios


def summary(records: list, ratios: dict, linalg_dtype: str) -> str:
    """The constants that the measurements suggest, next to the ones in use."""
    from gpsd import settings

    lines = []
    if linalg_dtype in ratios:
        lines.append(
            f"- eigh / Cholesky in {linalg_dtype} (median over N): "
            f"{statistics.median(ratios[linalg_dtype]):.1f}."
        )
    for n in sorted({r[0] for r in records}):
        chain_wins = [t for m, t, times, _ in records if m == n and _beats(times, "cholesky")]
        dense_wins = [t for m, t, times, _ in records if m == n and _beats(times, "dense")]
        lines.append(
            f"- N = {n}: the Cholesky chain beats the dense eigendecomposition for T in "
            f"{chain_wins or 'none measured'}, the dense one beats the chain for T in "
            f"{dense_wins or 'none measured'}; fastest by T: "
            + ", ".join(f"{t}: {f}" for m, t, _, f in records if m == n)
            + "."
        )
    wins = [
        max((t for m, t, times, _ in records if m == n and _beats(times, "cholesky")), default=0)
        for n in sorted({r[0] for r in records})
    ]
    if wins:
        lines.append(
            f"- largest T at which the chain beat the dense eigendecomposition at every N: "
            f"{min(wins)} (a `max_chain_factorisations` for this device)."
        )
    lines.append(
        f"- in use: `gpsd.settings.max_chain_factorisations` = "
        f"{settings.max_chain_factorisations.value()}, `gpsd.settings.dense_max_n` = "
        f"{settings.dense_max_n.value()}."
    )
    return "\n".join(lines)


def _beats(times: dict, backend: str) -> bool:
    other = "dense" if backend == "cholesky" else "cholesky"
    return backend in times and other in times and times[backend] < times[other]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--steps", type=int, nargs="+", default=[1, 3, 10, 30, 100])
    parser.add_argument("--m", type=int, default=1000, help="test points")
    parser.add_argument("--dtype", default="float64", choices=["float32", "float64"])
    parser.add_argument(
        "--linalg-dtype",
        default="float64",
        choices=["float32", "float64"],
        help="dtype of the factorisations (the regressors' linalg_dtype)",
    )
    parser.add_argument("--lengthscale", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-seconds", type=float, default=60.0)
    parser.add_argument("--skip-factorisations", action="store_true")
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="N in {512, 1024}, T in {1, 10}, 200 test points (under a minute on 2 cores)",
    )
    args = parser.parse_args()
    if args.quick:
        args.sizes, args.steps, args.m, args.max_seconds = [512, 1024], [1, 10], 200, 10.0
    device = torch.device(args.device)
    if cuda_missing(device):
        return
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    header = "\n".join(
        [
            f"# Backend choice on {device.type}: data {args.dtype}, factorisations "
            f"{args.linalg_dtype}",
            "",
            f"- command: `python benchmarks/bench_backend_choice.py {' '.join(sys.argv[1:])}`",
            f"- machine: {platform.system()}, {name}, {torch.get_num_threads()} torch threads",
            f"- torch {torch.__version__} (CUDA {torch.version.cuda}), gpytorch "
            f"{gpytorch.__version__}, Python {platform.python_version()}",
            f"- data: inputs uniform on [0, 10]^2, RBF lengthscale {args.lengthscale}, "
            f"{args.m} test points, noise schedule linspace(0.1, 1, T); times in seconds for "
            "fit + every step's means and variances",
            "",
        ]
    )
    report = Report(args.out)  # rewritten after every row: a run cut short keeps its rows
    report.add(header, "## Every backend against N and T", "")
    records = choice_table(args, device, getattr(torch, args.dtype), report)
    report.add("")
    ratios: dict = {}
    if not args.skip_factorisations:
        report.add("## Bare factorisations", "")
        ratios = factorisation_table(args, device, report)
        report.add("")
    report.add("## What the measurements suggest", "", summary(records, ratios, args.linalg_dtype))
    report.close()


if __name__ == "__main__":
    main()
