"""Rows of test points shared out over the ranks of a process group, the results gathered."""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from gpsd._internal.collectives import (
    all_gather_cat,
    check_group,
    check_same,
    split_sizes,
    tensor_fingerprint,
)

__all__ = ["check_same_rows", "on_my_rows"]


def check_same_rows(x: Tensor, process_group: object, name: str = "test_x") -> None:
    """The same ``ValueError`` on every rank of ``process_group`` unless all hold the same
    ``x`` (shape, dtype and values), naming ``name``."""
    check_same(
        tensor_fingerprint(name, x),
        process_group,
        "the check of the test points",
        f"every rank must pass the same {name}",
    )


def on_my_rows(
    x: Tensor,
    compute: Callable[[Tensor], Tensor],
    process_group: object,
    name: str = "test_x",
) -> Tensor:
    r"""``compute`` on this rank's contiguous share of the rows of ``x``, gathered from every
    rank in rank order: on every rank, what ``compute(x)`` gives in one process.

    Every rank must pass the same ``x`` (checked first: :func:`check_same_rows`). Of :math:`M`
    rows, rank :math:`r` of :math:`P` takes the :math:`r`-th of :math:`P` contiguous blocks of
    :math:`\lceil M/P \rceil` or :math:`\lfloor M/P \rfloor` rows; a rank left without rows
    computes on one row for the shapes and sends none of its values.

    :param x: rows, shape ``(*b, M, d)``.
    :param compute: maps rows ``(*b, m, d)`` to a tensor ``(..., m)`` with a column per row,
        the same leading shape on every rank.
    :param process_group: the ``torch.distributed.ProcessGroup`` whose ranks share the rows.
    :param name: the argument ``x`` is, for the message of a mismatch.
    :return: shape ``(..., M)``.
    """
    rank, size = check_group(process_group)
    check_same_rows(x, process_group, name)
    sizes = split_sizes(x.shape[-2], size)
    start = sum(sizes[:rank])
    if sizes[rank] > 0:
        mine = compute(x[..., start : start + sizes[rank], :])
    else:  # shapes from one row, none of whose values are sent
        mine = compute(x[..., :1, :])[..., :0]
    return all_gather_cat(mine, -1, sizes, process_group, "all_gather of the predictions")
