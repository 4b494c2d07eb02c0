"""Predictive variances of ``backend="cg"`` at small noise against a 40-digit reference.

At a small noise γ the predictive variance k** − cᵀ(K + γI)⁻¹c is a small difference of numbers
near k**, so the error of the quadratic form decides its relative accuracy. This script compares
the variances of ``DataCentricGPR`` (one step) with every backend against the same quantity in
mpmath at 40 digits, computed from the float64 kernel matrices by a Cholesky factorisation and
forward substitution: the largest relative error over the test points, per backend, ``rtol`` and γ.

Data: N inputs uniform on [0, 10], Matérn-3/2 kernel with lengthscale 1 (a slowly decaying
spectrum), 8 test points uniform on [0, 10]. CG is deflated by a Lanczos run of ``--rank`` < N
(a rank of N or more would leave CG one step). An entry is marked † where the model warned that
the solves leave the variances uncertain by more than 10 % (``|r|² / γ``), ‡ where CG also did
not reach ``rtol``.

Usage::

    python benchmarks/bench_cg_variance_accuracy.py --out benchmarks/results/cg_variance_accuracy_cpu.md
"""

from __future__ import annotations

import argparse
import platform
import sys
import warnings

import gpytorch
import mpmath
import torch
from _timing import cpu_name, write_report

from gpsd import DataCentricGPR


def reference_variances(K: torch.Tensor, cross: torch.Tensor, prior: torch.Tensor, gamma: float):
    """k** − ‖L⁻¹c‖² with L the Cholesky factor of K + γI, in mpmath (``mp.dps`` digits)."""
    n = K.shape[0]
    L = mpmath.cholesky(mpmath.matrix(K.tolist()) + mpmath.eye(n) * mpmath.mpf(gamma))
    out = []
    for c, k_ss in zip(cross.tolist(), prior.tolist(), strict=True):
        z = []
        for i in range(n):  # forward substitution
            z.append((c[i] - mpmath.fsum(L[i, j] * z[j] for j in range(i))) / L[i, i])
        out.append(float(mpmath.mpf(k_ss) - mpmath.fsum(v * v for v in z)))
    return torch.tensor(out, dtype=torch.float64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=150, help="training points")
    parser.add_argument("--rank", type=int, default=64, help="CG's deflation rank")
    parser.add_argument("--digits", type=int, default=40, help="mpmath precision")
    parser.add_argument("--out", help="also write the Markdown report here")
    parser.add_argument("--quick", action="store_true", help="N = 60, rank 32, 30 digits")
    args = parser.parse_args()
    if args.quick:
        args.n, args.rank, args.digits = 60, 32, 30
    mpmath.mp.dps = args.digits
    gen = torch.Generator().manual_seed(0)
    dtype = torch.float64
    x = 10 * torch.rand(args.n, 1, generator=gen, dtype=dtype)
    y = torch.sin(x[:, 0]) + 0.1 * torch.randn(args.n, generator=gen, dtype=dtype)
    test_x = 10 * torch.rand(8, 1, generator=gen, dtype=dtype)
    kernel = gpytorch.kernels.MaternKernel(nu=1.5).double()
    kernel.lengthscale = torch.tensor(1.0, dtype=dtype)
    with torch.no_grad():
        K = kernel(x).to_dense()
        cross = kernel(test_x, x).to_dense()
        prior = kernel(test_x, diag=True)
    settings = [("dense", None), ("cholesky", None)] + [("cg", r) for r in (1e-6, 1e-8, 1e-10)]
    lines = [
        "# Predictive variances at small noise against a 40-digit reference (cpu, float64)",
        "",
        f"- command (in `benchmarks/`): `python {' '.join(sys.argv)}`",
        f"- machine: {cpu_name()}, torch {torch.__version__}, gpytorch "
        f"{gpytorch.__version__}, mpmath {mpmath.__version__}, Python {platform.python_version()}",
        f"- N = {args.n} inputs on [0, 10], Matérn-3/2 (lengthscale 1), 8 test points; reference: "
        f"mpmath at {args.digits} digits from the same float64 kernel matrices; CG deflated by "
        f"a rank-{args.rank} Lanczos run",
        "- entries: the largest relative error of the 8 variances; † the model warned that the "
        "solves leave them uncertain by over 10 %, ‡ CG also warned that it did not reach rtol",
        "",
        "| γ | smallest variance | "
        + " | ".join(b if r is None else f"{b} rtol={r:g}" for b, r in settings)
        + " |",
        "|---:|---:|" + "---:|" * len(settings),
    ]
    for gamma in (1e-4, 1e-6, 1e-8):
        ref = reference_variances(K, cross, prior, gamma)
        row = [f"{gamma:.0e}", f"{float(ref.min()):.1e}"]
        for backend, rtol in settings:
            options = {} if rtol is None else {"rtol": rtol, "rank": args.rank}
            model = DataCentricGPR(
                x, y, kernel, noise=torch.tensor([gamma], dtype=dtype), backend=backend, **options
            )
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                variance = model.predict(test_x).variance[0].detach()
            messages = [str(w.message) for w in caught]
            marks = "†" if any("uncertain" in m for m in messages) else ""
            marks += "‡" if any("reached a relative residual" in m for m in messages) else ""
            row.append(f"{float(((variance - ref).abs() / ref).max()):.1e}{marks}")
        lines.append("| " + " | ".join(row) + " |")
    write_report("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
