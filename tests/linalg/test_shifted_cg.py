"""Tests of ShiftedCG: deflated conjugate gradients against dense solves and the Cholesky
chain, the multi-shift paths, the one-run Krylov chain, and the error bounds of its quadratic
forms."""

import gpytorch
import pytest
import torch
from gpytorch.utils.warnings import NumericalWarning

import gpsd
from gpsd.linalg import (
    ChunkedKernelOperator,
    KernelSpectrum,
    ShiftedCG,
    ShiftedCholesky,
    SpectralFilter,
)
from gpsd.linalg import SpectralFilter as SF
from gpsd.linalg._shifted_solve import ShiftedSolveEngine

DTYPE = torch.float64


def rbf_matrix(x, lengthscale):
    return torch.exp(-0.5 * torch.cdist(x, x).square() / lengthscale**2)


def test_solves_equal_dense_solves_for_a_batch_of_shifts_and_kernels():
    gen = torch.Generator().manual_seed(0)
    x = 5 * torch.rand(2, 300, 2, generator=gen, dtype=DTYPE)  # a kernel batch of 2
    k = rbf_matrix(x, 0.4)
    rhs = torch.randn(2, 300, 3, generator=gen, dtype=DTYPE)
    noise = torch.tensor([[1e-3], [1e-2], [0.5]], dtype=DTYPE)  # shape (3, 1): a schedule batch
    spectrum = KernelSpectrum.from_lanczos(k, rank=48, generator=gen)
    cg = ShiftedCG.from_spectrum(k, spectrum, tol=1e-12)
    got = cg.solve(noise.squeeze(-1)[:, None], rhs)  # shape (3, 2, 300, 3)
    eye = torch.eye(300, dtype=DTYPE)
    expected = torch.linalg.solve(k + noise[..., None, None] * eye, rhs)
    assert got.shape == (3, 2, 300, 3)
    assert float((got - expected).abs().max() / expected.abs().max()) < 1e-9
    assert cg.max_relative_residual <= 10 * 1e-12


def no_deflation(kernel, **kwargs):
    n = kernel.shape[-1]
    empty_values = torch.zeros(*kernel.shape[:-2], 0, dtype=DTYPE)
    empty_vectors = torch.zeros(*kernel.shape[:-2], n, 0, dtype=DTYPE)
    return ShiftedCG(kernel, empty_values, empty_vectors, **kwargs)


def test_deflation_cuts_iterations_where_the_series_would_diverge():
    gen = torch.Generator().manual_seed(1)
    x = 5 * torch.rand(1500, 1, generator=gen, dtype=DTYPE)
    k = rbf_matrix(x, 0.2)
    noise = torch.tensor(1e-4, dtype=DTYPE)
    rhs = torch.randn(1500, 2, generator=gen, dtype=DTYPE)
    spectrum = KernelSpectrum.from_lanczos(k, rank=32, generator=gen)
    with pytest.raises(ValueError, match="diverges"):  # the Taylor complement cannot serve here
        spectrum.check_accuracy(1e-4, 1e-6)
    plain, deflated = (
        no_deflation(k, tol=1e-10, max_iter=5000),
        ShiftedCG.from_spectrum(k, spectrum, tol=1e-10),
    )
    a, b = plain.solve(noise, rhs), deflated.solve(noise, rhs)
    expected = torch.linalg.solve(k + noise * torch.eye(1500, dtype=DTYPE), rhs)
    for got in (a, b):
        assert float((got - expected).abs().max() / expected.abs().max()) < 1e-7
    assert deflated.last_iterations < plain.last_iterations / 3


def test_filters_equal_the_cholesky_chain():
    gen = torch.Generator().manual_seed(2)
    x = 5 * torch.rand(250, 3, generator=gen, dtype=DTYPE)
    k = rbf_matrix(x, 0.7)
    rhs = torch.randn(250, 2, generator=gen, dtype=DTYPE)
    noise = torch.tensor([[0.01, 0.02, 0.05], [0.1, 0.1, 0.1]], dtype=DTYPE)
    spectrum = KernelSpectrum.from_lanczos(k, rank=16, generator=gen)
    cg, chol = ShiftedCG.from_spectrum(k, spectrum, tol=1e-13), ShiftedCholesky(k)
    for filt in (SF.data_centric_targets(noise, 0.3), SF.data_centric_weights(noise, 0.0)):
        expected = chol.apply(filt, rhs)
        assert float((cg.apply(filt, rhs) - expected).abs().max() / expected.abs().max()) < 1e-9
    resolvent = SF.resolvent(noise)
    expected = chol.quad_diag(resolvent, rhs)
    got = cg.quad_diag(resolvent, rhs)
    assert got.shape == (2, 3, 2)
    assert float((got - expected).abs().max() / expected.abs().max()) < 1e-9


