"""The values of a module's state (parameters and buffers), to tell when it has changed."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn


class ModuleState:
    """A copy of ``module.state_dict()``'s values at one moment.

    Caches built from a module (a factorisation, kept kernel rows) compare it on every use, so that
    any change (an optimiser step, a hyperparameter set through ``.data``, ``load_state_dict``,
    ``.to()``) invalidates them. Comparing is cheap next to what they cache.
    """

    def __init__(self, module: nn.Module) -> None:
        self.values: list[Tensor] = [t.detach().clone() for t in module.state_dict().values()]

    def matches(self, module: nn.Module) -> bool:
        """Whether ``module``'s state still has these values (shapes, dtypes and devices too)."""
        return same_values(self.values, list(module.state_dict().values()))


def same_values(saved: list[Tensor], current: list[Tensor]) -> bool:
    """Whether the tensors ``current`` have the values, shapes, dtypes and devices of ``saved``.

    Values on a GPU are compared there and the answer read once per device (the GPU waits once,
    not once per tensor: the chunked kernel operator asks at every product); values on the CPU
    one by one.
    """
    if len(current) != len(saved) or not all(
        a.shape == b.shape and a.dtype == b.dtype and a.device == b.device
        for a, b in zip(saved, current, strict=True)
    ):
        return False
    differs: dict[torch.device, list[Tensor]] = {}
    for a, b in zip(saved, current, strict=True):
        if a.device.type == "cpu":  # no device to wait for: the cheaper comparison
            if not torch.equal(a, b):
                return False
        elif a.numel():
            differs.setdefault(a.device, []).append(torch.ne(a, b).any())
    return not any(bool(torch.stack(flags).any()) for flags in differs.values())


def write_count(tensor: Tensor) -> int | None:
    """``tensor``'s version counter (it grows with every in-place write), or ``None`` for a
    tensor made under ``torch.inference_mode()``, which keeps no counter."""
    return None if tensor.is_inference() else tensor._version


def adopt_buffer_shapes(
    module: nn.Module, state_dict: dict, prefix: str, names: tuple[str, ...]
) -> None:
    """Resize ``module``'s buffers ``names`` to the shapes they have in ``state_dict``.

    For ``_load_from_state_dict``: the fitted buffers of the classifiers take the kernel's batch
    shape, known only after ``fit()``, and ``set_train_data`` may change the number of training
    points, so a freshly built model must adopt the saved shapes.
    """
    for name in names:
        saved = state_dict.get(prefix + name)
        current = getattr(module, name)
        if isinstance(saved, Tensor) and saved.shape != current.shape:
            setattr(module, name, current.new_empty(saved.shape))


def check_saved_num_steps(module: nn.Module, saved: object) -> None:
    """Raise a ``ValueError`` naming ``num_steps`` if ``saved``, a buffer of a state dict with one
    entry per distillation step along its first dimension, comes from a model with another
    ``num_steps`` than ``module``'s. For ``_load_from_state_dict``: the steps of one model do not
    belong to another's (and would not fit its buffers)."""
    if isinstance(saved, Tensor) and saved.dim() and saved.shape[0] != module.num_steps:
        raise ValueError(
            f"the state comes from a {type(module).__name__} with num_steps={saved.shape[0]}, "
            f"but this one has num_steps={module.num_steps}; build one with "
            f"num_steps={saved.shape[0]} to load it"
        )


def fixed_setting(name: str, doc: str) -> property:
    """A read-only property over ``self._<name>``: setting it raises an ``AttributeError`` that
    says the setting is fixed at construction (buffers were sized by it)."""

    def get(self):
        return getattr(self, "_" + name)

    def refuse(self, value: object) -> None:
        raise AttributeError(
            f"{name} is fixed at construction; build a new {type(self).__name__} to change it"
        )

    return property(get, refuse, doc=doc)


def checked_setting(name: str, check: Callable[[object], object], doc: str) -> property:
    """A property over ``self._<name>`` whose setter stores ``check(value)``: ``check`` raises
    a ``ValueError`` or ``TypeError`` naming the setting for a bad value."""

    def get(self):
        return getattr(self, "_" + name)

    def set_(self, value: object) -> None:
        setattr(self, "_" + name, check(value))

    return property(get, set_, doc=doc)


def choice_setting(name: str, choices: tuple[str, ...], doc: str) -> property:
    """A :func:`checked_setting` that takes only one of ``choices``, or raises a ``ValueError``
    naming the setting and the choices."""

    def check(value: object) -> object:
        if value not in choices:
            raise ValueError(f"{name} must be one of {choices}, got {value!r}")
        return value

    return checked_setting(name, check, doc)
