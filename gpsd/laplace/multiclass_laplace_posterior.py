r"""The Laplace approximation for :math:`K`-class GP classification (Rasmussen & Williams §3.5)."""

from __future__ import annotations

import torch
from linear_operator.operators import LinearOperator
from torch import Tensor

from gpsd._internal.memory_check import check_dense_matrices_fit
from gpsd._internal.validation import as_float_tensor, check_finite, check_int, check_positive_float
from gpsd.exceptions import LaplaceConvergenceError
from gpsd.laplace._multiclass_factor import (
    DenseFactor,
    SoftmaxFactor,
    apply_blocks,
    apply_K,
)
from gpsd.laplace.continuous_categorical_terms import ContinuousCategoricalTerms
from gpsd.laplace.multiclass_likelihood_terms import MulticlassLikelihoodTerms
from gpsd.laplace.predictive import multiclass_expectation
from gpsd.laplace.softmax_terms import SoftmaxTerms

__all__ = ["MulticlassLaplacePosterior"]

_LIKELIHOOD_NAMES = {"softmax": SoftmaxTerms, "continuous_categorical": ContinuousCategoricalTerms}


def _resolve(likelihood: object) -> MulticlassLikelihoodTerms:
    if isinstance(likelihood, MulticlassLikelihoodTerms):
        return likelihood
    if isinstance(likelihood, str) and likelihood.lower() in _LIKELIHOOD_NAMES:
        return _LIKELIHOOD_NAMES[likelihood.lower()]()
    raise ValueError(
        f"likelihood must be one of {sorted(_LIKELIHOOD_NAMES)} or MulticlassLikelihoodTerms, "
        f"got {likelihood!r}"
    )


def _checked_hessian(hessian: Tensor, name: str) -> Tensor:
    """:math:`\\mathbf W = -\\nabla^2 \\log p` per point, symmetrised; a ``ValueError`` where it
    is not finite or not positive semi-definite (beyond round-off)."""
    W = -0.5 * (hessian + hessian.transpose(-1, -2))
    if not torch.isfinite(W).all():
        raise ValueError(f"the {name} likelihood's Hessian is not finite at the current latents")
    smallest = torch.linalg.eigvalsh(W).amin(-1)
    rounding = 100.0 * torch.finfo(W.dtype).eps * (1.0 + W.abs().amax((-1, -2)))
    if (smallest < -rounding).any():
        raise ValueError(
            f"the {name} likelihood is not log-concave at the current latents (a Hessian block "
            f"has eigenvalue {-float(smallest.min()):.3g} > 0); the Laplace engine needs a "
            "log-concave one"
        )
    return W


#: matrices of size n per class that the softmax's fit and evidence gradient hold at their peak
#: (measured: 7.1 per class at n = 1500, K = 4, float64)
_SOFTMAX_MATRICES = 8
#: matrices of size K n that the dense fit and evidence gradient hold at their peak (measured:
#: 10.2 at n = 1000, K = 4, float64)
_DENSE_MATRICES = 11


def _default_tolerances(dtype: torch.dtype) -> tuple[float, float]:
    if dtype == torch.float64:
        return 1e-13, 1e-10
    return 1e-6, 1e-4


