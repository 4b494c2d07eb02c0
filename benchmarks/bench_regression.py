"""Timing of self-distillation for GP regression (Borup & Andersen, Appendix D.2, Fig. 15).

Prints Markdown tables; ``--out FILE`` also writes them with a header naming the machine.

1. Fig. 15 protocol: the time to fit T = 1..100 data-centric steps (means and variances at 1000 test
   points) relative to one scikit-learn ``GaussianProcessRegressor`` fit + predict with the same
   fixed kernel, for the naive loop (refit scikit-learn on the previous step's predictions), each
   gpsd backend (dense eigendecomposition, Cholesky chain, block Lanczos) and the
   distribution-centric closed form. Each gpsd result's relative error against the float64 naive
   loop is reported too.
2. Time and peak memory against N for 100 steps, next to one plain GPyTorch ``ExactGP``
   fit + predict. Each cell runs in a fresh process so that the peak resident memory (CPU) or
   ``torch.cuda.max_memory_allocated`` (CUDA) belongs to that computation alone.

Usage::

    python benchmarks/bench_regression.py                 # full run (about 10 minutes on 2 cores)
    python benchmarks/bench_regression.py --quick         # a smoke run
    python benchmarks/bench_regression.py --device cuda --dtype float32
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys

import gpytorch
import numpy as np
import torch
from _timing import cpu_name, cuda_missing, load_line, median_time, peak_rss_kib

from gpsd import DataCentricGPR, DistributionCentricGPR
from gpsd.data import load_dataset

LENGTHSCALE = {"synthetic1d": 1.0, "deliveries": 3.0}
SCALING_METHODS = [
    "gpytorch ExactGP (1 step)",
    "dense",
    "cholesky",
    "lanczos",
    "distribution-centric",
]


# ---------------------------------------------------------------------------------------- data
def make_data(name: str, n: int, m: int, seed: int = 0) -> tuple[np.ndarray, ...]:
    """``(x, y, test_x)`` as float64 arrays: a smooth 1-D problem or a subset of deliveries."""
    rng = np.random.default_rng(seed)
    if name == "synthetic1d":
        x = rng.uniform(0.0, 10.0, (n, 1))
        y = np.sin(x[:, 0]) * x[:, 0] / 5 + 0.3 * rng.standard_normal(n)
        test_x = rng.uniform(0.0, 10.0, (m, 1))
        return x, y, test_x
    split = load_dataset(name, n_train=n, n_test=m, seed=seed)
    return split.train_x.numpy(), split.train_y.numpy(), split.test_x.numpy()


# ---------------------------------------------------------------------------------------- methods
def sklearn_fit_predict(x, y, test_x, gamma, lengthscale):
    from sklearn.gaussian_process import GaussianProcessRegressor
    from sklearn.gaussian_process.kernels import RBF

    model = GaussianProcessRegressor(RBF(lengthscale), alpha=gamma, optimizer=None)
    model.fit(x, y)
    return model.predict(test_x, return_std=True)


def naive_loop(x, y, test_x, gammas, lengthscale):
    """Refit scikit-learn on the previous step's mean predictions, step by step."""
    from sklearn.gaussian_process import GaussianProcessRegressor
    from sklearn.gaussian_process.kernels import RBF

    means, variances, targets = [], [], y
    for g in gammas:
        model = GaussianProcessRegressor(RBF(lengthscale), alpha=g, optimizer=None)
        model.fit(x, targets)
        mean, std = model.predict(test_x, return_std=True)
        means.append(mean)
        variances.append(std**2)
        targets = model.predict(x)
    return np.stack(means), np.stack(variances)


def gpsd_kernel(lengthscale, dtype, device):
    kernel = gpytorch.kernels.RBFKernel().to(device=device, dtype=dtype)
    kernel.lengthscale = torch.tensor(lengthscale, dtype=dtype, device=device)
    return kernel


def gpsd_path(method, x, y, test_x, gammas, lengthscale, rank=None, kernel_cache_bytes=None):
    """All T steps' means and variances at test_x with one gpsd model."""
    kernel = gpsd_kernel(lengthscale, x.dtype, x.device)
    with torch.no_grad():
        if method == "distribution-centric":
            model = DistributionCentricGPR(x, y, kernel, noise=gammas, backend="dense")
        else:
            model = DataCentricGPR(
                x,
                y,
                kernel,
                noise=gammas,
                backend=method,
                rank=rank,
                rtol=1e-6,
                kernel_cache_bytes=kernel_cache_bytes,
            )
        return model.predict(test_x)


