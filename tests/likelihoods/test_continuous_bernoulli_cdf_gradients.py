"""Gradients of ContinuousBernoulli.cdf, .icdf and .rsample in the logits, against mpmath."""

import cb_reference
import mpmath
import pytest
import torch

from gpsd.likelihoods import ContinuousBernoulli

U = [0.01, 0.2, 0.5, 0.8, 0.99]


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
    # the rewritten |f| < 1 branch keeps the values as accurate as before (a few ulps)
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
    # F(y) = 1 for y >= 1, but exp(f (y - 1)) overflowed before the final clamp: NaN gradients
    logits = torch.tensor([5.0, 30.0, -30.0, 0.5], dtype=dtype, requires_grad=True)
    values = torch.tensor([1e3, 1e6, 1e6, 3.0], dtype=dtype, requires_grad=True)
    cdf = ContinuousBernoulli(logits).cdf(values)
    assert torch.equal(cdf, torch.ones_like(cdf))
    cdf.sum().backward()
    assert torch.equal(logits.grad, torch.zeros_like(logits))
    assert torch.equal(values.grad, torch.zeros_like(values))


def test_cdf_and_icdf_of_nan_are_nan():
    # a NaN value was taken for 0 (value > 0 is False for NaN) and gave F = 0 and F^{-1} = 0
    dist = ContinuousBernoulli(torch.tensor([-3.0, 0.2, 4.0]))
    nan = torch.full((3,), float("nan"))
    assert dist.cdf(nan).isnan().all()
    assert dist.icdf(nan).isnan().all()
