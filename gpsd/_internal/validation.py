"""Input checks shared by gpsd's public classes.

Every check raises a ``ValueError`` or ``TypeError`` whose message names the argument and says what
was expected, so that bad input never turns into a silent NaN further down.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import operator

import torch
from torch import Tensor

__all__ = [
    "as_float_tensor",
    "check_gp_modules",
    "check_test_inputs",
    "check_finite",
    "check_int",
    "check_matrix",
    "check_positive_float",
    "check_same_device",
    "check_vector",
    "replacement_data",
]


def as_float_tensor(
    value: object,
    name: str,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> Tensor:
    """Convert ``value`` to a floating-point tensor, raising a ``TypeError`` naming ``name``.

    Tensors and arrays keep their dtype unless ``dtype`` is given (then they are converted);
    anything else becomes ``dtype`` or, without one, the default dtype. Python numbers and (nested)
    lists or tuples of them are doubles, and are read as float64 before any conversion, so that
    they are rounded once: ``torch.as_tensor(0.05)`` is a float32 tensor, and converting it to
    float64 would give ``0.05000000074505806``.
    """
    if isinstance(value, Tensor):
        tensor = value
    else:
        tensor = None
        if isinstance(value, (int, float, list, tuple)) and not isinstance(value, bool):
            # not real numbers: tensor stays None, and the conversion below names the argument
            with contextlib.suppress(TypeError, ValueError, RuntimeError):
                tensor = torch.as_tensor(value, dtype=torch.float64)
                dtype = dtype or torch.get_default_dtype()
        if tensor is None:
            try:
                tensor = torch.as_tensor(value)
            except (TypeError, ValueError, RuntimeError) as err:
                raise TypeError(
                    f"{name} must be a tensor or array-like of numbers, got {type(value)}"
                ) from err
    if not (tensor.is_floating_point() or tensor.dtype in (torch.int32, torch.int64, torch.bool)):
        raise TypeError(f"{name} must hold real numbers, got dtype {tensor.dtype}")
    if dtype is None:
        dtype = tensor.dtype if tensor.is_floating_point() else torch.get_default_dtype()
    return tensor.to(dtype=dtype, device=device if device is not None else tensor.device)


def check_gp_modules(
    kernel: object, mean_module: object, kernel_name: str = "covar_module"
) -> None:
    """A GPyTorch ``Kernel`` and an optional GPyTorch ``Mean``, or a ``TypeError`` naming which."""
    from gpytorch.kernels import Kernel
    from gpytorch.means import Mean

    if not isinstance(kernel, Kernel):
        raise TypeError(
            f"{kernel_name} must be a gpytorch.kernels.Kernel, got {type(kernel).__name__}"
        )
    if mean_module is not None and not isinstance(mean_module, Mean):
        raise TypeError(
            f"mean_module must be a gpytorch.means.Mean or None, got {type(mean_module).__name__}"
        )


def check_finite(tensor: Tensor, name: str) -> Tensor:
    """Raise a ``ValueError`` if ``tensor`` holds NaN or infinite values."""
    if not torch.isfinite(tensor).all():
        n_bad = int((~torch.isfinite(tensor)).sum())
        raise ValueError(f"{name} must be finite, but it holds {n_bad} NaN or infinite value(s)")
    return tensor


def check_int(value: object, name: str, *, minimum: int = 1, optional: bool = False) -> int | None:
    """``value`` as an ``int`` of at least ``minimum`` (``None`` passes where ``optional``), or a
    ``ValueError`` naming ``name``. Integer types (NumPy's, 0-d integer tensors) are accepted;
    ``bool`` and floats are not."""
    if optional and value is None:
        return None
    try:
        number = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        number = None
    if number is None or number < minimum:
        kind = {0: "a non-negative integer", 1: "a positive integer"}.get(
            minimum, f"an integer >= {minimum}"
        )
        raise ValueError(f"{name} must be {kind}{' or None' if optional else ''}, got {value!r}")
    return number


def check_matrix(tensor: Tensor, name: str, *, nonempty: bool = False) -> Tensor:
    """Check that ``tensor`` has shape ``(*batch, n, d)`` (a 1-D tensor is read as ``(n, 1)``)
    and is finite; with ``nonempty``, that it holds at least one row (``n >= 1``)."""
    if tensor.dim() == 1:
        tensor = tensor.unsqueeze(-1)
    if tensor.dim() < 2:
        raise ValueError(f"{name} must have shape (*batch, n, d), got shape {tuple(tensor.shape)}")
    if nonempty and tensor.shape[-2] == 0:
        raise ValueError(
            f"{name} must hold at least one input (n >= 1 rows), got shape {tuple(tensor.shape)}"
        )
    return check_finite(tensor, name)


def check_vector(tensor: Tensor, name: str, n: int | None = None) -> Tensor:
    """Check that ``tensor`` has shape ``(*batch, n)`` and is finite."""
    if tensor.dim() < 1:
        raise ValueError(f"{name} must have shape (*batch, n), got a scalar")
    if n is not None and tensor.shape[-1] != n:
        raise ValueError(
            f"{name} must have {n} entries in its last dimension (one per training input), "
            f"got shape {tuple(tensor.shape)}"
        )
    return check_finite(tensor, name)


def check_same_device(reference: Tensor, tensor: Tensor, name: str, ref_name: str) -> None:
    """Raise a ``ValueError`` if ``tensor`` lives on another device than ``reference``."""
    if tensor.device != reference.device:
        raise ValueError(
            f"{name} is on {tensor.device} but {ref_name} is on {reference.device}; "
            f"move them to the same device with .to(device)"
        )


def check_test_inputs(x: object, train_inputs: Tensor, name: str = "test_x") -> Tensor:
    """Test inputs as ``(*batch, M, d)`` in the training inputs' dtype, device and width ``d``."""
    x = check_matrix(as_float_tensor(x, name, dtype=train_inputs.dtype), name)
    check_same_device(train_inputs, x, name, "train_x")
    if x.shape[-1] != train_inputs.shape[-1]:
        raise ValueError(
            f"{name} must have {train_inputs.shape[-1]} features (as train_x), "
            f"got shape {tuple(x.shape)}"
        )
    return x


def check_positive_float(value: object, name: str, *, allow_zero: bool = False) -> float:
    """``value`` (a real number or a one-element real tensor) as a finite ``float > 0`` (``>= 0``
    with ``allow_zero``), or a ``ValueError`` naming ``name``; ``bool``, strings and tensors of
    several elements are bad."""
    kind = "a finite float >= 0" if allow_zero else "a positive float"
    scalar_tensor = (
        isinstance(value, Tensor)
        and value.numel() == 1
        and not value.is_complex()
        and value.dtype != torch.bool
    )
    if not (isinstance(value, numbers.Real) or scalar_tensor) or isinstance(value, bool):
        raise ValueError(f"{name} must be {kind}, got {value!r}")
    number = float(value)
    if not (math.isfinite(number) and (number >= 0 if allow_zero else number > 0)):
        raise ValueError(f"{name} must be {kind}, got {value!r}")
    return number


def replacement_data(
    inputs: object, targets: object, current_x: Tensor, current_y: Tensor, strict: bool
) -> tuple[object, object]:
    """The new ``(inputs, targets)`` of a ``set_train_data`` call, GPyTorch's ``ExactGP``
    convention: ``None`` keeps the current one, a one-element tuple or list of inputs is
    unpacked, and with ``strict`` a new tensor must have the current one's shape, dtype and
    device (``strict=False`` lets them change). The caller checks the values."""
    if isinstance(inputs, (tuple, list)) and len(inputs) == 1 and isinstance(inputs[0], Tensor):
        inputs = inputs[0]
    pairs = ((inputs, current_x, "inputs"), (targets, current_y, "targets"))
    for new, current, name in pairs:
        if not strict or new is None:
            continue
        old = (tuple(current.shape), current.dtype, current.device)
        got = type(new)
        if isinstance(new, Tensor):
            # 1-D inputs are read as (n, 1), as at construction
            shape = (*new.shape, 1) if name == "inputs" and new.dim() == 1 else tuple(new.shape)
            got = (shape, new.dtype, new.device)
        if got != old:
            raise ValueError(
                f"{name} must have the current shape, dtype and device {old} with strict=True, "
                f"got {got}; pass strict=False to change them"
            )
    return (current_x if inputs is None else inputs), (current_y if targets is None else targets)
