r"""The teacher's log marginal likelihood :math:`\log p(\mathbf y \mid \boldsymbol\theta,
\gamma_1)` of the regression distillers, by a dense Cholesky factorisation or matrix-free
(GPyTorch's CG and stochastic Lanczos quadrature through a differentiable kernel operator)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import gpytorch
import torch
from gpytorch.kernels import Kernel
from gpytorch.means import Mean
from linear_operator.operators import AddedDiagLinearOperator, DiagLinearOperator
from linear_operator.utils.cholesky import psd_safe_cholesky
from torch import Tensor

from gpsd._internal.negligible import kernel_matrix
from gpsd.linalg import ChunkedKernelOperator, DistributedKernelOperator


def dense_log_likelihood(kernel: Kernel, mean: Mean, x: Tensor, y: Tensor, noise: Tensor) -> Tensor:
    r""":math:`\log \mathcal N(\mathbf y;\ m(\mathbf X),\ \mathbf K + \gamma\mathbf I)` by the
    Cholesky factor :math:`\mathbf L` of the formed matrix,

    .. math::
        -\tfrac12 \lVert \mathbf L^{-1}(\mathbf y - \mathbf m) \rVert^2
        - \sum_i \log L_{ii} - \tfrac N2 \log 2\pi ,

    shape ``(*batch,)``, with the autograd graph of the modules and ``noise`` (``(*s,)``)."""
    K = kernel_matrix(kernel, x)  # shape: (*bk, N, N)
    n = K.shape[-1]
    eye = torch.eye(n, dtype=K.dtype, device=K.device)
    shifted = K + noise[..., None, None] * eye  # shape: (*batch, N, N)
    residual = (y - mean(x)).unsqueeze(-1)  # shape: (*b, N, 1)
    batch = torch.broadcast_shapes(shifted.shape[:-2], residual.shape[:-2])
    factor = psd_safe_cholesky(shifted.expand(*batch, n, n))
    white = torch.linalg.solve_triangular(factor, residual.expand(*batch, n, 1), upper=False)
    log_det = 2 * factor.diagonal(dim1=-2, dim2=-1).log().sum(-1)
    return -0.5 * (white.square().sum((-2, -1)) + log_det + n * math.log(2 * math.pi))


def matrix_free_log_likelihood(
    kernel: Kernel,
    mean: Mean,
    x: Tensor,
    y: Tensor,
    noise: Tensor,
    process_group: object = None,
    cache_bytes: int = 0,
) -> Tensor:
    r"""The same as :func:`dense_log_likelihood`, by GPyTorch's ``MultivariateNormal.log_prob``
    on :math:`\mathbf K + \gamma\mathbf I` with :math:`\mathbf K` a
    :class:`~gpsd.linalg.ChunkedKernelOperator` (a
    :class:`~gpsd.linalg.DistributedKernelOperator` with a ``process_group``): preconditioned
    CG and stochastic Lanczos quadrature as ``gpytorch.settings`` set them, the gradient by
    the operator's chunked bilinear derivative. Shape ``(*batch,)``. ``cache_bytes`` is the
    memory the operator may fill with the kernel rows of this one evaluation (read again by
    every CG iteration and by the backward pass, then dropped with the operator)."""
    if process_group is None:
        operator = ChunkedKernelOperator(x, covar_module=kernel, cache_bytes=cache_bytes)
    else:
        operator = DistributedKernelOperator(
            x, covar_module=kernel, process_group=process_group, cache_bytes=cache_bytes
        )
    prior_mean = mean(x)  # shape: (*bm, N)
    n = x.shape[-2]
    batch = torch.broadcast_shapes(
        operator.batch_shape, noise.shape, prior_mean.shape[:-1], y.shape[:-1]
    )
    if operator.batch_shape != batch:
        operator = operator.expand(*batch, n, n)
    diag = DiagLinearOperator(noise.unsqueeze(-1).expand(*batch, n))
    covariance = AddedDiagLinearOperator(operator, diag)
    distribution = gpytorch.distributions.MultivariateNormal(
        prior_mean.expand(*batch, n), covariance
    )
    return distribution.log_prob(y.expand(*batch, n))


def log_prior(modules: tuple[torch.nn.Module, ...], like: Tensor) -> Tensor:
    """:math:`\\sum_j \\log p_j(\\theta_j)` over the hyperpriors registered on ``modules`` (as
    GPyTorch's marginal likelihoods add them), a scalar of ``like``'s dtype and device; 0
    without priors."""
    total = like.new_zeros(())
    for module in modules:
        for _, prior_module, prior, closure, _ in module.named_priors():
            total = total + prior.log_prob(closure(prior_module)).sum().to(total)
    return total


@contextlib.contextmanager
def seeded_probes(seed: int, device: torch.device) -> Iterator[None]:
    """The global random state seeded with ``seed`` inside the block (the probe vectors of the
    log determinant: the same on every rank of a group and in every run), and put back after."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield
