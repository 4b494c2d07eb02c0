"""Settings: context managers for gpsd's tuning knobs, in GPyTorch's style.

Each setting is a class. ``setting.value()`` reads the value in force; ``with setting(v):``
changes it inside the block (nested blocks restore the outer value on exit, also when an
exception leaves the block). The defaults are the measured choices of the benchmarks under
``benchmarks/results/``; change them to trade memory for time, or to exercise a rare path in a
test::

    import gpsd

    with gpsd.settings.test_chunk_size(512), gpsd.settings.max_lanczos_rank(256):
        prediction = model.predict(test_x)

Settings whose value depends on the device (:class:`dense_max_n`,
:class:`max_chain_factorisations`, :class:`memory_limit`) take one value for every device, or one per device type as
the keywords ``cpu=`` and ``cuda=`` (``dense_max_n(cpu=4000)``); other accelerators take
``cuda``'s value. ``value(device)`` reads the one for a device.

Values are held per thread and per :mod:`asyncio` task (in :mod:`contextvars`): a ``with`` block
changes the value for the code it runs and nowhere else, so two threads that nest settings leave
each other's values alone. A thread starts with the defaults; to run work in another thread
under the settings in force, run it in a copy of the context
(``contextvars.copy_context().run(work)``).

Models that cache a factorisation include :func:`snapshot` in what their cache depends on, so
that a prediction inside a ``with`` block never reuses a factorisation made under settings that
give another result. Settings that trade memory for time alone (:class:`test_chunk_size`,
:class:`kernel_cache_fraction`, :class:`keep_kernel_rows_after`, :class:`max_chunk_elements`)
are left out of it: a model fitted inside ``with gpsd.settings.test_chunk_size(1024):`` predicts
outside the block without factorising again.
"""

from __future__ import annotations

from contextvars import ContextVar, Token
from typing import Any, ClassVar

import torch

__all__ = [
    "cg_deflation_rank",
    "dense_max_n",
    "dense_memory_fraction",
    "kernel_cache_fraction",
    "keep_kernel_rows_after",
    "max_chain_factorisations",
    "max_chunk_elements",
    "max_lanczos_rank",
    "memory_limit",
    "snapshot",
    "test_chunk_size",
    "trace_probe_seed",
    "trace_probes",
]


class _Setting:
    """A value with a default, changed inside ``with`` blocks for the running thread or task."""

    _value: ClassVar[Any]  # the default
    _var: ClassVar[ContextVar]
    _registry: ClassVar[list[type[_Setting]]] = []
    #: Whether the value can change a result beyond rounding (and so belongs in
    #: :func:`snapshot`), rather than only the memory and time it takes.
    changes_results: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "_value" in vars(cls):  # a concrete setting, not an intermediate base
            cls._var = ContextVar(f"gpsd.settings.{cls.__name__}", default=cls._value)
            _Setting._registry.append(cls)

    @classmethod
    def _check(cls, value: Any) -> Any:
        return value

    @classmethod
    def value(cls) -> Any:
        """The value in force."""
        return cls._var.get()

    def __init__(self, value: Any) -> None:
        self._new = type(self)._check(value)

    def _entered_value(self) -> Any:
        """The value the block sets, given the one in force where it is entered."""
        return self._new

    def __enter__(self) -> _Setting:
        token = type(self)._var.set(self._entered_value())
        _open_blocks.set((*_open_blocks.get(), (self, token)))
        return self

    def __exit__(self, *exc: object) -> bool:
        blocks = _open_blocks.get()
        # the innermost block of this instance in the running thread or task
        entered = [i for i, (setting, _) in enumerate(blocks) if setting is self]
        if not entered:
            raise RuntimeError(
                f"gpsd.settings.{type(self).__name__} is left in a thread or task that did not "
                "enter it"
            )
        index = entered[-1]
        type(self)._var.reset(blocks[index][1])
        _open_blocks.set(blocks[:index] + blocks[index + 1 :])
        return False


#: The blocks open in the running thread or task, innermost last, with the token that restores
#: the value in force before each (one instance may be open in several threads at once).
_open_blocks: ContextVar[tuple[tuple[_Setting, Token], ...]] = ContextVar(
    "gpsd.settings open blocks", default=()
)


def _positive_int(name: str, minimum: int = 1):
    def check(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"gpsd.settings.{name} must be an int >= {minimum}, got {value!r}")
        return value

    return check


