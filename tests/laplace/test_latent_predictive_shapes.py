"""laplace_latent_predictive for a batch of modes sharing one test set: the diagonal and the full
covariance against the dense formula k** - k*^T (K + W^-1)^-1 k*, one problem at a time."""

import gpytorch
import pytest
import torch

from gpsd.data.toy import sine_classification
from gpsd.laplace import laplace_latent_predictive, resolve_likelihood_terms
from gpsd.laplace.newton import find_laplace_mode

DT = torch.float64


def _problem(batch: int, m: int):
    x, y, test_x = sine_classification(20, seed=1)
    kernel = gpytorch.kernels.RBFKernel().to(DT)
    kernel.lengthscale = torch.tensor(0.6, dtype=DT)
    with torch.no_grad():
        K = kernel(x).to_dense()
        K_cross = kernel(test_x[:m], x).to_dense()
        K_test = kernel(test_x[:m]).to_dense()
    # a batch of label sets: y, its flip, then shifted copies
    ys = torch.stack([torch.roll(y, i) if i % 2 == 0 else 1 - y for i in range(batch)])
    mode = find_laplace_mode(K, ys, resolve_likelihood_terms("logit"))
    return K, K_cross, K_test, mode


def _dense(K, K_cross, K_test, alpha, W):
    mean = K_cross @ alpha
    cov = K_test - K_cross @ torch.linalg.solve(K + torch.diag(1.0 / W), K_cross.T)
    return mean, cov


@pytest.mark.parametrize(("batch", "m"), [(3, 5), (4, 7)])
def test_batched_modes_with_one_test_set(batch, m):
    # a (batch, m) diagonal next to an unbatched (m, n) K_cross has as many dimensions as K_cross
    # and was taken for a full matrix: a broadcasting error, or (batch = m) covariances
    K, K_cross, K_test, mode = _problem(batch, m)
    diag = torch.diagonal(K_test).expand(batch, m)
    mean, var = laplace_latent_predictive(mode, K_cross, diag)
    _, cov = laplace_latent_predictive(mode, K_cross, K_test.expand(batch, m, m))
    assert var.shape == (batch, m) and cov.shape == (batch, m, m)
    for i in range(batch):
        ref_mean, ref_cov = _dense(K, K_cross, K_test, mode.alpha[i], mode.W[i])
        torch.testing.assert_close(mean[i], ref_mean, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(cov[i], ref_cov, rtol=1e-9, atol=1e-11)
        torch.testing.assert_close(var[i], torch.diagonal(ref_cov), rtol=1e-9, atol=1e-11)


def test_explicit_diag_settles_a_batch_of_m_diagonals():
    batch = m = 4
    K, K_cross, K_test, mode = _problem(batch, m)
    diag = torch.diagonal(K_test).expand(batch, m)
    _, var = laplace_latent_predictive(mode, K_cross, diag, diag=True)
    for i in range(batch):
        _, ref_cov = _dense(K, K_cross, K_test, mode.alpha[i], mode.W[i])
        torch.testing.assert_close(var[i], torch.diagonal(ref_cov), rtol=1e-9, atol=1e-11)


def test_a_k_test_of_the_wrong_size_is_named():
    K, K_cross, K_test, mode = _problem(2, 5)
    with pytest.raises(ValueError, match=r"K_test must end in shape \(5,\).*got shape \(2, 6\)"):
        laplace_latent_predictive(mode, K_cross, torch.ones(2, 6, dtype=DT))
    with pytest.raises(ValueError, match=r"K_test must end in shape \(5, 5\)"):
        laplace_latent_predictive(mode, K_cross, torch.ones(5, 6, dtype=DT), diag=False)
