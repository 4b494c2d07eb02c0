"""DPKL's default against the ARD GP it builds on, on the small-data protocol (issue 32, item 1).

For each data set a fixed test set is drawn once (seed 1234); in each trial ``n`` labelled rows
are drawn from the rest, inputs and targets are standardised on them, and every method gets the
same ``n`` rows (the DPKL and DKL fits hold their validation rows out of those ``n`` themselves).
RMSE and the per-point Gaussian NLL (noise included) are in the original target units.

Methods:

- ``ARD GP``: ``ARDGPRegressor(x, y).fit(max_iter=300, lr=0.1)`` (the marginal likelihood
  optimised to convergence, the baseline a practitioner would use);
- ``ARD GP (200 steps at 0.01)``: ``ARDGPRegressor(x, y).fit(max_iter=200, lr=0.01)`` (not converged);
- ``DPKL default``: ``DPKLRegressor(x, y, net).fit()``;
- ``DPKL paper``: ``DPKLRegressor.paper_setting(x, y, net).fit()``;
- ``DKL``: ``DKLRegressor(x, y, net).fit(val_fraction=0.1)``;

with ``net`` the paper's D-100-50-50-2 ReLU network. With both ``ARD GP`` and ``DPKL default``
a table per data set says in how many trials the default kept the network
(``network_kept_``) and its test RMSE and NLL minus the ARD GP's, over all trials and over
those where the network was kept. ``--diagnose`` also records, for the paper
setting trained without early stopping, the training loss, validation and test error and the
parameters over the iterations ("why DPKL overfits").

    python benchmarks/bench_dpkl_defaults.py --quick             # 2 trials, deliveries n=100
    python benchmarks/bench_dpkl_defaults.py --trials 10 --diagnose --out benchmarks/results/dpkl_defaults.md
    python benchmarks/bench_dpkl_defaults.py --trials 3 --methods "ARD GP" "DPKL default"  # the choice
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
import numpy as np
import torch
from _problems import dpkl_network as make_net
from _timing import Report, cpu_name

from gpsd.data import load_arrays
from gpsd.dpkl import ARDGPRegressor, DKLRegressor, DPKLRegressor

METHODS = ["ARD GP", "ARD GP (200 steps at 0.01)", "DPKL default", "DPKL paper", "DKL"]
N_TEST = {"deliveries": 1000, "concrete": 500, "boston": 206, "meats": 65}
NS = {"deliveries": [100, 300], "concrete": [100, 300], "boston": [100, 300], "meats": [100, 150]}


def draw(name: str, n: int, seed: int):
    """Standardised ``n`` labelled rows and the fixed test set (targets in original units)."""
    x, y = load_arrays(name)
    perm = np.random.default_rng(1234).permutation(len(y))
    test, pool = perm[: N_TEST[name]], perm[N_TEST[name] :]
    lab = np.random.default_rng(seed).choice(pool, size=n, replace=False)
    mu, sd = x[lab].mean(0), x[lab].std(0)
    sd = np.where(sd > 0, sd, 1.0)
    y_mu, y_sd = y[lab].mean(), y[lab].std()

    def t(a):
        return torch.as_tensor(a, dtype=torch.float64)

    return (
        t((x[lab] - mu) / sd),
        t((y[lab] - y_mu) / y_sd),
        t((x[test] - mu) / sd),
        t(y[test]),
        y_mu,
        y_sd,
    )


def scores(model, x_test, y_test, y_mu, y_sd) -> tuple[float, float]:
    """Test RMSE and per-point Gaussian NLL in the original target units."""
    pred = model.predict(x_test, include_noise=True)
    mean, var = pred.mean * y_sd + y_mu, pred.variance * y_sd**2
    rmse = float((mean - y_test).pow(2).mean().sqrt())
    nll = float((0.5 * (y_test - mean).pow(2) / var + 0.5 * torch.log(2 * math.pi * var)).mean())
    return rmse, nll


def fit(method: str, x, y):
    d = x.shape[1]
    if method == "ARD GP":
        return ARDGPRegressor(x, y).fit(max_iter=300, lr=0.1)
    if method == "ARD GP (200 steps at 0.01)":
        return ARDGPRegressor(x, y).fit(max_iter=200, lr=0.01)
    if method == "DPKL default":
        return DPKLRegressor(x, y, lambda: make_net(d)).fit()
    if method == "DPKL paper":
        return DPKLRegressor.paper_setting(x, y, lambda: make_net(d)).fit()
    return DKLRegressor(x, y, make_net(d)).fit(val_fraction=0.1)


def mean_se(values: list[float]) -> str:
    if any(not math.isfinite(v) for v in values):
        return f"NaN in {sum(not math.isfinite(v) for v in values)} trials"
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.3f} ± {se:.3f}"


def accuracy(args, report: Report) -> None:
    for name in args.datasets:
        res = {n: {m: [] for m in args.methods} for n in NS[name] if n in args.ns or not args.ns}
        for n in res:
            t0 = time.perf_counter()
            for trial in range(args.trials):
                x, y, x_test, y_test, y_mu, y_sd = draw(name, n, 1000 * trial + n)
                for method in args.methods:
                    torch.manual_seed(trial)
                    start = time.perf_counter()
                    try:
                        model = fit(method, x, y)
                        rmse, nll = scores(model, x_test, y_test, y_mu, y_sd)
                    except (RuntimeError, ValueError) as err:  # reported, not hidden
                        print(f"  {name} n={n} trial {trial} {method}: {err}", flush=True)
                        rmse = nll = math.nan
                    kept = getattr(model, "network_kept_", None) if math.isfinite(rmse) else None
                    res[n][method].append((rmse, nll, time.perf_counter() - start, kept))
            print(f"  {name} n={n}: {time.perf_counter() - t0:.0f} s", flush=True)
        d = load_arrays(name)[0].shape[1]
        for k, label in ((0, "test RMSE"), (1, "test NLL per point")):
            report.add(
                f"\n### {name} (D = {d}, {N_TEST[name]} test rows): {label}, mean ± s.e. over "
                f"{args.trials} trials\n"
            )
            ratio = "DPKL default / ARD GP (per-trial ratio)" if k == 0 else None
            cols = list(args.methods) + ([ratio] if ratio and "ARD GP" in args.methods else [])
            report.add("| n | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|")
            for n, by_method in res.items():
                cells = [mean_se([v[k] for v in by_method[m]]) for m in args.methods]
                if len(cols) > len(args.methods) and "DPKL default" in by_method:
                    cells.append(
                        mean_se(
                            [
                                a[0] / b[0]
                                for a, b in zip(
                                    by_method["DPKL default"], by_method["ARD GP"], strict=True
                                )
                            ]
                        )
                    )
                report.add(f"| {n} | " + " | ".join(cells) + " |")
        if "DPKL default" in args.methods and "ARD GP" in args.methods:
            choice_table(name, res, args.trials, report)
        report.add(f"\n### {name}: mean fit time in seconds (shared machine: indicative only)\n")
        report.add(
            "| n | " + " | ".join(args.methods) + " |", "|---" * (len(args.methods) + 1) + "|"
        )
        for n, by_method in res.items():
            cells = [f"{statistics.fmean(v[2] for v in by_method[m]):.1f}" for m in args.methods]
            report.add(f"| {n} | " + " | ".join(cells) + " |")


def choice_table(name: str, res: dict, trials: int, report: Report) -> None:
    """How often the default kept the network, and its test RMSE and NLL minus the ARD GP's
    in the same trials (all trials; those where the network was kept)."""
    report.add(
        f"\n### {name}: DPKL default's choice (`network_kept_`) over {trials} trials; "
        "default minus ARD GP, mean ± s.e.\n",
        "| n | network kept | Δ RMSE, all trials | Δ NLL, all trials | Δ RMSE, kept | Δ NLL, kept |",
        "|---" * 6 + "|",
    )
    for n, by_method in res.items():
        pairs = list(zip(by_method["DPKL default"], by_method["ARD GP"], strict=True))
        kept = [(a, b) for a, b in pairs if a[3]]
        cells = [f"{len(kept)} of {len(pairs)}"]
        for group in (pairs, kept):
            for k in (0, 1):
                cells.append(mean_se([a[k] - b[k] for a, b in group]) if group else "-")
        report.add(f"| {n} | " + " | ".join(cells) + " |")


def diagnose(args, report: Report) -> None:
    """The paper setting trained without early stopping: what moves while it overfits."""
    report.add(
        "",
        "## Why DPKL overfits: the paper setting trained without early stopping",
        "",
        f"`DPKLRegressor.paper_setting(x, y, net)` on {100 - args.diag_val_percent} % of n "
        f"labelled rows, Adam lr 0.01, {args.diag_iter} iterations, no early stopping; validation NLL "
        f"on the other {args.diag_val_percent} %. Particle distance: mean distance between two "
        "particles' parameter vectors; weights moved: mean over particles of |w - w_0| / |w_0|; "
        "embedding spread: the spread of one input's embeddings across particles over the "
        "spread of the ensemble-mean embeddings across inputs. The ARD GP line is the converged "
        "ARD GP on all n rows.",
    )
    for name, n in args.diag:
        n = int(n)
        for trial in range(args.diag_trials):
            x, y, x_test, y_test, y_mu, y_sd = draw(name, n, 1000 * trial + n)
            torch.manual_seed(trial)
            gp = ARDGPRegressor(x, y).fit(max_iter=300, lr=0.1)
            gp_rmse, gp_nll = scores(gp, x_test, y_test, y_mu, y_sd)
            n_val = round(n * args.diag_val_percent / 100)
            x_val, y_val, x_tr, y_tr = x[:n_val], y[:n_val], x[n_val:], y[n_val:]
            torch.manual_seed(trial)
            d = x.shape[1]
            model = DPKLRegressor.paper_setting(x_tr, y_tr, lambda d=d: make_net(d))
            ensemble = model.covar_module.feature_extractor
            w0 = ensemble.flat_parameters().detach().clone()
            rows = []

            def record(
                rec,
                model=model,
                ensemble=ensemble,
                w0=w0,
                rows=rows,
                stats=(x_test, y_test, y_mu, y_sd),
                val_data=(x_val, y_val),
                x_tr=x_tr,
            ):
                if rec.iteration not in args.diag_at:
                    return
                with torch.no_grad():
                    model._fitted = True
                    rmse, nll = scores(model, *stats)
                    val = model.nll(*val_data)
                    model.train()
                    w = ensemble.flat_parameters()
                    m = w.shape[0]
                    dist = float(torch.cdist(w, w).sum() / (m * (m - 1)))
                    moved = float(((w - w0).norm(dim=1) / w0.norm(dim=1)).mean())
                    ensemble.eval()
                    z = ensemble(x_tr)
                    ensemble.train()
                    within = z.var(0).sum(-1).mean().sqrt()
                    between = z.mean(0).var(0).sum().sqrt()
                    rf = model.covar_module.random_features
                    rows.append(
                        (
                            rec.iteration,
                            rec.loss,
                            val,
                            rmse,
                            nll,
                            float(model.likelihood.noise),
                            float(rf.outputscale),
                            float(rf.lengthscale.mean()),
                            moved,
                            dist,
                            float(within / between),
                        )
                    )

            model.fit(max_iter=args.diag_iter, val_fraction=0.0, callback=record)
            report.add(
                "",
                f"### {name}, n = {n}, trial {trial}: ARD GP test RMSE {gp_rmse:.3f}, NLL "
                f"{gp_nll:.3f}, training loss {float(gp.training_loss()):.3f}",
                "",
                "| iteration | training loss | validation NLL | test RMSE | test NLL | noise | "
                "outputscale | lengthscale | weights moved | particle distance | embedding spread |",
                "|---" * 11 + "|",
            )
            for r in rows:
                report.add("| " + " | ".join([str(r[0])] + [f"{v:.3f}" for v in r[1:]]) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument(
        "--datasets", nargs="+", default=["deliveries", "meats", "concrete", "boston"]
    )
    parser.add_argument("--ns", type=int, nargs="*", default=[], help="only these n (default: all)")
    parser.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    parser.add_argument("--quick", action="store_true", help="2 trials, deliveries n = 100")
    parser.add_argument("--diagnose", action="store_true")
    parser.add_argument(
        "--diag",
        nargs="+",
        type=lambda s: s.split(":"),
        default=[["deliveries", "100"], ["meats", "100"]],
    )
    parser.add_argument("--diag-trials", type=int, default=1)
    parser.add_argument("--diag-iter", type=int, default=300)
    parser.add_argument("--diag-val-percent", type=int, default=20)
    parser.add_argument("--skip-accuracy", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    args.diag_at = {1, 10, 20, 40, 60, 100, 150, 200, 300, 400, 500}
    if args.quick:
        args.trials, args.datasets, args.ns = 2, ["deliveries"], [100]
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=gpytorch.utils.warnings.GPInputWarning)
    report = Report(args.out)
    report.add(
        "# DPKL's default against the ARD GP (small-data protocol)",
        "",
        f"- machine: `{cpu_name()}`, 2 cores shared with other people's jobs (busy: the load "
        "line above), 1 torch thread; device: cpu; dtype: float64",
        f"- torch {torch.__version__}, gpytorch {gpytorch.__version__}",
        f"- command: `python benchmarks/{Path(sys.argv[0]).name} {' '.join(sys.argv[1:])}`",
        "- methods: "
        + "; ".join(args.methods)
        + " (see the script's docstring for their exact calls)",
    )
    t0 = time.perf_counter()
    if args.diagnose:
        diagnose(args, report)
    if not args.skip_accuracy:
        report.add("", "## Accuracy")
        accuracy(args, report)
    report.add("", f"- total wall time: {time.perf_counter() - t0:.0f} s")
    report.close()


if __name__ == "__main__":
    main()
