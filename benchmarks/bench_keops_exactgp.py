"""gpsd's matrix-free Lanczos against GPyTorch's KeOps ExactGP posterior at large N.

The baseline a GPyTorch user reaches for once the kernel matrix no longer fits: an ``ExactGP``
with ``ScaleKernel(gpytorch.kernels.keops.RBFKernel())`` (every product a KeOps reduction,
nothing formed), predicting in eval mode with GPyTorch's default settings (CG solves, LOVE for
the variances through ``fast_pred_var``). It gives the posterior for one noise level. gpsd's
``DataCentricGPR(backend="lanczos")`` gives all ``--steps`` steps of self-distillation (noise
schedule linspace(0.1, 1, T)), with step 1 the same posterior as GPyTorch's at noise 0.1.

For each N: the wall time and peak device memory of GPyTorch's posterior (mean and variance at
``--m`` test points; caches cleared first), of gpsd's fit + prediction of all steps, and the
largest relative differences of GPyTorch's means and variances from gpsd's step 1 (gpsd's
Lanczos path agrees with deflated CG to 1e-9 or better, ``gpu_million_h200.md``; what the
column shows is GPyTorch's CG and LOVE tolerances). Problem: inputs uniform on [0, 10]^2,
targets sin(x1) + sin(x2) + noise, RBF lengthscale 1, float32 data (GPyTorch computes in
float32; gpsd factorises in float64).

Needs pykeops (``pip install "gpsd[keops]"``); without it the script says so and stops.

Usage::

    python benchmarks/bench_keops_exactgp.py --device cuda --n 65536 262144 \\
        --out benchmarks/results/keops_exactgp_cuda.md
    python benchmarks/bench_keops_exactgp.py --device cpu --n 1024 --m 200   # a smoke run
    # at N = 10^6, against gpsd's step 1 saved by bench_million.py (no second gpsd fit)
    python benchmarks/bench_keops_exactgp.py --device cuda --n 1000000 \\
        --reference million_step_one.pt

With ``--reference PATH`` (written by ``bench_million.py --save-step-one PATH`` on the same
problem and test points), the sizes it holds take gpsd's step 1, time and peak from it instead
of fitting gpsd again.
"""

from __future__ import annotations

import argparse
import importlib.util
import platform
import time

import gpytorch
import torch
from _problems import rbf_kernel, uniform_square_problem
from _timing import Report, cpu_name, cuda_missing, peak_gib, reset_peak, sync

import gpsd
from gpsd import DataCentricGPR


class KeOpsExactGP(gpytorch.models.ExactGP):
    """A zero-mean exact GP with a scaled KeOps RBF kernel."""

    def __init__(self, x, y, likelihood, lengthscale: float) -> None:
        super().__init__(x, y, likelihood)
        self.mean_module = gpytorch.means.ZeroMean()
        self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.keops.RBFKernel())
        self.covar_module.base_kernel.lengthscale = lengthscale
        self.covar_module.outputscale = 1.0

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def gpytorch_posterior(x, y, test_x, noise: float, lengthscale: float, device):
    """Seconds, peak GiB, mean and variance of GPyTorch's KeOps ExactGP posterior."""
    likelihood = gpytorch.likelihoods.GaussianLikelihood().to(device, x.dtype)
    likelihood.noise = noise
    model = KeOpsExactGP(x, y, likelihood, lengthscale).to(device, x.dtype)
    model.eval()
    likelihood.eval()
    torch.manual_seed(0)  # LOVE's Lanczos starts from a random vector
    reset_peak(device)
    sync(device)
    start = time.perf_counter()
    with torch.no_grad(), gpytorch.settings.fast_pred_var():
        posterior = model(test_x)
        mean, variance = posterior.mean, posterior.variance
        sync(device)
    seconds = time.perf_counter() - start
    return seconds, peak_gib(device), mean, variance


def gpsd_steps(x, y, test_x, steps: int, lengthscale: float, device):
    """Seconds, peak GiB and prediction of gpsd's Lanczos fit and prediction of every step."""
    kernel = rbf_kernel(lengthscale, device, x.dtype)
    noise = torch.linspace(0.1, 1.0, steps, dtype=x.dtype, device=device)
    reset_peak(device)
    sync(device)
    start = time.perf_counter()
    with torch.no_grad():
        model = DataCentricGPR(x, y, kernel, noise=noise, backend="lanczos", rtol=1e-6).fit()
        prediction = model.predict(test_x)
        sync(device)
    seconds = time.perf_counter() - start
    return seconds, peak_gib(device), prediction


