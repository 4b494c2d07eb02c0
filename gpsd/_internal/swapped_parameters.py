"""A module evaluated with other tensors in place of its parameters, for one block of code."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

from torch import Tensor, nn


@contextlib.contextmanager
def swapped_parameters(module: nn.Module, values: Sequence[Tensor]) -> Iterator[None]:
    """Inside the block, ``module``'s parameters are ``values``, in the order of
    ``module.parameters()``; the parameters are put back on leaving it.

    Every submodule holding a parameter is visited once, and a parameter shared by several
    submodules is replaced in each; the swap writes the submodules' ``_parameters`` entries, so
    that properties computed from them (a constrained ``lengthscale``) read the values given,
    with their autograd graph. Values that are the parameters themselves are left alone.

    :raises ValueError: unless there is one value per parameter.
    """
    params = list(module.parameters())
    if len(values) != len(params):
        raise ValueError(
            f"values must hold one tensor per parameter of the module ({len(params)}), "
            f"got {len(values)}"
        )
    replace = {id(p): v for p, v in zip(params, values, strict=True) if v is not p}
    swapped: list[tuple[dict, str, Tensor]] = []
    try:
        if replace:
            for submodule in module.modules():
                for name, value in list(submodule._parameters.items()):
                    if value is not None and id(value) in replace:
                        swapped.append((submodule._parameters, name, value))
                        submodule._parameters[name] = replace[id(value)]
        yield
    finally:
        for store, name, value in reversed(swapped):
            store[name] = value
