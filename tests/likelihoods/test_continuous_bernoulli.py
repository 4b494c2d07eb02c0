"""The ContinuousBernoulli distribution: density, moments, CDF, inverse CDF and sampling, and
their gradients in the logits, against mpmath, scipy quadrature and torch's distribution."""

import math

import cb_reference
import mpmath
import pytest
import torch
from scipy import integrate

from gpsd.likelihoods import ContinuousBernoulli

U = [0.01, 0.2, 0.5, 0.8, 0.99]
DTYPES = [torch.float32, torch.float64]


def _grad_per_entry(fn, logit, values):
    """d fn(values)[i] / d logit for every i (one scalar logit, a vector of values)."""
    logits = logit.detach().expand(values.shape).clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(fn(ContinuousBernoulli(logits), values).sum(), logits)
    return grad.tolist()


@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
@pytest.mark.parametrize("f", [0.0, 3e-7, -3e-7, 3e-6, 1e-5, -1e-5, 1e-4, 1e-3, 0.1, -0.5, 0.9])
def test_cdf_and_icdf_logit_gradients_near_zero_logits(dtype, rtol, f):
    # The reparameterisation gradient of rsample is d icdf(u) / df. Above |f| = 1e-6 both were
    # differentiated through closed forms whose terms cancel: in float32 7x off at f = 3e-6, 58 %
    # at 1e-5, 1.4 % at 1e-4 (the cdf's even changed sign); in float64 2e-8 off at f = 1e-6.
    logit = torch.tensor(f, dtype=dtype)
    values = torch.tensor(U, dtype=dtype)
    fm = mpmath.mpf(logit.item())
    with mpmath.workdps(40):
        for name, reference in (("icdf", cb_reference.icdf), ("cdf", cb_reference.cdf)):
            got = _grad_per_entry(lambda d, v, name=name: getattr(d, name)(v), logit, values)
            for value, g in zip(values.tolist(), got, strict=True):
                exact = float(mpmath.diff(reference, (fm, mpmath.mpf(value)), (1, 0)))  # d/df
                # the gradients are O(0.1); near u = 1 they vanish and only absolute accuracy counts
                assert abs(g - exact) <= rtol * max(abs(exact), 1e-2), (name, value, g, exact)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cdf_and_icdf_values_near_zero_logits(dtype):
    # the |f| < 1 branch keeps the values within a few ulps
    logits = torch.tensor([0.0, 1e-9, 3e-6, -1e-4, 0.01, 0.3, -0.7, 0.999, -0.999], dtype=dtype)
    values = torch.tensor(U, dtype=dtype)
    dist = ContinuousBernoulli(logits.unsqueeze(-1))
    cdf, icdf = dist.cdf(values), dist.icdf(values)
    tol = 4 * torch.finfo(dtype).eps
    with mpmath.workdps(40):
        for i, f in enumerate(logits.tolist()):
            for j, v in enumerate(values.tolist()):
                fm, vm = mpmath.mpf(f), mpmath.mpf(v)
                assert abs(cdf[i, j].item() - float(cb_reference.cdf(fm, vm))) <= tol, (f, v)
                assert abs(icdf[i, j].item() - float(cb_reference.icdf(fm, vm))) <= tol, (f, v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rsample_gradient_at_a_zero_uniform_draw_with_very_negative_logits(dtype, monkeypatch):
    # torch.rand returns exactly 0 with probability 2^-24 in float32. icdf's stand-in value 1 at
    # u = 0 gave log1p(expm1(f)) = log1p(-1) = -inf below f = -17 (float32) / -37 (float64), and
    # torch.where passed the NaN gradient on: one such draw made the whole logits.grad NaN.
    logits = torch.tensor([-20.0, -40.0, -800.0, 3.0], dtype=dtype, requires_grad=True)
    monkeypatch.setattr(torch, "rand", lambda *args, **kwargs: torch.zeros(*args, **kwargs))
    samples = ContinuousBernoulli(logits).rsample()
    assert (samples == 0).all()
    samples.sum().backward()
    assert torch.equal(logits.grad, torch.zeros_like(logits))  # icdf(0) = 0 for every logit


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cdf_gradients_above_the_support_are_zero(dtype):
    # F(y) = 1 for y >= 1, and exp(f (y - 1)) must not overflow before the final clamp
    logits = torch.tensor([5.0, 30.0, -30.0, 0.5], dtype=dtype, requires_grad=True)
    values = torch.tensor([1e3, 1e6, 1e6, 3.0], dtype=dtype, requires_grad=True)
    cdf = ContinuousBernoulli(logits).cdf(values)
    assert torch.equal(cdf, torch.ones_like(cdf))
    cdf.sum().backward()
    assert torch.equal(logits.grad, torch.zeros_like(logits))
    assert torch.equal(values.grad, torch.zeros_like(values))


def test_cdf_and_icdf_of_nan_are_nan():
    # a NaN value must not be taken for 0 (value > 0 is False for NaN)
    dist = ContinuousBernoulli(torch.tensor([-3.0, 0.2, 4.0]))
    nan = torch.full((3,), float("nan"))
    assert dist.cdf(nan).isnan().all()
    assert dist.icdf(nan).isnan().all()


LOGITS = [1e-3, 0.5, 0.99, 1.0, 1.01, 1.5, 3.0, 5.0, 20.0, 80.0, 100.0, 500.0, 800.0]
LOGITS += [-f for f in LOGITS]


PROBABILITIES = [1e-30, 1e-10, 1e-4, 0.3, 0.5, 0.5000001, 0.7, 1 - 1e-4, 1 - 1e-7, 1 - 1e-12]


def _icdf_and_derivative(f: float, u: float) -> tuple[mpmath.mpf, mpmath.mpf]:
    """The inverse CDF and its derivative in f, :math:`u e^f / (f (1 + u (e^f - 1))) - F^{-1} / f`."""
    with mpmath.workdps(60):
        value = cb_reference.icdf(f, u)
        f, u = mpmath.mpf(f), mpmath.mpf(u)
        return value, u * mpmath.exp(f) / (f * (1 + u * mpmath.expm1(f))) - value / f


@pytest.mark.parametrize("dtype", DTYPES)
def test_icdf_and_its_logit_gradient_match_mpmath_over_logits_and_probabilities(dtype):
    # the naive 1 + log(u + (1 - u) e^-f) / f for f >= 1 gives 0 for f = 1, u = 1e-10 in float32
    # (exact 1.718e-10) and a relative error of 2.3e-7 for f = 1.5 in float64, with a gradient
    # of 0 there, and 2e7 ulps off (float32) as u -> 1 at f = 1.01
    eps = torch.finfo(dtype).eps
    f, u = torch.meshgrid(
        torch.tensor(LOGITS, dtype=dtype), torch.tensor(PROBABILITIES, dtype=dtype), indexing="ij"
    )
    f = f.clone().requires_grad_(True)
    out = ContinuousBernoulli(f).icdf(u)
    (grad,) = torch.autograd.grad(out.sum(), f)
    assert torch.isfinite(grad).all()
    inside = (u > 0) & (u < 1)  # float32 rounds 1 - 1e-12 to 1
    for fi, ui, oi, gi in zip(
        f[inside].tolist(), u[inside].tolist(), out[inside], grad[inside], strict=True
    ):
        value, derivative = _icdf_and_derivative(fi, ui)
        assert abs(oi.item() - value) <= 4 * eps * value, (fi, ui)
        assert abs(gi.item() - derivative) <= 16 * eps * abs(derivative), (fi, ui)


@pytest.mark.parametrize("f", [-300.0, -20.0, -2.0, -1e-7, 0.0, 1e-5, 0.7, 5.0, 40.0, 300.0])
def test_density_integrates_to_one_and_moments(f):
    dist = ContinuousBernoulli(torch.tensor(f, dtype=torch.float64))

    def density(y):
        return math.exp(dist.log_prob(torch.tensor(y, dtype=torch.float64)).item())

    points = [1e-3, 1 - 1e-3] if abs(f) > 50 else None
    mass = integrate.quad(density, 0, 1, points=points, epsabs=1e-13, epsrel=1e-11, limit=200)[0]
    first = integrate.quad(lambda y: y * density(y), 0, 1, points=points, epsabs=1e-13, limit=200)[
        0
    ]
    second = integrate.quad(
        lambda y: y * y * density(y), 0, 1, points=points, epsabs=1e-13, limit=200
    )[0]
    assert mass == pytest.approx(1.0, rel=1e-8)
    assert dist.mean.item() == pytest.approx(first, rel=1e-7, abs=1e-12)
    assert dist.variance.item() == pytest.approx(second - first**2, rel=1e-6, abs=1e-12)

    def neg_plogp(y):
        lp = dist.log_prob(torch.tensor(y, dtype=torch.float64)).item()
        return -math.exp(lp) * lp

    entropy = integrate.quad(neg_plogp, 0, 1, points=points, epsabs=1e-12, limit=200)[0]
    assert dist.entropy().item() == pytest.approx(entropy, rel=1e-6, abs=1e-9)


def test_matches_torch_distribution_where_torch_is_accurate():
    logits = torch.linspace(-8, 8, 33, dtype=torch.float64)
    y = torch.rand(33, dtype=torch.float64)
    ours = ContinuousBernoulli(logits)
    ref = torch.distributions.ContinuousBernoulli(logits=logits, lims=(0.4999, 0.5001))
    torch.testing.assert_close(ours.log_prob(y), ref.log_prob(y), rtol=1e-8, atol=1e-8)
    torch.testing.assert_close(ours.mean, ref.mean, rtol=1e-8, atol=1e-8)


def test_cdf_icdf_and_sampling():
    logits = torch.tensor([-200.0, -10.0, -0.5, 0.0, 1e-8, 2.0, 30.0, 200.0], dtype=torch.float64)
    dist = ContinuousBernoulli(logits)
    u = torch.tensor([0.05, 0.3, 0.5, 0.77, 0.95], dtype=torch.float64).unsqueeze(-1)
    y = dist.icdf(u)
    torch.testing.assert_close(dist.cdf(y), u.expand_as(y), rtol=1e-9, atol=1e-12)
    samples = dist.sample(torch.Size([40000]))
    assert samples.shape == (40000, 8)
    assert ((samples >= 0) & (samples <= 1)).all()
    se = (dist.variance / 40000).sqrt()
    assert ((samples.mean(0) - dist.mean).abs() < 5 * se + 1e-12).all()


def test_rsample_is_differentiable():
    logits = torch.tensor([-3.0, 0.5, 4.0], dtype=torch.float64, requires_grad=True)
    torch.manual_seed(3)
    y = ContinuousBernoulli(logits).rsample(torch.Size([50000]))
    y.mean(0).sum().backward()
    # d mean / d f = A''(f) = variance, by the reparameterisation gradient
    expected = ContinuousBernoulli(logits.detach()).variance
    torch.testing.assert_close(logits.grad, expected, rtol=0.05, atol=2e-3)


def test_float32_large_logits_are_exact_where_torch_is_not():
    f = torch.tensor([-30.0, -20.0, 20.0, 30.0])
    y = torch.tensor([0.5, 0.5, 0.5, 0.5])
    ours = ContinuousBernoulli(f).log_prob(y).double()
    f64 = f.double()
    exact = y.double() * f64 - (
        f64.clamp_min(0) + torch.log(-torch.expm1(-f64.abs())) - f64.abs().log()
    )
    torch.testing.assert_close(ours, exact, rtol=1e-6, atol=1e-6)


def test_validation_of_support():
    dist = ContinuousBernoulli(torch.zeros(2), validate_args=True)
    with pytest.raises(ValueError):
        dist.log_prob(torch.tensor([0.5, 1.5]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("f", [2e-6, 1e-5, 1e-4, 1e-3, 0.5, 0.99, 1.01, -1e-3])
def test_icdf_near_zero_logits_against_mpmath(dtype, f):
    mpmath = pytest.importorskip("mpmath")
    mpmath.mp.dps = 40
    logit = torch.tensor(f, dtype=dtype)
    u = torch.tensor([1e-3, 0.1, 0.3, 0.5, 0.9, 0.999], dtype=dtype)
    got = ContinuousBernoulli(logit).icdf(u).double()
    ref = [float(cb_reference.icdf(float(logit), float(v))) for v in u]
    # exp(-f) rounded, then divided by f, would lose 2e-2 at f = 2e-6 in float32
    tol = 4 * torch.finfo(dtype).eps
    torch.testing.assert_close(got, torch.tensor(ref, dtype=torch.float64), rtol=0, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_mean_and_entropy_gradients_at_very_negative_logits(dtype):
    # d/df A'(f) = A''(f) ~ 1/f^2 there; exp(-f) must not overflow into a NaN gradient
    logits = torch.tensor([-100.0, -800.0, -1e4], dtype=dtype, requires_grad=True)
    ContinuousBernoulli(logits).mean.sum().backward()
    torch.testing.assert_close(logits.grad, 1 / logits.detach() ** 2, rtol=1e-5, atol=0)
    logits.grad = None
    # H = A(f) - f A'(f), dH/df = -f A''(f) ~ -1/f
    ContinuousBernoulli(logits).entropy().sum().backward()
    torch.testing.assert_close(logits.grad, -1 / logits.detach(), rtol=1e-5, atol=0)


def test_cdf_and_icdf_gradients_at_zero_are_zero():
    for f in (2.0, -3.0, 1e4):
        logit = torch.tensor(f, dtype=torch.float64, requires_grad=True)
        dist = ContinuousBernoulli(logit)
        (dist.cdf(torch.tensor(0.0, dtype=torch.float64)) + dist.icdf(torch.tensor(0.0))).backward()
        assert float(logit.grad) == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_icdf_at_one_is_one_with_zero_gradient(dtype):
    # F^{-1}(1) = 1 for every f; at f << 0 expm1(f) rounds to -1 and log1p(u expm1(f)) is -inf,
    # which gives the right value after clamping but must not give a NaN gradient
    logits = torch.tensor([-1e4, -100.0, -3.0, 0.5, 3.0, 1e4], dtype=dtype, requires_grad=True)
    out = ContinuousBernoulli(logits).icdf(torch.ones(6, dtype=dtype))
    out.sum().backward()
    assert torch.equal(out.detach(), torch.ones(6, dtype=dtype))
    assert torch.equal(logits.grad, torch.zeros(6, dtype=dtype))


def _log_density_mpmath(y: float, f: float) -> mpmath.mpf:
    """:math:`y f - \\log((e^f - 1) / f)`."""
    with mpmath.workdps(60):
        y, f = mpmath.mpf(y), mpmath.mpf(f)
        return y * f - mpmath.log(mpmath.expm1(f) / f)


@pytest.mark.parametrize("dtype", DTYPES)
def test_log_prob_at_large_finite_logits_matches_mpmath(dtype):
    eps = torch.finfo(dtype).eps
    targets = [0.0, 1e-3, 0.3, 0.5, 0.999, 1.0]
    logits = [30.0, 1e3, 1e5, 1e7, -30.0, -1e3, -1e5, -1e7]
    for f in logits:
        for y in targets:
            got = ContinuousBernoulli(torch.tensor(f, dtype=dtype)).log_prob(
                torch.tensor(y, dtype=dtype)
            )
            exact = _log_density_mpmath(float(torch.tensor(y, dtype=dtype)), f)
            assert abs(got.item() - float(exact)) <= 4 * eps * abs(float(exact)) + 4 * eps, (f, y)


@pytest.mark.parametrize("dtype", DTYPES)
def test_log_prob_at_infinite_logits_is_the_limit(dtype):
    # f -> +inf: (y - 1) f + log f + log(1 - e^-f) -> -inf for y < 1, +inf for y = 1;
    # f -> -inf: p(y | f) = p(1 - y | -f) -> -inf for y > 0, +inf for y = 0
    inf = float("inf")
    y = torch.tensor([0.0, 1e-3, 0.5, 0.999, 1.0], dtype=dtype)
    at_plus = ContinuousBernoulli(torch.full_like(y, inf)).log_prob(y)
    at_minus = ContinuousBernoulli(torch.full_like(y, -inf)).log_prob(y)
    assert at_plus.tolist() == [-inf, -inf, -inf, -inf, inf]
    assert at_minus.tolist() == [inf, -inf, -inf, -inf, -inf]
    # the limits are the ones that large finite logits approach (mpmath at |f| = 1e7)
    for y_i, plus, minus in zip(y.tolist(), at_plus.tolist(), at_minus.tolist(), strict=True):
        assert math.copysign(1.0, float(_log_density_mpmath(y_i, 1e7))) == math.copysign(1.0, plus)
        assert math.copysign(1.0, float(_log_density_mpmath(y_i, -1e7))) == math.copysign(
            1.0, minus
        )
    # finite logits alongside are untouched, and the gradient in an infinite logit is 0
    f = torch.tensor([inf, -inf, 2.0], dtype=dtype, requires_grad=True)
    out = ContinuousBernoulli(f).log_prob(torch.tensor(0.3, dtype=dtype))
    (grad,) = torch.autograd.grad(out[2], f)
    assert grad[:2].tolist() == [0.0, 0.0]
    assert torch.isfinite(grad).all()
    # a NaN target stays NaN (without the support check, which refuses it)
    dist = ContinuousBernoulli(torch.tensor(inf, dtype=dtype), validate_args=False)
    assert dist.log_prob(torch.tensor(float("nan"), dtype=dtype)).isnan()
