"""Collectives over a ``torch.distributed`` process group, with the checks and errors gpsd needs.

Every function here is collective: each rank of the group calls it, in the same order, with
tensors of the same dtype and (but for the dimension that is gathered) the same shape. A
collective that fails (a rank left or failed, or the group's ``timeout`` ran out while a rank
did not join) raises a :class:`~gpsd.DistributedError` naming the operation.
"""

from __future__ import annotations

import itertools
import zlib
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from gpsd.exceptions import DistributedError

__all__ = [
    "all_gather",
    "all_gather_cat",
    "all_reduce_sum",
    "check_group",
    "check_same",
    "comm_device",
    "dtype_code",
    "exact_checksum",
    "module_fingerprint",
    "split_sizes",
    "tensor_fingerprint",
    "text_checksum",
]

#: The dtypes a fingerprint can name, by their position.
_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def check_group(process_group: object, name: str = "process_group") -> tuple[int, int]:
    """The rank of this process in ``process_group`` and the group's size.

    :raises TypeError: unless ``process_group`` is a ``torch.distributed.ProcessGroup``.
    :raises ValueError: where ``torch.distributed`` is not initialised or this process is not
        a member of the group.
    """
    dist = torch.distributed
    if not dist.is_available():
        raise ValueError(f"{name} needs torch.distributed, which this build of torch lacks")
    if not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(
            f"{name} must be a torch.distributed.ProcessGroup (torch.distributed.group.WORLD for "
            f"the default group), got {type(process_group).__name__}"
        )
    if not dist.is_initialized():
        raise ValueError(
            f"{name} needs torch.distributed.init_process_group() to have run on every rank"
        )
    rank = dist.get_rank(process_group)
    if rank < 0:
        raise ValueError(f"this process is not a member of {name}")
    return rank, dist.get_world_size(process_group)


def split_sizes(n: int, parts: int) -> list[int]:
    """Sizes of ``parts`` contiguous blocks of ``0..n``, as even as can be (the first
    ``n % parts`` one larger)."""
    base, extra = divmod(n, parts)
    return [base + (i < extra) for i in range(parts)]


def _collective(what: str, group: object, run: Callable[[], None]) -> None:
    """Run the collective ``run``, turning its failure into a :class:`~gpsd.DistributedError`."""
    try:
        run()
    except (RuntimeError, ValueError) as err:
        rank = torch.distributed.get_rank(group)
        size = torch.distributed.get_world_size(group)
        raise DistributedError(
            f"rank {rank} of {size}: the {what} failed: another rank has failed or left, called "
            "other methods or passed other arguments, or did not join within the process "
            f"group's timeout ({type(err).__name__}: {err})"
        ) from err


def comm_device(group: object, device: torch.device) -> torch.device:
    """Where the group's collectives take tensors that live on ``device``: there where the
    group's backend includes NCCL, else on the CPU (gloo)."""
    backend = str(torch.distributed.get_backend(group)).lower()
    return device if "nccl" in backend else torch.device("cpu")


def all_gather(tensor: Tensor, group: object, what: str) -> list[Tensor]:
    """Every rank's ``tensor`` (the same shape and dtype on every rank), in rank order, on the
    device of ``tensor``; ``what`` names the operation in an error."""
    device = tensor.device
    sent = tensor.detach().contiguous().to(comm_device(group, device))
    size = torch.distributed.get_world_size(group)
    parts = [torch.empty_like(sent) for _ in range(size)]
    _collective(what, group, lambda: torch.distributed.all_gather(parts, sent, group=group))
    return [p.to(device) for p in parts]


def all_gather_cat(
    tensor: Tensor, dim: int, sizes: Sequence[int], group: object, what: str
) -> Tensor:
    """Every rank's ``tensor`` concatenated along ``dim``, rank by rank, on every rank.

    Rank ``r``'s tensor has ``sizes[r]`` entries along ``dim`` (its other dimensions are the
    same on every rank); it is padded to the largest size for the ``all_gather``, so the
    volume received is ``len(sizes) * max(sizes)`` slices.
    """
    dim = dim % tensor.dim()
    largest = max(sizes)
    if tensor.shape[dim] < largest:
        pad = list(tensor.shape)
        pad[dim] = largest - tensor.shape[dim]
        tensor = torch.cat([tensor, tensor.new_zeros(pad)], dim=dim)
    parts = all_gather(tensor, group, what)
    return torch.cat([p.narrow(dim, 0, s) for p, s in zip(parts, sizes, strict=True)], dim=dim)


