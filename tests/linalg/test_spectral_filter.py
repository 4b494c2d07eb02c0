"""Tests of SpectralFilter: the filter values at eigenvalues and their Taylor series against
mpmath and explicit matrices, and its argument checks."""

import math

import mpmath
import pytest
import torch
from gpr_reference import rbf_gram

from gpsd.linalg import (
    KernelSpectrum,
    ShiftedCholesky,
    SpectralFilter,
)

DTYPE = torch.float64


@pytest.mark.parametrize("alpha", [0.0, 0.4])
def test_series_are_the_taylor_coefficients(alpha):
    """Coefficients at 0 against repeated autograd derivatives of the filter values."""
    gammas = torch.tensor([0.3, 0.7, 1.1], dtype=DTYPE)
    for filt in (
        SpectralFilter.data_centric_targets(gammas, alpha),
        SpectralFilter.data_centric_weights(gammas, alpha),
        SpectralFilter.resolvent(gammas),
    ):
        series = filt.series(4)  # shape: (3, 5)
        for t in range(3):

            def f(d, t=t, filt=filt):
                return filt.values(d.reshape(1))[t, 0]

            d0 = torch.zeros((), dtype=DTYPE, requires_grad=True)
            derivative = f(d0)
            for j in range(5):
                assert float(derivative.detach()) == pytest.approx(
                    float(series[t, j]) * math.factorial(j), rel=1e-10, abs=1e-12
                )
                if j < 4:
                    derivative = torch.autograd.grad(derivative, d0, create_graph=True)[0]


@pytest.mark.parametrize("alpha", [0.0, 0.4])
def test_combined_chain_series_are_the_taylor_coefficients(alpha):
    """The combined chain's filters (2 outer by 2 inner steps, a batch of two grids): their
    coefficients at 0 against repeated autograd derivatives of their values."""
    grids = torch.tensor([[0.3, 0.7, 1.1, 0.5], [0.2, 0.2, 0.2, 0.2]], dtype=DTYPE)
    for make in (
        SpectralFilter.combined_targets,
        SpectralFilter.combined_weights,
        SpectralFilter.combined_student_targets,
        SpectralFilter.combined_residuals,
    ):
        filt = make(grids, 2, alpha)
        series = filt.series(4)  # shape: (2, 4, 5)
        for s in range(2):
            for t in range(4):

                def f(d, s=s, t=t, filt=filt):
                    return filt.values(d.reshape(1))[s, t, 0]

                d0 = torch.zeros((), dtype=DTYPE, requires_grad=True)
                derivative = f(d0)
                for j in range(5):
                    assert float(derivative.detach()) == pytest.approx(
                        float(series[s, t, j]) * math.factorial(j), rel=1e-10, abs=1e-12
                    )
                    if j < 4:
                        derivative = torch.autograd.grad(derivative, d0, create_graph=True)[0]


def test_combined_chain_by_shifted_solves_equals_its_values_at_the_eigenvalues():
    """The combined filters applied by Cholesky solves (ShiftedSolveAlgebra, a batch of two
    grids) against their values on a dense eigendecomposition."""
    k = rbf_gram(torch.linspace(0, 5, 12, dtype=DTYPE).unsqueeze(-1))
    rhs = torch.randn(12, 2, generator=torch.Generator().manual_seed(0), dtype=DTYPE)
    grids = torch.tensor([[0.3, 0.7, 1.1, 0.5, 0.2, 0.9], [0.2] * 6], dtype=DTYPE)
    d, v = torch.linalg.eigh(k)
    engine = ShiftedCholesky(k)
    for make in (
        SpectralFilter.combined_targets,
        SpectralFilter.combined_weights,
        SpectralFilter.combined_residuals,
    ):
        filt = make(grids, 3, 0.25)
        want = v @ (filt.values(d).unsqueeze(-1) * (v.mT @ rhs))  # shape: (2, 6, 12, 2)
        torch.testing.assert_close(engine.apply(filt, rhs), want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    "inner_steps, error",
    [
        (4, "inner_steps must be a positive integer dividing the 6 steps"),
        (0, "inner_steps"),
        (1.0, "inner_steps"),
    ],
)
def test_combined_chain_needs_inner_steps_dividing_the_schedule(inner_steps, error):
    with pytest.raises(ValueError, match=error):
        SpectralFilter.combined_weights(torch.full((6,), 0.1, dtype=DTYPE), inner_steps)


