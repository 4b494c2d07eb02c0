"""Tests of KernelSpectrum: the dense eigendecomposition and block Lanczos against dense
references, the bounds on the complement norm, the a-posteriori error estimate, the growth of a
Lanczos basis (stop_when, progress and callback) and the argument checks."""

import math
import warnings

import gpytorch
import pytest
import torch
from gpr_reference import explicit_targets, random_rbf_matrix, rbf_gram
from gpytorch.utils.warnings import NumericalWarning

from gpsd.linalg import (
    KernelSpectrum,
    SpectralFilter,
)

DTYPE = torch.float64


def test_lanczos_on_a_batch_and_on_a_callable():
    k = random_rbf_matrix(200, batch=(2,))
    gammas = torch.tensor([0.3, 0.6], dtype=DTYPE)
    rhs = torch.randn(2, 200, 1, dtype=DTYPE)
    filt = SpectralFilter.data_centric_weights(gammas)
    dense = KernelSpectrum.from_dense(k)
    lanczos = KernelSpectrum.from_lanczos(k, rank=64, residual_tol=1e-9)
    assert lanczos.error_estimate(0.3) < 1e-8
    torch.testing.assert_close(
        lanczos.apply(filt, rhs), dense.apply(filt, rhs), rtol=1e-8, atol=1e-9
    )
    # The same through a bare matmul closure (how a KeOps or chunked operator plugs in).
    closure = KernelSpectrum.from_lanczos(
        lambda v: k @ v,
        size=200,
        batch_shape=(2,),
        dtype=DTYPE,
        rank=64,
        kernel_trace=k.diagonal(dim1=-2, dim2=-1).sum(-1),
    )
    torch.testing.assert_close(
        closure.apply(filt, rhs), dense.apply(filt, rhs), rtol=1e-8, atol=1e-9
    )
    torch.testing.assert_close(closure.trace(filt), dense.trace(filt), rtol=1e-8, atol=1e-8)


class CountingMatmul:
    """``X -> K X`` that counts its calls."""

    def __init__(self, k):
        self.k, self.calls = k, 0

    def __call__(self, v):
        self.calls += 1
        return self.k @ v


def lanczos_with_counter(k, rank, **kwargs):
    counter = CountingMatmul(k)
    spectrum = KernelSpectrum.from_lanczos(
        counter,
        size=k.shape[-1],
        batch_shape=k.shape[:-2],
        dtype=DTYPE,
        rank=rank,
        kernel_trace=k.diagonal(dim1=-2, dim2=-1).sum(-1),
        generator=torch.Generator().manual_seed(0),
        **kwargs,
    )
    return spectrum, counter


@pytest.mark.parametrize("rank", [32, 40, 44])
def test_complement_norm_bounds_bracket_the_dense_norm(rank):
    """Lower (largest unresolved Ritz value) <= ||P K P||_2 <= upper (trace bound), and the
    power-iteration estimate lies between, against the dense complement's eigenvalues."""
    k = random_rbf_matrix(300, lengthscale=0.5)
    spectrum, _ = lanczos_with_counter(k, rank, residual_tol=1e-9)
    v = spectrum.eigenvectors
    assert 0 < int(spectrum.num_resolved) < rank  # part of the Krylov space is unresolved
    proj = torch.eye(300, dtype=DTYPE) - v @ v.mT
    exact = float(torch.linalg.eigvalsh(proj @ k @ proj).abs().max())
    assert spectrum.complement_lower_bound <= exact * (1 + 1e-9)
    assert exact <= spectrum.complement_upper_bound
    assert spectrum.complement_lower_bound <= spectrum.complement_norm
    assert spectrum.complement_norm <= spectrum.complement_upper_bound
    assert spectrum.complement_norm == pytest.approx(exact, rel=0.05)


def test_a_spectrum_built_by_hand_estimates_its_complement_norm_on_first_read():
    k = random_rbf_matrix(300, lengthscale=0.5)
    ref, _ = lanczos_with_counter(k, 40, residual_tol=1e-9)
    spectrum = KernelSpectrum(
        ref.eigenvalues, ref.eigenvectors, matmul=lambda v: k @ v, complement_norm=None
    )
    v = ref.eigenvectors
    proj = torch.eye(300, dtype=DTYPE) - v @ v.mT
    exact = float(torch.linalg.eigvalsh(proj @ k @ proj).abs().max())
    assert spectrum.complement_norm == pytest.approx(exact, rel=0.05)