def all_reduce_sum(tensor: Tensor, group: object, what: str) -> Tensor:
    """The sum over the ranks of ``tensor`` (the same shape and dtype on every rank), on every
    rank; ``what`` names the operation in an error.

    The ranks' tensors are gathered and added in rank order on every rank, so that every rank
    holds the same bits whatever order the backend's own reduction would add them in (and the
    same bits from run to run). It moves ``P`` times the tensor to every rank: meant for small
    tensors (sums of a few scalars).
    """
    parts = all_gather(tensor, group, what)
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


def exact_checksum(tensor: Tensor) -> Tensor:
    """Two int64 checksums of the bits of ``tensor`` (its plain and position-weighted sums,
    modulo :math:`2^{64}`): exact and independent of the order of summation, so equal values
    give equal checksums on every rank and any device."""
    flat = tensor.detach().contiguous().reshape(-1)
    if flat.is_floating_point() or flat.is_complex():
        flat = flat.view(_INT_VIEW[flat.element_size()])
    flat = flat.to(torch.int64)
    weights = torch.arange(flat.numel(), device=flat.device, dtype=torch.int64) % 65521 + 1
    return torch.stack([flat.sum(), (flat * weights).sum()]).cpu()


def text_checksum(text: str) -> int:
    """A checksum of ``text`` that is the same in every process (``hash`` is salted)."""
    return zlib.crc32(text.encode())


def dtype_code(dtype: torch.dtype) -> int:
    """A number for ``dtype`` that is the same in every process."""
    return _DTYPES.index(dtype) if dtype in _DTYPES else 100 + text_checksum(str(dtype))


def tensor_fingerprint(name: str, tensor: Tensor) -> dict[str, Tensor]:
    """The shape, dtype and :func:`exact_checksum` of ``tensor``, as :func:`check_same` fields
    named after ``name`` (``"shape of x"``, ``"dtype of x"``, ``"values of x"``)."""
    return {
        f"shape of {name}": torch.tensor([text_checksum(str(tuple(tensor.shape)))]),
        f"dtype of {name}": torch.tensor([dtype_code(tensor.dtype)]),
        f"values of {name}": exact_checksum(tensor),
    }


def module_fingerprint(module: torch.nn.Module, name: str = "kernel") -> dict[str, Tensor]:
    """The types of ``module``'s submodules, the names, shapes and dtypes of its parameters and
    buffers, and an exact checksum of their values, as :func:`check_same` fields named after
    ``name`` (``"kernel modules"``, ``"kernel hyperparameter values"``, ...)."""
    tensors = list(itertools.chain(module.named_parameters(), module.named_buffers()))
    layout = ";".join(f"{key}:{tuple(t.shape)}:{t.dtype}" for key, t in tensors)
    types = ",".join(type(m).__qualname__ for m in module.modules())
    sums = [exact_checksum(t) for _, t in tensors]
    values = exact_checksum(torch.stack(sums)) if sums else torch.zeros(2, dtype=torch.int64)
    return {
        f"{name} modules": torch.tensor([text_checksum(types)]),
        f"{name} hyperparameter shapes and dtypes": torch.tensor([text_checksum(layout)]),
        f"{name} hyperparameter values": values,
    }


def check_same(fields: dict[str, Tensor], group: object, what: str, advice: str) -> None:
    """Raise the same ``ValueError`` on every rank unless each field (an int64 vector, of the
    same length on every rank) is equal on every rank.

    The fields are gathered on every rank, so each sees what the others hold and they all
    raise together (none is left waiting in a later collective).
    """
    names = list(fields)
    values = torch.cat([fields[name].reshape(-1).to(torch.int64) for name in names])
    lengths = [fields[name].numel() for name in names]
    rank, size = torch.distributed.get_rank(group), torch.distributed.get_world_size(group)
    gathered = torch.stack(all_gather(values, group, what)).split(lengths, dim=1)
    differing = []
    for name, column in zip(names, gathered, strict=True):
        ranks = [r for r in range(size) if not torch.equal(column[r], column[0])]
        if ranks:
            differing.append(f"{name} (rank(s) {ranks} differ from rank 0)")
    if differing:
        raise ValueError(
            f"rank {rank} of {size}: {what}: the ranks hold different "
            + ", ".join(differing)
            + f"; {advice}"
        )
