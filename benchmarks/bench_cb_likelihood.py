"""Accuracy and speed of ContinuousBernoulliLikelihood's expectations against plain Gauss-Hermite.

``expected_log_prob`` (the variational ELBO's data term) and ``log_marginal``
(``PredictiveLogLikelihood``) of gpsd's likelihood against GPyTorch's own rule, as a user of
``_OneDimensionalLikelihood`` gets it: Gauss-Hermite quadrature (20 nodes) of the same stable
log-density, the log marginal as the log of the quadrature of :math:`p(y \\mid f)`.

Latents: :math:`f \\sim \\mathcal{N}(\\mu, s^2)` elementwise, targets :math:`y \\sim U[0, 1]`, in three
regimes: small variances :math:`s^2 \\in [0.01, 1]` (where both use Gauss-Hermite), large variances
:math:`s^2 \\in [3, 10^4]` (log-uniform; early SVGP training, or a prior with a large output scale)
and means :math:`\\mu = s z` with :math:`z \\sim 3 N(0, 1)`. Errors: max over a subsample of the
absolute error against mpmath at 25 digits (``tests/cb_reference.py``); times: forward and backward
(to the means and variances) over all N elements, median of repeats after a warm-up.

Usage::

    python benchmarks/bench_cb_likelihood.py --out benchmarks/results/cb_likelihood_cpu.md
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys

import gpytorch
import torch
from _timing import Report, cpu_name, cuda_missing, median_wall_cpu
from gpytorch.likelihoods.likelihood import _OneDimensionalLikelihood

from gpsd.likelihoods import ContinuousBernoulliLikelihood

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from cb_reference import cb_gaussian_expectations  # noqa: E402

REGIMES = {"small variance": (0.01, 1.0), "large variance": (3.0, 1e4)}


def latents(n: int, regime: str, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Targets, means and variances in float64 on the CPU."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = REGIMES[regime]
    if regime == "small variance":
        variance = lo + (hi - lo) * torch.rand(n, generator=g, dtype=torch.float64)
    else:
        log_var = math.log(lo) + (math.log(hi) - math.log(lo)) * torch.rand(
            n, generator=g, dtype=torch.float64
        )
        variance = log_var.exp()
    mean = 3.0 * torch.randn(n, generator=g, dtype=torch.float64) * variance.sqrt()
    y = torch.rand(n, generator=g, dtype=torch.float64)
    return y, mean, variance


def expectations(method: str, kind: str, y, mean, variance) -> torch.Tensor:
    # GPyTorch's quadrature nodes are a buffer: on the latents' device and in their dtype
    likelihood = ContinuousBernoulliLikelihood().to(device=mean.device, dtype=mean.dtype)
    dist = torch.distributions.Normal(mean, variance.sqrt())
    if method == "gpsd":
        return getattr(likelihood, kind)(y, dist)
    return getattr(_OneDimensionalLikelihood, kind)(likelihood, y, dist)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=10_000, help="latent elements timed")
    parser.add_argument("--check", type=int, default=24, help="elements checked with mpmath")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", help="also write the Markdown report here")
    parser.add_argument("--quick", action="store_true", help="N = 2000, 8 mpmath checks, 5 repeats")
    args = parser.parse_args()
    if args.quick:
        args.n, args.check, args.repeats = 2000, 8, 5
    device = torch.device(args.device)
    if cuda_missing(device):
        return
    report = Report(args.out)
    report.add(
        f"# Continuous Bernoulli expectations: gpsd against plain Gauss-Hermite ({device.type})",
        "",
        f"- command (in `benchmarks/`): `python {' '.join(sys.argv)}`",
        f"- machine: {cpu_name()}, {torch.get_num_threads()} threads, torch "
        f"{torch.__version__}, gpytorch {gpytorch.__version__}, Python "
        f"{platform.python_version()}"
        + (f", {torch.cuda.get_device_name(device)}" if device.type == "cuda" else ""),
        f"- N = {args.n} latents per regime for the times (forward + backward, median of "
        f"{args.repeats} after 2 warm-up calls; wall clock, and process CPU time over all "
        f"threads, which other processes on a shared machine do not inflate); max absolute "
        f"error over {args.check} of them against mpmath",
        "- Gauss-Hermite: GPyTorch's `_OneDimensionalLikelihood` rule with 20 nodes (the "
        "likelihood converted to the latents' dtype; GPyTorch computes its nodes in float32, "
        "hence its float64 errors near 2e-8), on the same stable log-density",
        "",
        "| regime | quantity | dtype | GH max err | gpsd max err | GH ms | gpsd ms | time ratio "
        "| GH CPU ms | gpsd CPU ms |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    )
    for regime in REGIMES:
        y64, mean64, var64 = latents(args.n, regime, seed=0)
        picks = torch.linspace(0, args.n - 1, args.check).long()
        refs = [
            cb_gaussian_expectations(float(y64[i]), float(mean64[i]), float(var64[i]))
            for i in picks.tolist()
        ]
        for kind in ("expected_log_prob", "log_marginal"):
            ref = torch.tensor([getattr(r, kind) for r in refs], dtype=torch.float64)
            for dtype in (torch.float32, torch.float64):
                y, mean, var = (t.to(device, dtype) for t in (y64, mean64, var64))
                errors, times, cpu = {}, {}, {}
                for method in ("gh", "gpsd"):
                    with torch.no_grad():
                        got = expectations(method, kind, y[picks], mean[picks], var[picks])
                    errors[method] = float((got.double().cpu() - ref).abs().max())

                    def step(method=method, kind=kind, y=y, mean=mean, var=var):
                        m = mean.clone().requires_grad_()
                        v = var.clone().requires_grad_()
                        out = expectations(method, kind, y, m, v).sum()
                        out.backward()
                        return out

                    times[method], cpu[method] = median_wall_cpu(
                        step, args.repeats, device, warmup=2
                    )
                report.add(
                    f"| {regime} | {kind} | {str(dtype).split('.')[-1]} | {errors['gh']:.1e} | "
                    f"{errors['gpsd']:.1e} | {1e3 * times['gh']:.1f} | "
                    f"{1e3 * times['gpsd']:.1f} | {times['gpsd'] / times['gh']:.2f} | "
                    f"{1e3 * cpu['gh']:.1f} | {1e3 * cpu['gpsd']:.1f} |"
                )
    report.close()


if __name__ == "__main__":
    main()
