"""Why GPyTorch's ``ExactGP`` and the same model over a :class:`gpsd.ChunkedKernel` reach
different marginal likelihoods with the same probe seeds: the preconditioner's pivots, and with
them the probe vectors, at GPyTorch's default training settings.

At one set of hyperparameters (ARD RBF, lengthscales 1, outputscale 1, noise 0.1) on ``--n``
training flights, for GPyTorch's dense kernel and for gpsd's operator, with and without
autograd: the first pivots of GPyTorch's pivoted-Cholesky preconditioner (rank 15), and the
estimates of :math:`\\mathbf y^\\top \\widehat{\\mathbf K}^{-1}\\mathbf y` and
:math:`\\log\\lvert\\widehat{\\mathbf K}\\rvert` that ``inv_quad_logdet`` returns after
``torch.manual_seed(0)``, beside the exact values by Cholesky.

Usage (from the repository root)::

    OMP_NUM_THREADS=2 python benchmarks/bench_probe_agreement.py --n 5000 \\
        --out benchmarks/results/probe_agreement_cpu.md
"""

from __future__ import annotations

import argparse
import platform

import gpytorch
import torch
from _timing import Report, cpu_name
from linear_operator.functions import pivoted_cholesky

import gpsd
from gpsd.data import load_dataset


def _kernel(d: int) -> gpytorch.kernels.Kernel:
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=d))
    kernel.base_kernel.lengthscale = 1.0
    kernel.outputscale = 1.0
    return kernel.to(torch.float64)


def _covariance(kernel: gpytorch.kernels.Kernel, x: torch.Tensor, noise: float):
    likelihood = gpytorch.likelihoods.GaussianLikelihood().to(torch.float64)
    likelihood.noise = noise
    prior = gpytorch.distributions.MultivariateNormal(torch.zeros_like(x[:, 0]), kernel(x))
    return likelihood(prior).lazy_covariance_matrix


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=5_000, help="training flights")
    parser.add_argument("--noise", type=float, default=0.1)
    parser.add_argument("--out", default=None, help="also write the Markdown report here")
    args = parser.parse_args()
    data = load_dataset("flights", n_train=args.n, n_test=100, seed=0, dtype=torch.float64)
    x, y = data.train_x, data.train_y
    report = Report(args.out)
    report.add(
        f"# GPyTorch's preconditioner and probes: dense ExactGP kernel against gpsd's operator, "
        f"N = {args.n:,} flights",
        "",
        f"{cpu_name()}, {torch.get_num_threads()} threads, float64, ARD RBF on 6 inputs at "
        f"lengthscales 1, outputscale 1, noise {args.noise}; GPyTorch's default settings "
        f"(`cg_tolerance` {gpytorch.settings.cg_tolerance.value()}, "
        f"{gpytorch.settings.num_trace_samples.value()} probes, preconditioner rank "
        f"{gpytorch.settings.max_preconditioner_size.value()}), `torch.manual_seed(0)` before "
        f"each estimate. torch {torch.__version__}, gpytorch {gpytorch.__version__}, gpsd "
        f"{gpsd.__version__}, Python {platform.python_version()}.",
        "",
        "| kernel | autograd | first pivots | y^T K^-1 y | log det K |",
        "|---|---|---|---:|---:|",
    )
    for name in ("dense", "gpsd.ChunkedKernel"):
        for grad in (False, True):
            kernel = _kernel(x.shape[-1])
            if name != "dense":
                kernel = gpsd.ChunkedKernel(kernel)
            with torch.set_grad_enabled(grad):
                k = kernel(x).evaluate_kernel()
                _, pivots = pivoted_cholesky(k, 15, return_pivots=True)
                torch.manual_seed(0)
                cov = _covariance(kernel, x, args.noise)
                inv_quad, logdet = cov.inv_quad_logdet(y.unsqueeze(-1), logdet=True)
            first = ", ".join(str(int(p)) for p in pivots[:5])
            report.add(
                f"| {name} | {'yes' if grad else 'no'} | {first}, … | {float(inv_quad.detach()):.4f} "
                f"| {float(logdet.detach()):.4f} |"
            )
    with torch.no_grad():
        dense = _kernel(x.shape[-1])(x).to_dense()
        dense.diagonal().add_(args.noise)
        chol = torch.linalg.cholesky(dense)
        alpha = torch.cholesky_solve(y.unsqueeze(-1), chol).squeeze(-1)
        exact = (float(y @ alpha), float(2 * chol.diagonal().log().sum()))
    report.add(f"| exact (Cholesky) | – | – | {exact[0]:.4f} | {exact[1]:.4f} |")
    report.close()


if __name__ == "__main__":
    main()
