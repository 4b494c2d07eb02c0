"""GPU and KeOps paths of the regression distillers (skipped where CUDA / pykeops are absent)."""

import warnings

import gpytorch
import pytest
import torch
from gpr_reference import rbf_kernel, relative_error
from gpytorch.utils.warnings import NumericalWarning

from gpsd import DataCentricGPR, DistributionCentricGPR
from gpsd.linalg import SpectralFilter
from gpsd.linalg._shifted_solve import ShiftedSolveEngine

DTYPE = torch.float64
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def data(n=300, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = 10 * torch.rand(n, 1, generator=gen, dtype=DTYPE)
    y = torch.sin(x.squeeze(-1)) + 0.2 * torch.randn(n, generator=gen, dtype=DTYPE)
    return x, y, torch.linspace(0, 10, 50, dtype=DTYPE).unsqueeze(-1)


@cuda
@pytest.mark.parametrize("backend", ["dense", "cholesky", "lanczos", "cg"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cuda_matches_cpu(backend, dtype):
    x, y, test_x = data()
    gammas = torch.linspace(0.1, 1.0, 10, dtype=DTYPE)
    ref = DataCentricGPR(x, y, rbf_kernel(), noise=gammas, backend="dense")
    kernel = rbf_kernel(dtype=dtype).cuda()
    options = {"rtol": 1e-12} if backend == "cg" else {}
    model = DataCentricGPR(
        x.to("cuda", dtype),
        y.to("cuda", dtype),
        kernel,
        noise=gammas.to(dtype),
        backend=backend,
        rank=64,
        **options,
    )
    with torch.no_grad():
        got = model.predict(test_x.to("cuda", dtype))
        expected = ref.predict(test_x)
    assert got.mean.device.type == "cuda"
    tol = 1e-8 if dtype == torch.float64 else 1e-4
    assert relative_error(got.mean.cpu().double(), expected.mean) < tol
    assert relative_error(got.variance.cpu().double(), expected.variance) < tol
    dist = DistributionCentricGPR(
        x.to("cuda", dtype), y.to("cuda", dtype), kernel, noise=gammas.to(dtype)
    )
    with torch.no_grad():
        assert dist.predict(test_x.to("cuda", dtype)).mean.device.type == "cuda"


def test_keops_lanczos_and_cg_agree_with_dense_at_n_2000():
    pytest.importorskip("pykeops", reason="the matrix-free KeOps path needs pykeops (gpsd[keops])")
    x, y, test_x = data(n=2000)
    gammas = torch.linspace(0.1, 1.0, 5, dtype=DTYPE)
    keops_kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.keops.RBFKernel()).to(DTYPE)
    keops_kernel.base_kernel.lengthscale = 1.5
    keops_kernel.outputscale = 4.0
    dense = DataCentricGPR(x, y, rbf_kernel(), noise=gammas, backend="dense")
    lanczos = DataCentricGPR(x, y, keops_kernel, noise=gammas, backend="lanczos", rank=128)
    with torch.no_grad():
        ref, got = dense.predict(test_x), lanczos.predict(test_x)
        tol = max(10 * lanczos.error_estimate, 1e-9)
    assert relative_error(got.mean, ref.mean) < tol
    assert relative_error(got.variance, ref.variance) < tol
    cg = DataCentricGPR(x, y, keops_kernel, noise=gammas, backend="cg", rank=16, rtol=1e-10)
    with torch.no_grad():
        got = cg.predict(test_x)
        # the one-run Krylov chain on KeOps products, against the step-by-step chain
        engine, centred = cg._state()["engine"], cg._state()["centred"]
        weights = SpectralFilter.data_centric_weights(gammas)
        one_run = engine.krylov_apply(weights, centred)
        step_by_step = ShiftedSolveEngine.apply(engine, weights, centred)
    assert relative_error(got.mean, ref.mean) < 1e-7
    assert relative_error(got.variance, ref.variance) < 1e-7
    assert relative_error(one_run, step_by_step) < 1e-8
    # float32 data: the KeOps products still run in the float64 of the factorisation, so CG
    # reaches a residual that float32 products (rounding ~1e-7 per product) could not.
    cg = DataCentricGPR(
        x.float(),
        y.float(),
        keops_kernel.float(),
        noise=gammas.float(),
        backend="cg",
        rank=16,
        rtol=1e-10,
    )
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", NumericalWarning)
        cg.predict(test_x.float())
        engine = cg._state()["engine"]
    assert engine.kernel.dtype == torch.float64
    assert 0 < engine.max_relative_residual < 1e-9
