"""GPU benchmark suite for large N (issue: "Large N on one GPU").

Skips cleanly (exit 0) where CUDA is absent. For N in a doubling sequence up to ``--max-n`` (or the
largest size that fits), prints Markdown tables of wall time (CUDA events, median of repeats after
a warm-up) and peak device memory (``torch.cuda.max_memory_allocated``; with ``--device cpu``,
the growth of the peak resident set) for:

* one plain GPyTorch ``ExactGP`` fit + prediction (fixed hyperparameters), with Cholesky and with
  GPyTorch's large-N path (CG means, LOVE variances), the baseline of every row's time ratio;
* data-centric GPR for T = 1, 10, 100 with each backend (dense, cholesky, lanczos, cg) and the
  distribution-centric closed form, with the relative errors of the matrix-free paths' means and
  variances against the dense path where both run; the matrix-free backends keep the kernel's
  rows within half the free memory (their default), and run once more at the largest T with
  ``kernel_cache_bytes=0`` ("rows not kept": K evaluated afresh at every product, never whole);
* kernel distillation: distil (K-means, neighbours, least squares, 2 line-search steps) and
  predict 10,000 points, against exact-GP and SGPR prediction of the same points;
* the dense factorisations' achieved fraction of the GPU's measured matmul rate.

DPKL training steps per second against a per-particle loop on the GPU come from
``python benchmarks/bench_dpkl.py --skip-accuracy --device cuda``.

A cell that runs out of memory reads "OOM" and one that fails reads "failed: ..."; a method whose
next doubling is predicted to take longer than ``--max-seconds`` per call (8 times this size's
time for the dense factorisations, 4 times for the matrix-free rows) stops there, and the dense
rows stop above ``--max-dense-n``. The Markdown file is rewritten after every row, so a run cut
short by a time limit keeps what it measured.
``--lengthscale`` sets the RBF lengthscale on inputs in [0, 10]^2: the default 1.0 gives a fast
decaying spectrum (Lanczos resolves it), 0.1 a slowly decaying one (deflated CG's case).

Usage::

    python benchmarks/bench_gpu.py --dtype float32 --out benchmarks/results/gpu_float32.md
    # a smoke run on the CPU (about 20 s on one thread)
    python benchmarks/bench_gpu.py --device cpu --min-n 256 --max-n 512 --m 200 --steps 1 10 \
        --repeats 1 --kd-m 50 --kd-b 10 --kd-test 200 --kd-max-n 512 --max-seconds 5
    python benchmarks/bench_gpu.py --dtype float64 --max-n 65536
    # the agreement of the matrix-free paths with the dense one, alone (no kernel distillation)
    python benchmarks/bench_gpu.py --dtype float64 --methods dense lanczos cg --steps 100 \
        --skip kd rate --warmup 0 --repeats 1

The matrix-free rows' errors come from the output of their last timed call, compared with the
dense row's at the same N and T, so checking accuracy costs no extra run.
"""

from __future__ import annotations

import argparse
import gc
import platform
import statistics
import sys
from typing import NamedTuple

import gpytorch
import torch
from _problems import rbf_kernel, uniform_square_problem
from _timing import (
    Report,
    cpu_name,
    cuda_missing,
    median_time_and_output,
    peak_rss_kib,
    start_peak_rss,
)

from gpsd import DataCentricGPR, DistributionCentricGPR, KernelDistillation

#: The device every table runs on (``--device``).
DEVICE = torch.device("cuda")


def cuda_time(fn, repeats: int, warmup: int = 1) -> tuple[float, object]:
    """Median wall time in seconds of ``fn()`` measured with CUDA events, and its last output."""
    # before every call, untimed: the model of the call before sits in a reference cycle
    # (GPyTorch modules do), and the peak would be the sum of two calls' instead of one's
    for _ in range(warmup):
        gc.collect()
        fn()
    torch.cuda.synchronize()
    times, out = [], None
    for _ in range(repeats):
        out = None
        gc.collect()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times), out


