"""Hyperparameter training on 1 and 2 gloo processes of this machine: time per iteration.

Each configuration trains the same model, :meth:`gpsd.DataCentricGPR.optimize_hyperparameters`
of an ARD RBF kernel and the teacher's noise on ``--n`` flights (Adam, ``--iters``
iterations, ``--backend`` matrix-free), and times every iteration from the callback's clock:

* ``1 process, 1 thread``: no process group;
* ``1 process, P threads``: no process group, torch with as many threads as the group has processes
  (what a user of one process would run on these cores);
* ``P processes, 1 thread each``: ``process_group=`` a gloo group of P processes on loopback, each
  rank computing its rows of every kernel product.

The table gives the median seconds per iteration after the first (its warm-up), rank 0's
clock, and the final loss (the same on every configuration to the CG tolerance: the probe
vectors are seeded per iteration).

Usage::

    python benchmarks/bench_distributed_training.py --n 4000 --iters 6 \\
        --out benchmarks/results/distributed_training_cpu.md
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

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _worker(args: argparse.Namespace) -> None:
    """One rank (or the single process): train and write its per-iteration times as JSON."""
    import gpytorch
    import torch.distributed as dist

    import gpsd
    from gpsd.data import load_dataset

    torch.set_num_threads(args.threads)
    group = None
    if args.world > 1:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{args.store}",
            rank=args.rank,
            world_size=args.world,
        )
        group = dist.group.WORLD
    data = load_dataset("flights", n_train=args.n, n_test=10, seed=0, dtype=torch.float64)
    x, y = data.train_x, data.train_y
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=x.shape[-1]))
    kernel = kernel.to(torch.float64)
    model = gpsd.DataCentricGPR(
        x, y, kernel, noise=[0.1] * 3, backend=args.backend, process_group=group
    )
    stamps = []

    def callback(record) -> None:
        stamps.append(time.perf_counter())

    if group is not None:
        dist.barrier(group)
    start = time.perf_counter()
    model.optimize_hyperparameters(max_iter=args.iters, lr=0.1, callback=callback)
    times = [b - a for a, b in zip([start, *stamps[:-1]], stamps, strict=True)]
    if args.rank == 0:
        pathlib.Path(args.result).write_text(
            json.dumps({"times": times, "loss": float(model.history[-1])})
        )
    if group is not None:
        dist.destroy_process_group()


def _run(args: argparse.Namespace, world: int, threads: int) -> dict:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "GLOO_SOCKET_IFNAME": "lo",
    }
    with tempfile.TemporaryDirectory() as folder:
        store, result = pathlib.Path(folder) / "store", pathlib.Path(folder) / "result.json"
        common = [
            sys.executable,
            __file__,
            "--worker",
            "--n",
            str(args.n),
            "--iters",
            str(args.iters),
            "--backend",
            args.backend,
            "--world",
            str(world),
            "--threads",
            str(threads),
            "--store",
            str(store),
            "--result",
            str(result),
        ]
        procs = [
            subprocess.Popen([*common, "--rank", str(r)], env=env, stderr=subprocess.PIPE)
            for r in range(world)
        ]
        for proc in procs:
            _, err = proc.communicate()
            if proc.returncode != 0:
                raise RuntimeError(err.decode(errors="replace")[-3000:])
        return json.loads(result.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=4000)
    parser.add_argument("--iters", type=int, default=6)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--backend", default="lanczos", choices=["lanczos", "cg"])
    parser.add_argument("--out", default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--store", default="", help=argparse.SUPPRESS)
    parser.add_argument("--result", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args)
        return
    p = args.processes
    load_start = os.getloadavg()
    configs = [
        ("1 process, 1 thread", 1, 1),
        (f"1 process, {p} threads", 1, p),
        (f"{p} processes, 1 thread each", p, 1),
    ]
    rows = []
    for label, world, threads in configs:
        result = _run(args, world, threads)
        per_iter = statistics.median(result["times"][1:])
        rows.append((label, per_iter, result["loss"]))
        print(f"{label}: {per_iter:.2f} s / iteration", file=sys.stderr)
    load_end = os.getloadavg()
    import gpytorch

    base = rows[0][1]
    lines = [
        f"# Training on 1 and {p} processes: flights, N = {args.n:,}",
        "",
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores; float64, ARD RBF "
        f"on 6 inputs, `{args.backend}` backend, Adam lr 0.1, {args.iters} iterations; torch "
        f"{torch.__version__}, gpytorch {gpytorch.__version__}, Python {platform.python_version()}; "
        f"gloo on loopback. Machine load (1, 5, 15 min) at start: "
        f"{', '.join(f'{v:.2f}' for v in load_start)}; at end: "
        f"{', '.join(f'{v:.2f}' for v in load_end)}.",
        "",
        "| configuration | s / iteration (median after the first) | vs 1 process, 1 thread | final loss |",
        "|---|---:|---:|---:|",
    ]
    lines += [f"| {label} | {t:.2f} | {base / t:.2f}x | {loss:.6f} |" for label, t, loss in rows]
    lines += [
        "",
        "Command: `python benchmarks/bench_distributed_training.py "
        f"--n {args.n} --iters {args.iters} --processes {p} --backend {args.backend}`",
    ]
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        pathlib.Path(args.out).write_text(report)


if __name__ == "__main__":
    main()
