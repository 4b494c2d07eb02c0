"""One mechanism for every model that caches a fit: valid while nothing it depends on changed."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from gpsd import settings
from gpsd._internal.module_state import ModuleState


class BackwardWatch:
    """Notes when a backward pass reaches any of the watched tensors.

    A cached fit that carries an autograd graph serves one backward pass only (the pass frees the
    graph's saved tensors), so it is rebuilt once :attr:`reached` is set. The hooks hold this small
    object alone, not the cache, so no reference cycle runs through the autograd graph.
    """

    def __init__(self) -> None:
        self.reached = False

    def _hook(self, grad: Tensor) -> None:
        self.reached = True

    def watch(self, *objects: object) -> None:
        """Hook every tensor that carries a graph among ``objects`` and their attributes."""
        for obj in objects:
            values = (obj,) if isinstance(obj, Tensor) else vars(obj).values()
            for value in values:
                if isinstance(value, Tensor) and value.requires_grad:
                    value.register_hook(self._hook)


def _graph_needed(modules: tuple[nn.Module, ...]) -> bool:
    """Whether a value computed from ``modules`` now would carry an autograd graph through them:
    gradients are enabled and one of their parameters or buffers requires one."""
    return torch.is_grad_enabled() and any(
        tensor.requires_grad
        for module in modules
        for tensor in itertools.chain(module.parameters(), module.buffers())
    )


class FitCache:
    """A value computed from modules, with what it was computed from.

    The value stays valid while all of these are unchanged: the values, shapes, dtypes and
    devices of the modules' parameters and buffers (so an optimiser step, a write through
    ``.data``, ``load_state_dict`` and ``.to()`` all invalidate it), the ``config`` the owner
    passes (its settings that the fit depends on) and :func:`gpsd.settings.snapshot`. Where
    ``grad_matters`` (the value may carry an autograd graph through the modules), a value built
    without a graph is invalid once one is needed: gradients are enabled and a parameter or
    buffer of the modules requires them. A value built with a graph serves without one too
    (under ``torch.no_grad()``), and one built under grad mode from modules that require no
    gradient, which has no graph, serves under ``torch.no_grad()`` alike. A fit that carries an
    autograd graph is invalid after a backward pass has reached it (:meth:`watch`).

    Owners keep one ``FitCache`` per cached fit and call :meth:`get` wherever they need it.
    It is dropped from copies and pickles (:meth:`__deepcopy__`): a copy refits on first use.
    """

    def __init__(self) -> None:
        self._states: list[ModuleState] | None = None
        self._config: tuple | None = None
        self._with_graph = False
        self._backward = BackwardWatch()
        self.grad_matters = True
        self.value: Any = None

    def valid(self, modules: nn.Module | tuple[nn.Module, ...], config: tuple = ()) -> bool:
        """Whether the cached value still belongs to ``modules`` and ``config``."""
        modules = modules if isinstance(modules, tuple) else (modules,)
        if self._states is None or self._backward.reached:
            return False
        if self.grad_matters and not self._with_graph and _graph_needed(modules):
            return False
        if self._config != (config, settings.snapshot()):
            return False
        return len(self._states) == len(modules) and all(
            state.matches(module) for state, module in zip(self._states, modules, strict=True)
        )

    def store(self, modules: nn.Module | tuple[nn.Module, ...], config: tuple, value: Any) -> Any:
        """Keep ``value`` as computed from ``modules`` and ``config`` now; returns it. Tensors
        watched since the last :meth:`clear` (:meth:`watch`) stay watched."""
        modules = modules if isinstance(modules, tuple) else (modules,)
        self._states = [ModuleState(module) for module in modules]
        self._config = (config, settings.snapshot())
        self._with_graph = _graph_needed(modules)
        self.value = value
        return value

    def get(
        self,
        modules: nn.Module | tuple[nn.Module, ...],
        config: tuple,
        build: Callable[[], Any],
    ) -> Any:
        """The cached value, rebuilt by ``build()`` first where it is no longer valid."""
        if not self.valid(modules, config):
            self.clear()
            value = build()
            # the snapshot is taken after building: a build that writes buffers (a fitted mode)
            # leaves the state it depends on; ``build`` may call ``watch`` and set ``grad_matters``
            self.store(modules, config, value)
        return self.value

    def watch(self, *objects: object) -> None:
        """Invalidate the value once a backward pass reaches a tensor among ``objects``."""
        self._backward.watch(*objects)

    def clear(self) -> None:
        """Forget the value."""
        self.__init__()

    def __deepcopy__(self, memo: dict) -> FitCache:
        return FitCache()

    def __getstate__(self) -> dict:
        return FitCache().__dict__

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
