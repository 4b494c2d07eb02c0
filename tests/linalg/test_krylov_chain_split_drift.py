"""The one-run Krylov chain of ShiftedCG splits the resolved Ritz pairs off exactly and runs
Lanczos on the rest; rounding lets the Lanczos basis drift into the span of those pairs, K
multiplies the drift by their (the largest) eigenvalues, and a small shift makes the solution
large. The chain's first step (a solve with the smallest shift) had a true relative residual of
1.5e-7 at tol = 1e-8 (Matérn-1/2, 1000 points, shifts 1e-4 to 10) while its estimate said 1e-10;
the complement part is now projected off the split-off pairs. Checked by true residuals."""

import gpytorch
import torch

from gpsd.linalg import KernelSpectrum, ShiftedCG, SpectralFilter

DT = torch.float64


def test_the_chain_solves_its_first_step_to_tol():
    gen = torch.Generator().manual_seed(0)
    x = 10 * torch.rand(800, 1, generator=gen, dtype=DT)
    kernel = gpytorch.kernels.MaternKernel(nu=0.5).to(DT)
    k = kernel(x).to_dense().detach()
    rhs = torch.sin(x) + 0.1 * torch.randn(800, 1, generator=gen, dtype=DT)
    gamma = torch.logspace(-4, 1, 10, dtype=DT)
    tol = 1e-8
    spectrum = KernelSpectrum.from_lanczos(
        k, rank=256, residual_tol=0.1 * tol * 1e-4, generator=torch.Generator().manual_seed(0)
    )
    cg = ShiftedCG.from_spectrum(k, spectrum, tol=tol)
    assert int(cg.resolved.sum()) > 0  # pairs are split off
    weights = cg.krylov_apply(SpectralFilter.data_centric_weights(gamma), rhs)
    # step 1 weights solve (K + gamma_1 I) w = y
    residual = (k + gamma[0] * torch.eye(800, dtype=DT)) @ weights[0] - rhs
    assert float(residual.norm() / rhs.norm()) <= tol
    # every step against dense solves of the chain
    eye = torch.eye(800, dtype=DT)
    targets = rhs
    for t, g in enumerate(gamma):
        expected = torch.linalg.solve(k + g * eye, targets)
        error = float((weights[t] - expected).norm() / expected.norm())
        assert error < 1e-6, (t, error)
        targets = k @ expected
