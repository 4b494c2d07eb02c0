"""How to fit an ARD GP's hyperparameters on small data (issue 44, item 1).

The small-data protocol of ``bench_dpkl_defaults.py``: for each data set a fixed test set is
drawn once (seed 1234); in each trial ``n`` labelled rows are drawn from the rest, and inputs and
targets are standardised on them. RMSE and the per-point Gaussian NLL (noise included) are in the
original target units. Every candidate is an :class:`~gpsd.ARDGPRegressor` (ARD RBF kernel with
a learned outputscale, constant mean, Gaussian likelihood; lengthscales start at sqrt(D), float64)
trained by Adam at learning rate 0.1:

- ``MLE (300 steps)``: the log marginal likelihood to convergence, ``fit()`` (300 steps);
- ``early stop (60 steps)``: the same run read after 60 of its steps;
- ``MAP (priors)``: ``hyperprior="dim_scaled"``, 300 steps: the marginal likelihood plus the log
  density of log h_j ~ N(sqrt(2) + log(D)/2, 3) on every lengthscale (Hvarfner, Hellsten & Nardi,
  2024) and of log noise ~ N(-4, 1) (BoTorch's ``SingleTaskGP`` noise prior); the noise keeps
  GPyTorch's lower bound of 1e-4 (BoTorch's bound has the same value); no outputscale prior;
- ``LOO objective``: ``objective="loo"``, 300 steps: the leave-one-out predictive log
  likelihood (Rasmussen & Williams eq. 5.10-5.12) in place of the marginal likelihood;
- ``LOO choice``: of the first three fits, the one whose closed-form leave-one-out predictive
  log likelihood on its training rows is highest (computed here by dense float64 formulas).

Meats has 215 rows, so its larger n is 150. Boston at n = 300 and meats at n = 150 take the whole
pool left after the test set, so their trials repeat one fit.

    python benchmarks/bench_small_data_hyperparameters.py --quick        # 1 trial, deliveries
    python benchmarks/bench_small_data_hyperparameters.py --out benchmarks/results/small_data_hyperparameters_cpu.md
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
import warnings
from pathlib import Path

import gpytorch
import torch
from _timing import Report, cpu_name
from bench_dpkl_defaults import N_TEST, NS, draw, mean_se, scores

from gpsd.data import load_arrays
from gpsd.dpkl import ARDGPRegressor

METHODS = [
    "MLE (300 steps)",
    "early stop (60 steps)",
    "MAP (priors)",
    "LOO objective",
    "LOO choice",
]
CHOOSABLE = METHODS[:3]


@torch.no_grad()
def loo_log_likelihood(model: ARDGPRegressor) -> float:
    """Mean closed-form leave-one-out predictive log likelihood of the training targets
    (Rasmussen & Williams eq. 5.10-5.12), by a dense Cholesky factor of K + noise I."""
    x, y = model.train_inputs[0], model.train_targets
    k = model.covar_module(x).to_dense() + model.likelihood.noise * torch.eye(len(y), dtype=y.dtype)
    chol = torch.linalg.cholesky(k)
    k_inv = torch.cholesky_inverse(chol)
    alpha = k_inv @ (y - model.mean_module(x))
    var = 1.0 / k_inv.diagonal()  # sigma^2_{-i}
    resid = alpha * var  # y_i - mu_{-i}
    return float((-0.5 * resid.pow(2) / var - 0.5 * torch.log(2 * math.pi * var)).mean())


def fit_all(x, y) -> dict[str, ARDGPRegressor]:
    """Every candidate's fitted model (the early-stopped one is the MLE run after 60 steps)."""
    models = {}
    torch.manual_seed(0)
    mle = ARDGPRegressor(x, y)
    optimizer = torch.optim.Adam(mle.parameters(), lr=0.1)
    mle.fit(max_iter=60, optimizer=optimizer)
    early = ARDGPRegressor(x, y)
    early.load_state_dict(mle.state_dict())
    models["early stop (60 steps)"] = early
    mle.fit(max_iter=240, optimizer=optimizer)  # the same Adam run, 300 steps in all
    models["MLE (300 steps)"] = mle
    models["MAP (priors)"] = ARDGPRegressor(x, y, hyperprior="dim_scaled").fit()
    models["LOO objective"] = ARDGPRegressor(x, y, objective="loo").fit()
    loo = {m: loo_log_likelihood(models[m]) for m in CHOOSABLE}
    best = max(loo, key=loo.get)
    models["LOO choice"] = models[best]
    models["_chosen"] = best
    return models


