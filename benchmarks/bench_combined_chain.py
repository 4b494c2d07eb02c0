"""Where the combined self-distillation chain helps: test RMSE and NLL per (outer, inner) step.

On diabetes, concrete and deliveries, over random train/test splits, :class:`gpsd.CombinedGPR`
(an outer distribution-centric loop around an inner data-centric loop) against the best
data-centric and the best distribution-centric step and the teacher (step 1).

Per split:

1. ``load_dataset(name, seed=split)`` (inputs and targets standardised on the training rows;
   deliveries keeps 1000 of its 8010 training rows, ``--deliveries-train``, and all 2002 test
   rows).
2. A teacher as in ``examples/regression_self_distillation.py``: a GPyTorch ``ExactGP`` with a
   constant mean and a scaled ARD RBF kernel, trained by maximum marginal likelihood (Adam,
   learning rate 0.05, ``--iterations`` steps, Cholesky throughout), once per split.
3. Three distillers from that teacher, each with the teacher's noise at every step and one
   dense eigendecomposition: ``CombinedGPR.from_teacher`` over the ``O x I`` grid (all cells
   predicted at once), ``DataCentricGPR.from_teacher`` and ``DistributionCentricGPR.from_teacher``
   over ``--baseline-steps`` steps. Cell ``(o, i)`` of the grid is inner step ``i`` of outer
   step ``o`` of one chain with ``I`` inner steps per outer step: its prior is the posterior of
   inner step ``I`` of outer step ``o - 1``. Row ``o = 1`` is the data-centric chain (the report
   checks it); column ``i = 1`` is the distribution-centric chain only for ``I = 1``.
4. Test RMSE in the target's units and the mean test NLL per point in the target's units, with the
   teacher's noise added to every step's predictive variance (the noise of a new observation);
   the cell GCV picks on the grid and the step GCV picks on the data-centric chain.

With ``--out FILE`` the report goes to ``FILE`` and a heat map of the grid per data set to
``combined_chain_<data>.png`` beside it.

The "best" step of a baseline, and the best cell of the grid, are the ones with the lowest mean
over the splits of the test metric: chosen on the test rows (an oracle, the same for every
method), reported beside the GCV choices, which use the training rows only.

Usage::

    python benchmarks/bench_combined_chain.py --out benchmarks/results/combined_chain_cpu.md
    python benchmarks/bench_combined_chain.py --splits 1      # a smoke run: one split of each
    python benchmarks/bench_combined_chain.py --quick         # one split of diabetes
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
import time
from pathlib import Path

import gpytorch
import matplotlib
import numpy as np
import torch
from _timing import cpu_name, load_line

from gpsd import CombinedGPR, DataCentricGPR, DistributionCentricGPR
from gpsd.data import load_dataset

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

DATASETS = ("diabetes", "concrete", "deliveries")
LOG_2PI = math.log(2 * math.pi)


class TeacherGP(gpytorch.models.ExactGP):
    """An ordinary GPyTorch exact GP: constant mean, scaled ARD RBF kernel."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, likelihood) -> None:
        super().__init__(x, y, likelihood)
        self.mean_module = gpytorch.means.ConstantMean()
        self.covar_module = gpytorch.kernels.ScaleKernel(
            gpytorch.kernels.RBFKernel(ard_num_dims=x.shape[-1])
        )

    def forward(self, x: torch.Tensor) -> gpytorch.distributions.MultivariateNormal:
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def train_teacher(x: torch.Tensor, y: torch.Tensor, iterations: int) -> TeacherGP:
    """Maximum marginal likelihood by Adam (lr 0.05), with Cholesky solves at every size."""
    likelihood = gpytorch.likelihoods.GaussianLikelihood().to(x.dtype)
    teacher = TeacherGP(x, y, likelihood).to(x.dtype)
    teacher.train()
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(likelihood, teacher)
    optimizer = torch.optim.Adam(teacher.parameters(), lr=0.05)
    with gpytorch.settings.max_cholesky_size(10**6):
        for _ in range(iterations):
            optimizer.zero_grad()
            loss = -mll(teacher(x), y)
            loss.backward()
            optimizer.step()
    return teacher.eval()


def metrics(prediction, split, noise: float) -> tuple[np.ndarray, np.ndarray]:
    """Test RMSE and mean NLL per step (target units), each ``(T,)``."""
    test_y = split.test_y.unsqueeze(0)  # shape: (1, M)
    resid = prediction.mean - test_y  # shape: (T, M), standardised units
    rmse = resid.square().mean(-1).sqrt() * split.y_std
    var = prediction.variance + noise  # shape: (T, M)
    nll = 0.5 * (resid.square() / var + var.log() + LOG_2PI).mean(-1) + math.log(split.y_std)
    return rmse.numpy(), nll.numpy()


