"""Tests of InputPlusEmbeddingKernel: the sum of an ARD kernel on the inputs and a DPKL
embedding kernel, against the two written out densely."""

import gpytorch
import pytest
import torch
from dpkl_reference import dense_kernel, loop_embeddings, noisy_sine_data, tanh_net

from gpsd.dpkl import DPKLRegressor, InputPlusEmbeddingKernel


def _dense_ard(kernel, x1, x2):
    """s exp(-sum_j (x_j - x'_j)^2 / (2 l_j^2)), written out."""
    ell = kernel.base_kernel.lengthscale.reshape(-1)
    diff = (x1.unsqueeze(-2) - x2.unsqueeze(-3)) / ell  # shape: (n1, n2, D)
    return kernel.outputscale * torch.exp(-0.5 * diff.pow(2).sum(-1))


@pytest.mark.parametrize("embedding", ["rff", "exact"])
def test_kernel_matrix_is_the_ard_kernel_plus_the_embedding_kernel(embedding):
    x, y = noisy_sine_data(n=20)
    model = DPKLRegressor(
        x, y, tanh_net, num_particles=3, num_random_features=7, embedding_kernel=embedding
    )
    kernel = model.covar_module
    assert isinstance(kernel, InputPlusEmbeddingKernel)
    kernel.input_kernel.base_kernel.lengthscale = torch.tensor([0.5, 1.0, 2.0, 3.0])
    kernel.input_kernel.outputscale = 0.7
    xq = torch.randn(6, 4)
    with torch.no_grad():
        z = loop_embeddings(model, torch.cat([x, xq]), training=False)
        emb = dense_kernel(model, z)  # shape: (26, 26)
        both = torch.cat([x, xq])
        ref = _dense_ard(kernel.input_kernel, both, both) + emb
        full = kernel(both, both).to_dense()
        cross = kernel(x, xq).to_dense()
        diag = kernel(xq, xq, diag=True)
    torch.testing.assert_close(full, ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(cross, ref[:20, 20:], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(diag, ref[20:, 20:].diagonal(), rtol=1e-10, atol=1e-12)


def test_loss_is_the_dense_gaussian_log_likelihood_and_reaches_every_parameter():
    x, y = noisy_sine_data(n=25)
    model = DPKLRegressor(x, y, tanh_net, num_particles=2, num_random_features=5)
    model.likelihood.noise = 0.3
    loss = model.training_loss() * 25
    with torch.no_grad():
        z = loop_embeddings(model, x, training=True)
        k = _dense_ard(model.input_kernel, x, x) + dense_kernel(model, z)
        cov = k + 0.3 * torch.eye(25)
        mean = model.mean_module.constant.expand(25)
        ref = -torch.distributions.MultivariateNormal(mean, cov).log_prob(y)
    torch.testing.assert_close(loss.detach(), ref, rtol=1e-9, atol=1e-10)
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


def test_the_paper_kernel_has_no_input_kernel():
    x, y = noisy_sine_data(n=10)
    model = DPKLRegressor(x, y, tanh_net, num_particles=2, input_kernel=None)
    assert model.input_kernel is None and model.embedding_kernel is model.covar_module


def test_a_kernel_of_ones_own_is_used_as_given():
    x, y = noisy_sine_data(n=10)
    own = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=1.5))
    model = DPKLRegressor(x, y, tanh_net, num_particles=2, input_kernel=own)
    assert model.input_kernel is own


def test_bad_arguments_are_named():
    x, y = noisy_sine_data(n=10)
    with pytest.raises(TypeError, match="input_kernel"):
        DPKLRegressor(x, y, tanh_net, input_kernel="rbf")
    model = DPKLRegressor(x, y, tanh_net, num_particles=2, input_kernel=None)
    with pytest.raises(TypeError, match="input_kernel"):
        InputPlusEmbeddingKernel(torch.nn.Linear(2, 2), model.covar_module)
    with pytest.raises(TypeError, match="embedding_kernel"):
        InputPlusEmbeddingKernel(gpytorch.kernels.RBFKernel(), gpytorch.kernels.RBFKernel())
