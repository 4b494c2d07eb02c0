"""Matrix-free fixes from an audit against dense float64 references: Ritz pairs whose residuals
sit at rounding level count as resolved (a tolerance below rounding put the largest pairs in the
complement and raised "series diverges" on a Krylov space spanning all of R^N); a matrix-free
engine is not rebuilt when only the grad mode changes (it builds no graph; the rebuild lost the
residuals CG reached); the float32 warning comes before a factorisation that may fail."""

import gpytorch
import pytest
import torch
from gpytorch.utils.warnings import NumericalWarning

import gpsd.linalg
from gpsd import DataCentricGPR

DT = torch.float64


def _kernel(lengthscale=1.0):
    k = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).to(DT)
    k.base_kernel.lengthscale = lengthscale
    return k


def _data(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = 10 * torch.rand(n, 1, generator=gen, dtype=DT)
    return x, torch.sin(x.squeeze(-1)) + 0.1 * torch.randn(n, generator=gen, dtype=DT)


def test_a_tight_rtol_on_a_smooth_kernel_is_met_not_refused():
    x, y = _data(600)
    test_x = torch.linspace(0, 10, 50, dtype=DT).unsqueeze(-1)
    gamma = torch.tensor([1e-4, 1e-3], dtype=DT)
    with torch.no_grad():
        model = DataCentricGPR(x, y, _kernel(), noise=gamma, backend="lanczos", rtol=1e-8)
        got = model.predict_mean(test_x)
        dense = DataCentricGPR(x, y, _kernel(), noise=gamma, backend="dense").predict_mean(test_x)
    assert model.error_estimate <= 1e-8
    scale = dense.abs().max()
    assert float((got - dense).abs().max() / scale) < 1e-8


def test_switching_the_grad_mode_keeps_a_matrix_free_engine():
    x, y = _data(300)
    model = DataCentricGPR(x, y, _kernel(0.3), noise=[0.01, 0.02], backend="cg", rtol=1e-6)
    with torch.no_grad():
        first = model.predict_mean(x[:5])
    engine = model._state()["engine"]
    second = model.predict_mean(x[:5])  # gradients enabled now
    assert model._state()["engine"] is engine
    torch.testing.assert_close(second, first, rtol=0, atol=0)
    with pytest.raises(gpsd.BackendError, match="'dense' or 'cholesky'"):
        second.sum().backward()  # CG builds no graph
    # a dense engine carries a graph with gradients enabled: rebuilt
    dense = DataCentricGPR(x, y, _kernel(0.3), noise=[0.01, 0.02], backend="dense")
    with torch.no_grad():
        dense.predict_mean(x[:5])
        engine = dense._state()["engine"]
    assert dense.predict_mean(x[:5]).requires_grad and dense._state()["engine"] is not engine


def test_the_low_precision_warning_comes_before_the_factorisation(monkeypatch):
    def failing_engine(*args, **kwargs):
        raise RuntimeError("the factorisation failed")

    monkeypatch.setattr(gpsd.linalg, "make_engine", failing_engine)
    x, y = _data(40)
    kernel = gpytorch.kernels.RBFKernel()
    model = DataCentricGPR(x.float(), y.float(), kernel, noise=[1e-6], linalg_dtype=None)
    with (
        pytest.warns(NumericalWarning, match="factored in torch.float32"),
        pytest.raises(RuntimeError, match="the factorisation failed"),
        torch.no_grad(),
    ):
        model.predict_mean(x[:3].float())


def test_a_float32_lanczos_spectrum_warns_instead_of_refusing():
    # every pair's residual is at float32 rounding: none used to count as resolved
    x, y = _data(300)
    test_x = torch.linspace(0, 10, 20, dtype=DT).unsqueeze(-1)
    model = DataCentricGPR(
        x.float(), y.float(), _kernel().float(), noise=[1e-2], backend="lanczos", linalg_dtype=None
    )
    with torch.no_grad(), pytest.warns(NumericalWarning, match="estimated relative error"):
        got = model.predict_mean(test_x.float())
    with torch.no_grad():
        dense = DataCentricGPR(x, y, _kernel(), noise=[1e-2], backend="dense").predict_mean(test_x)
    error = float((got.double() - dense).abs().max() / dense.abs().max())
    assert error < 10 * model.error_estimate and model.error_estimate < 0.05


def test_auto_rebuilds_for_gradients_after_a_no_grad_prediction():
    # under no_grad, auto may take a truncated Lanczos spectrum (no graph); a later prediction
    # with gradients must not reuse it
    x, y = _data(300)
    gammas = torch.full((30,), 0.1, dtype=DT)
    model = DataCentricGPR(x, y, _kernel(2.0), noise=gammas)
    with torch.no_grad():
        model.predict_mean(x[:5])
    mean = model.predict_mean(x[:5])
    assert mean.requires_grad
    (got,) = torch.autograd.grad(mean.sum(), model.covar_module.base_kernel.raw_lengthscale)
    fresh = DataCentricGPR(x, y, _kernel(2.0), noise=gammas)
    (expected,) = torch.autograd.grad(
        fresh.predict_mean(x[:5]).sum(), fresh.covar_module.base_kernel.raw_lengthscale
    )
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=0)


def test_cg_splits_off_only_pairs_within_the_residual_tolerance():
    # the rounding floor that lets Lanczos count pairs as resolved is not for CG, whose
    # estimate ignores the split-off pairs' residuals: float32 chains came out 1.4 off
    gen = torch.Generator().manual_seed(0)
    x = 10 * torch.rand(300, 1, generator=gen, dtype=DT)
    y = torch.sin(x.squeeze(-1)) + 0.1 * torch.randn(300, generator=gen, dtype=DT)
    test_x = torch.linspace(0, 10, 40, dtype=DT).unsqueeze(-1)
    gammas = torch.logspace(0, 1, 20, dtype=DT) * 1e-4

    def kernel(dtype):
        k = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=2.5)).to(DT)
        return k.to(dtype)

    with torch.no_grad():
        dense = DataCentricGPR(x, y, kernel(DT), noise=gammas, backend="dense").predict_mean(test_x)
        model = DataCentricGPR(
            x.float(),
            y.float(),
            kernel(torch.float32),
            noise=gammas.float(),
            backend="cg",
            linalg_dtype=None,
            rtol=1e-3,
        )
        with pytest.warns(NumericalWarning):  # the float32 warning
            got = model.predict_mean(test_x.float())
    engine = model._state()["engine"]
    error = (got.double() - dense).abs().amax(-1) / dense.abs().amax(-1)
    assert float(error.max()) < 0.05
    assert int(engine.resolved.sum()) == 0  # none within residual_tol in float32 here
