"""MulticlassLaplacePosterior against an independent numpy Rasmussen & Williams Algorithm 3.3,
brute-force optimisation and finite-difference Hessians of the objective, the binary Laplace
engine at K = 2, dense predictive formulas and finite differences of the evidence."""

from __future__ import annotations

import cc_reference
import numpy as np
import pytest
import scipy.optimize
import torch
from conftest import requires_cuda
from linear_operator.operators import DenseLinearOperator

from gpsd.exceptions import InsufficientMemoryError
from gpsd.laplace import (
    BernoulliLogitTerms,
    ContinuousBernoulliTerms,
    LaplaceConvergenceError,
    MulticlassLaplacePosterior,
    MulticlassLikelihoodTerms,
    SoftmaxTerms,
    find_laplace_mode,
    gauss_hermite_expectation,
    laplace_latent_predictive,
)

DT = torch.float64


def _rbf(x1, x2, lengthscale, outputscale=2.0):
    """RBF covariance ``(m, n)``; ``lengthscale`` a number or a 0-d tensor."""
    return outputscale * torch.exp(-0.5 * torch.cdist(x1, x2).square() / lengthscale**2)


def _inputs(n, seed, d=2):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=gen, dtype=DT)


def _class_covariances(x, lengthscales, outputscale=2.0):
    return torch.stack([_rbf(x, x, ls, outputscale) for ls in lengthscales])


