"""Audit of the spectral filters, their power series and the shifted-Cholesky chain, each
checked against an independent computation (mpmath Taylor expansions of the closed forms, naive
float64 refits by ``torch.linalg.solve``)."""

import math

import mpmath
import pytest
import torch
from gpr_reference import explicit_targets

from gpsd.linalg import KernelSpectrum, ShiftedCholesky, SpectralFilter

F64 = torch.float64


def _rbf(x, lengthscale=1.0):
    return torch.exp(-0.5 * (x - x.mT).square() / lengthscale**2)


# ------------------------------------------------------------------ negative rounding eigenvalues
def test_negative_rounding_eigenvalues_are_evaluated_as_zero():
    """d = -1e-17 next to gamma = 1e-17 gave 1/(d + gamma) = inf: a PSD kernel's negative
    eigenvalues are rounding, and the filters there must take their values at 0."""
    gamma = torch.tensor([1e-17, 1e-17], dtype=F64)
    d = torch.tensor([-1e-17, -3e-18, 0.0], dtype=F64)
    for filt in (
        SpectralFilter.resolvent(gamma),
        SpectralFilter.data_centric_weights(gamma),
        SpectralFilter.data_centric_targets(gamma, 0.3),
    ):
        values = filt.values(d)
        assert torch.isfinite(values).all()
        torch.testing.assert_close(values, filt.values(torch.zeros(3, dtype=F64)), rtol=0, atol=0)


