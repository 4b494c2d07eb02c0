"""A dense reference for K-class Laplace GP classification (tests only).

Every matrix is written out over all ``n K`` latents, ordered point-major (entry ``i K + c`` is
class ``c`` of point ``i``): the block-diagonal prior, the likelihood's Hessian from its formula
(softmax) or from autograd of the written-out log-density (continuous categorical, with
``cc_log_normalizer`` as its normaliser), Newton's method with step halving, the predictive of
Rasmussen & Williams Algorithm 3.4 with ``(K + W^-1)^-1 = (I + W K)^-1 W``, and Monte Carlo
class probabilities from the draws of a generator seeded with 0.
"""

from __future__ import annotations

import torch

from gpsd.likelihoods.cc_log_normalizer import cc_log_normalizer


def block_prior(Ks: torch.Tensor) -> torch.Tensor:
    """The ``nK x nK`` point-major prior covariance of class covariances ``Ks`` ``(K, n, n)``."""
    K, n, _ = Ks.shape
    big = torch.zeros(n, K, n, K, dtype=Ks.dtype)
    for c in range(K):
        big[:, c, :, c] = Ks[c]
    return big.reshape(n * K, n * K)


def softmax_log_density(Y: torch.Tensor, F: torch.Tensor) -> torch.Tensor:
    """The softmax log-likelihood summed over the points."""
    return (Y * (F - torch.logsumexp(F, dim=-1, keepdim=True))).sum()


def softmax_derivatives(Y: torch.Tensor, F: torch.Tensor):
    """Gradient ``(n, K)`` and Hessian blocks ``(n, K, K)`` of the softmax, written out."""
    pi = softmax(F)
    hessian = torch.stack([torch.outer(p, p) - torch.diag(p) for p in pi])
    return Y - pi, hessian


def softmax(F: torch.Tensor) -> torch.Tensor:
    return torch.exp(F - torch.logsumexp(F, dim=-1, keepdim=True))


def cc_log_density(Y: torch.Tensor, F: torch.Tensor) -> torch.Tensor:
    """The continuous categorical log-density summed over the points: y.f - A(f)."""
    return (Y * F).sum() - cc_log_normalizer(F).sum()


def cc_derivatives(Y: torch.Tensor, F: torch.Tensor):
    """Gradient and Hessian blocks of :func:`cc_log_density` by autograd (the points are
    independent, so row ``k`` of every block is the gradient of the gradient's column ``k``)."""
    G = F.clone().requires_grad_(True)
    with torch.enable_grad():
        (gradient,) = torch.autograd.grad(cc_log_density(Y, G), G, create_graph=True)
        rows = [
            torch.autograd.grad(gradient[:, k].sum(), G, retain_graph=True)[0]
            for k in range(F.shape[-1])
        ]
    return gradient.detach(), torch.stack(rows, dim=-2)


SOFTMAX = (softmax_log_density, softmax_derivatives)
CONTINUOUS_CATEGORICAL = (cc_log_density, cc_derivatives)


def tempered(terms, t):
    """The likelihood ``terms`` raised to the power ``t``."""
    log_density, derivatives = terms

    def scaled(Y, F):
        gradient, hessian = derivatives(Y, F)
        return t * gradient, t * hessian

    return (lambda Y, F: t * log_density(Y, F)), scaled


def _block_diag(blocks: torch.Tensor) -> torch.Tensor:
    n, K, _ = blocks.shape
    return torch.block_diag(*blocks).reshape(n * K, n * K)


