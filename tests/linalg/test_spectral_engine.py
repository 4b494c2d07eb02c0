"""Tests of the SpectralEngine interface: every engine implements all of it, and the engines
agree with explicit matrices and with each other."""

import gpytorch
import pytest
import torch
from gpr_reference import explicit_targets, random_rbf_matrix, rbf_gram

import gpsd
from gpsd.linalg import (
    ChunkedKernelOperator,
    KernelSpectrum,
    ShiftedCG,
    ShiftedCholesky,
    SpectralEngine,
    SpectralFilter,
)

DTYPE = torch.float64


def test_dense_and_cholesky_apply_equal_explicit_matrices():
    k = random_rbf_matrix(50)
    gammas = torch.tensor([[0.2, 0.5, 0.5], [1.0, 0.1, 0.3]], dtype=DTYPE)
    rhs = torch.randn(50, 3, dtype=DTYPE)
    left = torch.randn(50, 4, dtype=DTYPE)
    for alpha in (0.0, 0.3):
        filt = SpectralFilter.data_centric_targets(gammas, alpha)
        expected = torch.stack([explicit_targets(k, g, alpha) for g in gammas]) @ rhs
        for engine in (KernelSpectrum.from_dense(k), ShiftedCholesky(k)):
            got = engine.apply(filt, rhs)
            assert got.shape == (2, 3, 50, 3)
            torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-10)
            torch.testing.assert_close(
                engine.cross(filt, left, rhs), left.T @ expected, rtol=1e-9, atol=1e-10
            )
            quad = torch.stack([explicit_targets(k, g, alpha) for g in gammas])
            expected_diag = (left.unsqueeze(0).unsqueeze(0) * (quad @ left)).sum(-2)
            torch.testing.assert_close(
                engine.quad_diag(filt, left), expected_diag, rtol=1e-9, atol=1e-10
            )
            torch.testing.assert_close(
                engine.trace(filt), quad.diagonal(dim1=-2, dim2=-1).sum(-1), rtol=1e-9, atol=1e-9
            )


def _explicit_targets(k, gammas, rhs):
    """``F_t(K) rhs`` by dense float64 solves, ``F_t = K (K + g_t I)^-1 F_{t-1}``."""
    eye = torch.eye(k.shape[-1], dtype=DTYPE)
    out, f = [], rhs
    for g in gammas.tolist():
        f = k @ torch.linalg.solve(k + g * eye, f)
        out.append(f)
    return torch.stack(out)


def _engines(k, dtype):
    gen = torch.Generator().manual_seed(3)
    residual_tol = 1e-8 if dtype == DTYPE else 1e-4  # float32 residuals stall near 1e-6
    spectrum = KernelSpectrum.from_lanczos(
        k.to(dtype), rank=96, residual_tol=residual_tol, generator=gen
    )
    spectrum.check_accuracy(0.3, 1e-6 if dtype == DTYPE else 1e-3)
    return {
        "dense": KernelSpectrum.from_dense(k, dtype=dtype),
        "lanczos": spectrum,
        "cholesky": ShiftedCholesky(k, dtype=dtype),
        "cg": ShiftedCG.from_spectrum(k.to(dtype), spectrum, tol=1e-12 if dtype == DTYPE else 1e-6),
    }


@pytest.mark.parametrize("engine_name", ["dense", "lanczos", "cholesky", "cg"])
@pytest.mark.parametrize(
    "engine_dtype,schedule_dtype", [(torch.float64, torch.float32), (torch.float32, torch.float64)]
)
def test_a_schedule_in_another_dtype_is_evaluated_in_the_backends(
    engine_name, engine_dtype, schedule_dtype
):
    # a float64 schedule on a float32 backend, and a float32 schedule on a float64 Lanczos
    # spectrum, are evaluated in the backend's dtype
    gen = torch.Generator().manual_seed(4)
    x = 10 * torch.rand(150, 1, generator=gen, dtype=DTYPE)
    k = rbf_gram(x)
    rhs = torch.randn(150, 1, generator=gen, dtype=DTYPE)
    gammas = torch.tensor([0.3, 0.5], dtype=schedule_dtype)
    engine = _engines(k, engine_dtype)[engine_name]
    filt = SpectralFilter.data_centric_targets(gammas)
    got = engine.apply(filt, rhs.to(engine_dtype))
    assert got.dtype == engine_dtype
    expected = _explicit_targets(k, gammas.to(DTYPE), rhs)
    tol = 1e-9 if engine_dtype == torch.float64 else 1e-4
    assert float((got.to(DTYPE) - expected).norm() / expected.norm()) < tol
    resolvent = SpectralFilter.resolvent(gammas)
    variances = engine.quad_diag(resolvent, rhs.to(engine_dtype))
    assert variances.dtype == engine_dtype
    eye = torch.eye(150, dtype=DTYPE)
    for t, g in enumerate(gammas.tolist()):
        exact = rhs.mT @ torch.linalg.solve(k + g * eye, rhs)
        assert abs(float(variances[t, 0]) / float(exact) - 1) < tol