def _reference(args) -> dict:
    """gpsd's step 1 by N from ``--reference`` (empty without it), checked to match this run's
    test points, step count and data type."""
    if args.reference is None:
        return {}
    reference = torch.load(args.reference)
    for n, saved in reference.items():
        if (saved["m"], saved["steps"], saved["dtype"]) != (args.m, args.steps, "float32"):
            raise ValueError(
                f"--reference: N = {n} was saved with m={saved['m']}, steps={saved['steps']}, "
                f"dtype={saved['dtype']}; this run needs m={args.m}, steps={args.steps}, "
                "dtype=float32"
            )
    return reference


def _reference_lines(args, reference: dict) -> list[str]:
    """The header line saying which sizes took gpsd's columns from ``--reference``."""
    if not reference:
        return []
    sizes = ", ".join(f"{n:,}" for n in sorted(reference))
    return [
        f"- gpsd's columns at N = {sizes}: from `bench_million.py --save-step-one` "
        f"(`--reference {args.reference}`), its fit and prediction of all steps in one call"
    ]


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).abs().max() / b.abs().max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, nargs="+", default=[65_536, 262_144])
    parser.add_argument("--m", type=int, default=10_000, help="test points")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--reference",
        default=None,
        metavar="PATH",
        help="gpsd's step 1 by N, from bench_million.py --save-step-one (same --m and --steps)",
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    if cuda_missing(device):
        return
    if importlib.util.find_spec("pykeops") is None:
        print('bench_keops_exactgp.py: pykeops is not installed (pip install "gpsd[keops]")')
        return
    import pykeops

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    reference = _reference(args)
    report = Report(args.out)
    sizes = " ".join(str(n) for n in args.n)
    report.add(
        "# gpsd's Lanczos (all steps) against GPyTorch's KeOps ExactGP posterior (one step)",
        "",
        f"- device: {name}; torch {torch.__version__}, gpytorch {gpytorch.__version__}, "
        f"pykeops {pykeops.__version__}, gpsd {gpsd.__version__}, Python "
        f"{platform.python_version()}",
        f"- command: `python benchmarks/bench_keops_exactgp.py --device {args.device} --n "
        f"{sizes} --m {args.m} --steps {args.steps}`",
        f"- float32 data, {args.m} test points, RBF lengthscale 1; GPyTorch: noise 0.1, eval "
        'mode, `fast_pred_var`, default CG settings; gpsd: `backend="lanczos"`, '
        f"`rtol=1e-6`, {args.steps} steps; one call each, the first (KeOps compiles its "
        "formulas there) after an untimed call at N = min(smallest N, 4096)",
        *_reference_lines(args, reference),
        "",
        "| N | GPyTorch KeOps (s) | its peak (GiB) | gpsd, all steps (s) | its peak (GiB) "
        "| GPyTorch − gpsd step 1: means | variances |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    )
    # KeOps compiles its formulas here; they depend on the dimension and dtype, not on N.
    warm_n = min(min(args.n), 4096)
    warm_x, warm_y, warm_test = uniform_square_problem(warm_n, args.m, device, torch.float32)
    gpytorch_posterior(warm_x, warm_y, warm_test, 0.1, 1.0, device)
    for n in args.n:
        x, y, test_x = uniform_square_problem(n, args.m, device, torch.float32)
        try:
            theirs = gpytorch_posterior(x, y, test_x, 0.1, 1.0, device)
        except torch.cuda.OutOfMemoryError:
            theirs = None
        if n in reference:
            saved = reference[n]
            ours = saved["seconds"], saved["peak_gib"]
            step_one = saved["mean"], saved["variance"]
        else:
            ours = gpsd_steps(x, y, test_x, args.steps, 1.0, device)
            step_one = ours[2].mean[..., 0, :], ours[2].variance[..., 0, :]
        if theirs is None:
            cells = "out of memory | — |", "— | — |"
        else:
            cells = (
                f"{theirs[0]:.2f} | {theirs[1]:.1f} |",
                f"{_relative(theirs[2], step_one[0]):.1e} | "
                f"{_relative(theirs[3], step_one[1]):.1e} |",
            )
        report.add(f"| {n:,} | {cells[0]} {ours[0]:.2f} | {ours[1]:.1f} | {cells[1]}")
        del theirs, ours, step_one
    report.close()


if __name__ == "__main__":
    main()
