"""The linear algebra that 100 noise levels need on a slowly decaying spectrum, piece by piece.

A floor under every dense route to all T = 100 data-centric steps' variances at M = 1,000 test
points (N = 2,000, the settings of ``bench_hard_spectrum_vs_sklearn.py``), set against one
scikit-learn ``GaussianProcessRegressor`` fit + predict in the same process. Each piece is timed
alone (median of ``--repeats`` after a warm-up) and a route's floor is the sum of its pieces: it
leaves out the kernel matrices, input checks, the means and every Python step between, so a
route cannot run faster than its floor. With :math:`\\mathbf K = \\mathbf Q \\mathbf T
\\mathbf Q^\\top` (``sytrd``), :math:`\\mathbf T = \\mathbf Z \\boldsymbol\\Theta \\mathbf Z^\\top`
(``stevd``) and :math:`\\mathbf B = \\mathbf Q^\\top \\mathbf K_{X*}`, the variance of step
:math:`t` at test point :math:`j` is :math:`k_{jj} - \\mathbf b_j^\\top (\\mathbf T + \\gamma_t
\\mathbf I)^{-1} \\mathbf b_j`. The routes:

- ``eigenvectors formed``: V = QZ (``ormqr`` on N columns), then VᵀK_X*, then one matrix
  product applies the T filters (gpsd's dense backend);
- ``eigenvectors as factors``: Qᵀ applied to the M test columns, then Zᵀ;
- ``shifted tridiagonal solves``: no ``stevd``; for every shift an LDLᵀ factor of T + γI and
  one forward substitution through B, vectorised over the shifts and the test columns (and, for
  comparison, LAPACK's ``gtsv`` one shift at a time, timed once);
- ``full eigh``: ``torch.linalg.eigh`` (MKL's divide and conquer), then VᵀK_X*;
- ``one Cholesky per step``: T times a Cholesky factor of K + γI and a triangular solve with
  K_X* (one step timed, times T).

Every route's variances are checked against ``torch.linalg.eigh``'s. One more piece times the
second stage of a two-stage reduction alone: a random symmetric band matrix of width 32 to its
eigenvalues (``sbevd`` without vectors), the cost a two-stage reduction adds to its first,
matrix-product stage.

Usage::

    python benchmarks/bench_hard_spectrum_floor.py --out benchmarks/results/hard_spectrum_floor_cpu.md
"""

from __future__ import annotations

import argparse
import platform
import sys

import gpytorch
import numpy as np
import scipy
import sklearn
import torch
from _timing import Report, cpu_name, load_line
from bench_hard_spectrum_vs_sklearn import M, N, T, kernel, problem, sklearn_run, timed
from scipy.linalg import get_lapack_funcs

SETTINGS = ("3d", "48d", "deliveries")
_BANDWIDTH = 32  # of the band matrix a two-stage reduction would leave


def shifted_forward_solves(
    diag: torch.Tensor, offdiag: torch.Tensor, noise: torch.Tensor, rhs: torch.Tensor
) -> torch.Tensor:
    """``bⱼᵀ (T + γₜ I)⁻¹ bⱼ`` for every shift γₜ (rows) and column bⱼ of ``rhs`` (columns):
    T + γI = L D Lᵀ with unit lower bidiagonal L, so the quadratic form is
    Σᵢ xᵢ² / dᵢ with x = L⁻¹ b, one forward substitution."""
    n, m = rhs.shape
    pivots = torch.empty(n, noise.numel(), dtype=rhs.dtype)  # (N, T)
    multipliers = torch.empty(n - 1, noise.numel(), dtype=rhs.dtype)  # (N-1, T)
    pivots[0] = diag[0] + noise
    for i in range(1, n):
        multipliers[i - 1] = offdiag[i - 1] / pivots[i - 1]
        pivots[i] = diag[i] + noise - multipliers[i - 1] * offdiag[i - 1]
    x = rhs[0].expand(noise.numel(), m).clone()  # (T, M)
    quad = x * x / pivots[0, :, None]
    for i in range(1, n):
        x = rhs[i] - multipliers[i - 1, :, None] * x
        quad.addcmul_(x, x / pivots[i, :, None])
    return quad


