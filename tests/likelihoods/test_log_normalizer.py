"""The continuous-Bernoulli log-normaliser and Prop. 4.1 against mpmath and autograd."""

import math

import cb_reference
import mpmath
import numpy as np
import pytest
import torch

from gpsd.likelihoods import (
    ContinuousBernoulli,
    cb_entropy,
    cb_log_normalizer,
    cb_mean,
    cb_variance,
    log_cb_normalizing_constant,
    log_cb_normalizing_constant_grad,
    log_cb_normalizing_constant_hessian,
)

mpmath.mp.dps = 60
POINTS = [0.0, 1e-8, -1e-8, 1e-4, -1e-4, 0.01, -0.01, 0.5, -0.5, 0.999, 1.0, -1.0, 1.001, 3.0]
POINTS += [-3.0, 16.0, -16.0, 36.0, -36.0, 100.0, -100.0, 700.0, -700.0]


def _ref_logC(a):  # log C(lambda) of eq. (20) with lambda = sigmoid(a), from its definition
    a = mpmath.mpf(a)
    if a == 0:
        return mpmath.log(2)
    lam = 1 / (1 + mpmath.exp(-a))
    return mpmath.log(2 * mpmath.atanh(1 - 2 * lam) / (1 - 2 * lam))


CASES = [
    (cb_log_normalizer, cb_reference.cb_log_normalizer),
    (cb_mean, cb_reference.cb_mean),
    (cb_variance, cb_reference.cb_variance),
    (log_cb_normalizing_constant, _ref_logC),
    (log_cb_normalizing_constant_grad, cb_reference.log_cb_normalizing_constant_grad),
    (log_cb_normalizing_constant_hessian, cb_reference.log_cb_normalizing_constant_hessian),
]