def test_negative_rounding_eigenvalues_are_evaluated_as_zero():
    """d = -1e-17 next to noise = 1e-17 would give 1/(d + noise) = inf: a PSD kernel's negative
    eigenvalues are rounding, and the filters there must take their values at 0."""
    noise = torch.tensor([1e-17, 1e-17], dtype=DTYPE)
    d = torch.tensor([-1e-17, -3e-18, 0.0], dtype=DTYPE)
    for filt in (
        SpectralFilter.resolvent(noise),
        SpectralFilter.data_centric_weights(noise),
        SpectralFilter.data_centric_targets(noise, 0.3),
    ):
        values = filt.values(d)
        assert torch.isfinite(values).all()
        torch.testing.assert_close(values, filt.values(torch.zeros(3, dtype=DTYPE)), rtol=0, atol=0)


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
    return torch.tensor(out, dtype=DTYPE)


@pytest.mark.parametrize("kind", ["targets", "weights"])
@pytest.mark.parametrize("alpha", [0.0, 0.4])
def test_series_match_mpmath_to_rounding(kind, alpha):
    """d/(d + g) expanded as 1 - g fl(1/g) is 1.1e-16 for g = 49: F_3 would get a coefficient
    3.7e-13 at order 2 where it has a zero of order 3, and the higher coefficients would err by
    5.4e-12 relative."""
    gammas = [0.3, 1e-3, 49.0, 7.0]
    series = getattr(SpectralFilter, f"data_centric_{kind}")(
        torch.tensor(gammas, dtype=DTYPE), alpha
    ).series(6)
    expected = _mp_taylor(kind, gammas, alpha, 6)
    torch.testing.assert_close(series, expected, rtol=1e-14, atol=0)
    if alpha == 0.0:  # F_t has a zero of order t at 0, G_t one of order t - 1
        lead = 0 if kind == "targets" else 1
        for t in range(len(gammas)):
            assert torch.all(series[t, : t + 1 - lead] == 0)


def test_float32_series_do_not_overflow_where_the_coefficients_are_finite():
    """noise = 1e-8 in float32: the coefficient 1e32 of d^4 in d/(d + noise), formed as
    noise * noise^-5 = noise * inf, would be -inf, and the product with the next step NaN."""
    noise = torch.full((2,), 1e-8, dtype=torch.float32)
    got = SpectralFilter.data_centric_targets(noise).series(4)
    expected = SpectralFilter.data_centric_targets(noise.double()).series(4)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=0)
    assert float(expected[1, 4]) == pytest.approx(3e32, rel=1e-6)  # (d / (d + g))^2 at d^4


def test_alpha_one_keeps_the_targets_and_the_long_schedule_underflows_cleanly():
    """alpha = 1: F_t = 1 and G_t = R_t. T = 1000 steps: F_t = (d / (d + g))^t, no NaN."""
    gen = torch.Generator().manual_seed(6)
    n = 20
    k = rbf_gram(5 * torch.rand(n, 1, generator=gen, dtype=DTYPE))
    rhs = torch.randn(n, 1, generator=gen, dtype=DTYPE)
    gammas = torch.tensor([0.2, 0.05], dtype=DTYPE)
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
    d = torch.tensor([0.0, 1e-3, 0.5, 40.0], dtype=DTYPE)
    values = SpectralFilter.data_centric_targets(torch.full((1000,), 0.1, dtype=DTYPE)).values(d)
    for t in (0, 9, 999):
        expected = [float((mpmath.mpf(v) / (mpmath.mpf(v) + 0.1)) ** (t + 1)) for v in d.tolist()]
        torch.testing.assert_close(
            values[t], torch.tensor(expected, dtype=DTYPE), rtol=1e-12, atol=0
        )


@pytest.mark.parametrize(
    "make, error, match",
    [
        (
            lambda: SpectralFilter.resolvent(torch.tensor([0.1, 0.0], dtype=DTYPE)),
            ValueError,
            "noise",
        ),
        (lambda: SpectralFilter.resolvent(torch.tensor([-0.5], dtype=DTYPE)), ValueError, "noise"),
        (
            lambda: SpectralFilter.data_centric_weights(torch.tensor([math.nan])),
            ValueError,
            "noise",
        ),
        (
            lambda: SpectralFilter.data_centric_targets(torch.tensor([math.inf])),
            ValueError,
            "noise",
        ),
        (lambda: SpectralFilter.resolvent(torch.tensor(0.1)), ValueError, "noise"),
        (lambda: SpectralFilter.resolvent(torch.zeros(2, 0)), ValueError, "noise"),
        (lambda: SpectralFilter.resolvent([0.1, 0.2]), TypeError, "noise"),
        (lambda: SpectralFilter.resolvent(torch.tensor([1, 2])), TypeError, "noise"),
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
    """Unchecked, these give NaN or infinite values (noise 0, negative, NaN; alpha NaN), integer
    series truncated to 0 (1 / (d + 2) as [0, 0, 0]), or an IndexError from deep inside."""
    with pytest.raises(error, match=match):
        make()