def test_small_trace_bound_skips_the_power_iterations():
    """A resolved spectrum: the trace bound serves as the complement norm, with no products."""
    k = random_rbf_matrix(200)
    spectrum, counter = lanczos_with_counter(k, 64, residual_tol=1e-9, complement_tol=1e-7)
    calls = counter.calls
    dense = torch.linalg.eigvalsh(k).flip(-1)
    tail = float(dense[int(spectrum.num_resolved) :].sum())  # = tr K_perp up to rounding
    assert spectrum.complement_norm <= 1e-7
    assert spectrum.complement_norm >= tail - 1e-12
    assert counter.calls == calls  # reading it ran no power iterations
    # Without the tolerance the first read runs the 12 power iterations, once.
    spectrum, counter = lanczos_with_counter(k, 64, residual_tol=1e-9)
    calls = counter.calls
    assert spectrum.complement_norm < 1e-7
    assert counter.calls == calls + 12
    assert spectrum.complement_norm < 1e-7
    assert counter.calls == calls + 12


def test_meets_decides_from_the_bounds_before_any_power_iteration():
    k = random_rbf_matrix(300, lengthscale=0.3)
    spectrum, counter = lanczos_with_counter(k, 16, residual_tol=1e-10)
    calls = counter.calls
    assert spectrum.complement_lower_bound > 1e-2  # far from resolved
    assert not spectrum.meets(1e-2, 1e-6)
    assert counter.calls == calls  # the lower bound sufficed
    # A huge shift: the trace bound alone meets rtol and becomes the complement norm.
    assert spectrum.meets(1e6, 1e-3)
    assert spectrum.complement_norm == spectrum.complement_upper_bound
    assert counter.calls == calls


def test_meets_runs_the_power_iterations_only_where_the_bounds_leave_it_open():
    k = random_rbf_matrix(300, lengthscale=0.5)
    spectrum, counter = lanczos_with_counter(k, 44, residual_tol=1e-9)
    calls = counter.calls
    low, up = spectrum.complement_lower_bound, spectrum.complement_upper_bound
    rtol = 0.5 * (low + up)  # noise = 1: the lower bound meets it, the upper one does not
    assert spectrum._error_for(low, 1.0) < rtol < spectrum._error_for(up, 1.0, order=0)
    assert not spectrum.meets(1.0, rtol, allow_power=False)
    assert counter.calls == calls
    assert spectrum.meets(1.0, rtol) == (spectrum.error_estimate(1.0) <= rtol)
    assert counter.calls == calls + 12


def test_stop_when_ends_the_krylov_run_at_a_checkpoint_with_fewer_products():
    k = random_rbf_matrix(400)  # smooth: a few blocks resolve it
    gammas = torch.tensor([0.05, 0.1], dtype=DTYPE)
    rhs = torch.randn(400, 2, dtype=DTYPE)
    filt = SpectralFilter.data_centric_weights(gammas)
    looked_at = []

    def stop(spectrum):
        looked_at.append(int(spectrum.ritz_values.shape[-1]))
        return spectrum.meets(0.05, 1e-8, allow_power=False)

    early, counter = lanczos_with_counter(
        k, 256, block_size=32, residual_tol=1e-11, complement_tol=1e-10, stop_when=stop
    )
    full, full_counter = lanczos_with_counter(k, 256, block_size=32, residual_tol=1e-11)
    assert full_counter.calls == 9  # the start and 8 blocks
    assert counter.calls == 1 + looked_at[-1] // 32 < 9
    assert looked_at == [64, 96, 128, 192][: len(looked_at)]  # after 2, 3, 4, 6 blocks
    assert early.error_estimate(0.05) <= 1e-8
    dense = KernelSpectrum.from_dense(k)
    torch.testing.assert_close(early.apply(filt, rhs), dense.apply(filt, rhs), rtol=1e-7, atol=1e-9)
    # A test that never passes runs the whole basis.
    never, counter = lanczos_with_counter(k, 256, block_size=32, stop_when=lambda s: False)
    assert counter.calls == 9 and never.ritz_values.shape[-1] == 256


def test_lanczos_divergent_complement_raises():
    k = random_rbf_matrix(300, lengthscale=0.3)
    spectrum = KernelSpectrum.from_lanczos(k, rank=8, residual_tol=1e-10)
    assert math.isinf(spectrum.error_estimate(1e-3))
    with pytest.raises(ValueError, match="rank"):
        spectrum.check_accuracy(1e-3, 1e-6)
    with pytest.raises(ValueError, match="rank"):
        KernelSpectrum.from_lanczos(k, rank=0)


