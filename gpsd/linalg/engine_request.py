"""What :func:`~gpsd.linalg.make_engine` is asked for, as one value a cache can keep."""

from __future__ import annotations

import dataclasses

import torch
from gpytorch.kernels import Kernel
from torch import Tensor

from gpsd._internal.collectives import check_group
from gpsd._internal.module_state import ModuleState
from gpsd._internal.validation import check_int, check_positive_float

__all__ = ["EngineRequest"]

#: The backends of :func:`~gpsd.linalg.make_engine`, :class:`~gpsd.distillation.DataCentricGPR`
#: and :class:`~gpsd.distillation.DistributionCentricGPR`.
BACKENDS = ("auto", "dense", "cholesky", "lanczos", "cg")


@dataclasses.dataclass(frozen=True, eq=False)
class EngineRequest:
    r"""Everything :func:`~gpsd.linalg.make_engine` builds an engine from: the kernel matrix
    :math:`\mathbf K` of ``covar_module`` at ``inputs``, the backend, the schedules the filters will
    have, and the accuracy and memory the engine is held to.

    A request is validated when it is made, and it is the key of a cached engine: two requests
    are equal when an engine built for one serves the other. The kernel is compared by identity
    and by the values of its parameters and buffers, the process group by identity, and the
    inputs and every other field by value; the values are those at the moment the request is
    made (a copy is kept), so that an optimiser step or an in-place write to the inputs makes a
    later request unequal to an earlier one.

    :param covar_module: the GPyTorch kernel.
    :param inputs: the training inputs, shape ``(*b, N, d)``.
    :param backend: one of :data:`~gpsd.linalg.BACKENDS`.
    :param schedule_shape: the batch shape ``*s`` of the noise schedules (``backend="auto"``
        counts the factorisations with it).
    :param steps: the steps :math:`T` of every schedule.
    :param dtype: the dtype of the factorisation (``None``: the inputs').
    :param rank: the Lanczos rank (``None``: grown until the error estimate meets ``rtol``).
    :param rtol: the relative tolerance of the matrix-free backends.
    :param smallest_noise: :math:`\gamma_{\min}`, the smallest shift any filter will use.
    :param cache_bytes: the kernel rows a matrix-free backend keeps, in bytes (``None``:
        :class:`gpsd.settings.kernel_cache_fraction` of the free memory).
    :param process_group: the ``torch.distributed.ProcessGroup`` whose ranks share the kernel
        rows (``None``: one process).
    :param seed: the seed of the Lanczos start block.
    :param free_bytes: the memory the policy may plan with (``None``: measured on the inputs'
        device, within :class:`gpsd.settings.memory_limit`).
    """

    covar_module: Kernel
    inputs: Tensor
    backend: str
    schedule_shape: torch.Size
    steps: int
    dtype: torch.dtype | None
    rank: int | None
    rtol: float
    smallest_noise: float
    cache_bytes: int | None = None
    process_group: object = None
    seed: int = 0
    free_bytes: int | None = None
    _kernel_state: ModuleState = dataclasses.field(init=False, repr=False)
    _inputs_copy: Tensor = dataclasses.field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.covar_module, Kernel):
            raise TypeError(
                f"covar_module must be a gpytorch Kernel, got {type(self.covar_module).__name__}"
            )
        if not isinstance(self.inputs, Tensor) or self.inputs.dim() < 2:
            raise ValueError(
                "inputs must be a tensor of shape (*b, N, d), got "
                f"{getattr(self.inputs, 'shape', type(self.inputs).__name__)}"
            )
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.dtype is not None and not (
            isinstance(self.dtype, torch.dtype) and self.dtype.is_floating_point
        ):
            raise TypeError(
                f"dtype must be a floating-point torch.dtype or None, got {self.dtype!r}"
            )
        try:
            shape = torch.Size(self.schedule_shape)
        except TypeError:
            raise TypeError(
                f"schedule_shape must be a torch.Size, got {self.schedule_shape!r}"
            ) from None
        if self.process_group is not None:
            check_group(self.process_group)
        checked = {
            "schedule_shape": shape,
            "steps": check_int(self.steps, "steps"),
            "rank": check_int(self.rank, "rank", optional=True),
            "rtol": check_positive_float(self.rtol, "rtol"),
            "smallest_noise": check_positive_float(self.smallest_noise, "smallest_noise"),
            "cache_bytes": check_int(self.cache_bytes, "cache_bytes", minimum=0, optional=True),
            "seed": check_int(self.seed, "seed", minimum=0),
            "free_bytes": check_int(self.free_bytes, "free_bytes", minimum=0, optional=True),
            "_kernel_state": ModuleState(self.covar_module),
            "_inputs_copy": self.inputs.detach().clone(),
        }
        for name, value in checked.items():
            object.__setattr__(self, name, value)

    def _fields(self) -> tuple:
        """The fields compared by value."""
        return tuple(
            getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.init and f.name not in ("covar_module", "inputs", "process_group")
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, EngineRequest):
            return NotImplemented
        return (
            self.covar_module is other.covar_module
            and self.process_group is other.process_group
            and self._fields() == other._fields()
            and _same_values(self._inputs_copy, other._inputs_copy)
            and _same_values(self._kernel_state.values, other._kernel_state.values)
        )

    def __hash__(self) -> int:
        return hash((id(self.covar_module), id(self.process_group), self._fields()))


def _same_values(a: Tensor | list[Tensor], b: Tensor | list[Tensor]) -> bool:
    """Whether tensors (or lists of them) have the same shapes, dtypes, devices and values."""
    a, b = ([a], [b]) if isinstance(a, Tensor) else (a, b)
    return len(a) == len(b) and all(
        x.shape == y.shape and x.dtype == y.dtype and x.device == y.device and torch.equal(x, y)
        for x, y in zip(a, b, strict=True)
    )