def test_chunked_operator_gives_the_same_solves():
    import gpytorch

    gen = torch.Generator().manual_seed(3)
    x = 5 * torch.rand(200, 2, generator=gen, dtype=DTYPE)
    kernel = gpytorch.kernels.RBFKernel().to(DTYPE)
    kernel.lengthscale = 0.5
    op = ChunkedKernelOperator(x, covar_module=kernel, chunk_size=64)
    dense = kernel(x).to_dense().detach()
    rhs = torch.randn(200, 1, generator=gen, dtype=DTYPE)
    noise = torch.tensor(0.01, dtype=DTYPE)
    spectrum = KernelSpectrum.from_lanczos(op, rank=16, generator=gen)
    got = ShiftedCG.from_spectrum(op, spectrum, tol=1e-12).solve(noise, rhs)
    expected = torch.linalg.solve(dense + noise * torch.eye(200, dtype=DTYPE), rhs)
    assert float((got - expected).abs().max() / expected.abs().max()) < 1e-9


def test_zero_right_hand_side_columns_stay_zero():
    k = rbf_matrix(torch.linspace(0, 3, 50, dtype=DTYPE).unsqueeze(-1), 0.5)
    rhs = torch.zeros(50, 2, dtype=DTYPE)
    rhs[:, 1] = 1.0
    got = no_deflation(k, tol=1e-12).solve(torch.tensor(0.1, dtype=DTYPE), rhs)
    assert torch.isfinite(got).all() and float(got[:, 0].abs().max()) == 0.0


def test_warns_when_it_does_not_converge_and_raises_on_nan():
    gen = torch.Generator().manual_seed(4)
    x = 5 * torch.rand(300, 2, generator=gen, dtype=DTYPE)
    k = rbf_matrix(x, 0.5)
    rhs = torch.randn(300, 1, generator=gen, dtype=DTYPE)
    with pytest.warns(NumericalWarning, match="raise rank="):
        no_deflation(k, tol=1e-12, max_iter=3).solve(torch.tensor(1e-3, dtype=DTYPE), rhs)
    bad = k.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        no_deflation(bad).solve(torch.tensor(0.1, dtype=DTYPE), rhs)


def test_bad_arguments_and_trace_raise_clear_errors():
    k = rbf_matrix(torch.linspace(0, 3, 20, dtype=DTYPE).unsqueeze(-1), 0.5)
    with pytest.raises(ValueError, match="tol must be positive"):
        no_deflation(k, tol=0.0)
    with pytest.raises(ValueError, match="max_iter"):
        no_deflation(k, max_iter=0)
    with pytest.raises(ValueError, match="ritz_vectors must have 20 rows"):
        ShiftedCG(k, torch.zeros(1, dtype=DTYPE), torch.zeros(19, 1, dtype=DTYPE))
    with pytest.raises(ValueError, match="from_lanczos"):
        ShiftedCG.from_spectrum(k, KernelSpectrum.from_dense(k))
    with pytest.raises(ValueError, match="trace_estimate"):
        no_deflation(k).trace(SF.resolvent(torch.tensor([0.1], dtype=DTYPE)))
    with pytest.raises(ValueError, match="num_probes must be an integer >= 2"):
        no_deflation(k).trace_estimate(
            SF.resolvent(torch.tensor([0.1], dtype=DTYPE)), 1, torch.Generator()
        )


def dense_solves(k, noise, rhs):
    """``(K + g I)^-1 rhs`` for every entry ``g`` of ``noise``, by dense solves: ``(*s, T, N, r)``."""
    eye = torch.eye(k.shape[-1], dtype=DTYPE)
    solves = [torch.linalg.solve(k + g * eye, rhs) for g in noise.reshape(-1)]
    return torch.stack(solves).reshape(*noise.shape, *rhs.shape)


def multishift_problem(seed, lengthscale, rank, columns, tol):
    """A 300-point kernel, ``columns`` random right-hand sides, a 2 x 4 batch of distinct
    shifts, and a CG engine deflated by a rank-``rank`` Lanczos run."""
    gen = torch.Generator().manual_seed(seed)
    x = 5 * torch.rand(300, 2, generator=gen, dtype=DTYPE)
    k = rbf_matrix(x, lengthscale)
    rhs = torch.randn(300, columns, generator=gen, dtype=DTYPE)
    noise = torch.tensor([[1e-3, 1e-2, 0.1, 1.0], [0.05, 0.2, 0.3, 0.4]], dtype=DTYPE)
    spectrum = KernelSpectrum.from_lanczos(k, rank=rank, residual_tol=1e-9, generator=gen)
    return k, rhs, noise, spectrum, ShiftedCG.from_spectrum(k, spectrum, tol=tol)


@pytest.mark.parametrize("lengthscale, rank", [(0.5, 32), (1.0, 64)])
def test_multishift_variances_equal_dense_quadratic_forms(lengthscale, rank):
    k, left, noise, spectrum, cg = multishift_problem(5, lengthscale, rank, 6, 1e-10)
    got = cg.quad_diag(SF.resolvent(noise), left)
    expected = (left * dense_solves(k, noise, left)).sum(-2)
    assert got.shape == (2, 4, 6)
    assert float(((got - expected).abs() / expected).max()) < 1e-9
    if lengthscale == 1.0:  # smooth enough that some pairs are split off exactly
        assert int(spectrum.resolved.sum()) > 0