def test_dense_eigendecomposition_runs_in_float64_by_default():
    k = random_rbf_matrix(30).float()
    assert KernelSpectrum.from_dense(k).eigenvalues.dtype == torch.float64
    assert KernelSpectrum.from_dense(k, dtype=None).eigenvalues.dtype == torch.float32


def test_to_linear_operator_equals_explicit_filter_matrices():
    k = random_rbf_matrix(40)
    gammas = torch.tensor([0.2, 0.7], dtype=DTYPE)
    op = KernelSpectrum.from_dense(k).to_linear_operator(
        SpectralFilter.data_centric_targets(gammas)
    )
    assert op.shape == (2, 40, 40)
    torch.testing.assert_close(
        op.to_dense(), explicit_targets(k, gammas, 0.0), rtol=1e-9, atol=1e-10
    )
    rhs = torch.randn(40, 2, dtype=DTYPE)
    torch.testing.assert_close(
        op @ rhs, explicit_targets(k, gammas, 0.0) @ rhs, rtol=1e-9, atol=1e-10
    )
    with pytest.raises(ValueError, match="full eigendecomposition"):
        KernelSpectrum.from_lanczos(k, rank=16).to_linear_operator(SpectralFilter.resolvent(gammas))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(rank=0), "rank must be a positive int"),
        (dict(rank=8.0), "rank"),
        (dict(block_size=0), "block_size must be a positive integer or None"),
        (dict(block_size=-2), "block_size"),
    ],
)
def test_lanczos_sizes_are_checked(kwargs, match):
    k = torch.eye(10, dtype=torch.float64)
    with pytest.raises(ValueError, match=match):
        KernelSpectrum.from_lanczos(k, **kwargs)


