"""DPKL small-data benchmark (Mallick et al., Appendix C.1) and training-step timings.

Accuracy: on ``deliveries`` (D = 35 after one-hot coding the weekday) a fixed test set of 1000 rows; in each trial ``n`` labelled
rows are drawn from the rest (90 % train, 10 % validation for early stopping) and every other
row is unlabelled (SSDPKL draws minibatches of them). On ``meats`` (D = 100, 215 rows) the test
set is 65 rows and n <= 150. Inputs and targets are standardised on the labelled rows; RMSE and
per-point Gaussian NLL are reported in the original target units. Methods: GP (ARD-RBF), DKL,
DPKL with the paper's update, DPKL with full SVGD, SSDPKL (paper's update, alpha = 1).

Timing: seconds per training step (forward + backward of the negative log marginal likelihood
and the functional-gradient transform) of the vmap'ed ensemble against a per-particle Python loop,
and of the Woodbury (low-rank) solve against a dense Cholesky of the n x n kernel matrix.

    python benchmarks/bench_dpkl.py              # default: 5 trials (about 9 min on 2 busy cores)
    python benchmarks/bench_dpkl.py --quick      # 1 trial, deliveries, n in {50, 200}
    python benchmarks/bench_dpkl.py --trials 10  # the full protocol (10 trials)
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from pathlib import Path

import gpytorch
import numpy as np
import torch
from _problems import dpkl_network as make_net
from _timing import Report, cpu_name, cuda_missing, median_time
from linear_operator.operators import LowRankRootLinearOperator
from torch import nn

from gpsd.data import load_arrays
from gpsd.dpkl import (
    ARDGPRegressor,
    DKLRegressor,
    DPKLRegressor,
    SSDPKLRegressor,
    SteinVariationalGradient,
)

RESULTS = Path(__file__).parent / "results"
METHODS = ["GP", "DKL", "DPKL (paper)", "DPKL (SVGD)", "SSDPKL"]


def standardise(train: np.ndarray, *others: np.ndarray):
    mu, sd = train.mean(0), train.std(0)
    sd = np.where(sd > 0, sd, 1.0)
    return [(a - mu) / sd for a in (train, *others)], mu, sd


def run_trial(x, y, test_idx, pool_idx, n, seed, args, dtype, device):
    rng = np.random.default_rng(seed)
    lab = rng.choice(pool_idx, size=n, replace=False)
    unl = np.setdiff1d(pool_idx, lab)
    n_val = max(1, int(round(0.1 * n)))
    val, tr = lab[:n_val], lab[n_val:]
    (xtr, xval, xte, xun), _, _ = standardise(x[tr], x[val], x[test_idx], x[unl])
    ymu, ysd = y[tr].mean(), y[tr].std()

    def t(a):
        return torch.as_tensor(a, dtype=dtype, device=device)

    xtr, xval, xte = t(xtr), t(xval), t(xte)
    ytr, yval = t((y[tr] - ymu) / ysd), t((y[val] - ymu) / ysd)
    yte = t(y[test_idx])
    d = x.shape[1]
    out = {}
    for method in args.methods:
        if method == "SSDPKL" and len(unl) == 0:
            continue
        torch.manual_seed(seed)
        common = dict(num_particles=args.particles, num_random_features=args.features)
        if method == "GP":
            model = ARDGPRegressor(xtr, ytr)
        elif method == "DKL":
            model = DKLRegressor(xtr, ytr, make_net(d))
        elif method == "DPKL (paper)":
            model = DPKLRegressor(
                xtr, ytr, lambda: make_net(d), update="paper", input_kernel=None, **common
            )
        elif method == "DPKL (SVGD)":
            model = DPKLRegressor(
                xtr, ytr, lambda: make_net(d), update="svgd", input_kernel=None, **common
            )
        else:
            model = SSDPKLRegressor(
                xtr,
                ytr,
                lambda: make_net(d),
                unlabelled_x=t(xun),
                alpha=1.0,
                unlabelled_batch_size=256,
                update="paper",
                **common,
            )
        model.to(device)
        t0 = time.perf_counter()
        model.fit(
            max_iter=args.steps, lr=args.lr, val_x=xval, val_y=yval, check_every=args.check_every
        )
        fit_s = time.perf_counter() - t0
        pred = model.predict(xte, include_noise=True)  # of the observed targets
        mean, var = pred.mean, pred.variance
        mean, var = mean * ysd + ymu, var * ysd**2
        rmse = float((mean - yte).pow(2).mean().sqrt())
        nll = float((0.5 * (yte - mean).pow(2) / var + 0.5 * torch.log(2 * math.pi * var)).mean())
        out[method] = (rmse, nll, fit_s)
    return out


def accuracy_tables(args, dtype, device, report):
    """Add each data set's tables to ``report`` as it finishes; returns the data to plot."""
    plot_data = {}
    for name in args.datasets:
        lines = []
        x, y = load_arrays(name)
        rng = np.random.default_rng(1234)
        perm = rng.permutation(len(y))
        n_test = 1000 if name == "deliveries" else 65
        test_idx, pool_idx = perm[:n_test], perm[n_test:]
        ns = args.ns if name == "deliveries" else [n for n in (50, 100, 150) if n <= len(pool_idx)]
        res = {m: {n: [] for n in ns} for m in METHODS}
        for n in ns:
            for trial in range(args.trials):
                r = run_trial(x, y, test_idx, pool_idx, n, 1000 * trial + n, args, dtype, device)
                for m, v in r.items():
                    res[m][n].append(v)
            print(f"  {name} n={n} done", flush=True)
        plot_data[name] = (ns, res)
        for k, label in ((0, "test RMSE"), (1, "test NLL per point")):
            lines.append(f"\n### {name}: {label} (mean ± std over {args.trials} trials)\n")
            lines.append("| n | " + " | ".join(METHODS) + " |")
            lines.append("|---" * (len(METHODS) + 1) + "|")
            for n in ns:
                cells = []
                for m in METHODS:
                    vals = [v[k] for v in res[m][n]]
                    if not vals:
                        cells.append("n/a")
                        continue
                    mu = statistics.fmean(vals)
                    sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
                    cells.append(f"{mu:.3f} ± {sd:.3f}")
                best = min(
                    (statistics.fmean([v[k] for v in res[m][n]]), m) for m in METHODS if res[m][n]
                )[1]
                cells = [
                    f"**{c}**" if m == best else c for c, m in zip(cells, METHODS, strict=True)
                ]
                lines.append(f"| {n} | " + " | ".join(cells) + " |")
        lines.append(f"\n### {name}: mean fit time in seconds (incl. validation checks)\n")
        lines.append("| n | " + " | ".join(METHODS) + " |")
        lines.append("|---" * (len(METHODS) + 1) + "|")
        for n in ns:
            cells = [
                f"{statistics.fmean([v[2] for v in res[m][n]]):.2f}" if res[m][n] else "n/a"
                for m in METHODS
            ]
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
        report.add(*lines)
    return plot_data