def timed(fn, repeats: int, warmup: int = 1) -> tuple[float, object]:
    """Median seconds of ``fn()`` after ``warmup`` untimed calls (CUDA events on a GPU), and the
    output of the last timed call."""
    if DEVICE.type == "cuda":
        return cuda_time(fn, repeats, warmup)
    return median_time_and_output(fn, repeats, DEVICE, warmup)


def timer(fn, repeats: int, warmup: int = 1) -> float:
    """Median seconds of ``fn()`` after ``warmup`` untimed calls."""
    return timed(fn, repeats, warmup)[0]


def measure(fn, repeats: int, warmup: int = 1) -> tuple[float, str, object]:
    """(median seconds, peak memory in GiB as a table cell, last output) of ``fn``; raises
    ``torch.OutOfMemoryError`` or ``MemoryError`` where it does not fit.

    The peak is ``torch.cuda.max_memory_allocated`` on CUDA, and on the CPU the growth of the
    process's peak resident set over the calls (:func:`_timing.start_peak_rss`; "—" where the
    platform cannot measure it). The output of the last timed call is returned so that
    accuracy checks need no extra run.
    """
    if DEVICE.type == "cuda":
        # what earlier rows left in reference cycles (models, an out-of-memory traceback's
        # frames) would otherwise count in this row's peak, or make it run out of memory
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        seconds, out = timed(fn, repeats, warmup)
        return seconds, f"{torch.cuda.max_memory_allocated() / 2**30:.2f}", out
    base = start_peak_rss()
    seconds, out = timed(fn, repeats, warmup)
    peak = "—" if base is None else f"{max(0, peak_rss_kib() - base) / 2**20:.2f}"
    return seconds, peak, out


def device_name() -> str:
    """The GPU's name and memory (what "fits" is measured against), or the CPU's name."""
    if DEVICE.type != "cuda":
        return f"cpu, {cpu_name()}"
    props = torch.cuda.get_device_properties(DEVICE)
    return f"{props.name} ({props.total_memory / 2**30:.1f} GiB)"


def matmul_rate(dtype: torch.dtype, n: int = 8192) -> float:
    """Measured dense matmul rate in FLOP/s (random operands)."""
    a = torch.randn(n, n, device=DEVICE, dtype=dtype)
    b = torch.randn(n, n, device=DEVICE, dtype=dtype)
    seconds = timer(lambda: a @ b, 10)
    return 2 * n**3 / seconds


def problem(n: int, m: int, dtype: torch.dtype, seed: int = 0):
    return uniform_square_problem(n, m, DEVICE, dtype, seed)


#: The matrix-free rows that evaluate the kernel at every product (``kernel_cache_bytes=0``);
#: the others keep its rows within half the free memory (the default).
NOT_KEPT = "rows not kept"

#: RBF lengthscale of every table (``--lengthscale``).
LENGTHSCALE = 1.0


def rbf(dtype: torch.dtype) -> gpytorch.kernels.Kernel:
    return rbf_kernel(LENGTHSCALE, DEVICE, dtype)


def exact_gp(x, y, test_x, iterative: bool = False):
    """One plain GPyTorch ``ExactGP`` posterior (fit and prediction) at fixed hyperparameters.

    ``iterative=False`` forces Cholesky with exact variances; ``iterative=True`` is GPyTorch's
    large-N path: CG solves for the mean (``max_cholesky_size(0)``) and LOVE variances
    (``fast_pred_var``), each at GPyTorch's default tolerances.
    """

    class GP(gpytorch.models.ExactGP):
        def __init__(self):
            likelihood = gpytorch.likelihoods.GaussianLikelihood().to(x)
            likelihood.noise = torch.tensor(0.1, dtype=x.dtype, device=x.device)
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
            gpytorch.settings.fast_pred_var(iterative),
            gpytorch.settings.max_cholesky_size(0 if iterative else 10**9),
        ):
            post = model(test_x)
            return post.mean, post.variance

    return run


