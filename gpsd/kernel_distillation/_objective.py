r"""The objective of kernel distillation on a fixed sparsity pattern: the chunked blocks of
:math:`K_{XX}`, the least-squares start, the gradient, the block direction, the exact line search
and the descent, with their sums over the ranks of a process group.

.. math::
    f(W) = \|K_{XX} - W K_{UU} W^\top\|_F^2, \qquad W_{ij} = 0 \text{ for } j \notin J_i .
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

from gpsd._internal.collectives import all_gather_cat, all_reduce_sum, check_group, split_sizes
from gpsd._internal.progress_reporter import ProgressReporter
from gpsd._internal.stationary_kernel import evaluate_kernel

__all__ = ["SparseKernelObjective"]

#: Elements of the temporaries of one block of K_XX columns or of least-squares rows.
_CHUNK_ELEMENTS = 2**22


def default_chunk_size(n: int, num_inducing: int, sparsity: int) -> int:
    """Columns of :math:`K_{XX}` per block whose temporaries hold about :math:`2^{22}`
    numbers: ``n`` per column of the block, ``m b`` per row of :math:`W K_{UU}` on the pattern."""
    return max(1, _CHUNK_ELEMENTS // max(n, num_inducing * sparsity))


def step_rule(lr: float | None, optimizer: object) -> str:
    """The fixed-step setting that chose the steps, for messages about them."""
    if optimizer is not None:
        return "the optimizer's learning rate"
    return f"lr={lr:g}"


def _batched_least_squares(design: Tensor, rhs: Tensor, gram: Tensor) -> Tensor:
    r"""``argmin_beta ||design^T beta - rhs||`` for a batch of wide ``(b, m)`` designs, ``b <= m``.

    Normal equations with a batched Cholesky factor of the Gram matrix :math:`G = D D^\top`
    (``gram``, passed in because the caller gathers it from a precomputed matrix) and six steps of
    iterative refinement on the directly computed residual (batched QR of tall matrices is very
    slow on CPUs). A refinement step multiplies the error by about :math:`\rho \approx
    \kappa(G)\, \epsilon`, so a row whose last correction :math:`\delta` is at most
    :math:`\sqrt\epsilon\, \|\beta\|` has converged (its error is about
    :math:`\rho \|\delta\| / (1 - \rho)`). The other rows, and those whose Cholesky
    factorisation fails or whose Cholesky diagonal spans more than :math:`\sqrt\epsilon`, are
    re-solved by an SVD-based least squares (minimum-norm solution).

    A test on the conditioning alone does not do: the spread of the Cholesky diagonal only bounds
    :math:`\kappa(G)^{1/2}` from below, and rows with :math:`\kappa(D) \approx 8 \times 10^9`
    passed it with residuals :math:`10^6` times the least squares'; a test on ``eigvalsh`` of
    :math:`G` (:math:`\lambda_{\min} \le 1000 \epsilon \lambda_{\max}`) sends rows to the SVD
    that refinement solves: at n = 16,384, m = 1000, b = 30, RBF lengthscale 1.5 it took 10.2 s
    where this takes 3.7 s, for the same start (the diagonal test with two refinement steps
    alone: 2.2 s, and a start 0.5 % farther from :math:`K_{XX}`).

    :param design: shape ``(c, b, m)``; :param rhs: shape ``(c, m)``; :param gram: shape
        ``(c, b, b)``; returns shape ``(c, b)``.
    """
    eps = torch.finfo(design.dtype).eps
    chol, info = torch.linalg.cholesky_ex(gram)
    diag = chol.diagonal(dim1=-2, dim2=-1).abs()
    bad = (info != 0) | (diag.min(-1).values <= 10 * eps**0.5 * diag.max(-1).values)
    chol = torch.where(
        bad[:, None, None], torch.eye(gram.shape[-1], dtype=gram.dtype, device=gram.device), chol
    )
    sol = torch.cholesky_solve((design @ rhs.unsqueeze(-1)), chol)  # shape: (c, b, 1)
    for _ in range(6):
        resid = rhs.unsqueeze(-1) - design.transpose(-1, -2) @ sol  # shape: (c, m, 1)
        correction = torch.cholesky_solve(design @ resid, chol)
        sol = sol + correction
    sol, correction = sol.squeeze(-1), correction.squeeze(-1)
    bad = bad | ~(correction.norm(dim=-1) <= eps**0.5 * sol.norm(dim=-1))  # NaN: not converged
    if bool(bad.any()):
        tall, target = design[bad].transpose(-1, -2), rhs[bad].unsqueeze(-1)
        if design.device.type == "cpu":
            sol[bad] = torch.linalg.lstsq(tall, target, driver="gelsd").solution.squeeze(-1)
        else:
            sol[bad] = (torch.linalg.pinv(tall) @ target).squeeze(-1)
    return sol


class _SparseRows:
    """``W`` with ``b`` non-zeros per row: ``values (n, b)`` at columns ``indices (n, b)``.

    ``W`` and ``W^T`` are built as compressed-row (CSR) tensors, whose products with dense
    matrices run about twice as fast as the coordinate (COO) layout's on a CPU (n = 8192,
    m = 1000, b = 30, 2048 columns: 0.14 s against 0.26 s in float32). Indices are sorted within
    each row; the permutation to column-major order (the rows of ``W^T``) is computed once.
    """

    def __init__(self, indices: Tensor, num_columns: int) -> None:
        self.indices = indices
        self.n, self.b = indices.shape
        self.m = num_columns
        device = indices.device
        self.crow = torch.arange(0, self.n * self.b + 1, self.b, device=device)
        self.col = indices.reshape(-1)
        rows = torch.arange(self.n, device=device).repeat_interleave(self.b)
        self.t_order = torch.argsort(self.col * self.n + rows)
        self.t_col = rows[self.t_order]
        counts = torch.bincount(self.col, minlength=self.m)
        self.t_crow = torch.cat([counts.new_zeros(1), counts.cumsum(0)])

    @staticmethod
    def _csr(crow: Tensor, col: Tensor, values: Tensor, size: tuple[int, int]) -> Tensor:
        with warnings.catch_warnings():  # torch calls its CSR support "beta" on first use
            warnings.filterwarnings("ignore", message="Sparse CSR tensor support")
            return torch.sparse_csr_tensor(crow, col, values, size, check_invariants=False)

    def matrix(self, values: Tensor) -> Tensor:
        return self._csr(self.crow, self.col, values.reshape(-1), (self.n, self.m))

    def rows(self, values: Tensor, rows: slice) -> Tensor:
        """Rows ``rows`` (a slice with step 1) of ``W``."""
        start, stop, _ = rows.indices(self.n)
        crow = self.crow[: stop - start + 1]
        col = self.col[start * self.b : stop * self.b]
        return self._csr(crow, col, values[rows].reshape(-1), (stop - start, self.m))

    def transpose(self, values: Tensor) -> Tensor:
        values = values.reshape(-1)[self.t_order]
        return self._csr(self.t_crow, self.t_col, values, (self.m, self.n))

    def dense(self, values: Tensor) -> Tensor:
        out = values.new_zeros(self.n, self.m)
        return out.scatter_(-1, self.indices, values)


class SparseKernelObjective:
    r"""The squared error :math:`f(W) = \|K_{XX} - W K_{UU} W^\top\|_F^2` of a sparse ``W``.

    Row ``i`` of :math:`W` has its ``b`` non-zeros ``values[i]`` at the columns
    ``neighbour_indices[i]`` (the set :math:`J_i`). :math:`K_{XX}` is never formed: every pass
    evaluates it in blocks of ``chunk_size`` columns, and the products with :math:`W` use sparse
    matrices. The gradient of :math:`f` on the pattern is

    .. math::
        \nabla_W = 4\, P\big((W K_{UU} W^\top - K_{XX})\, W K_{UU}\big),

    :math:`P` keeping the entries of the pattern.

    With a ``process_group``, the ``n`` columns of :math:`K_{XX}` (and rows of :math:`W`) are split
    into contiguous blocks, one per rank (:attr:`block`); each rank evaluates its block, sums are
    added over the ranks and rows gathered, so that every method returns the same bits on every
    rank (every method is then collective).

    :param covar_module: the kernel :math:`k` (without batch shape).
    :param train_x: :math:`X`, shape ``(n, d)``.
    :param inducing_points: :math:`U`, shape ``(m, d)``.
    :param neighbour_indices: :math:`J`, shape ``(n, b)``, sorted within each row.
    :param chunk_size: columns of :math:`K_{XX}` per block (default: :func:`default_chunk_size`).
    :param inducing_covariance: :math:`K_{UU}`, shape ``(m, m)`` (default: evaluated here).
    :param process_group: a ``torch.distributed.ProcessGroup`` whose ranks share the passes, or
        ``None``.
    """

    def __init__(
        self,
        covar_module: torch.nn.Module,
        train_x: Tensor,
        inducing_points: Tensor,
        neighbour_indices: Tensor,
        *,
        chunk_size: int | None = None,
        inducing_covariance: Tensor | None = None,
        process_group: object = None,
    ) -> None:
        n, b = neighbour_indices.shape
        m = inducing_points.shape[0]
        self.covar_module = covar_module
        self.train_x = train_x  # shape: (n, d)
        self.inducing_points = inducing_points  # shape: (m, d)
        self.neighbour_indices = neighbour_indices  # shape: (n, b)
        self.num_inducing, self.sparsity = m, b
        self.chunk_size = chunk_size or default_chunk_size(n, m, b)
        if inducing_covariance is None:
            inducing_covariance = evaluate_kernel(covar_module, inducing_points, inducing_points)
        self.inducing_covariance = inducing_covariance  # shape: (m, m)
        self.pattern = _SparseRows(neighbour_indices, m)
        self.process_group = process_group
        #: The columns of :math:`K_{XX}` (and rows of :math:`W`) this rank evaluates, and the
        #: number of them every rank holds, in rank order.
        self.block, self.block_sizes = slice(0, n), [n]
        if process_group is not None:
            rank, size = check_group(process_group)
            self.block_sizes = split_sizes(n, size)
            start = sum(self.block_sizes[:rank])
            self.block = slice(start, start + self.block_sizes[rank])

    # ------------------------------------------------------------------ sums over ranks
    def gather_rows(self, mine: Tensor, what: str) -> Tensor:
        """This rank's rows :attr:`block` of an ``(n, b)`` matrix, with every other rank's,
        ``(n, b)`` on every rank (``mine`` itself without a process group)."""
        if self.process_group is None:
            return mine
        return all_gather_cat(mine, 0, self.block_sizes, self.process_group, what)

    def sum_over_ranks(self, mine: Tensor, what: str) -> Tensor:
        """This rank's partial sums plus every other rank's (``mine`` itself without a
        process group)."""
        if self.process_group is None:
            return mine
        return all_reduce_sum(mine, self.process_group, what)

    # ------------------------------------------------------------------ blocks
    def columns(self, start: int) -> tuple[slice, Tensor]:
        """Columns ``start ..`` of :math:`K_{XX}`, at most ``chunk_size`` of them and none
        beyond this rank's :attr:`block`: ``(columns, K_XX[:, columns])``, the block of shape
        ``(n, c)``."""
        cols = slice(start, min(start + self.chunk_size, self.block.stop))
        return cols, evaluate_kernel(self.covar_module, self.train_x, self.train_x[cols])

    def _times_kuu(self, values: Tensor, cols: slice) -> Tensor:
        """Rows ``cols`` of :math:`W K_{UU}`, shape ``(c, m)``."""
        return self.pattern.rows(values, cols) @ self.inducing_covariance

    def dense_weights(self, values: Tensor) -> Tensor:
        """:math:`W` as a dense ``(n, m)`` matrix."""
        return self.pattern.dense(values)

    # ------------------------------------------------------------------ least squares
    def least_squares_blocks(self) -> list[slice]:
        """The blocks of this rank's rows that :meth:`least_squares_weights` solves at once."""
        rows = max(1, _CHUNK_ELEMENTS // (self.num_inducing * self.sparsity))
        block = self.block  # all n rows without a process group
        return [
            slice(start, min(start + rows, block.stop))
            for start in range(block.start, block.stop, rows)
        ]

    def least_squares_weights(self, report: ProgressReporter | None = None) -> Tensor:
        r"""The start, rows :math:`\arg\min_\beta \|\beta K_{UU}(J_i,:) - k(x_i, U)\|_2`,
        shape ``(n, b)``.

        A batch of ``m x b`` least-squares problems per block of rows
        (:meth:`least_squares_blocks`; each block solved is reported to ``report``, with
        ``rows`` its rows), by normal equations with iterative refinement and an SVD for rows
        where they do not converge, in float64 whatever the dtype (except on MPS). Every row's
        Gram matrix :math:`K_{UU}(J_i,:) K_{UU}(J_i,:)^\top` is read from
        :math:`K_{UU} K_{UU}^\top`, computed once.
        """
        idx, b = self.neighbour_indices, self.sparsity
        dtype = self.inducing_covariance.dtype
        work = dtype if self.inducing_covariance.device.type == "mps" else torch.float64
        kuu = self.inducing_covariance.to(work)
        kuu_gram = kuu @ kuu.mT  # shape: (m, m)
        out = []
        for number, rows in enumerate(self.least_squares_blocks(), start=1):
            xr = self.train_x[rows]
            rhs = evaluate_kernel(self.covar_module, xr, self.inducing_points).to(work)  # (c, m)
            j = idx[rows]  # shape: (c, b)
            design = kuu[j]  # K_UU(J_i, :), shape: (c, b, m)
            gram = kuu_gram[j.unsqueeze(-1), j.unsqueeze(-2)]  # shape: (c, b, b)
            out.append(_batched_least_squares(design, rhs, gram).to(dtype))
            if report is not None:
                report.update(number, rows=rows.stop - rows.start)
        mine = torch.cat(out) if out else kuu.new_zeros(0, b).to(dtype)  # (n_p, b)
        return self.gather_rows(mine, "all_gather of the least-squares start")

    # ------------------------------------------------------------------ objective
    def objective_and_gradient(
        self, values: Tensor, *, gradient: bool = True
    ) -> tuple[Tensor, Tensor | None]:
        r""":math:`f(W)` and, with ``gradient``, :math:`\nabla_W` on the pattern.

        :param values: non-zeros of :math:`W`, shape ``(n, b)``.
        :param gradient: also return the gradient (``False``: the objective alone, cheaper).
        :return: ``(objective (), gradient (n, b) or None)``.
        """
        w = self.pattern.matrix(values)
        wt = self.pattern.transpose(values) if gradient else None
        total = values.new_zeros(())
        block = self.block  # all n columns without a process group
        rows = slice(0, block.stop - block.start)
        grad = torch.empty_like(values[rows]) if gradient else None  # rows of this block
        with torch.no_grad():
            for start in range(block.start, block.stop, self.chunk_size):
                cols, k_cols = self.columns(start)
                a_rows = self._times_kuu(values, cols)  # (W K_UU)[cols], shape: (c, m)
                resid = w @ a_rows.transpose(-1, -2) - k_cols  # E[:, cols] (n, c)
                total = total + resid.pow(2).sum()
                if gradient:
                    ew = (wt @ resid).transpose(-1, -2)  # (E W)[cols], shape: (c, m)
                    # (E W K_UU)[cols] on the pattern, shape: (c, b)
                    ewk = ew @ self.inducing_covariance.mT
                    local = slice(cols.start - block.start, cols.stop - block.start)
                    grad[local] = 4.0 * ewk.gather(-1, self.neighbour_indices[cols])
        total = self.sum_over_ranks(total, "all_reduce of the objective")
        if gradient:
            grad = self.gather_rows(grad, "all_gather of the gradient")
        return total, grad

    def frobenius_error(self, values: Tensor) -> float:
        r""":math:`\|K_{XX} - W K_{UU} W^\top\|_F = f(W)^{1/2}`."""
        return float(self.objective_and_gradient(values, gradient=False)[0].sqrt())

    # ------------------------------------------------------------------ descent
    def block_direction(self, values: Tensor, gradient: Tensor) -> Tensor:
        r"""The block least-squares direction :math:`D` (``W - D`` is one alternating step):
        :math:`D_i = G(J_i, J_i)^{-1} \nabla_W(i, J_i) / 4` with
        :math:`G = K_{UU} W^\top W K_{UU}`, in float64 (except on MPS), with a relative jitter
        of :math:`10^{-12}` on each :math:`G(J_i, J_i)` and the pseudo-inverse for rows whose
        factorisation still fails.

        :param values: non-zeros of :math:`W`, shape ``(n, b)``.
        :param gradient: :math:`\nabla_W` on the pattern, shape ``(n, b)``.
        :return: :math:`D`, shape ``(n, b)``.
        """
        idx, m = self.neighbour_indices, self.num_inducing
        for name, tensor in (("values", values), ("gradient", gradient)):
            if not isinstance(tensor, Tensor) or tensor.shape != idx.shape:
                shape = tuple(tensor.shape) if isinstance(tensor, Tensor) else type(tensor).__name__
                raise ValueError(
                    f"{name} must be a tensor of shape {tuple(idx.shape)}, got {shape}"
                )
        dtype = values.dtype
        work = dtype if values.device.type == "mps" else torch.float64
        vals = values.to(work)
        outer = vals.unsqueeze(-1) * vals.unsqueeze(-2)  # shape: (n, b, b)
        flat = (idx.unsqueeze(-1) * m + idx.unsqueeze(-2)).reshape(-1)
        gram = torch.zeros(m * m, dtype=work, device=values.device)
        gram = gram.index_add_(0, flat, outer.reshape(-1)).reshape(m, m)  # W^T W
        kuu = self.inducing_covariance.to(work)
        g = kuu @ gram @ kuu  # shape: (m, m)
        g = 0.5 * (g + g.mT)
        b = self.sparsity
        eye = torch.eye(b, dtype=work, device=values.device)
        rows = max(1, _CHUNK_ELEMENTS // (b * b))
        owned = self.block  # all n rows without a process group
        out = []
        for start in range(owned.start, owned.stop, rows):
            stop = min(start + rows, owned.stop)
            j = idx[start:stop]  # shape: (c, b)
            block = g[j.unsqueeze(-1), j.unsqueeze(-2)]  # shape: (c, b, b)
            scale = block.diagonal(dim1=-2, dim2=-1).mean(-1).clamp_min(torch.finfo(work).tiny)
            block = block + 1e-12 * scale[:, None, None] * eye
            rhs = 0.25 * gradient[start:stop].to(work).unsqueeze(-1)  # (c, b, 1)
            chol, info = torch.linalg.cholesky_ex(block)
            sol = torch.cholesky_solve(rhs, chol)
            bad = (info != 0) | ~torch.isfinite(sol).all(dim=(-2, -1))
            if bool(bad.any()):
                sol[bad] = torch.linalg.pinv(block[bad], hermitian=True) @ rhs[bad]
            out.append(sol.squeeze(-1))
        mine = torch.cat(out) if out else g.new_zeros(0, b)  # shape: (n_p, b)
        return self.gather_rows(mine.to(dtype), "all_gather of the block direction")

    def line_search(self, values: Tensor, direction: Tensor) -> tuple[float, float]:
        r"""The first local minimiser ``t >= 0`` of :math:`f(W - t D)` and :math:`f` there.

        :math:`f(W - tD)` is a quartic in :math:`t` whose five coefficients come from six sums
        over the columns of one pass. Not the global minimiser of the quartic: :math:`f` is even
        in :math:`W`, so a farther minimum can be (nearly) :math:`-W`, beyond the barrier at
        :math:`W = 0`, whose student predicts the negated mean.

        :param values: non-zeros of :math:`W`, shape ``(n, b)``.
        :param direction: non-zeros of :math:`D` on the same pattern, shape ``(n, b)``.
        :return: ``(t, f(W - t D))``; ``t = 0`` where ``D`` is no descent direction.
        """
        w = self.pattern.matrix(values)
        dmat = self.pattern.matrix(direction)
        c = torch.zeros(6, dtype=values.dtype, device=values.device)
        block = self.block  # all n columns without a process group
        with torch.no_grad():
            for start in range(block.start, block.stop, self.chunk_size):
                cols, k_cols = self.columns(start)
                a = self._times_kuu(values, cols).transpose(-1, -2)  # (m, c)
                bmat = self._times_kuu(direction, cols).transpose(-1, -2)
                both = torch.cat([a, bmat], dim=-1)  # shape: (m, 2c)
                w_both, d_both = w @ both, dmat @ both
                width = a.shape[-1]
                e0 = w_both[:, :width] - k_cols  # E_0[:, cols]
                s = d_both[:, :width] + w_both[:, width:]  # (D K W^T + W K D^T)[:, cols]
                q = d_both[:, width:]  # (D K D^T)[:, cols]
                c += torch.stack(
                    [
                        (e0 * e0).sum(),
                        (e0 * s).sum(),
                        (s * s).sum(),
                        (e0 * q).sum(),
                        (s * q).sum(),
                        (q * q).sum(),
                    ]
                )
        c = self.sum_over_ranks(c, "all_reduce of the line search's coefficients")
        ee, es, ss, eq, sq, qq = c.tolist()
        # f(t) = ee - 2 es t + (ss + 2 eq) t^2 - 2 sq t^3 + qq t^4
        coeffs = [qq, -2.0 * sq, ss + 2.0 * eq, -2.0 * es, ee]
        poly = np.polynomial.Polynomial(coeffs[::-1])
        # f decreases from t = 0 (a descent direction) up to its first critical point
        t = min(
            (
                r.real
                for r in poly.deriv().roots()
                if abs(r.imag) < 1e-12 * (1 + abs(r)) and r.real > 0
            ),
            default=0.0,
        )
        if poly(t) > ee:  # not a descent direction, or no step beyond rounding
            t = 0.0
        return t, max(poly(t), 0.0)

    def descend(
        self,
        values: Tensor,
        max_iter: int,
        *,
        lr: float | None = None,
        optimizer: Callable[[list[Tensor]], torch.optim.Optimizer] | None = None,
        descent: str = "block",
        report: ProgressReporter | None = None,
    ) -> tuple[Tensor, list[float]]:
        r"""Up to ``max_iter`` descent iterations from ``values``.

        Each iteration steps along the block direction (``descent="block"``) or the gradient
        (``"gradient"``): by the exact :meth:`line_search` without ``lr`` and ``optimizer``,
        by :math:`W \leftarrow W - \text{lr}\, \nabla_W` with ``lr``, or by an ``optimizer``
        step (a new optimiser made by the factory for this descent).

        :param report: told, after iteration ``k``, ``k`` with ``loss`` the error after it; an
            ``update`` returning ``True`` stops the descent there.
        :return: ``(values, errors)``: the non-zeros reached and the errors
            :math:`f^{1/2}` of the start and after every iteration taken.
        :raises RuntimeError: where a step gives non-finite weights, naming the step rule.
        """
        errors: list[float] = []
        param, opt = None, None
        if optimizer is not None:
            param = torch.nn.Parameter(values.clone())
            opt = optimizer([param])
        for step in range(max_iter):
            current = param.detach() if opt is not None else values
            obj, grad = self.objective_and_gradient(current)
            errors.append(float(obj.sqrt()))
            # the error after iteration `step` is known now, with the gradient there
            if step > 0 and report is not None and report.update(step, loss=errors[-1]):
                return values, errors
            if opt is not None:
                opt.zero_grad()
                param.grad = grad
                opt.step()
                values = param.detach().clone()
            elif lr is not None:
                values = values - lr * grad
            else:
                direction = self.block_direction(values, grad) if descent == "block" else grad
                t, _ = self.line_search(values, direction)
                values = values - t * direction
            if not bool(torch.isfinite(values).all()):
                advice = (
                    "the exact line search took a non-finite step (an ill-conditioned "
                    "K_UU: use float64, or fewer or more spread-out inducing points)"
                    if lr is None and optimizer is None
                    else f"{step_rule(lr, optimizer)} is too large; lower it, or use the exact "
                    "line search (lr=None, the default)"
                )
                raise RuntimeError(
                    f"kernel distillation diverged at iteration {step + 1}: {advice}"
                )
        errors.append(self.frobenius_error(values))
        if max_iter > 0 and report is not None:
            report.update(max_iter, loss=errors[-1])
        return values, errors
