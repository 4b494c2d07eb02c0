"""The cost–accuracy frontier of kernel distillation against SGPR, SoR and the exact GP (gpsd
issue 44, item 3).

For Boston (455/51), concrete (824/206) and a 2,000-row subset of deliveries (1,000 test rows),
each method is a point (prediction time per test point, test SMSE) and (time, test NLL):

* SGPR (GPyTorch ``InducingPointKernel``, Titsias' collapsed bound), inducing points from K-means
  and hyperparameters trained by Adam for a fixed number of steps (the training of
  ``bench_kernel_distillation_vs_sgpr.py``), over m from 25 to 1,000 (capped at n);
* students of ``KernelDistillation.from_sgpr`` (the exact GP with each trained SGPR's
  hyperparameters, at its inducing points) over (m, b);
* students of the exact GP (the teacher) at K-means inducing points, over (m, b);
* SoR with the teacher's hyperparameters at the same K-means points, over m;
* the exact GP (ARD RBF, hyperparameters by marginal likelihood).

Prediction time: mean and variance of 1,000 points (test rows repeated), median of repeats after
a warm-up, process (CPU) time and wall time on one thread. Memory: the numbers a predictor keeps
(the student's tensors; for SGPR and SoR the inducing points, an m-vector and an m x m matrix;
for the exact GP the inputs, an n-vector and the n x n Cholesky factor).

Run: ``python benchmarks/bench_kernel_distillation_frontier.py [--datasets ...] [--out PATH]``
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import time
import warnings

import gpytorch
import torch
from _problems import ExactRegressor
from _timing import Report, cpu_name, median_wall_cpu
from bench_kernel_distillation_vs_sgpr import gp_predict, smse, stage, train

from gpsd.data import load_dataset
from gpsd.kernel_distillation import KernelDistillation, kmeans

warnings.filterwarnings("ignore", category=UserWarning)
warnings.filterwarnings("ignore", category=gpytorch.utils.warnings.NumericalWarning)

DATASETS = {
    "boston": {"n_train": 455, "n_test": 51, "seed": 0},
    "concrete": {"n_test": 206},
    "deliveries": {"n_train": 2000, "n_test": 1000},
}


def nll(mean, variance, y) -> float:
    """Mean Gaussian negative log predictive density of ``y`` (``variance`` includes noise)."""
    return float(
        (0.5 * torch.log(2 * math.pi * variance) + 0.5 * (y - mean) ** 2 / variance).mean()
    )


def student_point(student, tx, ty, timing_x, repeats):
    p = student.predict(tx, include_noise=True)
    wall, cpu = median_wall_cpu(lambda: student.predict(timing_x), repeats, tx.device)
    return dict(
        smse=smse(p.mean, ty),
        nll=nll(p.mean, p.variance, ty),
        wall=wall / timing_x.shape[0],
        cpu=cpu / timing_x.shape[0],
        kib=student.storage_bytes() / 1024,
    )


def gp_point(model, tx, ty, timing_x, repeats, state_numbers):
    mean, var = gp_predict(model, tx)
    noise = model.likelihood.noise.detach().reshape(())
    wall, cpu = median_wall_cpu(lambda: gp_predict(model, timing_x), repeats, tx.device)
    return dict(
        smse=smse(mean, ty),
        nll=nll(mean, var + noise, ty),
        wall=wall / timing_x.shape[0],
        cpu=cpu / timing_x.shape[0],
        kib=state_numbers * tx.element_size() / 1024,
    )


def train_sgpr(x, y, m, iters, dtype):
    d = x.shape[-1]
    lik = gpytorch.likelihoods.GaussianLikelihood()
    base = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=d))
    kernel = gpytorch.kernels.InducingPointKernel(
        base, inducing_points=kmeans(x, m, seed=0), likelihood=lik
    )
    model = ExactRegressor(x, y, lik, kernel, constant_mean=True).to(dtype)
    train(model, lik, x, y, iters, 0.05)
    return model


def run_dataset(name, args, dtype):
    split = load_dataset(name, dtype=dtype, **DATASETS[name])
    x, y, tx, ty = split.train_x, split.train_y, split.test_x, split.test_y
    n, d = x.shape
    timing_x = tx.repeat(math.ceil(1000 / tx.shape[0]), 1)[:1000]
    ms = sorted({min(m, n) for m in args.sgpr_m})
    points = []  # (family, m, b, measurements)

    stage(f"{name}: exact GP")
    torch.manual_seed(0)
    sub = torch.randperm(n, generator=torch.Generator().manual_seed(0))[: args.teacher_rows]
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=d))
    lik = gpytorch.likelihoods.GaussianLikelihood()
    hyper = ExactRegressor(x[sub], y[sub], lik, kernel, constant_mean=True).to(dtype)
    with gpytorch.settings.max_cholesky_size(10**6):
        train(hyper, lik, x[sub], y[sub], args.teacher_iters, 0.1)
    teacher = ExactRegressor(x, y, lik, hyper.covar_module, constant_mean=True).to(dtype)
    teacher.mean_module.load_state_dict(hyper.mean_module.state_dict())
    teacher.eval()
    exact_numbers = n * d + n + n * n
    points.append(
        ("exact GP", n, None, gp_point(teacher, tx, ty, timing_x, args.repeats, exact_numbers))
    )

    train_s = {}
    for m in ms:
        stage(f"{name}: SGPR m = {m}")
        t0 = time.perf_counter()
        sgpr = train_sgpr(x, y, m, args.sgpr_iters, dtype)
        train_s[m] = time.perf_counter() - t0
        gp_numbers = m * d + m + m * m
        points.append(("SGPR", m, None, gp_point(sgpr, tx, ty, timing_x, args.repeats, gp_numbers)))
        for b in args.b:
            if b > m:
                continue
            kd = KernelDistillation.from_sgpr(sgpr, sparsity=b).fit()
            points.append(
                (
                    "student, from SGPR",
                    m,
                    b,
                    student_point(kd.student, tx, ty, timing_x, args.repeats),
                )
            )
        stage(f"{name}: K-means students and SoR, m = {m}")
        u_km = None
        for b in args.kmeans_b:
            if b > m:
                continue
            kd = KernelDistillation(teacher, num_inducing=m, sparsity=b, seed=0).fit()
            u_km = kd.inducing_points
            points.append(
                (
                    "student, exact GP + K-means",
                    m,
                    b,
                    student_point(kd.student, tx, ty, timing_x, args.repeats),
                )
            )
        if u_km is None:
            u_km = (
                KernelDistillation(teacher, num_inducing=m, sparsity=1, seed=0)
                .fit()
                .inducing_points
            )
        sor_kernel = gpytorch.kernels.InducingPointKernel(
            copy.deepcopy(teacher.covar_module), inducing_points=u_km.clone(), likelihood=lik
        )
        sor = ExactRegressor(x, y, lik, sor_kernel, constant_mean=True).to(dtype)
        sor.mean_module.load_state_dict(teacher.mean_module.state_dict())
        sor.eval()
        points.append(
            (
                "SoR (teacher's kernel, K-means U)",
                m,
                None,
                gp_point(sor, tx, ty, timing_x, args.repeats, gp_numbers),
            )
        )
    return dict(n=n, d=d, n_test=tx.shape[0], train_s=train_s), points


def dominated_by_sgpr(point, points, metric):
    """SGPR configurations both faster (CPU time) and more accurate (``metric``) than ``point``."""
    return [
        (m, p)
        for family, m, _, p in points
        if family == "SGPR" and p["cpu"] < point["cpu"] and p[metric] < point[metric]
    ]


def frontier_students(points, metric):
    """Students no SGPR configuration dominates, each with the fastest SGPR at least as slow."""
    out = []
    for family, m, b, p in points:
        if family.startswith("student") and not dominated_by_sgpr(p, points, metric):
            slower = [
                (q["cpu"], mm, q) for f, mm, _, q in points if f == "SGPR" and q["cpu"] >= p["cpu"]
            ]
            out.append((family, m, b, p, min(slower, key=lambda t: t[0])[1:] if slower else None))
    return out


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    styles = {
        "SGPR": dict(color="black", marker="s", linestyle="-"),
        "SoR (teacher's kernel, K-means U)": dict(color="tab:gray", marker="^", linestyle="--"),
        "exact GP": dict(color="tab:red", marker="*", linestyle="", markersize=12),
        "student, from SGPR": dict(color="tab:blue", marker="o", linestyle=""),
        "student, exact GP + K-means": dict(color="tab:orange", marker="x", linestyle=""),
    }
    fig, axes = plt.subplots(2, len(results), figsize=(5 * len(results), 8), squeeze=False)
    for col, (name, (info, points)) in enumerate(results.items()):
        for row, metric in enumerate(("smse", "nll")):
            ax = axes[row][col]
            for family, style in styles.items():
                pts = sorted((p["cpu"] * 1e6, p[metric]) for f, _, _, p in points if f == family)
                if pts:
                    ax.plot(*zip(*pts, strict=True), label=family, **style)
            ax.set_xscale("log")
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.set_xlabel("CPU µs per test point (mean + variance, 1 thread)")
            ax.set_ylabel("test SMSE" if metric == "smse" else "test NLL (nats)")
            ax.set_title(f"{name} (n = {info['n']}, d = {info['d']})")
            ax.grid(True, which="both", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(styles), fontsize=9)
    fig.suptitle("Kernel distillation: cost–accuracy frontier (CPU, busy shared machine)")
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="float64", choices=["float32", "float64"])
    parser.add_argument("--datasets", nargs="+", default=list(DATASETS))
    parser.add_argument("--sgpr-m", type=int, nargs="+", default=[25, 50, 100, 200, 400, 1000])
    parser.add_argument("--b", type=int, nargs="+", default=[5, 10, 20, 40])
    parser.add_argument("--kmeans-b", type=int, nargs="+", default=[10, 20])
    parser.add_argument("--sgpr-iters", type=int, default=150)
    parser.add_argument("--teacher-iters", type=int, default=60)
    parser.add_argument("--teacher-rows", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None)
    parser.add_argument("--plot", default=None, help="PNG path (default: next to --out)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    report = Report(args.out)
    report.add(
        "# Kernel distillation: the cost–accuracy frontier against SGPR, SoR and the exact GP\n",
        f"- machine: {cpu_name()}, 2-core CPU shared with about five other jobs (busy: wall "
        f"times are noisy, process times less so), {torch.get_num_threads()} torch thread(s); "
        f"device: cpu; dtype: {args.dtype}",
        f"- torch {torch.__version__}, gpytorch {gpytorch.__version__}",
        f"- command: `OMP_NUM_THREADS=1 python {' '.join(sys.argv)}`",
        f"- exact GP: ScaleKernel(ARD RBF), ConstantMean, {args.teacher_iters} Adam steps (lr 0.1) "
        f"of the marginal likelihood on <= {args.teacher_rows} rows, conditioned on all rows",
        f"- SGPR: GPyTorch InducingPointKernel, {args.sgpr_iters} Adam steps (lr 0.05) on U "
        "(from K-means), kernel, noise and mean (the training of "
        "`bench_kernel_distillation_vs_sgpr.py`); m from the list, capped at n",
        "- student, from SGPR: `KernelDistillation.from_sgpr(sgpr, sparsity=b)` (T = 0); "
        "student, exact GP + K-means: `KernelDistillation(exact_gp, num_inducing=m, "
        "sparsity=b)` (T = 0); SoR: the exact GP's kernel, noise and mean at those K-means U",
        f"- time: mean and variance of 1000 points (test rows repeated), median of {args.repeats} "
        "after a warm-up, per point; CPU = process time, wall = wall clock",
        "- memory: numbers the predictor keeps (student: `storage_bytes()`; SGPR, SoR: U, an "
        "m-vector, an m x m matrix; exact GP: X, an n-vector, the n x n Cholesky factor)",
        "- NLL: mean negative log predictive density of the test targets (noise included), "
        "targets standardised by the training rows\n",
    )
    results = {}
    verdicts = {}
    for name in args.datasets:
        info, points = run_dataset(name, args, dtype)
        results[name] = (info, points)
        report.add(
            f"## {name}: n = {info['n']}, d = {info['d']}, test = {info['n_test']}\n",
            "| method | m | b | SMSE | NLL | CPU µs / pt | wall µs / pt | memory (KiB) | "
            "SGPRs faster and better (SMSE) | (NLL) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---|---|",
        )
        for family, m, b, p in points:
            by = {
                metric: ", ".join(f"m={mm}" for mm, _ in dominated_by_sgpr(p, points, metric))
                or "none"
                for metric in ("smse", "nll")
            }
            if family == "SGPR":
                by = {"smse": "–", "nll": "–"}
            report.add(
                f"| {family} | {m} | {b if b is not None else '–'} | {p['smse']:.4f} | "
                f"{p['nll']:.3f} | {p['cpu'] * 1e6:.1f} | {p['wall'] * 1e6:.1f} | "
                f"{p['kib']:.0f} | {by['smse']} | {by['nll']} |"
            )
        train_s = ", ".join(f"m={m}: {s:.0f} s" for m, s in info["train_s"].items())
        report.add(f"\nSGPR training (wall): {train_s}\n")
        for metric in ("smse", "nll"):
            front = frontier_students(points, metric)
            verdicts.setdefault(metric, {})[name] = bool(front)
            lines = []
            for family, m, b, p, nearest in front:
                near = (
                    f"; the fastest SGPR at least as slow: m = {nearest[0]}, "
                    f"{nearest[1][metric]:.4f} at {nearest[1]['cpu'] * 1e6:.1f} µs"
                    if nearest
                    else "; slower than every SGPR"
                )
                lines.append(
                    f"- {family}, m = {m}, b = {b}: {metric.upper()} {p[metric]:.4f} at "
                    f"{p['cpu'] * 1e6:.1f} µs{near}"
                )
            report.add(
                f"Students on the frontier by {metric.upper()} (no SGPR both faster and better): "
                f"{len(front)}",
                *lines,
                "",
            )
    report.add("## Target\n")
    for metric in ("smse", "nll"):
        met = [name for name, ok in verdicts[metric].items() if ok]
        report.add(
            f"- {metric.upper()}: some student on the frontier on {len(met)} of "
            f"{len(verdicts[metric])} data sets ({', '.join(met) or 'none'})"
        )
    if args.out:
        path = args.plot or args.out.rsplit(".", 1)[0] + ".png"
        plot(results, path)
        report.add(f"\nPlot: `{path}`")
    report.close()


if __name__ == "__main__":
    main()