def test_multishift_variances_of_a_batch_of_kernels_with_different_resolved_pairs():
    """Pairs resolved in one kernel of a batch and not in the other are split off only where
    they are resolved; the variances still equal dense quadratic forms."""
    gen = torch.Generator().manual_seed(12)
    x = 5 * torch.rand(2, 300, 2, generator=gen, dtype=DTYPE)
    lengthscale = torch.tensor([0.3, 1.5], dtype=DTYPE)[:, None, None]
    k = torch.exp(-0.5 * torch.cdist(x, x).square() / lengthscale**2)
    left = torch.randn(2, 300, 5, generator=gen, dtype=DTYPE)
    noise = torch.tensor([1e-2, 0.1, 1.0], dtype=DTYPE)
    spectrum = KernelSpectrum.from_lanczos(k, rank=48, residual_tol=1e-9, generator=gen)
    counts = spectrum.resolved.sum(-1)
    assert int(counts[1]) > int(counts[0])  # the smoother kernel resolves more pairs
    assert not torch.equal(spectrum.resolved[0], spectrum.resolved[1])
    cg = ShiftedCG.from_spectrum(k, spectrum, tol=1e-10)
    got = cg.quad_diag(SF.resolvent(noise), left)
    eye = torch.eye(300, dtype=DTYPE)
    expected = torch.stack(  # shape (2, 3, 5), one kernel and shift at a time
        [
            torch.stack([(c * torch.linalg.solve(kb + g * eye, c)).sum(-2) for g in noise])
            for kb, c in zip(k, left, strict=True)
        ]
    )
    assert got.shape == (2, 3, 5)
    assert float(((got - expected).abs() / expected).max()) < 1e-9


def test_multishift_warns_when_it_does_not_converge():
    gen = torch.Generator().manual_seed(6)
    k = rbf_matrix(5 * torch.rand(200, 2, generator=gen, dtype=DTYPE), 0.5)
    left = torch.randn(200, 2, generator=gen, dtype=DTYPE)
    noise = torch.tensor([1e-3, 1e-2], dtype=DTYPE)
    with pytest.warns(NumericalWarning, match="multi-shift"):
        no_deflation(k, tol=1e-12, max_iter=3).quad_diag(SF.resolvent(noise), left)


@pytest.mark.parametrize("lengthscale, rank", [(0.5, 32), (1.0, 64)])
def test_multishift_solves_equal_dense_solves(lengthscale, rank):
    k, rhs, noise, spectrum, cg = multishift_problem(7, lengthscale, rank, 2, 1e-11)
    got = cg.apply(SF.resolvent(noise), rhs)
    expected = dense_solves(k, noise, rhs)
    assert got.shape == (2, 4, 300, 2)
    assert float((got - expected).abs().max() / expected.abs().max()) < 1e-9
    # one Krylov run for all eight shifts: no more iterations than the hardest single solve
    single = ShiftedCG(k, spectrum.ritz_values[:0], spectrum.ritz_vectors[:, :0], tol=1e-11)
    single.solve(noise.min(), rhs)
    assert cg.last_iterations <= single.last_iterations + 5


def test_multishift_paths_raise_on_nan_instead_of_returning_it():
    k = rbf_matrix(torch.linspace(0, 3, 40, dtype=DTYPE).unsqueeze(-1), 0.5)
    k[3, 3] = float("nan")
    left = torch.randn(40, 2, dtype=DTYPE)
    resolvent = SF.resolvent(torch.tensor([0.1, 0.2], dtype=DTYPE))
    with pytest.raises(ValueError, match="non-finite"):
        no_deflation(k).quad_diag(resolvent, left)
    with pytest.raises(ValueError, match="non-finite"):
        no_deflation(k).apply(resolvent, left)


def naive_chain(k, noise, alpha, rhs):
    """Targets ``y_t`` and weights ``w_t = (K + g_t I)^-1 y_(t-1)`` by refitting, step by step:
    each ``(*s, T, N, r)`` for ``noise`` of shape ``(*s, T)``."""
    eye = torch.eye(k.shape[-1], dtype=DTYPE)
    targets, weights = [], []
    for schedule in noise.reshape(-1, noise.shape[-1]):
        y, ys, ws = rhs, [], []
        for g in schedule:
            w = torch.linalg.solve(k + g * eye, y)
            y = alpha * rhs + (1 - alpha) * (k @ w)
            ys.append(y)
            ws.append(w)
        targets.append(torch.stack(ys, dim=-3))
        weights.append(torch.stack(ws, dim=-3))
    shape = (*noise.shape[:-1], *targets[0].shape)
    return torch.stack(targets).reshape(shape), torch.stack(weights).reshape(shape)


def relative_error(got, expected):
    return float((got - expected).abs().max() / expected.abs().max())


