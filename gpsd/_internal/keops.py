"""Whether a GPyTorch kernel evaluates through KeOps."""

from __future__ import annotations

from gpytorch.kernels import Kernel

__all__ = ["is_keops_kernel"]


def is_keops_kernel(kernel: Kernel) -> bool:
    """Whether ``kernel`` or one of its submodules is a GPyTorch KeOps kernel
    (``gpytorch.kernels.keops``), whose matrices multiply by KeOps reductions, never formed."""
    return any(type(m).__module__.startswith("gpytorch.kernels.keops") for m in kernel.modules())
