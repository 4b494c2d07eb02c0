"""Tests of ShiftedCholesky: factors against the matrices they factor, the cache of factors
within its memory, gradients to the shifts, and its argument checks."""

import math
import warnings

import pytest
import torch
from gpr_reference import explicit_targets, random_rbf_matrix, rbf_gram
from linear_operator.utils.warnings import PerformanceWarning

from gpsd.linalg import (
    KernelSpectrum,
    ShiftedCholesky,
    SpectralFilter,
)

DTYPE = torch.float64


X = torch.linspace(0, 1, 12, dtype=DTYPE)


K = torch.exp(-0.5 * (X[:, None] - X[None, :]).square() / 0.3**2)


@pytest.mark.parametrize(
    "noise, error, message",
    [
        (torch.tensor([0.1, -0.1], dtype=DTYPE), ValueError, "1 of them are not, such as -0.1"),
        (torch.tensor(0.0, dtype=DTYPE), ValueError, "finite positive shifts"),
        (torch.tensor([math.nan], dtype=DTYPE), ValueError, "finite positive shifts"),
        (torch.tensor([math.inf], dtype=DTYPE), ValueError, "finite positive shifts"),
        ([0.1], TypeError, "noise must be a floating-point tensor of shifts, got list"),
        (torch.tensor([1]), TypeError, "got dtype torch.int64"),
    ],
)
def test_bad_shifts_are_named(noise, error, message):
    with pytest.raises(error, match=message):
        ShiftedCholesky(K).factor(noise)


def test_good_shifts_give_the_cholesky_factor():
    noise = torch.tensor([0.1, 0.5], dtype=DTYPE)
    factor = ShiftedCholesky(K).factor(noise)
    eye = torch.eye(12, dtype=DTYPE)
    for i, g in enumerate(noise):
        torch.testing.assert_close(factor[i] @ factor[i].T, K + g * eye, rtol=1e-12, atol=1e-12)


def _cached_bytes(engine):
    return sum(f.numel() * f.element_size() for f in engine._factors.values())


def test_cholesky_cache_counts_the_bytes_of_factors_of_different_sizes():
    """The cache assumed every factor as large as the newest: a factor for three schedules
    followed by two for one overfilled a 3-matrix budget with 5 matrices, and a 4-matrix
    budget holding one small factor dropped it for a 3-matrix one although both fit."""
    gen = torch.Generator().manual_seed(3)
    n = 30
    k = rbf_gram(10 * torch.rand(n, 1, generator=gen, dtype=DTYPE))
    rhs = torch.randn(n, 1, generator=gen, dtype=DTYPE)
    matrix = n * n * 8
    three = torch.tensor([[0.1], [0.2], [0.3]], dtype=DTYPE)  # (3, 1): one factor of 3 matrices
    one = torch.tensor([0.5, 0.6], dtype=DTYPE)  # two factors of 1 matrix
    eye = torch.eye(n, dtype=DTYPE)

    engine = ShiftedCholesky(k, max_cached_bytes=3 * matrix)
    engine.apply(SpectralFilter.resolvent(three), rhs)
    got = engine.apply(SpectralFilter.resolvent(one), rhs)
    assert _cached_bytes(engine) <= 3 * matrix
    expected = torch.stack([torch.linalg.solve(k + g * eye, rhs) for g in one.tolist()])
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)

    engine = ShiftedCholesky(k, max_cached_bytes=4 * matrix)
    engine.apply(SpectralFilter.resolvent(one[:1]), rhs)
    engine.apply(SpectralFilter.resolvent(three), rhs)
    assert len(engine._factors) == 2 and _cached_bytes(engine) == 4 * matrix


def test_a_refactored_shift_gives_identical_results():
    """Dropped factors are recomputed bit for bit (the cache changes costs, not numbers)."""
    gen = torch.Generator().manual_seed(5)
    n = 30
    k = rbf_gram(10 * torch.rand(n, 1, generator=gen, dtype=DTYPE), lengthscale=0.5)
    rhs = torch.randn(n, 2, generator=gen, dtype=DTYPE)
    gammas = torch.tensor([[0.1, 0.2, 0.3, 0.1], [0.4, 0.4, 0.2, 0.3]], dtype=DTYPE)
    filt = SpectralFilter.data_centric_weights(gammas, 0.25)
    roomy = ShiftedCholesky(k).apply(filt, rhs)
    tight = ShiftedCholesky(k, max_cached_bytes=0)
    first = tight.apply(filt, rhs)
    with pytest.warns(Warning, match="dropped from its cache"):
        second = tight.apply(filt, rhs.clone())
    assert torch.equal(first, roomy) and torch.equal(second, roomy)