#: The rows of GPyTorch's own ``ExactGP``: label -> ``iterative`` of :func:`exact_gp`.
GPYTORCH_ROWS = {"gpytorch ExactGP, Cholesky": False, "gpytorch ExactGP, CG + LOVE": True}


#: The families of rows of the regression table (``--methods``).
REGRESSION_METHODS = (
    "gpytorch",
    "dense",
    "cholesky",
    "lanczos",
    "cg",
    "not-kept",
    "distribution-centric",
)


def regression_methods(families, steps) -> list[str]:
    """The row labels of the regression table for the chosen ``families`` and ``steps``."""
    methods = list(GPYTORCH_ROWS) if "gpytorch" in families else []
    for kind in ("dense", "cholesky", "lanczos", "cg"):
        if kind in families:
            methods += [f"{kind} T={t}" for t in steps]
    if "not-kept" in families:
        methods += [f"{kind}, {NOT_KEPT} T={max(steps)}" for kind in ("lanczos", "cg")]
    if "distribution-centric" in families:
        methods.append(f"distribution-centric T={max(steps)}")
    return methods


def regression_table(args, dtype: torch.dtype, report: Report) -> None:
    methods = regression_methods(args.methods, args.steps)
    failed: set[str] = set()
    report.add(
        "Errors: max |method − dense| / max |dense| over every step and test point, against the "
        "dense path at the same N and T (GPyTorch's rows against dense T=1, the same posterior). "
        "× GPyTorch: time over the faster GPyTorch row at the same N. Peak: "
        + (
            "torch.cuda.max_memory_allocated."
            if DEVICE.type == "cuda"
            else "growth of the process's peak resident set over the calls."
        ),
        "",
        "| N | method | time (s) | × GPyTorch | peak (GiB) | mean rel. err vs dense | "
        "variance rel. err |",
        "|---:|---|---:|---:|---:|---:|---:|",
    )
    n = args.min_n
    while n <= args.max_n:
        x, y, test_x = problem(n, args.m, dtype)
        # method -> (seconds, peak, output), or the cell that says why it did not run
        results: dict[str, tuple[float, str, object] | str] = {}
        pending: list[str] = []  # measured methods whose rows wait for the reference rows
        for method in methods:
            if method in failed or (n > args.max_dense_n and _is_dense(method)):
                continue
            if method in GPYTORCH_ROWS:
                fn = exact_gp(x, y, test_x, iterative=GPYTORCH_ROWS[method])
            else:
                kind, t = method.rsplit(" T=", 1)
                gammas = torch.linspace(0.1, 1.0, int(t), device=DEVICE, dtype=dtype)
                cls = DistributionCentricGPR if kind == "distribution-centric" else DataCentricGPR
                backend = "auto" if kind == "distribution-centric" else kind.split(",")[0]
                cache = 0 if kind.endswith(NOT_KEPT) else None

                def fn(
                    cls=cls, backend=backend, cache=cache, gammas=gammas, x=x, y=y, test_x=test_x
                ):
                    with torch.no_grad():
                        model = cls(
                            x,
                            y,
                            rbf(dtype),
                            noise=gammas,
                            backend=backend,
                            kernel_cache_bytes=cache,
                        )
                        return model.predict(test_x)

            try:
                results[method] = measure(fn, args.repeats, args.warmup)
            except (torch.OutOfMemoryError, MemoryError):
                failed.add(method)
                results[method] = "OOM"
            except (ValueError, RuntimeError) as err:  # a diverging Lanczos series, a solver
                failed.add(method)
                results[method] = f"failed: {str(err).split(';')[0][:80]}"
            else:
                # the next doubling costs about 8 times as much for a dense factorisation and
                # 4 times for the matrix-free products: stop before it would pass the limit
                growth = 4 if method.startswith(("lanczos", "cg")) else 8
                if results[method][0] * growth > args.max_seconds:
                    failed.add(method)
            # each row as soon as the rows it is compared with (GPyTorch's and the dense ones,
            # which come first) are measured: a run cut short by its time limit keeps its rows
            pending.append(method)
            if not any(_is_reference(m) for m in methods[methods.index(method) + 1 :]):
                report.add(*(_regression_row(n, m, results) for m in pending))
                pending.clear()
        if pending:  # the last reference row was skipped at this N
            report.add(*(_regression_row(n, m, results) for m in pending))
        n *= 2


