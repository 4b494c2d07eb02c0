"""gcv() at noise levels where ``y - mu_t`` and ``N - tr S_t`` cancel to rounding: it used to
return NaN (N = 2, gamma = 1e-16), infinity (N = 5) or a wrong score (1.33 for 2.07 on the
Cholesky backend; 8 % off at lengthscale 1e-3, outputscale 1e6, gamma = 1e-9). Checked against
a 50-digit eigendecomposition."""

import gpytorch
import mpmath
import pytest
import torch

from gpsd import DataCentricGPR

DT = torch.float64


def _kernel(lengthscale=1.0, outputscale=1.0):
    k = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).to(DT)
    k.base_kernel.lengthscale = lengthscale
    k.outputscale = outputscale
    return k


def _gcv_reference(x, y, gamma, lengthscale=1.0, outputscale=1.0):
    """N ||(I - S) y||^2 / tr(I - S)^2 with I - S = gamma (K + gamma I)^{-1}, in 50 digits."""
    with mpmath.workdps(50):
        n = len(x)
        k = mpmath.matrix(n, n)
        for i in range(n):
            for j in range(n):
                r2 = (mpmath.mpf(float(x[i])) - mpmath.mpf(float(x[j]))) ** 2
                k[i, j] = mpmath.mpf(outputscale) * mpmath.exp(
                    -r2 / (2 * mpmath.mpf(lengthscale) ** 2)
                )
        evals, evecs = mpmath.eigsy(k)
        coords = evecs.T * mpmath.matrix([mpmath.mpf(float(v)) for v in y])
        g = mpmath.mpf(gamma)
        resid = [g / (evals[i] + g) for i in range(n)]
        rss = mpmath.fsum((resid[i] * coords[i]) ** 2 for i in range(n))
        return float(n * rss / mpmath.fsum(resid) ** 2)


@pytest.mark.parametrize("backend", ["dense", "cholesky"])
@pytest.mark.parametrize("n, gamma", [(1, 1e-17), (2, 1e-16), (5, 1e-16), (20, 1e-13)])
def test_gcv_at_tiny_noise(backend, n, gamma):
    x = torch.linspace(0, 10, n, dtype=DT)
    y = torch.linspace(1, 2, n, dtype=DT)
    with torch.no_grad():
        got = DataCentricGPR(x, y, _kernel(), noise=[gamma], backend=backend).gcv()
    expected = torch.tensor([_gcv_reference(x, y, gamma)], dtype=DT)
    torch.testing.assert_close(got, expected, rtol=1e-8, atol=0)


def test_gcv_at_a_short_lengthscale_and_large_outputscale():
    x = torch.linspace(0, 10, 20, dtype=DT)
    y = torch.sin(x)
    with torch.no_grad():
        got = DataCentricGPR(x, y, _kernel(1e-3, 1e6), noise=[1e-9]).gcv()
    expected = torch.tensor([_gcv_reference(x, y, 1e-9, 1e-3, 1e6)], dtype=DT)
    torch.testing.assert_close(got, expected, rtol=1e-8, atol=0)


def _chain_gcv_reference(x, y, gammas, alpha):
    """Every step's score of an alpha-mixed chain, per eigenvalue in 50 digits: F_0 = 1,
    S_t = d F_{t-1} / (d + g_t), F_t = alpha + (1 - alpha) S_t, residual 1 - S_t taken
    directly (50 digits hold its cancellation)."""
    with mpmath.workdps(50):
        n = len(x)
        k = mpmath.matrix(n, n)
        for i in range(n):
            for j in range(n):
                k[i, j] = mpmath.exp(
                    -((mpmath.mpf(float(x[i])) - mpmath.mpf(float(x[j]))) ** 2) / 2
                )
        evals, evecs = mpmath.eigsy(k)
        coords = evecs.T * mpmath.matrix([mpmath.mpf(float(v)) for v in y])
        f = [mpmath.mpf(1)] * n
        alpha = mpmath.mpf(alpha)  # 1 - alpha in 50 digits too: a float 0.7 is 1e-17 off
        scores = []
        for g in gammas:
            g = mpmath.mpf(float(g))
            s = [evals[i] * f[i] / (evals[i] + g) for i in range(n)]
            resid = [1 - s[i] for i in range(n)]
            rss = mpmath.fsum((resid[i] * coords[i]) ** 2 for i in range(n))
            scores.append(float(n * rss / mpmath.fsum(resid) ** 2))
            f = [alpha + (1 - alpha) * s[i] for i in range(n)]
        return scores


@pytest.mark.parametrize("backend", ["dense", "cholesky"])
def test_an_alpha_mixed_chain_at_tiny_noise(backend):
    x = torch.linspace(0, 6, 8, dtype=DT)
    y = torch.cos(x)
    gammas = torch.tensor([1e-15, 3e-16, 1e-14], dtype=DT)
    with torch.no_grad():
        got = DataCentricGPR(x, y, _kernel(), noise=gammas, alpha=0.3, backend=backend).gcv()
    expected = torch.tensor(_chain_gcv_reference(x, y, gammas, 0.3), dtype=DT)
    torch.testing.assert_close(got, expected, rtol=1e-7, atol=0)


def test_a_truncated_lanczos_spectrum_scores_as_the_dense_one():
    # the unresolved part of the spectrum enters through the residual filter's power series
    gen = torch.Generator().manual_seed(1)
    x = 10 * torch.rand(300, generator=gen, dtype=DT)
    y = torch.sin(x) + 0.1 * torch.randn(300, generator=gen, dtype=DT)
    gammas = torch.tensor([0.1, 0.3, 0.3], dtype=DT)
    with torch.no_grad():
        dense = DataCentricGPR(x, y, _kernel(), noise=gammas, alpha=0.2, backend="dense").gcv()
        model = DataCentricGPR(x, y, _kernel(), noise=gammas, alpha=0.2, backend="lanczos", rank=64)
        got = model.gcv()
    assert model._state()["engine"].is_truncated
    torch.testing.assert_close(got, dense, rtol=1e-6, atol=0)