def test_float32_dense_spectrum_keeps_filters_in_range():
    """A float32 eigendecomposition of an RBF kernel has eigenvalues down to about -8e-6; with
    noise = 1e-5, three data-centric steps took filter values down to -7000 and the targets erred
    by 96 times their norm (2e-3 once negative eigenvalues count as 0)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.linspace(0, 10, 200, dtype=DTYPE).unsqueeze(-1)
    k = rbf_gram(x, lengthscale=2.0)
    y = torch.sin(x) + 0.1 * torch.randn(200, 1, generator=gen, dtype=DTYPE)
    gammas = torch.full((3,), 1e-5, dtype=DTYPE)
    spectrum = KernelSpectrum.from_dense(k, dtype=torch.float32)
    assert float(spectrum.eigenvalues.min()) < -1e-6  # the rounding this test is about
    targets = SpectralFilter.data_centric_targets(gammas)
    values = targets.values(spectrum.eigenvalues)
    assert float(values.min()) >= 0.0 and float(values.max()) <= 1.0
    weights = SpectralFilter.data_centric_weights(gammas).values(spectrum.eigenvalues)
    assert float(weights.min()) >= 0.0 and float(weights.max()) <= 1.0 / 1e-5 * (1 + 1e-6)
    got = spectrum.apply(targets, y.float()).double()
    expected = explicit_targets(k, gammas.tolist()) @ y
    error = (got - expected).norm(dim=(-2, -1)) / expected.norm(dim=(-2, -1))
    assert float(error.max()) < 0.05


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
    # At rho = 0.05, J = 4, the true relative error of the three-step weights G_3 on the
    # complement's leading eigenvector is 2.91e-6 (targets F_3: 1.73e-6), 8.8 times
    # rho^(J+1) / (1 - rho) = 3.29e-7. The Taylor remainder of G_t carries the factor
    # binom(J + 1, t - 1), up to binom(5, 2) = 10: the estimate is 3.13e-6.
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
    noise = epsilon / 0.05
    rhs = comp_evecs[:, -1:]  # shape: (n, 1): the worst direction for the series
    schedule = torch.full((num_steps,), noise, dtype=torch.float64)
    filt = getattr(SpectralFilter, f"data_centric_{kind}")(schedule, alpha=alpha)

    approx = spectrum.apply(filt, rhs)  # shape: (T, n, 1)
    exact = evecs @ (filt.values(evals).unsqueeze(-1) * (evecs.T @ rhs))
    scale = 1.0 if kind == "targets" else 1.0 / noise
    error = float(torch.linalg.vector_norm(approx - exact, dim=-2).max()) / scale
    estimate = spectrum.error_estimate(noise)
    assert error > 1e-7  # the series term dominates: far above rounding
    assert error <= estimate


def test_error_estimate_counts_the_spectral_norm_of_the_ritz_residuals():
    # 16 resolved Ritz pairs of an RBF kernel (lengthscale 1, 300 points on [0, 5]): the largest
    # column residual is 7.33e-10, the spectral norm ||K V - V D||_2 8.71e-10. Along the
    # residuals' leading left singular vector one step at noise = 0.01 errs by 8.71e-8, 1.19
    # times the column residual over noise (7.33e-8); the estimate must be the 8.71e-8.
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
    noise = 0.01
    filt = SpectralFilter.data_centric_targets(torch.full((2,), noise, dtype=torch.float64))
    approx = spectrum.apply(filt, rhs)  # shape: (2, 300, 1)
    exact = evecs @ (filt.values(evals).unsqueeze(-1) * (evecs.T @ rhs))
    error = float(torch.linalg.vector_norm(approx - exact, dim=-2).max())
    assert error > 1e-8  # the residual term dominates
    assert error <= 1.01 * spectrum.error_estimate(noise)


def _repeated_inputs(distinct=20, copies=15, seed=0):
    """``distinct`` points repeated ``copies`` times: an RBF kernel of rank ``distinct``."""
    gen = torch.Generator().manual_seed(seed)
    return (10 * torch.rand(distinct, 1, generator=gen, dtype=DTYPE)).repeat(copies, 1)


def test_lanczos_basis_stays_orthonormal_where_the_krylov_space_is_invariant():
    # rank 20, a basis of 64: once the Krylov space is exhausted the new block is rounding noise,
    # whose QR factor is not orthogonal to the basis (Ritz vectors 1.7 from orthonormal, solves
    # off by a factor of 1e12)
    k = rbf_gram(_repeated_inputs())
    gen = torch.Generator().manual_seed(1)
    spectrum = KernelSpectrum.from_lanczos(k, rank=64, block_size=8, generator=gen)
    v = spectrum.ritz_vectors
    gram = v.mT @ v
    assert float((gram - torch.eye(gram.shape[-1], dtype=DTYPE)).abs().max()) < 1e-12
    exact = torch.linalg.eigvalsh(k).flip(-1)
    resolved = int(spectrum.resolved.sum())
    assert resolved >= 20
    assert float((spectrum.eigenvalues[:resolved] - exact[:resolved]).abs().max()) < 1e-11
    rhs = torch.randn(k.shape[-1], 2, generator=gen, dtype=DTYPE)
    got = spectrum.apply(SpectralFilter.resolvent(torch.tensor([0.1], dtype=DTYPE)), rhs)[0]
    expected = torch.linalg.solve(k + 0.1 * torch.eye(k.shape[-1], dtype=DTYPE), rhs)
    assert float((got - expected).norm() / expected.norm()) < 1e-11


def _kernel_matrix(n: int) -> torch.Tensor:
    x = torch.linspace(0, 10, n, dtype=DTYPE).unsqueeze(-1)
    kernel = gpytorch.kernels.RBFKernel().to(DTYPE)
    kernel.lengthscale = torch.tensor(0.8, dtype=DTYPE)
    with torch.no_grad():
        return kernel(x).to_dense()


@pytest.mark.parametrize(("n", "block_size"), [(15, None), (37, 8), (10, 3)])
def test_full_rank_lanczos_resolves_every_eigenpair(n, block_size):
    # 15 inputs with the default blocks of 4: a basis stopping at 12 columns would leave three
    # eigenpairs to the complement (norm 1.66 here), whose series diverges for noise 0.1
    K = _kernel_matrix(n)
    generator = torch.Generator().manual_seed(0)
    spectrum = KernelSpectrum.from_lanczos(
        K, rank=n, block_size=block_size, residual_tol=1e-9, generator=generator
    )
    ref = torch.linalg.eigvalsh(K).flip(-1)  # descending
    got = spectrum.eigenvalues.sort(descending=True).values
    assert got.shape[-1] >= n
    torch.testing.assert_close(got[:n], ref, rtol=0, atol=1e-10)
    assert spectrum.error_estimate(0.1) <= 1e-8


X = torch.linspace(0, 1, 12, dtype=DTYPE)


K = torch.exp(-0.5 * (X[:, None] - X[None, :]).square() / 0.3**2)


def test_a_kernel_matrix_holding_nan_is_named():
    bad = K.clone()
    bad[3, 5] = math.nan
    with pytest.raises(ValueError, match="kernel must be finite, but it holds 1 NaN"):
        KernelSpectrum.from_dense(bad)


# ------------------------------------------------------------------ from_dense argument checks
def test_from_dense_refuses_a_non_symmetric_matrix_naming_the_asymmetry():
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(8, 8, generator=gen, dtype=DTYPE)
    asymmetry = float((a - a.mT).abs().max())
    with pytest.raises(
        ValueError, match=f"kernel must be symmetric: max \\|K - K\\^T\\| is {asymmetry:.3g}"
    ):
        KernelSpectrum.from_dense(a)
    # one batch entry out of two is enough
    with pytest.raises(ValueError, match="kernel must be symmetric"):
        KernelSpectrum.from_dense(torch.stack([K, K + 1e-3 * torch.triu(torch.ones_like(K), 1)]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_from_dense_symmetrises_an_asymmetry_of_rounding_size(dtype):
    k = K.to(dtype)
    noisy = k + 50 * torch.finfo(dtype).eps * torch.triu(torch.ones_like(k), 1)
    spectrum = KernelSpectrum.from_dense(noisy, dtype=torch.float64)
    reference = torch.linalg.eigvalsh(0.5 * (noisy + noisy.mT).double()).flip(-1)
    torch.testing.assert_close(spectrum.eigenvalues, reference, rtol=0, atol=1e-12)


def test_from_dense_refuses_non_square_and_integer_matrices():
    with pytest.raises(
        ValueError, match=r"kernel must be a square matrix \(\*b, N, N\), got shape \(3, 4\)"
    ):
        KernelSpectrum.from_dense(torch.ones(3, 4, dtype=DTYPE))
    with pytest.raises(
        TypeError, match="kernel must be a floating-point matrix, got dtype torch.int64"
    ):
        KernelSpectrum.from_dense(torch.eye(3, dtype=torch.int64))


def test_from_dense_warns_on_clearly_negative_eigenvalues_and_filters_them_as_zero():
    # eigenvalues 2, 1 and -0.5 of a symmetric, indefinite matrix
    q, _ = torch.linalg.qr(torch.randn(3, 3, dtype=DTYPE))
    indefinite = q @ torch.diag(torch.tensor([2.0, 1.0, -0.5], dtype=DTYPE)) @ q.mT
    indefinite = 0.5 * (indefinite + indefinite.mT)
    with pytest.warns(
        NumericalWarning, match="not positive semi-definite: its smallest eigenvalue is -0.5"
    ):
        spectrum = KernelSpectrum.from_dense(indefinite)
    noise = torch.tensor([0.1], dtype=DTYPE)
    rhs = torch.randn(3, 1, dtype=DTYPE)
    projected = q @ torch.diag(torch.tensor([2.0, 1.0, 0.0], dtype=DTYPE)) @ q.mT
    expected = torch.linalg.solve(projected + 0.1 * torch.eye(3, dtype=DTYPE), rhs)
    got = spectrum.apply(SpectralFilter.resolvent(noise), rhs)[0]
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


def test_from_dense_takes_rounding_level_negative_eigenvalues_silently():
    # a float32 RBF matrix of numerical rank far below N: eigenvalues down to about -1e-6 ||K||
    x = torch.linspace(0, 10, 200, dtype=DTYPE).unsqueeze(-1)
    k = rbf_gram(x, lengthscale=2.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        spectrum = KernelSpectrum.from_dense(k.float(), dtype=torch.float32)
        KernelSpectrum.from_dense(k)
    assert float(spectrum.eigenvalues.min()) < 0


# ------------------------------------------------------------------ growth: progress and callback
def _smooth_matrix(n=120):
    x = torch.linspace(0, 10, n, dtype=DTYPE).unsqueeze(-1)
    return rbf_gram(x, lengthscale=1.5)


def test_lanczos_callback_gets_one_record_per_block_and_changes_nothing():
    k = _smooth_matrix()
    records = []
    kwargs = dict(rank=64, block_size=8, residual_tol=1e-10, complement_tol=1e-9)
    plain = KernelSpectrum.from_lanczos(k, generator=torch.Generator().manual_seed(0), **kwargs)
    reported = KernelSpectrum.from_lanczos(
        k,
        generator=torch.Generator().manual_seed(0),
        callback=records.append,
        gamma_min=1e-2,
        **kwargs,
    )
    assert [r.iteration for r in records] == list(range(1, 9))
    assert all(r.task == "KernelSpectrum.from_lanczos" and r.total == 8 for r in records)
    assert [r.info["rank"] for r in records] == list(range(8, 65, 8))
    assert set(records[-1].info) == {
        "rank",
        "resolved",
        "complement_bound",
        "residual_norm",
        "error_estimate",
    }
    # the resolved pairs grow and the bound on the complement norm falls with the basis
    resolved = [r.info["resolved"] for r in records]
    assert resolved == sorted(resolved) and resolved[-1] == int(plain.num_resolved)
    assert records[-1].info["complement_bound"] < records[0].info["complement_bound"]
    torch.testing.assert_close(reported.eigenvalues, plain.eigenvalues, rtol=0, atol=0)
    torch.testing.assert_close(reported.eigenvectors, plain.eigenvectors, rtol=0, atol=0)
    # the record's error estimate is the spectrum's own, from its trace bound
    assert records[-1].info["error_estimate"] == pytest.approx(
        plain._error_for(plain.complement_upper_bound, 1e-2), rel=1e-12
    )


def test_lanczos_callback_returning_true_stops_the_growth_with_the_basis_so_far():
    k = _smooth_matrix()
    stop_after = 3

    def callback(record):
        return record.iteration == stop_after

    spectrum = KernelSpectrum.from_lanczos(k, rank=64, block_size=8, callback=callback)
    assert spectrum.ritz_values.shape[-1] == stop_after * 8
    # the spectrum of those 24 columns: the same as a run of rank 24
    short = KernelSpectrum.from_lanczos(k, rank=24, block_size=8)
    torch.testing.assert_close(spectrum.ritz_values, short.ritz_values, rtol=1e-12, atol=1e-12)


def test_the_accuracy_check_of_a_growth_stopped_by_the_callback_names_the_callback():
    k = _smooth_matrix()
    spectrum = KernelSpectrum.from_lanczos(
        k, rank=64, block_size=8, callback=lambda r: r.iteration == 2
    )
    assert spectrum.stopped_by_callback
    # the complement (norm about 22) is above this noise: its series diverges
    with pytest.raises(ValueError, match="the callback stopped the Lanczos growth") as raised:
        spectrum.check_accuracy(1e-2, 1e-6)
    assert "rank=" not in str(raised.value)
    # below this one the series converges, but not to the tolerance asked for
    with pytest.warns(NumericalWarning, match="the callback stopped the Lanczos growth") as caught:
        spectrum.check_accuracy(30.0, 1e-12)
    assert "rank=" not in str(caught[0].message)
    # a basis that stopped at its rank still points at rank=
    short = KernelSpectrum.from_lanczos(k, rank=16, block_size=8)
    assert not short.stopped_by_callback
    with pytest.raises(ValueError, match="raise rank="):
        short.check_accuracy(1e-2, 1e-6)


def test_lanczos_progress_advances_a_bar_once_per_block():
    class Bar:
        def __init__(self):
            self.steps = 0

        def update(self, n):
            self.steps += n

        def set_postfix(self, **kwargs):
            pass

    bar = Bar()
    KernelSpectrum.from_lanczos(_smooth_matrix(), rank=32, block_size=8, progress=bar)
    assert bar.steps == 4
    with pytest.raises(TypeError, match="progress must be True, False or a tqdm progress bar"):
        KernelSpectrum.from_lanczos(_smooth_matrix(), rank=32, block_size=8, progress="yes")
    KernelSpectrum.from_lanczos(_smooth_matrix(), rank=16, block_size=8, progress=True)


def test_engines_of_a_tensor_hold_the_matrix_and_a_callable_is_matrix_free():
    k = _smooth_matrix(40)
    assert not KernelSpectrum.from_dense(k).matrix_free
    assert not KernelSpectrum.from_lanczos(k, rank=16).matrix_free
    spectrum = KernelSpectrum.from_lanczos(
        lambda v: k @ v, size=40, dtype=DTYPE, rank=16, kernel_trace=k.trace()
    )
    assert spectrum.matrix_free


@pytest.mark.parametrize("batch", [(), (2,)])
def test_tridiagonal_spectrum_filters_equal_explicit_filter_matrices(batch):
    """Every filter operation of a from_tridiagonal spectrum against the explicit filter
    matrices of dense solves: apply, cross, quad_diag, trace."""
    k = random_rbf_matrix(60, lengthscale=0.5, seed=8, batch=batch)
    gammas = torch.tensor([0.05, 0.3, 1.0], dtype=DTYPE)
    filt = SpectralFilter.data_centric_targets(gammas)
    flat = k.reshape(-1, 60, 60)
    explicit = torch.stack([explicit_targets(m, gammas, 0.0) for m in flat])
    explicit = explicit.reshape(*batch, 3, 60, 60)
    spectrum = KernelSpectrum.from_tridiagonal(k)
    assert not spectrum.supports_autograd and not spectrum.is_truncated
    rhs = torch.randn(*batch, 60, 2, dtype=DTYPE)
    left = torch.randn(*batch, 60, 5, dtype=DTYPE)
    opts = dict(rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(spectrum.apply(filt, rhs), explicit @ rhs.unsqueeze(-3), **opts)
    torch.testing.assert_close(
        spectrum.cross(filt, left, rhs),
        left.mT.unsqueeze(-3) @ explicit @ rhs.unsqueeze(-3),
        **opts,
    )
    quad = (left.unsqueeze(-3) * (explicit @ left.unsqueeze(-3))).sum(-2)
    torch.testing.assert_close(spectrum.quad_diag(filt, left), quad, **opts)
    torch.testing.assert_close(spectrum.trace(filt), explicit.diagonal(dim1=-2, dim2=-1).sum(-1))


def test_tridiagonal_spectrum_checks_its_input_as_the_dense_one_does():
    with pytest.raises(ValueError, match="symmetric"):
        KernelSpectrum.from_tridiagonal(torch.triu(random_rbf_matrix(10)))
    with pytest.raises(ValueError, match="NaN|finite"):
        KernelSpectrum.from_tridiagonal(torch.full((3, 3), float("nan"), dtype=DTYPE))
    indefinite = torch.tensor([[1.0, 2.0], [2.0, 1.0]], dtype=DTYPE)
    with pytest.warns(NumericalWarning, match="not positive semi-definite"):
        KernelSpectrum.from_tridiagonal(indefinite)


def test_lanczos_trace_estimate_adds_the_higher_series_terms_within_a_few_standard_errors():
    k = random_rbf_matrix(300, lengthscale=0.8, seed=2)
    noise = torch.tensor([0.5, 0.5, 0.8], dtype=DTYPE)
    filt = SpectralFilter.data_centric_residuals(noise)
    evals = torch.linalg.eigvalsh(k).clamp_min(0.0)
    expected = filt.values(evals).sum(-1)  # the dense float64 trace
    spectrum = KernelSpectrum.from_lanczos(
        k, rank=24, residual_tol=1e-6, generator=torch.Generator().manual_seed(0)
    )
    spectrum.check_accuracy(0.5, 1e-5)
    assert spectrum.series_order >= 2 and spectrum.exact_trace is False
    value, error = spectrum.trace_estimate(filt, 64, torch.Generator().manual_seed(1))
    first_order = spectrum.trace(filt)
    series_error = spectrum.error_estimate(0.5) * 300  # per unit vector, over N of them
    # E_3 = 1 - O(d^3): no series term of order 2 to estimate for step 3 at J = 2
    assert bool((error[:2] > 0).all())
    assert bool(((value - expected).abs() <= 5 * error + series_error).all())
    # the probes correct the first-order trace towards the dense one
    assert float((value - expected).abs().max()) < float((first_order - expected).abs().max())


def test_a_full_spectrum_estimates_its_trace_exactly():
    k = random_rbf_matrix(40)
    filt = SpectralFilter.resolvent(torch.tensor([0.1, 0.4], dtype=DTYPE))
    dense = KernelSpectrum.from_dense(k)
    value, error = dense.trace_estimate(filt, 8, torch.Generator().manual_seed(0))
    assert dense.exact_trace is True
    eye = torch.eye(40, dtype=DTYPE)
    expected = torch.stack([torch.linalg.inv(k + g * eye).trace() for g in (0.1, 0.4)])
    torch.testing.assert_close(value, expected, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(error, torch.zeros(2, dtype=DTYPE))