def _is_reference(method: str) -> bool:
    """Rows that other rows are compared with: GPyTorch's (times) and the dense ones (errors)."""
    return method in GPYTORCH_ROWS or method.startswith("dense")


def _is_dense(method: str) -> bool:
    """Rows that factor the N x N matrix whole (limited by ``--max-dense-n``)."""
    return method.startswith(("dense", "cholesky")) or GPYTORCH_ROWS.get(method) is False


def _regression_row(n: int, method: str, results: dict) -> str:
    """The table row of ``method`` at one N: its time over GPyTorch's and its errors against the
    dense path (those rows are measured first)."""
    baseline = min(
        (r[0] for label, r in results.items() if label in GPYTORCH_ROWS and not isinstance(r, str)),
        default=None,
    )
    dense_out = {
        label.split(" T=")[-1]: r[2]
        for label, r in results.items()
        if label.startswith("dense") and not isinstance(r, str)
    }
    result = results[method]
    if isinstance(result, str):
        return f"| {n} | {method} | {result} | — | — | — | — |"
    seconds, peak, out = result
    ratio = "—" if baseline is None else f"{seconds / baseline:.2f}"
    if method in GPYTORCH_ROWS:
        ref, out = dense_out.get("1"), _Posterior(*out)
    elif method.startswith(("lanczos", "cg")):
        ref = dense_out.get(method.split(" T=")[-1])
    else:
        ref = None
    errs = ["—", "—"]
    if ref is not None:
        errs = [
            f"{float((a - b).abs().max() / b.abs().max()):.1e}"
            for a, b in ((out.mean, ref.mean), (out.variance, ref.variance))
        ]
    return f"| {n} | {method} | {seconds:.4f} | {ratio} | {peak} | {errs[0]} | {errs[1]} |"


class _Posterior(NamedTuple):
    """GPyTorch's (mean, variance) under the names of gpsd's predictions."""

    mean: torch.Tensor
    variance: torch.Tensor


def sgpr_predictor(x, y, test_x, inducing):
    """GPyTorch SGPR/FITC (``InducingPointKernel``) with the distiller's inducing points."""

    class SGPR(gpytorch.models.ExactGP):
        def __init__(self):
            likelihood = gpytorch.likelihoods.GaussianLikelihood().to(x)
            likelihood.noise = torch.tensor(0.1, dtype=x.dtype, device=x.device)
            super().__init__(x, y, likelihood)
            self.mean_module = gpytorch.means.ZeroMean()
            self.covar_module = gpytorch.kernels.InducingPointKernel(
                rbf(x.dtype), inducing_points=inducing.clone(), likelihood=likelihood
            )

        def forward(self, z):
            return gpytorch.distributions.MultivariateNormal(
                self.mean_module(z), self.covar_module(z)
            )

    model = SGPR().eval()

    def run():
        with torch.no_grad(), gpytorch.settings.fast_pred_var(False):
            post = model(test_x)
            return post.mean, post.variance

    return run


