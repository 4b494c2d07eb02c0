"""A kernel matrix that is never formed: products evaluated in row chunks."""

from __future__ import annotations

import contextlib

import torch
from gpytorch.kernels import Kernel, ScaleKernel
from linear_operator import to_dense
from linear_operator.operators import LinearOperator
from torch import Tensor

from gpsd import settings
from gpsd._internal.module_state import ModuleState, write_count
from gpsd._internal.negligible import DROP_MIN_COLUMNS, drop_negligible
from gpsd._internal.stationary_kernel import (
    stationary_kernel_block,
    stationary_kernel_parameters,
)
from gpsd._internal.swapped_parameters import swapped_parameters
from gpsd._internal.validation import check_finite, check_int

__all__ = ["ChunkedKernelOperator"]


class ChunkedKernelOperator(LinearOperator):
    r"""The symmetric kernel matrix :math:`\mathbf K = k(\mathbf X, \mathbf X)` as a matrix-free operator.

    A product :math:`\mathbf K \mathbf B` is computed chunk by chunk over the rows,

    .. math::
        (\mathbf K\mathbf B)_{I} = k(\mathbf X_I, \mathbf X)\,\mathbf B ,

    so memory stays at ``chunk_size x N`` kernel entries: the path for large N when pykeops is not
    installed (with pykeops, a GPyTorch KeOps kernel is the faster matrix-free operator). The
    block Lanczos and CG backends multiply by it; GPyTorch's marginal likelihood differentiates
    through it (below).

    **Gradients.** The operator's representation (what ``linear_operator`` passes through its
    autograd functions) is the inputs :math:`\mathbf X` and the kernel's parameters
    :math:`\boldsymbol\theta` (``covar_module.parameters()``, in that order), so
    ``inv_quad_logdet`` (GPyTorch's ``ExactMarginalLogLikelihood``), ``matmul`` and
    ``to_dense`` give gradients to the hyperparameters, and to :math:`\mathbf X` where it
    requires them. The derivative of a bilinear form with :math:`D` pairs of vectors is taken
    chunk by chunk,

    .. math::
        \frac{\partial}{\partial\boldsymbol\theta} \sum_{i=1}^D \mathbf u_i^\top
        \mathbf K(\boldsymbol\theta)\mathbf v_i
        = \sum_{I} \frac{\partial}{\partial\boldsymbol\theta}
        \sum_{i=1}^D \mathbf u_{i,I}^\top k(\mathbf X_I, \mathbf X; \boldsymbol\theta)\,
        \mathbf v_i ,

    each row chunk evaluated afresh by ``covar_module`` with its autograd graph, differentiated
    and freed before the next: no kernel entry is kept beyond one chunk of
    :math:`c \times N` (:math:`c` = ``chunk_size``, fewer rows where
    :math:`c N` would exceed :class:`gpsd.settings.max_chunk_elements`). For the RBF kernel
    (alone or in a ``ScaleKernel``, unbatched, inputs without a gradient) the derivative is
    taken in closed form from the kernel's entries, the fast or the kept rows, with no graph
    of any block. Single entries (the rows a pivoted-Cholesky preconditioner takes) and the
    diagonal are evaluated by ``covar_module`` with their graph. Products themselves run
    without a graph, by the fast rows below.

    **Stationary kernels.** For an ``RBFKernel`` (and a ``MaternKernel`` of :math:`\nu` 1/2,
    3/2 or 5/2 in float32), alone or in a ``ScaleKernel``, unbatched, on all input dimensions,
    a chunk of rows is one matrix product of augmented inputs accumulated in float64,

    .. math::
        \log s - \tfrac12 r_{ij}^2 = [\mathbf z_i,\ \log s - \tfrac12\lVert\mathbf z_i\rVert^2,\ 1]
            \cdot [\mathbf z_j,\ 1,\ -\tfrac12\lVert\mathbf z_j\rVert^2],
        \qquad \mathbf z = (\mathbf x - \bar{\mathbf x}) / \boldsymbol\ell ,

    then capped at :math:`\log s` and exponentiated in place: three operations over the block
    where GPyTorch's evaluation takes five (:mod:`gpsd._internal.stationary_kernel`). Every
    other kernel is evaluated by ``covar_module``.

    **Keeping rows.** An iterative solver multiplies by :math:`\mathbf K` tens to hundreds of
    times, and evaluating a kernel entry costs several passes over memory where a kept entry
    costs one read. With ``cache_bytes > 0`` the operator keeps the row chunks it evaluates, in
    order, while they fit in ``cache_bytes`` (a chunk that would not fit, and every one after it,
    is evaluated afresh at each product): with ``cache_bytes`` at least the size of
    :math:`\mathbf K` only the first product evaluates the kernel. On the CPU, kept rows (and
    rows for a product with many columns) have their entries below :math:`\epsilon^2` times the
    block's largest set to zero, since x86 processors multiply subnormal numbers slowly; that
    changes no product beyond rounding. The kept rows belong to the inputs and kernel state of
    the product that evaluated them: a change to either (an optimiser step, new hyperparameter
    values, inputs written in place) drops them. A backward pass through the operator (the
    derivative of a marginal likelihood's bilinear forms, its last use of the rows) frees them:
    in a training loop the graph of one iteration's loss lives on until the next loss replaces
    it, and its rows would otherwise sit beside the next iteration's.

    Keeping rows pays where there are many products; a run of a few (block Lanczos on a smooth
    kernel stops after three) is better off without the memory. ``keep_after`` products are
    therefore evaluated without keeping anything, and rows are kept from the next one on.

    **A block of rows.** With ``rows=slice(start, stop)`` the operator is the
    ``(stop - start) x N`` block :math:`k(\mathbf X_{\text{start:stop}}, \mathbf X)` of rows of
    :math:`\mathbf K`, chunked and kept as above (the local part of a
    :class:`~gpsd.linalg.DistributedKernelOperator`); it has no transpose nor diagonal.

    Inputs ``x`` and right-hand sides holding NaN or infinite values are refused with a
    ``ValueError`` naming them (every entry of the product would be NaN).

    :param covar_module: any GPyTorch kernel :math:`k`.
    :param x: inputs, shape ``(*b, N, d)``, finite.
    :param hyperparameters: tensors standing for ``covar_module.parameters()``, one each, in
        that order (default: the parameters themselves); ``linear_operator`` passes them when it
        rebuilds the operator inside its autograd functions.
    :param chunk_size: rows evaluated at once.
    :param cache_bytes: memory the kept rows may fill, in bytes (default 0: keep none).
    :param keep_after: products evaluated afresh before rows are kept (default 0).
    :param rows: the rows of :math:`\mathbf K` the operator holds, a ``slice`` with
        ``0 <= start <= stop <= N`` and step 1 (default: all of them).
    """

    def __init__(
        self,
        x: Tensor,
        *hyperparameters: Tensor,
        covar_module: Kernel,
        chunk_size: int = 2048,
        cache_bytes: int = 0,
        keep_after: int = 0,
        rows: slice | None = None,
        _rows: _KeptRows | None = None,
    ) -> None:
        chunk_size = check_int(chunk_size, "chunk_size")
        cache_bytes = check_int(cache_bytes, "cache_bytes", minimum=0)
        keep_after = check_int(keep_after, "keep_after", minimum=0)
        if _rows is None:  # not a copy that linear_operator rebuilds for a product
            if not isinstance(x, Tensor) or not x.is_floating_point() or x.dim() < 2:
                raise ValueError(
                    "x must be a floating-point tensor of inputs (*b, N, d), got "
                    + (
                        f"shape {tuple(x.shape)}, dtype {x.dtype}"
                        if isinstance(x, Tensor)
                        else type(x).__name__
                    )
                )
            check_finite(x.detach(), "x")
            rows = _check_rows(rows, x.shape[-2])
        hyperparameters = _check_hyperparameters(hyperparameters, covar_module)
        # The rows live in an object passed along as a keyword: linear_operator rebuilds the
        # operator from its arguments for every product, and the rows must outlive that.
        kept = _rows if _rows is not None else _KeptRows()
        super().__init__(
            x,
            *hyperparameters,
            covar_module=covar_module,
            chunk_size=chunk_size,
            cache_bytes=cache_bytes,
            keep_after=keep_after,
            rows=rows,
            _rows=kept,
        )
        self.x = x
        #: The tensors the kernel is evaluated with, one per ``covar_module.parameters()``.
        self.hyperparameters = hyperparameters
        self.covar_module = covar_module
        self.chunk_size = chunk_size
        self.cache_bytes = cache_bytes
        self.keep_after = keep_after
        #: The rows of K held, ``slice(start, stop)``; ``None`` for all of them.
        self.rows = rows
        self._rows = kept

    @property
    def kept_bytes(self) -> int:
        """Memory the kept kernel rows fill now, in bytes."""
        return self._rows.nbytes if self._rows.belongs_to(self.x, self.covar_module) else 0

    def _row_range(self) -> tuple[int, int]:
        """The first and one past the last row of K the operator holds."""
        if self.rows is None:
            return 0, self.x.shape[-2]
        return self.rows.start, self.rows.stop

    def _matmul(self, rhs: Tensor) -> Tensor:
        first, stop = self._row_range()
        n = stop - first
        check_finite_rhs(rhs)
        out = None  # written into chunk by chunk, not concatenated: one N x r block, not two
        with torch.no_grad(), self._evaluating():
            # without a budget there is nothing to count or compare (a sync per product on GPUs)
            keep = (
                self.cache_bytes > 0
                and self._rows.claim(self.x, self.covar_module) > self.keep_after
            )
            for start in range(first, stop, self.chunk_size):
                block = self._rows.blocks.get(start) if keep else None
                if block is None:
                    block = self._row_block(start, min(start + self.chunk_size, stop))
                    if keep or rhs.shape[-1] >= DROP_MIN_COLUMNS:
                        block = drop_negligible(block, inplace=True)
                    keep = keep and self._rows.add(start, block, self.cache_bytes)
                product = block @ rhs  # shape: (*b, chunk, r), *b with the kernel's batch
                if out is None:
                    out = product.new_empty(*product.shape[:-2], n, product.shape[-1])
                out[..., start - first : start - first + product.shape[-2], :] = product
        if out is None:  # no rows
            return rhs.new_empty(*self.batch_shape, 0, rhs.shape[-1])
        return out

    def _evaluating(self):
        """A context in which ``covar_module`` evaluates with :attr:`hyperparameters`."""
        return swapped_parameters(self.covar_module, self.hyperparameters)

    def _row_block(self, start: int, stop: int, x: Tensor | None = None) -> Tensor:
        r"""Rows ``start : stop`` of :math:`\mathbf K`, shape ``(*b, c, N)``: by
        :func:`~gpsd._internal.stationary_kernel.stationary_kernel_block` for the common
        stationary kernels, else by ``covar_module``; evaluated inside :meth:`_evaluating`.

        Given ``x`` (the inputs, requiring a gradient or not), the rows are evaluated by
        ``covar_module`` alone, with their autograd graph (the fast rows keep none).

        GPyTorch zeroes the distances of a point to itself only where ``x1`` equals ``x2``,
        which a row chunk does not: the entries :math:`k(\mathbf x_i, \mathbf x_i)` of the
        chunk then come from a distance of rounding size, about :math:`\sqrt{\epsilon}`, and
        a kernel that is not smooth at 0 turns it into an error of that size (a Matérn-1/2
        diagonal of :math:`1 - 4 \times 10^{-8}` in float64 and :math:`1 - 1.4 \times 10^{-3}`
        in float32 instead of 1). They are replaced by ``covar_module(x_I, diag=True)``, as the dense
        ``covar_module(x)`` has them.
        """
        graph = x is not None
        x = self.x if x is None else x
        rows = x[..., start:stop, :]  # shape: (*bx, c, d)
        block = None
        if not graph:
            block = stationary_kernel_block(self.covar_module, rows, x, drop=False)
        if block is None:  # another kernel, batched inputs, Matérn in float64, a graph
            block = to_dense(self.covar_module(rows, x))  # shape: (*b, c, N)
        diag = self._kernel_diagonal(rows, block.shape[:-1]).to(block)  # shape: (*b, c)
        if not graph and block.is_contiguous():  # a fresh tensor: written in place
            block.diagonal(offset=start, dim1=-2, dim2=-1).copy_(diag)
            return block
        return torch.diagonal_scatter(block, diag.expand(*block.shape[:-1]), start, -2, -1)

    def _kernel_diagonal(self, rows: Tensor, shape: torch.Size) -> Tensor:
        """``k(x_i, x_i)`` for ``rows`` (``(*bx, c, d)``), of the expected ``shape`` ``(*b, c)``
        (:func:`kernel_diagonal`), with :attr:`hyperparameters` and their graph."""
        with self._evaluating():
            return kernel_diagonal(self.covar_module, rows, shape)

    def _grad_chunk_rows(self) -> int:
        """Rows per chunk of a derivative: ``chunk_size``, fewer where a chunk would exceed
        :class:`gpsd.settings.max_chunk_elements` entries (its graph holds a few such blocks)."""
        per_row = max(1, self.shape[:-2].numel() * self.x.shape[-2])
        return max(1, min(self.chunk_size, settings.max_chunk_elements.value() // per_row))

    def _bilinear_derivative(
        self, left_vecs: Tensor, right_vecs: Tensor
    ) -> tuple[Tensor | None, ...]:
        r"""The derivative of :math:`\sum_i \mathbf u_i^\top \mathbf K \mathbf v_i`
        (``left_vecs`` ``(*b, n, D)`` holding the :math:`\mathbf u_i`, ``right_vecs``
        ``(*b, N, D)`` the :math:`\mathbf v_i`) with respect to each tensor of the
        representation, chunk of rows by chunk of rows (``None`` for those that require no
        gradient). The kept rows are freed after it."""
        args = [
            a.detach().requires_grad_(a.requires_grad and a.is_floating_point())
            for a in self.representation()
        ]
        wanted = [a for a in args if a.requires_grad]
        if not wanted:
            return (None,) * len(args)
        try:
            return self._derivative(left_vecs, right_vecs, args, wanted)
        finally:
            self._rows.release()

    def _derivative(
        self, left_vecs: Tensor, right_vecs: Tensor, args: list[Tensor], wanted: list[Tensor]
    ) -> tuple[Tensor | None, ...]:
        """:meth:`_bilinear_derivative` with respect to ``args``, the detached representation
        (``wanted``: those of them that require a gradient)."""
        x, *hyperparameters = args
        operator = self.representation_tree()(*args)
        if not x.requires_grad:
            rbf = operator._rbf_derivative(left_vecs, right_vecs, hyperparameters)
            if rbf is not None:
                return (None, *rbf)
        first, stop = self._row_range()
        step = self._grad_chunk_rows()
        totals: list[Tensor | None] = [None] * len(wanted)
        with torch.enable_grad(), operator._evaluating():
            for start in range(first, stop, step):
                end = min(start + step, stop)
                block = operator._row_block(start, end, x)  # shape: (*b, c, N), with its graph
                left = left_vecs[..., start - first : end - first, :].to(block)
                form = (left * (block @ right_vecs.to(block))).sum()
                parts = torch.autograd.grad(form, wanted, allow_unused=True)
                totals = [
                    t if p is None else (p if t is None else t + p)
                    for t, p in zip(totals, parts, strict=True)
                ]
        grads = iter(totals)
        return tuple(next(grads) if a.requires_grad else None for a in args)

    def _rbf_derivative(
        self, left_vecs: Tensor, right_vecs: Tensor, hyperparameters: list[Tensor]
    ) -> tuple[Tensor | None, ...] | None:
        r"""The bilinear derivative of an RBF kernel (alone or in a ``ScaleKernel``, one or ARD
        lengthscales, unbatched) in closed form from the kernel's own entries, or ``None`` for
        another kernel; one entry per tensor of ``hyperparameters`` (which the operator
        evaluates with, requiring gradients or not).

        With :math:`\mathbf A = (\mathbf U_I \mathbf V^\top) \circ \mathbf K_{I,:}` per row
        chunk :math:`I` and :math:`K_{ij} = s \exp(-\tfrac12 \sum_k (x_{ik} - x_{jk})^2 /
        \ell_k^2)`,

        .. math::
            \frac{\partial F}{\partial s} = \frac{1}{s}\sum_{ij} A_{ij}, \qquad
            \frac{\partial F}{\partial \ell_k} = \frac{1}{\ell_k^3}\Big(
            \sum_i a^{\text{row}}_i x_{ik}^2 + \sum_j a^{\text{col}}_j x_{jk}^2
            - 2 \sum_i x_{ik} (\mathbf A \mathbf X)_{ik}\Big),

        on inputs centred at their mean, accumulated in float64; then through the constraints
        to the raw parameters by autograd on the two small tensors. The rows are the fast
        ones, or the kept ones where the operator keeps them: no autograd graph of any block.
        """
        with self._evaluating():
            params = stationary_kernel_parameters(self.covar_module)
        if params is None or params[0] != "rbf" or self.x.dim() != 2:
            return None
        _, lengthscale, outputscale = params
        wide = torch.float64
        centred = self.x.detach().to(wide)
        centred = centred - centred.mean(-2, keepdim=True)  # shape: (N, d)
        squares = centred.square()
        total = centred.new_zeros(())
        distance_terms = centred.new_zeros(centred.shape[-1])  # shape: (d,)
        first, stop = self._row_range()
        kept = self.cache_bytes > 0 and self._rows.belongs_to(self.x, self.covar_module)
        step = self.chunk_size if kept else self._grad_chunk_rows()
        with torch.no_grad(), self._evaluating():
            for start in range(first, stop, step):
                end = min(start + step, stop)
                block = self._rows.blocks.get(start) if kept else None
                if block is None:
                    block = self._row_block(start, end)  # shape: (c, N)
                left = left_vecs[start - first : end - first].to(block)
                weighted = (left @ right_vecs.to(block).mT).mul_(block).to(wide)  # A: (c, N)
                rows = weighted.sum(-1)  # shape: (c,)
                total += rows.sum()
                distance_terms += rows @ squares[start:end] + weighted.sum(-2) @ squares
                distance_terms -= 2 * (centred[start:end] * (weighted @ centred)).sum(-2)
        lengthscale = lengthscale.to(wide)
        grad_lengthscale = distance_terms / lengthscale**3  # shape: (d,)
        if lengthscale.numel() == 1:
            grad_lengthscale = grad_lengthscale.sum().reshape(1)
        grad_scale = total / outputscale.to(wide)
        scaled = isinstance(self.covar_module, ScaleKernel)  # else the RBF kernel alone
        with torch.enable_grad(), self._evaluating():
            base = self.covar_module.base_kernel if scaled else self.covar_module
            pairs = [(base.lengthscale, grad_lengthscale)]
            if scaled:
                pairs.append((self.covar_module.outputscale, grad_scale))
            pairs = [(out, g.reshape(out.shape).to(out)) for out, g in pairs if out.requires_grad]
            wanted = [h for h in hyperparameters if h.requires_grad]
            parts = [None] * len(wanted)
            if pairs and wanted:
                outputs, grads = zip(*pairs, strict=True)
                parts = torch.autograd.grad(outputs, wanted, grads, allow_unused=True)
        found = iter(parts)
        return tuple(next(found) if h.requires_grad else None for h in hyperparameters)

    def _get_indices(self, row_index: Tensor, col_index: Tensor, *batch_indices: Tensor) -> Tensor:
        """Entries ``K[*batch_indices, row_index, col_index]`` (broadcast index tensors), each
        evaluated by ``covar_module`` with :attr:`hyperparameters` (and their graph), without a
        product; a kernel with a batch shape goes through ``linear_operator``'s products."""
        if len(self.covar_module.batch_shape) or len(batch_indices) != self.x.dim() - 2:
            return super()._get_indices(row_index, col_index, *batch_indices)
        first, _ = self._row_range()
        with self._evaluating():
            return kernel_entries(
                self.covar_module, self.x, row_index + first, col_index, batch_indices
            )

    def to_dense(self) -> Tensor:
        r"""The rows of :math:`\mathbf K` the operator holds as one tensor ``(*b, n, N)``:
        through ``covar_module`` with its autograd graph where a gradient is wanted (the graph
        then holds the whole matrix), else by the fast rows, chunk by chunk."""
        first, stop = self._row_range()
        graph = torch.is_grad_enabled() and any(t.requires_grad for t in self.representation())
        with self._evaluating(), contextlib.nullcontext() if graph else torch.no_grad():
            blocks = [
                self._row_block(
                    start, min(start + self.chunk_size, stop), self.x if graph else None
                )
                for start in range(first, stop, self.chunk_size)
            ]
        if not blocks:
            return self.x.new_empty(self.shape)
        return torch.cat(blocks, dim=-2)

    def _size(self) -> torch.Size:
        n = self.x.shape[-2]
        first, stop = self._row_range()
        # a kernel with a batch shape on shared inputs is a batch of matrices too
        batch = torch.broadcast_shapes(self.x.shape[:-2], self.covar_module.batch_shape)
        return torch.Size((*batch, stop - first, n))

    def _transpose_nonbatch(self) -> ChunkedKernelOperator:
        self._require_square("transpose")
        return self

    def _require_square(self, what: str) -> None:
        """A ``ValueError`` where the operator holds a block of rows, which has no ``what``."""
        if self.rows is not None and self._row_range() != (0, self.x.shape[-2]):
            raise ValueError(
                f"a ChunkedKernelOperator of rows {self.rows.start}:{self.rows.stop} of "
                f"{self.x.shape[-2]} has no {what}; leave rows=None for the whole kernel matrix"
            )

    def _diagonal(self) -> Tensor:
        self._require_square("diagonal")
        return self._kernel_diagonal(self.x, self.shape[:-1])  # shape: (*b, N)

    def _expand_batch(self, batch_shape: torch.Size) -> ChunkedKernelOperator:
        x = self.x.expand(*batch_shape, *self.x.shape[-2:])
        return ChunkedKernelOperator(
            x,
            *self.hyperparameters,
            covar_module=self.covar_module,
            chunk_size=self.chunk_size,
            cache_bytes=self.cache_bytes,
            keep_after=self.keep_after,
            rows=self.rows,
        )


def kernel_diagonal(covar_module: Kernel, rows: Tensor, shape: torch.Size) -> Tensor:
    """``k(x_i, x_i)`` for ``rows`` (``(*bx, c, d)``), of the expected ``shape`` ``(*b, c)``.

    GPyTorch's ``diag=True`` can drop a dimension: a ScaleKernel with batch shape ``(2,)`` on
    ``c = 2`` unbatched rows gives ``(2,)``, the output scales, which would make the operator's
    trace their sum (2.6) instead of the traces (1.4, 3.8). Then the diagonal of the ``c x c``
    block, evaluated with ``x1 = x2``, is taken.
    """
    diag = covar_module(rows, diag=True)
    if diag.shape != shape:
        diag = to_dense(covar_module(rows, rows)).diagonal(dim1=-2, dim2=-1)
    return diag


def kernel_entries(
    covar_module: Kernel,
    x: Tensor,
    row_index: Tensor,
    col_index: Tensor,
    batch_indices: tuple[Tensor, ...] = (),
) -> Tensor:
    """``k(x[*b, i], x[*b, j])`` for the entries of the broadcast index tensors
    ``batch_indices``, ``row_index`` and ``col_index`` (into ``x``, ``(*b, N, d)``, one batch
    index per batch dimension), of their broadcast shape, with the kernel's autograd graph:
    one evaluation of pairs (``diag=True``), no block."""
    shape = torch.broadcast_shapes(
        row_index.shape, col_index.shape, *(b.shape for b in batch_indices)
    )
    batch = tuple(b.expand(shape).reshape(-1) for b in batch_indices)
    rows = x[(*batch, row_index.expand(shape).reshape(-1))]  # shape: (P, d)
    cols = x[(*batch, col_index.expand(shape).reshape(-1))]
    return to_dense(covar_module(rows, cols, diag=True)).reshape(shape)


def check_finite_rhs(rhs: Tensor) -> None:
    """A ``ValueError`` where the right-hand side of a product with a kernel operator holds NaN
    or infinite values (every entry of the product would be NaN)."""
    if not bool(torch.isfinite(rhs).all()):
        bad = int((~torch.isfinite(rhs)).sum())
        raise ValueError(
            "rhs, the right-hand side of a product with the kernel operator, must be finite, "
            f"but it holds {bad} NaN or infinite value(s)"
        )


def _check_hyperparameters(values: tuple, covar_module: Kernel) -> tuple[Tensor, ...]:
    """``values`` (or, empty, the kernel's parameters) as one tensor per parameter of
    ``covar_module``, or a ``ValueError`` naming them."""
    own = tuple(covar_module.parameters())
    if not values:
        return own
    if len(values) != len(own) or not all(isinstance(v, Tensor) for v in values):
        raise ValueError(
            f"hyperparameters must be one tensor per parameter of covar_module ({len(own)}), "
            f"got {len(values)} value(s)"
        )
    return values


def _check_rows(rows: object, n: int) -> slice | None:
    """``rows`` as a ``slice`` of ``0..n`` with step 1 and bounds set, or a ``TypeError`` or
    ``ValueError`` naming it."""
    if rows is None:
        return None
    if not isinstance(rows, slice):
        raise TypeError(f"rows must be a slice(start, stop) or None, got {type(rows).__name__}")
    start = 0 if rows.start is None else rows.start
    stop = n if rows.stop is None else rows.stop
    valid = all(isinstance(v, int) and not isinstance(v, bool) for v in (start, stop))
    if not valid or rows.step not in (None, 1) or not 0 <= start <= stop <= n:
        raise ValueError(
            f"rows must be a slice(start, stop) with 0 <= start <= stop <= N = {n} and step 1, "
            f"got {rows}"
        )
    return slice(start, stop)


class _KeptRows:
    """The kernel row chunks a :class:`ChunkedKernelOperator` keeps between products, with the
    inputs and kernel state they were evaluated for."""

    def __init__(self) -> None:
        self.blocks: dict[int, Tensor] = {}
        self.nbytes = 0
        self.products = 0
        self._inputs: tuple | None = None
        self._kernel_state: ModuleState | None = None
        self._full = False

    def belongs_to(self, x: Tensor, kernel: Kernel) -> bool:
        """Whether the kept rows were evaluated for these inputs and this kernel state."""
        return (
            self._inputs == _identity(x)
            and self._kernel_state is not None
            and self._kernel_state.matches(kernel)
        )

    def claim(self, x: Tensor, kernel: Kernel) -> int:
        """Count a product with ``x`` and ``kernel``, dropping rows kept for others; returns the
        number of products with them so far, this one included, or 0 where no row can be kept
        or read (the budget holds none)."""
        if not self.belongs_to(x, kernel):
            self.blocks, self.nbytes, self._full, self.products = {}, 0, False, 0
            self._inputs = _identity(x)
            self._kernel_state = ModuleState(kernel)
        self.products += 1
        return self.products if self.blocks or not self._full else 0

    def release(self) -> None:
        """Free the kept rows; later products with the same inputs and kernel state may keep
        rows again."""
        self.blocks, self.nbytes, self._full = {}, 0, False

    def add(self, start: int, block: Tensor, budget: int) -> bool:
        """Keep ``block`` if it fits in ``budget``; returns whether later chunks may be kept."""
        size = block.nbytes
        if self._full or self.nbytes + size > budget:
            self._full = True
            return False
        self.blocks[start] = block
        self.nbytes += size
        return True


def _identity(x: Tensor) -> tuple:
    """What identifies the values of ``x``: its memory, layout and write counter (``None`` for
    inputs made under ``torch.inference_mode()``, which keep none: in-place writes to such inputs
    go unnoticed)."""
    return (x.data_ptr(), x.shape, x.stride(), x.dtype, x.device, write_count(x))