@pytest.mark.parametrize("lengthscale, alpha", [(0.3, 0.0), (1.0, 0.3)])
def test_krylov_chain_equals_a_naive_refit_loop(lengthscale, alpha):
    gen = torch.Generator().manual_seed(8)
    x = 5 * torch.rand(2, 300, 2, generator=gen, dtype=DTYPE)  # a kernel batch of 2
    k = rbf_matrix(x, lengthscale)
    rhs = torch.randn(2, 300, 2, generator=gen, dtype=DTYPE)
    steps = torch.arange(6, dtype=DTYPE)
    noise = torch.stack([torch.full((6,), 0.01), 0.05 * 1.3**steps, 0.2 / (1 + steps)])
    noise = noise.to(DTYPE)[:, None, :]  # shape (3, 1, 6): a schedule batch against the kernels
    spectrum = KernelSpectrum.from_lanczos(k, rank=48, residual_tol=1e-10, generator=gen)
    cg = ShiftedCG.from_spectrum(k, spectrum, tol=1e-11)
    targets, weights = naive_chain(k, noise.squeeze(1), alpha, rhs)  # (3, 2, 6, 300, 2)
    got_targets = cg.krylov_apply(SF.data_centric_targets(noise, alpha), rhs)
    got_weights = cg.krylov_apply(SF.data_centric_weights(noise, alpha), rhs)
    assert got_weights.shape == weights.shape == (3, 2, 6, 300, 2)
    assert relative_error(got_targets, targets) < 1e-9
    assert relative_error(got_weights, weights) < 1e-9
    assert cg.krylov_error_estimate <= 1e-11
    if lengthscale == 1.0:  # smooth enough that some pairs split off exactly
        assert int(spectrum.resolved.sum()) > 0


class CountingKernel:
    """A kernel matrix that counts the products ``K @ X`` asked of it."""

    def __init__(self, k):
        self.k, self.shape, self.dtype, self.products = k, k.shape, k.dtype, 0

    def __matmul__(self, x):
        self.products += 1
        return self.k @ x


def hard_chain_problem(n=500):
    gen = torch.Generator().manual_seed(9)
    k = rbf_matrix(5 * torch.rand(n, 1, generator=gen, dtype=DTYPE), 0.1)
    rhs = torch.randn(n, 1, generator=gen, dtype=DTYPE)
    spectrum = KernelSpectrum.from_lanczos(k, rank=16, generator=gen)
    return k, rhs, spectrum


def test_krylov_chain_takes_one_run_whatever_the_number_of_steps():
    k, rhs, spectrum = hard_chain_problem()
    products = {}
    for steps in (3, 30):
        noise = torch.full((steps,), 1e-3, dtype=DTYPE)
        counting = CountingKernel(k)
        got = ShiftedCG.from_spectrum(counting, spectrum, tol=1e-10).krylov_apply(
            SF.data_centric_weights(noise), rhs
        )
        assert relative_error(got, naive_chain(k, noise, 0.0, rhs)[1]) < 1e-8
        products[steps] = counting.products
    # ten times the steps, about the same Krylov run
    assert products[30] <= 1.5 * products[3]
    chain = CountingKernel(k)
    cg = ShiftedCG.from_spectrum(chain, spectrum, tol=1e-10)
    ShiftedSolveEngine.apply(cg, SF.data_centric_weights(torch.full((30,), 1e-3, dtype=DTYPE)), rhs)
    assert products[30] < chain.products / 5


def test_apply_takes_the_cheaper_of_the_krylov_run_and_the_chain():
    # A hard spectrum and a long chain: one Krylov run.
    k, rhs, spectrum = hard_chain_problem()
    noise = torch.full((30,), 1e-3, dtype=DTYPE)
    counting, chain = CountingKernel(k), CountingKernel(k)
    got = ShiftedCG.from_spectrum(counting, spectrum, tol=1e-10).apply(
        SF.data_centric_weights(noise), rhs
    )
    cg = ShiftedCG.from_spectrum(chain, spectrum, tol=1e-10)
    ShiftedSolveEngine.apply(cg, SF.data_centric_weights(noise), rhs)
    assert relative_error(got, naive_chain(k, noise, 0.0, rhs)[1]) < 1e-8
    assert counting.products < chain.products / 3
    # A well-deflated spectrum and a short chain: the solves are cheap, so step by step.
    gen = torch.Generator().manual_seed(10)
    k = rbf_matrix(5 * torch.rand(300, 2, generator=gen, dtype=DTYPE), 1.0)
    rhs = torch.randn(300, 1, generator=gen, dtype=DTYPE)
    spectrum = KernelSpectrum.from_lanczos(k, rank=128, generator=gen)
    noise = torch.tensor([0.01, 0.02, 0.03], dtype=DTYPE)
    counting, chain = CountingKernel(k), CountingKernel(k)
    got = ShiftedCG.from_spectrum(counting, spectrum, tol=1e-10).apply(
        SF.data_centric_targets(noise, 0.2), rhs
    )
    cg = ShiftedCG.from_spectrum(chain, spectrum, tol=1e-10)
    ShiftedSolveEngine.apply(cg, SF.data_centric_targets(noise, 0.2), rhs)
    assert relative_error(got, naive_chain(k, noise, 0.2, rhs)[0]) < 1e-8
    assert counting.products <= 1.5 * chain.products + 2