def test_shift_gradients_reach_each_step_and_every_call():
    """Equal shifts shared one cached factor or solve whatever their autograd history: a step
    whose shift equalled an earlier one's sent its gradient to that one, and a second call with a
    new shift tensor of the same values got a factor holding the first call's (freed) graph.
    Checked against dense solves, one per step."""
    gen = torch.Generator().manual_seed(7)
    n = 25
    k = rbf_gram(10 * torch.rand(n, 1, generator=gen, dtype=DTYPE), lengthscale=0.7)
    rhs = torch.randn(n, 1, generator=gen, dtype=DTYPE)
    left = torch.randn(n, 3, generator=gen, dtype=DTYPE)
    weights = torch.randn(3, n, 1, generator=gen, dtype=DTYPE)
    values = [0.1, 0.1, 0.3]
    eye = torch.eye(n, dtype=DTYPE)

    def dense(noise):
        solves = [torch.linalg.solve(k + g * eye, torch.cat([rhs, left], -1)) for g in noise]
        mean = torch.stack([s[:, :1] for s in solves])
        quad = torch.stack([(left * s[:, 1:]).sum(0) for s in solves])
        return (weights * mean).sum() + quad.sum()

    def chain(engine, noise):
        filt = SpectralFilter.resolvent(noise)
        return (weights * engine.apply(filt, rhs)).sum() + engine.quad_diag(filt, left).sum()

    noise = torch.tensor(values, dtype=DTYPE, requires_grad=True)
    (expected,) = torch.autograd.grad(dense(noise), noise)
    assert not torch.allclose(expected[0], expected[1])  # the equal shifts have their own
    engine = ShiftedCholesky(k)
    chain(engine, torch.tensor(values, dtype=DTYPE))  # a graph-free call first fills the caches
    for _ in range(2):
        noise = torch.tensor(values, dtype=DTYPE, requires_grad=True)
        (got,) = torch.autograd.grad(chain(engine, noise), noise)
        torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-12)
    # the data-centric weights (a product of ratios) against the eigendecomposition
    noise = torch.tensor(values, dtype=DTYPE, requires_grad=True)
    filt = SpectralFilter.data_centric_weights(noise, 0.5)
    (got,) = torch.autograd.grad((weights * engine.apply(filt, rhs)).sum(), noise)
    spectrum = KernelSpectrum.from_dense(k)
    (want,) = torch.autograd.grad((weights * spectrum.apply(filt, rhs)).sum(), noise)
    torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-10)


def test_shifts_that_require_grad_share_factors_under_no_grad(count_calls):
    """A Parameter schedule keeps requires_grad inside no_grad, where no graph is built: equal
    shifts share one factor there, and get one each (for their gradients) outside."""
    import gpsd.linalg.shifted_cholesky as module

    gen = torch.Generator().manual_seed(10)
    k = rbf_gram(10 * torch.rand(30, 1, generator=gen, dtype=DTYPE))
    rhs = torch.randn(30, 1, generator=gen, dtype=DTYPE)
    noise = torch.nn.Parameter(torch.tensor([0.1, 0.1, 0.2, 0.1], dtype=DTYPE))
    factorisations = count_calls(module, "psd_safe_cholesky")
    with torch.no_grad():
        ShiftedCholesky(k).apply(SpectralFilter.data_centric_weights(noise), rhs)
    assert factorisations[0] == 2
    factorisations[0] = 0
    ShiftedCholesky(k).apply(SpectralFilter.data_centric_weights(noise), rhs)
    assert factorisations[0] == 4  # with a graph: one per step, so each gets its gradient


def test_a_factor_made_without_a_graph_does_not_serve_a_call_that_needs_one():
    x = torch.linspace(0, 5, 25, dtype=DTYPE).unsqueeze(-1)
    lengthscale = torch.tensor(0.8, dtype=DTYPE, requires_grad=True)
    k = torch.exp(-0.5 * (x - x.mT).square() / lengthscale**2)
    rhs = torch.ones(25, 1, dtype=DTYPE)
    filt = SpectralFilter.resolvent(torch.tensor([0.1], dtype=DTYPE))
    engine = ShiftedCholesky(k)
    with torch.no_grad():
        engine.apply(filt, rhs)  # caches a factor without a graph
    (got,) = torch.autograd.grad(engine.apply(filt, rhs).sum(), lengthscale, retain_graph=True)
    dense = torch.linalg.solve(k + 0.1 * torch.eye(25, dtype=DTYPE), rhs).sum()
    (want,) = torch.autograd.grad(dense, lengthscale)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


def test_cholesky_keeps_its_factors_within_the_memory_it_is_given():
    k = random_rbf_matrix(60, lengthscale=0.5)
    gammas = torch.linspace(0.1, 1.0, 6, dtype=DTYPE)
    rhs = torch.randn(60, 2, generator=torch.Generator().manual_seed(1), dtype=DTYPE)
    left = torch.randn(60, 4, generator=torch.Generator().manual_seed(2), dtype=DTYPE)
    factor_bytes = 60 * 60 * 8
    small = ShiftedCholesky(k, max_cached_bytes=2 * factor_bytes)
    filt = SpectralFilter.data_centric_targets(gammas, 0.2)
    expected = explicit_targets(k, gammas, 0.2) @ rhs
    torch.testing.assert_close(small.apply(filt, rhs), expected, rtol=1e-9, atol=1e-10)
    assert len(small._factors) == 2  # six shifts factored, two kept
    resolvent = SpectralFilter.resolvent(gammas)
    eye = torch.eye(60, dtype=DTYPE)
    solves = torch.stack([torch.linalg.solve(k + g * eye, left) for g in gammas])
    with pytest.warns(PerformanceWarning, match="dropped from its cache"):
        quad = small.quad_diag(resolvent, left)  # the six shifts again: refactored
    torch.testing.assert_close(quad, (left * solves).sum(-2), rtol=1e-9, atol=1e-10)
    assert len(small._factors) == 2
    default = ShiftedCholesky(k)  # half the free memory: all six fit
    with warnings.catch_warnings():
        warnings.simplefilter("error", PerformanceWarning)
        default.apply(filt, rhs)
        default.quad_diag(resolvent, left)
    assert len(default._factors) == 6 and default.max_cached_bytes > 6 * factor_bytes
