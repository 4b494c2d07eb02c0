"""Predictive variances computed as a difference: rounding may take them below zero."""

from __future__ import annotations

import torch
from gpytorch.utils.warnings import NumericalWarning
from torch import Tensor

from gpsd._internal.user_warning import warn

__all__ = [
    "can_branch_on",
    "checked_latent_variance",
    "nonnegative_variance",
    "warn_if_variance_error_large",
]


def can_branch_on(tensor: Tensor) -> bool:
    """Whether Python may branch on the values of ``tensor``: not while ``torch.compile`` or
    ``torch.export`` traces, nor inside ``torch.func.vmap`` (whose batched tensors refuse
    data-dependent control flow). Checks that read values are skipped there."""
    if torch.compiler.is_compiling():
        return False
    is_batched = getattr(torch._C._functorch, "is_batchedtensor", None)
    return not (is_batched is not None and is_batched(tensor))


def _rounding_tolerance(dtype: torch.dtype) -> float:
    """How far below 0, relative to its scale, a variance may come out by rounding alone."""
    return max(1e-6, torch.finfo(dtype).eps ** 0.5)


def checked_latent_variance(variance: Tensor) -> Tensor:
    r"""A latent variance passed in by a caller, clamped at 0 where it is negative by rounding;
    a ``ValueError`` where it is negative beyond that (below :math:`-\max(10^{-6},
    \sqrt{\epsilon})` times the largest of 1 and its largest magnitude: a log-variance or a
    mistaken sign, not rounding). Compiled or vmapped: the clamp alone (:func:`can_branch_on`)."""
    if not can_branch_on(variance):
        return variance.clamp_min(0.0)
    detached = variance.detach()
    scale = detached.abs().amax().clamp_min(1.0) if detached.numel() else 1.0
    if bool((detached < -_rounding_tolerance(variance.dtype) * scale).any()):
        raise ValueError(
            f"variance must hold latent variances >= 0, got a minimum of "
            f"{float(detached.min()):.4g} (negative beyond rounding; a log-variance or a "
            "difference of variances with the wrong sign?)"
        )
    return variance.clamp_min(0.0)


def nonnegative_variance(variance: Tensor, scale: Tensor) -> Tensor:
    r"""Clamp at 0 a variance :math:`k_{**} - \mathbf k_*^\top\mathbf A\mathbf k_*` that came out
    negative, warning with a ``NumericalWarning`` where that is beyond rounding.

    The difference of two nearly equal terms loses accuracy relative to ``scale`` (the prior
    variance :math:`k_{**}`); a value below :math:`-\max(10^{-6}, \sqrt{\epsilon})` times the
    scale (:math:`\epsilon` the dtype's machine epsilon: float32 allows about :math:`3\cdot
    10^{-4}`) means an indefinite kernel matrix or a badly conditioned solve, and is reported
    rather than hidden.

    Under ``torch.compile``, ``torch.export`` or ``torch.func.vmap`` only the clamp runs: the
    check is a data-dependent branch (:func:`can_branch_on`).

    :param variance: the computed variances, any shape.
    :param scale: the prior variances, broadcastable against ``variance``.
    """
    if not can_branch_on(variance):
        return variance.clamp_min(0.0)
    tiny = torch.finfo(variance.dtype).tiny
    relative = _rounding_tolerance(variance.dtype)
    size = scale.detach().abs().clamp_min(tiny)
    if bool((variance.detach() < -relative * size).any()):
        worst = float((-variance.detach() / size).max())
        warn(
            f"a predictive variance came out negative, {worst:.3g} times its prior variance "
            "(beyond rounding: an indefinite kernel matrix or an ill-conditioned solve); it was "
            "clamped at 0",
            NumericalWarning,
        )
    return variance.clamp_min(0.0)


def warn_if_variance_error_large(variance: Tensor, bound: Tensor, scale: Tensor) -> None:
    r"""Warn with a ``NumericalWarning`` where an iterative solve's error bound could make a
    predictive variance more than 10 % off.

    A variance :math:`k_{**} - q` from a quadratic form :math:`q` known to within ``bound``
    (absolute) may be off by that much. Bounds below :math:`\max(10^{-6}, \sqrt{\epsilon})`
    times the prior variance are not reported, the floor :func:`nonnegative_variance` allows a
    negative variance (a heuristic: rounding itself, about :math:`\epsilon\lambda_{\max}/\gamma`
    relative, is not bounded here; float32 solves have their own warning). Compiled or vmapped:
    nothing is checked (:func:`can_branch_on`).

    :param variance: the computed variances, any shape.
    :param bound: bounds on their absolute errors, broadcastable against ``variance``.
    :param scale: the prior variances, broadcastable against ``variance``.
    """
    if not can_branch_on(variance):
        return
    value = variance.detach()
    bound = bound.detach().to(value)
    floor = _rounding_tolerance(value.dtype) * scale.detach().abs().to(value)
    tolerable = torch.maximum(0.1 * value.abs(), floor)
    if bool((bound > tolerable).any()):
        worst = float((bound / torch.maximum(value.abs(), floor)).max())
        warn(
            f"the conjugate-gradient solves leave some predictive variances uncertain by up to "
            f"{worst:.3g} times their value (the bound |r|^2 / noise of a residual r within "
            "rtol of the right-hand side; small noise makes it large): lower rtol, or use "
            "backend='cholesky' where an N x N matrix fits",
            NumericalWarning,
        )
