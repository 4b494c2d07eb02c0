"""Spectral filters of the data-centric family by deflated conjugate gradients, matrix-free."""

from __future__ import annotations

import math

import torch
from gpytorch.utils.warnings import NumericalWarning
from linear_operator.operators import LinearOperator
from torch import Tensor

from gpsd._internal.user_warning import warn
from gpsd._internal.validation import check_int
from gpsd.linalg._shifted_solve import ShiftedSolveEngine, per_distinct_shift
from gpsd.linalg.kernel_spectrum import KernelSpectrum
from gpsd.linalg.spectral_engine import (
    columns_per_chunk,
    is_matrix_free,
    rademacher,
    sample_mean,
)
from gpsd.linalg.spectral_filter import SpectralFilter

__all__ = ["ShiftedCG"]

#: Iterations before the Lanczos chain first compares its coefficients: part of its stopping
#: rule (two checkpoints are the fewest that estimate an error), not a tuning knob.
_FIRST_CHECK = 8


class ShiftedCG(ShiftedSolveEngine):
    r"""Applies data-centric filters by preconditioned conjugate gradients, never forming K.

    Every factor of a data-centric filter is a solve with :math:`\mathbf K + \gamma\mathbf I`
    (see :class:`~gpsd.linalg.ShiftedCholesky`); here each solve runs conjugate gradients on the
    products :math:`\mathbf K\mathbf X` of a matrix-free operator (a KeOps kernel or a
    :class:`~gpsd.linalg.ChunkedKernelOperator`), one independent CG per column.

    The preconditioner deflates :math:`q` approximate eigenpairs
    :math:`(\theta_i, \mathbf v_i)` of :math:`\mathbf K` (the Ritz pairs of a block Lanczos run):

    .. math::
        \mathbf P_\gamma = \mathbf V(\boldsymbol\Theta + \gamma\mathbf I)\mathbf V^\top
        + \gamma(\mathbf I - \mathbf V\mathbf V^\top), \qquad
        \mathbf P_\gamma^{-1} = \mathbf V\big((\boldsymbol\Theta + \gamma\mathbf I)^{-1}
        - \gamma^{-1}\mathbf I\big)\mathbf V^\top + \gamma^{-1}\mathbf I .

    It is symmetric positive definite for any orthonormal :math:`\mathbf V` and
    :math:`\boldsymbol\Theta \succeq 0`, serves every shift at once, and costs
    :math:`\mathcal O(Nq)` per column. Where the Ritz pairs are exact the preconditioned matrix has
    the eigenvalues 1 and :math:`(\lambda + \gamma)/\gamma` for the eigenvalues :math:`\lambda` of
    the complement, so CG needs about :math:`\sqrt{1 + \lambda_{q+1}/\gamma}` iterations. Unlike the
    Taylor series of :meth:`~gpsd.linalg.KernelSpectrum.from_lanczos`, this converges whatever
    :math:`\lambda_{q+1}/\gamma`: it is the backend for slowly decaying spectra at large N.

    **Many shifts at once.** A resolvent with several distinct shifts (the variances of a
    changing noise schedule, the distribution-centric means) needs no solve per shift:
    :meth:`multishift_solve` and :meth:`multishift_quad_diag` run one CG for the smallest shift
    on the complement of the resolved Ritz pairs and read every other shift off it (as it splits
    off only the resolved pairs, it takes about :math:`\sqrt{1 + \lambda_{r+1}/\gamma_0}`
    iterations for :math:`r` resolved pairs and the smallest shift :math:`\gamma_0`). The
    data-centric chain, where each step's right-hand side is the previous step's output, can
    skip its :math:`T` solves too: :meth:`krylov_apply` reads all steps off one Lanczos run on
    the same complement, and :meth:`apply` takes it when that is cheaper.

    **Accuracy.** Each column stops once its residual satisfies
    :math:`\lVert \mathbf b - (\mathbf K + \gamma\mathbf I)\mathbf x\rVert \le \text{tol}\,
    \lVert\mathbf b\rVert`, checked on the true residual at the end. The solution's error is then
    at most :math:`\text{tol}\,\lVert\mathbf b\rVert/\gamma`, and each data-centric step
    :math:`\mathbf K(\mathbf K + \gamma\mathbf I)^{-1}\mathbf a = \mathbf a - \gamma
    (\mathbf K + \gamma\mathbf I)^{-1}\mathbf a` adds at most :math:`\text{tol}\,\lVert\mathbf a\rVert`
    to the targets. The quadratic forms of the predictive variances,
    :math:`\mathbf c^\top(\mathbf K + \gamma\mathbf I)^{-1}\mathbf c`, err by at most
    :math:`\text{tol}^2\lVert\mathbf c\rVert^2/\gamma` (second order; see
    :meth:`_resolvent_quad_diag` and :meth:`multishift_quad_diag`); :meth:`quad_diag` leaves the
    bound :math:`\lVert\mathbf r\rVert^2/\gamma` of each form in :attr:`quad_error_bound`, and
    the regression distillers warn where it exceeds 10 % of a variance. A solve whose true residual
    ends above ``10 * tol`` (``max_iter`` iterations were not enough, or rounding stalled it)
    warns with a ``NumericalWarning`` naming the residual it reached.

    :param kernel: :math:`\mathbf K` as a tensor or ``LinearOperator`` of shape ``(*b, N, N)``
        (only ``matmul`` is used).
    :param ritz_values: :math:`\boldsymbol\Theta`, shape ``(*b, q)`` (negative rounding is clipped).
    :param ritz_vectors: :math:`\mathbf V`, shape ``(*b, N, q)`` with orthonormal columns.
    :param resolved: ``(*b, q)``, which pairs are eigenpairs to the accuracy wanted (their
        residuals are below ``tol`` times the smallest shift); :meth:`quad_diag` splits them off
        exactly. Default: none.
    :param tol: relative residual at which a column stops.
    :param max_iter: iterations per solve before it warns.
    :param dtype: dtype of the iterations (default: the Ritz vectors').
    """

    name = "cg"
    supports_autograd = False
    exact_trace = False

    def __init__(
        self,
        kernel: Tensor | LinearOperator,
        ritz_values: Tensor,
        ritz_vectors: Tensor,
        *,
        resolved: Tensor | None = None,
        tol: float = 1e-8,
        max_iter: int = 1000,
        dtype: torch.dtype | None = None,
    ) -> None:
        if not tol > 0:
            raise ValueError(f"tol must be positive, got {tol}")
        max_iter = check_int(max_iter, "max_iter")
        if ritz_vectors.shape[-2] != kernel.shape[-1]:
            raise ValueError(
                f"ritz_vectors must have {kernel.shape[-1]} rows (the kernel's size), "
                f"got shape {tuple(ritz_vectors.shape)}"
            )
        self.dtype = dtype or ritz_vectors.dtype
        self.kernel = kernel
        self.matrix_free = is_matrix_free(kernel)
        self.size = kernel.shape[-1]
        self.batch_shape = kernel.shape[:-2]
        self.ritz_values = ritz_values.to(self.dtype).clamp_min(0.0)
        self.ritz_vectors = ritz_vectors.to(self.dtype)
        if resolved is None:
            resolved = torch.zeros(ritz_values.shape, dtype=torch.bool, device=ritz_values.device)
        #: Ritz pairs accurate enough to split off exactly in the multi-shift variances.
        self.resolved = resolved
        self.tol = tol
        self.max_iter = max_iter
        #: Iterations of the most recent solve.
        self.last_iterations = 0
        #: Largest true relative residual of any solve so far.
        self.max_relative_residual = 0.0
        #: Largest a posteriori relative error of any :meth:`krylov_apply` so far.
        self.krylov_error_estimate = 0.0
        self._solve_iterations = 0  # iterations of the latest CG solve (not the Krylov runs)
        #: ``(solution, true residual)`` of the latest solve, until quad_diag takes it
        self._residual: tuple[Tensor, Tensor] | None = None

    @classmethod
    def from_spectrum(
        cls,
        kernel: Tensor | LinearOperator,
        spectrum: KernelSpectrum,
        *,
        tol: float = 1e-8,
        max_iter: int = 1000,
    ) -> ShiftedCG:
        """Deflate every Ritz pair of a :meth:`KernelSpectrum.from_lanczos` spectrum of ``kernel``
        (a spectrum whose Ritz vectors are split by rows across a process group,
        :attr:`KernelSpectrum.local_rows`, hands over all their rows, gathered: the iterations
        of CG run alike on every rank)."""
        if spectrum.ritz_vectors is None:
            raise ValueError(
                "spectrum must come from KernelSpectrum.from_lanczos (it has Ritz pairs)"
            )
        return cls(
            kernel,
            spectrum.ritz_values,
            spectrum.all_rows(spectrum.ritz_vectors),
            resolved=spectrum.ritz_resolved,  # within residual_tol, not the rounding floor
            tol=tol,
            max_iter=max_iter,
        )

    # ------------------------------------------------------------------ products
    def _kernel_matmul(self, x: Tensor) -> Tensor:
        """:math:`\\mathbf K\\mathbf X` for ``x`` of shape ``(*lead, *b, N, r)``: lead dims become
        columns. The result never shares memory with ``x``: the callers update it in place."""
        num_lead = x.dim() - 2 - len(self.batch_shape)
        lead = x.shape[:num_lead]
        if num_lead == 0:
            out = (self.kernel @ x.to(self.kernel.dtype)).to(self.dtype)
        else:
            count = math.prod(lead)
            cols = x.reshape(count, *x.shape[num_lead:]).movedim(0, -1)  # shape: (*b, N, r, L)
            cols = cols.reshape(*cols.shape[:-2], -1)  # shape: (*b, N, r * L)
            out = (self.kernel @ cols.to(self.kernel.dtype)).to(self.dtype)
            out = out.reshape(*out.shape[:-1], x.shape[-1], count).movedim(-1, 0).reshape(x.shape)
        # an operator may hand back its input (an identity does)
        same = out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
        return out.clone() if same else out

    def _precondition(self, noise: Tensor, r: Tensor) -> Tensor:
        """:math:`\\mathbf P_\\gamma^{-1}\\mathbf r` for ``noise`` ``(*, 1, 1)`` and ``r`` ``(*, N, c)``."""
        v = self.ritz_vectors
        g = noise.squeeze(-1)  # shape: (*, 1)
        scale = 1.0 / (self.ritz_values + g) - 1.0 / g  # shape: (*, q)
        return (v @ (scale.unsqueeze(-1) * (v.mT @ r))).addcdiv_(r, noise)

    # ------------------------------------------------------------------ the solve
    def _solve(self, noise: Tensor, rhs: Tensor) -> Tensor:
        """Preconditioned CG, one independent run per column, each stopping on its own."""
        with torch.no_grad():
            return self._conjugate_gradients(noise.to(self.dtype), rhs.to(self.dtype))

    def _conjugate_gradients(self, noise: Tensor, rhs: Tensor) -> Tensor:
        self._residual = None  # the previous solve's: freed before this one allocates
        shape = torch.broadcast_shapes(noise.shape, rhs.shape[:-2], self.batch_shape)
        b = rhs.expand(*shape, *rhs.shape[-2:])
        g = noise.expand(shape)[..., None, None]  # shape: (*shape, 1, 1)

        def shifted(x: Tensor) -> Tensor:
            return self._kernel_matmul(x).addcmul_(x, g)

        b_norm = torch.linalg.vector_norm(b, dim=-2)  # shape: (*shape, r)
        threshold = self.tol * b_norm
        # The N x r blocks are updated in place: on the CPU, a fresh block per update lets the
        # C allocator scatter the small per-iteration tensors over the freed blocks, and the
        # process's memory grows by about a block per iteration.
        x = self._precondition(g, b)  # exact on the deflated subspace
        r = shifted(x).neg_().add_(b)
        p = self._precondition(g, r)
        rz = (r * p).sum(-2)
        iterations = 0
        while iterations < self.max_iter:
            active = torch.linalg.vector_norm(r, dim=-2) > threshold
            if not bool(active.any()):
                break
            q = shifted(p)
            pq = (p * q).sum(-2)
            alpha = torch.where(active & (pq > 0), rz / pq.where(pq > 0, 1.0), 0.0)
            x.addcmul_(p, alpha.unsqueeze(-2))
            r.addcmul_(q, alpha.unsqueeze(-2), value=-1.0)
            del q
            z = self._precondition(g, r)
            rz_new = (r * z).sum(-2)
            beta = torch.where(active & (rz > 0), rz_new / rz.where(rz > 0, 1.0), 0.0)
            p = p.mul_(beta.unsqueeze(-2)).add_(z)
            del z
            rz = rz_new
            iterations += 1
        self.last_iterations = self._solve_iterations = iterations
        residual = b - shifted(x)
        self._residual = (x, residual)  # for the second-order quadratic forms of quad_diag
        true_residual = torch.linalg.vector_norm(residual, dim=-2)
        del residual
        relative = true_residual / b_norm.clamp_min(torch.finfo(self.dtype).tiny)
        worst = float(relative.max()) if relative.numel() else 0.0
        self.max_relative_residual = max(self.max_relative_residual, worst)
        _raise_if_not_finite(relative)
        if worst > 10 * self.tol:
            advice = (
                "raise rank= (a stronger preconditioner) or max_iter"
                if iterations >= self.max_iter
                else "rounding in the kernel products limits it: run them in float64 or raise tol"
            )
            warn(
                f"conjugate gradients reached a relative residual of {worst:.3g} after "
                f"{iterations} iterations, above tol={self.tol:.3g}; {advice}",
                NumericalWarning,
            )
        return x

    def _resolvent_quad_diag(self, noise: Tensor, left: Tensor) -> tuple[Tensor, Tensor]:
        r""":math:`\mathbf c^\top(\mathbf K + \gamma\mathbf I)^{-1}\mathbf c` per column, to second
        order in the solve's error, and the bound :math:`\lVert\mathbf r\rVert^2/\gamma` on that
        error.

        With :math:`\mathbf A = \mathbf K + \gamma\mathbf I`, the iterate :math:`\hat{\mathbf x}`,
        its error :math:`\mathbf e = \mathbf A^{-1}\mathbf c - \hat{\mathbf x}` and residual
        :math:`\mathbf r = \mathbf c - \mathbf A\hat{\mathbf x} = \mathbf A\mathbf e`,

        .. math::
            \mathbf c^\top\mathbf A^{-1}\mathbf c = \hat{\mathbf x}^\top(\mathbf c + \mathbf r)
            + \mathbf e^\top\mathbf A\,\mathbf e, \qquad
            0 \le \mathbf e^\top\mathbf A\,\mathbf e = \mathbf r^\top\mathbf A^{-1}\mathbf r
            \le \text{tol}^2\lVert\mathbf c\rVert^2/\gamma ,

        where the plain :math:`\mathbf c^\top\hat{\mathbf x}` errs by
        :math:`\hat{\mathbf x}^\top\mathbf r`, of first order (up to
        :math:`\text{tol}\lVert\mathbf c\rVert^2/\gamma`). The predictive variance
        :math:`k_{**} - \mathbf c^\top\mathbf A^{-1}\mathbf c` is a small difference when
        :math:`\gamma` is small, so the first-order term would dominate its error: at
        :math:`\gamma = 10^{-8}` and ``tol`` :math:`= 10^{-8}` the first-order variances are
        :math:`3.5 \times 10^{-3}` off a 40-digit reference, against :math:`3.3 \times 10^{-9}`
        for the second-order form (``benchmarks/bench_cg_variance_accuracy.py``). The residual is the one the solve computed for its final check. The value
        returned is below the true one by :math:`\mathbf r^\top\mathbf A^{-1}\mathbf r \in
        [0, \lVert\mathbf r\rVert^2/\gamma]`, the bound returned with it
        (:attr:`quad_error_bound` after :meth:`quad_diag`).
        """
        x = self.solve(noise, left)
        cached, self._residual = self._residual, None
        if cached is not None and cached[0] is x:
            residual = cached[1]
        else:  # a solve reused from before: its residual again
            g = noise.to(self.dtype).expand(x.shape[:-2])[..., None, None]
            residual = left - self._kernel_matmul(x).addcmul_(x, g)
        value = (x * (left + residual)).sum(-2)  # shape: (*, M)
        g = noise.to(self.dtype).expand(residual.shape[:-2]).unsqueeze(-1)  # shape: (*, 1)
        return value, residual.square().sum(-2) / g

    # ------------------------------------------------------------------ all shifts at once
    def apply(self, filt: SpectralFilter, rhs: Tensor) -> Tensor:
        """:math:`f_t(\\mathbf K)` ``rhs`` for every filter; returns ``(*, F, N, r)``.

        A resolvent with several distinct shifts goes through :meth:`multishift_solve`. A
        data-centric chain of :math:`T \\ge 2` steps first times one deflated solve for the
        smallest shift (``n`` iterations), then tries :meth:`krylov_apply` within a budget of
        :math:`(T - 1)\\,n / 2` iterations (if that is at least 16), and solves step by step only
        if that is not enough. The failed attempt costs at most about half of the chain's own
        cost, and the chain reuses the timed solve when its first step has the smallest noise;
        a long chain on a hard spectrum costs about one solve instead of :math:`T`.

        This choice is the engine's own, not a backend policy: both ways give the same filters to
        ``tol`` within the same memory, and only the measured solve can tell which is faster.
        """
        filt = filt.to(self.dtype, self.ritz_vectors.device)  # a schedule made on the CPU, say
        if filt.is_resolvent:
            if torch.unique(filt.noise).numel() > 1:
                return self.multishift_solve(filt.noise, rhs.to(self.dtype))
            return super().apply(filt, rhs)
        if filt.num_filters > 1:
            self.solve(filt.noise.min(), rhs.to(self.dtype))
            # the timed solve's iterations, also when it came from the reuse cache
            budget = (filt.num_filters - 1) * self._solve_iterations // 2
            if budget >= 2 * _FIRST_CHECK:  # the stopping rule needs two checkpoints
                out, estimate = self._krylov_apply(filt, rhs, budget)
                if estimate <= self.tol:
                    self.krylov_error_estimate = max(self.krylov_error_estimate, estimate)
                    return out
        return super().apply(filt, rhs)

    def krylov_apply(self, filt: SpectralFilter, rhs: Tensor) -> Tensor:
        r""":math:`f_t(\mathbf K)\mathbf B` for every filter of the stack from one Lanczos run.

        A data-centric chain of :math:`T` steps costs :math:`T` solves, each waiting for the
        previous one. Instead, as in :meth:`multishift_solve`, the resolved Ritz pairs
        :math:`(d_i, \mathbf v_i)` split off exactly, and on the complement
        :math:`\mathbf b_\perp = (\mathbf I - \mathbf V\mathbf V^\top)\mathbf b` of each
        column, Lanczos with full reorthogonalisation builds an orthonormal basis
        :math:`\mathbf Q_k` and the tridiagonal :math:`\mathbf T_k = \mathbf Q_k^\top
        \mathbf K_\perp \mathbf Q_k`, so that every filter follows from one small
        eigendecomposition :math:`\mathbf T_k = \mathbf S\boldsymbol\Theta\mathbf S^\top`:

        .. math::
            f_t(\mathbf K)\mathbf b \approx \mathbf V f_t(\mathbf D)\mathbf V^\top\mathbf b
            + \lVert\mathbf b_\perp\rVert\,\mathbf Q_k \mathbf S f_t(\boldsymbol\Theta)
            \mathbf S^\top \mathbf e_1 .

        This is exact for polynomials of degree below :math:`k`. The filters are rational with
        poles at :math:`-\gamma_t \le -\gamma_0 < 0`, so it converges about as fast as CG
        without a preconditioner for the smallest shift, in about
        :math:`\sqrt{1 + \lambda_{r+1}/\gamma_0}` iterations (times a logarithm of the
        accuracy) for :math:`r` resolved pairs, whatever :math:`T`. Unresolved Ritz pairs cannot
        help here as they help CG as a preconditioner, so :meth:`apply` chooses between this and
        the step-by-step chain.

        **Stopping rule** (a posteriori). At checkpoints :math:`k' < k` the coefficient vectors
        :math:`\mathbf c^{(k)}_t = \lVert\mathbf b_\perp\rVert \mathbf S f_t(\boldsymbol\Theta)
        \mathbf S^\top\mathbf e_1` are compared; as :math:`\mathbf Q_k` is orthonormal,
        :math:`\lVert\mathbf c^{(k)}_t - \mathbf c^{(k')}_t\rVert` is the exact distance
        between the two approximations, an estimate of the error of the older one. A column stops
        once this is at most ``tol`` times :math:`\lVert f_t(\mathbf K)\mathbf b\rVert` for every
        filter, or when its Krylov space is exhausted: :math:`\beta_k \le 100\,\varepsilon
        \max_j|\alpha_j|`, after which the estimate is 0. The estimate counts truncation only:
        rounding limits any solver's relative error to about :math:`\varepsilon\,(\lambda_{\max}
        + \gamma_0)/\gamma_0`, and at exhaustion the neglected :math:`\beta_k` leaves an error of
        that order (float64, :math:`\gamma_0 = 10^{-4}`: 2e-8, as far from the dense solution as
        a step-by-step LU chain is from an eigendecomposition). If ``max_iter`` iterations do not
        get there, it warns with a ``NumericalWarning``; the estimate reached is kept in
        :attr:`krylov_error_estimate`.

        Memory: the basis, ``k`` vectors of length ``N`` per column.

        :param filt: any filter of the data-centric family, shape ``(*s, T)``.
        :param rhs: :math:`\mathbf B`, shape ``(*b, N, r)``.
        :return: shape ``(*broadcast(s, b), T, N, r)``.
        """
        out, estimate = self._krylov_apply(filt, rhs, self.max_iter)
        self.krylov_error_estimate = max(self.krylov_error_estimate, estimate)
        if estimate > self.tol:
            warn(
                f"Lanczos for the data-centric chain reached an estimated relative error of "
                f"{estimate:.3g} after {self.last_iterations} iterations, above "
                f"tol={self.tol:.3g}; raise max_iter",
                NumericalWarning,
            )
        return out

    def _krylov_apply(
        self, filt: SpectralFilter, rhs: Tensor, max_iter: int
    ) -> tuple[Tensor, float]:
        """:meth:`krylov_apply` within ``max_iter`` iterations; also returns its error estimate."""
        filt = filt.to(self.dtype, self.ritz_vectors.device)
        with torch.no_grad():
            d, v, z, b = self._split_resolved(rhs.to(self.dtype))
            # shape: (*bc, T, N, r) with *bc the schedules' batch broadcast against *kb
            exact = v.unsqueeze(-3) @ (filt.values(d).unsqueeze(-1) * z.unsqueeze(-3))
            b = b.movedim(-1, 0).unsqueeze(-1)  # each column a batch entry: (r, *kb, N, 1)
            basis, coefficients, estimate = self._lanczos(b, v, filt, exact, max_iter)
            basis = _columns_before_schedules(basis, filt, 2)  # shape: (r, *1, *kb, N, k)
            # shape: (r, *bc, T, N) -> (*bc, T, N, r)
            complement = (basis.unsqueeze(-3) @ coefficients.unsqueeze(-1)).squeeze(-1)
            complement = complement.movedim(0, -1)
            if v.shape[-1]:
                # The basis drifts into the span of the split-off pairs by rounding; K multiplies
                # that drift by their (largest) eigenvalues, and small shifts make the solution
                # large: a true residual of 1.5e-7 where the basis alone reached 5e-12.
                vt = v.unsqueeze(-3)  # shape: (*kb, 1, N, p)
                complement = complement - vt @ (vt.mT @ complement)
        return exact + complement, estimate

    def _lanczos(self, b: Tensor, v: Tensor, filt: SpectralFilter, exact: Tensor, max_iter: int):
        """Lanczos on the complement of ``v`` from ``b`` ``(r, *kb, N, 1)`` until every filter
        has converged; returns the basis ``(r, *kb, N, k)``, the coefficients ``(r, *bc, T, k)``
        of every filter in it and the error estimate."""
        operator = self._complement_operator(v, None)
        tiny = torch.finfo(self.dtype).tiny
        b_norm = torch.linalg.vector_norm(b, dim=-2).squeeze(-1)  # shape: (r, *kb)
        _raise_if_not_finite(b_norm)
        q = b / b_norm.clamp_min(tiny)[..., None, None]
        # shape: (r, *bc, T): the norm of each filter's resolved part, per column
        exact_norm = torch.linalg.vector_norm(exact, dim=-2).movedim(-1, 0)
        max_k = min(max_iter, self.size)
        capacity = min(64, max_k)
        basis = q.new_zeros(*q.shape[:-1], capacity)
        alphas, betas = _Record(max_k), _Record(max_k)
        scale = torch.zeros_like(b_norm)  # the largest |alpha| so far: a scale for ||K_perp||
        exhausted = b_norm == 0
        previous, next_check, estimate = None, min(_FIRST_CHECK, max_k), math.inf
        k = 0
        while k < max_k:
            if k == capacity:
                capacity = min(2 * capacity, max_k)
                grown = basis.new_zeros(*basis.shape[:-1], capacity)
                grown[..., :k] = basis
                basis = grown
            basis[..., k : k + 1] = q
            kept = basis[..., : k + 1]
            w = operator(q)
            h = kept.mT @ w  # shape: (r, *kb, k + 1, 1)
            w.sub_(kept @ h)
            w.sub_(kept @ (kept.mT @ w))  # full reorthogonalisation: twice is enough
            alpha = h[..., k, 0]
            beta = torch.linalg.vector_norm(w, dim=-2).squeeze(-1)
            scale = torch.maximum(scale, alpha.abs())
            # A vanishing beta means the Krylov space is invariant: the result is exact.
            exhausted = exhausted | (beta <= 100 * torch.finfo(self.dtype).eps * scale)
            beta = beta.where(~exhausted, 0.0)
            alphas.append(alpha)
            betas.append(beta)
            q = w.mul_((1.0 / beta.where(beta > 0, 1.0) * (beta > 0))[..., None, None])
            k += 1
            if k < next_check:
                continue
            _raise_if_not_finite(beta)
            coefficients = self._lanczos_coefficients(
                filt, alphas.values, betas.values[:-1], b_norm
            )
            done = _columns_before_schedules(exhausted, filt, 0).unsqueeze(-1)
            if k >= self.size or bool(done.all()):
                estimate = 0.0
                break
            if previous is not None:
                gap = coefficients.shape[-1] - previous.shape[-1]
                change = coefficients - torch.nn.functional.pad(previous, (0, gap))
                total = (coefficients.square().sum(-1) + exact_norm.square()).sqrt()
                relative = torch.linalg.vector_norm(change, dim=-1) / total.clamp_min(tiny)
                estimate = float(relative.where(~done, 0.0).max())
                if estimate <= self.tol:
                    break
            previous = coefficients
            next_check = min(k + max(8, k // 4), max_k)
        self.last_iterations = k
        return basis[..., :k], coefficients, estimate

    def _lanczos_coefficients(
        self, filt: SpectralFilter, alphas: Tensor, betas: Tensor, b_norm: Tensor
    ) -> Tensor:
        r""":math:`\lVert\mathbf b\rVert\mathbf S f_t(\boldsymbol\Theta)\mathbf S^\top\mathbf e_1`
        for the tridiagonal of ``alphas`` ``(k, r, *kb)`` and ``betas`` ``(k - 1, r, *kb)``;
        returns ``(r, *bc, T, k)``."""
        tri = torch.diag_embed(alphas.movedim(0, -1))  # shape: (r, *kb, k, k)
        if len(betas):
            off = torch.diag_embed(betas.movedim(0, -1), offset=1)
            tri = tri + off + off.mT
        theta, vectors = torch.linalg.eigh(tri)
        theta = _columns_before_schedules(theta, filt, 1)  # shape: (r, *1, *kb, k)
        vectors = _columns_before_schedules(vectors, filt, 2)
        norm = _columns_before_schedules(b_norm, filt, 0)
        values = filt.values(theta.clamp_min(0.0))  # shape: (r, *bc, T, k)
        weights = values * vectors[..., 0, :].unsqueeze(-2)
        out = (vectors.unsqueeze(-3) @ weights.unsqueeze(-1)).squeeze(-1)
        return out * norm[..., None, None]

    def multishift_solve(self, noise: Tensor, rhs: Tensor) -> Tensor:
        r""":math:`(\mathbf K + \gamma_t\mathbf I)^{-1}\mathbf B` for every shift, from one CG run.

        The resolved Ritz pairs split off exactly, as in :meth:`multishift_quad_diag`; on the
        complement, CG for the smallest shift :math:`\gamma_0` carries along the iterates of
        every other shift (multi-shift CG, Jegerlehner 1996): their residuals are the base
        residual scaled by :math:`\zeta_t`, with :math:`|\zeta_t| \le 1` for
        :math:`\gamma_t \ge \gamma_0`, so they stop no later than the base system does, at
        relative residual ``tol``. Memory: two ``N x r`` blocks per shift.

        :param noise: shifts, shape ``(*s, T)``.
        :param rhs: :math:`\mathbf B`, shape ``(*b, N, r)``.
        :return: shape ``(*broadcast(s, b), T, N, r)``.
        """
        gamma0 = noise.min()
        with torch.no_grad():
            d, v, z, b = self._split_resolved(rhs)
            shifts = noise[..., :, None, None]  # shape: (*s, T, 1, 1)
            exact = v.unsqueeze(-3) @ (z.unsqueeze(-3) / (d[..., None, :, None] + shifts))
            delta = shifts - gamma0  # shape: (*s, T, 1, 1)
            shifted = self._complement_operator(v, gamma0)
            norm2 = (b * b).sum(-2, keepdim=True)  # shape: (*b, 1, r)
            threshold = self.tol**2 * norm2
            r, p, rr = b.clone(), b.clone(), norm2
            x_t = torch.zeros_like(exact)
            p_t = b.unsqueeze(-3).expand_as(exact).clone()
            zeta_old = zeta = torch.ones_like(delta * norm2.unsqueeze(-3))  # (*sb, T, 1, r)
            alpha_old, beta_old = torch.ones_like(norm2), torch.zeros_like(norm2)
            iterations = 0
            while iterations < self.max_iter:
                active = rr > threshold
                if not bool(active.any()):
                    break
                q = shifted(p)
                pq = (p * q).sum(-2, keepdim=True)
                active = active & (pq > 0)
                alpha = torch.where(active, rr / pq.where(pq > 0, 1.0), 0.0)
                a, a_old = alpha.unsqueeze(-3), alpha_old.unsqueeze(-3)
                b_old = beta_old.unsqueeze(-3)
                denom = a * b_old * (zeta_old - zeta) + zeta_old * a_old * (1.0 + delta * a)
                # zeta underflows to 0 once a shifted system has converged far below tol
                live = active.unsqueeze(-3) & (zeta != 0) & (denom != 0)
                zeta_new = torch.where(live, zeta * zeta_old * a_old / denom.where(live, 1.0), 0.0)
                zeta_new = torch.where(active.unsqueeze(-3), zeta_new, zeta)
                ratio = torch.where(live, zeta_new / zeta.where(live, 1.0), 0.0)
                x_t.addcmul_(p_t, a * ratio)
                r.addcmul_(q, alpha, value=-1.0)
                del q
                rr_new = (r * r).sum(-2, keepdim=True)
                beta = torch.where(active, rr_new / rr.where(rr > 0, 1.0), 0.0)
                # where live: p_t <- zeta_new r + ratio^2 beta p_t; elsewhere p_t stays
                p_t.mul_(torch.where(live, ratio.square() * beta.unsqueeze(-3), 1.0))
                p_t.addcmul_(r.unsqueeze(-3), zeta_new.where(live, 0.0))
                p = p.mul_(beta).add_(r)
                zeta_old, zeta = zeta, zeta_new
                alpha_old = torch.where(active, alpha, alpha_old)
                beta_old = torch.where(active, beta, beta_old)
                rr = rr_new
                iterations += 1
            self.last_iterations = iterations
            self._check_multishift(rr, norm2)
        return exact + x_t

    def cross(self, filt: SpectralFilter, left: Tensor, rhs: Tensor) -> Tensor:
        r""":math:`\mathbf C^\top f_t(\mathbf K)\mathbf B`; returns ``(*, F, M, r)``.

        For a resolvent with ``left is rhs`` (predictive covariances), the form of
        :meth:`_resolvent_quad_diag` extended to every pair of columns: from the iterates
        :math:`\hat{\mathbf X}` and residuals :math:`\mathbf R = \mathbf C - \mathbf A
        \hat{\mathbf X}`,

        .. math::
            \mathbf C^\top\mathbf A^{-1}\mathbf C = \tfrac12\big(\hat{\mathbf X}^\top
            (\mathbf C + \mathbf R) + (\mathbf C + \mathbf R)^\top\hat{\mathbf X}\big)
            + \mathbf R^\top\mathbf A^{-1}\mathbf R ,

        symmetric, with a positive semi-definite error of second order (its diagonal is the
        quadratic forms' error); the plain :math:`\mathbf C^\top\hat{\mathbf X}` errs at first
        order, and the diagonal of a covariance made from it would disagree with the variances
        (at noise :math:`10^{-6}`, ``tol`` :math:`= 10^{-6}`: 9.4e-2 off against 3.1e-2). Costs one more
        product with :math:`\mathbf K` for the residuals of each distinct shift.
        """
        if not (filt.is_resolvent and left is rhs):
            return super().cross(filt, left, rhs)
        left = left.to(self.dtype)
        filt = filt.to(self.dtype, left.device)
        x = self.apply(filt, left)  # shape: (*, T, N, M)

        def symmetric_form(t: int, g: Tensor) -> Tensor:
            xt = x[..., t, :, :]  # shape: (*, N, M)
            corrected = 2 * left - self._kernel_matmul(xt) - g[..., None, None] * xt  # C + R
            half = xt.mT @ corrected
            return 0.5 * (half + half.mT)

        with torch.no_grad():  # one residual per distinct shift (a constant noise: one)
            return torch.stack(per_distinct_shift(filt.noise, symmetric_form), dim=-3)

    def quad_diag(self, filt: SpectralFilter, left: Tensor) -> Tensor:
        r""":math:`\operatorname{diag}(\mathbf C^\top f_t(\mathbf K)\mathbf C)`; ``(*, F, M)``.

        A resolvent with several distinct shifts (the variances of a changing noise schedule)
        goes through :meth:`multishift_quad_diag`: one Krylov run serves every shift.
        """
        filt = filt.to(self.dtype, self.ritz_vectors.device)
        if filt.is_resolvent and torch.unique(filt.noise).numel() > 1:
            return self.multishift_quad_diag(filt.noise, left.to(self.dtype))
        return super().quad_diag(filt, left)

    def multishift_quad_diag(self, noise: Tensor, left: Tensor) -> Tensor:
        r""":math:`\mathbf c^\top(\mathbf K + \gamma_t\mathbf I)^{-1}\mathbf c` for every shift and
        column, by one CG run and Gauss quadrature.

        The resolved Ritz pairs :math:`(d_i, \mathbf v_i)` split off exactly; on the complement
        :math:`\mathbf c_\perp = (\mathbf I - \mathbf V\mathbf V^\top)\mathbf c`, CG on
        :math:`\mathbf K_\perp + \gamma_0\mathbf I` with the smallest shift :math:`\gamma_0`
        yields the Lanczos tridiagonal :math:`\mathbf T_k` (from its step sizes :math:`\alpha_j`
        and :math:`\beta_j`), and since Krylov spaces do not change under shifts,

        .. math::
            \mathbf c^\top(\mathbf K + \gamma\mathbf I)^{-1}\mathbf c \approx
            \sum_i \frac{(\mathbf v_i^\top\mathbf c)^2}{d_i + \gamma}
            + \lVert\mathbf c_\perp\rVert^2\,
            \mathbf e_1^\top\big(\mathbf T_k + (\gamma - \gamma_0)\mathbf I\big)^{-1}\mathbf e_1 ,

        the last term a continued fraction. Each column stops when its residual
        :math:`\mathbf r_0` for :math:`\gamma_0` is below ``tol``
        :math:`\lVert\mathbf c_\perp\rVert`. In exact arithmetic the quadrature is the shifted
        CG iterate's :math:`\mathbf c_\perp^\top\hat{\mathbf x}_t` (in floating point it agrees
        with the second-order :math:`\hat{\mathbf x}_t^\top(\mathbf c_\perp + \mathbf r_t)`),
        short of the complement's true form by :math:`\mathbf r_t^\top(\mathbf K_\perp +
        \gamma\mathbf I)^{-1}\mathbf r_t \le \lVert\mathbf r_0\rVert^2/\gamma_0` (the residual
        of shift :math:`\gamma` is :math:`\zeta_t\mathbf r_0`, :math:`|\zeta_t| \le 1`), at most
        :math:`\text{tol}^2\lVert\mathbf c_\perp\rVert^2/\gamma_0` for every
        :math:`\gamma \ge \gamma_0` (:math:`\mathbf r_0` the recursion's residual). That bound
        is kept in :attr:`quad_error_bound`; it leaves out the split-off pairs, whose error is of
        first order in their residuals (below ``tol`` :math:`\gamma_0` by the contract of
        ``resolved``) and of either sign: at most about 1e-9 of forms near 1 over 54 measured
        settings, far below what the distillers warn about. Memory stays at a few ``N x M``
        blocks, whatever the number of shifts.

        :param noise: shifts, shape ``(*s, T)``.
        :param left: :math:`\mathbf C`, shape ``(*b, N, M)``.
        :return: shape ``(*broadcast(s, b), T, M)``.
        """
        with torch.no_grad():
            d, v, z, complement = self._split_resolved(left)
            shifts = noise[..., :, None, None]  # shape: (*s, T, 1, 1)
            exact = (z.square().unsqueeze(-3) / (d[..., None, :, None] + shifts)).sum(-2)
            gamma0 = noise.min()
            alphas, betas, actives, norm2, rr = self._complement_cg(complement, v, gamma0)
            delta = (noise - gamma0)[..., :, None]  # shape: (*s, T, 1)
            fraction = torch.ones_like(exact)
            for j in range(len(alphas) - 1, -1, -1):  # continued fraction, from the bottom
                alpha, active = alphas[j], actives[j]
                safe = alpha.where(active, 1.0)
                diag = 1.0 / safe
                if j > 0:
                    diag = diag + betas[j - 1] / alphas[j - 1].where(actives[j - 1], 1.0)
                diag = diag.where(active, 1.0).unsqueeze(-2) + delta  # shape: (*, T, M)
                if j + 1 < len(alphas):
                    couple = (betas[j] / safe.square()).where(actives[j + 1], 0.0)
                    diag = diag - couple.unsqueeze(-2) / fraction
                fraction = diag
            complement = norm2.unsqueeze(-2) / fraction if len(alphas) else torch.zeros_like(exact)
            out = exact + complement
            # shape: (*b, M) -> (*broadcast(s, b), T, M)
            self.quad_error_bound = (rr / gamma0).unsqueeze(-2).expand_as(out)
        return out

    def _complement_cg(self, b: Tensor, v: Tensor, gamma0: Tensor):
        r"""CG on :math:`(\mathbf K_\perp + \gamma_0\mathbf I)\mathbf x = \mathbf b`; returns the
        step sizes, the activity masks per iteration, :math:`\lVert\mathbf b\rVert^2` and the
        final squared residual norms."""
        shifted = self._complement_operator(v, gamma0)
        norm2 = (b * b).sum(-2)  # shape: (*b, M)
        threshold = self.tol**2 * norm2
        r, p, rr = b.clone(), b.clone(), norm2
        alphas, betas, actives = (_Record(self.max_iter) for _ in range(3))
        while len(alphas) < self.max_iter:
            active = rr > threshold
            if not bool(active.any()):
                break
            q = shifted(p)
            pq = (p * q).sum(-2)
            active = active & (pq > 0)
            alpha = torch.where(active, rr / pq.where(pq > 0, 1.0), 0.0)
            r.addcmul_(q, alpha.unsqueeze(-2), value=-1.0)
            del q
            rr_new = (r * r).sum(-2)
            beta = torch.where(active, rr_new / rr.where(rr > 0, 1.0), 0.0)
            p = p.mul_(beta.unsqueeze(-2)).add_(r)
            alphas.append(alpha)
            betas.append(beta)
            actives.append(active)
            rr = rr_new
        self.last_iterations = len(alphas)
        self._check_multishift(rr, norm2)
        return alphas.values, betas.values, actives.values, norm2, rr

    def _split_resolved(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The resolved Ritz values ``d`` ``(*b, p)`` and vectors ``V`` ``(*b, N, p)``, ``V^T x``
        and the complement ``x - V V^T x`` of ``x`` ``(*b, N, r)``. The ``p`` columns are those
        resolved in some batch entry (zeroed in the entries where they are not), so that no
        product is spent on pairs that no entry splits off."""
        flat = self.resolved.flatten(0, -2) if self.resolved.dim() > 1 else self.resolved[None]
        some = flat.any(0)  # shape: (q,)
        resolved = self.resolved[..., some]
        d = self.ritz_values[..., some] * resolved
        v = self.ritz_vectors[..., some] * resolved.unsqueeze(-2)
        z = v.mT @ x  # shape: (*b, q, r)
        return d, v, z, x - v @ z

    def _complement_operator(self, v: Tensor, gamma0: Tensor | None):
        """``x -> (P K + gamma0 I) x`` with :math:`\\mathbf P = \\mathbf I - \\mathbf V\\mathbf V^\\top`,
        which is :math:`\\mathbf K_\\perp + \\gamma_0\\mathbf I` on the complement of ``v``
        (no shift for ``None``)."""

        def shifted(x: Tensor) -> Tensor:
            kx = self._kernel_matmul(x)  # updated in place: see _conjugate_gradients
            if v.shape[-1]:  # with no pair resolved there is nothing to project out
                kx.sub_(v @ (v.mT @ kx))
            return kx if gamma0 is None else kx.addcmul_(x, gamma0)

        return shifted

    def _check_multishift(self, rr: Tensor, norm2: Tensor) -> None:
        """Raise on a non-finite residual; warn if the base system stopped above ``tol``."""
        _raise_if_not_finite(rr)
        relative = (rr / norm2.clamp_min(torch.finfo(self.dtype).tiny)).sqrt()
        worst = float(relative.max()) if relative.numel() else 0.0
        if worst > self.tol:
            warn(
                f"multi-shift conjugate gradients reached a relative residual of {worst:.3g} "
                f"after {self.last_iterations} iterations, above tol={self.tol:.3g}; raise "
                "rank= or max_iter",
                NumericalWarning,
            )

    # ------------------------------------------------------------------ interface
    def trace(self, filt: SpectralFilter) -> Tensor:
        """Not available exactly: it would take N solves (:meth:`trace_estimate` estimates it)."""
        raise ValueError(
            "the exact trace of a filter would take N conjugate-gradient solves on the CG "
            "backend; trace_estimate() estimates it from probe vectors (gcv() uses that)"
        )

    def trace_estimate(
        self, filt: SpectralFilter, num_probes: int, generator: torch.Generator
    ) -> tuple[Tensor, Tensor]:
        r""":math:`\operatorname{tr} f_t(\mathbf K)` by Hutchinson's estimator deflated with the
        Ritz vectors, and its standard error; both ``(*, F)``.

        For the :math:`q` orthonormal Ritz vectors :math:`\mathbf V` of the deflation,
        :math:`\mathbf P_\perp = \mathbf I - \mathbf V\mathbf V^\top` and :math:`c_0 = f(0)`,

        .. math::
            \operatorname{tr} f(\mathbf K) = \sum_{i=1}^{q} \mathbf v_i^\top f(\mathbf K)
            \mathbf v_i + c_0 (N - q)
            + \operatorname{tr}\big(\mathbf P_\perp (f(\mathbf K) - c_0\mathbf I)
            \mathbf P_\perp\big)

        holds for any orthonormal :math:`\mathbf V`. A resolved pair's form is
        :math:`f(\theta_i)`; the others are computed by solves (:meth:`apply` on those Ritz
        vectors). The last term is estimated by :math:`\frac1m\sum_i \mathbf z_{\perp i}^\top
        f(\mathbf K)\mathbf z_{\perp i} - c_0\lVert\mathbf z_{\perp i}\rVert^2` over
        Rademacher vectors :math:`\mathbf z_i`, :math:`\mathbf z_{\perp i} = \mathbf P_\perp
        \mathbf z_i`. This is Hutch++ with the Krylov space of the deflation in place of a
        random sketch: the part of the spectrum the Ritz vectors capture, where the filters of
        the steps differ most, is taken exactly, and what is left to chance is
        :math:`f - c_0` on the eigenvalues below them (for the residual filters of GCV a
        multiple of the smoother, small where the noise exceeds those eigenvalues). The solves
        run in chunks of columns, about :math:`T + 64` vectors of length :math:`N` per column
        within :math:`N` times :class:`gpsd.settings.test_chunk_size` (a chunk of test
        points' memory); their tolerance adds at most about ``tol``
        :math:`\lVert f\rVert N` to the value.
        """
        num_probes = check_int(num_probes, "num_probes", minimum=2)  # before any solve
        filt = filt.to(self.dtype, self.ritz_vectors.device)
        v = self.ritz_vectors  # shape: (*b, N, q)
        resolved = self.resolved.to(v.device)
        c0 = filt.series(0)[..., 0]  # shape: (*s, F)
        vectors = filt.num_filters + 64  # the filtered columns, the solves' blocks and basis

        def forms(columns: Tensor) -> Tensor:  # (*b, N, c) -> (*, F, c)
            chunk = columns_per_chunk(vectors)
            out = []
            for start in range(0, columns.shape[-1], chunk):
                part = columns[..., start : start + chunk]
                out.append((part.unsqueeze(-3) * self.apply(filt, part)).sum(-2))
            return torch.cat(out, dim=-1)

        with torch.no_grad():
            # shape: (*, F): f(theta_i) summed over the resolved pairs
            captured = (filt.values(self.ritz_values) * resolved.unsqueeze(-2)).sum(-1)
            # shape: (q,): the pairs unresolved in some batch entry, whose forms take solves
            open_pairs = (~resolved).flatten(0, -2).any(0) if resolved.dim() > 1 else ~resolved
            unresolved = v[..., open_pairs] * (~resolved[..., open_pairs]).unsqueeze(-2)
            probes = rademacher(self.size, num_probes, generator, self.dtype, v.device)
            projected = probes - v @ (v.mT @ probes)  # shape: (*b, N, m)
            projected = projected.expand(*v.shape[:-2], *projected.shape[-2:])
            # one set of solves for the Ritz vectors and the probes side by side
            both = forms(torch.cat([unresolved, projected], dim=-1))  # shape: (*, F, p + m)
            squares = projected.square().sum(-2).unsqueeze(-2)  # shape: (*b, 1, m)
            samples = both[..., unresolved.shape[-1] :] - c0.unsqueeze(-1) * squares
            value, error = sample_mean(samples)
            exact = captured + both[..., : unresolved.shape[-1]].sum(-1)
            exact = exact + c0 * (self.size - v.shape[-1])
        return exact + value, error

    def error_estimate(self, gamma_min: float) -> float:
        """The relative residual every solve is run to (see the class docstring for its meaning),
        or the larger residual or Lanczos error estimate actually reached."""
        return max(self.tol, self.max_relative_residual, self.krylov_error_estimate)


class _Record:
    """Per-iteration values of one shape, kept in one preallocated tensor that doubles when full.

    A list of small tensors, one per iteration, would scatter long-lived small allocations over
    the large blocks that the iterations free, so that the C allocator cannot reuse them.
    """

    def __init__(self, max_len: int) -> None:
        self._max_len = max_len
        self._data: Tensor | None = None
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def append(self, value: Tensor) -> None:
        if self._data is None:
            self._data = value.new_empty(min(64, self._max_len), *value.shape)
        elif self._len == self._data.shape[0]:
            grown = self._data.new_empty(min(2 * self._len, self._max_len), *value.shape)
            grown[: self._len] = self._data
            self._data = grown
        self._data[self._len] = value
        self._len += 1

    @property
    def values(self) -> Tensor:
        """The values so far, stacked along a new leading dimension (a view; empty before the
        first)."""
        return self._data[: self._len] if self._data is not None else torch.empty(0)


def _raise_if_not_finite(residual: Tensor) -> None:
    """A NaN or inf residual means the answer is worthless: raise rather than return it."""
    if not bool(torch.isfinite(residual).all()):
        raise ValueError(
            "conjugate gradients produced a non-finite residual: the kernel operator returned "
            "NaN or inf, or K + noise I is not positive definite"
        )


def _columns_before_schedules(x: Tensor, filt: SpectralFilter, core_dims: int) -> Tensor:
    """Insert singleton dimensions after the leading column dimension of ``x``
    (``(r, *kb, *core)``) so that a filter's schedule batch ``*s`` broadcasts against ``*kb``
    and never against the columns."""
    batch = x.dim() - 1 - core_dims
    pad = max(0, filt.noise.dim() - 1 - batch)
    return x.reshape(x.shape[0], *[1] * pad, *x.shape[1:])
