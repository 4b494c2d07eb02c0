"""A kernel matrix whose rows are evaluated across the ranks of a ``torch.distributed`` group."""

from __future__ import annotations

import torch
from gpytorch.kernels import Kernel
from linear_operator.operators import LinearOperator
from torch import Tensor

from gpsd._internal.collectives import (
    all_gather,
    all_reduce_sum,
    check_group,
    check_same,
    module_fingerprint,
    split_sizes,
    tensor_fingerprint,
)
from gpsd._internal.keops import is_keops_kernel
from gpsd._internal.validation import check_int
from gpsd.exceptions import BackendError
from gpsd.linalg.chunked_kernel_operator import (
    ChunkedKernelOperator,
    check_finite_rhs,
    kernel_diagonal,
    kernel_entries,
)

__all__ = ["DistributedKernelOperator"]

#: Extra rows each rank sends with its block of a product: the weighted sums of the
#: right-hand side and of its absolute values, by which every rank checks that all of them
#: multiplied the same right-hand side.
_CHECK_ROWS = 2


class DistributedKernelOperator(LinearOperator):
    r"""The symmetric kernel matrix :math:`\mathbf K = k(\mathbf X, \mathbf X)` as a matrix-free
    operator whose rows are split across the ranks of a ``torch.distributed`` process group.

    The :math:`N` training rows are split into contiguous blocks, one per rank (sizes as even as
    can be: rank :math:`p` of :math:`P` holds :math:`\lceil N/P \rceil` or
    :math:`\lfloor N/P \rfloor` rows, the first :math:`N \bmod P` ranks one more). A product is

    .. math::
        \mathbf K\mathbf B = \begin{pmatrix} k(\mathbf X_{I_1}, \mathbf X)\,\mathbf B \\
        \vdots \\ k(\mathbf X_{I_P}, \mathbf X)\,\mathbf B \end{pmatrix} ,

    each rank evaluating its block :math:`k(\mathbf X_{I_p}, \mathbf X)\mathbf B` by row chunks
    (a :class:`~gpsd.linalg.ChunkedKernelOperator` of those rows, keeping the rows that fit in
    ``cache_bytes``), or, for a GPyTorch KeOps kernel (``gpytorch.kernels.keops``), by one KeOps
    reduction over those rows that holds no kernel entry, and an ``all_gather`` giving every
    rank the whole product. As a ``LinearOperator`` it serves iterations that run identically
    on every rank (replicated): every rank calls
    each product with the same :math:`\mathbf B` (``(*b, N, r)``), in the same order, and gets
    the same :math:`\mathbf K\mathbf B`, so that deflated CG
    (:class:`~gpsd.linalg.ShiftedCG`) runs on it unchanged and every rank ends with the answer
    of one process (up to the rounding of the row products, which do not depend on the split).
    Block Lanczos (:meth:`~gpsd.linalg.KernelSpectrum.from_lanczos`) splits its vectors by
    the same rows instead: each rank keeps its rows of the Krylov basis, gathers a block's rows
    from the ranks and multiplies its kernel rows by it (:meth:`row_block_matmul`), and adds
    its inner products over the ranks.

    **Memory per rank**: the inputs :math:`\mathbf X` whole (:math:`N \times d`), the kept rows
    of its own block (at most ``cache_bytes``, of the :math:`N^2/P` entries of the block) or one
    chunk of ``chunk_size`` rows (none for a KeOps kernel), and what the caller's iteration
    holds: block Lanczos its rows of the basis and of its products, :math:`2 N q / P` entries
    for :math:`q` columns (about :math:`8 N q / P` at a Rayleigh–Ritz step), and the gathered
    block (:math:`N r`, twice); deflated CG its vectors whole.

    **Communication per product** with :math:`r` columns: each rank sends its block,
    :math:`(\lceil N/P \rceil + 2) r` entries (padded to the largest block; two more rows carry
    the check below), and receives those of every rank, :math:`P (\lceil N/P \rceil + 2) r
    \approx N r` entries (an ``all_gather``; an ``all_reduce`` of zero-padded
    :math:`N \times r` blocks would move about twice as much).

    **Checks.** Construction is collective: every rank compares the shape, dtype and an exact
    checksum of the bits of its ``x`` and of the kernel's hyperparameters (and its module
    types) with every other rank's, and where any differ, every rank raises the same
    ``ValueError`` naming what differs. Each product checks that all ranks multiplied the same
    right-hand side (weighted sums equal to :math:`\sqrt{\epsilon}` of the right-hand side's
    dtype): where they did not, the replicated iterations have diverged, and every rank raises
    a ``ValueError``. A collective that fails or waits longer than the process group's
    ``timeout`` (``init_process_group(timeout=...)``, ``new_group(timeout=...)``) raises a
    :class:`~gpsd.DistributedError` on the ranks that wait in it: a rank that fails or leaves
    mid-run ends the run with an error on every rank, not a hang.

    **Gradients.** As for :class:`~gpsd.linalg.ChunkedKernelOperator`, the representation
    carries the kernel's parameters, so GPyTorch's marginal likelihood differentiates through
    the operator. The derivative of a bilinear form
    :math:`\sum_i \mathbf u_i^\top \mathbf K \mathbf v_i` (the same vectors on every rank)
    is a sum over the rows: each rank differentiates the forms of its rows,
    :math:`\sum_i \mathbf u_{i,I_p}^\top k(\mathbf X_{I_p}, \mathbf X)\,\mathbf v_i`,
    chunk by chunk, and the ranks' gradients are added in rank order on every rank (one
    gather of the gradients' entries), so every rank holds the same gradient, that of one
    process up to the order of the sums. Single entries and the diagonal (a pivoted-Cholesky
    preconditioner's) are evaluated by every rank, without a collective. A KeOps kernel's rows
    are not differentiated (a :class:`~gpsd.BackendError`).

    Collectives run where the group's backend takes them: on the tensors' device with NCCL
    (CUDA), on the CPU with gloo. A group of one rank is the plain
    :class:`~gpsd.linalg.ChunkedKernelOperator`.

    :param x: inputs, shape ``(*b, N, d)``, finite, the same on every rank.
    :param covar_module: any GPyTorch kernel :math:`k`, the same on every rank.
    :param process_group: the ranks that share the rows: a ``torch.distributed.ProcessGroup``
        (``torch.distributed.group.WORLD`` for the default group of
        ``torch.distributed.init_process_group``), of which this process is a member.
    :param chunk_size: rows evaluated at once.
    :param cache_bytes: memory the kept rows of this rank's block may fill, in bytes
        (default 0: keep none).
    :param keep_after: products evaluated afresh before rows are kept (default 0).

    Example (on every rank of ``torchrun --nproc_per_node=2``)::

        torch.distributed.init_process_group("gloo")
        operator = DistributedKernelOperator(
            x, covar_module=kernel, process_group=torch.distributed.group.WORLD
        )
        # the same eigenvalues on every rank, each rank its rows of the eigenvectors
        spectrum = KernelSpectrum.from_lanczos(operator, rank=64)
    """

    def __init__(
        self,
        x: Tensor,
        *,
        covar_module: Kernel,
        process_group: object,
        chunk_size: int = 2048,
        cache_bytes: int = 0,
        keep_after: int = 0,
        _local: ChunkedKernelOperator | _KeOpsRows | None = None,
    ) -> None:
        if _local is None:  # not a copy that linear_operator rebuilds for a product
            rank, size = check_group(process_group)
            chunk_size = check_int(chunk_size, "chunk_size")
            cache_bytes = check_int(cache_bytes, "cache_bytes", minimum=0)
            keep_after = check_int(keep_after, "keep_after", minimum=0)
            if not isinstance(x, Tensor) or not x.is_floating_point() or x.dim() < 2:
                raise ValueError(
                    "x must be a floating-point tensor of inputs (*b, N, d), got "
                    + (
                        f"shape {tuple(x.shape)}, dtype {x.dtype}"
                        if isinstance(x, Tensor)
                        else type(x).__name__
                    )
                )
            if not isinstance(covar_module, Kernel):
                raise TypeError(
                    f"covar_module must be a gpytorch.kernels.Kernel, got "
                    f"{type(covar_module).__name__}"
                )
            check_same(
                {**tensor_fingerprint("x", x), **module_fingerprint(covar_module)},
                process_group,
                "DistributedKernelOperator's check of its inputs",
                "every rank must build it from the same training inputs x and the same kernel "
                "(hyperparameters and dtype)",
            )
            sizes = split_sizes(x.shape[-2], size)
            start = sum(sizes[:rank])
            rows = slice(start, start + sizes[rank])
            if is_keops_kernel(covar_module):
                _local = _KeOpsRows(x, covar_module, rows)
            else:
                _local = ChunkedKernelOperator(
                    x,
                    covar_module=covar_module,
                    chunk_size=chunk_size,
                    cache_bytes=cache_bytes,
                    keep_after=keep_after,
                    rows=rows,
                )
        super().__init__(
            x,
            covar_module=covar_module,
            process_group=process_group,
            chunk_size=chunk_size,
            cache_bytes=cache_bytes,
            keep_after=keep_after,
            _local=_local,
        )
        self.x = x
        self.covar_module = covar_module
        self.process_group = process_group
        self.chunk_size = chunk_size
        self.cache_bytes = cache_bytes
        self.keep_after = keep_after
        #: This rank's block of rows: a :class:`~gpsd.linalg.ChunkedKernelOperator`, or for a
        #: KeOps kernel the rows as KeOps reductions.
        self.local = _local
        #: This rank's position in the group and the group's size.
        self.rank = torch.distributed.get_rank(process_group)
        self.world_size = torch.distributed.get_world_size(process_group)
        #: The number of rows of every rank, in rank order.
        self.row_sizes = split_sizes(x.shape[-2], self.world_size)

    @property
    def rows(self) -> slice:
        """The rows of :math:`\\mathbf K` this rank evaluates, ``slice(start, stop)``."""
        return self.local.rows

    @property
    def kept_bytes(self) -> int:
        """Memory the kept kernel rows of this rank fill now, in bytes."""
        return self.local.kept_bytes

    def row_block_matmul(self, rhs: Tensor) -> Tensor:
        r"""This rank's rows of the product, :math:`k(\mathbf X_{I_p}, \mathbf X)\,\mathbf B`
        for the whole :math:`\mathbf B` (``(*b, N, r)``): ``(*b, n_p, r)``. Not collective: an
        iteration whose vectors are split by rows gathers :math:`\mathbf B` first and keeps the
        rows returned (as :meth:`~gpsd.linalg.KernelSpectrum.from_lanczos` does)."""
        n = self.x.shape[-2]
        if rhs.shape[-2] != n:
            raise ValueError(f"rhs must have {n} rows, got shape {tuple(rhs.shape)}")
        with torch.no_grad():
            return self.local._matmul(rhs)  # shape: (*b, n_p, r)

    def _matmul(self, rhs: Tensor) -> Tensor:
        n = self.x.shape[-2]
        if rhs.shape[-2] != n:
            raise ValueError(f"rhs must have {n} rows, got shape {tuple(rhs.shape)}")
        with torch.no_grad():
            block = self.local._matmul(rhs)  # shape: (*b, n_p, r)
            batch = block.shape[:-2]
            largest = max(self.row_sizes)
            sent = block.new_zeros(*batch, largest + _CHECK_ROWS, rhs.shape[-1])
            sent[..., : block.shape[-2], :] = block
            sent[..., largest:, :] = _rhs_sums(rhs).to(sent).expand(*batch, -1, -1)
            parts = all_gather(sent, self.process_group, "all_gather of a kernel product")
            _check_same_rhs([p[..., largest:, :] for p in parts], rhs.dtype, self.rank)
            blocks = [p[..., :s, :] for p, s in zip(parts, self.row_sizes, strict=True)]
            return torch.cat(blocks, dim=-2)  # shape: (*b, N, r)

    def _size(self) -> torch.Size:
        n = self.x.shape[-2]
        batch = torch.broadcast_shapes(self.x.shape[:-2], self.covar_module.batch_shape)
        return torch.Size((*batch, n, n))

    def _transpose_nonbatch(self) -> DistributedKernelOperator:
        return self

    def _diagonal(self) -> Tensor:
        # every rank evaluates the whole diagonal: N kernel entries, no collective
        return self.local._kernel_diagonal(self.x, self.shape[:-1])  # shape: (*b, N)

    def _get_indices(self, row_index: Tensor, col_index: Tensor, *batch_indices: Tensor) -> Tensor:
        # every rank evaluates the entries itself: no collective
        local = self.local
        batched_kernel = len(self.covar_module.batch_shape) > 0
        if (
            isinstance(local, _KeOpsRows)
            or batched_kernel
            or len(batch_indices) != self.x.dim() - 2
        ):
            return super()._get_indices(row_index, col_index, *batch_indices)
        with local._evaluating():
            return kernel_entries(self.covar_module, self.x, row_index, col_index, batch_indices)

    def _bilinear_derivative(
        self, left_vecs: Tensor, right_vecs: Tensor
    ) -> tuple[Tensor | None, ...]:
        """This rank's rows' derivative (:meth:`ChunkedKernelOperator._bilinear_derivative
        <gpsd.linalg.ChunkedKernelOperator._bilinear_derivative>`), summed over the ranks in
        rank order; one entry per tensor of the representation (the inputs, then this rank's
        block's inputs and the kernel's parameters; the sum goes to the block's)."""
        representation = self.representation()
        if isinstance(self.local, _KeOpsRows):
            if any(t.requires_grad for t in representation):
                raise BackendError(
                    "a DistributedKernelOperator of a KeOps kernel has no gradient; use the "
                    "kernel's non-KeOps counterpart (gpytorch.kernels.RBFKernel for "
                    "gpytorch.kernels.keops.RBFKernel) to differentiate through the group"
                )
            return (None,) * len(representation)
        rows = self.local.rows
        local = self.local._bilinear_derivative(left_vecs[..., rows, :], right_vecs)
        needed = [t.requires_grad and t.is_floating_point() for t in self.local.representation()]
        # every rank sends an entry for every tensor that needs one, a rank without rows zeros
        parts = [
            (g if g is not None else torch.zeros_like(t)) if need else None
            for g, t, need in zip(local, self.local.representation(), needed, strict=True)
        ]
        present = [p for p in parts if p is not None]
        if not present:
            return (None,) * len(representation)
        flat = torch.cat([p.reshape(-1).to(torch.float64) for p in present])
        total = all_reduce_sum(flat, self.process_group, "all-reduce of a kernel gradient")
        sums = iter(total.split([p.numel() for p in present]))
        reduced = tuple(
            None if p is None else next(sums).reshape(p.shape).to(p.dtype) for p in parts
        )
        return (None, *reduced)  # the top-level x: its gradient counts in the block's

    def _expand_batch(self, batch_shape: torch.Size) -> DistributedKernelOperator:
        x = self.x.expand(*batch_shape, *self.x.shape[-2:])
        return DistributedKernelOperator(
            x,
            covar_module=self.covar_module,
            process_group=self.process_group,
            chunk_size=self.chunk_size,
            cache_bytes=self.cache_bytes,
            keep_after=self.keep_after,
        )


