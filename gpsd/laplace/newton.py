r"""Newton's method for the mode of the Laplace approximation (Rasmussen & Williams, Alg. 3.1)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from linear_operator.operators import LinearOperator
from torch import Tensor

from gpsd._internal.validation import (
    as_float_tensor,
    check_finite,
    check_int,
    check_positive_float,
    check_vector,
)
from gpsd.exceptions import LaplaceConvergenceError
from gpsd.laplace.likelihood_terms import LaplaceLikelihoodTerms
from gpsd.laplace.resolve import resolve_likelihood_terms

__all__ = ["LaplaceMode", "find_laplace_mode"]


@dataclass
class LaplaceMode:
    r"""The converged Laplace approximation :math:`q(\mathbf f) = \mathcal N(\hat{\mathbf f},
    (\mathbf K^{-1} + \mathbf W)^{-1})` of one (batch of) GP classification problem(s).

    :ivar f: the mode :math:`\hat{\mathbf f}`, shape ``(*batch, n)``
    :ivar alpha: :math:`\mathbf a = \mathbf K^{-1}(\hat{\mathbf f} - \mathbf m)`, shape ``(*batch, n)``
    :ivar W: :math:`-\tau\, \partial_f^2 \log p(\mathbf y \mid \hat{\mathbf f})`, shape ``(*batch, n)``
    :ivar sqrt_W: :math:`\mathbf W^{1/2}`
    :ivar chol_B: lower Cholesky factor of :math:`\mathbf B = \mathbf I + \mathbf W^{1/2} \mathbf K
        \mathbf W^{1/2}`, shape ``(*batch, n, n)``
    :ivar objective: :math:`\psi(\hat{\mathbf f}) = -\tfrac12 \mathbf a^\top(\hat{\mathbf f} -
        \mathbf m) + \tau \log p(\mathbf y \mid \hat{\mathbf f})`, shape ``batch``
    :ivar log_marginal_likelihood: :math:`\psi(\hat{\mathbf f}) - \sum_i \log L_{ii}` (R&W eq. 3.32)
    :ivar iterations: Newton iterations used
    :ivar temperature: :math:`\tau`, the power of the likelihood the mode was found at
    """

    f: Tensor
    alpha: Tensor
    W: Tensor
    sqrt_W: Tensor
    chol_B: Tensor
    objective: Tensor
    log_marginal_likelihood: Tensor
    iterations: int
    temperature: float = 1.0

    def check_dtype(self, tensor: object, name: str) -> None:
        """Raise a ``ValueError`` naming ``name`` if ``tensor`` is a tensor in another dtype than
        the mode (a product with :attr:`alpha` or :attr:`chol_B` would fail on it)."""
        if isinstance(tensor, Tensor) and tensor.dtype != self.f.dtype:
            raise ValueError(
                f"{name} has dtype {tensor.dtype} but the mode was found in {self.f.dtype}; "
                f"pass {name} in the mode's dtype"
            )


def _default_tolerances(dtype: torch.dtype) -> tuple[float, float]:
    if dtype == torch.float64:
        return 1e-13, 1e-10
    return 1e-6, 1e-4


def _factor_B(K: Tensor, W: Tensor) -> tuple[Tensor, Tensor]:
    sqrt_W = W.clamp_min(0.0).sqrt()
    B = sqrt_W.unsqueeze(-1) * K * sqrt_W.unsqueeze(-2)  # shape: (*batch, n, n)
    B = B + torch.eye(K.shape[-1], dtype=K.dtype, device=K.device)
    chol_B, info = torch.linalg.cholesky_ex(B)
    if (info != 0).any():
        hint = "" if K.dtype == torch.float64 else "; fit in float64"
        raise LaplaceConvergenceError(
            "the Laplace matrix B = I + W^1/2 K W^1/2 is not positive definite; the kernel matrix "
            f"holds NaN or is not positive semi-definite at {str(K.dtype).removeprefix('torch.')} "
            f"precision (largest entry {K.abs().amax().item():.3g}){hint}"
        )
    return sqrt_W, chol_B


def _objective(
    alpha: Tensor, f: Tensor, m: Tensor, y: Tensor, terms: LaplaceLikelihoodTerms, tau: float
) -> Tensor:
    return -0.5 * (alpha * (f - m)).sum(-1) + tau * terms.log_prob(y, f).sum(-1)


def _newton_step_gain(K: Tensor, W: Tensor, direction: Tensor) -> Tensor:
    r"""The increase of :math:`\psi` a full Newton step promises, half the squared Newton decrement.

    With :math:`\mathbf d` the step in :math:`\mathbf a` and :math:`\Delta\mathbf f = \mathbf K
    \mathbf d` the step in :math:`\mathbf f`,

    .. math::

        \tfrac12 \Delta\mathbf f^\top (\mathbf K^{-1} + \mathbf W) \Delta\mathbf f
        = \tfrac12 \left(\mathbf d^\top \Delta\mathbf f
        + \Delta\mathbf f^\top \mathbf W \Delta\mathbf f\right)

    (no inverse of :math:`\mathbf K` is formed). Shape ``batch``.
    """
    step_f = (K @ direction.unsqueeze(-1)).squeeze(-1)  # shape: (*batch, n)
    W = W.clamp_min(0.0)
    return 0.5 * ((direction * step_f).sum(-1) + (W * step_f * step_f).sum(-1))


def _check_short_steps_end_at_the_mode(
    K: Tensor, W: Tensor, direction: Tensor, short: Tensor, slack: Tensor, name: str
) -> None:
    """Raise unless the problems that stopped without a full Newton step are at the mode.

    Such a stop (the line search stalled, or a shortened step moved nothing beyond round-off) is
    at the mode to working precision only when the full Newton step promises no more than the line
    search's slack (:func:`_newton_step_gain`). A larger promise means that the derivatives do not
    belong to the log-likelihood (a custom :class:`LaplaceLikelihoodTerms` whose ``derivatives``
    and ``log_prob`` disagree) or that rounding hides a real ascent (float32 with a kernel scale of
    1e6, say, where such a stop returned a point 76% off the mode).
    """
    gain = _newton_step_gain(K, W, direction)
    off = short & ~(gain <= slack)  # NaN counts as off
    if off.any():
        digits = f"{str(K.dtype).removeprefix('torch.')} leaves too few digits for this kernel's "
        digits += f"scale (largest entry {K.abs().amax().item():.3g})"
        if K.dtype != torch.float64:
            digits += ": fit in float64"
        raise LaplaceConvergenceError(
            "Newton's method for the Laplace mode stopped short of the mode: no step along the "
            "Newton direction raised the objective beyond round-off, but the full step promised "
            f"{gain[off].max().item():.3e} (round-off allows {slack[off].max().item():.3e}). "
            f"Either the {name} likelihood terms' derivatives are not those of their log_prob, or "
            f"{digits}"
        )


def _checked_problem(
    K: object,
    y: object,
    prior_mean: object,
    init_f: object,
    terms: LaplaceLikelihoodTerms,
    check_targets: bool,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """The arguments of :func:`find_laplace_mode` as tensors in ``K``'s dtype and device, after
    checking their shapes, finiteness and (with ``check_targets``) the likelihood's support."""
    if isinstance(K, LinearOperator):  # a GPyTorch kernel's output: Newton factors it densely
        K = K.to_dense()
    if not isinstance(K, Tensor) or K.dim() < 2 or K.shape[-1] != K.shape[-2]:
        shape = tuple(K.shape) if isinstance(K, Tensor) else type(K).__name__
        raise ValueError(f"K must be a tensor of shape (*batch, n, n), got {shape}")
    if not K.is_floating_point():
        raise TypeError(f"K must be a floating-point tensor, got dtype {K.dtype}")
    n = K.shape[-1]  # a K holding NaN raises LaplaceConvergenceError in the iteration
    like = {"dtype": K.dtype, "device": K.device}
    y = check_vector(as_float_tensor(y, "y", **like), "y", n=n)
    if check_targets:
        terms.check_targets(y, "y")
    checked = []
    for value, name in ((prior_mean, "prior_mean"), (init_f, "init_f")):
        if value is not None:
            value = check_finite(as_float_tensor(value, name, **like), name)
            if value.dim() and value.shape[-1] not in (1, n):
                raise ValueError(
                    f"{name} must have shape (*batch, {n}) or broadcast to it, got shape "
                    f"{tuple(value.shape)}"
                )
        checked.append(value)
    return K, y, *checked


