"""Peak memory and time of the CG backend's fit, means and variances, each case in a new process.

``backend="cg"`` iterates on ``N x M`` blocks (one column per test point for the variances). On
the CPU, the memory a process holds depends on the C allocator's history as well as on the
tensors alive at once, so every case runs in a fresh Python process, and each phase reports the
growth of the process's peak resident set (glibc ``malloc_trim`` first, then ``VmHWM``
restarted, as in ``bench_gpu.py --device cpu``); on CUDA, ``torch.cuda.max_memory_allocated``.

Cases, on inputs uniform in [0, 10]^2 with an RBF kernel of lengthscale 0.1 (a slowly decaying
spectrum: CG's case), float64, ``--m`` test points, the matrix-free backend's default row cache:

* data-centric, T = 100 with the noise going from 0.1 to 1 (one multi-shift CG per test chunk);
* data-centric, T = 10 with constant noise 0.1 (one deflated CG per test chunk);
* distribution-centric, T = 100 with the noise going from 0.1 to 1 (effective noises down to
  1e-3: many iterations).

Phases: "fit" (the rank-256 Lanczos deflation), "means" (every step's mean weights), "predict"
(means and variances at the test points, the weights already there).

Usage::

    python benchmarks/bench_cg_memory.py --out benchmarks/results/cg_memory_cpu.md
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time

import gpytorch
import torch

CASES = (
    "data-centric, T=100, changing noise",
    "data-centric, T=10, constant noise",
    "distribution-centric, T=100",
)


def run_case(case: str, n: int, m: int, device: str) -> dict:
    """One case in this process: the peak growth (MiB) and seconds of every phase."""
    from _problems import rbf_kernel, uniform_square_problem
    from _timing import peak_rss_kib, start_peak_rss, sync

    from gpsd import DataCentricGPR, DistributionCentricGPR

    dev = torch.device(device)
    dtype = torch.float64
    x, y, test_x = uniform_square_problem(n, m, dev, dtype)
    if case == CASES[1]:
        gamma = torch.full((10,), 0.1, dtype=dtype, device=dev)
    else:
        gamma = torch.linspace(0.1, 1.0, 100, dtype=dtype, device=dev)
    cls = DistributionCentricGPR if case == CASES[2] else DataCentricGPR
    results = {}

    def phase(name, fn):
        sync(dev)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
            base = torch.cuda.memory_allocated(dev)
        else:
            base = start_peak_rss() or 0
        start = time.perf_counter()
        out = fn()
        sync(dev)
        seconds = time.perf_counter() - start
        if dev.type == "cuda":
            grown = (torch.cuda.max_memory_allocated(dev) - base) / 2**20
        else:
            grown = (peak_rss_kib() - base) / 1024
        results[name] = (grown, seconds)
        return out

    with torch.no_grad():
        model = cls(x, y, rbf_kernel(0.1, dev, dtype), noise=gamma, backend="cg")
        state = phase("fit", model._state)
        phase("means", lambda: model._mean_weights(state))
        phase("predict", lambda: model.predict(test_x))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, nargs="+", default=[2048, 4096], help="training sizes")
    parser.add_argument("--m", type=int, default=1000, help="test points")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--out", help="also write the Markdown report here")
    parser.add_argument("--quick", action="store_true", help="N = 1024, 200 test points")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # internal: run one case, print JSON
    args = parser.parse_args()
    if args.quick:
        args.n, args.m = [1024], 200
    if args.case is not None:
        print(json.dumps(run_case(args.case, args.n[0], args.m, args.device)))
        return
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("CUDA is not available: nothing to measure on the GPU.")
        return
    from _timing import cpu_name, load_line

    import gpsd

    lines = [
        load_line().replace("at end", "at the last row"),
        "",
        f"# Memory and time of backend='cg' ({args.device}, float64)",
        "",
        f"- command (in `benchmarks/`): `python {' '.join(sys.argv)}`",
        f"- machine: {cpu_name()}, {torch.get_num_threads()} threads, torch "
        f"{torch.__version__}, gpytorch {gpytorch.__version__}, Python "
        f"{platform.python_version()}; gpsd from {gpsd.__file__}",
        f"- {args.m} test points; RBF lengthscale 0.1 on [0, 10]^2; each case in a new process",
        "- peak: "
        + (
            "torch.cuda.max_memory_allocated above the memory allocated at the phase's start."
            if args.device.startswith("cuda")
            else "growth of the process's peak resident set over the phase (after malloc_trim)."
        ),
        "",
        "| N | case | fit: peak (MiB) / s | means: peak (MiB) / s | predict: peak (MiB) / s |",
        "|---:|---|---:|---:|---:|",
    ]
    print("\n".join(lines), flush=True)
    for n in args.n:
        for case in CASES:
            command = [sys.executable, __file__, "--case", case, "--n", str(n), "--m", str(args.m)]
            command += ["--device", args.device]
            done = subprocess.run(command, capture_output=True, text=True, check=True)
            results = json.loads(done.stdout.strip().splitlines()[-1])
            cells = [
                f"{results[p][0]:.0f} / {results[p][1]:.1f}" for p in ("fit", "means", "predict")
            ]
            lines.append(f"| {n} | {case} | {' | '.join(cells)} |")
            print(lines[-1], flush=True)
    lines[0] = load_line()
    print("\n" + lines[0])
    if args.out:
        with open(args.out, "w") as fh:
            fh.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