class _KeOpsRows:
    r"""Rows ``rows`` of a GPyTorch KeOps kernel's matrix, :math:`k(\mathbf X_I, \mathbf X)`:
    each product is one KeOps reduction over them, and no kernel entry is held."""

    #: Kept kernel rows, in bytes: a KeOps reduction keeps none.
    kept_bytes = 0

    def __init__(self, x: Tensor, covar_module: Kernel, rows: slice) -> None:
        self.x, self.covar_module, self.rows = x, covar_module, rows

    def _matmul(self, rhs: Tensor) -> Tensor:
        check_finite_rhs(rhs)
        with torch.no_grad():
            return self.covar_module(self.x[..., self.rows, :], self.x) @ rhs  # (*b, n_p, r)

    def _kernel_diagonal(self, rows: Tensor, shape: torch.Size) -> Tensor:
        return kernel_diagonal(self.covar_module, rows, shape)


def _rhs_sums(rhs: Tensor) -> Tensor:
    r"""Weighted column sums of ``rhs`` (``(*b, N, r)``) and of its absolute values, in float64,
    ``(2, r)`` summed over the batch: :math:`\sum_i w_i b_i` and :math:`\sum_i w_i |b_i|` with
    weights :math:`w_i \in [1, 2)` that depend on the position (a permuted right-hand side has
    other sums)."""
    n = rhs.shape[-2]
    index = torch.arange(n, device=rhs.device, dtype=torch.float64)
    weights = 1.0 + torch.remainder(index * 0.6180339887498949, 1.0)  # shape: (N,)
    values = rhs.detach().to(torch.float64)
    plain = (weights.unsqueeze(-1) * values).sum(-2)
    absolute = (weights.unsqueeze(-1) * values.abs()).sum(-2)
    both = torch.stack([plain, absolute], dim=-2)  # shape: (*b, 2, r)
    return both.reshape(-1, 2, both.shape[-1]).sum(0)


def _check_same_rhs(sums: list[Tensor], dtype: torch.dtype, rank: int) -> None:
    """A ``ValueError`` (on every rank alike: all decide on the same gathered sums) where the
    ranks' right-hand sides differ by more than rounding."""
    stacked = torch.stack([s.reshape(-1, *s.shape[-2:]).sum(0) for s in sums])  # (P, 2, r)
    plain, scale = stacked[:, 0, :], stacked[:, 1, :].amax(0)
    tol = torch.finfo(dtype).eps ** 0.5 * scale
    differing = [p for p in range(len(sums)) if bool(((plain[p] - plain[0]).abs() > tol).any())]
    if differing:
        raise ValueError(
            f"rank {rank} of {len(sums)}: rank(s) {differing} multiplied the distributed kernel "
            "operator by another right-hand side than rank 0: the replicated iterations have "
            "diverged (every rank must call the same methods with the same arguments, in the "
            "same order)"
        )
