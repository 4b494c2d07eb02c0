"""Per-product costs of DistributedKernelOperator on 1, 2 and 3 gloo processes of this CPU.

For each number of processes P and each N, every rank times, as medians of ``--repeats`` calls
after one warm-up (the ranks aligned by a barrier before each call):

* ``local``: its block of rows, ``k(X_I, X) @ B`` for ``B`` of ``--columns`` columns (a
  ``ChunkedKernelOperator`` of its rows, nothing kept: every product evaluates the kernel);
* ``all_gather``: the collective of a product, blocks of ``ceil(N/P) x r`` padded;
* ``all_reduce``: the alternative, a zero-padded ``N x r`` block summed over the ranks;
* ``product``: the whole ``DistributedKernelOperator`` product (local rows, gather, checks).

and fits of ``DataCentricGPR(backend="lanczos", T=10)`` at each ``--fit-n`` through the group,
with the kernel rows kept (``--fit-cache default``: the default cache) or evaluated afresh at
every product (``none``), each followed by a prediction at ``--test-m`` points, the fastest of
``--fit-repeats`` (a fresh model each time): wall and CPU seconds (``time.process_time`` of
each rank: the slowest rank's, and summed over the ranks), the number of products,
the Krylov rank, the rows of the eigenvectors each rank holds and the peak resident memory of
the ranks; with ``--basis-memory N Q``, first (in fresh processes), the peak resident memory of
one ``KernelSpectrum.from_lanczos`` of rank ``Q`` at ``N`` points (blocks of 64 columns, no
kernel row kept, chunks of 32 rows) above that of the operator after one product, in units of
``n_p Q`` float64 entries for the ``n_p`` rows of each rank's eigenvectors; and, for
:class:`gpsd.KernelDistillation` at ``--kd-n``
points (m = 200, b = 10) through the group, one pass of the objective and gradient over
:math:`K_{XX}` (each rank its block of columns) and one fit of 3 block iterations. The tables
give the slowest rank's ``local`` and ``product`` (the critical path) and rank 0's collectives; the report's model section is
written by hand from them (``benchmarks/results/distributed_scaling_model.md``).

Usage::

    python benchmarks/bench_distributed.py --out benchmarks/results/distributed_products_cpu.md
    python benchmarks/bench_distributed.py --quick
    python benchmarks/bench_distributed.py --fits-only --fit-n 4000 8000 --processes 1 2
    python benchmarks/bench_distributed.py --fits-only --fit-n 4000 --basis-memory 8000 512
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist

ROOT = pathlib.Path(__file__).resolve().parents[1]
DTYPE = torch.float64


def _problem(n: int):
    import gpytorch

    gen = torch.Generator().manual_seed(0)
    x = torch.rand(n, 2, generator=gen, dtype=DTYPE) * 10
    y = torch.sin(x).sum(-1) + 0.1 * torch.randn(n, generator=gen, dtype=DTYPE)
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).to(DTYPE)
    kernel.base_kernel.lengthscale = torch.tensor(1.0, dtype=DTYPE)
    return x, y, kernel


def _median(fn, repeats: int) -> float:
    """Median seconds of ``repeats`` calls after one warm-up, each started after a barrier."""
    fn()
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _time_product(n: int, world: int, group: object, args) -> dict:
    """The medians of one product's pieces at ``n`` points (every rank calls this)."""
    from gpsd.linalg import ChunkedKernelOperator, DistributedKernelOperator

    x, _, kernel = _problem(n)
    rhs = torch.randn(n, args.columns, generator=torch.Generator().manual_seed(1), dtype=DTYPE)
    operator = DistributedKernelOperator(x, covar_module=kernel, process_group=group)
    local = ChunkedKernelOperator(x, covar_module=kernel, rows=operator.rows)
    largest = -(-n // world)
    block = torch.randn(largest, args.columns, dtype=DTYPE)
    parts = [torch.empty_like(block) for _ in range(world)]
    full = torch.randn(n, args.columns, dtype=DTYPE)
    with torch.no_grad():
        return {
            "n": n,
            "local": _median(lambda: local @ rhs, args.repeats),
            "all_gather": _median(lambda: dist.all_gather(parts, block), args.repeats),
            "all_reduce": _median(lambda: dist.all_reduce(full), args.repeats),
            "product": _median(lambda: operator @ rhs, args.repeats),
        }


def _time_kernel_distillation(n: int, group: object, args) -> tuple[float, float]:
    """The median seconds of one objective-and-gradient pass of kernel distillation at ``n``
    points through the group, and of one fit of 3 block iterations (every rank calls this)."""
    import gpsd

    x, y, kernel = _problem(n)
    distiller = gpsd.KernelDistillation.from_data(
        x, y, kernel, noise=0.01, num_inducing=200, sparsity=10, max_iter=3, process_group=group
    )
    distiller.prepare()
    values = distiller.weight_values
    one_pass = _median(lambda: distiller.objective_and_gradient(values), args.repeats)
    start_values = values.clone()

    def fit():
        distiller.weight_values = start_values.clone()
        distiller.fit()

    return one_pass, _median(fit, 1)


def _basis_memory(n: int, q: int, group: object) -> dict:
    """The peak resident memory of one Lanczos spectrum of rank ``q`` at ``n`` points through
    the group above the operator's, in MB and in units of ``n_p q`` float64 entries (every rank
    calls this first, in a fresh process: the peak is the process's so far)."""
    from gpsd.linalg import DistributedKernelOperator, KernelSpectrum

    x, _, kernel = _problem(n)
    operator = DistributedKernelOperator(x, covar_module=kernel, process_group=group, chunk_size=32)
    block = torch.randn(n, 64, generator=torch.Generator().manual_seed(5), dtype=DTYPE)
    with torch.no_grad():
        operator @ block  # the product's own buffers, in the baseline
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        spectrum = KernelSpectrum.from_lanczos(
            operator, rank=q, block_size=64, generator=torch.Generator().manual_seed(1)
        )
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    rows = spectrum.eigenvectors.shape[-2]
    return {
        "n": n,
        "q": q,
        "rows": rows,
        "extra_mb": peak - base,
        "units": (peak - base) / (rows * q * 8 / 2**20),
    }


def _time_fit(n: int, cache: str, group: object, args) -> dict:
    """One Lanczos fit at ``n`` points through the group and one prediction after it (every
    rank calls this): wall and CPU seconds of each, and what the engine holds on this rank."""
    import gpsd
    from gpsd.linalg import DistributedKernelOperator

    calls = []
    matmul = DistributedKernelOperator._matmul
    row_block = getattr(DistributedKernelOperator, "row_block_matmul", None)

    def counted(self, rhs):
        calls.append(rhs.shape[-1])
        return matmul(self, rhs)

    def counted_rows(self, rhs):
        calls.append(rhs.shape[-1])
        return row_block(self, rhs)

    x, y, kernel = _problem(n)
    test_x = torch.rand(args.test_m, 2, generator=torch.Generator().manual_seed(2), dtype=DTYPE)
    DistributedKernelOperator._matmul = counted
    if row_block is not None:
        DistributedKernelOperator.row_block_matmul = counted_rows
    times = {"fit": [], "fit_cpu": [], "predict": [], "predict_cpu": []}
    try:
        for _ in range(args.fit_repeats):
            calls.clear()
            model = gpsd.DataCentricGPR(
                x,
                y,
                kernel,
                noise=torch.linspace(0.1, 1.0, 10, dtype=DTYPE),
                backend="lanczos",
                kernel_cache_bytes=0 if cache == "none" else None,
                process_group=group,
            )
            with torch.no_grad():
                dist.barrier()
                wall, cpu = time.perf_counter(), time.process_time()
                model.fit()
                times["fit"].append(time.perf_counter() - wall)
                times["fit_cpu"].append(time.process_time() - cpu)
                products, columns = len(calls), sum(calls)
                dist.barrier()
                wall, cpu = time.perf_counter(), time.process_time()
                model.predict(test_x * 10)
                times["predict"].append(time.perf_counter() - wall)
                times["predict_cpu"].append(time.process_time() - cpu)
    finally:
        DistributedKernelOperator._matmul = matmul
        if row_block is not None:
            DistributedKernelOperator.row_block_matmul = row_block
    engine = model._current_fit().engine
    return {
        "n": n,
        "cache": cache,
        **{key: min(values) for key, values in times.items()},
        "products": products,
        "columns": columns,
        "rank": int(engine.eigenvectors.shape[-1]),
        "basis_rows": int(engine.eigenvectors.shape[-2]),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def worker(rank: int, world: int, init: str, out: str, args) -> None:
    """One rank: time the pieces of a product at every N, then the Lanczos fits."""
    torch.set_num_threads(1)

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    group = dist.group.WORLD
    memory = _basis_memory(*args.basis_memory, group) if args.basis_memory else None
    rows = [] if args.fits_only else [_time_product(n, world, group, args) for n in args.sizes]
    fits = [_time_fit(n, cache, group, args) for n in args.fit_n for cache in args.fit_cache]
    kd_pass, kd_fit = (
        (None, None) if args.fits_only else _time_kernel_distillation(args.kd_n, group, args)
    )
    result = {"rows": rows, "kd_pass": kd_pass, "kd_fit": kd_fit, "fits": fits, "memory": memory}
    with open(out, "w") as handle:
        json.dump(result, handle)
    dist.destroy_process_group()


def launch(world: int, args) -> list[dict]:
    """Run :func:`worker` on ``world`` processes; their results in rank order."""
    folder = pathlib.Path(tempfile.mkdtemp(prefix="bench_distributed_"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    if pathlib.Path("/sys/class/net/lo").exists():
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    outs = [folder / f"rank{r}.json" for r in range(world)]
    command = [sys.executable, __file__, "--worker", "--world", str(world), "--init"]
    common = [
        "--sizes", *map(str, args.sizes), "--columns", str(args.columns),
        "--repeats", str(args.repeats), "--fit-n", *map(str, args.fit_n), "--kd-n", str(args.kd_n),
        "--fit-cache", *args.fit_cache, "--test-m", str(args.test_m),
        "--fit-repeats", str(args.fit_repeats),
    ] + (["--fits-only"] if args.fits_only else []) + (
        ["--basis-memory", *map(str, args.basis_memory)] if args.basis_memory else []
    )  # fmt: skip
    procs = [
        subprocess.Popen([*command, str(folder / "store"), "--rank", str(r), "--result", str(o),
                          *common], env=env)
        for r, o in enumerate(outs)
    ]  # fmt: skip
    for proc in procs:
        if proc.wait() != 0:
            raise SystemExit(f"a rank of the {world}-process run failed")
    return [json.loads(o.read_text()) for o in outs]


def report(results: dict[int, list[dict]], args) -> str:
    import gpytorch
    from _timing import cpu_name

    fits = _fit_table(results, args) + _memory_table(results, args)
    if args.fits_only:
        return "\n".join(_header(args, cpu_name(), gpytorch.__version__) + fits + [""])
    lines = [
        "# DistributedKernelOperator: per-product costs on gloo processes of one CPU",
        "",
        f"- command: `python benchmarks/bench_distributed.py {' '.join(sys.argv[1:])}`",
        f"- machine: {cpu_name()}, {os.cpu_count()} cores (the load averages at start and end "
        "are in the line above and below); each process runs one thread (OMP_NUM_THREADS=1), "
        "so 3 processes share 2 cores",
        f"- device: CPU; dtype float64; torch {torch.__version__}, gpytorch "
        f"{gpytorch.__version__}, Python {platform.python_version()}; gloo over loopback",
        f"- kernel: RBF (lengthscale 1) on inputs uniform in [0, 10]^2; right-hand sides of "
        f"{args.columns} columns (a Lanczos block); medians of {args.repeats} calls after one "
        "warm-up, each started after a barrier; no kernel rows kept",
        "",
        "| P | N | local rows (s, slowest rank) | all_gather (ms) | all_reduce (ms) | "
        "whole product (s, slowest rank) | comm. share |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for world, ranks in results.items():
        for i, row in enumerate(ranks[0]["rows"]):
            local = max(r["rows"][i]["local"] for r in ranks)
            product = max(r["rows"][i]["product"] for r in ranks)
            lines.append(
                f"| {world} | {row['n']} | {local:.4f} | {1e3 * row['all_gather']:.2f} | "
                f"{1e3 * row['all_reduce']:.2f} | {product:.4f} | "
                f"{row['all_gather'] / max(product, 1e-12):.1%} |"
            )
    lines += [""] + fits
    lines += [
        "",
        f"`KernelDistillation` through the group, n = {args.kd_n}, m = 200, b = 10 (each rank "
        "its block of columns of K_XX; medians after one warm-up):",
        "",
        "| P | objective + gradient pass (s, slowest rank) | fit, 3 block iterations (s, "
        "slowest rank) |",
        "|---:|---:|---:|",
    ]
    for world, ranks in results.items():
        one_pass = max(r["kd_pass"] for r in ranks)
        fit = max(r["kd_fit"] for r in ranks)
        lines.append(f"| {world} | {one_pass:.3f} | {fit:.2f} |")
    lines += [""]
    return "\n".join(lines)


def _header(args, cpu: str, gpytorch_version: str) -> list[str]:
    """The report's title and settings, for a run of the fits alone."""
    return [
        "# Lanczos fits through a process group on gloo processes of one CPU",
        "",
        f"- command: `python benchmarks/bench_distributed.py {' '.join(sys.argv[1:])}`",
        f"- machine: {cpu}, {os.cpu_count()} cores (the load averages at start and end are in "
        "the lines above and below); each process runs one thread (OMP_NUM_THREADS=1)",
        f"- device: CPU; dtype float64; torch {torch.__version__}, gpytorch {gpytorch_version}, "
        f"Python {platform.python_version()}; gloo over loopback",
        "- kernel: RBF (lengthscale 1) on inputs uniform in [0, 10]^2",
        "",
    ]


def _fit_table(results: dict[int, list[dict]], args) -> list[str]:
    """The fits' table: one row per P, N and cache setting."""
    lines = [
        f'`DataCentricGPR(backend="lanczos")` fits, T = 10 (noise 0.1 to 1), through the group, '
        f"then one prediction (means and variances) at {args.test_m} test points. Wall seconds "
        "of the slowest rank; CPU seconds of the slowest rank and summed over the ranks; "
        "kernel rows kept within the default cache (`default`) or evaluated afresh at every "
        f"product (`none`); the fastest of {args.fit_repeats} fits:",
        "",
        "| P | N | kernel rows kept | fit (s) | fit CPU (s, slowest rank) | fit CPU (s, all "
        "ranks) | predict (s) | predict CPU (s, all ranks) | products | Krylov rank | "
        "eigenvector rows per rank | peak RSS per rank so far (MB) |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for world, ranks in results.items():
        for i, fit in enumerate(ranks[0]["fits"]):
            of = [r["fits"][i] for r in ranks]
            lines.append(
                f"| {world} | {fit['n']} | {fit['cache']} | {max(f['fit'] for f in of):.2f} | "
                f"{max(f['fit_cpu'] for f in of):.2f} | {sum(f['fit_cpu'] for f in of):.2f} | "
                f"{max(f['predict'] for f in of):.2f} | "
                f"{sum(f['predict_cpu'] for f in of):.2f} | {fit['products']} | {fit['rank']} | "
                f"{max(f['basis_rows'] for f in of)} | {max(f['peak_rss_mb'] for f in of):.0f} |"
            )
    return lines


def _memory_table(results: dict[int, list[dict]], args) -> list[str]:
    """The basis' memory table (``--basis-memory``): one row per P, the largest rank's."""
    if not args.basis_memory:
        return []
    n, q = args.basis_memory
    lines = [
        "",
        f"Peak resident memory of one `KernelSpectrum.from_lanczos` of rank {q} at N = {n} "
        "through the group (blocks of 64 columns, no kernel row kept, chunks of 32 rows), above "
        "the operator's after one product, on the rank where it is largest; `n_p` is the rows of "
        "each rank's eigenvectors:",
        "",
        "| P | rows per rank n_p | above the operator (MB) | in n_p q float64 entries |",
        "|---:|---:|---:|---:|",
    ]
    for world, ranks in results.items():
        worst = max((r["memory"] for r in ranks), key=lambda m: m["extra_mb"])
        lines.append(
            f"| {world} | {worst['rows']} | {worst['extra_mb']:.0f} | {worst['units']:.1f} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2000, 4000, 8000, 16000])
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--columns", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--fit-n", type=int, nargs="+", default=[4000])
    parser.add_argument("--fit-cache", nargs="+", choices=["none", "default"], default=["none"])
    parser.add_argument("--test-m", type=int, default=2000)
    parser.add_argument("--fit-repeats", type=int, default=1)
    parser.add_argument("--fits-only", action="store_true", help="no product or KD timings")
    parser.add_argument("--basis-memory", type=int, nargs=2, metavar=("N", "Q"), default=None)
    parser.add_argument("--kd-n", type=int, default=3000)
    parser.add_argument("--quick", action="store_true", help="N = 1000, 2000; P = 1, 2")
    parser.add_argument("--out", default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--init", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.rank, args.world, args.init, args.result, args)
        return
    if args.quick:
        args.sizes, args.processes, args.repeats, args.fit_n = [1000, 2000], [1, 2], 2, [1000]
        args.kd_n = 1000
    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    from _timing import write_report

    results = {world: launch(world, args) for world in args.processes}
    write_report(report(results, args), args.out)


if __name__ == "__main__":
    main()