def test_krylov_chain_is_exact_once_its_krylov_space_is_exhausted():
    gen = torch.Generator().manual_seed(11)
    factor = torch.randn(60, 5, generator=gen, dtype=DTYPE)
    k = factor @ factor.mT  # rank 5: every Krylov space has at most 6 dimensions
    rhs = torch.randn(60, 1, generator=gen, dtype=DTYPE)
    noise = torch.tensor([0.1, 0.1, 0.1, 0.1], dtype=DTYPE)
    cg = no_deflation(k, tol=1e-14)
    got = cg.krylov_apply(SF.data_centric_targets(noise), rhs)
    assert cg.last_iterations <= 8
    assert relative_error(got, naive_chain(k, noise, 0.0, rhs)[0]) < 1e-12


def test_krylov_chain_warns_when_it_does_not_converge_and_raises_on_nan():
    k, rhs, _ = hard_chain_problem(200)
    noise = torch.full((5,), 1e-3, dtype=DTYPE)
    cg = no_deflation(k, tol=1e-12, max_iter=10)
    with pytest.warns(NumericalWarning, match="raise max_iter"):
        cg.krylov_apply(SF.data_centric_weights(noise), rhs)
    assert cg.error_estimate(1e-3) > 1e-12
    bad = k.clone()
    bad[5, 5] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        no_deflation(bad).krylov_apply(SF.data_centric_weights(noise), rhs)


def test_a_short_chain_reuses_the_probe_solve_and_a_written_rhs_is_solved_again():
    gen = torch.Generator().manual_seed(12)
    k = rbf_matrix(5 * torch.rand(200, 2, generator=gen, dtype=DTYPE), 1.0)
    rhs = torch.randn(200, 1, generator=gen, dtype=DTYPE)
    spectrum = KernelSpectrum.from_lanczos(k, rank=64, generator=gen)
    noise = torch.tensor([0.01, 0.02], dtype=DTYPE)
    probed, chain = CountingKernel(k), CountingKernel(k)
    ShiftedCG.from_spectrum(probed, spectrum, tol=1e-10).apply(SF.data_centric_weights(noise), rhs)
    cg = ShiftedCG.from_spectrum(chain, spectrum, tol=1e-10)
    ShiftedSolveEngine.apply(cg, SF.data_centric_weights(noise), rhs)
    assert probed.products == chain.products  # the probe is the chain's first solve
    # Writing into the right-hand side invalidates the reuse.
    g = torch.tensor(0.01, dtype=DTYPE)
    first = cg.solve(g, rhs).clone()
    rhs.mul_(2.0)
    assert relative_error(cg.solve(g, rhs), 2 * first) < 1e-8


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_krylov_chain_on_cuda_matches_the_cpu():
    k, rhs, spectrum = hard_chain_problem(300)
    noise = torch.full((2, 20), 1e-3, dtype=DTYPE)
    filt = SF.data_centric_targets(noise, 0.1)
    cpu = ShiftedCG.from_spectrum(k, spectrum, tol=1e-10).krylov_apply(filt, rhs)
    cuda = ShiftedCG(
        k.cuda(),
        spectrum.ritz_values.cuda(),
        spectrum.ritz_vectors.cuda(),
        resolved=spectrum.ritz_resolved.cuda(),  # the pairs from_spectrum splits off
        tol=1e-10,
    ).krylov_apply(SF.data_centric_targets(noise.cuda(), 0.1), rhs.cuda())
    assert cuda.device.type == "cuda"
    assert relative_error(cuda.cpu(), cpu) < 1e-8


def test_a_second_filter_on_the_same_rhs_reuses_the_timed_solve():
    k, rhs, spectrum = hard_chain_problem(300)
    noise = torch.full((10,), 1e-3, dtype=DTYPE)
    counting = CountingKernel(k)
    cg = ShiftedCG.from_spectrum(counting, spectrum, tol=1e-10)
    cg.apply(SF.data_centric_targets(noise), rhs)
    first, timed, krylov = counting.products, cg._solve_iterations, cg.last_iterations
    assert krylov != timed and cg.krylov_error_estimate > 0  # the Krylov run served the chain
    got = cg.apply(SF.data_centric_weights(noise), rhs)
    # no second timed solve: only the Krylov run
    assert counting.products - first == krylov
    assert relative_error(got, naive_chain(k, noise, 0.0, rhs)[1]) < 1e-8


def test_an_operator_that_hands_back_its_input_is_not_written_into():
    """The iterations update the kernel products in place; an operator that returns its input
    (the identity does) must see neither its input nor the answers change."""
    from linear_operator.operators import IdentityLinearOperator

    gen = torch.Generator().manual_seed(21)
    n = 50
    rhs = torch.randn(n, 3, generator=gen, dtype=DTYPE)
    before = rhs.clone()
    eye = IdentityLinearOperator(n, dtype=DTYPE)
    noise = torch.tensor([0.1, 0.5, 2.0], dtype=DTYPE)
    torch.testing.assert_close(no_deflation(eye).solve(noise[1], rhs), rhs / 1.5)
    solves = no_deflation(eye).apply(SF.resolvent(noise), rhs)  # the multi-shift solve
    torch.testing.assert_close(solves, rhs / (1 + noise)[:, None, None])
    variances = no_deflation(eye).quad_diag(SF.resolvent(noise), rhs)  # multi-shift quadrature
    torch.testing.assert_close(variances, rhs.square().sum(-2) / (1 + noise)[:, None])
    chain = no_deflation(eye).krylov_apply(SF.data_centric_targets(noise, 0.2), rhs)
    torch.testing.assert_close(chain, naive_chain(torch.eye(n, dtype=DTYPE), noise, 0.2, rhs)[0])
    assert torch.equal(rhs, before)


