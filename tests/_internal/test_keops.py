"""Which kernels count as KeOps kernels (instantiating one needs no pykeops)."""

import gpytorch

from gpsd._internal.keops import is_keops_kernel


def test_a_keops_kernel_is_recognised_inside_wrappers_and_sums():
    keops = gpytorch.kernels.keops.RBFKernel()
    assert is_keops_kernel(keops)
    assert is_keops_kernel(gpytorch.kernels.ScaleKernel(keops))
    assert is_keops_kernel(gpytorch.kernels.RBFKernel() + gpytorch.kernels.ScaleKernel(keops))


def test_plain_kernels_are_not_keops_kernels():
    assert not is_keops_kernel(gpytorch.kernels.RBFKernel())
    assert not is_keops_kernel(gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel()))
