"""Tests of the teacher's log marginal likelihood: the dense Cholesky formula and the
matrix-free one against torch.distributions on a kernel matrix built from cdist."""

import contextlib

import gpytorch
import torch

from gpsd.distillation._teacher_likelihood import (
    dense_log_likelihood,
    log_prior,
    matrix_free_log_likelihood,
    seeded_probes,
)

DT = torch.float64


def problem(n=50):
    gen = torch.Generator().manual_seed(0)
    x = 3 * torch.rand(n, 2, generator=gen, dtype=DT)
    y = torch.sin(2 * x).sum(-1) + 0.1 * torch.randn(n, generator=gen, dtype=DT)
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).to(DT)
    kernel.base_kernel.lengthscale = 0.5
    kernel.outputscale = 1.5
    mean = gpytorch.means.ConstantMean().to(DT)
    mean.constant.data.fill_(0.3)
    return x, y, kernel, mean


def reference(x, y, noise):
    """log N(y; 0.3, 1.5 exp(-|x - x'|^2 / (2 * 0.25)) + noise I): cdist and torch.distributions."""
    K = 1.5 * torch.exp(-0.5 * torch.cdist(x, x).square() / 0.25)
    cov = K + noise * torch.eye(x.shape[0], dtype=DT)
    return torch.distributions.MultivariateNormal(torch.full_like(y, 0.3), cov).log_prob(y)


def exact_cg():
    stack = contextlib.ExitStack()
    for setting in (
        gpytorch.settings.max_cholesky_size(0),
        gpytorch.settings.cg_tolerance(1e-12),
        gpytorch.settings.max_cg_iterations(500),
        gpytorch.settings.max_preconditioner_size(500),
        gpytorch.settings.preconditioner_tolerance(1e-10),
        gpytorch.settings.min_preconditioning_size(1),
    ):
        stack.enter_context(setting)
    return stack


def test_dense_likelihood_equals_the_multivariate_normal_density_for_a_batch_of_noises():
    x, y, kernel, mean = problem()
    noise = torch.tensor([0.1, 0.02], dtype=DT)
    got = dense_log_likelihood(kernel, mean, x, y, noise)
    expected = torch.stack([reference(x, y, g) for g in noise])
    torch.testing.assert_close(got, expected, rtol=1e-11, atol=1e-10)


def test_matrix_free_likelihood_and_gradient_equal_the_dense_ones():
    x, y, kernel, mean = problem()
    noise = torch.tensor(0.1, dtype=DT, requires_grad=True)
    params = [*kernel.parameters(), *mean.parameters(), noise]
    expected = dense_log_likelihood(kernel, mean, x, y, noise)
    expected_grads = torch.autograd.grad(expected, params)
    with exact_cg():
        got = matrix_free_log_likelihood(kernel, mean, x, y, noise)
        grads = torch.autograd.grad(got, params)
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-8)
    for g, e in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-7)


def test_log_prior_sums_the_registered_priors():
    _, _, kernel, mean = problem()
    prior = gpytorch.priors.GammaPrior(2.0, 3.0)
    kernel.register_prior("outputscale_prior", prior, "outputscale")
    expected = torch.distributions.Gamma(2.0, 3.0).log_prob(torch.tensor(1.5, dtype=DT))
    got = log_prior((kernel, mean), torch.zeros((), dtype=DT))
    torch.testing.assert_close(got, expected.to(DT), rtol=1e-6, atol=1e-9)
    assert log_prior((mean,), torch.zeros(())) == 0


def test_seeded_probes_repeat_and_leave_the_global_state_as_it_was():
    torch.manual_seed(7)
    before = torch.random.get_rng_state()
    with seeded_probes(3, torch.device("cpu")):
        first = torch.randn(4)
    with seeded_probes(3, torch.device("cpu")):
        second = torch.randn(4)
    torch.testing.assert_close(first, second, rtol=0, atol=0)
    assert torch.equal(torch.random.get_rng_state(), before)
