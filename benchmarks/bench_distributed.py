"""Per-product costs of DistributedKernelOperator on 1, 2 and 3 gloo processes of this CPU.

For each number of processes P and each N, every rank times, as medians of ``--repeats`` calls
after one warm-up (the ranks aligned by a barrier before each call):

* ``local``: its block of rows, ``k(X_I, X) @ B`` for ``B`` of ``--columns`` columns (a
  ``ChunkedKernelOperator`` of its rows, nothing kept: every product evaluates the kernel);
* ``all_gather``: the collective of a product, blocks of ``ceil(N/P) x r`` padded;
* ``all_reduce``: the alternative, a zero-padded ``N x r`` block summed over the ranks;
* ``product``: the whole ``DistributedKernelOperator`` product (local rows, gather, checks).

and one fit of ``DataCentricGPR(backend="lanczos", T=10)`` at ``--fit-n`` points through the
group, with its number of products; and, for :class:`gpsd.KernelDistillation` at ``--kd-n``
points (m = 200, b = 10) through the group, one pass of the objective and gradient over
:math:`K_{XX}` (each rank its block of columns) and one fit of 3 block iterations. The tables
give the slowest rank's ``local`` and ``product`` (the critical path) and rank 0's collectives; the report's model section is
written by hand from them (``benchmarks/results/distributed_scaling_model.md``).

Usage::

    python benchmarks/bench_distributed.py --out benchmarks/results/distributed_products_cpu.md
    python benchmarks/bench_distributed.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
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


def worker(rank: int, world: int, init: str, out: str, args) -> None:
    """One rank: time the pieces of a product at every N, then one Lanczos fit."""
    torch.set_num_threads(1)
    import gpsd
    from gpsd.linalg import DistributedKernelOperator

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    group = dist.group.WORLD
    rows = [_time_product(n, world, group, args) for n in args.sizes]
    # one fit through the group, counting its products
    calls = []
    matmul = DistributedKernelOperator._matmul

    def counted(self, rhs):
        calls.append(rhs.shape[-1])
        return matmul(self, rhs)

    DistributedKernelOperator._matmul = counted
    x, y, kernel = _problem(args.fit_n)
    dist.barrier()
    start = time.perf_counter()
    with torch.no_grad():
        model = gpsd.DataCentricGPR(
            x,
            y,
            kernel,
            noise=torch.linspace(0.1, 1.0, 10, dtype=DTYPE),
            backend="lanczos",
            kernel_cache_bytes=0,
            process_group=group,
        ).fit()
    fit = time.perf_counter() - start
    kd_pass, kd_fit = _time_kernel_distillation(args.kd_n, group, args)
    result = {
        "rows": rows,
        "kd_pass": kd_pass,
        "kd_fit": kd_fit,
        "fit": fit,
        "products": len(calls),
        "columns": sum(calls),
        "rank": int(model._current_fit().engine.eigenvectors.shape[-1]),
    }
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
        "--repeats", str(args.repeats), "--fit-n", str(args.fit_n), "--kd-n", str(args.kd_n),
    ]  # fmt: skip
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
    lines += [
        "",
        f'One `DataCentricGPR(backend="lanczos")` fit, T = 10, N = {args.fit_n}, '
        "`kernel_cache_bytes=0`, through the group:",
        "",
        "| P | fit (s, rank 0) | products | columns multiplied | Krylov rank |",
        "|---:|---:|---:|---:|---:|",
    ]
    for world, ranks in results.items():
        r0 = ranks[0]
        lines.append(
            f"| {world} | {r0['fit']:.2f} | {r0['products']} | {r0['columns']} | {r0['rank']} |"
        )
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2000, 4000, 8000, 16000])
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--columns", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--fit-n", type=int, default=4000)
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
        args.sizes, args.processes, args.repeats, args.fit_n = [1000, 2000], [1, 2], 2, 1000
        args.kd_n = 1000
    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    from _timing import write_report

    results = {world: launch(world, args) for world in args.processes}
    write_report(report(results, args), args.out)


if __name__ == "__main__":
    main()