def test_runs_longer_than_the_first_record_block_equal_dense_answers():
    """Without deflation on a slowly decaying spectrum every path runs past the 64 iterations
    its per-iteration records start with, and must still equal dense solves."""
    gen = torch.Generator().manual_seed(22)
    k = rbf_matrix(5 * torch.rand(400, 1, generator=gen, dtype=DTYPE), 0.1)
    left = torch.randn(400, 4, generator=gen, dtype=DTYPE)
    noise = torch.tensor([1e-4, 1e-3, 1e-2], dtype=DTYPE)
    cg = no_deflation(k, tol=1e-10)
    got = cg.quad_diag(SF.resolvent(noise), left)
    assert cg.last_iterations > 64
    expected = (left * dense_solves(k, noise, left)).sum(-2)
    assert float(((got - expected).abs() / expected).max()) < 1e-8
    steps = torch.full((5,), 1e-3, dtype=DTYPE)
    chain = cg.krylov_apply(SF.data_centric_weights(steps), left[:, :1])
    assert cg.last_iterations > 64
    assert relative_error(chain, naive_chain(k, steps, 0.0, left[:, :1])[1]) < 1e-8


def matern32_problem(seed):
    """A Matérn-3/2 kernel matrix (lengthscale 1: a slowly decaying spectrum) on 400 inputs
    in [0, 10] and its cross-covariance with 6 test points: ``(K, C)``."""
    gen = torch.Generator().manual_seed(seed)
    x = 10 * torch.rand(400, 1, generator=gen, dtype=DTYPE)
    test_x = 10 * torch.rand(6, 1, generator=gen, dtype=DTYPE)

    def matern32(a, b):
        d = torch.cdist(a, b) * 3**0.5
        return (1 + d) * torch.exp(-d)

    return matern32(x, x), matern32(x, test_x), gen


def test_repeated_shift_quadratic_forms_err_at_second_order():
    """c^T (K + g I)^-1 c from an iterate x with residual r is x^T (c + r), whose error
    r^T (K + g I)^-1 r is non-negative and at most tol^2 |c|^2 / g; the plain c^T x errs at
    first order. The predictive variance k** - c^T (K + g I)^-1 c inherits it."""
    k, left, gen = matern32_problem(21)
    noise, tol = 1e-6, 1e-8
    spectrum = KernelSpectrum.from_lanczos(k, rank=64, generator=gen)
    cg = ShiftedCG.from_spectrum(k, spectrum, tol=tol)
    got = cg.quad_diag(SF.resolvent(torch.tensor([noise, noise], dtype=DTYPE)), left)
    assert got.shape == (2, 6)
    expected = (left * dense_solves(k, torch.tensor(noise, dtype=DTYPE), left)).sum(-2)
    error = expected - got[0]
    bound = tol**2 * left.square().sum(-2) / noise
    assert bool((error >= -1e-9 * expected).all())  # below the exact form, up to rounding
    assert bool((error <= bound).all())
    plain = (left * cg.solve(torch.tensor(noise, dtype=DTYPE), left)).sum(-2)
    assert float((expected - plain).abs().max()) > 10 * float(error.abs().max())


@pytest.mark.parametrize("shifts", [(1e-4, 1e-4), (1e-4, 3e-4, 1e-3)])
def test_quad_error_bound_bounds_the_error_of_every_quadratic_form(shifts):
    """After quad_diag, quad_error_bound holds |r|^2 / g per form (one shift: the solve's true
    residual; several: the base shift's, which bounds every larger shift's): the forms lie below
    the dense ones by at most that. A loose tol makes the truncation visible above rounding."""
    k, left, gen = matern32_problem(22)
    noise = torch.tensor(shifts, dtype=DTYPE)
    spectrum = KernelSpectrum.from_lanczos(k, rank=32, generator=gen)
    cg = ShiftedCG.from_spectrum(k, spectrum, tol=1e-3)
    got = cg.quad_diag(SF.resolvent(noise), left)
    bound = cg.quad_error_bound
    assert bound.shape == got.shape == (len(shifts), 6)
    expected = (left * dense_solves(k, noise, left)).sum(-2)
    error = expected - got
    assert float(error.max()) > 1e-8 * float(expected.max())  # truncation, not rounding
    assert bool((error >= -1e-10 * expected).all())
    assert bool((error <= bound * (1 + 1e-6)).all())
    assert bool((bound <= (1e-3) ** 2 * left.square().sum(-2) / noise.min()).all())
    chol = ShiftedCholesky(k)
    chol.quad_diag(SF.resolvent(noise), left)
    assert chol.quad_error_bound is None  # exact up to rounding


