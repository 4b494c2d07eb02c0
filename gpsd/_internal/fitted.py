"""The fit lifecycle of every estimator that fits in closed form: ``fit()``, lazy fitting, and
when a fit is stale."""

from __future__ import annotations

import abc
import dataclasses
import itertools
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from gpsd import settings
from gpsd._internal.module_state import ModuleState, adopt_buffer_shapes, same_values
from gpsd._internal.progress_reporter import check_progress
from gpsd.progress import Callback

__all__ = ["FitDependencies", "FitRecord", "Fitted", "fit_records"]

#: the name of the whole fit among an estimator's records (its parts have their own names)
_WHOLE = "fit"


@dataclasses.dataclass(frozen=True, eq=False)
class FitDependencies:
    """What a fit is computed from, declared by its estimator.

    :param modules: Modules whose parameters and buffers the fit reads (``None`` entries, such
        as an absent likelihood, are skipped).
    :param tensors: The estimator's own tensors that the fit reads (its buffers: training data,
        a noise schedule), compared by value as the modules' are.
    :param config: The estimator's settings that the fit depends on, compared with ``==``.
    """

    modules: tuple[nn.Module | None, ...] = ()
    tensors: tuple[Tensor, ...] = ()
    config: tuple = ()

    def present_modules(self) -> tuple[nn.Module, ...]:
        """:attr:`modules` without the ``None`` entries."""
        return tuple(module for module in self.modules if module is not None)

    def graph_needed(self) -> bool:
        """Whether a value computed from the dependencies now would carry an autograd graph:
        gradients are enabled and one of their tensors requires one."""
        modules = self.present_modules()
        module_tensors = (
            itertools.chain(module.parameters(), module.buffers()) for module in modules
        )
        return torch.is_grad_enabled() and any(
            tensor.requires_grad for tensor in itertools.chain(self.tensors, *module_tensors)
        )


class _BackwardWatch:
    """Notes when a backward pass reaches any of the watched tensors.

    A fit that carries an autograd graph serves one backward pass only (the pass frees the
    graph's saved tensors), so it is stale once :attr:`reached` is set. The hooks hold this small
    object alone, not the fit, so no reference cycle runs through the autograd graph.
    """

    def __init__(self) -> None:
        self.reached = False

    def _hook(self, grad: Tensor) -> None:
        self.reached = True

    def watch(self, *objects: object) -> None:
        """Hook every tensor that carries a graph among ``objects`` and their attributes
        (objects without attributes, such as tuples, are passed over)."""
        for obj in objects:
            if isinstance(obj, Tensor):
                values = (obj,)
            elif hasattr(obj, "__dict__") and not isinstance(obj, nn.Module):
                values = tuple(vars(obj).values())
            else:
                continue
            for value in values:
                if isinstance(value, Tensor) and value.requires_grad:
                    value.register_hook(self._hook)


class FitRecord:
    """A value with a copy of what it was computed from."""

    def __init__(self, dependencies: FitDependencies, value: Any, follows_gradients: bool) -> None:
        self.modules = [ModuleState(module) for module in dependencies.present_modules()]
        self.tensors = [tensor.detach().clone() for tensor in dependencies.tensors]
        self.config = (dependencies.config, settings.snapshot())
        self.with_graph = dependencies.graph_needed()
        self.follows_gradients = follows_gradients
        self.value = value
        self.backward = _BackwardWatch()
        if dataclasses.is_dataclass(value):  # a fit: each of its fields
            self.backward.watch(
                *(getattr(value, field.name) for field in dataclasses.fields(value))
            )
        else:
            self.backward.watch(value)

    def valid(self, dependencies: FitDependencies) -> bool:
        """Whether the value still belongs to ``dependencies`` (the rules of :class:`Fitted`)."""
        if self.backward.reached:
            return False
        if self.follows_gradients and not self.with_graph and dependencies.graph_needed():
            return False
        if self.config != (dependencies.config, settings.snapshot()):
            return False
        modules = dependencies.present_modules()
        if len(modules) != len(self.modules):
            return False
        if not same_values(self.tensors, list(dependencies.tensors)):
            return False
        return all(
            state.matches(module) for state, module in zip(self.modules, modules, strict=True)
        )


class _FitRecords(dict):
    """An estimator's :class:`FitRecord` by name; copies and pickles of the estimator start
    without any."""

    def __deepcopy__(self, memo: dict) -> _FitRecords:
        return _FitRecords()

    def __reduce__(self):
        return (_FitRecords, ())


def fit_records(owner: object) -> _FitRecords:
    """``owner``'s records (made on first use): where :class:`Fitted` keeps its fit and parts,
    and where an estimator that trains keeps what a cache of its own was built from."""
    return owner.__dict__.setdefault("_fit_records", _FitRecords())


