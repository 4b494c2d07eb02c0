"""LaplacePosterior: mode, evidence and predictive against a NumPy implementation of Rasmussen &
Williams' Algorithms 3.1 and 3.2 (logistic likelihood, with a prior mean and a temperature), a
batch against a loop, the evidence's gradient against finite differences of that implementation,
and the checks of its arguments."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gpr_reference import rbf_kernel

from gpsd.data.toy import sine_classification
from gpsd.laplace import BernoulliLogitTerms, LaplaceMode, LaplacePosterior, find_laplace_mode

DT = torch.float64


# ------------------------------------------------------------------ the NumPy reference
def _rw_laplace(K, y, m, tau=1.0):
    """Algorithm 3.1 (Newton, stable B-form) for the logistic likelihood raised to ``tau``, with
    prior mean ``m``; returns the mode, W^1/2, L, the gradient at the mode and log q(y)."""
    n = len(y)
    f = m.copy()
    for _ in range(200):
        pi = 1.0 / (1.0 + np.exp(-f))
        W = tau * pi * (1.0 - pi)
        sW = np.sqrt(W)
        L = np.linalg.cholesky(np.eye(n) + sW[:, None] * K * sW[None, :])
        b = W * (f - m) + tau * (y - pi)
        c = np.linalg.solve(L.T, np.linalg.solve(L, sW * (K @ b)))
        a = b - sW * c
        f_new = m + K @ a
        done = np.max(np.abs(f_new - f)) < 1e-14 * (1.0 + np.max(np.abs(f)))
        f = f_new
        if done:
            break
    pi = 1.0 / (1.0 + np.exp(-f))
    W = tau * pi * (1.0 - pi)
    sW = np.sqrt(W)
    L = np.linalg.cholesky(np.eye(n) + sW[:, None] * K * sW[None, :])
    grad = tau * (y - pi)  # = K^{-1}(f - m) at the mode
    log_lik = tau * np.sum(y * f - np.logaddexp(0.0, f))
    log_q = -0.5 * grad @ (f - m) + log_lik - np.sum(np.log(np.diag(L)))
    return f, sW, L, grad, log_q


def _rw_predictive(sW, L, grad, k_cross, k_test, m_test):
    """Algorithm 3.2 (latent mean and covariance), with the test prior mean."""
    mean = m_test + k_cross @ grad
    v = np.linalg.solve(L, sW[:, None] * k_cross.T)
    return mean, k_test - v.T @ v


def _data(n, seed):
    """Inputs ``(n, 1)``, labels ``(n,)`` and test inputs ``(M, 1)``."""
    x, y, test_x = sine_classification(n, seed=seed)
    return x.unsqueeze(-1), y, test_x.unsqueeze(-1)


def _problem(n=25, seed=0, outputscale=3.0, lengthscale=0.8):
    x, y, test_x = _data(n, seed)
    kernel = rbf_kernel(outputscale, lengthscale, DT)
    with torch.no_grad():
        K = kernel(x).to_dense()
        K_cross = kernel(test_x[:7], x).to_dense()
        K_test = kernel(test_x[:7]).to_dense()
    m = 0.3 * torch.sin(x[:, 0])
    m_test = 0.3 * torch.sin(test_x[:7, 0])
    return K, y, m, K_cross, K_test, m_test


# ------------------------------------------------------------------ values
@pytest.mark.parametrize("tau", [1.0, 2.5])
def test_mode_evidence_and_predictive_match_algorithms_3_1_and_3_2(tau):
    K, y, m, K_cross, K_test, m_test = _problem()
    post = LaplacePosterior(m, K, BernoulliLogitTerms(), y, temperature=tau)
    f, sW, L, grad, log_q = _rw_laplace(K.numpy(), y.numpy(), m.numpy(), tau)
    np.testing.assert_allclose(post.mode.f.numpy(), f, rtol=0, atol=1e-10)
    np.testing.assert_allclose(post.mode.sqrt_W.numpy(), sW, rtol=0, atol=1e-10)
    np.testing.assert_allclose(post.mode.chol_B.numpy(), L, rtol=0, atol=1e-10)
    assert post.log_marginal_likelihood().item() == pytest.approx(log_q, rel=1e-10)
    mean_ref, cov_ref = _rw_predictive(sW, L, grad, K_cross.numpy(), K_test.numpy(), m_test.numpy())
    mean, cov = post.predictive(K_cross, K_test, m_test, diag=False)
    np.testing.assert_allclose(mean.numpy(), mean_ref, rtol=0, atol=1e-10)
    np.testing.assert_allclose(cov.numpy(), cov_ref, rtol=0, atol=1e-10)
    mean_d, var = post.predictive(K_cross, torch.diagonal(K_test), m_test, diag=True)
    np.testing.assert_allclose(mean_d.numpy(), mean_ref, rtol=0, atol=1e-10)
    np.testing.assert_allclose(var.numpy(), np.diag(cov_ref), rtol=0, atol=1e-10)


def test_covariance_correction_is_the_inverse_of_K_plus_W_inverse():
    K, y, m, *_ = _problem(n=15, seed=2)
    post = LaplacePosterior(m, K, "logit", y)
    W = post.mode.W.numpy()
    expected = np.linalg.inv(K.numpy() + np.diag(1.0 / W))
    np.testing.assert_allclose(post.covariance_correction().numpy(), expected, atol=1e-10)


def test_a_batch_of_priors_equals_a_loop():
    problems = [_problem(n=20, seed=3, outputscale=s, lengthscale=l) for s, l in [(1, 0.5), (4, 1)]]
    K = torch.stack([p[0] for p in problems])  # shape: (2, n, n)
    m = torch.stack([p[2] for p in problems])
    y = problems[0][1]  # one set of labels for both priors (the same inputs)
    K_cross = torch.stack([p[3] for p in problems])
    K_test = torch.stack([torch.diagonal(p[4]) for p in problems])
    batched = LaplacePosterior(m, K, BernoulliLogitTerms(), y)
    mean, var = batched.predictive(K_cross, K_test, diag=True)
    evidence = batched.log_marginal_likelihood()
    assert evidence.shape == (2,) and mean.shape == var.shape == (2, 7)
    for i in range(2):
        alone = LaplacePosterior(m[i], K[i], BernoulliLogitTerms(), y)
        mean_i, var_i = alone.predictive(K_cross[i], K_test[i], diag=True)
        torch.testing.assert_close(batched.mode.f[i], alone.mode.f, rtol=0, atol=1e-10)
        torch.testing.assert_close(evidence[i], alone.log_marginal_likelihood(), rtol=1e-12, atol=0)
        torch.testing.assert_close(mean[i], mean_i, rtol=0, atol=1e-10)
        torch.testing.assert_close(var[i], var_i, rtol=0, atol=1e-10)


# ------------------------------------------------------------------ gradients
def _softplus(value: float) -> float:
    return float(np.logaddexp(0.0, value))


def _evidence_by_numpy(x, y, m, raw_scale, raw_length):
    with torch.no_grad():
        kernel = rbf_kernel(_softplus(raw_scale), _softplus(raw_length), DT)
        K = kernel(x).to_dense().numpy()
    return _rw_laplace(K, y.numpy(), m.numpy())[-1]


def test_evidence_gradient_in_the_kernel_hyperparameters_matches_finite_differences():
    x, y, _ = _data(20, 5)
    m = 0.2 * torch.cos(x[:, 0])
    kernel = rbf_kernel(2.0, 0.7, DT)
    raw = [kernel.raw_outputscale, kernel.base_kernel.raw_lengthscale]
    post = LaplacePosterior(m, kernel(x), BernoulliLogitTerms(), y)  # a LinearOperator
    grads = torch.autograd.grad(post.log_marginal_likelihood(), raw)
    s, ell = raw[0].item(), raw[1].item()
    h = 1e-5
    fd_scale = (
        _evidence_by_numpy(x, y, m, s + h, ell) - _evidence_by_numpy(x, y, m, s - h, ell)
    ) / (2 * h)
    fd_length = (
        _evidence_by_numpy(x, y, m, s, ell + h) - _evidence_by_numpy(x, y, m, s, ell - h)
    ) / (2 * h)
    assert grads[0].item() == pytest.approx(fd_scale, rel=1e-6, abs=1e-8)
    assert grads[1].item() == pytest.approx(fd_length, rel=1e-6, abs=1e-8)


def test_predictive_mean_carries_the_modes_derivative():
    # the total derivative of the predictive mean in the output scale, mode included
    x, y, test_x = _data(20, 6)
    kernel = rbf_kernel(2.0, 0.7, DT)
    m = torch.zeros(20, dtype=DT)
    post = LaplacePosterior(m, kernel(x).to_dense(), BernoulliLogitTerms(), y)
    mean, _ = post.predictive(kernel(test_x[:3], x).to_dense(), kernel(test_x[:3], diag=True))
    (grad,) = torch.autograd.grad(mean.sum(), kernel.raw_outputscale)

    def mean_by_numpy(raw_scale):
        with torch.no_grad():
            k = rbf_kernel(_softplus(raw_scale), 0.7, DT)
            K, k_cross = k(x).to_dense().numpy(), k(test_x[:3], x).to_dense().numpy()
        gradient = _rw_laplace(K, y.numpy(), m.numpy())[3]
        return (k_cross @ gradient).sum()

    s, h = kernel.raw_outputscale.item(), 1e-5
    fd = (mean_by_numpy(s + h) - mean_by_numpy(s - h)) / (2 * h)
    assert grad.item() == pytest.approx(fd, rel=1e-6, abs=1e-8)


def test_a_given_mode_is_adopted_and_its_evidence_differentiates():
    x, y, _ = _data(20, 7)
    kernel = rbf_kernel(2.0, 0.7, DT)
    m = torch.zeros(20, dtype=DT)
    with torch.no_grad():
        found = find_laplace_mode(kernel(x).to_dense(), y, BernoulliLogitTerms())
    post = LaplacePosterior(m, kernel(x).to_dense(), BernoulliLogitTerms(), y, mode=found)
    assert post.mode is found
    fresh = LaplacePosterior(m, kernel(x).to_dense(), BernoulliLogitTerms(), y)
    torch.testing.assert_close(
        post.log_marginal_likelihood(), fresh.log_marginal_likelihood(), rtol=1e-12, atol=0
    )
    (grad,) = torch.autograd.grad(post.log_marginal_likelihood(), kernel.raw_outputscale)
    assert torch.isfinite(grad) and grad != 0


# ------------------------------------------------------------------ bad input
def _valid():
    K, y, m, *_ = _problem(n=10, seed=1)
    return m, K, y


@pytest.mark.parametrize(
    "change, error, match",
    [
        (lambda m, K, y: (m, K[:, :-1], y), ValueError, r"prior_covariance must have shape"),
        (lambda m, K, y: (m, K[0], y), ValueError, r"prior_covariance must have shape"),
        (lambda m, K, y: (m, K.to(torch.int64), y), TypeError, r"prior_covariance must be float"),
        (lambda m, K, y: (m, K.numpy(), y), TypeError, r"prior_covariance must be a tensor"),
        (lambda m, K, y: (m[:-1], K, y), ValueError, r"prior_mean must have shape \(\*b, 10\)"),
        (lambda m, K, y: (m.float(), K, y), TypeError, r"prior_mean has dtype torch.float32"),
        (lambda m, K, y: (m, K, y[:-1]), ValueError, r"train_y must have shape \(\*b, 10\)"),
        (
            lambda m, K, y: (m, K.expand(2, 10, 10), torch.ones(3, 10, dtype=DT)),
            ValueError,
            r"the batch shapes do not broadcast: .*prior_covariance \(2,\), train_y \(3,\)",
        ),
    ],
    ids=[
        "not-square",
        "vector",
        "integer",
        "array",
        "mean-length",
        "mean-dtype",
        "y-length",
        "batch",
    ],
)
def test_bad_shapes_and_dtypes_are_refused_naming_the_argument(change, error, match):
    m, K, y = change(*_valid())
    with pytest.raises(error, match=match):
        LaplacePosterior(m, K, BernoulliLogitTerms(), y)


@pytest.mark.parametrize("name", ["prior_mean", "prior_covariance", "train_y", "init_f"])
def test_non_finite_values_are_refused_naming_the_argument(name):
    m, K, y = _valid()
    args = {"prior_mean": m.clone(), "prior_covariance": K.clone(), "train_y": y.clone()}
    init_f = torch.zeros(10, dtype=DT) if name == "init_f" else None
    target = init_f if name == "init_f" else args[name]
    target.view(-1)[3] = float("nan")
    with pytest.raises(ValueError, match=rf"{name} must be finite"):
        LaplacePosterior(
            args["prior_mean"], args["prior_covariance"], "logit", args["train_y"], init_f=init_f
        )


def test_targets_outside_the_support_and_a_bad_temperature_are_refused():
    m, K, y = _valid()
    with pytest.raises(ValueError, match="train_y"):
        LaplacePosterior(m, K, BernoulliLogitTerms(), y + 0.5)
    with pytest.raises(ValueError, match="temperature must be a positive float"):
        LaplacePosterior(m, K, BernoulliLogitTerms(), y, temperature=0.0)


def test_a_mode_of_another_problem_is_refused():
    m, K, y = _valid()
    found = find_laplace_mode(K, y, BernoulliLogitTerms(), prior_mean=m)
    with pytest.raises(ValueError, match="mode is not the mode for this K and prior_mean"):
        LaplacePosterior(m + 1.0, K, BernoulliLogitTerms(), y, mode=found)
    with pytest.raises(ValueError, match="temperature"):
        LaplacePosterior(m, K, BernoulliLogitTerms(), y, mode=found, temperature=2.0)
    with pytest.raises(ValueError, match="either mode or init_f"):
        LaplacePosterior(m, K, BernoulliLogitTerms(), y, mode=found, init_f=found.f)
    with pytest.raises(TypeError, match="mode must be a LaplaceMode"):
        LaplacePosterior(m, K, BernoulliLogitTerms(), y, mode=found.f)
    assert isinstance(found, LaplaceMode)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_tensors_on_another_device_are_refused_naming_the_argument():
    m, K, y = _valid()
    with pytest.raises(ValueError, match="prior_mean is on cuda"):
        LaplacePosterior(m.cuda(), K, BernoulliLogitTerms(), y)
    with pytest.raises(ValueError, match="train_y is on cuda"):
        LaplacePosterior(m, K, BernoulliLogitTerms(), y.cuda())


def test_predictive_refuses_a_cross_covariance_of_another_width():
    m, K, y = _valid()
    post = LaplacePosterior(m, K, BernoulliLogitTerms(), y)
    with pytest.raises(ValueError, match=r"cross_covariance must have shape \(\*b, M, 10\)"):
        post.predictive(K[:, :-1], torch.diagonal(K), diag=True)
    with pytest.raises(ValueError, match="K_test must end in shape"):
        post.predictive(K, torch.diagonal(K)[:-1], diag=True)