@pytest.mark.parametrize("shifts, tol", [((1e-6, 1e-6), 1e-8), ((1e-6, 3e-6, 1e-5), 1e-7)])
def test_resolvent_cross_products_err_by_a_psd_matrix_of_second_order(shifts, tol):
    """C^T (K + g I)^-1 C from iterates X and residuals R is the symmetric part of
    X^T (C + R), short of the dense value by R^T (K + g I)^-1 R: positive semi-definite and of
    second order. The plain C^T X errs at first order (x^T r, large at a small shift) and is
    not symmetric; the setting of test_repeated_shift_quadratic_forms_err_at_second_order."""
    k, left, gen = matern32_problem(21)
    noise = torch.tensor(shifts, dtype=DTYPE)
    spectrum = KernelSpectrum.from_lanczos(k, rank=64, generator=gen)
    cg = ShiftedCG.from_spectrum(k, spectrum, tol=tol)  # multi-shift stalls at 1.8e-8
    got = cg.cross(SF.resolvent(noise), left, left)
    assert got.shape == (len(shifts), 6, 6)
    assert torch.equal(got, got.mT)
    expected = left.mT @ dense_solves(k, noise, left)
    error = expected - got
    scale = float(expected.abs().max())
    assert float(torch.linalg.eigvalsh(error).min()) >= -1e-10 * scale
    plain = left.mT @ cg.apply(SF.resolvent(noise), left)
    assert float((expected - plain).abs().max()) > 10 * float(error.abs().max())
    other = 2 * left[:, :2]  # C is not B: the plain product
    crossed = cg.cross(SF.resolvent(noise), left, other)
    assert torch.allclose(crossed, left.mT @ cg.apply(SF.resolvent(noise), other))


def test_cg_predictive_variances_at_a_tiny_noise_match_float64_cholesky():
    from gpr_reference import matern_regression_problem

    from gpsd import DataCentricGPR

    kernel, x, y, test_x = matern_regression_problem()
    noise = torch.tensor([1e-8], dtype=DTYPE)
    exact = (
        DataCentricGPR(x, y, kernel, noise=noise, backend="cholesky")
        .predict(test_x)
        .variance.detach()
    )
    # rank 64 < N = 150: CG iterates (758 times); rank >= N would make it one step
    model = DataCentricGPR(x, y, kernel, noise=noise, backend="cg", rtol=1e-8, rank=64)
    cg = model.predict(test_x).variance
    # the first-order quadratic form c^T x would err by 2.3e-3 relative here
    assert float(((cg - exact).abs() / exact).max().detach()) < 1e-6


@pytest.mark.parametrize("engine_kind", ["cholesky", "cg"])
def test_a_solve_written_to_by_the_caller_is_not_reused(engine_kind):
    """``solve`` returns its cached result itself: a caller who scales it in place must not get
    the scaled values back from the next solve with the same right-hand side and shift."""
    gen = torch.Generator().manual_seed(11)
    x = torch.rand(20, 1, generator=gen, dtype=DTYPE)
    k = rbf_matrix(x, 0.3)
    rhs = torch.randn(20, 2, generator=gen, dtype=DTYPE)
    noise = torch.tensor(0.1, dtype=DTYPE)
    if engine_kind == "cholesky":
        engine = ShiftedCholesky(k)
    else:
        engine = ShiftedCG.from_spectrum(k, KernelSpectrum.from_lanczos(k, rank=4), tol=1e-12)
    expected = dense_solves(k, noise.reshape(1), rhs)[0]
    first = engine.solve(noise, rhs)
    torch.testing.assert_close(first, expected, rtol=1e-9, atol=1e-10)
    first.mul_(0.0)
    torch.testing.assert_close(engine.solve(noise, rhs), expected, rtol=1e-9, atol=1e-10)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_engine_takes_a_filter_made_on_the_cpu():
    """ShiftedCG.quad_diag moves the schedule to its device as well as to its dtype."""
    gen = torch.Generator().manual_seed(12)
    k = rbf_matrix(torch.rand(60, 1, generator=gen, dtype=DTYPE), 0.3)
    left = torch.randn(60, 3, generator=gen, dtype=DTYPE)
    filt = SF.resolvent(torch.tensor([0.1, 0.3], dtype=DTYPE))  # on the CPU
    expected = ShiftedCholesky(k).quad_diag(filt, left)
    kc = k.cuda()
    engine = ShiftedCG.from_spectrum(kc, KernelSpectrum.from_lanczos(kc, rank=8), tol=1e-12)
    got = engine.quad_diag(filt, left.cuda())
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-8, atol=1e-10)
    got = engine.apply(filt, left.cuda())
    torch.testing.assert_close(
        got.cpu(), ShiftedCholesky(k).apply(filt, left), rtol=1e-8, atol=1e-10
    )