def run(args, report: Report) -> None:
    for name in args.datasets:
        d = load_arrays(name)[0].shape[1]
        for n in NS[name]:
            if args.ns and n not in args.ns:
                continue
            res = {m: [] for m in METHODS}
            chosen = {m: 0 for m in CHOOSABLE}
            t0 = time.perf_counter()
            for trial in range(args.trials):
                x, y, x_test, y_test, y_mu, y_sd = draw(name, n, 1000 * trial + n)
                models = fit_all(x, y)
                chosen[models.pop("_chosen")] += 1
                for m in METHODS:
                    rmse, nll = scores(models[m], x_test, y_test, y_mu, y_sd)
                    res[m].append((rmse, nll, float(models[m].likelihood.noise.detach())))
            seconds = time.perf_counter() - t0
            report.add(
                "",
                f"### {name} (D = {d}), n = {n}, {N_TEST[name]} test rows, {args.trials} trials "
                f"({seconds:.0f} s)",
                "",
                "| | " + " | ".join(METHODS) + " |",
                "|---" * (len(METHODS) + 1) + "|",
            )
            best = {}
            for k, label in ((0, "test RMSE"), (1, "test NLL"), (2, "noise (standardised)")):
                means = {m: statistics.fmean(v[k] for v in res[m]) for m in METHODS}
                best[k] = min(means.values())
                cells = []
                for m in METHODS:
                    cell = mean_se([v[k] for v in res[m]])
                    cells.append(f"**{cell}**" if k < 2 and means[m] == best[k] else cell)
                report.add(f"| {label} | " + " | ".join(cells) + " |")
            report.add(
                "",
                "LOO choice picked: "
                + ", ".join(f"{m} {c}×" for m, c in chosen.items())
                + "; per method, RMSE / best RMSE and NLL - best NLL: "
                + "; ".join(
                    f"{m} {statistics.fmean(v[0] for v in res[m]) / best[0]:.3f}, "
                    f"{statistics.fmean(v[1] for v in res[m]) - best[1]:+.3f}"
                    for m in METHODS
                ),
            )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument(
        "--datasets", nargs="+", default=["deliveries", "concrete", "boston", "meats"]
    )
    parser.add_argument("--ns", type=int, nargs="*", default=[], help="only these n (default: all)")
    parser.add_argument("--quick", action="store_true", help="1 trial, deliveries")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.quick:
        args.trials, args.datasets = 1, ["deliveries"]
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=gpytorch.utils.warnings.GPInputWarning)
    report = Report(args.out)
    report.add(
        "# Small-data hyperparameters of the ARD GP: MLE, early stopping, MAP, LOO",
        "",
        f"- machine: `{cpu_name()}`, 2 cores shared with five other agents' jobs (busy: the load "
        "line above), 1 torch thread; device: cpu; dtype: float64",
        f"- torch {torch.__version__}, gpytorch {gpytorch.__version__}",
        f"- command: `python benchmarks/{Path(sys.argv[0]).name} {' '.join(sys.argv[1:])}`",
        "- candidates: see the script's docstring; meats has 215 rows, so its larger n is 150",
        "- cells: mean ± s.e. over the trials; bold: the best mean of the row",
    )
    t0 = time.perf_counter()
    run(args, report)
    report.add("", f"- total wall time: {time.perf_counter() - t0:.0f} s")
    report.close()


if __name__ == "__main__":
    main()
