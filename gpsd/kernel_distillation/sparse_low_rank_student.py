"""The distilled student of kernel distillation: fast prediction with a sparse low-rank kernel."""

from __future__ import annotations

import copy
import math
import numbers

import gpytorch
import torch
from gpytorch.distributions import MultivariateNormal
from torch import Tensor

from gpsd import settings
from gpsd._internal.distances import squared_distances
from gpsd._internal.stationary_kernel import (
    STATIONARY_KERNEL_TYPES,
    check_lengthscale_count,
    evaluate_kernel,
    stationary_kernel_from_squared_distance,
    stationary_kernel_parameters,
)
from gpsd._internal.validation import (
    as_float_tensor,
    check_finite,
    check_gp_modules,
    check_int,
    check_matrix,
    check_vector,
)
from gpsd._internal.variance import nonnegative_variance
from gpsd.prediction import Prediction

__all__ = ["SparseLowRankStudent"]

_DEFAULT_JITTER = {
    torch.float64: 1e-10,
    torch.float32: 1e-6,
    torch.float16: 1e-3,
    torch.bfloat16: 1e-2,
}


def _one_positive_variance(noise: float | Tensor, dtype: torch.dtype) -> Tensor:
    """``noise`` as a detached 0-d tensor, checked to be one positive finite variance."""
    value = as_float_tensor(noise, "noise", dtype=dtype).detach().reshape(-1)
    if value.numel() != 1 or not bool(value > 0) or not bool(value.isfinite().all()):
        raise ValueError(f"noise must be one positive variance (finite), got {noise!r}")
    return value.reshape(())


def _jitter_or_none(jitter: object) -> float | None:
    """``None`` or a finite float ``>= 0``, or a ``ValueError`` naming ``jitter``."""
    if jitter is None:
        return None
    if isinstance(jitter, bool) or not isinstance(jitter, numbers.Real):
        raise ValueError(f"jitter must be a finite float >= 0 or None, got {jitter!r}")
    if not (math.isfinite(jitter) and jitter >= 0):
        raise ValueError(f"jitter must be a finite float >= 0 or None, got {jitter!r}")
    return float(jitter)


def _one_finite_number(mean_constant: float | Tensor, dtype: torch.dtype) -> Tensor:
    """``mean_constant`` as a detached 0-d tensor, checked to be one finite number."""
    value = as_float_tensor(mean_constant, "mean_constant", dtype=dtype).detach().reshape(-1)
    if value.numel() != 1 or not bool(value.isfinite().all()):
        raise ValueError(f"mean_constant must be one finite number, got {mean_constant!r}")
    return value.reshape(())


