"""The check made before a computation allocates dense ``N x N`` matrices: the bytes they need
against the device's free memory (:func:`gpsd.linalg.free_memory_bytes`)."""

from __future__ import annotations

import torch
from torch import Tensor

from gpsd.exceptions import InsufficientMemoryError
from gpsd.linalg.memory import free_memory_bytes

__all__ = ["check_dense_matrices_fit"]


def check_dense_matrices_fit(
    task: str, matrices: int, x: Tensor, batch_shape: torch.Size, what: str, advice: str
) -> None:
    """Raise :class:`~gpsd.InsufficientMemoryError` where ``matrices`` matrices of ``N x N`` in
    the dtype of the inputs ``x`` (``(..., N, d)``), for every problem of ``batch_shape``, do not
    fit in the free memory of ``x``'s device.

    :param task: What allocates them, as ``"ClassName.method"``.
    :param matrices: How many ``N x N`` matrices per problem the task holds at its peak.
    :param what: What the matrices are, for the message.
    :param advice: The setting or argument to change, for the message.
    """
    n, dtype, device = x.shape[-2], x.dtype, x.device
    one = n * n * (torch.finfo(dtype).bits // 8)
    needed = matrices * batch_shape.numel() * one
    free = free_memory_bytes(device, wanted=needed)
    if needed > free:
        problems = f" for each of {batch_shape.numel()} problems" if batch_shape.numel() > 1 else ""
        raise InsufficientMemoryError(
            f"{task} needs about {needed} bytes ({needed / 2**30:.3g} GiB: {matrices} matrices of "
            f"N x N = {n} x {n} in {dtype}{problems}, {what}) on {device}, but {free} bytes "
            f"({free / 2**30:.3g} GiB) are free; {advice}"
        )