def test_the_chain_solves_its_first_step_to_tol():
    gen = torch.Generator().manual_seed(0)
    x = 10 * torch.rand(800, 1, generator=gen, dtype=DTYPE)
    kernel = gpytorch.kernels.MaternKernel(nu=0.5).to(DTYPE)
    k = kernel(x).to_dense().detach()
    rhs = torch.sin(x) + 0.1 * torch.randn(800, 1, generator=gen, dtype=DTYPE)
    noise = torch.logspace(-4, 1, 10, dtype=DTYPE)
    tol = 1e-8
    spectrum = KernelSpectrum.from_lanczos(
        k, rank=256, residual_tol=0.1 * tol * 1e-4, generator=torch.Generator().manual_seed(0)
    )
    cg = ShiftedCG.from_spectrum(k, spectrum, tol=tol)
    assert int(cg.resolved.sum()) > 0  # pairs are split off
    weights = cg.krylov_apply(SpectralFilter.data_centric_weights(noise), rhs)
    # step 1 weights solve (K + gamma_1 I) w = y
    residual = (k + noise[0] * torch.eye(800, dtype=DTYPE)) @ weights[0] - rhs
    assert float(residual.norm() / rhs.norm()) <= tol
    # every step against dense solves of the chain
    eye = torch.eye(800, dtype=DTYPE)
    targets = rhs
    for t, g in enumerate(noise):
        expected = torch.linalg.solve(k + g * eye, targets)
        error = float((weights[t] - expected).norm() / expected.norm())
        assert error < 1e-6, (t, error)
        targets = k @ expected


def _explicit_trace(k, filt):
    """``tr f_t(K)`` of every filter by a dense float64 eigendecomposition: ``(*, F)``."""
    evals = torch.linalg.eigvalsh(k)
    return filt.values(evals.clamp_min(0.0)).sum(-1)


@pytest.mark.parametrize("deflation_rank", [0, 64])
def test_trace_estimate_is_within_a_few_standard_errors_of_the_dense_trace(deflation_rank):
    gen = torch.Generator().manual_seed(4)
    x = 5 * torch.rand(250, 2, generator=gen, dtype=DTYPE)
    k = rbf_matrix(x, 0.6)
    noise = torch.tensor([[0.05, 0.05, 0.2], [0.3, 0.1, 0.1]], dtype=DTYPE)
    if deflation_rank:
        spectrum = KernelSpectrum.from_lanczos(k, rank=deflation_rank, residual_tol=1e-4)
        cg = ShiftedCG.from_spectrum(k, spectrum, tol=1e-10)
        assert int(cg.resolved.sum()) > 0
    else:
        cg = no_deflation(k, tol=1e-10)
    assert cg.exact_trace is False
    for filt in (SF.data_centric_residuals(noise, 0.2), SF.resolvent(noise)):
        value, error = cg.trace_estimate(filt, 64, torch.Generator().manual_seed(0))
        expected = _explicit_trace(k, filt)
        assert value.shape == error.shape == (2, 3)
        assert bool((error > 0).all())
        assert bool(((value - expected).abs() <= 5 * error).all()), (value, expected, error)
        assert float(((value - expected) / expected).abs().max()) < 0.05


def test_trace_estimate_depends_on_the_seed_alone_not_on_the_chunks():
    gen = torch.Generator().manual_seed(5)
    k = rbf_matrix(5 * torch.rand(120, 1, generator=gen, dtype=DTYPE), 0.3)
    cg = no_deflation(k, tol=1e-10)
    filt = SF.data_centric_residuals(torch.tensor([0.1, 0.2], dtype=DTYPE))
    once = cg.trace_estimate(filt, 10, torch.Generator().manual_seed(3))
    with gpsd.settings.test_chunk_size(2):  # one probe per chunk (each takes T + 64 vectors)
        chunked = cg.trace_estimate(filt, 10, torch.Generator().manual_seed(3))
    other = cg.trace_estimate(filt, 10, torch.Generator().manual_seed(4))
    torch.testing.assert_close(chunked, once, rtol=1e-9, atol=1e-9)
    assert not torch.allclose(other[0], once[0], rtol=1e-6, atol=0)


def test_trace_estimate_of_a_batch_of_kernels_and_schedules_matches_each_dense_trace():
    gen = torch.Generator().manual_seed(0)
    x = 5 * torch.rand(2, 150, 2, generator=gen, dtype=DTYPE)  # a kernel batch of 2
    k = rbf_matrix(x, 0.7)
    noise = torch.tensor([[[0.05, 0.1]], [[0.2, 0.2]], [[0.1, 0.3]]], dtype=DTYPE)  # (3, 1, 2)
    filt = SF.data_centric_residuals(noise)
    spectrum = KernelSpectrum.from_lanczos(k, rank=32, residual_tol=1e-4, generator=gen)
    cg = ShiftedCG.from_spectrum(k, spectrum, tol=1e-10)
    assert cg.resolved.sum(-1).unique().numel() == 2  # the kernels resolve different pairs
    value, error = cg.trace_estimate(filt, 32, torch.Generator().manual_seed(0))
    expected = _explicit_trace(k, filt)  # shape: (3, 2, 2)
    assert value.shape == error.shape == (3, 2, 2)
    assert bool(((value - expected).abs() <= 5 * error).all())