def test_float32_dense_spectrum_keeps_filters_in_range():
    """A float32 eigendecomposition of an RBF kernel has eigenvalues down to about -8e-6; with
    gamma = 1e-5, three data-centric steps took filter values down to -7000 and the targets erred
    by 96 times their norm (2e-3 once negative eigenvalues count as 0)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.linspace(0, 10, 200, dtype=F64).unsqueeze(-1)
    k = _rbf(x, lengthscale=2.0)
    y = torch.sin(x) + 0.1 * torch.randn(200, 1, generator=gen, dtype=F64)
    gammas = torch.full((3,), 1e-5, dtype=F64)
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


# ------------------------------------------------------------------ power series
def _mp_taylor(kind, gammas, alpha, order):
    """Taylor coefficients at 0 of the closed-form filters, by mpmath at 40 digits."""
    mpmath.mp.dps = 40
    gammas = [mpmath.mpf(g) for g in gammas]
    alpha = mpmath.mpf(alpha)

    def targets(t, d):
        f = mpmath.mpf(1)
        for g in gammas[:t]:
            f = alpha + (1 - alpha) * d / (d + g) * f
        return f

    out = []
    for t in range(1, len(gammas) + 1):
        if kind == "targets":
            fn = lambda d, t=t: targets(t, d)  # noqa: E731
        else:
            fn = lambda d, t=t: targets(t - 1, d) / (d + gammas[t - 1])  # noqa: E731
        out.append([float(c) for c in mpmath.taylor(fn, 0, order)])
    return torch.tensor(out, dtype=F64)


@pytest.mark.parametrize("kind", ["targets", "weights"])
@pytest.mark.parametrize("alpha", [0.0, 0.4])
def test_series_match_mpmath_to_rounding(kind, alpha):
    """d/(d + g) was expanded as 1 - g fl(1/g), which is 1.1e-16 for g = 49: F_3 got a
    coefficient 3.7e-13 at order 2 where it has a zero of order 3, and the higher coefficients
    erred by 5.4e-12 relative."""
    gammas = [0.3, 1e-3, 49.0, 7.0]
    series = getattr(SpectralFilter, f"data_centric_{kind}")(
        torch.tensor(gammas, dtype=F64), alpha
    ).series(6)
    expected = _mp_taylor(kind, gammas, alpha, 6)
    torch.testing.assert_close(series, expected, rtol=1e-14, atol=0)
    if alpha == 0.0:  # F_t has a zero of order t at 0, G_t one of order t - 1
        lead = 0 if kind == "targets" else 1
        for t in range(len(gammas)):
            assert torch.all(series[t, : t + 1 - lead] == 0)


def test_float32_series_do_not_overflow_where_the_coefficients_are_finite():
    """gamma = 1e-8 in float32: the coefficient 1e32 of d^4 in d/(d + gamma) was formed as
    gamma * gamma^-5 = gamma * inf, giving -inf, and the product with the next step NaN."""
    gamma = torch.full((2,), 1e-8, dtype=torch.float32)
    got = SpectralFilter.data_centric_targets(gamma).series(4)
    expected = SpectralFilter.data_centric_targets(gamma.double()).series(4)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=0)
    assert float(expected[1, 4]) == pytest.approx(3e32, rel=1e-6)  # (d / (d + g))^2 at d^4


# ------------------------------------------------------------------ the Cholesky cache
def _cached_bytes(engine):
    return sum(f.numel() * f.element_size() for f in engine._factors.values())


def test_cholesky_cache_counts_the_bytes_of_factors_of_different_sizes():
    """The cache assumed every factor as large as the newest: a factor for three schedules
    followed by two for one overfilled a 3-matrix budget with 5 matrices, and a 4-matrix
    budget holding one small factor dropped it for a 3-matrix one although both fit."""
    gen = torch.Generator().manual_seed(3)
    n = 30
    k = _rbf(10 * torch.rand(n, 1, generator=gen, dtype=F64))
    rhs = torch.randn(n, 1, generator=gen, dtype=F64)
    matrix = n * n * 8
    three = torch.tensor([[0.1], [0.2], [0.3]], dtype=F64)  # (3, 1): one factor of 3 matrices
    one = torch.tensor([0.5, 0.6], dtype=F64)  # two factors of 1 matrix
    eye = torch.eye(n, dtype=F64)

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
    k = _rbf(10 * torch.rand(n, 1, generator=gen, dtype=F64), lengthscale=0.5)
    rhs = torch.randn(n, 2, generator=gen, dtype=F64)
    gammas = torch.tensor([[0.1, 0.2, 0.3, 0.1], [0.4, 0.4, 0.2, 0.3]], dtype=F64)
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
    k = _rbf(10 * torch.rand(n, 1, generator=gen, dtype=F64), lengthscale=0.7)
    rhs = torch.randn(n, 1, generator=gen, dtype=F64)
    left = torch.randn(n, 3, generator=gen, dtype=F64)
    weights = torch.randn(3, n, 1, generator=gen, dtype=F64)
    values = [0.1, 0.1, 0.3]
    eye = torch.eye(n, dtype=F64)

    def dense(gamma):
        solves = [torch.linalg.solve(k + g * eye, torch.cat([rhs, left], -1)) for g in gamma]
        mean = torch.stack([s[:, :1] for s in solves])
        quad = torch.stack([(left * s[:, 1:]).sum(0) for s in solves])
        return (weights * mean).sum() + quad.sum()

    def chain(engine, gamma):
        filt = SpectralFilter.resolvent(gamma)
        return (weights * engine.apply(filt, rhs)).sum() + engine.quad_diag(filt, left).sum()

    gamma = torch.tensor(values, dtype=F64, requires_grad=True)
    (expected,) = torch.autograd.grad(dense(gamma), gamma)
    assert not torch.allclose(expected[0], expected[1])  # the equal shifts have their own
    engine = ShiftedCholesky(k)
    chain(engine, torch.tensor(values, dtype=F64))  # a graph-free call first fills the caches
    for _ in range(2):
        gamma = torch.tensor(values, dtype=F64, requires_grad=True)
        (got,) = torch.autograd.grad(chain(engine, gamma), gamma)
        torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-12)
    # the data-centric weights (a product of ratios) against the eigendecomposition
    gamma = torch.tensor(values, dtype=F64, requires_grad=True)
    filt = SpectralFilter.data_centric_weights(gamma, 0.5)
    (got,) = torch.autograd.grad((weights * engine.apply(filt, rhs)).sum(), gamma)
    spectrum = KernelSpectrum.from_dense(k)
    (want,) = torch.autograd.grad((weights * spectrum.apply(filt, rhs)).sum(), gamma)
    torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-10)


# ------------------------------------------------------------------ edge cases that were right
def test_alpha_one_keeps_the_targets_and_the_long_schedule_underflows_cleanly():
    """alpha = 1: F_t = 1 and G_t = R_t. T = 1000 steps: F_t = (d / (d + g))^t, no NaN."""
    gen = torch.Generator().manual_seed(6)
    n = 20
    k = _rbf(5 * torch.rand(n, 1, generator=gen, dtype=F64))
    rhs = torch.randn(n, 1, generator=gen, dtype=F64)
    gammas = torch.tensor([0.2, 0.05], dtype=F64)
    for engine in (KernelSpectrum.from_dense(k), ShiftedCholesky(k)):
        torch.testing.assert_close(
            engine.apply(SpectralFilter.data_centric_targets(gammas, 1.0), rhs),
            rhs.expand(2, n, 1),
            rtol=1e-10,
            atol=1e-10,
        )
        torch.testing.assert_close(
            engine.apply(SpectralFilter.data_centric_weights(gammas, 1.0), rhs),
            engine.apply(SpectralFilter.resolvent(gammas), rhs),
            rtol=1e-10,
            atol=1e-10,
        )
    d = torch.tensor([0.0, 1e-3, 0.5, 40.0], dtype=F64)
    values = SpectralFilter.data_centric_targets(torch.full((1000,), 0.1, dtype=F64)).values(d)
    for t in (0, 9, 999):
        expected = [float((mpmath.mpf(v) / (mpmath.mpf(v) + 0.1)) ** (t + 1)) for v in d.tolist()]
        torch.testing.assert_close(values[t], torch.tensor(expected, dtype=F64), rtol=1e-12, atol=0)


# ------------------------------------------------------------------ argument checks
@pytest.mark.parametrize(
    "make, error, match",
    [
        (
            lambda: SpectralFilter.resolvent(torch.tensor([0.1, 0.0], dtype=F64)),
            ValueError,
            "gamma",
        ),
        (lambda: SpectralFilter.resolvent(torch.tensor([-0.5], dtype=F64)), ValueError, "gamma"),
        (
            lambda: SpectralFilter.data_centric_weights(torch.tensor([math.nan])),
            ValueError,
            "gamma",
        ),
        (
            lambda: SpectralFilter.data_centric_targets(torch.tensor([math.inf])),
            ValueError,
            "gamma",
        ),
        (lambda: SpectralFilter.resolvent(torch.tensor(0.1)), ValueError, "gamma"),
        (lambda: SpectralFilter.resolvent(torch.zeros(2, 0)), ValueError, "gamma"),
        (lambda: SpectralFilter.resolvent([0.1, 0.2]), TypeError, "gamma"),
        (lambda: SpectralFilter.resolvent(torch.tensor([1, 2])), TypeError, "gamma"),
        (
            lambda: SpectralFilter.data_centric_targets(torch.tensor([0.1]), math.nan),
            ValueError,
            "alpha",
        ),
        (
            lambda: SpectralFilter.data_centric_weights(torch.tensor([0.1]), 1.5),
            ValueError,
            "alpha",
        ),
        (
            lambda: SpectralFilter.data_centric_weights(torch.tensor([0.1]), -0.1),
            ValueError,
            "alpha",
        ),
        (
            lambda: SpectralFilter.data_centric_weights(torch.tensor([0.1]), "0.5"),
            ValueError,
            "alpha",
        ),
        (
            lambda: ShiftedCholesky(torch.eye(3), max_cached_bytes=-1),
            ValueError,
            "max_cached_bytes",
        ),
        (
            lambda: ShiftedCholesky(torch.eye(3), max_cached_bytes="1e9"),
            ValueError,
            "max_cached_bytes",
        ),
    ],
)
def test_bad_filter_arguments_are_named(make, error, match):
    """These gave NaN or infinite values (gamma 0, negative, NaN; alpha NaN), integer series
    truncated to 0 (1 / (d + 2) as [0, 0, 0]), or an IndexError from deep inside."""
    with pytest.raises(error, match=match):
        make()


def _counting(monkeypatch, module, name):
    calls = [0]
    original = getattr(module, name)

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def test_one_solve_per_data_centric_step_under_inference_mode(monkeypatch):
    """A step needs (K + g I)^-1 f twice (weights and targets): the solve was shared through
    the tensors' write counters, which inference tensors lack, so each step solved twice."""
    gen = torch.Generator().manual_seed(9)
    k = _rbf(10 * torch.rand(30, 1, generator=gen, dtype=F64))
    rhs = torch.randn(30, 1, generator=gen, dtype=F64)
    filt = SpectralFilter.data_centric_weights(torch.tensor([0.1, 0.2, 0.3], dtype=F64), 0.25)
    expected = KernelSpectrum.from_dense(k).apply(filt, rhs)
    for context in (torch.no_grad, torch.inference_mode):
        engine = ShiftedCholesky(k)
        solves = _counting(monkeypatch, engine, "_solve")
        with context():
            got = engine.apply(filt, rhs.clone())
        assert solves[0] == 3, context.__name__
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


