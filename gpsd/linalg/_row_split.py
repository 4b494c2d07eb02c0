"""Where the rows of the vectors of a Krylov iteration live: on every process, or split by rows
across the ranks of a process group, with the sums over the rows each layout needs."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from gpsd._internal.collectives import all_gather, all_gather_cat, all_reduce_sum
from gpsd.linalg.distributed_kernel_operator import DistributedKernelOperator


class AllRows:
    """Every row of every vector on this process: sums over rows are local.

    :param matmul: ``X -> K X`` for ``X`` of shape ``(*b, N, c)``.
    """

    #: ``None``: no rank holds a part of the rows only.
    local_rows: slice | None = None

    def __init__(self, matmul: Callable[[Tensor], Tensor]) -> None:
        self.matmul = matmul

    def take(self, full: Tensor) -> Tensor:
        """This process's rows of ``full`` (``(*, N, c)``): all of them."""
        return full

    def gather(self, mine: Tensor) -> Tensor:
        """All ``N`` rows from this process's rows ``mine``: ``mine`` itself."""
        return mine

    def total(self, partial: Tensor) -> Tensor:
        """The sum over the ranks of ``partial`` sums over rows: ``partial`` itself."""
        return partial

    def gram(self, left: Tensor, right: Tensor) -> Tensor:
        r""":math:`\mathbf A^\top \mathbf B` for ``left`` ``(*, N, a)`` and ``right`` ``(*, N, b)``."""
        return left.mT @ right

    def norm(self, x: Tensor) -> Tensor:
        """The Euclidean norms of the columns of ``x`` (``(*, N, c)``): ``(*, c)``."""
        return torch.linalg.vector_norm(x, dim=-2)

    def qr(self, z: Tensor) -> tuple[Tensor, Tensor]:
        """The reduced QR factors of ``z`` (``(*b, N, c)``, ``N >= c``)."""
        return torch.linalg.qr(z)

    def project_out(self, blocks: list[Tensor], z: Tensor) -> Tensor:
        """``z`` (``(*b, N, c)``) less its part in the span of the orthonormal ``blocks``: block
        by block (each block's coefficients from what the earlier ones left), twice."""
        for _ in range(2):
            for q in blocks:
                z = z - q @ self.gram(q, z)
        return z


class SplitRows(AllRows):
    r"""The rows of every vector split across the ranks of a process group as the rows of a
    :class:`~gpsd.linalg.DistributedKernelOperator`: this rank holds rows
    :math:`I_p` (``local_rows``) of every ``N``-row vector, and each sum over rows is this rank's
    partial sum, added over the ranks in rank order (:func:`~gpsd._internal.collectives.all_reduce_sum`),
    so that every rank holds the same bits.

    A product :math:`(\mathbf K\mathbf X)_{I_p} = k(\mathbf X_{I_p}, \mathbf X)\,\mathbf X`
    needs all of :math:`\mathbf X`: the ranks' rows of it are gathered (an ``all_gather`` of the
    block, :math:`N c` entries received per rank), and this rank multiplies its kernel rows.

    Every method is collective: every rank calls it, in the same order.

    :param operator: the kernel, split by rows across its group of at least two ranks.
    :param dtype: the dtype of the iteration's vectors (products are cast to it).
    """

    def __init__(self, operator: DistributedKernelOperator, dtype: torch.dtype) -> None:
        self.operator = operator
        self.group = operator.process_group
        self.rank = operator.rank
        self.sizes = operator.row_sizes
        self.local_rows = operator.rows
        self.size = operator.shape[-1]
        self.dtype = dtype

        def matmul(mine: Tensor) -> Tensor:
            full = self.gather(mine).to(operator.dtype)
            return operator.row_block_matmul(full).to(dtype)

        super().__init__(matmul)

    def take(self, full: Tensor) -> Tensor:
        """This rank's rows of ``full`` (``(*, N, c)``): ``(*, n_p, c)``."""
        return full[..., self.local_rows, :]

    def gather(self, mine: Tensor) -> Tensor:
        """All ``N`` rows, in order, from every rank's rows ``mine`` (``(*, n_p, c)``)."""
        return all_gather_cat(mine, -2, self.sizes, self.group, "all_gather of a block's rows")

    def total(self, partial: Tensor) -> Tensor:
        """The sum over the ranks, in rank order, of this rank's partial sums ``partial``."""
        return all_reduce_sum(partial, self.group, "all_gather of partial sums over rows")

    def gram(self, left: Tensor, right: Tensor) -> Tensor:
        """:math:`\\sum_p \\mathbf A_{I_p}^\\top \\mathbf B_{I_p}` for this rank's rows."""
        return self.total(left.mT @ right)

    def norm(self, x: Tensor) -> Tensor:
        """The norms of the columns of the whole ``x`` from this rank's rows ``(*, n_p, c)``."""
        return self.total(x.square().sum(-2)).sqrt()

    def project_out(self, blocks: list[Tensor], z: Tensor) -> Tensor:
        """``z`` (this rank's rows) less its part in the span of the orthonormal ``blocks``:
        the coefficients of every block at once, in one sum over the ranks (classical
        Gram-Schmidt over the whole basis), twice; one collective per pass, where block by
        block would take one per block."""
        if not blocks:
            return z
        widths = [q.shape[-1] for q in blocks]
        for _ in range(2):
            partial = torch.cat([q.mT @ z for q in blocks], dim=-2)  # shape: (*b, q, c)
            for q, coefficients in zip(blocks, self.total(partial).split(widths, -2), strict=True):
                z = z - q @ coefficients
        return z

    def qr(self, z: Tensor) -> tuple[Tensor, Tensor]:
        r"""This rank's rows of the orthonormal factor of the whole ``z`` and its triangular
        factor (the same on every rank), by a one-level TSQR.

        Each rank factors its rows, :math:`\mathbf Z_{I_p} = \mathbf Q_p \mathbf R_p` (zero rows
        appended where it holds fewer than ``c``); the stacked :math:`\mathbf R_p` (``P c x c``,
        gathered on every rank) are factored alike on every rank,
        :math:`[\mathbf R_1; \dots; \mathbf R_P] = \mathbf S \mathbf R`, and
        :math:`\mathbf Q_{I_p} = \mathbf Q_p \mathbf S_p` with :math:`\mathbf S_p` the rows of
        :math:`\mathbf S` of rank :math:`p`. The ranks exchange :math:`P c^2` entries.
        """
        rows, c = z.shape[-2], z.shape[-1]
        if rows < c:
            z = torch.cat([z, z.new_zeros(*z.shape[:-2], c - rows, c)], dim=-2)
        q_mine, r_mine = torch.linalg.qr(z)  # shape: (*b, max(n_p, c), c), (*b, c, c)
        stacked = torch.cat(all_gather(r_mine, self.group, "all_gather of the QR factors"), -2)
        s, r = torch.linalg.qr(stacked)  # shape: (*b, P c, c), (*b, c, c)
        q = q_mine @ s[..., self.rank * c : (self.rank + 1) * c, :]
        return q[..., :rows, :], r


def row_layout(kernel: object, matmul: Callable[[Tensor], Tensor], dtype: torch.dtype) -> AllRows:
    """:class:`SplitRows` for a :class:`~gpsd.linalg.DistributedKernelOperator` of at least two
    ranks, else :class:`AllRows` with ``matmul``."""
    if isinstance(kernel, DistributedKernelOperator) and kernel.world_size > 1:
        return SplitRows(kernel, dtype)
    return AllRows(matmul)
