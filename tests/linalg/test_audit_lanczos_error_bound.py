"""KernelSpectrum.error_estimate against the true error of a truncated (Lanczos) spectrum.

The reference is a dense float64 ``torch.linalg.eigh`` of the same matrix; the complement norm
is set to its exact value (from the dense eigendecomposition of the projected matrix) so that
only the stated bound is tested, not the power iterations.
"""

import pytest
import torch

from gpsd.linalg import KernelSpectrum, SpectralFilter


def _geometric_kernel(n: int = 60) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    basis, _ = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
    kernel = basis @ torch.diag(0.5 ** torch.arange(n, dtype=torch.float64)) @ basis.T
    return 0.5 * (kernel + kernel.T)  # shape: (n, n)


@pytest.mark.parametrize(
    ("kind", "num_steps", "alpha"),
    [("weights", 3, 0.0), ("weights", 4, 0.0), ("targets", 3, 0.0), ("weights", 3, 0.5)],
)
def test_error_estimate_bounds_multi_step_filters(kind, num_steps, alpha):
    # Old estimate rho^(J+1) / (1 - rho) = 3.29e-7 at rho = 0.05, J = 4; the true relative
    # error of the three-step weights G_3 on the complement's leading eigenvector was 2.91e-6
    # (8.8 times the estimate; targets F_3: 1.73e-6). The Taylor remainder of G_t carries the
    # factor binom(J + 1, t - 1), up to binom(5, 2) = 10: the estimate is now 3.13e-6.
    kernel = _geometric_kernel()
    n = kernel.shape[-1]
    evals, evecs = torch.linalg.eigh(kernel)
    spectrum = KernelSpectrum.from_lanczos(
        kernel,
        rank=16,
        block_size=4,
        series_order=4,
        residual_tol=1e-10,
        generator=torch.Generator().manual_seed(1),
    )
    kept = spectrum.eigenvectors  # shape: (n, k), zero columns where unresolved
    projector = torch.eye(n, dtype=torch.float64) - kept @ kept.T
    comp_evals, comp_evecs = torch.linalg.eigh(projector @ kernel @ projector)
    epsilon = float(comp_evals[-1])
    spectrum.complement_norm = epsilon  # exact, so that only the bound itself is tested
    gamma = epsilon / 0.05
    rhs = comp_evecs[:, -1:]  # shape: (n, 1): the worst direction for the series
    schedule = torch.full((num_steps,), gamma, dtype=torch.float64)
    filt = getattr(SpectralFilter, f"data_centric_{kind}")(schedule, alpha=alpha)

    approx = spectrum.apply(filt, rhs)  # shape: (T, n, 1)
    exact = evecs @ (filt.values(evals).unsqueeze(-1) * (evecs.T @ rhs))
    scale = 1.0 if kind == "targets" else 1.0 / gamma
    error = float(torch.linalg.vector_norm(approx - exact, dim=-2).max()) / scale
    estimate = spectrum.error_estimate(gamma)
    assert error > 1e-7  # the series term dominates: far above rounding
    assert error <= estimate


def test_error_estimate_counts_the_spectral_norm_of_the_ritz_residuals():
    # 16 resolved Ritz pairs of an RBF kernel (lengthscale 1, 300 points on [0, 5]): the largest
    # column residual is 7.33e-10, the spectral norm ||K V - V D||_2 8.71e-10. Along the
    # residuals' leading left singular vector one step at gamma = 0.01 erred by 8.71e-8, 1.19
    # times the old estimate 7.33e-8 (column residual / gamma); the estimate is now 8.71e-8.
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(300, 1, generator=gen, dtype=torch.float64) * 5
    kernel = torch.exp(-0.5 * (x - x.T) ** 2)  # shape: (300, 300)
    evals, evecs = torch.linalg.eigh(kernel)
    spectrum = KernelSpectrum.from_lanczos(
        kernel, rank=16, series_order=4, generator=torch.Generator().manual_seed(1)
    )
    vecs = spectrum.eigenvectors[:, spectrum.resolved]
    residuals = kernel @ vecs - vecs * spectrum.eigenvalues[spectrum.resolved]
    rhs = torch.linalg.svd(residuals, full_matrices=False)[0][:, :1]  # shape: (300, 1)
    gamma = 0.01
    filt = SpectralFilter.data_centric_targets(torch.full((2,), gamma, dtype=torch.float64))
    approx = spectrum.apply(filt, rhs)  # shape: (2, 300, 1)
    exact = evecs @ (filt.values(evals).unsqueeze(-1) * (evecs.T @ rhs))
    error = float(torch.linalg.vector_norm(approx - exact, dim=-2).max())
    assert error > 1e-8  # the residual term dominates
    assert error <= 1.01 * spectrum.error_estimate(gamma)
