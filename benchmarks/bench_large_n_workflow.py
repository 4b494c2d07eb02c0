"""The whole large-N workflow on the flights data (or a synthetic problem): learn the
hyperparameters, fit every step, choose the step by GCV, predict; with GPyTorch's ``ExactGP``
beside it.

gpsd's side, on ``--n`` training flights (:func:`gpsd.data.load_dataset` ``"flights"``, six
standardised inputs, air time as target; ``--n 0`` for all 327,346 but the test rows;
``--data synthetic`` for six standard-normal inputs of which a smooth target uses four,
``--data sines`` for the two-input problem of ``bench_million.py``) and ``--m`` test points,
from unit lengthscales and outputscale or (``--pretrain P``) from hyperparameters learnt on a
random P-point subset by the exact marginal likelihood, as Wang et al. (2019) start their
million-point runs:

1. **learn**: :meth:`DataCentricGPR.optimize_hyperparameters` (Adam, ``--iters`` iterations,
   learning rate ``--lr``) of an ARD RBF kernel and the teacher's noise, matrix-free on
   ``--backend`` (``cg``, ``lanczos`` or ``auto``: preconditioned CG and stochastic Lanczos
   quadrature through GPyTorch's ``MultivariateNormal.log_prob`` on a
   :class:`ChunkedKernelOperator`);
   with ``--learn exactgp``, GPyTorch's own loop over an ``ExactGP`` whose kernel is a
   :class:`gpsd.ChunkedKernel` (``--chunk`` rows at once, ``--cache-gib`` of rows kept), then
   :meth:`DataCentricGPR.from_teacher`;
2. **fit**: all ``--steps`` data-centric steps at the learnt noise (one factorisation);
3. **gcv**: the step with the smallest GCV score, by stochastic trace estimation;
4. **predict**: the latent means and variances of every step at the test points
   (``--test-chunk`` at once), and each step's test RMSE (minutes) and NLL (with the
   observation noise).

GPyTorch's side (``--gpytorch``): an ``ExactGP`` with the same kernel, initial values,
optimiser and iterations on GPyTorch's default settings (CG and SLQ above 800 points, the
kernel matrix formed and kept), then its predictive means and variances at the test points
with ``fast_pred_var`` (LOVE): its default exact variances solve one system per test point,
which ran for over 20 CPU minutes at N = 10,000 and 5,000 test points here. The probe vectors
of iteration ``i`` are drawn after seeding ``i`` on both sides.

Each side runs in a process of its own, so that its peak resident memory (``VmHWM``; on CUDA
the allocator's peak) is its own. Both final hyperparameters are then scored by the same exact
float64 Cholesky marginal likelihood (``--exact-mll``), which is what "the MLL reached"
compares. ``--probe-runs R`` learns R times on each side, run ``r`` with the probes of seeds
``1000 r + i``: the spread of the MLL that each side's stochastic estimator reaches;
``--cg-tolerance`` and ``--trace-samples`` tighten that estimator on both sides.

Usage (from the repository root)::

    OMP_NUM_THREADS=2 python benchmarks/bench_large_n_workflow.py --n 20000 --m 5000 \\
        --iters 5 --backend lanczos --learn exactgp --cache-gib 3 --chunk 1024 \\
        --test-chunk 512 --gpytorch --exact-mll --probe-runs 3 \\
        --out benchmarks/results/large_n_workflow_cpu_n20000.md
    # on a GPU: all of flights, and a million points (stages 8 and 9 of gpu_suite.sh)
    python benchmarks/bench_large_n_workflow.py --device cuda --dtype float32 --n 0 \\
        --backend auto --pretrain 10000 --iters 3 --gpytorch
    python benchmarks/bench_large_n_workflow.py --device cuda --dtype float32 \\
        --data sines --n 1000000 --backend lanczos --pretrain 10000 --iters 1 --gpytorch
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import subprocess
import sys
import time

import gpytorch
import torch
from _engine import engine_name, krylov_rank, series_order
from _problems import (
    ExactRegressor,
    ard_rbf_kernel,
    pretrained_ard_rbf,
    uniform_square_problem,
)
from _timing import Report, device_name, peak_gib, reset_peak, start_peak_rss, sync
from tqdm import tqdm

import gpsd
from gpsd import DataCentricGPR
from gpsd.data import DataSplit, load_dataset


def _start(args: argparse.Namespace) -> dict | None:
    """The pretrained hyperparameters the sides start from (``--pretrain``), else ``None``."""
    return json.loads(args.start) if args.start else None


def _initial_noise(args: argparse.Namespace) -> float:
    start = _start(args)
    return start["noise"] if start else args.noise


def run_pretrain(args: argparse.Namespace) -> dict:
    """The sides' start of ``--pretrain`` (:func:`pretrained_ard_rbf`)."""
    data = _data(args, torch.device(args.device))
    start = pretrained_ard_rbf(
        data.train_x,
        data.train_y,
        args.pretrain,
        args.pretrain_iters,
        lr=args.lr,
        noise=args.noise,
        seed=args.seed,
        progress=not args.quiet,
    )
    return {"side": "pretrain", **start}