def _soft_targets(n, num_classes, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.softmax(1.5 * torch.randn(n, num_classes, generator=gen, dtype=DT), -1)


def _labels(n, num_classes, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, num_classes, (n,), generator=gen)


def _numpy_algorithm_3_3(K, labels, num_classes, tol=1e-15, max_iter=200):
    """Rasmussen & Williams Algorithm 3.3 (mode and log marginal likelihood of the softmax
    Laplace approximation), class-major vectors, written from the book in numpy."""
    C, n = num_classes, K.shape[-1]
    y = np.zeros(C * n)
    for i, label in enumerate(labels):
        y[label * n + i] = 1.0
    f = np.zeros(C * n)
    R = np.vstack([np.eye(n)] * C)  # (C n, n)
    objective = -np.inf
    for _ in range(max_iter):
        F = f.reshape(C, n)
        pi = np.exp(F - F.max(0)) / np.exp(F - F.max(0)).sum(0)  # (C, n)
        pi_flat = pi.reshape(-1)
        E = np.zeros((C, n, n))
        z = 0.0
        for c in range(C):
            sqrt_d = np.sqrt(pi[c])
            L = np.linalg.cholesky(np.eye(n) + sqrt_d[:, None] * K[c] * sqrt_d[None, :])
            inner = np.linalg.solve(L.T, np.linalg.solve(L, np.diag(sqrt_d)))
            E[c] = sqrt_d[:, None] * inner
            z += np.log(np.diag(L)).sum()
        M = np.linalg.cholesky(E.sum(0))
        Pi = np.vstack([np.diag(pi[c]) for c in range(C)])  # (C n, n)
        b = pi_flat * f - Pi @ (Pi.T @ f) + y - pi_flat
        c_vec = np.concatenate([E[c] @ K[c] @ b.reshape(C, n)[c] for c in range(C)])
        ER = np.vstack([E[c] for c in range(C)])
        a = b - c_vec + ER @ np.linalg.solve(M.T, np.linalg.solve(M, R.T @ c_vec))
        f = np.concatenate([K[c] @ a.reshape(C, n)[c] for c in range(C)])
        F = f.reshape(C, n)
        log_norm = np.log(np.exp(F - F.max(0)).sum(0)) + F.max(0)
        new_objective = -0.5 * a @ f + y @ f - log_norm.sum()
        if abs(new_objective - objective) < tol * (1 + abs(new_objective)):
            objective = new_objective
            break
        objective = new_objective
    # the marginal likelihood at the converged f (one more evaluation of E and M there)
    F = f.reshape(C, n)
    pi = np.exp(F - F.max(0)) / np.exp(F - F.max(0)).sum(0)
    E = np.zeros((C, n, n))
    z = 0.0
    for c in range(C):
        sqrt_d = np.sqrt(pi[c])
        L = np.linalg.cholesky(np.eye(n) + sqrt_d[:, None] * K[c] * sqrt_d[None, :])
        E[c] = sqrt_d[:, None] * np.linalg.solve(L.T, np.linalg.solve(L, np.diag(sqrt_d)))
        z += np.log(np.diag(L)).sum()
    M = np.linalg.cholesky(E.sum(0))
    log_ml = objective - z - np.log(np.diag(M)).sum()
    return F.T, log_ml  # mode (n, C)


def test_softmax_mode_and_evidence_match_numpy_algorithm_3_3():
    x = _inputs(15, seed=0)
    K = _class_covariances(x, [0.7, 1.0, 1.6])
    labels = _labels(15, 3, seed=1)
    posterior = MulticlassLaplacePosterior(0.0, K, "softmax", labels)
    mode, log_ml = _numpy_algorithm_3_3(K.numpy(), labels.numpy(), 3)
    np.testing.assert_allclose(posterior.mode.numpy(), mode, rtol=0, atol=1e-10)
    assert abs(posterior.log_marginal_likelihood().item() - log_ml) < 1e-10


def _reference_log_likelihood(likelihood, y, F):
    """log p(y | F) of one problem in float64/mpmath, independent of the terms under test."""
    if likelihood == "softmax":
        top = F.max(-1, keepdims=True)
        log_softmax = F - top - np.log(np.exp(F - top).sum(-1, keepdims=True))
        return sum(log_softmax[i, label] for i, label in enumerate(y))
    return sum(
        float(row @ target - cc_reference.log_normalizer(list(row), digits=25))
        for row, target in zip(F, y, strict=True)
    )


def _brute_force_laplace(likelihood, K, y, mean):
    """The mode of Psi(f) = log p(y | f) - 1/2 (f - m)^T K^-1 (f - m) by Nelder-Mead from f = 0, and
    the Laplace
    evidence Psi(f_hat) - 1/2 log|K| - 1/2 log|-H| with H the Hessian of Psi by central second
    differences (f flat and class-major)."""
    C, n = K.shape[0], K.shape[-1]
    K_dense = torch.block_diag(*K).numpy()
    K_inv = np.linalg.inv(K_dense)
    m = np.broadcast_to(mean, (n, C)).T.reshape(-1)  # class-major

    def psi(flat):
        return _reference_log_likelihood(likelihood, y, flat.reshape(C, n).T) - 0.5 * (
            flat - m
        ) @ K_inv @ (flat - m)

    found = scipy.optimize.minimize(
        lambda flat: -psi(flat),
        np.zeros(C * n),
        method="Nelder-Mead",
        options={"xatol": 1e-10, "fatol": 1e-15, "maxiter": 40000, "maxfev": 40000},
    )
    D, step = C * n, 1e-4
    H = np.zeros((D, D))
    for i in range(D):
        for j in range(D):
            ei, ej = np.eye(D)[i] * step, np.eye(D)[j] * step
            x0 = found.x
            H[i, j] = (
                psi(x0 + ei + ej) - psi(x0 + ei - ej) - psi(x0 - ei + ej) + psi(x0 - ei - ej)
            ) / (4 * step * step)
    evidence = psi(found.x) - 0.5 * np.linalg.slogdet(K_dense)[1] - 0.5 * np.linalg.slogdet(-H)[1]
    return found.x.reshape(C, n).T, evidence


@pytest.mark.parametrize("likelihood", ["softmax", "continuous_categorical"])
@pytest.mark.parametrize("mean", [0.0, [[0.5, -1.0, 0.2], [1.5, 0.0, -0.3]]])
def test_tiny_problem_mode_and_evidence_by_brute_force(likelihood, mean):
    # N = 2 points, K = 3 classes: a 6-dimensional latent space
    x = _inputs(2, seed=3)
    K = _class_covariances(x, [0.8, 1.2, 2.0]) + 0.1 * torch.eye(2, dtype=DT)
    y = torch.tensor([2, 0]) if likelihood == "softmax" else _soft_targets(2, 3, seed=4)
    posterior = MulticlassLaplacePosterior(mean, K, likelihood, y)
    mode, evidence = _brute_force_laplace(likelihood, K, y.numpy(), np.asarray(mean))
    np.testing.assert_allclose(posterior.mode.numpy(), mode, rtol=0, atol=1e-6)
    assert abs(posterior.log_marginal_likelihood().item() - evidence) < 1e-6


@pytest.mark.parametrize(
    ("likelihood", "binary_terms"),
    [("softmax", BernoulliLogitTerms()), ("continuous_categorical", ContinuousBernoulliTerms())],
)
def test_two_classes_with_a_shared_covariance_equal_the_binary_engine_on_the_difference(
    likelihood, binary_terms
):
    # f_2 - f_1 ~ N(0, 2 K) carries the likelihood; f_1 + f_2 is independent of it
    x, x_test = _inputs(10, seed=5), _inputs(4, seed=6)
    K = _rbf(x, x, 1.1)
    if likelihood == "softmax":
        y = _labels(10, 2, seed=7)
        binary_y = y.to(DT)
    else:
        y = _soft_targets(10, 2, seed=7)
        binary_y = y[:, 1]
    posterior = MulticlassLaplacePosterior(0.0, K, likelihood, y, num_classes=2)
    binary = find_laplace_mode(2 * K, binary_y, binary_terms)
    difference = posterior.mode[:, 1] - posterior.mode[:, 0]
    torch.testing.assert_close(difference, binary.f, rtol=0, atol=1e-10)
    torch.testing.assert_close(
        posterior.mode.sum(-1), torch.zeros(10, dtype=DT), rtol=0, atol=1e-10
    )
    torch.testing.assert_close(
        posterior.log_marginal_likelihood(), binary.log_marginal_likelihood, rtol=0, atol=1e-10
    )
    cross = _rbf(x_test, x, 1.1)
    mean, covariance = posterior.predictive(cross, torch.full((4,), 2.0, dtype=DT))
    binary_mean, binary_variance = laplace_latent_predictive(
        binary, 2 * cross, torch.full((4,), 4.0, dtype=DT)
    )
    torch.testing.assert_close(mean[:, 1] - mean[:, 0], binary_mean, rtol=0, atol=1e-10)
    difference_variance = covariance[:, 0, 0] + covariance[:, 1, 1] - 2 * covariance[:, 0, 1]
    torch.testing.assert_close(difference_variance, binary_variance, rtol=0, atol=1e-10)


@pytest.mark.parametrize("likelihood", ["softmax", "continuous_categorical"])
def test_predictive_matches_the_dense_gaussian_formulas(likelihood):
    n, m, C = 7, 3, 3
    x, x_test = _inputs(n, seed=8), _inputs(m, seed=9)
    lengthscales = [0.6, 1.0, 1.5]
    K = _class_covariances(x, lengthscales) + 0.05 * torch.eye(n, dtype=DT)
    y = _labels(n, C, seed=10) if likelihood == "softmax" else _soft_targets(n, C, seed=10)
    prior_mean = torch.tensor([0.3, -0.5, 0.1], dtype=DT)  # a constant per class
    posterior = MulticlassLaplacePosterior(prior_mean, K, likelihood, y)
    cross = torch.stack([_rbf(x_test, x, ls) for ls in lengthscales])
    mean, covariance = posterior.predictive(cross, torch.full((C, m), 2.0, dtype=DT), prior_mean)
    # q(f) = N(f_hat, (K^-1 + W)^-1); f_* | f is the prior conditional: dense, class-major
    K_dense = torch.block_diag(*K).numpy()
    W_dense = np.zeros((C * n, C * n))
    for i in range(n):
        W_dense[i::n, i::n] = posterior.W[i].numpy()
    f_hat = (posterior.mode - prior_mean).T.reshape(-1).numpy()  # centred
    K_inv = np.linalg.inv(K_dense)
    posterior_cov = np.linalg.inv(K_inv + W_dense)
    for j in range(m):
        Q = np.zeros((C * n, C))
        for c in range(C):
            Q[c * n : (c + 1) * n, c] = cross[c, j].numpy()
        expected_mean = prior_mean.numpy() + Q.T @ K_inv @ f_hat
        expected_cov = 2.0 * np.eye(C) - Q.T @ K_inv @ Q + Q.T @ K_inv @ posterior_cov @ K_inv @ Q
        np.testing.assert_allclose(mean[j].numpy(), expected_mean, rtol=0, atol=1e-9)
        np.testing.assert_allclose(covariance[j].numpy(), expected_cov, rtol=0, atol=1e-9)
    probabilities = posterior.class_probabilities(
        cross, torch.full((C, m), 2.0, dtype=DT), num_samples=300
    )
    assert (probabilities > 0).all()
    torch.testing.assert_close(probabilities.sum(-1), torch.ones(m, dtype=DT))


@pytest.mark.parametrize("likelihood", ["softmax", "continuous_categorical"])
@pytest.mark.parametrize("shared", [False, True])
def test_evidence_gradient_in_a_lengthscale_matches_finite_differences(likelihood, shared):
    n, C = 8, 3
    x = _inputs(n, seed=11)
    y = _labels(n, C, seed=12) if likelihood == "softmax" else _soft_targets(n, C, seed=12)

    def evidence(lengthscale):
        if shared:
            K = _rbf(x, x, lengthscale).unsqueeze(0)
        else:
            K = torch.stack(
                [_rbf(x, x, lengthscale), _rbf(x, x, 0.8), _rbf(x, x, 1.7 * lengthscale)]
            )
        return MulticlassLaplacePosterior(
            0.0, K, likelihood, y, num_classes=C
        ).log_marginal_likelihood()

    lengthscale = torch.tensor(1.1, dtype=DT, requires_grad=True)
    (gradient,) = torch.autograd.grad(evidence(lengthscale), lengthscale)
    h = 1e-5
    with torch.no_grad():
        fd = (
            evidence(torch.tensor(1.1 + h, dtype=DT)) - evidence(torch.tensor(1.1 - h, dtype=DT))
        ) / (2 * h)
    assert abs(gradient.item() - fd.item()) < 1e-7 * (1 + abs(fd.item()))


@pytest.mark.parametrize("likelihood", ["softmax", "continuous_categorical"])
def test_evidence_gradient_in_the_prior_mean_matches_finite_differences(likelihood):
    n, C = 8, 3
    x = _inputs(n, seed=33)
    K = _class_covariances(x, [0.7, 1.0, 1.6])
    y = _labels(n, C, seed=34) if likelihood == "softmax" else _soft_targets(n, C, seed=34)
    offsets = torch.tensor([0.0, 0.4, -0.2], dtype=DT)

    def evidence(shift):
        return MulticlassLaplacePosterior(
            shift * offsets + 0.1 * x[:, :1], K, likelihood, y
        ).log_marginal_likelihood()

    shift = torch.tensor(0.8, dtype=DT, requires_grad=True)
    (gradient,) = torch.autograd.grad(evidence(shift), shift)
    h = 1e-5
    with torch.no_grad():
        fd = (
            evidence(torch.tensor(0.8 + h, dtype=DT)) - evidence(torch.tensor(0.8 - h, dtype=DT))
        ) / (2 * h)
    assert abs(gradient.item() - fd.item()) < 1e-7 * (1 + abs(fd.item()))


@pytest.mark.parametrize("likelihood", ["softmax", "continuous_categorical"])
def test_predictive_gradient_through_the_mode_matches_finite_differences(likelihood):
    n, m, C = 8, 3, 3
    x, x_test = _inputs(n, seed=35), _inputs(m, seed=36)
    y = _labels(n, C, seed=37) if likelihood == "softmax" else _soft_targets(n, C, seed=37)
    gen = torch.Generator().manual_seed(38)
    mean_weights = torch.randn(m, C, generator=gen, dtype=DT)
    covariance_weights = torch.randn(m, C, C, generator=gen, dtype=DT)

    def summary(lengthscale, shift):
        scales = (lengthscale, 1.0, 1.5 * lengthscale)
        K = torch.stack([_rbf(x, x, ls) for ls in scales])
        cross = torch.stack([_rbf(x_test, x, ls) for ls in scales])
        prior_mean = shift * torch.tensor([0.5, -0.2, 0.0], dtype=DT)
        posterior = MulticlassLaplacePosterior(prior_mean, K, likelihood, y)
        mean, covariance = posterior.predictive(
            cross, torch.full((C, m), 2.0, dtype=DT), prior_mean
        )
        return (mean * mean_weights).sum() + (covariance * covariance_weights).sum()

    lengthscale = torch.tensor(0.9, dtype=DT, requires_grad=True)
    shift = torch.tensor(0.7, dtype=DT, requires_grad=True)
    gradients = torch.autograd.grad(summary(lengthscale, shift), (lengthscale, shift))
    h = 1e-5
    with torch.no_grad():
        fd_lengthscale = (summary(0.9 + h, 0.7) - summary(0.9 - h, 0.7)) / (2 * h)
        fd_shift = (summary(0.9, 0.7 + h) - summary(0.9, 0.7 - h)) / (2 * h)
    for gradient, fd in zip(gradients, (fd_lengthscale, fd_shift), strict=True):
        assert abs(gradient.item() - fd.item()) < 1e-7 * (1 + abs(fd.item()))


def test_class_probabilities_at_two_classes_match_quadrature_of_the_difference():
    x, x_test = _inputs(10, seed=13), _inputs(4, seed=14)
    K = _rbf(x, x, 1.0, outputscale=4.0)
    posterior = MulticlassLaplacePosterior(
        0.0, K, "softmax", _labels(10, 2, seed=15), num_classes=2
    )
    cross = _rbf(x_test, x, 1.0, outputscale=4.0)
    variance = torch.full((4,), 4.0, dtype=DT)
    probabilities = posterior.class_probabilities(cross, variance, num_samples=20000)
    mean, covariance = posterior.predictive(cross, variance)
    expected = gauss_hermite_expectation(
        torch.sigmoid,
        mean[:, 1] - mean[:, 0],
        covariance[:, 0, 0] + covariance[:, 1, 1] - 2 * covariance[:, 0, 1],
    )
    # the standard error of each entry is below 0.5 / sqrt(20000) = 0.0035
    torch.testing.assert_close(probabilities[:, 1], expected, rtol=0, atol=0.015)
    torch.testing.assert_close(probabilities.sum(-1), torch.ones(4, dtype=DT))
    again = posterior.class_probabilities(cross, variance, num_samples=20000)
    assert torch.equal(probabilities, again)


@pytest.mark.parametrize("likelihood", ["softmax", "continuous_categorical"])
def test_float32_mode_and_evidence_agree_with_float64(likelihood):
    x = _inputs(12, seed=16)
    K = _class_covariances(x, [0.8, 1.3, 1.9]) + 1e-3 * torch.eye(12, dtype=DT)
    y = _labels(12, 3, seed=17) if likelihood == "softmax" else _soft_targets(12, 3, seed=17)
    double = MulticlassLaplacePosterior(0.0, K, likelihood, y)
    single = MulticlassLaplacePosterior(
        0.0, K.float(), likelihood, y.float() if y.is_floating_point() else y
    )
    assert single.mode.dtype == torch.float32
    torch.testing.assert_close(single.mode.double(), double.mode, rtol=0, atol=1e-3)
    torch.testing.assert_close(
        single.log_marginal_likelihood().double(),
        double.log_marginal_likelihood(),
        rtol=1e-4,
        atol=1e-4,
    )


def test_batches_of_covariances_and_of_targets_equal_separate_fits():
    x = _inputs(9, seed=18)
    y, other_y = _soft_targets(9, 3, seed=19), _soft_targets(9, 3, seed=25)
    first, second = _class_covariances(x, [0.7, 1.0, 1.4]), _class_covariances(x, [1.5, 0.5, 1.0])
    batched = MulticlassLaplacePosterior(
        0.0, torch.stack([first, second]), "continuous_categorical", y
    )
    batched_targets = MulticlassLaplacePosterior(
        0.0, first, "continuous_categorical", torch.stack([y, other_y])
    )
    separate = [
        (batched, first, y, 0),
        (batched, second, y, 1),
        (batched_targets, first, other_y, 1),
    ]
    for posterior, K, targets, index in separate:
        alone = MulticlassLaplacePosterior(0.0, K, "continuous_categorical", targets)
        torch.testing.assert_close(posterior.mode[index], alone.mode, rtol=0, atol=1e-10)
        torch.testing.assert_close(
            posterior.log_marginal_likelihood()[index],
            alone.log_marginal_likelihood(),
            rtol=0,
            atol=1e-10,
        )


def test_a_linear_operator_covariance_gives_the_tensor_result():
    x = _inputs(8, seed=26)
    K = _rbf(x, x, 1.0)
    labels = _labels(8, 3, seed=27)
    dense = MulticlassLaplacePosterior(0.0, K, "softmax", labels, num_classes=3)
    operator = MulticlassLaplacePosterior(
        0.0, DenseLinearOperator(K), "softmax", labels, num_classes=3
    )
    torch.testing.assert_close(operator.mode, dense.mode, rtol=0, atol=0)


@requires_cuda
@pytest.mark.parametrize("likelihood", ["softmax", "continuous_categorical"])
def test_on_cuda_the_mode_evidence_and_probabilities_match_the_cpu(likelihood):
    x, x_test = _inputs(10, seed=28), _inputs(3, seed=29)
    K = _class_covariances(x, [0.7, 1.0, 1.5])
    y = _labels(10, 3, seed=30) if likelihood == "softmax" else _soft_targets(10, 3, seed=30)
    cross = torch.stack([_rbf(x_test, x, ls) for ls in (0.7, 1.0, 1.5)])
    variance = torch.full((3, 3), 2.0, dtype=DT)
    cpu = MulticlassLaplacePosterior(0.0, K, likelihood, y)
    cuda = MulticlassLaplacePosterior(0.0, K.cuda(), likelihood, y.cuda())
    torch.testing.assert_close(cuda.mode.cpu(), cpu.mode, rtol=0, atol=1e-10)
    torch.testing.assert_close(
        cuda.log_marginal_likelihood().cpu(), cpu.log_marginal_likelihood(), rtol=0, atol=1e-10
    )
    probabilities = cuda.class_probabilities(cross.cuda(), variance.cuda())
    assert probabilities.device.type == "cuda"
    torch.testing.assert_close(probabilities.sum(-1).cpu(), torch.ones(3, dtype=DT))


@pytest.mark.parametrize(
    ("likelihood", "needed"),
    [("softmax", 8 * 3 * 5 * 5 * 8), ("continuous_categorical", 11 * 15 * 15 * 8)],
)
def test_a_problem_beyond_the_free_memory_is_refused_before_allocating(
    monkeypatch, likelihood, needed
):
    from gpsd._internal import memory_check

    x = _inputs(5, seed=31)
    K = _class_covariances(x, [0.7, 1.0, 1.5])
    y = _labels(5, 3, seed=32) if likelihood == "softmax" else _soft_targets(5, 3, seed=32)
    monkeypatch.setattr(memory_check, "free_memory_bytes", lambda device, wanted=None: needed - 1)
    with pytest.raises(
        InsufficientMemoryError, match=f"MulticlassLaplacePosterior needs about {needed} bytes"
    ):
        MulticlassLaplacePosterior(0.0, K, likelihood, y)
    monkeypatch.setattr(memory_check, "free_memory_bytes", lambda device, wanted=None: needed)
    MulticlassLaplacePosterior(0.0, K, likelihood, y)


class _PseudoHuberTerms(MulticlassLikelihoodTerms):
    """log p = -sum_c sqrt(1 + (f_c - y_c)^2): log-concave, with a curvature that vanishes away
    from the targets, so full Newton steps from f = 0 overshoot."""

    name = "pseudo-Huber"

    def targets(self, y, num_classes=None, name="train_y"):
        return y

    def log_prob(self, Y, F):
        return -torch.sqrt(1 + (F - Y) ** 2).sum(-1)

    def derivatives(self, Y, F):
        r = F - Y
        return -r / torch.sqrt(1 + r**2), torch.diag_embed(-((1 + r**2) ** -1.5))

    def response(self, F):
        return torch.softmax(F, -1)


def test_step_halving_makes_newton_converge_from_zero_where_full_steps_overshoot():
    x = _inputs(6, seed=20)
    K = _class_covariances(x, [1.0, 1.0, 1.0], outputscale=100.0)
    gen = torch.Generator().manual_seed(21)
    y = torch.tensor([[5.0, -5.0, 3.0]], dtype=DT) + torch.randn(6, 3, generator=gen, dtype=DT)
    with pytest.raises(LaplaceConvergenceError):
        MulticlassLaplacePosterior(0.0, K, _PseudoHuberTerms(), y, max_halvings=0)
    posterior = MulticlassLaplacePosterior(0.0, K, _PseudoHuberTerms(), y)
    # stationarity, with the gradient of log p by autograd: f = K grad log p(y | f)
    F = posterior.mode.clone().requires_grad_(True)
    (gradient,) = torch.autograd.grad(_PseudoHuberTerms().log_prob(y, F).sum(), F)
    expected = torch.einsum("cij,jc->ic", K, gradient)
    torch.testing.assert_close(posterior.mode, expected, rtol=0, atol=1e-9)


class _SoftmaxThroughTheDenseFactor(MulticlassLikelihoodTerms):
    """The softmax, as terms the engine does not recognise: it factors B of size K n."""

    name = "softmax (dense)"

    def __init__(self):
        self.softmax = SoftmaxTerms()

    def targets(self, y, num_classes=None, name="train_y"):
        return self.softmax.targets(y, num_classes, name)

    def log_prob(self, Y, F):
        return self.softmax.log_prob(Y, F)

    def derivatives(self, Y, F):
        return self.softmax.derivatives(Y, F)

    def response(self, F):
        return self.softmax.response(F)


def test_algorithm_3_3_and_the_dense_factor_agree_for_the_softmax():
    n, m = 9, 4
    x, x_test = _inputs(n, seed=22), _inputs(m, seed=23)
    labels = _labels(n, 3, seed=24)
    cross = torch.stack([_rbf(x_test, x, ls) for ls in (0.6, 1.0, 1.5)])
    variance = torch.full((3, m), 2.0, dtype=DT)
    results = []
    for terms in (SoftmaxTerms(), _SoftmaxThroughTheDenseFactor()):
        lengthscale = torch.tensor(0.9, dtype=DT, requires_grad=True)
        K = torch.stack([_rbf(x, x, lengthscale), _rbf(x, x, 1.0), _rbf(x, x, 2 * lengthscale)])
        posterior = MulticlassLaplacePosterior(0.0, K, terms, labels)
        evidence = posterior.log_marginal_likelihood()
        (gradient,) = torch.autograd.grad(evidence, lengthscale)
        results.append(
            (posterior.mode, evidence.detach(), gradient, *posterior.predictive(cross, variance))
        )
    for fast, dense in zip(*results, strict=True):
        torch.testing.assert_close(fast.detach(), dense.detach(), rtol=0, atol=1e-11)


@pytest.mark.parametrize("likelihood", ["softmax", "continuous_categorical"])
def test_a_start_near_the_mode_reaches_the_mode_of_numpy_in_fewer_iterations(likelihood):
    x = _inputs(20, seed=30)
    K = _class_covariances(x, [0.6, 1.0, 1.5]) + 0.05 * torch.eye(20, dtype=DT)
    y = _labels(20, 3, seed=31) if likelihood == "softmax" else _soft_targets(20, 3, seed=31)
    cold = MulticlassLaplacePosterior(0.0, K, likelihood, y, num_classes=3)
    # the mode of a nearby problem (another noise) as the start
    nearby = MulticlassLaplacePosterior(
        0.0, K + 0.1 * torch.eye(20, dtype=DT), likelihood, y, num_classes=3
    )
    for start in ({"init_f": nearby.mode}, {"init_alpha": nearby.alpha}):
        warm = MulticlassLaplacePosterior(0.0, K, likelihood, y, num_classes=3, **start)
        if likelihood == "softmax":
            reference, _ = _numpy_algorithm_3_3(K.numpy(), y.numpy(), 3)
            np.testing.assert_allclose(warm.mode.numpy(), reference, rtol=0, atol=1e-10)
        torch.testing.assert_close(warm.mode, cold.mode, rtol=0, atol=1e-10)
        torch.testing.assert_close(
            warm.log_marginal_likelihood(), cold.log_marginal_likelihood(), rtol=0, atol=1e-11
        )
        assert warm.iterations < cold.iterations


def test_a_start_at_the_modes_alpha_converges_in_one_iteration():
    x = _inputs(15, seed=38)
    K = _class_covariances(x, [0.7, 1.0, 1.6])
    labels = _labels(15, 3, seed=39)
    cold = MulticlassLaplacePosterior(0.0, K, "softmax", labels)
    again = MulticlassLaplacePosterior(0.0, K, "softmax", labels, init_alpha=cold.alpha)
    assert again.iterations == 1
    torch.testing.assert_close(again.mode, cold.mode, rtol=0, atol=1e-12)


def test_a_start_far_from_the_mode_still_reaches_it():
    x = _inputs(12, seed=32)
    K = _class_covariances(x, [0.8, 1.2, 2.0])
    labels = _labels(12, 3, seed=33)
    far = 8.0 * torch.randn(12, 3, generator=torch.Generator().manual_seed(34), dtype=DT)
    warm = MulticlassLaplacePosterior(0.0, K, "softmax", labels, init_f=far)
    reference, _ = _numpy_algorithm_3_3(K.numpy(), labels.numpy(), 3)
    np.testing.assert_allclose(warm.mode.numpy(), reference, rtol=0, atol=1e-10)


def test_a_start_broadcasts_over_a_batch_of_targets():
    x = _inputs(10, seed=35)
    K = _rbf(x, x, 1.0) + 0.05 * torch.eye(10, dtype=DT)
    targets = torch.stack([_soft_targets(10, 3, seed=s) for s in (36, 37)])  # (2, 10, 3)
    start = torch.linspace(-1.0, 1.0, 3, dtype=DT)  # (3,): one value per class
    batch = MulticlassLaplacePosterior(0.0, K, "continuous_categorical", targets, init_f=start)
    for b in range(2):
        alone = MulticlassLaplacePosterior(0.0, K, "continuous_categorical", targets[b])
        torch.testing.assert_close(batch.mode[b], alone.mode, rtol=0, atol=1e-10)


def test_too_few_iterations_raise_naming_max_iter():
    x = _inputs(10, seed=22)
    with pytest.raises(LaplaceConvergenceError, match="max_iter=1"):
        MulticlassLaplacePosterior(
            0.0, _rbf(x, x, 1.0), "softmax", _labels(10, 3, seed=23), num_classes=3, max_iter=1
        )


def test_bad_input_raises_clear_errors():
    x = _inputs(5, seed=24)
    K = _rbf(x, x, 1.0)
    with pytest.raises(ValueError, match=r"train_y must hold integer class labels in 0 \.\.\. 2"):
        MulticlassLaplacePosterior(0.0, K, "softmax", torch.tensor([0, 1, 3, 0, 2]), num_classes=3)
    with pytest.raises(ValueError, match="integer class labels"):
        MulticlassLaplacePosterior(
            0.0, K, "softmax", torch.tensor([0.0, 1.5, 1, 0, 2]), num_classes=3
        )
    with pytest.raises(ValueError, match="pass num_classes"):
        MulticlassLaplacePosterior(0.0, K, "softmax", torch.tensor([0, 1, 2, 0, 2]))
    with pytest.raises(ValueError, match="summing to 1"):
        MulticlassLaplacePosterior(
            0.0, K, "continuous_categorical", torch.full((5, 3), 0.4, dtype=DT)
        )
    negative = torch.tensor([[1.2, -0.2, 0.0]] * 5, dtype=DT)
    with pytest.raises(ValueError, match="negative values"):
        MulticlassLaplacePosterior(0.0, K, "continuous_categorical", negative)
    with pytest.raises(ValueError, match="train_y has 4 points but prior_covariance is 5 x 5"):
        MulticlassLaplacePosterior(0.0, K, "softmax", torch.tensor([0, 1, 2, 0]), num_classes=3)
    with pytest.raises(ValueError, match="train_y has 3 classes .* prior covariances have 2"):
        MulticlassLaplacePosterior(
            0.0, K.expand(2, 5, 5), "continuous_categorical", _soft_targets(5, 3, 0)
        )
    with pytest.raises(ValueError, match="prior_covariance must have shape"):
        MulticlassLaplacePosterior(
            0.0, K[:, :4], "softmax", torch.tensor([0, 1, 2, 0, 1]), num_classes=3
        )
    with pytest.raises(ValueError, match="prior_mean .* must broadcast to"):
        MulticlassLaplacePosterior(
            torch.zeros(4, 3), K, "softmax", torch.tensor([0, 1, 2, 0, 1]), num_classes=3
        )
    with pytest.raises(ValueError, match="prior_mean must be finite"):
        MulticlassLaplacePosterior(
            float("nan"), K, "softmax", torch.tensor([0, 1, 2, 0, 1]), num_classes=3
        )
    labels = torch.tensor([0, 1, 2, 0, 1])
    with pytest.raises(ValueError, match=r"init_f \(4, 3\) must broadcast to \(\*b, n, K\)"):
        MulticlassLaplacePosterior(
            0.0, K, "softmax", labels, num_classes=3, init_f=torch.zeros(4, 3)
        )
    with pytest.raises(ValueError, match="pass either init_f or init_alpha, not both"):
        MulticlassLaplacePosterior(
            0.0, K, "softmax", labels, num_classes=3, init_f=0.0, init_alpha=0.0
        )
    with pytest.raises(ValueError, match=r"init_alpha \(5, 2\) must broadcast"):
        MulticlassLaplacePosterior(
            0.0, K, "softmax", labels, num_classes=3, init_alpha=torch.zeros(5, 2)
        )
    with pytest.raises(ValueError, match="init_f must be finite"):
        MulticlassLaplacePosterior(
            0.0, K, "softmax", labels, num_classes=3, init_f=torch.full((5, 3), float("inf"))
        )
    with pytest.raises(ValueError, match="likelihood must be one of"):
        MulticlassLaplacePosterior(0.0, K, "probit", torch.tensor([0, 1, 2, 0, 1]), num_classes=3)
    posterior = MulticlassLaplacePosterior(
        0.0, K, "softmax", torch.tensor([0, 1, 2, 0, 1]), num_classes=3
    )
    with pytest.raises(ValueError, match="cross_covariance must have shape"):
        posterior.predictive(torch.zeros(2, 4, dtype=DT), torch.ones(2, dtype=DT))
    with pytest.raises(ValueError, match="test_prior_variance must have shape"):
        posterior.predictive(torch.zeros(2, 5, dtype=DT), torch.ones(3, dtype=DT))
    cross, variance = torch.zeros(2, 5, dtype=DT), torch.ones(2, dtype=DT)
    with pytest.raises(ValueError, match="num_samples must be a positive integer"):
        posterior.class_probabilities(cross, variance, num_samples=0)
    with pytest.raises(TypeError, match="generator must be a torch.Generator"):
        posterior.class_probabilities(cross, variance, generator=0)
