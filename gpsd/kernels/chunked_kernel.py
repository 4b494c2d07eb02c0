"""A GPyTorch kernel whose training covariance is never formed: row chunks, with gradients."""

from __future__ import annotations

import torch
from gpytorch.kernels import Kernel
from linear_operator import to_dense
from linear_operator.operators import LinearOperator
from torch import Tensor

from gpsd._internal.collectives import check_group
from gpsd._internal.distances import same_inputs
from gpsd._internal.keops import is_keops_kernel
from gpsd._internal.validation import check_int
from gpsd.linalg.chunked_kernel_operator import ChunkedKernelOperator
from gpsd.linalg.distributed_kernel_operator import DistributedKernelOperator

__all__ = ["ChunkedKernel"]


class ChunkedKernel(Kernel):
    r"""``base_kernel`` whose square blocks :math:`k(\mathbf X, \mathbf X)` are matrix-free,
    differentiable operators: an exact GP's marginal likelihood and its gradient at large N
    without forming :math:`\mathbf K`.

    Put it in an ``ExactGP`` in place of the kernel it wraps and keep GPyTorch's loop::

        covar_module = gpsd.kernels.ChunkedKernel(ScaleKernel(RBFKernel()))
        mll = gpytorch.mlls.ExactMarginalLogLikelihood(likelihood, model)
        loss = -mll(model(train_x), train_y)
        loss.backward()

    :math:`k(\mathbf X, \mathbf X)` (the training covariance, and any block whose two inputs
    are equal) is a :class:`~gpsd.linalg.ChunkedKernelOperator` (with ``process_group``, a
    :class:`~gpsd.linalg.DistributedKernelOperator`): products evaluate ``chunk_size`` rows
    at a time. GPyTorch's marginal likelihood,

    .. math::
        \log p(\mathbf y \mid \boldsymbol\theta) = -\tfrac12 (\mathbf y - \mathbf m)^\top
        \hat{\mathbf K}^{-1} (\mathbf y - \mathbf m) - \tfrac12 \log\det\hat{\mathbf K}
        - \tfrac N2 \log 2\pi, \qquad \hat{\mathbf K} = \mathbf K + \sigma^2 \mathbf I,

    then takes its matrix-free route (BBMM, Gardner et al. 2018) beyond
    ``gpytorch.settings.max_cholesky_size``: preconditioned CG for
    :math:`\hat{\mathbf K}^{-1}(\mathbf y - \mathbf m)` and for :math:`t` probe vectors
    :math:`\mathbf z_j`, stochastic Lanczos quadrature for the log determinant, and the gradient

    .. math::
        \frac{\partial \log p}{\partial \theta} = \tfrac12 \boldsymbol\alpha^\top
        \frac{\partial \mathbf K}{\partial\theta} \boldsymbol\alpha
        - \tfrac12 \operatorname{tr}\Big(\hat{\mathbf K}^{-1}
        \frac{\partial \mathbf K}{\partial\theta}\Big), \qquad
        \operatorname{tr}\Big(\hat{\mathbf K}^{-1} \frac{\partial \mathbf K}{\partial\theta}\Big)
        \approx \frac1t \sum_j (\hat{\mathbf K}^{-1}\mathbf z_j)^\top
        \frac{\partial \mathbf K}{\partial\theta}\, \mathbf P^{-1}\mathbf z_j ,

    whose bilinear forms in :math:`\partial\mathbf K/\partial\theta` the operator evaluates
    chunk by chunk in the backward pass (autograd through ``base_kernel`` on one
    :math:`c \times N` block of rows at a time; for an RBF kernel, in closed form from its
    entries). Memory: :math:`\mathcal O(N c + N t)`, never
    :math:`N^2`. ``gpytorch.settings`` (``cg_tolerance``, ``max_cg_iterations``,
    ``num_trace_samples``, ``max_preconditioner_size``, ``max_cholesky_size``) apply as to any
    GPyTorch kernel. Below ``max_cholesky_size`` (800 by default) GPyTorch forms the matrix
    and factors it, as it would for ``base_kernel``.

    Other blocks (test against training points) and diagonals are ``base_kernel``'s own,
    dense: predict in batches of test points for large N.

    :param base_kernel: any GPyTorch kernel but a KeOps one (which is matrix-free already).
    :param chunk_size: kernel rows evaluated at once.
    :param cache_bytes: memory in bytes the kernel rows of one training covariance may keep
        between the products of one marginal likelihood, freed by its backward pass (``0``,
        the default: none; at most the size of :math:`\mathbf K` helps, as the rows change
        with every optimiser step).
    :param process_group: a ``torch.distributed.ProcessGroup`` whose ranks share the rows of
        the training covariance (``None``: this process alone). Every rank then runs the same
        loop on the same data, with the same random probe vectors (seed every rank alike).
    """

    def __init__(
        self,
        base_kernel: Kernel,
        *,
        chunk_size: int = 2048,
        cache_bytes: int = 0,
        process_group: object = None,
        **kwargs,
    ) -> None:
        if not isinstance(base_kernel, Kernel):
            raise TypeError(
                f"base_kernel must be a gpytorch.kernels.Kernel, got {type(base_kernel).__name__}"
            )
        if is_keops_kernel(base_kernel):
            raise TypeError(
                "base_kernel is a KeOps kernel, already matrix-free and differentiable: use it "
                "without ChunkedKernel"
            )
        if process_group is not None:
            check_group(process_group)
        super().__init__(**kwargs)
        self.base_kernel = base_kernel
        self.chunk_size = check_int(chunk_size, "chunk_size")
        self.cache_bytes = check_int(cache_bytes, "cache_bytes", minimum=0)
        self.process_group = process_group

    @property
    def batch_shape(self) -> torch.Size:
        """The base kernel's batch shape, broadcast with this kernel's own."""
        return torch.broadcast_shapes(self._batch_shape, self.base_kernel.batch_shape)

    @batch_shape.setter
    def batch_shape(self, value: torch.Size) -> None:
        self._batch_shape = value

    @property
    def is_stationary(self) -> bool:
        """Whether the base kernel is stationary."""
        return self.base_kernel.is_stationary

    def forward(
        self, x1: Tensor, x2: Tensor, diag: bool = False, last_dim_is_batch: bool = False, **params
    ) -> Tensor | LinearOperator:
        if last_dim_is_batch:
            raise ValueError("ChunkedKernel does not support last_dim_is_batch=True")
        if diag:
            return self.base_kernel(x1, x2, diag=True, **params)
        if not same_inputs(x1, x2):
            return to_dense(self.base_kernel(x1, x2, **params))
        if self.process_group is not None:
            return DistributedKernelOperator(
                x1,
                covar_module=self.base_kernel,
                process_group=self.process_group,
                chunk_size=self.chunk_size,
                cache_bytes=self.cache_bytes,
            )
        return ChunkedKernelOperator(
            x1,
            covar_module=self.base_kernel,
            chunk_size=self.chunk_size,
            cache_bytes=self.cache_bytes,
        )