class Fitted(abc.ABC):
    r"""The fit lifecycle, once for every estimator that fits in closed form (a mixin of a
    ``gpytorch.Module``).

    An estimator declares what its fit depends on (:meth:`_fit_dependencies`: modules, its own
    tensors, its settings) and computes the fit (:meth:`_compute_fit`), a frozen dataclass. This
    class does the rest: :meth:`fit` computes it now, and :meth:`_current_fit` returns it,
    computed first on first use and again whenever it is stale. A fit is stale when

    * a parameter or buffer of a declared module, or a declared tensor, has another value,
      shape, dtype or device (an optimiser step, a write through ``.data``, an assignment such
      as ``model.noise = ...``, ``set_train_data``, ``load_state_dict``, ``.to()``);
    * a declared setting of the estimator, or a :func:`gpsd.settings.snapshot` value (the
      :mod:`gpsd.settings` that can change a result), has changed;
    * the fit follows gradients (:meth:`_fit_follows_gradients`), was made without an autograd
      graph, and one is needed now (gradients enabled and a declared tensor requiring one);
      a fit made with a graph, or under grad mode from tensors that require none (which has no
      graph), serves under ``torch.no_grad()`` as it is;
    * a backward pass has reached a tensor of the fit that carries a graph (the pass freed it).

    Nothing else makes it stale: a prediction reads the fit and never refits. **State and
    devices**: a fit belongs to the values it was computed from, so ``load_state_dict`` and
    ``.to()`` that change any of them leave it stale, and the next use refits (fitted buffers
    that a state holds, such as Laplace modes, are warm starts for that refit, not the fit);
    ones that change nothing keep it. ``copy.deepcopy`` and ``pickle`` carry no fit: the copy
    refits on first use.

    A state saved after ``set_train_data(..., strict=False)`` or a fit of another batch shape
    loads into an estimator built alike: the buffers named in :attr:`_resizable_buffers` take
    the saved shapes first.

    A part of the fit with fewer dependencies (the factorisation of a kernel matrix, which new
    targets leave valid) is kept by :meth:`_fit_part` under the same rules, and reused by the
    next computation of the fit while its own dependencies hold.
    """

    #: the buffers whose shapes a loaded state may change (training data, fitted buffers)
    _resizable_buffers: ClassVar[tuple[str, ...]] = ()

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        adopt_buffer_shapes(self, state_dict, prefix, self._resizable_buffers)
        return super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    @abc.abstractmethod
    def _fit_dependencies(self) -> FitDependencies:
        """What the fit depends on now."""

    @abc.abstractmethod
    def _compute_fit(self, **options: Any) -> Any:
        """The fit at the current state, a frozen dataclass; ``options`` are :meth:`fit`'s."""

    def _fit_follows_gradients(self, fit: Any) -> bool:
        """Whether ``fit`` may carry an autograd graph through the dependencies, so that one
        made without a graph is stale once a graph is needed (default: ``False``, a fit made
        without autograd)."""
        return False

    def fit(self, *, progress: object = False, callback: Callback | None = None) -> Fitted:
        """Compute the fit now; returns the estimator.

        :param progress: ``True`` for a ``tqdm`` bar, or a bar of your own (:mod:`gpsd.progress`).
        :param callback: Called after each iteration with an :class:`~gpsd.IterationRecord`;
            returning ``True`` stops.
        """
        check_progress(progress, callback)
        self._refit(progress=progress, callback=callback)
        return self

    def _refit(self, **options: Any) -> Any:
        """Compute the fit now (its parts reused where valid) and keep it; returns it."""
        records = fit_records(self)
        records.pop(_WHOLE, None)
        fit = self._compute_fit(**options)
        # the copy is taken after computing: a fit that writes buffers (a warm start) leaves the
        # state it belongs to
        dependencies = self._fit_dependencies()
        records[_WHOLE] = FitRecord(dependencies, fit, self._fit_follows_gradients(fit))
        return fit

    def _current_fit(self) -> Any:
        """The fit at the current state: the kept one, or computed now where there is none or
        it is stale."""
        record = fit_records(self).get(_WHOLE)
        if record is None or not record.valid(self._fit_dependencies()):
            return self._refit()
        return record.value

    def _fit_part(
        self,
        name: str,
        dependencies: FitDependencies,
        compute: Callable[[], Any],
        follows_gradients: Callable[[Any], bool],
    ) -> Any:
        """The part ``name`` of the fit, computed by ``compute()`` where none is kept or the kept
        one is stale for ``dependencies`` (by the rules above; ``follows_gradients(part)`` as
        :meth:`_fit_follows_gradients`). Called from :meth:`_compute_fit`."""
        records = fit_records(self)
        record = records.get(name)
        if record is None or not record.valid(dependencies):
            records.pop(name, None)
            part = compute()
            records[name] = FitRecord(dependencies, part, follows_gradients(part))
        return records[name].value