class SparseLowRankStudent(gpytorch.Module):
    r"""A GP regression student whose kernel matrix is :math:`\tilde K = W K_{UU} W^\top`.

    Song & Sun (§2, "Fast prediction"): with the teacher's noise :math:`\sigma^2` and
    :math:`\tilde K_{XX} = W K_{UU} W^\top` the student stores only the ``m`` inducing points and

    .. math::
        \tilde\alpha = K_{UU} W^\top (\tilde K_{XX} + \sigma^2 I)^{-1} (y - \mu), \qquad
        V = K_{UU} W^\top (\tilde K_{XX} + \sigma^2 I)^{-1} W K_{UU},

    an ``m``-vector and an ``m x m`` matrix (plus :math:`K_{UU}`), :math:`O(m^2)` storage. For a
    test input :math:`x_\star` the sparse row :math:`w_\star` has ``b`` non-zeros at the ``b``
    nearest inducing points :math:`J_\star`, where it solves the ``b x b`` system
    :math:`w_\star(J_\star)\, K_{UU}(J_\star, J_\star) = k(x_\star, U_{J_\star})`, and

    .. math::
        \mathbb E[f_\star] = \mu + w_\star \tilde\alpha, \qquad
        \operatorname{Var}[f_\star] = k(x_\star, x_\star) - w_\star V w_\star^\top,

    :math:`O(m d + b^3)` per point with the exact neighbour search used here (the paper's KD-tree
    gives :math:`O(b \log m + b^3)` on a CPU).

    Build one with :class:`~gpsd.KernelDistillation` (``KernelDistillation(teacher, ...).fit()
    .student``) or :meth:`from_sparse_weights`; the constructor takes the precomputed
    quantities, so that a student of the same shapes can be created and filled with
    :meth:`load_state_dict`. :meth:`predict` returns a :class:`~gpsd.Prediction` (latent;
    ``include_noise=True`` adds :math:`\sigma^2`), ``student(test_x)`` a GPyTorch
    ``MultivariateNormal`` with a diagonal covariance.

    The prediction path (:meth:`prediction_module`) exports with ``torch.export`` when the kernel is
    an RBF or Matérn (:math:`\nu \in \{1/2, 3/2, 5/2\}`) kernel, with one or ARD lengthscales,
    optionally inside a ``ScaleKernel``: the student then stores its hyperparameters as plain
    tensors and evaluates it itself. Any other kernel is kept as a GPyTorch module; prediction
    works, export does not.

    :param covar_module: the teacher's (trained) kernel.
    :param inducing_points: :math:`U`, shape ``(m, d)``.
    :param inducing_covariance: :math:`K_{UU}`, shape ``(m, m)``.
    :param predictive_mean_weights: :math:`\tilde\alpha`, shape ``(m,)``.
    :param predictive_covariance_correction: :math:`V`, shape ``(m, m)``.
    :param sparsity: ``b``, the non-zeros of :math:`w_\star`.
    :param noise: the teacher's noise variance :math:`\sigma^2` (kept for predictive ``y``).
    :param mean_constant: the teacher's constant prior mean :math:`\mu`.
    :param neighbour_scale: per-dimension scale of the nearest-neighbour metric, shape ``(d,)``
        (neighbours of :math:`x_\star` are searched among :math:`U` on :math:`x / s`); default 1.
    :param jitter: relative jitter added to :math:`K_{UU}(J_\star, J_\star)` (times the mean of
        the diagonal of :math:`K_{UU}`); default ``1e-10`` in float64, ``1e-6`` in float32.
    """

    def __init__(
        self,
        covar_module: gpytorch.kernels.Kernel,
        inducing_points: Tensor,
        inducing_covariance: Tensor,
        predictive_mean_weights: Tensor,
        predictive_covariance_correction: Tensor,
        *,
        sparsity: int,
        noise: float | Tensor,
        mean_constant: float | Tensor = 0.0,
        jitter: float | None = None,
        neighbour_scale: Tensor | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(covar_module, gpytorch.kernels.Kernel):
            raise TypeError(
                f"covar_module must be a gpytorch.kernels.Kernel, got {type(covar_module)}"
            )
        # buffers hold values, never an autograd graph (a graph would also defeat deepcopy)
        u = check_matrix(
            as_float_tensor(inducing_points, "inducing_points").detach(), "inducing_points"
        )
        m = u.shape[-2]
        if u.dim() != 2:
            raise ValueError(f"inducing_points must have shape (m, d), got {tuple(u.shape)}")
        kuu = as_float_tensor(inducing_covariance, "inducing_covariance", dtype=u.dtype).detach()
        v = as_float_tensor(
            predictive_covariance_correction, "predictive_covariance_correction", dtype=u.dtype
        ).detach()
        for name, mat in (("inducing_covariance", kuu), ("predictive_covariance_correction", v)):
            if mat.shape != (m, m):
                raise ValueError(f"{name} must have shape ({m}, {m}), got {tuple(mat.shape)}")
            check_finite(mat, name)
        alpha = as_float_tensor(
            predictive_mean_weights, "predictive_mean_weights", dtype=u.dtype
        ).detach()
        if alpha.shape != (m,):  # one weight per inducing point, no batch dimensions
            raise ValueError(
                f"predictive_mean_weights must have shape ({m},), got {tuple(alpha.shape)}"
            )
        check_finite(alpha, "predictive_mean_weights")
        sparsity = check_int(sparsity, "sparsity")
        if sparsity > m:
            raise ValueError(f"sparsity must be an int in [1, m={m}], got {sparsity!r}")
        noise_t = _one_positive_variance(noise, u.dtype)
        mu = _one_finite_number(mean_constant, u.dtype)
        self.sparsity = sparsity
        self.jitter = _jitter_or_none(jitter)
        # buffers are copies (the kernel's are made by stationary_kernel_parameters):
        # load_state_dict writes into them in place, which must not reach the caller's tensors
        # (nor a KernelDistillation's state)
        self.register_buffer("inducing_points", u.clone())
        if neighbour_scale is None:
            neighbour_scale = torch.ones(u.shape[-1], dtype=u.dtype, device=u.device)
        scale = as_float_tensor(neighbour_scale, "neighbour_scale", dtype=u.dtype)
        scale = scale.detach().reshape(-1).to(u)
        if (
            scale.shape != (u.shape[-1],)
            or not bool((scale > 0).all())
            or not bool(scale.isfinite().all())
        ):
            raise ValueError(f"neighbour_scale must hold d={u.shape[-1]} positive finite values")
        self.register_buffer("neighbour_scale", scale.clone())
        self.register_buffer("inducing_covariance", kuu.to(u, copy=True))
        self.register_buffer("predictive_mean_weights", alpha.to(u, copy=True))
        self.register_buffer("predictive_covariance_correction", v.to(u, copy=True))
        self.register_buffer("noise", noise_t.to(u, copy=True))
        self.register_buffer("mean_constant", mu.to(u, copy=True))
        params = stationary_kernel_parameters(covar_module)
        if params is None:
            self.kernel_type = "generic"
            # frozen copy (the teacher's kernel stays trainable), in the student's dtype and on its
            # device: a float64 kernel would otherwise give float64 cross-covariances that a
            # float32 student cannot solve with
            self.covar_module = copy.deepcopy(covar_module).to(device=u.device, dtype=u.dtype)
            for p in self.covar_module.parameters():
                p.requires_grad_(False)
        else:
            self.kernel_type, lengthscale, outputscale = params
            check_lengthscale_count(lengthscale, u.shape[-1], "inducing_points")
            self.covar_module = None
            self.register_buffer("kernel_lengthscale", lengthscale.to(u))
            self.register_buffer("kernel_outputscale", outputscale.to(u))

    # ------------------------------------------------------------------ saved state
    def get_extra_state(self) -> dict:
        """The settings that are not tensors (``sparsity``, ``jitter``, ``kernel_type``), saved in
        ``state_dict`` so that a student loaded into one built with other settings predicts as the
        saved one. (The RBF and Matérn students hold the same buffers, so without the kernel type
        a Matérn student loaded into one built with an RBF kernel would predict with the RBF.)"""
        return {"sparsity": self.sparsity, "jitter": self.jitter, "kernel_type": self.kernel_type}

    def set_extra_state(self, state: dict) -> None:
        sparsity = check_int(state["sparsity"], "sparsity")
        if sparsity > self.num_inducing:
            raise ValueError(
                f"the saved sparsity {sparsity} exceeds this student's m={self.num_inducing} "
                "inducing points"
            )
        kernel_type = state.get("kernel_type", self.kernel_type)  # absent from older states
        if kernel_type != self.kernel_type and "generic" in (kernel_type, self.kernel_type):
            raise ValueError(
                f"the saved student's kernel is {kernel_type!r} but this student's is "
                f"{self.kernel_type!r}; build the student with the same kernel type to load it"
            )
        if kernel_type not in STATIONARY_KERNEL_TYPES + ("generic",):
            raise ValueError(f"the saved kernel type {kernel_type!r} is not a known kernel type")
        self.sparsity = sparsity
        self.jitter = _jitter_or_none(state["jitter"])
        self.kernel_type = kernel_type

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_sparse_weights(
        cls,
        covar_module: gpytorch.kernels.Kernel,
        inducing_points: Tensor,
        weight_values: Tensor,
        weight_indices: Tensor,
        train_y: Tensor,
        noise: float | Tensor,
        *,
        mean_constant: float | Tensor = 0.0,
        inducing_covariance: Tensor | None = None,
        sparsity: int | None = None,
        jitter: float | None = None,
        neighbour_scale: Tensor | None = None,
    ) -> SparseLowRankStudent:
        r"""Precompute :math:`\tilde\alpha` and :math:`V` from a sparse W, :math:`O(n b^2 + m^3)`.

        With :math:`B = W^\top W` and the symmetric square root :math:`K_{UU}^{1/2}` (eigenvalues
        clamped at 0), the push-through identity
        :math:`W^\top (W K_{UU} W^\top + \sigma^2 I)^{-1} = (\sigma^2 I + B K_{UU})^{-1} W^\top`
        gives

        .. math::
            M = \sigma^2 I + K_{UU}^{1/2} B K_{UU}^{1/2}, \quad
            \tilde\alpha = K_{UU}^{1/2} M^{-1} K_{UU}^{1/2} W^\top (y - \mu), \quad
            V = K_{UU} - \sigma^2 K_{UU}^{1/2} M^{-1} K_{UU}^{1/2},

        where :math:`M \succeq \sigma^2 I` is safe to factor; no ``n x n`` matrix is formed.

        :param weight_values: non-zeros of :math:`W`, shape ``(n, b)``.
        :param weight_indices: their columns (inducing-point indices), shape ``(n, b)``.
        :param inducing_covariance: :math:`K_{UU}`; by default evaluated as
            :class:`~gpsd.KernelDistillation` evaluates it (RBF and Matérn kernels from squared
            distances accumulated in float64, others by GPyTorch), with the kernel in the inducing
            points' dtype, as the student evaluates it.
        :param sparsity: ``b`` at prediction (default: ``weight_values.shape[-1]``).
        :param neighbour_scale: see the class; it must match the metric that chose ``W``'s pattern.
        """
        check_gp_modules(covar_module, None)
        with torch.no_grad():  # the student's buffers are values: build no autograd graph
            u = check_matrix(
                as_float_tensor(inducing_points, "inducing_points").detach(), "inducing_points"
            )
            if u.dim() != 2:
                raise ValueError(f"inducing_points must have shape (m, d), got {tuple(u.shape)}")
            m = u.shape[0]
            values = check_matrix(
                as_float_tensor(
                    weight_values, "weight_values", dtype=u.dtype, device=u.device
                ).detach(),
                "weight_values",
            )
            if values.dim() != 2:
                raise ValueError(f"weight_values must have shape (n, b), got {tuple(values.shape)}")
            if not isinstance(weight_indices, Tensor):
                try:
                    weight_indices = torch.as_tensor(weight_indices)
                except (TypeError, ValueError, RuntimeError) as err:
                    raise TypeError(
                        "weight_indices must be a tensor or array-like of integer indices, got "
                        f"{type(weight_indices).__name__}"
                    ) from err
            if weight_indices.shape != values.shape:
                raise ValueError(
                    f"weight_indices must have the shape of weight_values {tuple(values.shape)}, "
                    f"got {tuple(weight_indices.shape)}"
                )
            if weight_indices.is_floating_point() or weight_indices.is_complex():
                raise TypeError(
                    f"weight_indices must hold integer indices, got dtype {weight_indices.dtype}"
                )
            idx = weight_indices.detach().to(device=u.device, dtype=torch.long)
            if idx.numel() and not (0 <= int(idx.min()) and int(idx.max()) < m):
                raise ValueError(
                    f"weight_indices must lie in [0, m={m}), got values in "
                    f"[{int(idx.min())}, {int(idx.max())}]"
                )
            n, b = values.shape
            y = as_float_tensor(train_y, "train_y", dtype=u.dtype, device=u.device).detach()
            if y.dim() != 1:
                raise ValueError(f"train_y must have shape (n={n},), got {tuple(y.shape)}")
            y = check_vector(y, "train_y", n)
            sigma2 = _one_positive_variance(noise, u.dtype).to(u.device)
            mu = _one_finite_number(mean_constant, u.dtype).to(u.device)
            if inducing_covariance is None:  # as KernelDistillation evaluates it
                on_u = copy.deepcopy(covar_module).to(device=u.device, dtype=u.dtype)
                inducing_covariance = evaluate_kernel(on_u, u, u)
            kuu = as_float_tensor(inducing_covariance, "inducing_covariance").detach().to(u)
            if kuu.shape != (m, m):
                raise ValueError(
                    f"inducing_covariance must have shape ({m}, {m}), got {tuple(kuu.shape)}"
                )
            check_finite(kuu, "inducing_covariance")
            return cls._from_checked_weights(
                covar_module, u, kuu, values, idx, y, sigma2, mu, b, sparsity, jitter,
                neighbour_scale,
            )  # fmt: skip

    @classmethod
    def _from_checked_weights(
        cls,
        covar_module,
        u,
        kuu,
        values,
        idx,
        y,
        sigma2,
        mu,
        b,
        sparsity,
        jitter,
        neighbour_scale,
    ) -> SparseLowRankStudent:
        """The body of :meth:`from_sparse_weights`, on validated, detached tensors."""
        m = u.shape[0]
        # B = W^T W, shape: (m, m)
        outer = values.unsqueeze(-1) * values.unsqueeze(-2)  # shape: (n, b, b)
        gram = torch.zeros(m * m, dtype=u.dtype, device=u.device)
        flat = (idx.unsqueeze(-1) * m + idx.unsqueeze(-2)).reshape(-1)
        gram.index_add_(0, flat, outer.reshape(-1))
        gram = gram.reshape(m, m)
        wty = torch.zeros(m, dtype=u.dtype, device=u.device).index_add_(
            0, idx.reshape(-1), (values * (y - mu).unsqueeze(-1)).reshape(-1)
        )
        evals, evecs = torch.linalg.eigh(kuu)
        root = (evecs * evals.clamp_min(0.0).sqrt().unsqueeze(-2)) @ evecs.transpose(-1, -2)
        eye = torch.eye(m, dtype=u.dtype, device=u.device)
        mat = sigma2 * eye + root @ gram @ root
        mat = 0.5 * (mat + mat.transpose(-1, -2))
        chol, info = torch.linalg.cholesky_ex(mat)
        if int(info) != 0:
            size = float(torch.linalg.matrix_norm(root @ gram @ root, ord=2))
            advice = (
                "near-coincident or duplicated inducing points give large weights W, and the "
                "noise is lost in their rounding: spread the inducing points out (K-means on "
                "distinct inputs), raise jitter, or lower num_inducing"
            )
            if u.dtype != torch.float64:
                advice += f"; or distil in float64 (now {u.dtype})"
            raise RuntimeError(
                "kernel distillation: sigma^2 I + K_UU^1/2 W^T W K_UU^1/2 is not positive "
                f"definite at working precision (sigma^2 = {float(sigma2):.3g} against a norm of "
                f"{size:.3g} for the rest); {advice}"
            )
        minv_root = torch.cholesky_solve(root, chol)  # M^{-1} K^{1/2}, shape: (m, m)
        alpha = root @ (minv_root @ wty)
        correction = kuu - sigma2 * (root @ minv_root)
        correction = 0.5 * (correction + correction.transpose(-1, -2))
        return cls(
            covar_module,
            u,
            kuu,
            alpha,
            correction,
            sparsity=b if sparsity is None else sparsity,
            noise=sigma2,
            mean_constant=mu,
            jitter=jitter,
            neighbour_scale=neighbour_scale,
        )

    # ------------------------------------------------------------------ prediction
    @property
    def num_inducing(self) -> int:
        return self.inducing_points.shape[-2]

    @property
    def exportable(self) -> bool:
        """Whether :meth:`prediction_module` can be exported (kernel stored as plain tensors)."""
        return self.kernel_type != "generic"

    def storage_bytes(self) -> int:
        """Bytes held by the student's tensors (buffers, kernel parameters): :math:`O(m^2)`."""
        tensors = list(self.buffers()) + list(self.parameters())
        return int(sum(t.nbytes for t in tensors))

    def _relative_jitter(self) -> float:
        if self.jitter is not None:
            return self.jitter
        return _DEFAULT_JITTER.get(self.inducing_points.dtype, 1e-6)

    def _cross_covariance(self, x: Tensor, neighbours: Tensor) -> tuple[Tensor, Tensor]:
        """``k(x_p, U_{J_p})`` of shape ``(p, b)`` and ``k(x_p, x_p)`` of shape ``(p,)``."""
        u_near = self.inducing_points[neighbours]  # shape: (p, b, d)
        if self.covar_module is None:
            diff = (x.unsqueeze(-2) - u_near) / self.kernel_lengthscale
            r2 = diff.pow(2).sum(-1)
            cross = stationary_kernel_from_squared_distance(
                self.kernel_type, r2, self.kernel_outputscale
            )
            diag = self.kernel_outputscale.expand(x.shape[:-1])
            return cross, diag
        # no torch.no_grad here: the frozen kernel builds no graph of its own, and the bare
        # prediction path (prediction_module) is differentiable in x as for the kernels above
        with gpytorch.settings.lazily_evaluate_kernels(False):
            cross = self.covar_module(x.unsqueeze(-2), u_near).to_dense().squeeze(-2)
            diag = self.covar_module(x, x, diag=True)
        return cross, diag

    def interpolation_weights(self, test_x: Tensor) -> tuple[Tensor, Tensor]:
        r"""The sparse rows :math:`w_\star`: ``(values, indices)``, both of shape ``(p, b)``."""
        test_x = self._check_inputs(test_x)
        with torch.no_grad():
            parts = [self._weights(rows)[:2] for rows in self._row_chunks(test_x)]
        return torch.cat([v for v, _ in parts]), torch.cat([i for _, i in parts])

    def _row_chunks(self, x: Tensor) -> tuple[Tensor, ...]:
        """``x`` split into blocks of rows whose temporaries (the ``(rows, m)`` distances and the
        ``(rows, b, b)`` local blocks) hold about :class:`gpsd.settings.max_chunk_elements`
        numbers."""
        per_row = self.num_inducing + 2 * self.sparsity**2 + self.sparsity * x.shape[-1]
        rows = max(1, settings.max_chunk_elements.value() // per_row)
        return x.split(rows) if x.shape[0] > 0 else (x,)

    def _weights(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        b = self.sparsity
        scale = self.neighbour_scale
        d2 = squared_distances(x / scale, self.inducing_points / scale)  # shape: (p, m)
        neighbours = torch.topk(d2, b, dim=-1, largest=False).indices  # shape: (p, b)
        kuu = self.inducing_covariance
        local = kuu[neighbours.unsqueeze(-1), neighbours.unsqueeze(-2)]  # shape: (p, b, b)
        scale = self._relative_jitter() * kuu.diagonal().mean()
        eye = torch.eye(b, dtype=x.dtype, device=x.device)
        cross, diag = self._cross_covariance(x, neighbours)
        try:
            values = torch.linalg.solve(local + scale * eye, cross.unsqueeze(-1)).squeeze(-1)
        except torch.linalg.LinAlgError as err:
            raise RuntimeError(
                f"kernel distillation: K_UU at a test point's {b} nearest inducing points is "
                f"singular with jitter={self.jitter} (coincident inducing points, as k-means "
                "gives when the data hold fewer distinct points than num_inducing); use a "
                "positive jitter (the default None adds 1e-10 in float64, 1e-6 in float32)"
            ) from err
        return values, neighbours, diag

    def _predict(self, x: Tensor) -> tuple[Tensor, Tensor]:
        values, neighbours, diag = self._weights(x)
        mean = self.mean_constant + (values * self.predictive_mean_weights[neighbours]).sum(-1)
        v_local = self.predictive_covariance_correction[
            neighbours.unsqueeze(-1), neighbours.unsqueeze(-2)
        ]  # shape: (p, b, b)
        quad = (values.unsqueeze(-2) @ v_local @ values.unsqueeze(-1)).squeeze(-1).squeeze(-1)
        return mean, nonnegative_variance(diag - quad, diag)

    def _check_inputs(self, test_x: Tensor) -> Tensor:
        d = self.inducing_points.shape[-1]
        x = as_float_tensor(
            test_x, "test_x", dtype=self.inducing_points.dtype, device=self.inducing_points.device
        )
        if x.dim() == 1 and d == 1:
            x = x.unsqueeze(-1)
        if x.dim() != 2 or x.shape[-1] != d:
            raise ValueError(
                f"test_x must have shape (p, d={d}) like the inducing points (or (p,) for d=1), "
                f"got {tuple(x.shape)}"
            )
        return check_matrix(x, "test_x")

    def predict(self, test_x: Tensor, *, include_noise: bool = False) -> Prediction:
        r"""Predictive mean and variance of :math:`f` (of :math:`y` with ``include_noise``).

        Evaluated in blocks of rows, so that memory stays :math:`O(m + b^2)` per row of a block
        whatever ``p`` (the block size follows :class:`gpsd.settings.max_chunk_elements`; the
        bare :meth:`prediction_module` takes ``test_x`` in one block).

        :param test_x: test inputs, shape ``(p, d)`` (or ``(p,)`` for ``d = 1``; any array-like,
            converted to the student's dtype and device, so float64 inputs to a float32 student
            are rounded to float32).
        :param include_noise: add the teacher's noise variance :math:`\sigma^2` (:attr:`noise`):
            the predictive distribution of :math:`y` rather than :math:`f`.
        :return: a :class:`~gpsd.Prediction` with ``mean`` and ``variance`` of shape ``(p,)``.
        """
        x = self._check_inputs(test_x)
        with torch.no_grad():
            parts = [self._predict(rows) for rows in self._row_chunks(x)]
        mean, variance = torch.cat([m for m, _ in parts]), torch.cat([v for _, v in parts])
        if include_noise:
            variance = variance + self.noise
        return Prediction(mean, variance)

    def forward(self, test_x: Tensor) -> MultivariateNormal:
        """The latent predictive distribution at ``test_x``, with a diagonal covariance."""
        return self.predict(test_x).to_distribution()

    def prediction_module(self) -> torch.nn.Module:
        """A module whose ``forward(x) -> (mean, variance)`` is the bare prediction path.

        It skips input checks (so it can be traced) and shares this student's buffers, and it is
        differentiable in ``x`` (:meth:`predict` is not). Export it when :attr:`exportable`
        (tracing it otherwise raises a ``RuntimeError`` that says so); for any number of test
        points, mark the first dimension dynamic::

            rows = torch.export.Dim("rows")
            program = torch.export.export(
                student.prediction_module(), (x,), dynamic_shapes=({0: rows},)
            )
        """
        return _StudentPredictor(self)


class _StudentPredictor(torch.nn.Module):
    def __init__(self, student: SparseLowRankStudent) -> None:
        super().__init__()
        self.student = student

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        if torch.compiler.is_compiling() and not self.student.exportable:
            raise RuntimeError(
                "this student's kernel is not exportable (exportable is False: only RBF and "
                "Matern kernels, optionally scaled, have a traceable prediction path); use "
                "student.predict instead"
            )
        return self.student._predict(x)