def _data(args: argparse.Namespace, device: torch.device) -> DataSplit:
    """The flights (``--n 0``: every row but the ``--m`` test rows) or a synthetic problem."""
    dtype = getattr(torch, args.dtype)
    if args.data == "synthetic":
        return _synthetic(args.n, args.m, args.seed, dtype, device)
    if args.data == "sines":
        return _sines(args.n, args.m, args.seed, dtype, device)
    n = args.n or None
    return load_dataset(
        "flights", n_train=n, n_test=args.m, seed=args.seed, dtype=dtype, device=device
    )


def _synthetic(n: int, m: int, seed: int, dtype: torch.dtype, device: torch.device) -> DataSplit:
    r"""``n + m`` standard-normal inputs in six dimensions, of which the target
    :math:`y = \sin(2 x_1) + \cos(x_2 x_3) + x_4 / 2 + \varepsilon`, :math:`\varepsilon \sim
    \mathcal N(0, 0.1^2)`, uses four; the last ``m`` held out."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n + m, 6, generator=gen, dtype=torch.float64)
    f = torch.sin(2 * x[:, 0]) + torch.cos(x[:, 1] * x[:, 2]) + x[:, 3] / 2
    y = f + 0.1 * torch.randn(n + m, generator=gen, dtype=torch.float64)
    return _split("synthetic", x, y, n, dtype, device)


def _sines(n: int, m: int, seed: int, dtype: torch.dtype, device: torch.device) -> DataSplit:
    """:func:`uniform_square_problem`'s ``n + m`` points (two inputs uniform on [0, 10]^2, targets
    sin(x1) + sin(x2) + N(0, 0.3^2)), the last ``m`` held out."""
    x, y, _ = uniform_square_problem(n + m, 0, torch.device("cpu"), torch.float64, seed)
    return _split("sines", x, y, n, dtype, device)


def _split(
    name: str, x: torch.Tensor, y: torch.Tensor, n: int, dtype: torch.dtype, device: torch.device
) -> DataSplit:
    """The first ``n`` rows for training, the rest for testing; targets standardised with the
    training moments, inputs as drawn."""
    y_mean, y_std = float(y[:n].mean()), float(y[:n].std())
    y = (y - y_mean) / y_std
    x, y = x.to(device=device, dtype=dtype), y.to(device=device, dtype=dtype)
    zeros, ones = x.new_zeros(x.shape[-1]), x.new_ones(x.shape[-1])
    return DataSplit(name, "regression", x[:n], y[:n], x[n:], y[n:], zeros, ones, y_mean, y_std)


def _hyperparameters(kernel: gpytorch.kernels.Kernel, noise: float) -> dict:
    return {
        "lengthscale": kernel.base_kernel.lengthscale.detach().reshape(-1).tolist(),
        "outputscale": float(kernel.outputscale.detach()),
        "noise": noise,
    }


def _nll(mean: torch.Tensor, variance: torch.Tensor, y: torch.Tensor, y_std: float) -> float:
    """Mean Gaussian negative log predictive density in the original units (minutes)."""
    var = variance * y_std**2
    err = (mean - y) * y_std
    return float((0.5 * (torch.log(2 * math.pi * var) + err**2 / var)).mean())


def start_peak_rss_phase(device: torch.device) -> None:
    """Count the next phase's peak afresh (without collecting garbage: what the phase before
    left alive stays in its resident set)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        start_peak_rss()


