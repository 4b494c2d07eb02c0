"""Plain-tensor evaluation of the common stationary GPyTorch kernels.

Three users. The distilled student: GPyTorch kernels go through ``LinearOperator`` objects and
keyword-only arguments, which neither ``torch.jit.script`` nor ``torch.export`` can compile, so
for the kernels below the student stores the hyperparameters as plain tensors and evaluates the
kernel itself, and its prediction path exports. The blocks of :math:`K_{XX}` that kernel
distillation evaluates in every pass, and the row chunks of
:class:`~gpsd.linalg.ChunkedKernelOperator`, which the matrix-free backends evaluate afresh at
every product at large N (:func:`stationary_kernel_block`: more accurate in float32, and the
RBF kernel in three operations over the block where GPyTorch's evaluation takes five). The
kernels:

* ``RBFKernel`` (``"rbf"``), ``MaternKernel`` with ``nu`` in {0.5, 1.5, 2.5} (``"matern12"``,
  ``"matern32"``, ``"matern52"``), each with one lengthscale or ARD lengthscales, optionally wrapped
  in a ``ScaleKernel``, without ``active_dims``, without batch shape, and with their classes'
  own ``forward`` (not a subclass, nor a ``forward`` replaced on the instance: either may
  compute another function).

Any other kernel is kept as a GPyTorch module ("generic"): prediction works, export does not;
blocks of it are GPyTorch's.
"""

from __future__ import annotations

import math

import gpytorch
import torch
import torch.nn.functional as F  # noqa: N812
from torch import Tensor

from gpsd._internal.negligible import drop_negligible, kernel_matrix

STATIONARY_KERNEL_TYPES = ("rbf", "matern12", "matern32", "matern52")


def stationary_kernel_parameters(
    kernel: gpytorch.kernels.Kernel,
) -> tuple[str, Tensor, Tensor] | None:
    """``(kernel_type, lengthscale (d or 1,), outputscale ())``, or ``None`` if unsupported."""
    outputscale = None
    base = kernel
    if type(kernel) is gpytorch.kernels.ScaleKernel:
        if (
            kernel.active_dims is not None
            or kernel.outputscale.numel() != 1
            or "forward" in vars(kernel)
        ):
            return None
        outputscale = kernel.outputscale.detach().reshape(())
        base = kernel.base_kernel
    if type(base) is gpytorch.kernels.RBFKernel:
        kind = "rbf"
    elif type(base) is gpytorch.kernels.MaternKernel and base.nu in (0.5, 1.5, 2.5):
        kind = {0.5: "matern12", 1.5: "matern32", 2.5: "matern52"}[base.nu]
    else:
        return None
    if base.active_dims is not None or len(base.batch_shape) != 0 or "forward" in vars(base):
        return None
    lengthscale = base.lengthscale.detach().reshape(-1)
    if outputscale is None:
        outputscale = torch.ones((), dtype=lengthscale.dtype, device=lengthscale.device)
    return kind, lengthscale.clone(), outputscale.clone()


def stationary_kernel_from_squared_distance(
    kernel_type: str, r2: Tensor, outputscale: Tensor
) -> Tensor:
    """Evaluate ``outputscale * k(r)`` from scaled squared distances ``r2 = ||(x - z) / l||^2``."""
    if kernel_type == "rbf":
        return outputscale * torch.exp(-0.5 * r2)
    r = r2.clamp_min(1e-30).sqrt()
    if kernel_type == "matern12":
        return outputscale * torch.exp(-r)
    if kernel_type == "matern32":
        s = math.sqrt(3.0) * r
        return outputscale * (1.0 + s) * torch.exp(-s)
    s = math.sqrt(5.0) * r
    return outputscale * (1.0 + s + s * s / 3.0) * torch.exp(-s)


#: Float64 elements per block of :func:`affine_squared_distances` on a CPU: fresh blocks of
#: 32 MiB or more are mapped page by page by glibc's allocator, which took 13 ms for a
#: 16384 x 256 product whose arithmetic takes 1.3 ms in blocks of this size.
_CPU_BLOCK_ELEMENTS = 2**20


