import pytest

from gpsd import (
    BackendError,
    DistributedError,
    GpsdError,
    InsufficientMemoryError,
    NotFittedError,
    exceptions,
)


@pytest.mark.parametrize(
    ("error", "builtin"),
    [
        (NotFittedError, RuntimeError),
        (BackendError, RuntimeError),
        (DistributedError, RuntimeError),
        (InsufficientMemoryError, MemoryError),
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
        "NotFittedError",
    }
