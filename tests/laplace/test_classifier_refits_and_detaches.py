"""LaplaceGPClassifier predictions follow the hyperparameters; its training data carry no graph."""

import copy

import gpytorch
import pytest
import torch
from gpr_reference import rbf_kernel

from gpsd import LaplaceGPClassifier
from gpsd.data.toy import sine_classification


@pytest.fixture
def toy():
    return sine_classification(30, seed=3)


def _model(x, y, outputscale=2.0, lengthscale=1.3, constant=0.0, **kw):
    mean = gpytorch.means.ConstantMean().double()
    mean.constant.data.fill_(constant)
    kernel = rbf_kernel(outputscale, lengthscale, torch.float64)
    return LaplaceGPClassifier(x, y, kernel, mean_module=mean, **kw)


def test_predictions_follow_changed_hyperparameters_and_temperature(toy):
    x, y, test_x = toy
    model = _model(x, y)
    model.predict_proba(test_x)[..., 1]  # fits the mode at the first hyperparameters
    model.covar_module.outputscale = 10.0
    model.covar_module.base_kernel.lengthscale = 0.5
    model.mean_module.constant.data.fill_(0.4)
    model.temperature = 2.0
    # the mode of the first hyperparameters was used with the new kernel: probabilities were off by
    # up to 0.42 (and a "negative predictive variance" warning came out)
    fresh = _model(x, y, 10.0, 0.5, 0.4, temperature=2.0)
    torch.testing.assert_close(
        model.predict_proba(test_x)[..., 1], fresh.predict_proba(test_x)[..., 1]
    )
    latent = model.predict_latent(test_x)
    mean, var = latent.mean, latent.variance
    latent = fresh.predict_latent(test_x)
    fresh_mean, fresh_var = latent.mean, latent.variance
    torch.testing.assert_close(mean, fresh_mean)
    torch.testing.assert_close(var, fresh_var)


def test_an_optimiser_step_refits_before_predicting(toy):
    x, y, test_x = toy
    model = _model(x, y)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.2)
    for _ in range(3):
        optimizer.zero_grad()
        (-model.log_marginal_likelihood()).backward()
        optimizer.step()
    fresh = _model(x, y)
    fresh.load_state_dict(model.state_dict())
    fresh.fit(warm_start=False)
    torch.testing.assert_close(
        model.predict_proba(test_x)[..., 1], fresh.predict_proba(test_x)[..., 1]
    )


def test_soft_targets_with_a_graph_are_stored_detached(toy):
    x, y, _ = toy
    teacher = _model(x, y)
    soft = teacher.predict_proba(x)[..., 1]
    assert soft.requires_grad  # the teacher's predictions are differentiable
    student = _model(x, soft, likelihood="continuous_bernoulli")
    reference = _model(x, soft.detach(), likelihood="continuous_bernoulli")
    assert not student.train_targets.requires_grad
    optimizer = torch.optim.Adam(student.parameters(), lr=0.05)
    for _ in range(2):  # the second backward pass ran into the teacher's freed graph
        optimizer.zero_grad()
        loss = -student.log_marginal_likelihood()
        loss.backward()
        optimizer.step()
        ref_loss = -reference.log_marginal_likelihood()
        ref_grads = torch.autograd.grad(ref_loss, list(reference.parameters()))
        torch.testing.assert_close(loss, ref_loss)
        for p, g in zip(student.parameters(), ref_grads, strict=True):
            torch.testing.assert_close(p.grad, g)
        with torch.no_grad():
            for p, q in zip(student.parameters(), reference.parameters(), strict=True):
                q.copy_(p)
    assert all(p.grad is None for p in teacher.parameters())  # the loss reached the teacher


def test_a_float64_kernel_on_float32_data_matches_the_float64_fit():
    # fit() raised "expected m1 and m2 to have the same dtype, but got: double != float"; the
    # classifier now works in the data's dtype, as DataCentricGPC and DistributionCentricGPC do
    x, y, test_x = sine_classification(30, seed=0)
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).double()
    model32 = LaplaceGPClassifier(x.float(), y.float(), kernel)
    latent = model32.predict_latent(test_x.float())
    mean, var = latent.mean, latent.variance
    proba = model32.predict_proba(test_x.float())[..., 1]
    assert mean.dtype == var.dtype == proba.dtype == torch.float32
    # the reference: everything in float64 at the same (float32-rounded) inputs
    x64, test64 = x.float().double(), test_x.float().double()
    model64 = LaplaceGPClassifier(x64, y.double(), copy.deepcopy(kernel))
    latent = model64.predict_latent(test64)
    ref_mean, ref_var = latent.mean, latent.variance
    torch.testing.assert_close(mean.double(), ref_mean, rtol=0, atol=1e-4)
    torch.testing.assert_close(var.double(), ref_var, rtol=0, atol=1e-4)
    torch.testing.assert_close(
        proba.double(), model64.predict_proba(test64)[..., 1], rtol=0, atol=1e-4
    )
    cov = model32(test_x.float()).covariance_matrix
    torch.testing.assert_close(torch.diagonal(cov).double(), ref_var, rtol=0, atol=1e-4)
