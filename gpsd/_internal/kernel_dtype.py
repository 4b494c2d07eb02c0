"""Kernels evaluated in another dtype than their parameters', with or without a graph."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from gpytorch.kernels import Kernel
from linear_operator import to_dense
from torch import Tensor


def needs_graph(kernel: Kernel, x: Tensor) -> bool:
    """Whether kernel matrices of ``kernel`` at ``x`` would carry an autograd graph now."""
    return torch.is_grad_enabled() and (
        x.requires_grad or any(p.requires_grad for p in kernel.parameters())
    )


def kernel_in_dtype(
    kernel: Kernel, x: Tensor, dtype: torch.dtype | None, keep_graph: bool = False
) -> tuple[Callable[..., Tensor], Tensor]:
    """``kernel`` and ``x`` in ``dtype`` (``None``: unchanged). Every parameter and buffer must
    match the inputs' dtype (mixed dtypes fail in some GPyTorch kernels, e.g.
    ``PolynomialKernel``): without ``keep_graph`` the kernel is a copy in ``dtype``, which
    carries no graph to the original; with it, a :class:`GraphKernelInDtype`."""
    if dtype is None or dtype == x.dtype:
        return kernel, x
    if keep_graph:
        return GraphKernelInDtype(kernel, dtype), x.to(dtype)
    return copy.deepcopy(kernel).to(dtype), x.to(dtype)


class GraphKernelInDtype:
    """``kernel`` evaluated in ``dtype`` with its autograd graph kept: every floating-point
    parameter and buffer is replaced, for the call only, by a differentiable cast, so that
    float32 hyperparameters give float64 kernel matrices whose gradients reach them.

    Called as a kernel (``(x1, x2=None, diag=False)``), it returns dense tensors, evaluated while
    the casts are in place. Each module is visited once and a tensor shared by several entries
    gets one cast (``torch.func.functional_call`` would swap a submodule used twice twice, and
    leave the cast in place of the parameter); buffers the kernel creates during the call (the
    random weights of ``RFFKernel``, say) are returned to the kernel's own dtype.
    """

    def __init__(self, kernel: Kernel, dtype: torch.dtype) -> None:
        self.kernel = kernel
        self.dtype = dtype

    def __call__(self, x1: Tensor, x2: Tensor | None = None, diag: bool = False) -> Tensor:
        modules = list(self.kernel.modules())  # each module once
        before = {(id(module), name) for module in modules for name in module._buffers}
        casts: dict[int, Tensor] = {}
        swapped: list[tuple[dict, str, Tensor]] = []
        own_dtype = None
        try:
            for module in modules:
                for store in (module._parameters, module._buffers):
                    for name, value in list(store.items()):
                        if value is None or not value.is_floating_point():
                            continue
                        own_dtype = own_dtype or value.dtype
                        if value.dtype != self.dtype:
                            swapped.append((store, name, value))
                            store[name] = casts.setdefault(id(value), value.to(self.dtype))
            x1 = x1.to(self.dtype)
            x2 = x1 if x2 is None else x2.to(self.dtype)
            return to_dense(self.kernel(x1, x2, diag=diag))
        finally:
            for store, name, value in reversed(swapped):
                store[name] = value
            for module in self.kernel.modules():
                for name, value in list(module._buffers.items()):
                    new = (id(module), name) not in before
                    if new and own_dtype and value is not None and value.is_floating_point():
                        module._buffers[name] = value.to(own_dtype)