def _fraction(name: str):
    def check(value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
            raise ValueError(f"gpsd.settings.{name} must be a number in (0, 1], got {value!r}")
        return float(value)

    return check


class test_chunk_size(_Setting):
    """Test points predicted per chunk by the regression distillers (default 4096): memory for
    the N x chunk cross-covariance against the number of kernel evaluations."""

    changes_results = False
    _value = 4096
    _check = staticmethod(_positive_int("test_chunk_size"))


class max_lanczos_rank(_Setting):
    """Largest Krylov basis Lanczos grows to when no ``rank=`` is given (default 1024). There
    ``backend="auto"`` switches to deflated CG and ``backend="lanczos"`` stops (its accuracy
    check then warns or raises)."""

    _value = 1024
    _check = staticmethod(_positive_int("max_lanczos_rank"))


class cg_deflation_rank(_Setting):
    """Rank of the Lanczos run whose Ritz pairs deflate the CG backend when no ``rank=`` is
    given (default 256)."""

    _value = 256
    _check = staticmethod(_positive_int("cg_deflation_rank"))


class kernel_cache_fraction(_Setting):
    """Fraction of the device's free memory that the matrix-free backends fill with kernel rows
    kept between products when no ``kernel_cache_bytes=`` is given (default 0.5)."""

    changes_results = False
    _value = 0.5
    _check = staticmethod(_fraction("kernel_cache_fraction"))


class keep_kernel_rows_after(_Setting):
    """Products with the row-chunked kernel operator before it starts keeping rows (default 3:
    block Lanczos resolves a smooth kernel in three, and holding K then costs more than it saves;
    on a 2-core CPU at N = 32,768: 22 s with every row kept against 19 s without, 13 GiB
    against 1 GiB)."""

    changes_results = False
    _value = 3
    _check = staticmethod(_positive_int("keep_kernel_rows_after", minimum=0))


class dense_memory_fraction(_Setting):
    """Fraction of the device's free memory that ``backend="auto"`` lets a dense
    eigendecomposition or a Cholesky chain fill (default 0.8)."""

    _value = 0.8
    _check = staticmethod(_fraction("dense_memory_fraction"))


class max_chunk_elements(_Setting):
    """Elements of the largest temporary block that chunked evaluations form (default 2**24:
    kernel distillation's student predictions, the DPKL classifier's pairwise differences)."""

    changes_results = False
    _value = 2**24
    _check = staticmethod(_positive_int("max_chunk_elements"))


class trace_probes(_Setting):
    """Probe vectors of the stochastic trace estimates of the ``"lanczos"`` and ``"cg"``
    backends (default 32), as :meth:`~gpsd.DataCentricGPR.gcv` uses them: the standard error
    falls as one over the square root of the count, the cost rises with it (on CG, one set of
    solves per chunk of probes). A model keys its GCV scores on this setting itself: a change
    re-estimates them without refactoring."""

    changes_results = False
    _value = 32
    _check = staticmethod(_positive_int("trace_probes", minimum=2))


class trace_probe_seed(_Setting):
    """Seed of the probe vectors of the stochastic trace estimates (default 0): the same seed
    gives the same probes, and so the same GCV scores, on every device and every rank. Keyed
    on by the models as :class:`trace_probes` is."""

    changes_results = False
    _value = 0
    _check = staticmethod(_positive_int("trace_probe_seed", minimum=0))


class _DeviceSetting(_Setting):
    """A setting with one value per device type, given as the keywords ``cpu=`` and ``cuda=``
    (other accelerators take ``cuda``'s)."""

    _value: ClassVar[dict[str, int]]

    def __init__(self, value: int | None = None, **per_device: int) -> None:
        name = f"gpsd.settings.{type(self).__name__}"
        if value is not None and per_device:
            raise ValueError(
                f"{name} takes one value for every device or values per device type as "
                "keywords, not both"
            )
        if value is None and not per_device:
            raise ValueError(f"{name} needs a value")
        accepted = tuple(type(self)._value)
        for keyword in per_device:
            if keyword not in accepted:
                raise TypeError(
                    f"{name} got an unknown device keyword {keyword!r}; the device keywords "
                    f"are {', '.join(accepted)}"
                )
        check = type(self)._check_one()
        if value is not None:
            per_device = dict.fromkeys(accepted, value)
        self._new = {keyword: check(v) for keyword, v in per_device.items()}

    @classmethod
    def _check_one(cls):
        """The check of one device's value."""
        return _positive_int(cls.__name__)

    def _entered_value(self) -> dict[str, int]:
        return {**type(self)._var.get(), **self._new}

    @classmethod
    def value(cls, device: torch.device | str | None = None) -> Any:
        """The value for ``device``'s type (``None``: the whole mapping)."""
        values = cls._var.get()
        if device is None:
            return dict(values)
        kind = torch.device(device).type
        return values.get(kind, values["cuda"])


class dense_max_n(_DeviceSetting):
    """Largest N for which ``backend="auto"`` considers the dense eigendecomposition (default
    12,000 on the CPU, 4,096 on CUDA, where ``torch.linalg.eigh`` is slow in some builds;
    calibrated in ``benchmarks/results/backend_choice_*.md``)."""

    _value = {"cpu": 12_000, "cuda": 4096}


class max_chain_factorisations(_DeviceSetting):
    """Most Cholesky factorisations (steps times schedules) for which ``backend="auto"`` takes
    the Cholesky chain over a decomposition (default 3 on both device types)."""

    _value = {"cpu": 3, "cuda": 3}


class memory_limit(_DeviceSetting):
    """Most bytes gpsd takes to be free on a device (default: no limit, the free memory
    :func:`~gpsd.linalg.free_memory_bytes` measures). Inside ``with
    gpsd.settings.memory_limit(cpu=2**30):`` every decision that reads the free memory sees at
    most 1 GiB on the CPU: the choice of ``backend="auto"``, the refusals of the backends and
    models that form ``N x N`` matrices (:class:`~gpsd.InsufficientMemoryError`), and the kernel
    rows the matrix-free backends keep. It holds a run within a share of a machine that others
    use, and makes a test of those decisions independent of the machine. A limit is a
    non-negative int of bytes; ``memory_limit(n)`` sets it for every device type."""

    _value = {"cpu": None, "cuda": None}

    @classmethod
    def _check_one(cls):
        return _positive_int(cls.__name__, minimum=0)


def snapshot() -> tuple:
    """The value now of every setting that can change a result: part of what a cached fit
    depends on (the settings that trade memory for time alone are left out)."""
    out = []
    for setting in _Setting._registry:
        if not setting.changes_results:
            continue
        value = setting._var.get()
        out.append(tuple(sorted(value.items())) if isinstance(value, dict) else value)
    return tuple(out)