@pytest.mark.parametrize("dtype,rtol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("fn,ref", CASES, ids=[c[0].__name__ for c in CASES])
def test_against_mpmath(fn, ref, dtype, rtol):
    x = torch.tensor(POINTS, dtype=dtype)
    values = fn(x)
    assert values.dtype == dtype
    assert torch.isfinite(values).all()
    for point, value in zip(
        x.tolist(), values.tolist(), strict=True
    ):  # the point as stored in dtype
        if fn is log_cb_normalizing_constant and abs(point) > 30:
            # sigma(a) rounds to 1 at 60 digits: use the equivalent form of Prop. 4.1
            exact = cb_reference.log_cb_normalizing_constant(point)
        else:
            exact = ref(point)
        if exact == 0:
            assert value == 0
        else:
            assert abs(value - float(exact)) <= rtol * abs(float(exact)), (point, value, exact)


def test_monotone_and_positive():
    f = torch.linspace(-800, 800, 20001, dtype=torch.float64)
    mean, var = cb_mean(f), cb_variance(f)
    assert (mean > 0).all() and (mean < 1).all()
    assert (mean.diff() >= 0).all()  # A' increasing because A'' > 0
    assert (var > 0).all()
    logc = log_cb_normalizing_constant(f)
    assert (logc >= math.log(2) - 1e-15).all()
    assert (log_cb_normalizing_constant_hessian(torch.tensor([0.0, 1e-6], dtype=f.dtype)) > 0).all()


def test_relations_between_functions():
    a = torch.linspace(-50, 50, 1001, dtype=torch.float64)
    # log C(sigma(a)) = softplus(a) - A(a), and its derivatives
    torch.testing.assert_close(
        log_cb_normalizing_constant(a),
        a.clamp_min(0) + torch.log1p(torch.exp(-a.abs())) - cb_log_normalizer(a),
        rtol=1e-12,
        atol=1e-12,
    )
    torch.testing.assert_close(
        log_cb_normalizing_constant_grad(a), torch.sigmoid(a) - cb_mean(a), rtol=1e-9, atol=1e-12
    )


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_derivatives_by_autograd(dtype):
    a = torch.tensor(
        [-40.0, -5.0, -1.2, -0.7, -0.3, -1e-3, 1e-3, 0.2, 0.6, 0.9, 1.1, 4.0, 30.0],
        dtype=dtype,
        requires_grad=True,
    )
    tol = dict(rtol=1e-9, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-6)
    (g,) = torch.autograd.grad(log_cb_normalizing_constant(a).sum(), a, create_graph=True)
    torch.testing.assert_close(g, log_cb_normalizing_constant_grad(a), **tol)
    (h,) = torch.autograd.grad(g.sum(), a)
    torch.testing.assert_close(h, log_cb_normalizing_constant_hessian(a).detach(), **tol)
    (dA,) = torch.autograd.grad(cb_log_normalizer(a).sum(), a, create_graph=True)
    torch.testing.assert_close(dA, cb_mean(a), **tol)
    (d2A,) = torch.autograd.grad(dA.sum(), a)
    torch.testing.assert_close(d2A, cb_variance(a).detach(), **tol)


def test_rejects_non_float():
    with pytest.raises(TypeError, match="f must be"):
        cb_log_normalizer(torch.tensor([1, 2]))
    with pytest.raises(TypeError, match="a must be"):
        log_cb_normalizing_constant([0.1])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_entropy_against_mpmath(dtype):
    # H = A(f) - f A'(f) as written cancels the f/2 of both terms near 0 (2.4e-4 relative error
    # at f = 1e-3 in float32) and their f at large f (4.6e-5 at f = 1e4 in float32)
    points = [1e-6, 1e-4, 1e-3, -1e-3, 0.1, 0.5, 0.99, 1.0, -1.0, 1.01, 3.0, 30.0, -30.0, 1e3, 1e4]
    points += [1e5, -1e5, 1e6]
    f = torch.tensor(points, dtype=dtype, requires_grad=True)
    values = ContinuousBernoulli(f).entropy()
    (grad,) = torch.autograd.grad(values.sum(), f)
    for point, value, g in zip(f.tolist(), values.tolist(), grad.tolist(), strict=True):
        with mpmath.workdps(80):
            exact = cb_reference.cb_entropy(point)
            exact_grad = -point * cb_reference.cb_variance(point)  # dH/df = -f A''(f)
        assert abs(value - float(exact)) <= 8 * torch.finfo(dtype).eps * abs(float(exact)), point
        assert abs(g - float(exact_grad)) <= 1e3 * torch.finfo(dtype).eps * abs(float(exact_grad))


DTYPES = [torch.float32, torch.float64]
REFERENCES = [
    (cb_log_normalizer, cb_reference.cb_log_normalizer),
    (cb_mean, cb_reference.cb_mean),
    (cb_variance, cb_reference.cb_variance),
    (cb_entropy, cb_reference.cb_entropy),
    (log_cb_normalizing_constant, cb_reference.log_cb_normalizing_constant),
    (log_cb_normalizing_constant_grad, cb_reference.log_cb_normalizing_constant_grad),
]
# a coarse grid over |f| <= 3.5, and dense ones just above the series cut-offs (|f| = 1.25 of the
# log C family, 2.5 of the A family), where the closed forms take over and the error is largest
GRID = np.concatenate(
    [np.linspace(0.3, 3.5, 97), [6.0, 20.0, 100.0], np.linspace(1.25, 1.5, 301)]
    + [np.linspace(2.5, 3.0, 301)]
)
GRID = np.concatenate([GRID, -GRID])
#: the relative error the module docs state, in machine epsilons
STATED_BOUND = 6


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("function", "reference"), REFERENCES, ids=lambda r: r.__name__)
def test_log_normalizer_family_is_within_the_stated_bound_of_mpmath(dtype, function, reference):
    eps = torch.finfo(dtype).eps
    f = torch.tensor(GRID, dtype=dtype)
    for fi, oi in zip(f.tolist(), function(f).tolist(), strict=True):
        with mpmath.workdps(50):
            exact = reference(mpmath.mpf(fi))
        assert abs(oi - exact) <= STATED_BOUND * eps * abs(exact), fi


@pytest.mark.parametrize("dtype", DTYPES)
def test_log_cb_hessian_absolute_error_is_below_1_5_eps_through_its_sign_change(dtype):
    # it vanishes at |a| = 2.678 (a relative error means nothing there)
    eps = torch.finfo(dtype).eps
    a = torch.tensor(GRID, dtype=dtype)
    for ai, oi in zip(a.tolist(), log_cb_normalizing_constant_hessian(a).tolist(), strict=True):
        with mpmath.workdps(50):
            exact = cb_reference.log_cb_normalizing_constant_hessian(ai)
        assert abs(oi - exact) <= 1.5 * eps, ai