def kernel_distillation_table(args, dtype: torch.dtype, report: Report) -> None:
    report.add(
        f"m = {args.kd_m} inducing points, b = {args.kd_b}, 2 line-search steps; "
        f"{args.kd_test} test points; times in seconds, peak in GiB. Exact predict: a fresh "
        "ExactGP's factorisation and prediction (nothing cached); SGPR predict: GPyTorch's "
        "prediction with its caches from the warm-up call; student predict: the stored student.",
        "",
        "| N | distil (s) | student predict (s) | SGPR predict (s) | exact predict (s) | "
        "student vs SGPR | student vs exact | peak distil (GiB) | RMS entry error of W K_UU Wᵀ | "
        "student mean vs exact (rel.) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    )
    n = max(args.min_n, 4 * args.kd_m)
    exact_ok = True
    while n <= args.kd_max_n:
        x, y, test_x = problem(n, args.kd_test, dtype)
        kernel = rbf(dtype)
        holder = {}

        def distil(x=x, y=y, kernel=kernel, holder=holder):
            kd = KernelDistillation.from_data(
                x, y, kernel, noise=0.1, num_inducing=args.kd_m, sparsity=args.kd_b, max_iter=2
            )
            holder["student"], holder["inducing"] = kd.fit().student, kd.inducing_points
            holder["rms"] = kd.frobenius_errors[-1] / x.shape[0]

        try:
            t_distil, peak, _ = measure(distil, 1)
            student = holder["student"]
            t_student, student_prediction = timed(
                lambda student=student, test_x=test_x: student.predict(test_x), 5
            )
            student_mean = student_prediction.mean
            sgpr = sgpr_predictor(x, y, test_x, holder["inducing"])
            t_sgpr = timer(sgpr, 5)
        except (torch.OutOfMemoryError, MemoryError, RuntimeError) as err:
            cell = "OOM" if not isinstance(err, RuntimeError) else "failed"
            report.add(f"| {n} | {cell}: {str(err).splitlines()[0][:80]} |" + " — |" * 9)
            break
        exact_cell, agreement, speedup = "OOM", "n/a", "—"
        if exact_ok:
            try:
                exact = exact_gp(x, y, test_x)
                t_exact, (exact_mean, _) = timed(exact, 3)
                exact_cell, speedup = f"{t_exact:.4f}", f"{t_exact / t_student:.1f}x"
                rel = (student_mean - exact_mean).norm() / exact_mean.norm()
                agreement = f"{float(rel):.2e}"
            except (torch.OutOfMemoryError, MemoryError):
                exact_ok = False
        report.add(
            f"| {n} | {t_distil:.3f} | {t_student:.4f} | {t_sgpr:.4f} | {exact_cell} | "
            f"{t_sgpr / t_student:.1f}x | {speedup} | {peak} | {holder['rms']:.2e} | {agreement} |"
        )
        n *= 2


def factorisation_rate_table(args, dtype: torch.dtype, rate: float, report: Report) -> None:
    """Achieved FLOP/s of the dense factorisations: eigh (about 9 N^3) and Cholesky (N^3 / 3).

    Stops before a size whose eigendecomposition would take longer than ``--max-seconds``."""
    report.add(
        "| N | eigh (s) | eigh fraction of matmul rate | cholesky (s) | cholesky fraction |",
        "|---:|---:|---:|---:|---:|",
    )
    n = args.min_n
    while n <= min(args.max_n, args.max_dense_n):
        gc.collect()  # what the regression rows left in reference cycles (see measure)
        if DEVICE.type == "cuda":
            torch.cuda.empty_cache()
        x, _, _ = problem(n, 1, dtype)
        k = rbf(dtype)(x).to_dense().detach() + 0.1 * torch.eye(n, device=DEVICE, dtype=dtype)
        t_eigh = timer(lambda k=k: torch.linalg.eigh(k), 3)
        t_chol = timer(lambda k=k: torch.linalg.cholesky(k), 3)
        report.add(
            f"| {n} | {t_eigh:.4f} | {9 * n**3 / t_eigh / rate:.3f} | {t_chol:.4f} | "
            f"{n**3 / 3 / t_chol / rate:.3f} |"
        )
        if 8 * t_eigh > args.max_seconds:
            break
        n *= 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument("--min-n", type=int, default=1024)
    parser.add_argument("--max-n", type=int, default=131072)
    parser.add_argument("--max-dense-n", type=int, default=32768)
    parser.add_argument("--m", type=int, default=10000, help="test points")
    parser.add_argument("--steps", type=int, nargs="+", default=[1, 10, 100])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--warmup", type=int, default=1, help="untimed calls before the timed regression ones"
    )
    parser.add_argument(
        "--methods",
        nargs="+",
        default=list(REGRESSION_METHODS),
        choices=REGRESSION_METHODS,
        help="rows of the regression table (not-kept: lanczos and cg with kernel_cache_bytes=0)",
    )
    parser.add_argument(
        "--max-seconds", type=float, default=30.0, help="a method slower than this stops growing N"
    )
    parser.add_argument("--lengthscale", type=float, default=1.0, help="RBF lengthscale")
    parser.add_argument(
        "--kd-m", type=int, default=1000, help="kernel distillation: inducing points"
    )
    parser.add_argument("--kd-b", type=int, default=30, help="kernel distillation: sparsity")
    parser.add_argument(
        "--kd-test", type=int, default=10000, help="kernel distillation: test points"
    )
    parser.add_argument("--kd-max-n", type=int, default=65536)
    parser.add_argument("--skip", nargs="*", default=[], choices=["regression", "kd", "rate"])
    parser.add_argument(
        "--device", default="cuda", help="cuda (the point of this suite) or cpu for a smoke run"
    )
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run: N = 512, T in {1, 10}, 200 test points, kernel distillation with "
        "m = 100, b = 10 at N in {512, 1024}; on the CPU where no CUDA device is here",
    )
    args = parser.parse_args()
    if args.quick:
        args.min_n, args.max_n, args.max_dense_n, args.m, args.steps = 512, 512, 512, 200, [1, 10]
        args.kd_m, args.kd_b, args.kd_test, args.kd_max_n = 100, 10, 200, 1024
        args.max_seconds = 5.0
        if not torch.cuda.is_available():
            args.device = "cpu"
    global DEVICE, LENGTHSCALE
    DEVICE = torch.device(args.device)
    LENGTHSCALE = args.lengthscale
    if cuda_missing(DEVICE):
        return
    dtype = getattr(torch, args.dtype)
    rate = matmul_rate(dtype, 8192 if DEVICE.type == "cuda" else 1024)
    header = "\n".join(
        [
            f"# Large-N benchmark on {DEVICE.type} ({args.dtype})",
            "",
            f"- command: `python benchmarks/bench_gpu.py {' '.join(sys.argv[1:])}`",
            f"- device: {device_name()}, "
            f"CUDA {torch.version.cuda}, "
            f"torch {torch.__version__}, gpytorch {gpytorch.__version__}, "
            f"Python {platform.python_version()}",
            f"- measured {args.dtype} matmul rate: {rate / 1e12:.2f} TFLOP/s (random operands)",
            f"- data: inputs uniform on [0, 10]^2, RBF lengthscale {args.lengthscale}, noise "
            "schedule linspace(0.1, 1, T); gpsd factorisations in float64",
            "",
        ]
    )
    report = Report(args.out)  # rewritten after every row: a run cut short keeps its rows
    report.add(header)
    if "regression" not in args.skip:
        report.add("## Self-distillation for regression", "")
        regression_table(args, dtype, report)
        report.add("")
    if "kd" not in args.skip:
        report.add("## Kernel distillation", "")
        kernel_distillation_table(args, dtype, report)
        report.add("")
    if "rate" not in args.skip:
        report.add("## Dense factorisations against the matmul rate", "")
        factorisation_rate_table(args, dtype, rate, report)
    report.close()


if __name__ == "__main__":
    main()