def test_shifts_that_require_grad_share_factors_under_no_grad(monkeypatch):
    """A Parameter schedule keeps requires_grad inside no_grad; it was factored per step there
    too. Without a graph being built, equal shifts share one factor again."""
    import gpsd.linalg.shifted_cholesky as module

    gen = torch.Generator().manual_seed(10)
    k = _rbf(10 * torch.rand(30, 1, generator=gen, dtype=F64))
    rhs = torch.randn(30, 1, generator=gen, dtype=F64)
    gamma = torch.nn.Parameter(torch.tensor([0.1, 0.1, 0.2, 0.1], dtype=F64))
    factorisations = _counting(monkeypatch, module, "psd_safe_cholesky")
    with torch.no_grad():
        ShiftedCholesky(k).apply(SpectralFilter.data_centric_weights(gamma), rhs)
    assert factorisations[0] == 2
    factorisations[0] = 0
    ShiftedCholesky(k).apply(SpectralFilter.data_centric_weights(gamma), rhs)
    assert factorisations[0] == 4  # with a graph: one per step, so each gets its gradient


def test_a_factor_made_without_a_graph_does_not_serve_a_call_that_needs_one():
    x = torch.linspace(0, 5, 25, dtype=F64).unsqueeze(-1)
    lengthscale = torch.tensor(0.8, dtype=F64, requires_grad=True)
    k = torch.exp(-0.5 * (x - x.mT).square() / lengthscale**2)
    rhs = torch.ones(25, 1, dtype=F64)
    filt = SpectralFilter.resolvent(torch.tensor([0.1], dtype=F64))
    engine = ShiftedCholesky(k)
    with torch.no_grad():
        engine.apply(filt, rhs)  # caches a factor without a graph
    (got,) = torch.autograd.grad(engine.apply(filt, rhs).sum(), lengthscale, retain_graph=True)
    dense = torch.linalg.solve(k + 0.1 * torch.eye(25, dtype=F64), rhs).sum()
    (want,) = torch.autograd.grad(dense, lengthscale)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