def one_split(name: str, seed: int, args) -> dict:
    n_train = args.deliveries_train if name == "deliveries" else None
    split = load_dataset(name, seed=seed, n_train=n_train)
    start = time.perf_counter()
    teacher = train_teacher(split.train_x, split.train_y, args.iterations)
    teacher_s = time.perf_counter() - start
    noise = float(teacher.likelihood.noise.detach())
    start = time.perf_counter()
    with torch.no_grad():
        combined = CombinedGPR.from_teacher(
            teacher, outer_steps=args.outer, inner_steps=args.inner, backend="dense"
        )
        data_centric = DataCentricGPR.from_teacher(
            teacher, num_steps=args.baseline_steps, backend="dense"
        )
        distribution_centric = DistributionCentricGPR.from_teacher(
            teacher, num_steps=args.baseline_steps, backend="dense"
        )
        comb = combined.predict(split.test_x)  # (O * I, M), row t - 1 for flat step t
        dc = data_centric.predict(split.test_x)  # (T, M)
        dist = distribution_centric.predict(split.test_x)  # (T, M)
        comb_gcv = combined.best_step("gcv")
        dc_gcv = data_centric.best_step("gcv")
    distil_s = time.perf_counter() - start
    # the grid's first row (outer step 1) is the data-centric chain
    first_row = comb.mean[: args.inner]  # shape: (I, M)
    limit_gap = float((first_row - dc.mean[: args.inner]).abs().max())
    comb_rmse, comb_nll = metrics(comb, split, noise)
    dc_rmse, dc_nll = metrics(dc, split, noise)
    dist_rmse, dist_nll = metrics(dist, split, noise)
    return {
        "n_train": split.train_x.shape[0],
        "n_test": split.test_x.shape[0],
        "noise": noise,
        "comb_rmse": comb_rmse.reshape(args.outer, args.inner),
        "comb_nll": comb_nll.reshape(args.outer, args.inner),
        "dc_rmse": dc_rmse,
        "dc_nll": dc_nll,
        "dist_rmse": dist_rmse,
        "dist_nll": dist_nll,
        "gcv_cell": combined.grid_step(comb_gcv),
        "gcv_rmse": float(comb_rmse[comb_gcv - 1]),
        "gcv_nll": float(comb_nll[comb_gcv - 1]),
        "dc_gcv_step": dc_gcv,
        "dc_gcv_rmse": float(dc_rmse[dc_gcv - 1]),
        "dc_gcv_nll": float(dc_nll[dc_gcv - 1]),
        "limit_gap": limit_gap,
        "teacher_s": teacher_s,
        "distil_s": distil_s,
    }


