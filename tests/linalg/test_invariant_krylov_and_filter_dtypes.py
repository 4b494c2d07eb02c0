"""Block Lanczos on kernels of low rank, and filters whose schedule has another dtype than the
backend, against dense float64 computations."""

import warnings

import pytest
import torch
from gpr_reference import rbf_kernel

from gpsd import DataCentricGPR
from gpsd.linalg import KernelSpectrum, ShiftedCG, ShiftedCholesky, SpectralFilter

DT = torch.float64


def _repeated_inputs(distinct=20, copies=15, seed=0):
    """``distinct`` points repeated ``copies`` times: an RBF kernel of rank ``distinct``."""
    gen = torch.Generator().manual_seed(seed)
    return (10 * torch.rand(distinct, 1, generator=gen, dtype=DT)).repeat(copies, 1)


def _rbf(x, lengthscale=1.0):
    return torch.exp(-0.5 * (x - x.mT).square() / lengthscale**2)


def test_lanczos_basis_stays_orthonormal_where_the_krylov_space_is_invariant():
    # rank 20, a basis of 64: once the Krylov space is exhausted the new block is rounding noise,
    # whose QR factor is not orthogonal to the basis (Ritz vectors 1.7 from orthonormal, solves
    # off by a factor of 1e12)
    k = _rbf(_repeated_inputs())
    gen = torch.Generator().manual_seed(1)
    spectrum = KernelSpectrum.from_lanczos(k, rank=64, block_size=8, generator=gen)
    v = spectrum.ritz_vectors
    gram = v.mT @ v
    assert float((gram - torch.eye(gram.shape[-1], dtype=DT)).abs().max()) < 1e-12
    exact = torch.linalg.eigvalsh(k).flip(-1)
    resolved = int(spectrum.resolved.sum())
    assert resolved >= 20
    assert float((spectrum.eigenvalues[:resolved] - exact[:resolved]).abs().max()) < 1e-11
    rhs = torch.randn(k.shape[-1], 2, generator=gen, dtype=DT)
    got = spectrum.apply(SpectralFilter.resolvent(torch.tensor([0.1], dtype=DT)), rhs)[0]
    expected = torch.linalg.solve(k + 0.1 * torch.eye(k.shape[-1], dtype=DT), rhs)
    assert float((got - expected).norm() / expected.norm()) < 1e-11


@pytest.mark.parametrize("backend,rank", [("lanczos", 64), ("lanczos", None), ("cg", 64)])
def test_repeated_inputs_predict_as_the_dense_backend_does(backend, rank):
    # at rank 64 Lanczos raised a divergent-series error, and CG deflated with a broken basis
    # stalled at a relative residual of 0.01 after 1000 iterations
    x = _repeated_inputs(25, 12)
    gen = torch.Generator().manual_seed(2)
    y = torch.sin(x[:, 0]) + 0.1 * torch.randn(x.shape[0], generator=gen, dtype=DT)
    test_x = torch.linspace(0, 10, 9, dtype=DT).unsqueeze(-1)
    gammas = [0.1, 0.2]
    with torch.no_grad():
        expected = DataCentricGPR(x, y, rbf_kernel(), noise=gammas, backend="dense").predict(test_x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = DataCentricGPR(x, y, rbf_kernel(), noise=gammas, backend=backend, rank=rank).predict(
            test_x
        )
        mean, variance = got.mean.detach(), got.variance.detach()
    assert float((mean - expected.mean).norm() / expected.mean.norm()) < 1e-9
    assert float((variance - expected.variance).abs().max() / expected.variance.max()) < 1e-8


def _explicit_targets(k, gammas, rhs):
    """``F_t(K) rhs`` by dense float64 solves, ``F_t = K (K + g_t I)^-1 F_{t-1}``."""
    eye = torch.eye(k.shape[-1], dtype=DT)
    out, f = [], rhs
    for g in gammas.tolist():
        f = k @ torch.linalg.solve(k + g * eye, f)
        out.append(f)
    return torch.stack(out)


def _engines(k, dtype):
    gen = torch.Generator().manual_seed(3)
    residual_tol = 1e-8 if dtype == DT else 1e-4  # float32 residuals stall near 1e-6
    spectrum = KernelSpectrum.from_lanczos(
        k.to(dtype), rank=96, residual_tol=residual_tol, generator=gen
    )
    spectrum.check_accuracy(0.3, 1e-6 if dtype == DT else 1e-3)
    return {
        "dense": KernelSpectrum.from_dense(k, dtype=dtype),
        "lanczos": spectrum,
        "cholesky": ShiftedCholesky(k, dtype=dtype),
        "cg": ShiftedCG.from_spectrum(k.to(dtype), spectrum, tol=1e-12 if dtype == DT else 1e-6),
    }


@pytest.mark.parametrize("engine_name", ["dense", "lanczos", "cholesky", "cg"])
@pytest.mark.parametrize(
    "engine_dtype,schedule_dtype", [(torch.float64, torch.float32), (torch.float32, torch.float64)]
)
def test_a_schedule_in_another_dtype_is_evaluated_in_the_backends(
    engine_name, engine_dtype, schedule_dtype
):
    # a float64 schedule on a float32 backend raised a dtype mismatch, as did a float32 schedule
    # on a float64 Lanczos spectrum
    gen = torch.Generator().manual_seed(4)
    x = 10 * torch.rand(150, 1, generator=gen, dtype=DT)
    k = _rbf(x)
    rhs = torch.randn(150, 1, generator=gen, dtype=DT)
    gammas = torch.tensor([0.3, 0.5], dtype=schedule_dtype)
    engine = _engines(k, engine_dtype)[engine_name]
    filt = SpectralFilter.data_centric_targets(gammas)
    got = engine.apply(filt, rhs.to(engine_dtype))
    assert got.dtype == engine_dtype
    expected = _explicit_targets(k, gammas.to(DT), rhs)
    tol = 1e-9 if engine_dtype == torch.float64 else 1e-4
    assert float((got.to(DT) - expected).norm() / expected.norm()) < tol
    resolvent = SpectralFilter.resolvent(gammas)
    variances = engine.quad_diag(resolvent, rhs.to(engine_dtype))
    assert variances.dtype == engine_dtype
    eye = torch.eye(150, dtype=DT)
    for t, g in enumerate(gammas.tolist()):
        exact = rhs.mT @ torch.linalg.solve(k + g * eye, rhs)
        assert abs(float(variances[t, 0]) / float(exact) - 1) < tol
