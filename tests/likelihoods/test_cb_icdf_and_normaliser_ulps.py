"""Review s23: the continuous Bernoulli's inverse CDF and log-normaliser family against mpmath."""

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

DTYPES = [torch.float32, torch.float64]
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
    # before: 1 + log(u + (1 - u) e^-f) / f for f >= 1 gave 0 for f = 1, u = 1e-10 in float32
    # (exact 1.718e-10) and a relative error of 2.3e-7 for f = 1.5 in float64; the gradient was
    # 0 there, and off by 2e7 ulps (float32) as u -> 1 at f = 1.01
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


REFERENCES = [
    (cb_log_normalizer, cb_reference.cb_log_normalizer),
    (cb_mean, cb_reference.cb_mean),
    (cb_variance, cb_reference.cb_variance),
    (cb_entropy, cb_reference.cb_entropy),
    (log_cb_normalizing_constant, cb_reference.log_cb_normalizing_constant),
    (log_cb_normalizing_constant_grad, cb_reference.log_cb_normalizing_constant_grad),
]
# around the old series cutoffs (0.5 and 1), where the closed forms cancelled, and the new ones
GRID = np.concatenate([np.linspace(0.3, 3.5, 97), [6.0, 20.0, 100.0]])
GRID = np.concatenate([GRID, -GRID])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("function", "reference"), REFERENCES, ids=lambda r: r.__name__)
def test_log_normalizer_family_is_within_4_ulps_of_mpmath(dtype, function, reference):
    # before (this grid): cb_entropy 19 ulps (float64) / 26 (float32) near |f| = 1.05,
    # log_cb_normalizing_constant_grad 16, cb_variance 12 / 13
    eps = torch.finfo(dtype).eps
    f = torch.tensor(GRID, dtype=dtype)
    for fi, oi in zip(f.tolist(), function(f).tolist(), strict=True):
        with mpmath.workdps(50):
            exact = reference(mpmath.mpf(fi))
        assert abs(oi - exact) <= 4 * eps * abs(exact), fi


@pytest.mark.parametrize("dtype", DTYPES)
def test_log_cb_hessian_absolute_error_is_below_1_5_eps_through_its_sign_change(dtype):
    # it vanishes at |a| = 2.678 (a relative error means nothing there); before: 6.7 eps
    eps = torch.finfo(dtype).eps
    a = torch.tensor(GRID, dtype=dtype)
    for ai, oi in zip(a.tolist(), log_cb_normalizing_constant_hessian(a).tolist(), strict=True):
        with mpmath.workdps(50):
            exact = cb_reference.log_cb_normalizing_constant_hessian(ai)
        assert abs(oi - exact) <= 1.5 * eps, ai