def _train_exact_gp(model, likelihood, x, y, args) -> list[float]:
    """GPyTorch's own loop: Adam on the exact marginal likelihood, the probes of iteration ``i``
    drawn after seeding ``args.probe_seed + i`` (the same on both sides)."""
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(likelihood, model)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    model.train()
    losses = []
    with _learning_settings(args):
        for i in tqdm(range(args.iters), desc=f"{args.side} ExactGP", disable=args.quiet):
            torch.manual_seed(args.probe_seed + i)
            optimizer.zero_grad()
            loss = -mll(model(x), y)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    model.eval()
    return losses


def run_gpsd(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    data = _data(args, device)
    x, y = data.train_x, data.train_y
    kernel = ard_rbf_kernel(x.shape[-1], x.dtype, device, _start(args))
    cache = None if args.cache_gib is None else int(args.cache_gib * 2**30)
    if args.learn == "exactgp":
        likelihood = gpytorch.likelihoods.GaussianLikelihood().to(device=device, dtype=x.dtype)
        likelihood.noise = _initial_noise(args)
        chunked = gpsd.ChunkedKernel(kernel, chunk_size=args.chunk, cache_bytes=cache or 0)
        teacher = ExactRegressor(x, y, likelihood, chunked)
    else:
        noise = torch.full((args.steps,), _initial_noise(args), dtype=x.dtype, device=device)
        model = DataCentricGPR(
            x, y, kernel, noise=noise, backend=args.backend, kernel_cache_bytes=cache
        )
    out: dict = {"side": "gpsd", "phases": {}, "cpu": {}, "phase_peaks": {}}
    reset_peak(device)
    overall = 0.0
    names = ["learn"] if args.learn_only else ["learn", "fit", "gcv", "predict"]
    phases = tqdm(names, desc="gpsd workflow", disable=args.quiet)
    for phase in phases:
        phases.set_postfix_str(phase)
        sync(device)
        phase_start_peak = peak_gib(device)
        start_peak_rss_phase(device)
        start, start_cpu = time.perf_counter(), time.process_time()
        if phase == "learn" and args.learn == "exactgp":
            out["loss"] = _train_exact_gp(teacher, likelihood, x, y, args)
            model = DataCentricGPR.from_teacher(
                teacher, num_steps=args.steps, backend=args.backend, kernel_cache_bytes=cache
            )
        elif phase == "learn":
            model.optimize_hyperparameters(max_iter=args.iters, lr=args.lr)
            out["loss"] = model.history
        elif phase == "fit":  # no gradients from here on, as a user predicting would
            with torch.no_grad():
                model.fit()
        elif phase == "gcv":
            with torch.no_grad():
                best = model.best_step("gcv")
                out["best_step"] = best
                out["gcv_se"] = float(model.gcv_standard_error()[best - 1])
        else:
            with torch.no_grad(), gpsd.settings.test_chunk_size(args.test_chunk):
                pred = model.predict(data.test_x, include_noise=True)
        sync(device)
        out["phases"][phase] = time.perf_counter() - start
        out["cpu"][phase] = time.process_time() - start_cpu
        out["phase_peaks"][phase] = peak_gib(device)
        print(
            f"gpsd {phase}: {out['phases'][phase]:.1f} s, peak {out['phase_peaks'][phase]:.2f} GiB",
            file=sys.stderr,
            flush=True,
        )
        overall = max(overall, phase_start_peak, out["phase_peaks"][phase])
    out["peak_gib"] = overall
    out["hyperparameters"] = _hyperparameters(kernel, float(model.noise[0]))
    if args.learn_only:
        return out
    with torch.no_grad():
        out["engine"] = [engine_name(model), krylov_rank(model), series_order(model)]
    out["rmse"] = [data.rmse(mean) for mean in pred.mean]
    out["nll"] = [
        _nll(mean, var, data.test_y, data.y_std)
        for mean, var in zip(pred.mean, pred.variance, strict=True)
    ]
    return out


def run_gpytorch(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    data = _data(args, device)
    x, y = data.train_x, data.train_y
    kernel = ard_rbf_kernel(x.shape[-1], x.dtype, device, _start(args))
    likelihood = gpytorch.likelihoods.GaussianLikelihood().to(device=device, dtype=x.dtype)
    likelihood.noise = _initial_noise(args)
    model = ExactRegressor(x, y, likelihood, kernel)
    out: dict = {"side": "gpytorch", "phases": {}, "cpu": {}}
    reset_peak(device)
    sync(device)
    start, start_cpu = time.perf_counter(), time.process_time()
    out["loss"] = _train_exact_gp(model, likelihood, x, y, args)
    sync(device)
    out["phases"]["learn"] = time.perf_counter() - start
    out["cpu"]["learn"] = time.process_time() - start_cpu
    out["phase_peaks"] = {"learn": peak_gib(device)}
    if args.learn_only:
        out["hyperparameters"] = _hyperparameters(kernel, float(likelihood.noise.detach()))
        return out
    start_peak_rss_phase(device)
    start = time.perf_counter()
    with torch.no_grad(), gpytorch.settings.fast_pred_var():
        pred = likelihood(model(data.test_x))
        mean, variance = pred.mean, pred.variance
    sync(device)
    out["phases"]["predict"] = time.perf_counter() - start
    out["phase_peaks"]["predict"] = peak_gib(device)
    out["peak_gib"] = max(out["phase_peaks"].values())
    out["hyperparameters"] = _hyperparameters(kernel, float(likelihood.noise.detach()))
    out["rmse"] = [data.rmse(mean)]
    out["nll"] = [_nll(mean, variance, data.test_y, data.y_std)]
    return out


def exact_mll(args: argparse.Namespace, hyper: dict) -> float:
    """log p(y | θ) / N by a float64 Cholesky of the formed matrix (the common yardstick)."""
    data = _data(argparse.Namespace(**{**vars(args), "dtype": "float64"}), torch.device("cpu"))
    kernel = ard_rbf_kernel(data.train_x.shape[-1], torch.float64, torch.device("cpu"), hyper)
    with torch.no_grad():
        k = kernel(data.train_x).to_dense()
        k.diagonal().add_(hyper["noise"])
        chol = torch.linalg.cholesky(k)
        del k
        alpha = torch.cholesky_solve(data.train_y.unsqueeze(-1), chol).squeeze(-1)
        n = data.train_y.shape[0]
        value = -0.5 * (data.train_y @ alpha) - chol.diagonal().log().sum()
        return float(value - 0.5 * n * math.log(2 * math.pi)) / n


def _learning_settings(args: argparse.Namespace) -> contextlib.ExitStack:
    """GPyTorch's estimator settings while learning, the same on both sides: the
    preconditioner's rank, and where given the CG tolerance and the number of probe vectors."""
    stack = contextlib.ExitStack()
    stack.enter_context(gpytorch.settings.max_preconditioner_size(_preconditioner_rank(args)))
    if args.cg_tolerance is not None:
        stack.enter_context(gpytorch.settings.cg_tolerance(args.cg_tolerance))
    if args.trace_samples is not None:
        stack.enter_context(gpytorch.settings.num_trace_samples(args.trace_samples))
    return stack


def _preconditioner_rank(args: argparse.Namespace) -> int:
    if args.preconditioner_size is None:
        return gpytorch.settings.max_preconditioner_size.value()
    return args.preconditioner_size


#: The flights with an air time (:func:`gpsd.data.load_dataset`).
_FLIGHTS = 327_346


#: The probe seeds of run ``r`` of ``--probe-runs`` start at ``r * _RUN_SEEDS``.
_RUN_SEEDS = 1000


def _seconds(phases: dict, key: str) -> str:
    return f"{phases[key]:.2f}" if key in phases else "–"


def _in_subprocess(side: str, argv: list[str]) -> dict:
    """Run one side in a process of its own, its standard error passed on line by line as it
    comes (each phase's time, so that a run cut short by a time limit still says how far it
    got); its result is the last line of its standard output."""
    command = [sys.executable, os.path.abspath(__file__), "--side", side, *argv]
    errors = []
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as process:
        for line in process.stderr:
            sys.stderr.write(line)
            errors.append(line)
        output = process.stdout.read()
    if process.returncode != 0:
        return {"side": side, "failed": "".join(errors).strip().splitlines()[-1:]}
    return json.loads(output.strip().splitlines()[-1])


def _report_probe_runs(report: Report, repeats: dict, args: argparse.Namespace) -> None:
    """The exact MLL each side reaches over its probe runs: mean, standard deviation, and the
    gap between the sides' means."""
    report.add(
        "",
        f"The exact MLL / N reached over {args.probe_runs} runs of each side's learning, run "
        f"r with the probes of seeds {_RUN_SEEDS} r + i:",
        "",
        "| side | " + " | ".join(f"run {r}" for r in range(args.probe_runs)) + " | mean | sd |",
        "|---|" + "---:|" * (args.probe_runs + 2),
    )
    means = {}
    for side, runs in repeats.items():
        values = []
        for r in runs:
            if "failed" not in r and "exact_mll" not in r:
                r["exact_mll"] = exact_mll(args, r["hyperparameters"])
            values.append(r.get("exact_mll", float("nan")))
        t = torch.tensor(values, dtype=torch.float64)
        means[side] = float(t.mean())
        cells = " | ".join(f"{v:.5f}" for v in values)
        report.add(f"| {side} | {cells} | {means[side]:.5f} | {float(t.std()):.5f} |")
    if len(means) == 2:
        rel = abs(means["gpsd"] - means["gpytorch"]) / abs(means["gpytorch"])
        report.add("", f"The sides' means differ by {rel:.1e} relative.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--n",
        type=int,
        default=20_000,
        help="training points (flights: 0 for every row but the test rows)",
    )
    parser.add_argument("--data", default="flights", choices=["flights", "synthetic", "sines"])
    parser.add_argument("--dtype", default="float64", choices=["float32", "float64"])
    parser.add_argument("--m", type=int, default=5_000, help="test points")
    parser.add_argument("--iters", type=int, default=10, help="Adam iterations")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--noise", type=float, default=0.1, help="initial noise (standardised)")
    parser.add_argument("--steps", type=int, default=10, help="data-centric steps")
    parser.add_argument(
        "--backend",
        default="cg",
        choices=["cg", "lanczos", "auto"],
        help="gpsd's backend (auto: Lanczos up to gpsd.settings.max_lanczos_rank, then deflated "
        "CG where it falls short of the accuracy)",
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gpytorch", action="store_true", help="run GPyTorch's ExactGP too")
    parser.add_argument("--exact-mll", action="store_true", help="score both by exact Cholesky")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.add_argument(
        "--learn",
        default="distiller",
        choices=["distiller", "exactgp"],
        help="gpsd learns by DataCentricGPR.optimize_hyperparameters, or by GPyTorch's own loop "
        "over an ExactGP with a gpsd.ChunkedKernel (the same parametrisation as GPyTorch's side), "
        "then DataCentricGPR.from_teacher",
    )
    parser.add_argument(
        "--cache-gib",
        type=float,
        default=None,
        help="kernel rows gpsd may keep, GiB (default: the ChunkedKernel keeps none while "
        "learning and the distiller a share of the free memory)",
    )
    parser.add_argument(
        "--chunk", type=int, default=2048, help="kernel rows gpsd's ChunkedKernel evaluates at once"
    )
    parser.add_argument(
        "--test-chunk",
        type=int,
        default=gpsd.settings.test_chunk_size.value(),
        help="test points gpsd predicts at once (gpsd.settings.test_chunk_size)",
    )
    parser.add_argument(
        "--probe-runs",
        type=int,
        default=1,
        help="learn this many times on each side, run r with the probes of seeds 1000 r + i "
        "(runs after the first learn only): the spread of the MLL each side's estimator reaches",
    )
    parser.add_argument("--learn-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--preconditioner-size",
        type=int,
        default=None,
        help="rank of GPyTorch's pivoted-Cholesky preconditioner while learning, on both sides "
        "(default: GPyTorch's, 15; 0: none, which makes the probe vectors of both sides equal)",
    )
    parser.add_argument(
        "--cg-tolerance",
        type=float,
        default=None,
        help="GPyTorch's CG tolerance while learning, on both sides (default: GPyTorch's, 1)",
    )
    parser.add_argument(
        "--trace-samples",
        type=int,
        default=None,
        help="GPyTorch's probe vectors for SLQ while learning, on both sides (default: "
        "GPyTorch's, 10)",
    )
    parser.add_argument(
        "--pretrain",
        type=int,
        default=0,
        help="start both sides from hyperparameters learnt on a random subset of this many "
        "training points by exact (Cholesky) Adam iterations, as Wang et al. (2019) do "
        "(default 0: from lengthscales 1, outputscale 1 and --noise)",
    )
    parser.add_argument(
        "--pretrain-iters", type=int, default=50, help="Adam iterations of --pretrain (lr --lr)"
    )
    parser.add_argument("--start", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--probe-seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help="also write the Markdown report here")
    parser.add_argument(
        "--side", default=None, choices=["gpsd", "gpytorch", "pretrain"], help=argparse.SUPPRESS
    )
    args, _ = parser.parse_known_args()
    torch.manual_seed(args.seed)
    if args.side is not None:
        sides = {"gpsd": run_gpsd, "gpytorch": run_gpytorch, "pretrain": run_pretrain}
        print(json.dumps(sides[args.side](args)))
        return
    argv = [a for a in sys.argv[1:] if a not in ("--gpytorch", "--exact-mll")]
    if "--out" in argv:
        i = argv.index("--out")
        del argv[i : i + 2]
    pretrained = None
    if args.pretrain:
        pretrained = _in_subprocess("pretrain", argv)
        if "failed" in pretrained:
            raise SystemExit(f"pretraining failed: {' '.join(pretrained['failed'])}")
        start = {k: pretrained[k] for k in ("lengthscale", "outputscale", "noise")}
        args.start = json.dumps(start)
        argv = [*argv, "--start", args.start]
    results = [_in_subprocess("gpsd", argv)]
    if args.gpytorch:
        results.append(_in_subprocess("gpytorch", argv))
    sides = ["gpsd", "gpytorch"] if args.gpytorch else ["gpsd"]
    repeats = {side: [r for r in results if r["side"] == side] for side in sides}
    for run in range(1, args.probe_runs):
        for side in sides:
            seed = ["--probe-seed", str(run * _RUN_SEEDS), "--learn-only"]
            repeats[side].append(_in_subprocess(side, [*argv, *seed]))
    report = Report(args.out)
    unit = " (min)" if args.data == "flights" else ""
    d = 2 if args.data == "sines" else 6
    if pretrained is None:
        start = f"lengthscales 1, outputscale 1, noise {args.noise}"
    else:
        start = (
            f"the hyperparameters learnt on a random {args.pretrain:,}-point subset by "
            f"{args.pretrain_iters} Adam iterations on the exact (Cholesky, float64) marginal "
            f"likelihood ({pretrained['seconds']:.1f} s; outputscale "
            f"{pretrained['outputscale']:.3f}, noise {pretrained['noise']:.4f})"
        )
    report.add(
        f"# The large-N workflow on {args.data}: N = {args.n or _FLIGHTS - args.m:,} training, "
        f"M = {args.m:,} test",
        "",
        f"{device_name(torch.device(args.device))}, "
        f"{torch.get_num_threads()} threads, {args.dtype}, ARD RBF on {d} inputs, Adam lr {args.lr}, "
        f"{args.iters} iteration{'s' * (args.iters != 1)} from {start}; "
        f"gpsd backend `{args.backend}`, {args.steps} steps, learning by "
        f"{'GPyTorch' + chr(39) + 's loop over a gpsd.ChunkedKernel' if args.learn == 'exactgp' else 'DataCentricGPR.optimize_hyperparameters'}"
        f"{'' if args.cache_gib is None else f', kernel rows kept within {args.cache_gib:g} GiB'}"
        f", {args.chunk} rows a chunk, {args.test_chunk} test points a chunk; GPyTorch's "
        f"preconditioner of rank {_preconditioner_rank(args)}"
        f"{'' if args.cg_tolerance is None else f', CG tolerance {args.cg_tolerance:g}'}"
        f"{'' if args.trace_samples is None else f', {args.trace_samples} probe vectors'}"
        " while learning. "
        f"torch {torch.__version__}, "
        f"gpytorch {gpytorch.__version__}, gpsd {gpsd.__version__}, Python "
        f"{platform.python_version()}. Each side in its own process.",
        "",
        "| side | learn (s) | s / iteration | CPU s / iteration | fit (s) | gcv (s) | predict (s) | peak RSS (GiB) "
        f"| final loss | exact MLL / N | RMSE{unit} | NLL |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    )
    for r in results:
        if "failed" in r:
            report.add(f"| {r['side']} | failed: {' '.join(r['failed'])} |" + " |" * 11)
            continue
        p = r["phases"]
        mll = exact_mll(args, r["hyperparameters"]) if args.exact_mll else float("nan")
        r["exact_mll"] = mll
        best = r.get("best_step", 1)
        report.add(
            f"| {r['side']} | {p['learn']:.1f} | {p['learn'] / args.iters:.2f} "
            f"| {r['cpu']['learn'] / args.iters:.2f} | {_seconds(p, 'fit')} "
            f"| {_seconds(p, 'gcv')} | {_seconds(p, 'predict')} | {r['peak_gib']:.2f} | {r['loss'][-1]:.5f} "
            f"| {mll:.5f} | {r['rmse'][best - 1]:.3f} | {r['nll'][best - 1]:.3f} |"
        )
    report.add(
        "",
        "Peak resident set per phase (GiB; each phase's peak, with what earlier phases left):",
        "",
        "| side | learn | fit | gcv | predict |",
        "|---|---:|---:|---:|---:|",
    )
    for r in results:
        if "failed" not in r:
            peaks = r["phase_peaks"]
            cells = [
                f"{peaks[k]:.2f}" if k in peaks else "–" for k in ("learn", "fit", "gcv", "predict")
            ]
            report.add(f"| {r['side']} | {' | '.join(cells)} |")
    gp = next((r for r in results if r["side"] == "gpsd" and "failed" not in r), None)
    if gp is not None:
        backend, rank, order = gp["engine"]
        report.add(
            "",
            f"gpsd's engine: {backend}, {rank} Ritz pairs, complement series of order {order}.",
        )
        report.add(
            "",
            f"gpsd's GCV chose step {gp['best_step']} (its score's standard error "
            f"{gp['gcv_se']:.2e}); the table's RMSE and NLL are that step's. Learnt: "
            f"noise {gp['hyperparameters']['noise']:.4f}, outputscale "
            f"{gp['hyperparameters']['outputscale']:.3f}.",
            "",
            "| step | " + " | ".join(str(t + 1) for t in range(len(gp["rmse"]))) + " |",
            "|---|" + "---:|" * len(gp["rmse"]),
            f"| RMSE{unit} | " + " | ".join(f"{v:.3f}" for v in gp["rmse"]) + " |",
            "| NLL | " + " | ".join(f"{v:.3f}" for v in gp["nll"]) + " |",
        )
    other = next((r for r in results if r["side"] == "gpytorch" and "failed" not in r), None)
    if gp is not None and other is not None:
        ratio_t = gp["phases"]["learn"] / other["phases"]["learn"]
        ratio_c = gp["cpu"]["learn"] / other["cpu"]["learn"]
        ratio_m = gp["peak_gib"] / other["peak_gib"]
        ratio_learn = gp["phase_peaks"]["learn"] / other["phase_peaks"]["learn"]
        rel = abs(gp["exact_mll"] - other["exact_mll"]) / abs(other["exact_mll"])
        report.add(
            "",
            f"gpsd / GPyTorch: time per iteration {ratio_t:.2f}x (CPU time {ratio_c:.2f}x), "
            f"peak memory {ratio_m:.2f}x (learning alone {ratio_learn:.2f}x); "
            f"exact MLL reached differs by {rel:.1e} relative.",
        )
    if args.probe_runs > 1 and args.exact_mll:
        _report_probe_runs(report, repeats, args)
    report.close()


if __name__ == "__main__":
    main()
