"""Regression distillers with a batch of targets or of prior means on unbatched inputs.

Every reference refits exact GPs literally, one batch member at a time, with dense float64
solves (``torch.linalg.solve``), independently of gpsd's spectral filters.
"""

import gpytorch
import pytest
import torch

from gpsd import DataCentricGPR, DistributionCentricGPR

DT = torch.float64
N, M = 16, 5
GAMMA = [0.1, 0.3, 0.05]
CONSTANTS = [0.5, -1.0]


def _data():
    gen = torch.Generator().manual_seed(3)
    x = 3 * torch.rand(N, 1, generator=gen, dtype=DT)
    y = torch.sin(2 * x[:, 0]) + 0.2 * torch.randn(3, N, generator=gen, dtype=DT) + 1.0
    test_x = 3 * torch.rand(M, 1, generator=gen, dtype=DT)
    return x, y, test_x


def _kernel():
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).to(DT)
    kernel.base_kernel.lengthscale = 0.6
    kernel.outputscale = 1.4
    return kernel


def _batched_mean():
    mean = gpytorch.means.ConstantMean(batch_shape=torch.Size([2])).to(DT)
    mean.constant.data = torch.tensor(CONSTANTS, dtype=DT)
    return mean


def _reference(kernel, x, y, test_x, gamma, data_centric, constant=0.0):
    """Means, variances and covariances ``(T, M[, M])`` of every step for one target vector:
    data-centric refits on the previous step's fitted values; distribution-centric conditions
    the current posterior (train and test points jointly) on the same data again."""
    with torch.no_grad():
        z = torch.cat([x, test_x])
        joint = kernel(z).to_dense()
    eye = torch.eye(N, dtype=DT)
    mean = torch.full((N + M,), constant, dtype=DT)
    cov, targets = joint.clone(), y.clone()
    means, covs = [], []
    for g in gamma:
        if data_centric:  # a fresh GP with prior (constant, k) fitted to the current targets
            mean, cov = torch.full((N + M,), constant, dtype=DT), joint.clone()
        solve = torch.linalg.solve(
            cov[:N, :N] + g * eye, torch.cat([(targets - mean[:N])[:, None], cov[:N]], 1)
        )
        mean = mean + cov[:, :N] @ solve[:, 0]
        cov = cov - cov[:, :N] @ solve[:, 1:]
        means.append(mean[N:])
        covs.append(cov[N:, N:])
        if data_centric:
            targets = mean[:N]
    covs = torch.stack(covs)
    return torch.stack(means), covs.diagonal(dim1=-2, dim2=-1), covs


@pytest.mark.parametrize("cls", [DataCentricGPR, DistributionCentricGPR])
def test_variances_and_covariances_have_the_batch_of_the_targets(cls):
    # Variances do not depend on the targets, and the closed form returned them without the
    # targets' batch: shape (3, 5) (steps, test points) beside means of shape (3, 3, 5), so that
    # path.variance[b] was the variances of step b + 1, and method="iterated" gave (3, 3, 5).
    x, y, test_x = _data()
    kernel = _kernel()
    path = cls(x, y, kernel, noise=GAMMA, backend="dense").predict(test_x, full_cov=True)
    assert path.mean.shape == (3, 3, M)
    assert path.variance.shape == (3, 3, M)
    assert path.covariance.shape == (3, 3, M, M)
    for b in range(3):
        mean, var, cov = _reference(kernel, x, y[b], test_x, GAMMA, cls is DataCentricGPR)
        torch.testing.assert_close(path.mean[b], mean, rtol=1e-9, atol=1e-10)
        torch.testing.assert_close(path.variance[b], var, rtol=1e-9, atol=1e-10)
        torch.testing.assert_close(path.covariance[b], cov, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("cls", [DataCentricGPR, DistributionCentricGPR])
def test_students_of_a_batch_of_targets_predict_their_step(cls):
    # The student was an ExactGP with unbatched train_x and batched targets, which GPyTorch
    # cannot predict with: "shape '[5]' is invalid for input of size 15". Step 2 of each member
    # of the batch must equal the literal refit.
    x, y, test_x = _data()
    kernel = _kernel()
    student = cls(x, y, kernel, noise=GAMMA, backend="dense").student(2)
    with torch.no_grad(), gpytorch.settings.fast_pred_var(False):
        post = student(test_x)
    assert post.mean.shape == (3, M)
    for b in range(3):
        mean, var, _ = _reference(kernel, x, y[b], test_x, GAMMA, cls is DataCentricGPR)
        torch.testing.assert_close(post.mean[b], mean[1], rtol=1e-9, atol=1e-10)
        torch.testing.assert_close(post.variance[b], var[1], rtol=1e-8, atol=1e-10)


def test_iterated_recursion_with_a_batch_of_targets():
    # method="iterated" failed with "shape '[5]' is invalid for input of size 15".
    x, y, test_x = _data()
    kernel = _kernel()
    path = DistributionCentricGPR(x, y, kernel, noise=GAMMA, method="iterated").predict(test_x)
    assert path.mean.shape == path.variance.shape == (3, 3, M)
    for b in range(3):
        mean, var, _ = _reference(kernel, x, y[b], test_x, GAMMA, data_centric=False)
        torch.testing.assert_close(path.mean[b], mean, rtol=1e-9, atol=1e-10)
        torch.testing.assert_close(path.variance[b], var, rtol=1e-8, atol=1e-10)


def test_iterated_recursion_and_students_with_a_batch_of_prior_means():
    # A ConstantMean with batch shape (2,) on unbatched data: method="iterated" failed in
    # GPyTorch ("mat2 must be a matrix, got 3-D tensor"), and so did the students.
    x, y, test_x = _data()
    kernel, y0 = _kernel(), y[0]
    iterated = DistributionCentricGPR(
        x, y0, kernel, noise=GAMMA, mean_module=_batched_mean(), method="iterated"
    ).predict(test_x)
    collapsed = DistributionCentricGPR(
        x, y0, kernel, noise=GAMMA, mean_module=_batched_mean(), backend="dense"
    ).predict(test_x)
    student = DataCentricGPR(
        x, y0, kernel, noise=GAMMA, mean_module=_batched_mean(), backend="dense"
    ).student(3)
    with torch.no_grad(), gpytorch.settings.fast_pred_var(False):
        post = student(test_x)
    for b, constant in enumerate(CONSTANTS):
        mean, var, _ = _reference(kernel, x, y0, test_x, GAMMA, False, constant)
        for path in (iterated, collapsed):
            torch.testing.assert_close(path.mean[b], mean, rtol=1e-9, atol=1e-10)
            torch.testing.assert_close(path.variance[b], var, rtol=1e-8, atol=1e-10)
        mean, var, _ = _reference(kernel, x, y0, test_x, GAMMA, True, constant)
        torch.testing.assert_close(post.mean[b], mean[2], rtol=1e-9, atol=1e-10)
        torch.testing.assert_close(post.variance[b], var[2], rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("cls", [DataCentricGPR, DistributionCentricGPR])
def test_a_batch_of_schedules_that_does_not_fit_the_targets_is_named(cls):
    # noise of shape (2, 3) next to targets of shape (3, 16) was accepted and failed at the
    # first prediction: "The size of tensor a (2) must match the size of tensor b (3)".
    x, y, _ = _data()
    gamma = torch.tensor([GAMMA, GAMMA], dtype=DT)
    with pytest.raises(ValueError, match=r"noise of shape \(2, 3\).*train_y of shape \(3, 16\)"):
        cls(x, y, _kernel(), noise=gamma)
