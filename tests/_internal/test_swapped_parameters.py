"""Tests of swapped_parameters: a module evaluated with other tensors as its parameters."""

import gpytorch
import pytest
import torch

from gpsd._internal.swapped_parameters import swapped_parameters


def test_values_replace_the_parameters_inside_the_block_and_gradients_reach_them():
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).double()
    x = torch.linspace(0, 1, 5, dtype=torch.float64).unsqueeze(-1)
    params = list(kernel.parameters())
    values = [p.detach().clone().add(0.3).requires_grad_(True) for p in params]
    with swapped_parameters(kernel, values):
        inside = kernel(x, x).to_dense()
    lengthscale = torch.nn.functional.softplus(values[1]).squeeze()
    scale = torch.nn.functional.softplus(values[0])
    expected = scale * torch.exp(-0.5 * torch.cdist(x, x).square() / lengthscale**2)
    torch.testing.assert_close(inside, expected, rtol=1e-12, atol=1e-12)
    grads = torch.autograd.grad(inside.sum(), values)
    assert all(g is not None for g in grads)
    assert all(a is b for a, b in zip(kernel.parameters(), params, strict=True))  # put back


def test_a_parameter_shared_by_two_submodules_is_replaced_in_both():
    base = gpytorch.kernels.RBFKernel().double()
    kernel = base + base
    (value,) = [torch.full((1, 1), 2.0, dtype=torch.float64)]
    with swapped_parameters(kernel, [value]):
        seen = [k.raw_lengthscale for k in kernel.kernels]
    assert all(s is value for s in seen)
    assert isinstance(base.raw_lengthscale, torch.nn.Parameter)


def test_a_wrong_number_of_values_is_refused():
    kernel = gpytorch.kernels.RBFKernel()
    with pytest.raises(ValueError, match="one tensor per parameter"):
        with swapped_parameters(kernel, []):
            pass