def affine_squared_distances(
    x1: Tensor, x2: Tensor, lengthscale: Tensor, factor: float = 1.0, offset: Tensor | None = None
) -> Tensor:
    r"""``offset + factor * r2`` with :math:`r^2_{ij} = \|(x_{1,i} - x_{2,j}) / \ell\|^2`, shape
    ``(n1, n2)``, in ``x1.dtype``, accumulated in float64 and rounded once.

    One float64 product of augmented rows,
    :math:`[-2 f z_i,\ f\|z_i\|^2 + c,\ 1] \cdot [z_j,\ 1,\ f\|z_j\|^2]` with
    :math:`z = x / \ell` centred on the mean of ``x2`` (:math:`f` the factor, :math:`c` the
    offset), so the cancellation in :math:`\|z_i\|^2 + \|z_j\|^2 - 2 z_i^\top z_j` happens in
    float64: every entry carries the relative rounding of ``x1.dtype`` plus float64's absolute
    error of about :math:`10^{-16} \|z\|^2`, which shows only for pairs much closer than
    :math:`\|z\|` (the diagonal computes as about :math:`10^{-16} \|z\|^2`, not 0). (In float32
    the expansion itself errs by about :math:`\epsilon \|z\|^2` absolutely.) With the default
    factor and offset the result is clamped at zero.

    :param offset: a 0-dimensional tensor (kept on the device: no synchronisation), or ``None``
        for zero.
    """
    wide = torch.float64
    inv_scale = lengthscale.to(wide).reciprocal()  # shape: (d,) or (1,)
    z1, z2 = x1.to(wide) * inv_scale, x2.to(wide) * inv_scale
    centre = z2.mean(-2, keepdim=True)  # shape: (1, d)
    z1, z2 = z1 - centre, z2 - centre
    norms1 = factor * z1.square().sum(-1, keepdim=True)  # shape: (n1, 1)
    if offset is not None:
        norms1 = norms1 + offset.to(wide)
    rows1 = torch.cat([(-2.0 * factor) * z1, norms1, z1.new_ones(z1.shape[0], 1)], -1)
    norms2 = factor * z2.square().sum(-1, keepdim=True)
    rows2 = torch.cat([z2, z2.new_ones(z2.shape[0], 1), norms2], -1).mT  # shape: (d + 2, n2)
    n1, n2 = z1.shape[0], z2.shape[0]
    if x1.device.type != "cpu" or n1 * n2 <= _CPU_BLOCK_ELEMENTS:
        out = (rows1 @ rows2).to(x1.dtype)
    else:
        out = torch.empty(n1, n2, dtype=x1.dtype, device=x1.device)
        step = max(1, _CPU_BLOCK_ELEMENTS // n2)
        for start in range(0, n1, step):
            out[start : start + step].copy_(rows1[start : start + step] @ rows2)
    if factor == 1.0 and offset is None:
        out.clamp_min_(0.0)
    return out


def stationary_kernel_block(
    kernel: gpytorch.kernels.Kernel, x1: Tensor, x2: Tensor, *, drop: bool = True
) -> Tensor | None:
    r"""``k(x1, x2)`` (``(n1, n2)``, no autograd graph, a fresh tensor) for the kernels above,
    with ``drop`` entries below :math:`\epsilon^2` times the largest set to zero on a CPU
    (:func:`~gpsd._internal.negligible.drop_negligible`); or ``None`` where GPyTorch should
    evaluate it (another kernel, batched inputs, Matérn in float64, MPS).

    The squared distances come from :func:`affine_squared_distances`, accumulated in float64 and
    rounded once, so every entry carries the rounding of its dtype relative to itself, up to the
    absolute :math:`10^{-16} \|z\|^2` of :math:`r^2` near :math:`r = 0` (see below). GPyTorch
    forms :math:`r^2` in the input dtype as :math:`\|x\|^2 + \|z\|^2 - 2 x^\top z`, whose
    absolute error grows with :math:`\|x/\ell\|^2`: for inputs on :math:`[0, 10]^2` and
    lengthscale 0.1 the largest entries of a float32 block :math:`K(X, X_{\text{cols}})` (its
    diagonal among them, which GPyTorch sets exactly only for ``k(x, x)``) err by up to
    :math:`6 \times 10^{-4}`, and Matérn-1/2 entries (through the square root near
    :math:`r = 0`) by up to :math:`2 \times 10^{-2}`. The RBF kernel is
    :math:`\exp(\log \sigma^2 - r^2/2)` with the exponent from the same float64 product; on a
    CPU, entries that would be subnormal are made zero before the exponential, which x86 CPUs
    compute slowly for such results.

    In float64 GPyTorch's expansion and :func:`affine_squared_distances` alike give :math:`r^2`
    with an absolute error of about :math:`10^{-16} \|z\|^2` (:math:`\|z\|` the inputs'
    distance from their centre in lengthscales). The RBF and Matérn-3/2 and 5/2 kernels are
    smooth in :math:`r^2` and change by as little; Matérn-1/2, :math:`e^{-r}`, takes the square
    root, so near :math:`r = 0` (the diagonal of a block included) it errs by about
    :math:`10^{-8} \|z\|`: :math:`1.35 \times 10^{-6}` for inputs spanning 100 lengthscales, by
    either path (float32 blocks from the float64 product carry the same error there). The float64
    product would gain nothing, and GPyTorch's Matérn evaluation was as fast, so Matérn kernels in
    float64 are left to it.
    """
    params = stationary_kernel_parameters(kernel)
    if params is None or x1.dim() != 2 or x2.dim() != 2 or x1.device.type == "mps":
        return None
    kind, lengthscale, outputscale = params
    if kind != "rbf" and x1.dtype == torch.float64:
        return None
    outputscale = outputscale.to(x1.dtype)
    with torch.no_grad():
        if kind != "rbf":
            block = _matern_in_place(
                kind, affine_squared_distances(x1, x2, lengthscale), outputscale
            )
        else:
            # log outputscale - r2 / 2, at most log outputscale; shape: (n1, n2)
            log_scale = outputscale.log()
            block = affine_squared_distances(x1, x2, lengthscale, -0.5, log_scale)
            block = torch.minimum(block, log_scale, out=block)
            if block.device.type == "cpu":  # exp(block) < tiny: zero
                F.threshold_(block, math.log(torch.finfo(block.dtype).tiny), -math.inf)
            block = block.exp_()
    return drop_negligible(block, inplace=True) if drop else block


def check_lengthscale_count(lengthscale: Tensor, d: int, inputs: str) -> None:
    """Raise a ``ValueError`` unless ``lengthscale`` holds one value or one per input dimension
    (``d`` columns of the tensor named ``inputs``)."""
    if lengthscale.numel() not in (1, d):
        raise ValueError(
            f"kernel has {lengthscale.numel()} lengthscales but {inputs} has d={d} columns; give "
            "the kernel 1 or d lengthscales"
        )


def evaluate_kernel(kernel: gpytorch.kernels.Kernel, x1: Tensor, x2: Tensor) -> Tensor:
    """``k(x1, x2)`` as a dense tensor (``(n1, n2)``, no autograd graph), entries below rounding
    set to zero on a CPU (see :mod:`gpsd._internal.negligible`): by
    :func:`stationary_kernel_block` where it applies, otherwise by GPyTorch. Both the blocks of
    kernel distillation and the student's default :math:`K_{UU}` are made here."""
    block = stationary_kernel_block(kernel, x1, x2)
    if block is not None:
        return block
    with torch.no_grad(), gpytorch.settings.lazily_evaluate_kernels(False):
        return kernel_matrix(kernel, x1, x2)


def _matern_in_place(kind: str, r2: Tensor, outputscale: Tensor) -> Tensor:
    r"""Matérn kernel values from squared scaled distances ``r2`` (overwritten), with one more
    buffer at most: fresh CPU buffers of this size cost page faults (see
    :func:`affine_squared_distances`).

    :math:`\sigma^2 e^{-r}`, :math:`\sigma^2 (1 + s) e^{-s}` with :math:`s = \sqrt 3 r`, or
    :math:`\sigma^2 (1 + s + s^2 / 3) e^{-s}` with :math:`s = \sqrt 5 r`.
    """
    r = r2.clamp_min_(0.0).sqrt_()
    if kind == "matern12":
        return r.neg_().exp_().mul_(outputscale)
    s = r.mul_(math.sqrt(3.0) if kind == "matern32" else math.sqrt(5.0))
    poly = s + 1.0 if kind == "matern32" else torch.mul(s, 1.0 / 3.0).add_(1.0).mul_(s).add_(1.0)
    return poly.mul_(s.neg_().exp_()).mul_(outputscale)