class LoopEnsemble(nn.Module):
    """The naive alternative: m separate modules evaluated one after the other."""

    def __init__(self, modules):
        super().__init__()
        self.nets = nn.ModuleList(modules)

    def forward(self, x):
        return torch.stack([net(x) for net in self.nets])


def timing_tables(args, dtype, device, report):
    """Add the timing tables to ``report`` row by row."""
    d, n, R = 30, 500, args.features
    x = torch.randn(n, d, dtype=dtype, device=device)
    y = torch.randn(n, dtype=dtype, device=device)
    report.add(
        f"\n### Training step: vmap ensemble vs per-particle Python loop (n = {n}, D = {d}, "
        f"R = {R}, median of {args.repeats} after a warm-up)\n"
    )
    report.add(
        "Both columns compute the same loss (features -> low-rank MVN log-prob, backward, SVGD "
        "transform with repulsion); only the ensemble forward differs. The last column is a "
        "full `DPKLRegressor.training_loss()` step through GPyTorch's ExactGP machinery.\n"
    )
    report.add("| m | vmap step (ms) | loop step (ms) | loop / vmap | DPKLRegressor step (ms) |")
    report.add("|---|---|---|---|---|")
    for m in args.timing_particles:
        torch.manual_seed(0)
        model = DPKLRegressor(
            x,
            y,
            lambda: make_net(d),
            num_particles=m,
            num_random_features=R,
            update="svgd",
            input_kernel=None,  # the paper's kernel: the ensemble's step alone
        ).to(device)
        ens = model.covar_module.feature_extractor
        loop = LoopEnsemble([ens.particle_module(i) for i in range(m)]).to(
            device=device, dtype=dtype
        )
        rf, lik, mean = model.covar_module.random_features, model.likelihood, model.mean_module
        svgd_vmap = SteinVariationalGradient(list(ens.parameters()), repulsion=1.0)
        loop_params = [list(net.parameters()) for net in loop.nets]

        def nlml(phi, lik=lik, mean=mean):
            cov = LowRankRootLinearOperator(phi).add_diagonal(lik.noise.expand(n))
            dist = gpytorch.distributions.MultivariateNormal(mean(x), cov)
            return -dist.log_prob(y) / n

        def step_model(model=model, svgd_vmap=svgd_vmap):
            for p in model.parameters():
                p.grad = None
            model.training_loss().backward()
            svgd_vmap.transform_()

        def step_vmap(model=model, ens=ens, rf=rf, svgd_vmap=svgd_vmap, nlml=nlml):
            for p in model.parameters():
                p.grad = None
            nlml(rf.featurize(ens(x)).mean(0)).backward()
            svgd_vmap.transform_()

        def step_loop(loop=loop, rf=rf, loop_params=loop_params, svgd_vmap=svgd_vmap, nlml=nlml):
            for p in loop.parameters():
                p.grad = None
            nlml(rf.featurize(loop(x)).mean(0)).backward()
            # the same transform on the per-module parameters, flattened by hand
            flat_w = torch.stack(
                [torch.cat([p.detach().reshape(-1) for p in ps]) for ps in loop_params]
            )
            flat_g = torch.stack(
                [torch.cat([p.grad.reshape(-1) for p in ps]) for ps in loop_params]
            )
            new = svgd_vmap.direction(flat_w, flat_g)
            for i, ps in enumerate(loop_params):
                off = 0
                for p in ps:
                    p.grad.copy_(new[i, off : off + p.numel()].view_as(p))
                    off += p.numel()

        tv = median_time(step_vmap, args.repeats, device)
        tl = median_time(step_loop, args.repeats, device)
        tm = median_time(step_model, args.repeats, device)
        report.add(f"| {m} | {1e3 * tv:.2f} | {1e3 * tl:.2f} | {tl / tv:.2f} | {1e3 * tm:.2f} |")

    report.add(
        f"\n### Negative log marginal likelihood + backward: Woodbury (low rank, 2R = {2 * R}) "
        "vs dense Cholesky of the n x n matrix\n"
    )
    report.add("| n | Woodbury (ms) | dense Cholesky (ms) | dense / Woodbury |")
    report.add("|---|---|---|---|")
    for n2 in args.timing_ns:
        phi0 = torch.randn(n2, 2 * R, dtype=dtype, device=device) / math.sqrt(2 * R)
        y2 = torch.randn(n2, dtype=dtype, device=device)
        noise = torch.tensor(0.3, dtype=dtype, device=device)

        def wood(phi0=phi0, noise=noise, n2=n2, y2=y2):
            phi = phi0.clone().requires_grad_(True)
            cov = LowRankRootLinearOperator(phi).add_diagonal(noise.expand(n2))
            dist = gpytorch.distributions.MultivariateNormal(torch.zeros_like(y2), cov)
            (-dist.log_prob(y2)).backward()

        def dense(phi0=phi0, noise=noise, n2=n2, y2=y2):
            phi = phi0.clone().requires_grad_(True)
            cov = phi @ phi.mT + noise * torch.eye(n2, dtype=dtype, device=device)
            chol = torch.linalg.cholesky(cov)
            a = torch.cholesky_solve(y2.unsqueeze(-1), chol)
            (0.5 * (y2 @ a.squeeze(-1)) + torch.log(torch.diagonal(chol)).sum()).backward()

        tw, td = median_time(wood, args.repeats, device), median_time(dense, args.repeats, device)
        report.add(f"| {n2} | {1e3 * tw:.2f} | {1e3 * td:.2f} | {td / tw:.1f} |")


