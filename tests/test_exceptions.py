import builtins
import importlib
import pkgutil

import pytest

import gpsd
from gpsd import (
    BackendError,
    DistributedError,
    GpsdError,
    InsufficientMemoryError,
    LaplaceConvergenceError,
    NonFiniteEmbeddingsError,
    NotFittedError,
    TeacherError,
    exceptions,
)


@pytest.mark.parametrize(
    ("error", "builtin"),
    [
        (NotFittedError, RuntimeError),
        (BackendError, RuntimeError),
        (DistributedError, RuntimeError),
        (InsufficientMemoryError, MemoryError),
        (LaplaceConvergenceError, RuntimeError),
        (NonFiniteEmbeddingsError, ValueError),
        (TeacherError, TypeError),
        (TeacherError, ValueError),
    ],
)
def test_each_gpsd_error_is_also_the_builtin_a_caller_would_catch(error, builtin):
    assert issubclass(error, GpsdError) and issubclass(error, builtin)
    with pytest.raises(builtin, match="call fit"):
        raise error("call fit() first")


def test_the_exceptions_module_exports_every_error():
    assert set(exceptions.__all__) == {
        "BackendError",
        "DistributedError",
        "GpsdError",
        "InsufficientMemoryError",
        "LaplaceConvergenceError",
        "NonFiniteEmbeddingsError",
        "NotFittedError",
        "TeacherError",
    }


def _exception_classes_of_gpsd():
    """Every exception class defined in a module of gpsd or exported by one (warnings aside)."""
    found = set()
    for info in pkgutil.walk_packages(gpsd.__path__, "gpsd."):
        module = importlib.import_module(info.name)
        names = set(vars(module)) | set(getattr(module, "__all__", ()))
        for name in names:
            obj = getattr(module, name, None)
            if not (isinstance(obj, type) and issubclass(obj, BaseException)):
                continue
            if issubclass(obj, Warning):
                continue
            if obj.__module__.split(".")[0] == "gpsd" or name in getattr(module, "__all__", ()):
                found.add(obj)
    return found


def test_every_exception_gpsd_defines_or_exports_is_a_gpsd_error_and_a_builtin():
    classes = _exception_classes_of_gpsd()
    assert {LaplaceConvergenceError, NonFiniteEmbeddingsError} <= classes
    builtin = tuple(
        obj
        for obj in vars(builtins).values()
        if isinstance(obj, type) and issubclass(obj, Exception) and obj is not Exception
    )
    for cls in classes:
        assert issubclass(cls, GpsdError), f"{cls.__module__}.{cls.__name__} is no GpsdError"
        if cls is not GpsdError:
            assert issubclass(cls, builtin), f"{cls.__name__} derives from no built-in error"
        # one place to find them: gpsd.exceptions, and the top level
        assert getattr(exceptions, cls.__name__) is cls
        assert getattr(gpsd, cls.__name__) is cls