def measure(name: str, repeats: int) -> tuple[float, dict[str, float], dict[str, float]]:
    """scikit-learn's time, the pieces' times and each route's error against ``eigh``."""
    x, _, test_x, lengthscale = problem(name)
    noise = torch.linspace(0.1, 1.0, T, dtype=torch.float64)
    with torch.no_grad():
        k = kernel(lengthscale)
        train = k(x).to_dense()  # (N, N)
        cross = k(x, test_x).to_dense()  # (N, M)
    sk, _ = timed(lambda: sklearn_run(name), repeats)

    host = train.numpy()
    sytrd, sytrd_lwork, stevd = get_lapack_funcs(("sytrd", "sytrd_lwork", "stevd"), (host,))
    lwork = int(sytrd_lwork(N, lower=1)[0])
    pieces: dict[str, float] = {}
    pieces["sytrd"], (packed, diag, offdiag, tau, _) = timed(
        lambda: sytrd(host.T, lower=1, lwork=lwork), repeats
    )
    pieces["stevd"], (theta, z, _) = timed(lambda: stevd(diag, offdiag, compute_v=1), repeats)
    reflectors = torch.from_numpy(np.ascontiguousarray(packed[1:, :-1]))
    tau = torch.from_numpy(tau)
    theta, z = torch.from_numpy(theta), torch.from_numpy(z)

    def apply_q(columns: torch.Tensor, transpose: bool) -> torch.Tensor:
        tail = torch.ormqr(reflectors, tau, columns[1:], left=True, transpose=transpose)
        return torch.cat([columns[:1], tail])

    pieces["form V = QZ"], v = timed(lambda: apply_q(z, False), repeats)
    pieces["Vᵀ K_X*"], _ = timed(lambda: v.T @ cross, repeats)
    pieces["Qᵀ K_X*"], b = timed(lambda: apply_q(cross, True), repeats)
    pieces["Zᵀ (Qᵀ K_X*)"], zb = timed(lambda: z.T @ b, repeats)
    pieces["T filters"], _ = timed(lambda: (1 / (theta[:, None] + noise)).T @ (zb * zb), repeats)
    pieces["T shifted solves"], solved = timed(
        lambda: shifted_forward_solves(torch.from_numpy(diag), torch.from_numpy(offdiag), noise, b),
        repeats,
    )
    gtsv = get_lapack_funcs("gtsv", (host,))
    rhs = b.numpy()

    def lapack_solves() -> torch.Tensor:
        quad = np.empty((T, M))
        for t, gamma in enumerate(noise.tolist()):
            solved = gtsv(offdiag, diag + gamma, offdiag, rhs)[3]
            quad[t] = np.einsum("ij,ij->j", rhs, solved)
        return torch.from_numpy(quad)

    pieces["T shifted solves (LAPACK gtsv)"], lapack_quad = timed(lapack_solves, 1)
    band = np.random.default_rng(0).standard_normal((_BANDWIDTH + 1, N))
    sbevd = get_lapack_funcs("sbevd", (band,))
    pieces[f"band of width {_BANDWIDTH} to eigenvalues (sbevd)"], _ = timed(
        lambda: sbevd(band, compute_v=0, lower=1), repeats
    )
    pieces["torch.linalg.eigh"], (lam, u) = timed(lambda: torch.linalg.eigh(train), repeats)
    shifted = train + noise[0] * torch.eye(N, dtype=torch.float64)

    def one_step() -> torch.Tensor:
        factor = torch.linalg.cholesky(shifted)
        half = torch.linalg.solve_triangular(factor, cross, upper=False)
        return (half * half).sum(0)

    pieces["one Cholesky + solve"], chol_quad = timed(one_step, repeats)

    projected = u.T @ cross
    reference = (1 / (lam[:, None] + noise)).T @ (projected * projected)  # (T, M)

    def error(quad: torch.Tensor, ref: torch.Tensor = reference) -> float:
        return float((quad - ref).abs().max() / ref.abs().max())

    errors = {
        "eigenvectors formed": error((1 / (theta[:, None] + noise)).T @ (v.T @ cross) ** 2),
        "eigenvectors as factors": error((1 / (theta[:, None] + noise)).T @ (zb * zb)),
        "shifted tridiagonal solves": error(solved),
        "shifted tridiagonal solves (LAPACK gtsv)": error(lapack_quad),
        "full eigh": 0.0,
        "one Cholesky per step": error(chol_quad[None], reference[:1]),
    }
    return sk, pieces, errors


ROUTES = {
    "eigenvectors formed": ("sytrd", "stevd", "form V = QZ", "Vᵀ K_X*", "T filters"),
    "eigenvectors as factors": ("sytrd", "stevd", "Qᵀ K_X*", "Zᵀ (Qᵀ K_X*)", "T filters"),
    "shifted tridiagonal solves": ("sytrd", "Qᵀ K_X*", "T shifted solves"),
    "shifted tridiagonal solves (LAPACK gtsv)": (
        "sytrd",
        "Qᵀ K_X*",
        "T shifted solves (LAPACK gtsv)",
    ),
    "full eigh": ("torch.linalg.eigh", "Vᵀ K_X*", "T filters"),
    "one Cholesky per step": ("one Cholesky + solve",) * T,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=SETTINGS)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    report = Report(args.out)
    report.add(
        "# The linear algebra under 100 noise levels on slowly decaying spectra",
        "",
        f"- machine: {cpu_name()}, {torch.get_num_threads()} torch threads; device: cpu; "
        "dtype: float64",
        f"- torch {torch.__version__}, gpytorch {gpytorch.__version__}, scipy "
        f"{scipy.__version__}, scikit-learn {sklearn.__version__}, numpy {np.__version__}, "
        f"Python {platform.python_version()}",
        f"- command: `python benchmarks/bench_hard_spectrum_floor.py {' '.join(sys.argv[1:])}`",
        f"- N = {N}, M = {M} test points, T = {T} noise levels linspace(0.1, 1, {T}); each "
        f"piece alone, median of {args.repeats} after a warm-up; a route's floor is the sum "
        "of its pieces (no kernel matrices, checks, means or Python between them)",
        "",
    )
    for name in args.settings:
        sk, pieces, errors = measure(name, args.repeats)
        report.add(
            f"## {name}",
            "",
            f"scikit-learn fit + predict: {sk:.3f} s; twice that: {2 * sk:.3f} s",
            "",
            "| piece | time (s) |",
            "|---|---:|",
            *(f"| {piece} | {seconds:.3f} |" for piece, seconds in pieces.items()),
            "",
            "| route | floor (s) | floor × scikit-learn | rel. error of variances vs eigh |",
            "|---|---:|---:|---:|",
        )
        for route, names in ROUTES.items():
            floor = sum(pieces[p] for p in names)
            report.add(f"| {route} | {floor:.3f} | {floor / sk:.2f} | {errors[route]:.1e} |")
        report.add("")
    report.add(load_line())
    report.close()


if __name__ == "__main__":
    main()