def plot(plot_data, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(plot_data), 2, figsize=(10, 3.6 * len(plot_data)), squeeze=False)
    for row, (name, (ns, res)) in enumerate(plot_data.items()):
        for col, label in enumerate(("test RMSE", "test NLL per point")):
            ax = axes[row, col]
            for m in METHODS:
                pts = [(n, [v[col] for v in res[m][n]]) for n in ns if res[m][n]]
                if not pts:
                    continue
                xs = [p[0] for p in pts]
                mu = [statistics.fmean(p[1]) for p in pts]
                sd = [statistics.stdev(p[1]) if len(p[1]) > 1 else 0.0 for p in pts]
                ax.errorbar(xs, mu, yerr=sd, label=m, capsize=3, marker="o", ms=3)
            trials = max((len(res[m][n]) for m in METHODS for n in ns if res[m][n]), default=1)
            ax.set_title(f"{name} data set: {label}\n(mean ± sd over {trials} trial(s))")
            ax.set_xlabel("labelled n (rows for training and early stopping)")
            ax.set_ylabel(label + (" (target units)" if col == 0 else " (nats)"))
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float64", choices=["float32", "float64"])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="1 trial, deliveries only, n in {50, 200}, fewer timings",
    )
    parser.add_argument("--trials", type=int, default=None)
    parser.add_argument("--ns", type=int, nargs="+", default=[50, 100, 200, 300, 400, 500])
    parser.add_argument("--datasets", nargs="+", default=["deliveries", "meats"])
    parser.add_argument("--steps", type=int, default=60, help="Adam steps per fit")
    parser.add_argument("--check-every", type=int, default=20, help="validation check period")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--particles", type=int, default=10)
    parser.add_argument("--features", type=int, default=100, help="R (2R random features)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--timing-particles", type=int, nargs="+", default=[1, 10, 30])
    parser.add_argument("--timing-ns", type=int, nargs="+", default=[500, 2000, 5000])
    parser.add_argument("--skip-accuracy", action="store_true")
    parser.add_argument("--skip-timing", action="store_true")
    parser.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: much faster on a shared CPU)"
    )
    parser.add_argument(
        "--out",
        default=None,
        help=f"write the tables (and a PNG beside them) to this file, e.g. {RESULTS / 'dpkl.md'}",
    )
    args = parser.parse_args()
    if args.trials is None:
        args.trials = 1 if args.quick else 5
    if args.quick:
        args.ns, args.datasets = [50, 200], ["deliveries"]
        args.timing_particles, args.timing_ns, args.repeats = [1, 10], [500, 1000], 3
    dtype = getattr(torch, args.dtype)
    device = torch.device(args.device)
    if cuda_missing(device):
        return
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    import sys

    header = [
        "# DPKL benchmark",
        "",
        f"- machine: `{cpu_name()}`, "
        f"{torch.get_num_threads()} torch threads; device: {device}; dtype: {args.dtype}",
        f"- torch {torch.__version__}, gpytorch {gpytorch.__version__}",
        f"- command: `python benchmarks/{Path(sys.argv[0]).name} {' '.join(sys.argv[1:])}`",
        f"- settings: {args.trials} trials, n in {args.ns}, Adam lr {args.lr}, {args.steps} full-batch steps, "
        f"early stopping on a 10 % validation split checked every {args.check_every} steps; m = {args.particles} "
        f"particles, R = {args.features} (2R features), network D-100-50-50-2 (ReLU); the GP "
        "noise, outputscale, lengthscale and constant mean are learned in every model.",
    ]
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    report = Report(args.out)  # rewritten after every row: a run cut short keeps what it measured
    report.add(*header)
    t0 = time.perf_counter()
    if not args.skip_accuracy:
        report.add("", "## Accuracy (small-data protocol of Appendix C.1)")
        plot_data = accuracy_tables(args, dtype, device, report)
        if args.out:
            png = Path(args.out).with_suffix(".png")
            plot(plot_data, png)
            report.add(f"\n![RMSE and NLL vs n]({png.name})")
    if not args.skip_timing:
        report.add("", "## Timing")
        timing_tables(args, dtype, device, report)
    report.add("", f"- total wall time: {time.perf_counter() - t0:.0f} s")
    report.close()


if __name__ == "__main__":
    main()