def laplace_mode(Ks, m, Y, terms, tol=1e-14, max_iter=200):
    """The Laplace mode ``(n, K)`` of the prior ``N(m, blockdiag(Ks))`` (``Ks`` ``(K, n, n)``,
    ``m`` ``(n, K)``) and the likelihood ``terms = (log_density, derivatives)``, and W
    ``(nK, nK)`` there."""
    log_density, derivatives = terms
    n, K = Y.shape
    Kb = block_prior(Ks)
    eye = torch.eye(n * K, dtype=Kb.dtype)
    mv = m.reshape(-1)

    def psi(a, F):
        return -0.5 * a @ (F.reshape(-1) - mv) + log_density(Y, F)

    a = torch.zeros(n * K, dtype=Kb.dtype)
    F = m.clone()
    for _ in range(max_iter):
        g, h = derivatives(Y, F)
        W = -_block_diag(h)
        b = W @ (F.reshape(-1) - mv) + g.reshape(-1)
        # (K^-1 + W)^-1 b = K (I + W K)^-1 b: a = (I + W K)^-1 b
        a_new = torch.linalg.solve(eye + W @ Kb, b)
        step, current = 1.0, psi(a, F)
        while True:
            cand = a + step * (a_new - a)
            F_new = (mv + Kb @ cand).reshape(n, K)
            if psi(cand, F_new) >= current - 1e-12 or step < 1e-10:
                break
            step /= 2
        change = (F_new - F).abs().max()
        a, F = cand, F_new
        if change < tol:
            break
    W = -_block_diag(derivatives(Y, F)[1])
    return F, W


def predictive(Ks, m, F, W, cross, test_var, test_mean):
    """Algorithm 3.4: the mean ``(M, K)`` and the class covariance ``(M, K, K)`` at the test
    points, from ``cross`` ``(K, M, n)``, ``test_var`` ``(K, M)`` and ``test_mean`` ``(M, K)``;
    ``Ks`` the covariances the posterior was fitted with."""
    K, M, n = cross.shape
    Kb = block_prior(Ks)
    alpha = torch.linalg.solve(Kb, (F - m).reshape(-1)).reshape(n, K)
    mean = test_mean + torch.stack([cross[c] @ alpha[:, c] for c in range(K)], dim=-1)
    Q = torch.zeros(n, K, M, K, dtype=Kb.dtype)  # column (j, d): k_d(X, x_j) in class d's block
    for d in range(K):
        Q[:, d, :, d] = cross[d].T
    Q = Q.reshape(n * K, M * K)
    eye = torch.eye(n * K, dtype=Kb.dtype)
    reduction = Q.T @ torch.linalg.solve(eye + W @ Kb, W @ Q)
    reduction = reduction.reshape(M, K, M, K)
    idx = torch.arange(M)
    covariance = torch.diag_embed(test_var.T) - reduction[idx, :, idx, :]
    return mean, covariance


def monte_carlo(mean, covariance, response, num_samples):
    """The average of ``response`` over ``num_samples`` draws ``mean + Sigma^1/2 z`` at each point,
    the same draws ``z`` ``(S, K)`` at every point, from a generator seeded with 0 in float64."""
    generator = torch.Generator().manual_seed(0)
    z = torch.randn((num_samples, mean.shape[-1]), generator=generator, dtype=torch.float64)
    z = z.to(mean.dtype)
    values, vectors = torch.linalg.eigh(covariance)
    root = vectors @ torch.diag_embed(values.clamp_min(0).sqrt()) @ vectors.transpose(-1, -2)
    samples = mean + torch.einsum("ikl,sl->sik", root, z)
    return response(samples.reshape(-1, mean.shape[-1])).reshape(samples.shape).mean(0)


def data_centric_chain(Ks, m, labels, noise, num_samples):
    """The data-centric chain: modes ``(T, n, K)``, targets ``(T, n, K)`` and each step's
    ``(F, W, Ks + gamma I)``; ``Ks`` ``(K, n, n)``, ``m`` ``(n, K)``."""
    K, n, _ = Ks.shape
    Y = torch.nn.functional.one_hot(labels.long(), K).to(Ks.dtype)
    eye = torch.eye(n, dtype=Ks.dtype)
    modes, targets, fits = [], [], []
    for t, gamma in enumerate(noise):
        Kt = Ks + gamma * eye
        terms = SOFTMAX if t == 0 else CONTINUOUS_CATEGORICAL
        F, W = laplace_mode(Kt, m, Y, terms)
        modes.append(F)
        targets.append(Y)
        fits.append((F, W, Kt))
        mean, cov = predictive(Kt, m, F, W, Ks, torch.diagonal(Ks, dim1=-2, dim2=-1), m)
        Y = monte_carlo(mean, cov, softmax, num_samples)
    return torch.stack(modes), torch.stack(targets), fits