# ---------------------------------------------------------------------------------------- report
def mean_se(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean and standard error over the first axis (splits); s.e. 0 for one split."""
    n = values.shape[0]
    se = values.std(0, ddof=1) / math.sqrt(n) if n > 1 else np.zeros_like(values[0])
    return values.mean(0), se


def fmt(mean: float, se: float, digits: int = 3) -> str:
    return f"{mean:.{digits}f} ± {se:.{digits}f}"


def grid_table(values: np.ndarray, label: str) -> list[str]:
    """An ``O x I`` Markdown table of mean ± s.e., the lowest mean in bold."""
    mean, se = mean_se(values)
    best = np.unravel_index(np.argmin(mean), mean.shape)
    outer, inner = mean.shape
    lines = [
        f"{label} (rows: outer step o, columns: inner step i; row o = 1 is the data-centric "
        "chain, cell (1, 1) the teacher)",
        "",
        "| o \\ i | " + " | ".join(str(i + 1) for i in range(inner)) + " |",
        "|---:|" + "---:|" * inner,
    ]
    for o in range(outer):
        cells = []
        for i in range(inner):
            cell = fmt(mean[o, i], se[o, i])
            cells.append(f"**{cell}**" if (o, i) == best else cell)
        lines.append(f"| {o + 1} | " + " | ".join(cells) + " |")
    return lines


def best_row(label: str, rmse: np.ndarray, nll: np.ndarray, cells: list[str], by: str) -> str:
    """The step (cell) with the lowest mean over the splits of ``rmse`` or ``nll`` (``by``), and
    its RMSE and NLL; ``rmse`` and ``nll`` are ``(splits, ...)``."""
    rmse, nll = rmse.reshape(rmse.shape[0], -1), nll.reshape(nll.shape[0], -1)
    k = int(np.argmin((rmse if by == "RMSE" else nll).mean(0)))
    return (
        f"| {label} (by {by}) | {cells[k]} | {fmt(*mean_se(rmse[:, k]))} | "
        f"{fmt(*mean_se(nll[:, k]))} |"
    )


def paired(a: np.ndarray, b: np.ndarray) -> str:
    """Mean ± s.e. over splits of the paired difference ``a - b``."""
    return fmt(*mean_se(a - b))


def dataset_report(name: str, runs: list[dict], args) -> list[str]:
    stack = {key: np.stack([r[key] for r in runs]) for key in runs[0]}
    outer, inner, steps = args.outer, args.inner, args.baseline_steps
    cells = [f"({o + 1}, {i + 1})" for o in range(outer) for i in range(inner)]
    chain = [str(t + 1) for t in range(steps)]
    r0 = runs[0]
    noise = mean_se(np.array([r["noise"] for r in runs]))
    lines = [
        f"## {name}",
        "",
        f"N = {r0['n_train']} training rows, M = {r0['n_test']} test rows, {len(runs)} splits; "
        f"teacher noise (standardised units) {fmt(*noise)}; teacher training "
        f"{np.mean([r['teacher_s'] for r in runs]):.1f} s and the three distillers "
        f"{np.mean([r['distil_s'] for r in runs]):.2f} s per split (mean). Largest difference "
        "of the grid's first row from the data-centric chain (test means, standardised "
        f"units): {max(r['limit_gap'] for r in runs):.1e}.",
        "",
        *grid_table(stack["comb_rmse"], "Test RMSE"),
        "",
        *grid_table(stack["comb_nll"], "Test NLL per point"),
        "",
        "| method | step | test RMSE | test NLL |",
        "|---|---:|---:|---:|",
    ]
    teacher = (stack["dc_rmse"][:, 0], stack["dc_nll"][:, 0])
    lines.append(f"| teacher | 1 | {fmt(*mean_se(teacher[0]))} | {fmt(*mean_se(teacher[1]))} |")
    for label, key, names in (
        ("best data-centric step", "dc", chain),
        ("best distribution-centric step", "dist", chain),
        ("best combined cell", "comb", cells),
    ):
        for by in ("RMSE", "NLL"):
            lines.append(best_row(label, stack[f"{key}_rmse"], stack[f"{key}_nll"], names, by))
    lines += [
        f"| GCV's data-centric step, per split | — | {fmt(*mean_se(stack['dc_gcv_rmse']))} | "
        f"{fmt(*mean_se(stack['dc_gcv_nll']))} |",
        f"| GCV's combined cell, per split | — | {fmt(*mean_se(stack['gcv_rmse']))} | "
        f"{fmt(*mean_se(stack['gcv_nll']))} |",
        "",
        "GCV's combined cell (o, i) per split: "
        + ", ".join(f"({o}, {i})" for o, i in (r["gcv_cell"] for r in runs))
        + "; GCV's data-centric step per split: "
        + ", ".join(str(r["dc_gcv_step"]) for r in runs)
        + ".",
        "",
        "Paired differences over the splits (mean ± s.e.; negative: the first is better): "
        "RMSE of the best combined cell minus the best data-centric step "
        f"{_paired_best(stack['comb_rmse'], stack['dc_rmse'])}, minus the best "
        f"distribution-centric step {_paired_best(stack['comb_rmse'], stack['dist_rmse'])}; "
        "RMSE of GCV's combined cell minus GCV's data-centric step "
        f"{paired(stack['gcv_rmse'], stack['dc_gcv_rmse'])}, minus the teacher "
        f"{paired(stack['gcv_rmse'], teacher[0])}; NLL of GCV's combined cell minus the teacher "
        f"{paired(stack['gcv_nll'], teacher[1])}.",
        "",
        f"![{name}](combined_chain_{name}.png)",
        "",
    ]
    return lines


def _paired_best(values: np.ndarray, baseline: np.ndarray) -> str:
    """Paired difference of the best (lowest-mean) cell of ``values`` and of ``baseline``."""
    flat, base = values.reshape(values.shape[0], -1), baseline.reshape(baseline.shape[0], -1)
    return paired(flat[:, np.argmin(flat.mean(0))], base[:, np.argmin(base.mean(0))])


def heat_map(name: str, runs: list[dict], path: Path) -> None:
    """Mean test RMSE and NLL over the splits on the (outer, inner) grid, annotated."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    for ax, key, label in zip(
        axes,
        ("comb_rmse", "comb_nll"),
        ("test RMSE (target units)", "test NLL per point"),
        strict=True,
    ):
        mean = np.stack([r[key] for r in runs]).mean(0)
        outer, inner = mean.shape
        image = ax.imshow(mean, origin="lower", cmap="viridis", aspect="auto")
        for o in range(outer):
            for i in range(inner):
                ax.text(i, o, f"{mean[o, i]:.3f}", ha="center", va="center", color="w", size=8)
        best = np.unravel_index(np.argmin(mean), mean.shape)
        ax.scatter([best[1]], [best[0]], marker="s", s=900, facecolors="none", edgecolors="r", lw=2)
        ax.set_xticks(range(inner), [str(i + 1) for i in range(inner)])
        ax.set_yticks(range(outer), [str(o + 1) for o in range(outer)])
        ax.set_xlabel("inner (data-centric) step i")
        ax.set_ylabel("outer (distribution-centric) step o")
        ax.set_title(f"mean {label}")
        fig.colorbar(image, ax=ax, label=label)
    fig.suptitle(
        f"{name}: combined self-distillation chain, mean over {len(runs)} splits "
        "(red square: lowest; (1, 1) is the teacher)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def header(args) -> list[str]:
    import sklearn

    return [
        "# Where the combined self-distillation chain helps (issue 43, part A item 4)",
        "",
        f"- command: `python benchmarks/bench_combined_chain.py {' '.join(sys.argv[1:])}`",
        f"- machine: {platform.system()} {cpu_name()}, {torch.get_num_threads()} torch thread(s); "
        "shared with other jobs (see the load line above: a load above the 2 cores means they "
        "were busy), which affects the times only",
        f"- torch {torch.__version__}, gpytorch {gpytorch.__version__}, scikit-learn "
        f"{sklearn.__version__}, numpy {np.__version__}, Python {platform.python_version()}",
        f"- grid: outer steps o = 1..{args.outer} x inner steps i = 1..{args.inner}, the "
        "teacher's noise at every step, one `CombinedGPR` with I = "
        f"{args.inner}: cell (o, i) is inner step i of outer step o, whose prior is the "
        f"posterior of inner step {args.inner} of outer step o - 1 (so column i = 1 is not "
        "the distribution-centric chain unless I = 1; that chain is the baseline); baselines: data- and distribution-centric "
        f"steps 1..{args.baseline_steps}; teacher: {args.iterations} Adam steps; splits: seeds "
        f"0..{args.splits - 1} of `load_dataset`; deliveries: {args.deliveries_train} training "
        "rows drawn from its 8010",
        "- cells: mean ± standard error over the splits; RMSE and NLL in the target's units "
        "(NLL: the teacher's noise added to each step's variance); bold: the lowest mean",
        "",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", nargs="+", default=list(DATASETS), choices=DATASETS)
    parser.add_argument("--splits", type=int, default=10)
    parser.add_argument("--outer", type=int, default=5)
    parser.add_argument("--inner", type=int, default=5)
    parser.add_argument("--baseline-steps", type=int, default=30)
    parser.add_argument("--iterations", type=int, default=150, help="teacher Adam steps")
    parser.add_argument("--deliveries-train", type=int, default=1000)
    parser.add_argument("--quick", action="store_true", help="one split of diabetes")
    parser.add_argument("--out", default=None, help="also write the report to this file")
    args = parser.parse_args()
    if args.quick:
        args.data, args.splits = ["diabetes"], 1
    torch.manual_seed(0)
    lines = header(args)
    print("\n".join(lines), flush=True)
    for name in args.data:
        runs = []
        for seed in range(args.splits):
            runs.append(one_split(name, seed, args))
            print(f"{name}: split {seed} done", file=sys.stderr, flush=True)
        part = dataset_report(name, runs, args)
        if args.out:  # the heat maps go beside the report
            heat_map(name, runs, Path(args.out).parent / f"combined_chain_{name}.png")
        print("\n".join(part), flush=True)
        lines += part
    lines.append(f"Process (CPU) time of the whole run: {time.process_time():.0f} s.")
    text = load_line() + "\n\n" + "\n".join(lines)
    print("\n" + load_line(), flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")


if __name__ == "__main__":
    main()