def gpytorch_exact(x, y, test_x, gamma, lengthscale):
    """One plain GPyTorch ExactGP with fixed hyperparameters: posterior mean and variance."""

    class GP(gpytorch.models.ExactGP):
        def __init__(self):
            likelihood = gpytorch.likelihoods.GaussianLikelihood().to(x)
            likelihood.noise = gamma
            super().__init__(x, y, likelihood)
            self.mean_module = gpytorch.means.ZeroMean()
            self.covar_module = gpsd_kernel(lengthscale, x.dtype, x.device)

        def forward(self, z):
            return gpytorch.distributions.MultivariateNormal(
                self.mean_module(z), self.covar_module(z)
            )

    model = GP().eval()
    with torch.no_grad(), gpytorch.settings.fast_pred_var(False):
        post = model(test_x)
        return post.mean, post.variance


def rel_err(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


# ---------------------------------------------------------------------------------------- tables
def fig15_table(args, device, dtype) -> str:
    data, n, m = args.data, args.n, args.m
    lengthscale = LENGTHSCALE[data]
    x, y, test_x = make_data(data, n, m)
    sk = median_time(
        lambda: sklearn_fit_predict(x, y, test_x, 0.1, lengthscale),
        args.repeats,
        torch.device("cpu"),
    )
    tx, ty, ttest = (torch.as_tensor(a, dtype=dtype, device=device) for a in (x, y, test_x))
    rows = [
        f"N = {n} training points, M = {m} test points, data `{data}`, RBF lengthscale "
        f"{lengthscale}, gamma_t = 0.1..1.0 spread over the T steps.",
        f"One scikit-learn fit + predict (mean and std): **{sk * 1e3:.1f} ms** (median of "
        f"{args.repeats}). Cells: time / that (ms in brackets); err = max relative error of means "
        "and variances against the naive loop.",
        "",
        "| T | naive loop (sklearn refits) | dense eigh | Cholesky chain | block Lanczos | "
        "distribution-centric | err dense | err Cholesky | err Lanczos |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for t in args.steps:
        gammas = np.linspace(0.1, 1.0, t) if t > 1 else np.array([0.1])
        g_t = torch.as_tensor(gammas, dtype=dtype, device=device)
        reps_naive = 1 if t >= 50 else args.repeats
        ref = None
        naive_time = float("nan")
        if t <= args.naive_max_steps:
            naive_time = median_time(
                lambda gammas=gammas: naive_loop(x, y, test_x, gammas, lengthscale),
                reps_naive,
                torch.device("cpu"),
                warmup=0,
            )
            ref = naive_loop(x, y, test_x, gammas, lengthscale)
        cells, errs = [], []
        for method in ("dense", "cholesky", "lanczos", "distribution-centric"):
            # a long Cholesky chain is slow: one run, warmed up by the shorter chains before it
            long_chain = method == "cholesky" and t >= 50
            reps = 1 if long_chain else args.repeats

            def run(method=method, g_t=g_t):
                return gpsd_path(method, tx, ty, ttest, g_t, lengthscale, rank=args.rank)

            cells.append(median_time(run, reps, device, warmup=0 if long_chain else 1))
            if method != "distribution-centric" and ref is not None:
                out = run()
                errs.append(
                    max(
                        rel_err(out.mean.cpu(), ref[0]),
                        rel_err(out.variance.cpu(), ref[1]),
                    )
                )
            elif method != "distribution-centric":
                errs.append(float("nan"))
        naive_cell = (
            "—" if np.isnan(naive_time) else f"{naive_time / sk:.2f} ({naive_time * 1e3:.0f})"
        )
        rows.append(
            f"| {t} | {naive_cell} | "
            + " | ".join(f"{c / sk:.2f} ({c * 1e3:.0f})" for c in cells)
            + " | "
            + " | ".join("—" if np.isnan(e) else f"{e:.1e}" for e in errs)
            + " |"
        )
    return "\n".join(rows)


def worker(spec: dict) -> dict:
    """One cell of the scaling table, in its own process."""
    device = torch.device(spec["device"])
    dtype = getattr(torch, spec["dtype"])
    torch.set_num_threads(spec["threads"])
    x, y, test_x = make_data(spec["data"], spec["n"], spec["m"])
    tx, ty, ttest = (torch.as_tensor(a, dtype=dtype, device=device) for a in (x, y, test_x))
    lengthscale = LENGTHSCALE[spec["data"]]
    gammas = torch.linspace(0.1, 1.0, spec["steps"], dtype=dtype, device=device)
    method = spec["method"]
    if method == "gpytorch ExactGP (1 step)":

        def run():
            return gpytorch_exact(tx, ty, ttest, 0.1, lengthscale)
    else:

        def run():
            return gpsd_path(
                method,
                tx,
                ty,
                ttest,
                gammas,
                lengthscale,
                rank=spec["rank"],
                kernel_cache_bytes=spec["kernel_cache_bytes"],
            )

    base_rss = peak_rss_kib()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    seconds = median_time(run, spec["repeats"], device)
    if device.type == "cuda":
        peak_mb = torch.cuda.max_memory_allocated(device) / 2**20
    else:
        peak_mb = (peak_rss_kib() - base_rss) / 1024
    return {"seconds": seconds, "peak_mb": peak_mb}


def scaling_table(args, device, dtype) -> str:
    methods = args.methods
    rows = [
        f"T = {args.scaling_steps} data-centric steps, M = {args.m} test points, data "
        f"`{args.data}`; time in seconds (median of {min(args.repeats, 3)}) and peak memory growth "
        "in MiB (CPU: resident set above the process's state after loading the data; CUDA: "
        f"max_memory_allocated). The Cholesky chain runs T = {args.scaling_steps} factorisations.",
        "",
        "| N | " + " | ".join(methods) + " |",
        "|---:|" + "---:|" * len(methods),
    ]
    for n in args.sizes:
        cells = []
        for method in methods:
            if method == "cholesky" and n > args.cholesky_max_n:
                cells.append("—")
                continue
            spec = {
                "device": str(device),
                "dtype": str(dtype).replace("torch.", ""),
                "threads": torch.get_num_threads(),
                "data": args.data,
                "n": n,
                "m": args.m,
                "steps": args.scaling_steps,
                "method": method,
                "rank": args.rank,
                "kernel_cache_bytes": args.kernel_cache_bytes,
                "repeats": min(args.repeats, 3),
            }
            proc = subprocess.run(
                [sys.executable, __file__, "--worker", json.dumps(spec)],
                capture_output=True,
                text=True,
                check=False,
            )
            if proc.returncode != 0:
                cells.append("failed")
                print(proc.stderr[-2000:], file=sys.stderr)
                continue
            out = json.loads(proc.stdout.strip().splitlines()[-1])
            cells.append(f"{out['seconds']:.3f} s / {out['peak_mb']:.0f} MiB")
        rows.append(f"| {n} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def header(args, device, dtype) -> str:
    import sklearn

    cpu = cpu_name()
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "none"
    return "\n".join(
        [
            "# Regression self-distillation: timings",
            "",
            f"- command: `python benchmarks/{' '.join(sys.argv[0:1]).split('/')[-1]} "
            f"{' '.join(sys.argv[1:])}`",
            f"- machine: {platform.system()} {cpu}, {torch.get_num_threads()} torch threads; "
            f"GPU: {gpu}",
            f"- device: {device}, dtype: {dtype} (gpsd factorisations in float64)",
            f"- torch {torch.__version__}, gpytorch {gpytorch.__version__}, scikit-learn "
            f"{sklearn.__version__}, numpy {np.__version__}, Python {platform.python_version()}",
            "",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float64", choices=["float32", "float64"])
    parser.add_argument("--data", default="synthetic1d", choices=sorted(LENGTHSCALE))
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--m", type=int, default=1000)
    parser.add_argument("--steps", type=int, nargs="+", default=[1, 2, 5, 10, 20, 50, 100])
    parser.add_argument("--naive-max-steps", type=int, default=100)
    parser.add_argument("--sizes", type=int, nargs="+", default=[250, 500, 1000, 2000, 4000, 5000])
    parser.add_argument("--scaling-steps", type=int, default=100)
    parser.add_argument(
        "--methods",
        nargs="+",
        default=SCALING_METHODS,
        choices=SCALING_METHODS + ["cg"],
        help="columns of the scaling table",
    )
    parser.add_argument("--cholesky-max-n", type=int, default=1000)
    parser.add_argument(
        "--rank", type=int, default=None, help="Lanczos rank (default: grown to meet rtol)"
    )
    parser.add_argument(
        "--kernel-cache-bytes",
        type=int,
        default=None,
        help="memory the matrix-free backends keep kernel rows in (default: half the free memory; "
        "0: evaluate K afresh at every product)",
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="small sizes, few repeats")
    parser.add_argument("--skip-scaling", action="store_true")
    parser.add_argument("--skip-fig15", action="store_true")
    parser.add_argument("--out", default=None, help="also write the tables to this file")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    if args.quick:
        args.n, args.m, args.steps, args.sizes = 400, 200, [1, 10, 100], [500]
        args.repeats, args.naive_max_steps = 2, 10
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if cuda_missing(device):
        return
    parts = [header(args, device, dtype)]
    if not args.skip_fig15:
        parts += ["## Fit time relative to one scikit-learn fit (Fig. 15)", ""]
        parts.append(fig15_table(args, device, dtype))
    print("\n".join(parts), flush=True)
    if not args.skip_scaling:
        scaling = ["", "## Time and memory against N", "", scaling_table(args, device, dtype)]
        print("\n".join(scaling), flush=True)
        parts += scaling
    parts.insert(0, load_line() + "\n")
    print("\n" + parts[0], flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write("\n".join(parts) + "\n")


if __name__ == "__main__":
    main()