def find_laplace_mode(
    K: Tensor,
    y: Tensor,
    terms: LaplaceLikelihoodTerms,
    prior_mean: Tensor | None = None,
    init_f: Tensor | None = None,
    temperature: float = 1.0,
    max_iter: int = 100,
    objective_tol: float | None = None,
    f_tol: float | None = None,
    max_halvings: int = 40,
    check_targets: bool = True,
) -> LaplaceMode:
    r"""Find the mode of :math:`\psi(\mathbf f) = \log \mathcal N(\mathbf f; \mathbf m, \mathbf K) +
    \tau \log p(\mathbf y \mid \mathbf f)` by Newton's method in the stable form of Rasmussen &
    Williams (Alg. 3.1), generalised to a prior mean and a temperature :math:`\tau`:

    .. math::

        \mathbf b = \mathbf W(\mathbf f - \mathbf m) + \tau \nabla \log p, \quad
        \mathbf a_{\text{new}} = \mathbf b - \mathbf W^{1/2} \mathbf B^{-1} \mathbf W^{1/2}
        \mathbf K \mathbf b, \quad \mathbf f = \mathbf m + \mathbf K \mathbf a,

    with :math:`\mathbf B = \mathbf I + \mathbf W^{1/2} \mathbf K \mathbf W^{1/2}` (no inverse of
    :math:`\mathbf K` is ever formed). Step control: the step in :math:`\mathbf a` is halved until
    :math:`\psi`, evaluated with the likelihood actually used, does not decrease (beyond round-off).
    Convergence: a full Newton step changed :math:`\psi` by less than ``objective_tol * (1 + |psi|)``
    and :math:`\mathbf f` by less than ``f_tol * (1 + max|f|)`` (so the remaining error is of the
    order of the square of that step), or, where round-off stops the line search, the full Newton
    step promises no more increase of :math:`\psi` than round-off. A warm start ``init_f`` takes
    one full Newton step from ``init_f`` first.

    Runs without autograd; see :func:`gpsd.laplace.laplace_log_marginal_likelihood` for gradients.
    The batch shapes of ``K``, ``y``, ``prior_mean`` and ``init_f`` broadcast against each other.

    :param K: Prior covariance of the training latents, shape ``(*batch, n, n)`` (a tensor, or a
        ``LinearOperator`` such as a GPyTorch kernel's output, made dense).
    :param y: Targets, shape ``(*batch, n)``, in the support of the likelihood (checked by
        ``terms.check_targets``); converted to the dtype and device of ``K``.
    :param terms: The likelihood terms (log-concave), or a name or GPyTorch likelihood that
        :func:`~gpsd.laplace.resolve_likelihood_terms` maps to terms.
    :param prior_mean: Prior mean :math:`\mathbf m`, shape ``(*batch, n)`` or anything that
        broadcasts to it (a scalar, ``(*batch, 1)``; default 0).
    :param init_f: Warm start for :math:`\mathbf f`, shape ``(*batch, n)`` or broadcasting to it.
    :param check_targets: check ``y`` against the likelihood's support (``terms.check_targets``);
        ``False`` for soft targets in :math:`[0, 1]` under a Bernoulli likelihood (the
        cross-entropy), whose own check takes binary labels only.
    :param temperature: :math:`\tau > 0`, the power of the likelihood.
    :param max_iter: Newton iterations allowed.
    :param objective_tol: Convergence tolerance (finite, :math:`\ge 0`) on the change of
        :math:`\psi` relative to :math:`1 + |\psi|` (default :math:`10^{-13}` in float64,
        :math:`10^{-6}` otherwise).
    :param f_tol: Convergence tolerance (finite, :math:`\ge 0`) on the change of
        :math:`\mathbf f` relative to :math:`1 + \max|\mathbf f|` (default :math:`10^{-10}` in
        float64, :math:`10^{-4}` otherwise).
    :param max_halvings: How often the step may be halved in one iteration (an integer
        :math:`\ge 0`; 0 tries the full Newton step only).
    :raises LaplaceConvergenceError: after ``max_iter`` iterations without convergence, or when
        the line search stops short of the mode (derivatives that disagree with ``log_prob``, or
        too few digits for the kernel's scale).
    """
    max_iter = check_int(max_iter, "max_iter")
    max_halvings = check_int(max_halvings, "max_halvings", minimum=0)
    temperature = check_positive_float(temperature, "temperature")
    if objective_tol is not None:
        objective_tol = check_positive_float(objective_tol, "objective_tol", allow_zero=True)
    if f_tol is not None:
        f_tol = check_positive_float(f_tol, "f_tol", allow_zero=True)
    terms = resolve_likelihood_terms(terms)
    K, y, prior_mean, init_f = _checked_problem(K, y, prior_mean, init_f, terms, check_targets)
    with torch.no_grad():
        K = K.detach()
        y = y.detach()
        # the batch of problems: K, y, the prior mean and the start point broadcast together
        batch_shapes = [K.shape[:-2], y.shape[:-1]]
        batch_shapes += [t.shape[:-1] for t in (prior_mean, init_f) if t is not None and t.dim()]
        try:
            batch_shape = torch.broadcast_shapes(*batch_shapes)
        except RuntimeError as err:
            raise ValueError(
                "the batch shapes of K, y, prior_mean and init_f (all but the last dimension of y, "
                f"prior_mean and init_f) do not broadcast: {[tuple(b) for b in batch_shapes]}"
            ) from err
        n = K.shape[-1]
        K = K.expand(*batch_shape, n, n)
        y = y.expand(*batch_shape, n)
        m = torch.zeros_like(y) if prior_mean is None else prior_mean.detach().expand_as(y)
        default_obj_tol, default_f_tol = _default_tolerances(K.dtype)
        objective_tol = default_obj_tol if objective_tol is None else objective_tol
        f_tol = default_f_tol if f_tol is None else f_tol
        tau = float(temperature)

        def newton_target(f: Tensor) -> Tensor:
            d1, d2 = terms.derivatives(y, f)
            W = -tau * d2
            if (W < -1e-8 * (1.0 + W.abs().amax())).any() or not torch.isfinite(W).all():
                raise ValueError(
                    f"the {terms.name} likelihood is not log-concave at the current latent values "
                    "(negative or non-finite curvature); the Laplace engine needs a log-concave one"
                )
            sqrt_W, chol_B = _factor_B(K, W)
            b = W.clamp_min(0.0) * (f - m) + tau * d1
            Kb = (K @ b.unsqueeze(-1)).squeeze(-1)
            c = torch.cholesky_solve((sqrt_W * Kb).unsqueeze(-1), chol_B).squeeze(-1)
            return b - sqrt_W * c, W

        if init_f is None:
            alpha = torch.zeros_like(y)
            f = m.clone()
            psi = _objective(alpha, f, m, y, terms, tau)
        else:
            f0 = init_f.detach().to(dtype=K.dtype, device=K.device).expand_as(y)
            alpha, _ = newton_target(f0)
            f = m + (K @ alpha.unsqueeze(-1)).squeeze(-1)
            psi = _objective(alpha, f, m, y, terms, tau)
        if not torch.isfinite(psi).all():
            raise LaplaceConvergenceError("the Laplace objective is not finite at the start point")

        converged = False
        iterations = 0
        for iteration in range(1, max_iter + 1):
            iterations = iteration
            direction, W_now = newton_target(f)
            direction = direction - alpha
            step = torch.ones_like(psi)
            accepted = torch.zeros_like(psi, dtype=torch.bool)
            new_alpha, new_f, new_psi = alpha, f, psi
            for _ in range(max_halvings + 1):  # the full step, then max_halvings shorter ones
                cand_alpha = alpha + step.unsqueeze(-1) * direction
                cand_f = m + (K @ cand_alpha.unsqueeze(-1)).squeeze(-1)
                cand_psi = _objective(cand_alpha, cand_f, m, y, terms, tau)
                # a step may lower psi by round-off only (near the mode); real overshoots lower it more
                slack = 1e4 * torch.finfo(K.dtype).eps * (1.0 + psi.abs())
                ok = torch.isfinite(cand_psi) & (cand_psi >= psi - slack) & ~accepted
                new_alpha = torch.where(ok.unsqueeze(-1), cand_alpha, new_alpha)
                new_f = torch.where(ok.unsqueeze(-1), cand_f, new_f)
                new_psi = torch.where(ok, cand_psi, new_psi)
                accepted = accepted | ok
                if accepted.all():
                    break
                step = torch.where(accepted, step, 0.5 * step)
            df = (new_f - f).abs().amax(-1)
            dpsi = (new_psi - psi).abs()
            alpha, f, psi = new_alpha, new_f, new_psi
            small_obj = dpsi <= objective_tol * (1.0 + psi.abs())
            small_f = df <= f_tol * (1.0 + f.abs().amax(-1))
            # after a small full Newton step the remaining error is O(df^2)
            full_step = accepted & (step == 1.0)
            stalled = ~accepted  # no step improved psi at working precision
            # A step that moves psi by no more than the round-off the line search tolerates is at
            # the mode to working precision when it is a full Newton step whose promised gain
            # (_newton_step_gain, free of the round-off in psi) is below objective_tol, or when the
            # full step was rejected and a shorter one barely moves f: with a large kernel scale
            # (float32, or an outputscale of 1e6 in float64) the iterates otherwise wander at that
            # level above objective_tol forever. The slack alone is too coarse for a full step:
            # 1e-3 |psi| in float32, where such stops left the mode 4e-2 off.
            small_gain = _newton_step_gain(K, W_now, direction) <= objective_tol * (1.0 + psi.abs())
            at_precision = accepted & (dpsi <= slack) & ((full_step & small_gain) | small_f)
            if ((small_obj & small_f & full_step) | at_precision | stalled).all():
                short = stalled | (at_precision & ~full_step)
                if short.any():
                    _check_short_steps_end_at_the_mode(
                        K, W_now, direction, short, slack, terms.name
                    )
                converged = True
                break
        if not converged:
            raise LaplaceConvergenceError(
                f"Newton's method for the Laplace mode did not converge in max_iter={max_iter} "
                f"iterations (last change of f: {df.max().item():.3e}, of the objective: "
                f"{dpsi.max().item():.3e}); raise max_iter or loosen objective_tol/f_tol"
            )
        d1, d2 = terms.derivatives(y, f)
        W = (-tau * d2).clamp_min(0.0)
        sqrt_W, chol_B = _factor_B(K, W)
        log_ml = psi - torch.diagonal(chol_B, dim1=-2, dim2=-1).log().sum(-1)
        return LaplaceMode(
            f=f,
            alpha=alpha,
            W=W,
            sqrt_W=sqrt_W,
            chol_B=chol_B,
            objective=psi,
            log_marginal_likelihood=log_ml,
            iterations=iterations,
            temperature=tau,
        )