# ------------------------------------------------------------------ the interface
def _every_engine():
    """One engine of each kind, with the kernel matrix it filters."""
    x = torch.linspace(0, 10, 60, dtype=DTYPE).unsqueeze(-1)
    kernel = gpytorch.kernels.RBFKernel().to(DTYPE)
    kernel.lengthscale = torch.tensor(1.5, dtype=DTYPE)
    k = kernel(x).to_dense().detach()
    operator = ChunkedKernelOperator(x, covar_module=kernel, chunk_size=16)
    lanczos = KernelSpectrum.from_lanczos(k, rank=60, residual_tol=1e-10)
    chunked = KernelSpectrum.from_lanczos(operator, rank=60, residual_tol=1e-10)
    return k, {
        "dense": KernelSpectrum.from_dense(k),
        "lanczos": lanczos,
        "lanczos_matrix_free": chunked,
        "cholesky": ShiftedCholesky(k),
        "cg": ShiftedCG.from_spectrum(k, lanczos, tol=1e-12),
        "cg_matrix_free": ShiftedCG.from_spectrum(operator, chunked, tol=1e-12),
    }


def test_engines_name_their_backend_and_whether_test_columns_are_local():
    x = torch.linspace(0, 10, 60, dtype=DTYPE).unsqueeze(-1)
    kernel = gpytorch.kernels.RBFKernel().to(DTYPE)
    k = kernel(x).to_dense().detach()
    truncated = KernelSpectrum.from_lanczos(k, rank=8)
    assert truncated.is_truncated
    engines = {
        "dense": KernelSpectrum.from_dense(k),
        "lanczos": truncated,
        "cholesky": ShiftedCholesky(k),
        "cg": ShiftedCG.from_spectrum(k, truncated, tol=1e-10),
    }
    for name, engine in engines.items():
        assert engine.name == name
    # the full spectrum's forms are projections; CG and Cholesky multiply by or solve with K
    assert engines["dense"].columns_are_local
    assert not engines["cg"].columns_are_local and not engines["cholesky"].columns_are_local
    assert truncated.columns_are_local == ((truncated.series_order + 1) // 2 == 0)


def test_every_engine_implements_the_whole_interface():
    _, engines = _every_engine()
    methods = [
        "apply",
        "cross",
        "quad_diag",
        "trace",
        "trace_estimate",
        "project",
        "error_estimate",
        "check_accuracy",
    ]
    for name, engine in engines.items():
        assert isinstance(engine, SpectralEngine), name
        for method in methods:
            assert callable(getattr(engine, method)), (name, method)
        for attribute in (
            "supports_autograd",
            "matrix_free",
            "is_truncated",
            "exact_trace",
            "columns_are_local",
        ):
            assert isinstance(getattr(engine, attribute), bool), (name, attribute)
        assert engine.name in ("dense", "cholesky", "lanczos", "cg"), name
        assert engine.size == 60
        assert engine.quad_error_bound is None or isinstance(engine.quad_error_bound, torch.Tensor)
    assert not SpectralEngine.__abstractmethods__ - {
        "apply",
        "cross",
        "quad_diag",
        "trace",
        "error_estimate",
        "check_accuracy",
    }
    with pytest.raises(TypeError, match="abstract"):
        SpectralEngine()


def test_matrix_free_says_whether_the_engine_multiplies_without_the_matrix():
    _, engines = _every_engine()
    assert {name: engine.matrix_free for name, engine in engines.items()} == {
        "dense": False,
        "lanczos": False,
        "lanczos_matrix_free": True,
        "cholesky": False,
        "cg": False,
        "cg_matrix_free": True,
    }
    assert {name: engine.supports_autograd for name, engine in engines.items()} == {
        "dense": True,
        "lanczos": False,
        "lanczos_matrix_free": False,
        "cholesky": True,
        "cg": False,
        "cg_matrix_free": False,
    }


def test_every_engine_applies_projected_and_plain_right_hand_sides_as_the_dense_formula():
    k, engines = _every_engine()
    gen = torch.Generator().manual_seed(1)
    rhs = torch.randn(60, 2, generator=gen, dtype=DTYPE)
    left = torch.randn(60, 3, generator=gen, dtype=DTYPE)
    gammas = torch.tensor([0.3, 0.1], dtype=DTYPE)
    filt = SpectralFilter.data_centric_targets(gammas, 0.2)
    resolvent = SpectralFilter.resolvent(torch.tensor([0.2, 0.2], dtype=DTYPE))
    explicit = explicit_targets(k, gammas.tolist(), 0.2)  # shape: (2, N, N)
    inverse = torch.linalg.inv(k + 0.2 * torch.eye(60, dtype=DTYPE))
    for name, engine in engines.items():
        engine.check_accuracy(0.1, 1e-8)
        assert engine.error_estimate(0.1) <= 1e-8, name
        coords = engine.project(rhs)
        for given in (rhs, coords):
            torch.testing.assert_close(
                engine.apply(filt, given), explicit @ rhs, rtol=1e-7, atol=1e-8
            )
            torch.testing.assert_close(
                engine.cross(filt, left, given), left.mT @ explicit @ rhs, rtol=1e-7, atol=1e-8
            )
        torch.testing.assert_close(
            engine.quad_diag(resolvent, left),
            (left * (inverse @ left)).sum(-2).expand(2, 3),
            rtol=1e-7,
            atol=1e-8,
        )
        value, error = engine.trace_estimate(resolvent, 16, torch.Generator().manual_seed(0))
        expected = inverse.trace().expand(2)
        assert bool(((value - expected).abs() <= 5 * error + 1e-6).all()), name
        if engine.exact_trace:
            torch.testing.assert_close(error, torch.zeros(2, dtype=DTYPE))
        if isinstance(engine, ShiftedCG):
            continue  # an exact trace would need N solves
        torch.testing.assert_close(engine.trace(resolvent), expected, rtol=1e-7, atol=1e-8)


def test_the_shifted_solve_engines_project_to_the_right_hand_side_itself():
    _, engines = _every_engine()
    rhs = torch.ones(60, 1, dtype=DTYPE)
    for name in ("cholesky", "cg", "cg_matrix_free"):
        assert engines[name].project(rhs) is rhs


def _guard_problem():
    """An RBF matrix of 40 points whose lengthscale requires grad, a schedule and targets."""
    gen = torch.Generator().manual_seed(11)
    x = 10 * torch.rand(40, 1, generator=gen, dtype=DTYPE)
    lengthscale = torch.tensor(1.3, dtype=DTYPE, requires_grad=True)
    rhs = torch.randn(40, 1, generator=gen, dtype=DTYPE)
    return rbf_gram(x, lengthscale), lengthscale, torch.tensor([0.3, 0.5], dtype=DTYPE), rhs


@pytest.mark.parametrize("engine_name", ["dense", "cholesky"])
def test_the_guard_of_a_graph_engine_passes_gradients_that_match_a_dense_formula(engine_name):
    k, lengthscale, gammas, rhs = _guard_problem()
    engine = {"dense": KernelSpectrum.from_dense, "cholesky": ShiftedCholesky}[engine_name](k)
    assert engine.supports_autograd
    value = engine.apply(SpectralFilter.data_centric_targets(gammas), rhs)
    guarded = engine.guard(value, lengthscale)
    assert guarded is value
    (got,) = torch.autograd.grad(guarded.square().sum(), lengthscale, retain_graph=True)
    # autograd through explicit dense solves, F_t = K (K + g_t I)^-1 F_{t-1}
    expected_value = explicit_targets(k, gammas) @ rhs
    (expected,) = torch.autograd.grad(expected_value.square().sum(), lengthscale)
    torch.testing.assert_close(got, expected, rtol=1e-7, atol=1e-10)


@pytest.mark.parametrize("engine_name", ["lanczos", "cg"])
def test_a_backward_pass_through_a_guarded_matrix_free_result_names_the_backends_that_can(
    engine_name,
):
    k, lengthscale, gammas, rhs = _guard_problem()
    engine = _engines(k.detach(), DTYPE)[engine_name]
    assert not engine.supports_autograd
    value = engine.apply(SpectralFilter.data_centric_targets(gammas), rhs)
    guarded = engine.guard(value, lengthscale, "not a tensor")
    assert torch.equal(guarded, value) and guarded.requires_grad
    with pytest.raises(
        gpsd.BackendError,
        match=rf"backend='{engine_name}' builds no autograd.*'dense' or 'cholesky'",
    ):
        guarded.sum().backward()


@pytest.mark.parametrize("engine_name", ["lanczos", "cg"])
def test_the_guard_leaves_a_result_alone_where_no_gradient_can_be_asked_for(engine_name):
    k, lengthscale, gammas, rhs = _guard_problem()
    engine = _engines(k.detach(), DTYPE)[engine_name]
    value = engine.apply(SpectralFilter.data_centric_targets(gammas), rhs)
    assert engine.guard(value) is value
    assert engine.guard(value, lengthscale.detach()) is value
    with torch.no_grad():
        assert engine.guard(value, lengthscale) is value