class MulticlassLaplacePosterior:
    r"""The Laplace approximation of the posterior of :math:`K` latent GPs, independent a priori,
    given one label or soft target per point (Rasmussen & Williams §3.5).

    The latents :math:`\mathbf f \in \mathbb R^{Kn}` (class :math:`c` of point :math:`i`) have
    the prior :math:`\mathcal N(\mathbf m, \mathbf K)`, :math:`\mathbf K =
    \operatorname{blockdiag}(\mathbf K_1, \dots, \mathbf K_K)`, and the likelihood
    :math:`\prod_i p(\mathbf y_i \mid \mathbf f_i)` (softmax labels or continuous-categorical
    soft targets, :class:`~gpsd.laplace.MulticlassLikelihoodTerms`). The mode :math:`\hat{\mathbf
    f}` of :math:`\Psi(\mathbf f) = \log p(\mathbf y \mid \mathbf f) - \tfrac12 (\mathbf f -
    \mathbf m)^\top \mathbf K^{-1} (\mathbf f - \mathbf m)` is found by Newton's method;
    :math:`\mathbf W = -\nabla\nabla \log p(\mathbf y \mid \mathbf f)` is block-diagonal over
    the points, a :math:`K \times K` block :math:`\mathbf W_i` each
    (:math:`\operatorname{diag}(\boldsymbol\pi_i) - \boldsymbol\pi_i\boldsymbol\pi_i^\top` for
    the softmax, the covariance of the continuous categorical for soft targets), and

    .. math::

        \mathbf b = \mathbf W (\mathbf f - \mathbf m) + \nabla \log p(\mathbf y \mid \mathbf f),
        \quad \mathbf a_{\text{new}} = \mathbf b - \mathbf R \mathbf K \mathbf b, \quad
        \mathbf f = \mathbf m + \mathbf K \mathbf a, \quad
        \mathbf R = (\mathbf K + \mathbf W^{-1})^{-1} = \mathbf W^{1/2} \mathbf B^{-1}
        \mathbf W^{1/2}, \quad \mathbf B = \mathbf I + \mathbf W^{1/2} \mathbf K \mathbf W^{1/2}.

    This is Newton's step :math:`\mathbf f_{\text{new}} = \mathbf m + (\mathbf K^{-1} +
    \mathbf W)^{-1} \mathbf b` written without inverting :math:`\mathbf K` or :math:`\mathbf W`:
    both likelihoods depend on the latents only through their differences, so every
    :math:`\mathbf W_i` is singular along :math:`\mathbf 1`, and :math:`\mathbf B` is positive
    definite all the same.
    :math:`\mathbf R` and :math:`\log|\mathbf B|` come from one of two factorisations:

    * the softmax: Rasmussen & Williams' Algorithm 3.3, which uses :math:`\mathbf W =
      \mathbf D - \boldsymbol\Pi\boldsymbol\Pi^\top` (diagonal minus rank :math:`n`) and
      :math:`\sum_c \boldsymbol\pi_c = \mathbf 1` to factor :math:`K + 1` matrices of size
      :math:`n`, :math:`O(K n^3)`;
    * any other terms, the continuous categorical among them, whose blocks are dense: the
      Cholesky factor of :math:`\mathbf B` of size :math:`Kn` with :math:`\mathbf W^{1/2}` the
      symmetric square root of each block, :math:`O(K^3 n^3)` time and :math:`O(K^2 n^2)`
      memory.

    The step in :math:`\mathbf a` is halved until :math:`\Psi` does not decrease (beyond
    round-off), so Newton converges from :math:`\mathbf f = \mathbf m`.

    Log marginal likelihood (R&W eq. 3.44):

    .. math::

        \log q(\mathbf y) = -\tfrac12 \hat{\mathbf a}^\top (\hat{\mathbf f} - \mathbf m)
        + \log p(\mathbf y \mid \hat{\mathbf f}) - \tfrac12 \log |\mathbf B|,

    differentiable in the prior mean and covariances with the mode's dependence on them
    (:meth:`log_marginal_likelihood`). Predictions at test points (R&W Algorithm 3.4, with the
    same total derivative):

    .. math::

        \boldsymbol\mu_{*c} = m_c(\mathbf x_*) + \mathbf k_{c*}^\top \hat{\mathbf a}_c, \qquad
        \boldsymbol\Sigma_* = \operatorname{diag}(k_c(\mathbf x_*, \mathbf x_*))
        - \mathbf Q_*^\top \mathbf R \mathbf Q_*,

    :math:`\mathbf Q_*` the :math:`Kn \times K` matrix with :math:`\mathbf k_{c*}` in block
    :math:`c` of column :math:`c` (:meth:`predictive`); class probabilities average the response
    over draws from :math:`\mathcal N(\boldsymbol\mu_*, \boldsymbol\Sigma_*)`
    (:meth:`class_probabilities`).

    The mode is found on construction. Works in the dtype of ``prior_covariance`` (float64 or
    float32; the continuous categorical's :math:`A` and its derivatives in float64 whatever the
    dtype). A batch of problems falls out of the shapes: the batch dimensions of the prior
    mean, the covariances ``(*b, C, n, n)`` and the targets broadcast.

    :param prior_mean: :math:`\mathbf m`, the prior mean of the latents, broadcasting to
        ``(*b, n, K)`` (``0.0``, a constant per class ``(K,)``, or one value per point and class).
    :param prior_covariance: Prior covariances of the training latents: ``(*b, C, n, n)`` with one
        per class (:math:`C = K`) or one shared (:math:`C = 1`), or ``(n, n)`` for one shared; a
        tensor or a ``LinearOperator`` (made dense). Keep the autograd history of it and of
        ``prior_mean`` for gradients of :meth:`log_marginal_likelihood`.
    :param terms: ``"softmax"``, ``"continuous_categorical"`` or
        :class:`~gpsd.laplace.MulticlassLikelihoodTerms`.
    :param train_y: For ``"softmax"``, labels ``(*b, n)`` in ``0 ... K - 1``; for
        ``"continuous_categorical"``, soft targets ``(*b, n, K)`` on the simplex.
    :param num_classes: :math:`K`; needed for labels with a shared covariance, else read from
        ``prior_covariance`` or ``train_y`` (and checked against them where given).
    :param init_f: A start for Newton's method (a previous mode, say), broadcasting to
        ``(*b, n, K)``; default :math:`\mathbf m`. Newton's method takes one full step from it
        first, which needs no solve with :math:`\mathbf K` (but one factorisation).
    :param init_alpha: A start given as :math:`\mathbf a`, broadcasting to ``(*b, n, K)``:
        :math:`\mathbf f = \mathbf m + \mathbf K \mathbf a` (another posterior's
        :attr:`alpha`, whose prior covariance differs from this one's by a multiple of
        :math:`\mathbf I`, say); no step is taken first. Not with ``init_f``.
    :param max_iter: Newton iterations allowed.
    :param objective_tol: Convergence tolerance (finite, :math:`\ge 0`) on the change of
        :math:`\Psi` relative to :math:`1 + |\Psi|` (default :math:`10^{-13}` in float64,
        :math:`10^{-6}` otherwise).
    :param f_tol: Convergence tolerance (finite, :math:`\ge 0`) on the change of
        :math:`\mathbf f` relative to :math:`1 + \max|\mathbf f|` (default :math:`10^{-10}` in
        float64, :math:`10^{-4}` otherwise).
    :param max_halvings: How often the step may be halved in one iteration (:math:`\ge 0`).
    :raises LaplaceConvergenceError: when Newton's method does not converge in ``max_iter``
        iterations, stops short of the mode, or :math:`\mathbf B` is not positive definite.
    :raises InsufficientMemoryError: before allocating, where the matrices of the fit and of the
        evidence gradient (about :math:`8K` of size :math:`n` for the softmax, 11 of size
        :math:`Kn` otherwise, measured) do not fit in the device's free memory.

    :ivar mode: :math:`\hat{\mathbf F}`, the mode as ``(*b, n, K)``.
    :ivar alpha: :math:`\hat{\mathbf a} = \mathbf K^{-1}(\hat{\mathbf f} - \mathbf m)` as
        ``(*b, n, K)``.
    :ivar prior_mean: :math:`\mathbf m` as given (a tensor).
    :ivar prior_covariance: the covariances as given, ``(*b, C, n, n)`` (dense).
    :ivar W: the blocks :math:`\mathbf W_i` at the mode, ``(*b, n, K, K)``.
    :ivar iterations: Newton iterations used.
    :ivar num_classes: :math:`K`.
    :ivar terms: the :class:`~gpsd.laplace.MulticlassLikelihoodTerms` in use.
    :ivar train_targets: the target matrix :math:`\mathbf Y`, ``(*b, n, K)`` (one-hot rows for
        labels).

    Example:

        >>> K = covar_module(train_x).to_dense()  # (n, n): one covariance shared by 3 classes
        >>> posterior = MulticlassLaplacePosterior(0.0, K, "softmax", labels, num_classes=3)
        >>> (-posterior.log_marginal_likelihood()).backward()
        >>> mean, covariance = posterior.predictive(K_cross, k_test_diagonal)  # (m, 3), (m, 3, 3)
    """

    def __init__(
        self,
        prior_mean: Tensor | float,
        prior_covariance: Tensor | LinearOperator,
        terms: str | MulticlassLikelihoodTerms,
        train_y: Tensor,
        *,
        num_classes: int | None = None,
        init_f: Tensor | None = None,
        init_alpha: Tensor | None = None,
        max_iter: int = 100,
        objective_tol: float | None = None,
        f_tol: float | None = None,
        max_halvings: int = 40,
    ) -> None:
        self.terms = _resolve(terms)
        self.max_iter = check_int(max_iter, "max_iter")
        self.max_halvings = check_int(max_halvings, "max_halvings", minimum=0)
        num_classes = check_int(num_classes, "num_classes", minimum=2, optional=True)
        K = self._checked_covariance(prior_covariance)
        if num_classes is not None and K.shape[-3] not in (1, num_classes):
            raise ValueError(
                f"prior_covariance has {K.shape[-3]} class covariances (dimension -3) but "
                f"num_classes={num_classes}; pass one per class or one shared"
            )
        if num_classes is None and K.shape[-3] > 1:
            num_classes = K.shape[-3]
        y = as_float_tensor(train_y, "train_y", dtype=K.dtype, device=K.device)
        Y = self.terms.targets(y, num_classes, "train_y")  # shape: (*b, n, C)
        n, C = K.shape[-1], Y.shape[-1]
        if K.shape[-3] not in (1, C):
            raise ValueError(
                f"prior_covariance has {K.shape[-3]} class covariances (dimension -3) but train_y "
                f"has {C} classes; pass one per class or one shared"
            )
        if Y.shape[-2] != n:
            raise ValueError(
                f"train_y has {Y.shape[-2]} points but prior_covariance is {n} x {n}; pass one "
                "target per training point"
            )
        m = check_finite(
            as_float_tensor(prior_mean, "prior_mean", dtype=K.dtype, device=K.device), "prior_mean"
        )
        try:
            batch = torch.broadcast_shapes(K.shape[:-3], Y.shape[:-2], m.shape[:-2])
            torch.broadcast_shapes(m.shape, (*batch, n, C))
        except RuntimeError as err:
            raise ValueError(
                f"prior_mean {tuple(m.shape)} must broadcast to (*b, n, K) = (*b, {n}, {C}), and "
                f"the batch shapes of prior_covariance {tuple(K.shape[:-3])}, train_y "
                f"{tuple(Y.shape[:-2])} and prior_mean must broadcast"
            ) from err
        if init_f is not None and init_alpha is not None:
            raise ValueError("pass either init_f or init_alpha, not both")
        start = init_f if init_alpha is None else init_alpha
        name = "init_f" if init_alpha is None else "init_alpha"
        if start is not None:
            start = check_finite(as_float_tensor(start, name, dtype=K.dtype, device=K.device), name)
            try:
                torch.broadcast_shapes(start.shape, (*batch, n, C))
            except RuntimeError as err:
                raise ValueError(
                    f"{name} {tuple(start.shape)} must broadcast to (*b, n, K) = {(*batch, n, C)}"
                ) from err
        default_obj_tol, default_f_tol = _default_tolerances(K.dtype)
        self.objective_tol = (
            default_obj_tol
            if objective_tol is None
            else check_positive_float(objective_tol, "objective_tol", allow_zero=True)
        )
        self.f_tol = (
            default_f_tol
            if f_tol is None
            else check_positive_float(f_tol, "f_tol", allow_zero=True)
        )
        self.num_classes = C
        self.prior_mean = m
        self.prior_covariance = K
        self.train_targets = Y.expand(*batch, n, C)
        self._batch = batch
        self._check_memory()
        self._find_mode(start, given_alpha=init_alpha is not None)

    def _check_memory(self) -> None:
        """Raise :class:`~gpsd.InsufficientMemoryError` before allocating where the matrices of
        the factorisation and of the evidence gradient do not fit: for the softmax, about
        :data:`_SOFTMAX_MATRICES` per class of size :math:`n`; otherwise :data:`_DENSE_MATRICES`
        of size :math:`Kn`."""
        n, C = self.prior_covariance.shape[-1], self.num_classes
        softmax = isinstance(self.terms, SoftmaxTerms)
        size, matrices = (n, _SOFTMAX_MATRICES * C) if softmax else (C * n, _DENSE_MATRICES)
        what = (
            "I + D_c^1/2 K_c D_c^1/2, its Cholesky factor, E_c and the evidence gradient's "
            "products per class"
            if softmax
            else "B = I + W^1/2 K W^1/2, its Cholesky factor and the evidence gradient's products"
        )
        like = self.prior_covariance.new_empty((size, 0))  # (N, 0): the size and dtype, no storage
        check_dense_matrices_fit(
            type(self).__name__,
            matrices,
            like,
            torch.Size(self._batch),
            what,
            "fit fewer points, or in float32 for half the bytes",
        )

    @staticmethod
    def _checked_covariance(covariance: object) -> Tensor:
        if isinstance(covariance, LinearOperator):
            covariance = covariance.to_dense()
        if not isinstance(covariance, Tensor):
            raise TypeError(
                f"prior_covariance must be a tensor or LinearOperator, got {type(covariance)}"
            )
        if not covariance.is_floating_point():
            raise TypeError(
                f"prior_covariance must be a floating-point tensor, got {covariance.dtype}"
            )
        if covariance.dim() == 2:
            covariance = covariance.unsqueeze(-3)
        if covariance.dim() < 3 or covariance.shape[-1] != covariance.shape[-2]:
            raise ValueError(
                "prior_covariance must have shape (*b, C, n, n) (one per class, or C = 1 shared) "
                f"or (n, n), got {tuple(covariance.shape)}"
            )
        check_finite(covariance.detach(), "prior_covariance")
        return covariance

    def _expanded_covariance(self, K: Tensor) -> Tensor:
        n = K.shape[-1]
        return K.expand(*self._batch, self.num_classes, n, n)

    def _factor(self, K: Tensor, W: Tensor, F: Tensor) -> DenseFactor | SoftmaxFactor:
        r"""The factorisation of :math:`\mathbf R = (\mathbf K + \mathbf W^{-1})^{-1}` at ``F``:
        Algorithm 3.3's for the softmax, the dense one otherwise."""
        if isinstance(self.terms, SoftmaxTerms):
            return SoftmaxFactor(K, self.terms.response(F))
        return DenseFactor(K, W)

    def _objective(self, a: Tensor, F: Tensor, m: Tensor) -> Tensor:
        return -0.5 * (a * (F - m)).sum((-1, -2)) + self.terms.log_prob(self.train_targets, F).sum(
            -1
        )

    def _newton_target(self, K: Tensor, F: Tensor, m: Tensor) -> tuple[Tensor, Tensor]:
        """The full Newton step's :math:`\\mathbf a = \\mathbf b - \\mathbf R \\mathbf K
        \\mathbf b`, :math:`\\mathbf b = \\mathbf W (\\mathbf f - \\mathbf m) + \\nabla \\log p`,
        from ``F``, and :math:`\\mathbf W` at ``F``."""
        gradient, hessian = self.terms.derivatives(self.train_targets, F)
        W = _checked_hessian(hessian, self.terms.name)
        factor = self._factor(K, W, F)
        b = apply_blocks(W, F - m) + gradient
        return b - factor.apply(apply_K(K, b).unsqueeze(-1)).squeeze(-1), W

    def _find_mode(self, start: Tensor | None, given_alpha: bool) -> None:
        r"""Newton's method from ``start``: :math:`\mathbf a` where ``given_alpha``, else
        :math:`\mathbf f` (one full step from it first), else the prior mean."""
        with torch.no_grad():
            K = self._expanded_covariance(self.prior_covariance.detach())
            Y = self.train_targets
            m = self.prior_mean.detach().expand_as(Y)
            if start is None:
                a = torch.zeros_like(Y)
                F = m.clone()
            else:
                start = start.detach().expand_as(Y)
                # from f, one full Newton step: a needs no solve with K
                a = start.clone() if given_alpha else self._newton_target(K, start, m)[0]
                F = m + apply_K(K, a)
            psi = self._objective(a, F, m)
            if not torch.isfinite(psi).all():
                raise LaplaceConvergenceError(
                    "the multiclass Laplace objective is not finite at the start point"
                )
            eps = torch.finfo(K.dtype).eps
            converged = False
            iterations = 0
            for iteration in range(1, self.max_iter + 1):
                iterations = iteration
                target, W = self._newton_target(K, F, m)
                direction = target - a
                step_f = apply_K(K, direction)
                # the increase a full step promises: half the squared Newton decrement
                gain = 0.5 * (
                    (direction * step_f).sum((-1, -2))
                    + (step_f * apply_blocks(W, step_f)).sum((-1, -2))
                )
                slack = 1e4 * eps * (1.0 + psi.abs())
                step = torch.ones_like(psi)
                accepted = torch.zeros_like(psi, dtype=torch.bool)
                new_a, new_F, new_psi = a, F, psi
                for _ in range(self.max_halvings + 1):
                    cand_a = a + step[..., None, None] * direction
                    cand_F = m + apply_K(K, cand_a)
                    cand_psi = self._objective(cand_a, cand_F, m)
                    ok = torch.isfinite(cand_psi) & (cand_psi >= psi - slack) & ~accepted
                    new_a = torch.where(ok[..., None, None], cand_a, new_a)
                    new_F = torch.where(ok[..., None, None], cand_F, new_F)
                    new_psi = torch.where(ok, cand_psi, new_psi)
                    accepted = accepted | ok
                    if accepted.all():
                        break
                    step = torch.where(accepted, step, 0.5 * step)
                df = (new_F - F).abs().amax((-1, -2))
                dpsi = (new_psi - psi).abs()
                a, F, psi = new_a, new_F, new_psi
                full = accepted & (step == 1.0)
                small = (dpsi <= self.objective_tol * (1.0 + psi.abs())) & (
                    df <= self.f_tol * (1.0 + F.abs().amax((-1, -2)))
                )
                # where round-off stops the line search, the mode is reached when the full step
                # promises no more than round-off
                at_precision = (~full) & (gain <= slack)
                if ((full & small) | at_precision).all():
                    converged = True
                    break
                if (~accepted & ~at_precision).any():
                    raise LaplaceConvergenceError(
                        "Newton's method for the multiclass Laplace mode stopped short of the "
                        "mode: no step along the Newton direction raised the objective beyond "
                        f"round-off, but the full step promised {float(gain.max()):.3e}; the "
                        f"{self.terms.name} likelihood terms' derivatives disagree with their "
                        "log_prob, or the dtype leaves too few digits for this covariance"
                    )
            if not converged:
                raise LaplaceConvergenceError(
                    f"Newton's method for the multiclass Laplace mode did not converge in "
                    f"max_iter={self.max_iter} iterations (last change of f: "
                    f"{float(df.max()):.3e}, of the objective: {float(dpsi.max()):.3e}); raise "
                    "max_iter or loosen objective_tol/f_tol"
                )
            _, hessian = self.terms.derivatives(Y, F)
            W = _checked_hessian(hessian, self.terms.name)
            self._factorisation = self._factor(K, W, F)
        self.mode, self.alpha, self.W, self.iterations = F, a, W, iterations
        self._objective_value = psi

    def _apply_R(self, X: Tensor) -> Tensor:
        r""":math:`(\mathbf K + \mathbf W^{-1})^{-1} \mathbf X` at the mode, ``X`` of shape
        ``(*b, n, C, r)``."""
        return self._factorisation.apply(X)

    def _sensitivities(self, K: Tensor) -> tuple[Tensor, Tensor]:
        r"""The per-point blocks of :math:`(\mathbf K^{-1} + \mathbf W)^{-1} = \mathbf K -
        \mathbf K \mathbf R \mathbf K` ``(*b, n, C, C)`` and the per-class blocks of
        :math:`\mathbf R = (\mathbf K + \mathbf W^{-1})^{-1}` ``(*b, C, n, n)``: the derivatives
        of :math:`\log|\mathbf B|` in :math:`\mathbf W` and in :math:`\mathbf K`."""
        K_R_K, R_blocks = self._factorisation.blocks(K)
        prior = torch.diag_embed(torch.diagonal(K, dim1=-2, dim2=-1).transpose(-1, -2))
        return prior - K_R_K, R_blocks

    def _prior_moves(self) -> bool:
        """Whether gradients are enabled and the prior carries autograd history."""
        return torch.is_grad_enabled() and (
            self.prior_covariance.requires_grad or self.prior_mean.requires_grad
        )

    def _moving_mode(self) -> tuple[Tensor, Tensor, Tensor]:
        r"""The prior covariances and mean (expanded, with their history) and the mode with its
        derivative attached: :math:`\hat{\mathbf f} + (\mathbf I + \mathbf K \mathbf W)^{-1}
        (\boldsymbol\delta - \operatorname{sg}\boldsymbol\delta)`, :math:`\boldsymbol\delta =
        \mathbf m + \mathbf K \hat{\mathbf a}`, whose value is :math:`\hat{\mathbf f}` and whose
        derivative is :math:`\partial\hat{\mathbf f}` (R&W eq. 5.24), with
        :math:`(\mathbf I + \mathbf K \mathbf W)^{-1} = \mathbf I - \mathbf K \mathbf R`."""
        K = self._expanded_covariance(self.prior_covariance)
        m = self.prior_mean.expand_as(self.mode)
        a, K_fixed = self.alpha, K.detach()
        delta = (m - m.detach()) + apply_K(K, a) - apply_K(K_fixed, a)
        moving = (
            self.mode + delta - apply_K(K_fixed, self._apply_R(delta.unsqueeze(-1)).squeeze(-1))
        )
        return K, m, moving

    def log_marginal_likelihood(self) -> Tensor:
        r"""The Laplace approximation of :math:`\log p(\mathbf y)`, shape ``batch``, with its total
        derivative in the prior mean and covariances (including the mode's dependence on them).

        The terms of :math:`\Psi` are stationary at the mode, so their derivative is the partial
        one, :math:`\hat{\mathbf a}^\top \partial\mathbf m + \tfrac12 \hat{\mathbf a}^\top
        \partial\mathbf K\, \hat{\mathbf a}`. The mode moves by :math:`\partial\hat{\mathbf f} =
        (\mathbf I + \mathbf K \mathbf W)^{-1} (\partial\mathbf m + \partial\mathbf K\,
        \hat{\mathbf a})` (R&W eq. 5.24), which enters :math:`\log|\mathbf B|
        = \log|\mathbf I + \mathbf K \mathbf W|` through :math:`\mathbf W(\hat{\mathbf f})`:

        .. math::

            \partial \log|\mathbf B| = \operatorname{tr}\bigl((\mathbf K + \mathbf W^{-1})^{-1}
            \partial \mathbf K\bigr) + \operatorname{tr}\bigl((\mathbf K^{-1} + \mathbf W)^{-1}
            \partial \mathbf W\bigr),

        both traces over blocks only (:math:`\mathbf K` is block-diagonal over the classes,
        :math:`\mathbf W` over the points; :math:`(\mathbf K + \mathbf W^{-1})^{-1}` stands for
        :math:`\mathbf R`). The returned tensor has the value
        of :math:`\log q(\mathbf y)` and, by autograd, these derivatives; the third derivative of
        the log-likelihood comes from autograd through the terms' Hessian.
        """
        value = self._objective_value - self._factorisation.half_log_det
        if not self._prior_moves():
            return value.clone()
        K, m, F_moving = self._moving_mode()
        a, K_fixed = self.alpha, K.detach()
        W_moving = -self.terms.derivatives(self.train_targets, F_moving)[1]
        P_blocks, R_blocks = self._sensitivities(K_fixed)
        half_log_det = self._factorisation.half_log_det + 0.5 * (
            (P_blocks * (W_moving - W_moving.detach())).sum((-1, -2, -3))
            + (R_blocks * (K - K_fixed)).sum((-1, -2, -3))
        )
        # -1/2 (f - m)^T K^-1 (f - m) to first order about the mode, without K^-1
        quadratic = -(a * (F_moving - m)).sum((-1, -2)) + 0.5 * (a * apply_K(K, a)).sum((-1, -2))
        fit = self.terms.log_prob(self.train_targets, F_moving).sum(-1)
        surrogate = quadratic + fit - half_log_det
        return surrogate - surrogate.detach() + value

    def _checked_test_covariances(
        self, cross_covariance: object, test_prior_variance: object
    ) -> tuple[Tensor, Tensor]:
        """``cross_covariance`` as ``(*b, C|1, m, n)`` and ``test_prior_variance`` as
        ``(*b, C|1, m)``, checked."""
        like = {"dtype": self.mode.dtype, "device": self.mode.device}
        if isinstance(cross_covariance, LinearOperator):
            cross_covariance = cross_covariance.to_dense()
        cross = as_float_tensor(cross_covariance, "cross_covariance", **like)
        n, C = self.mode.shape[-2], self.num_classes
        if cross.dim() == 2:
            cross = cross.unsqueeze(-3)
        if cross.dim() < 3 or cross.shape[-1] != n or cross.shape[-3] not in (1, C):
            raise ValueError(
                f"cross_covariance must have shape (*b, C, m, {n}) with C = {C} or 1 (k(x_*, X) "
                f"of each class), or (m, {n}), got {tuple(cross.shape)}"
            )
        m = cross.shape[-2]
        variance = as_float_tensor(test_prior_variance, "test_prior_variance", **like)
        if variance.dim() == 1:
            variance = variance.unsqueeze(-2)
        if variance.dim() < 2 or variance.shape[-1] != m or variance.shape[-2] not in (1, C):
            raise ValueError(
                f"test_prior_variance must have shape (*b, C, {m}) with C = {C} or 1 (the prior "
                f"variances k_c(x_*, x_*) at the m={m} test points of cross_covariance), or "
                f"({m},), got {tuple(variance.shape)}"
            )
        check_finite(cross.detach(), "cross_covariance")
        check_finite(variance.detach(), "test_prior_variance")
        return cross, variance

    def predictive(
        self,
        cross_covariance: Tensor,
        test_prior_variance: Tensor,
        test_prior_mean: Tensor | float | None = None,
    ) -> tuple[Tensor, Tensor]:
        r"""The latent predictive mean ``(*b, m, K)`` and covariance ``(*b, m, K, K)`` (between
        the classes at each test point) of R&W Algorithm 3.4 with the prior mean, see the class
        description.

        Where gradients are enabled and the prior mean or covariances carry autograd history,
        the predictions carry the total derivative, the mode's dependence on the prior included
        (as :meth:`log_marginal_likelihood` does); :meth:`class_probabilities` does not.

        :param cross_covariance: :math:`k_c(\mathbf x_*, \mathbf X)`, ``(*b, C, m, n)`` with
            :math:`C = K` or 1 (shared), or ``(m, n)``.
        :param test_prior_variance: :math:`k_c(\mathbf x_*, \mathbf x_*)`, ``(*b, C, m)`` or
            ``(m,)``.
        :param test_prior_mean: :math:`m_c(\mathbf x_*)`, broadcasting to ``(*b, m, K)``
            (default 0).
        """
        cross, variance = self._checked_test_covariances(cross_covariance, test_prior_variance)
        C, n = self.num_classes, self.mode.shape[-2]
        m = cross.shape[-2]
        batch = torch.broadcast_shapes(self._batch, cross.shape[:-3], variance.shape[:-2])
        cross = cross.expand(*batch, C, m, n)
        moving = self._prior_moves()
        alpha = self.alpha
        if moving:
            K, _, F_moving = self._moving_mode()
            gradient, hessian = self.terms.derivatives(self.train_targets, F_moving)
            # a = grad log p(y | f) at the mode: its derivative is -W times the mode's
            alpha = alpha + (gradient - gradient.detach())
        mean = (cross @ alpha.transpose(-1, -2).unsqueeze(-1)).squeeze(-1).transpose(-1, -2)
        if test_prior_mean is not None:
            like = {"dtype": mean.dtype, "device": mean.device}
            test_mean = check_finite(
                as_float_tensor(test_prior_mean, "test_prior_mean", **like), "test_prior_mean"
            )
            try:
                mean = mean + test_mean
            except RuntimeError as err:
                raise ValueError(
                    f"test_prior_mean {tuple(test_mean.shape)} must broadcast to (*b, m, K) = "
                    f"{tuple(mean.shape)}"
                ) from err
        # Q_*^T R Q_*: column (d, j) of Q_* holds k_d(X, x_j) in class d's block
        classes = torch.eye(C, dtype=cross.dtype, device=cross.device)
        columns = torch.einsum("...cji,cd->...icdj", cross, classes).reshape(*batch, n, C, C * m)
        R_Q = self._apply_R(columns).reshape(*batch, n, C, C, m)
        reduction = torch.einsum("...cji,...icdj->...jcd", cross, R_Q)  # shape: (*b, m, C, C)
        if moving:
            reduction = reduction + self._reduction_derivative(K, -hessian, columns, R_Q)
        covariance = torch.diag_embed(variance.expand(*batch, C, m).transpose(-1, -2)) - reduction
        return mean, covariance

    def _reduction_derivative(
        self, K: Tensor, W_moving: Tensor, columns: Tensor, R_Q: Tensor
    ) -> Tensor:
        r"""Zero, with the derivative of :math:`\mathbf Q_*^\top \mathbf R \mathbf Q_*` through
        :math:`\mathbf K` and :math:`\mathbf W(\hat{\mathbf f})` (``W_moving`` carries the
        mode's derivative): :math:`\partial\mathbf R = -\mathbf R\, \partial\mathbf K\,
        \mathbf R + \mathbf V^\top \partial\mathbf W\, \mathbf V`-type terms with
        :math:`\mathbf V = (\mathbf I + \mathbf K \mathbf W)^{-1} \mathbf Q_* = \mathbf Q_* -
        \mathbf K \mathbf R \mathbf Q_*`, shape ``(*b, m, C, C)``."""
        RQ = R_Q.detach()  # (*b, n, C, C, m): [i, e, c, j] = row (e, i) of R Q_*, column (c, j)
        K_fixed = K.detach()
        dK_RQ = torch.einsum("...eil,...lecj->...iecj", K - K_fixed, RQ)
        through_K = torch.einsum("...iecj,...iedj->...jcd", RQ, dK_RQ)
        Q = columns.detach().reshape(RQ.shape)
        V = Q - torch.einsum("...eil,...lecj->...iecj", K_fixed, RQ)
        dW = W_moving - W_moving.detach()  # shape: (*b, n, C, C)
        through_W = torch.einsum("...iecj,...ief,...ifdj->...jcd", V, dW, V)
        return through_W - through_K

    def class_probabilities(
        self,
        cross_covariance: Tensor,
        test_prior_variance: Tensor,
        test_prior_mean: Tensor | float | None = None,
        *,
        num_samples: int = 4096,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        r"""The predictive class probabilities (for soft targets: the expected soft target)
        :math:`\mathbb E[\mathbf r(\mathbf f_*)]`, :math:`\mathbf f_* \sim
        \mathcal N(\boldsymbol\mu_*, \boldsymbol\Sigma_*)` of :meth:`predictive`, by Monte Carlo,
        shape ``(*b, m, K)``, rows on the simplex.

        .. math::

            \mathbb E[\mathbf r(\mathbf f_*)] \approx \frac1S \sum_{s=1}^S
            \mathbf r\bigl(\boldsymbol\mu_* + \boldsymbol\Sigma_*^{1/2} \mathbf z_s\bigr),
            \qquad \mathbf z_s \sim \mathcal N(\mathbf 0, \mathbf I),

        with :math:`\mathbf r` the likelihood's response (softmax, or the continuous
        categorical's mean): :func:`~gpsd.laplace.multiclass_expectation` of :meth:`predictive`,
        the same draws for every point (a point's probabilities do not depend on the points
        predicted with it), from ``generator`` (default: a CPU generator seeded with 0, so the
        result is reproducible and the same on every device). The standard error of each entry
        is at most :math:`0.5/\sqrt S`.

        :param cross_covariance: As for :meth:`predictive`.
        :param test_prior_variance: As for :meth:`predictive`.
        :param test_prior_mean: As for :meth:`predictive`.
        :param num_samples: :math:`S`.
        :param generator: A ``torch.Generator`` for the draws.
        """
        with torch.no_grad():
            mean, covariance = self.predictive(
                cross_covariance, test_prior_variance, test_prior_mean
            )
            return multiclass_expectation(
                self.terms.response, mean, covariance, num_samples, generator
            )
