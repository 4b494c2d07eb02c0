r"""The Laplace approximation of a GP posterior, given the prior at the training inputs and the
likelihood terms: its mode, evidence and latent predictive in one object."""

from __future__ import annotations

import torch
from linear_operator.operators import LinearOperator
from torch import Tensor

from gpsd._internal.validation import (
    as_float_tensor,
    check_finite,
    check_positive_float,
    check_same_device,
)
from gpsd.laplace.likelihood_terms import LaplaceLikelihoodTerms
from gpsd.laplace.marginal_likelihood import (
    _check_stationary,
    differentiable_mode,
    laplace_log_marginal_likelihood,
)
from gpsd.laplace.newton import LaplaceMode, find_laplace_mode
from gpsd.laplace.predictive import laplace_latent_predictive
from gpsd.laplace.resolve import resolve_likelihood_terms

__all__ = ["LaplacePosterior"]


class LaplacePosterior:
    r"""The Laplace approximation :math:`q(\mathbf f \mid \mathbf y) = \mathcal N(\hat{\mathbf f},
    (\mathbf K^{-1} + \mathbf W)^{-1})` of a GP posterior (Rasmussen & Williams, §3.4), for a prior
    :math:`\mathbf f \sim \mathcal N(\mathbf m, \mathbf K)` at the training inputs and the
    likelihood :math:`p(\mathbf y \mid \mathbf f)^\tau` (``terms`` raised to ``temperature``).

    The mode :math:`\hat{\mathbf f}` maximises :math:`\log \mathcal N(\mathbf f; \mathbf m,
    \mathbf K) + \tau \log p(\mathbf y \mid \mathbf f)` by Newton's method in the stable form of
    Algorithm 3.1 (:func:`~gpsd.laplace.find_laplace_mode`, without autograd). With

    .. math::

        \mathbf W = -\tau \nabla\nabla \log p(\mathbf y \mid \hat{\mathbf f}), \qquad
        \mathbf B = \mathbf I + \mathbf W^{1/2} \mathbf K \mathbf W^{1/2} = \mathbf L
        \mathbf L^\top, \qquad
        \hat{\mathbf a} = \mathbf K^{-1}(\hat{\mathbf f} - \mathbf m)
        = \tau \nabla \log p(\mathbf y \mid \hat{\mathbf f}),

    the approximate log marginal likelihood (eq. 3.32) is

    .. math::

        \log q(\mathbf y) = -\tfrac12 \hat{\mathbf a}^\top (\hat{\mathbf f} - \mathbf m)
        + \tau \log p(\mathbf y \mid \hat{\mathbf f}) - \sum_i \log L_{ii},

    and the latent predictive at test inputs (Algorithm 3.2, with the prior mean)

    .. math::

        \mu_* = m(\mathbf x_*) + \mathbf k_*^\top \hat{\mathbf a}, \qquad
        \sigma_*^2 = k_{**} - \mathbf v^\top \mathbf v, \quad
        \mathbf v = \mathbf L^{-1} \mathbf W^{1/2} \mathbf k_*.

    :meth:`log_marginal_likelihood` carries the total derivative in whatever ``prior_mean``,
    ``prior_covariance`` (and the likelihood's parameters) have autograd history from, including
    the dependence of the mode on them (:func:`~gpsd.laplace.laplace_log_marginal_likelihood`);
    so does :meth:`predictive` where the prior carries a graph and gradients are enabled
    (:func:`~gpsd.laplace.differentiable_mode`). Every tensor broadcasts over the batch
    ``(*b)`` of the prior mean, the prior covariance and the targets, which holds independent
    problems.

    :param prior_mean: :math:`\mathbf m`, shape ``(*b, N)``.
    :param prior_covariance: :math:`\mathbf K`, shape ``(*b, N, N)``: a tensor, or a
        ``LinearOperator`` (a GPyTorch kernel's output), made dense. Its dtype (float32 or
        float64) is the posterior's.
    :param terms: The likelihood terms (log-concave), or a name or GPyTorch likelihood that
        :func:`~gpsd.laplace.resolve_likelihood_terms` maps to terms.
    :param train_y: Targets, shape ``(*b, N)``, in the support of the likelihood; converted to
        the posterior's dtype.
    :param init_f: A start for Newton's method ``(*b, N)`` (a previous mode), converted to the
        posterior's dtype; default :math:`\mathbf m`.
    :param mode: The converged :class:`~gpsd.laplace.LaplaceMode` of this very problem (a fit kept
        from before, say for a prior recomputed with autograd history); Newton's method is then
        skipped. Refused unless it is stationary for ``prior_mean`` and ``prior_covariance`` and
        was found at ``temperature``.
    :param temperature: :math:`\tau > 0`, the power of the likelihood.
    :param max_iter: Newton iterations allowed.
    :param objective_tol: Newton's tolerance on the objective (see
        :func:`~gpsd.laplace.find_laplace_mode`; default by dtype).
    :param f_tol: Newton's tolerance on :math:`\mathbf f` (default by dtype).
    :param check_targets: Check ``train_y`` against the likelihood's support; ``False`` for soft
        targets in :math:`[0, 1]` under a Bernoulli likelihood.
    :raises ValueError: for shapes that do not fit ``(*b, N)`` and ``(*b, N, N)``, non-finite
        values, or a ``mode`` that does not belong to this problem, each naming the argument.
    :raises TypeError: for tensors that are not floating point or in another dtype than
        ``prior_covariance``.
    :raises ~gpsd.LaplaceConvergenceError: where Newton's method does not converge.

    :ivar mode: The :class:`~gpsd.laplace.LaplaceMode` (:math:`\hat{\mathbf f}`,
        :math:`\hat{\mathbf a}`, :math:`\mathbf W`, :math:`\mathbf L`, the evidence's value).
    :ivar prior_mean: :math:`\mathbf m`, ``(*b, N)`` as given.
    :ivar prior_covariance: :math:`\mathbf K`, ``(*b, N, N)`` (dense).
    :ivar terms: The resolved likelihood terms.
    :ivar train_y: The targets, ``(*b, N)``.

    Example:

        >>> K = kernel(x).to_dense()  # shape: (N, N), with the kernel's autograd history
        >>> post = LaplacePosterior(torch.zeros(len(x)), K, BernoulliLogitTerms(), y)
        >>> (-post.log_marginal_likelihood()).backward()  # gradients in the kernel's parameters
        >>> mean, var = post.predictive(kernel(test_x, x).to_dense(), kernel(test_x, diag=True))
    """

    def __init__(
        self,
        prior_mean: Tensor,
        prior_covariance: Tensor | LinearOperator,
        terms: LaplaceLikelihoodTerms | object,
        train_y: Tensor,
        *,
        init_f: Tensor | None = None,
        mode: LaplaceMode | None = None,
        temperature: float = 1.0,
        max_iter: int = 100,
        objective_tol: float | None = None,
        f_tol: float | None = None,
        check_targets: bool = True,
    ) -> None:
        self.terms = resolve_likelihood_terms(terms)
        self.temperature = check_positive_float(temperature, "temperature")
        self.prior_covariance = _checked_covariance(prior_covariance)
        n = self.prior_covariance.shape[-1]
        dtype = self.prior_covariance.dtype
        self.prior_mean = _checked_vector(prior_mean, "prior_mean", n, dtype)
        self.train_y = _checked_vector(
            as_float_tensor(train_y, "train_y", dtype=dtype), "train_y", n
        )
        if check_targets:
            self.terms.check_targets(self.train_y, "train_y")
        if init_f is not None:
            init_f = _checked_vector(as_float_tensor(init_f, "init_f", dtype=dtype), "init_f", n)
        for tensor, name in ((self.prior_mean, "prior_mean"), (self.train_y, "train_y")):
            check_same_device(self.prior_covariance, tensor, name, "prior_covariance")
        if init_f is not None:
            check_same_device(self.prior_covariance, init_f, "init_f", "prior_covariance")
        _check_batch(self.prior_mean, self.prior_covariance, self.train_y, init_f)
        if mode is None:
            mode = find_laplace_mode(
                self.prior_covariance.detach(),
                self.train_y,
                self.terms,
                prior_mean=self.prior_mean.detach(),
                init_f=init_f,
                temperature=self.temperature,
                max_iter=max_iter,
                objective_tol=objective_tol,
                f_tol=f_tol,
                check_targets=False,  # checked above
            )
        elif init_f is not None:
            raise ValueError("pass either mode or init_f, not both: a given mode is not refitted")
        else:
            self._check_mode(mode)
        self.mode: LaplaceMode = mode

    def _check_mode(self, mode: object) -> None:
        if not isinstance(mode, LaplaceMode):
            raise TypeError(f"mode must be a LaplaceMode, got {type(mode).__name__}")
        if mode.temperature != self.temperature:
            raise ValueError(
                f"mode was found at temperature {mode.temperature}, but temperature="
                f"{self.temperature}; pass the temperature the mode was found at"
            )
        mode.check_dtype(self.prior_covariance, "prior_covariance")
        _check_stationary(self.prior_covariance, self.prior_mean, mode)

    def _graph_needed(self) -> bool:
        """Whether gradients are enabled and the prior (or the likelihood) carries a graph."""
        if not torch.is_grad_enabled():
            return False
        if self.prior_mean.requires_grad or self.prior_covariance.requires_grad:
            return True
        return self.terms.derivatives(self.train_y, self.mode.f)[0].requires_grad

    def log_marginal_likelihood(self) -> Tensor:
        r""":math:`\log q(\mathbf y)`, shape ``(*b,)``, with its total derivative in whatever the
        prior and the likelihood have autograd history from (the mode's own dependence on them
        included; :func:`~gpsd.laplace.laplace_log_marginal_likelihood`). Its value is
        ``mode.log_marginal_likelihood``."""
        return laplace_log_marginal_likelihood(
            self.prior_covariance,
            self.train_y,
            self.terms,
            self.mode,
            prior_mean=self.prior_mean,
            temperature=self.temperature,
        )

    def predictive(
        self,
        cross_covariance: Tensor,
        test_prior_covariance: Tensor,
        test_prior_mean: Tensor | None = None,
        *,
        diag: bool | None = None,
    ) -> tuple[Tensor, Tensor]:
        r"""The latent predictive mean ``(*b, M)`` and variance ``(*b, M)`` (or covariance
        ``(*b, M, M)``) at test inputs, :math:`\mu_* = m_* + \mathbf k_*^\top \hat{\mathbf a}` and
        :math:`\Sigma_* = \mathbf K_{**} - \mathbf v^\top \mathbf v` (see the class).

        Where gradients are enabled and the prior carries autograd history, the mode's
        derivative is attached first (:func:`~gpsd.laplace.differentiable_mode`): the
        predictions then carry the total derivative, not a partial one through the test
        covariances alone. Variances are returned as computed (a difference, which rounding may
        take slightly below 0).

        :param cross_covariance: :math:`k(\mathbf x_*, \mathbf X)`, shape ``(*b, M, N)``.
        :param test_prior_covariance: :math:`k(\mathbf x_*, \mathbf x_*)`: its diagonal
            ``(*b, M)`` (variances returned) or the full matrix ``(*b, M, M)``.
        :param test_prior_mean: :math:`m(\mathbf x_*)`, shape ``(*b, M)`` (default 0).
        :param diag: Whether ``test_prior_covariance`` is the diagonal (by default read from its
            shape, as :func:`~gpsd.laplace.laplace_latent_predictive` does).
        :raises ValueError: for a ``cross_covariance`` whose last dimension is not ``N`` or
            tensors in another dtype than the posterior.
        """
        n = self.prior_covariance.shape[-1]
        if not isinstance(cross_covariance, Tensor) or cross_covariance.dim() < 2:
            raise ValueError(
                f"cross_covariance must be a tensor of shape (*b, M, {n}), got "
                f"{getattr(cross_covariance, 'shape', type(cross_covariance).__name__)}"
            )
        if cross_covariance.shape[-1] != n:
            raise ValueError(
                f"cross_covariance must have shape (*b, M, {n}) (one column per training "
                f"input), got shape {tuple(cross_covariance.shape)}"
            )
        mode = self.mode
        if self._graph_needed():
            mode = differentiable_mode(
                self.prior_covariance, self.train_y, self.terms, mode, self.prior_mean
            )
        return laplace_latent_predictive(
            mode, cross_covariance, test_prior_covariance, test_prior_mean, diag=diag
        )

    def covariance_correction(self) -> Tensor:
        r""":math:`(\mathbf K + \mathbf W^{-1})^{-1} = \mathbf W^{1/2} \mathbf B^{-1}
        \mathbf W^{1/2}`, shape ``(*b, N, N)``, symmetric: the posterior covariance of the
        latents at any inputs is :math:`k(\mathbf x, \mathbf x') - k(\mathbf x, \mathbf X)
        (\mathbf K + \mathbf W^{-1})^{-1} k(\mathbf X, \mathbf x')`. Without autograd history."""
        sqrt_W, chol_B = self.mode.sqrt_W, self.mode.chol_B
        eye = torch.eye(sqrt_W.shape[-1], dtype=sqrt_W.dtype, device=sqrt_W.device)
        inverse_B = torch.cholesky_solve(eye.expand_as(chol_B), chol_B)
        S = sqrt_W.unsqueeze(-1) * inverse_B * sqrt_W.unsqueeze(-2)
        return 0.5 * (S + S.transpose(-1, -2))


def _checked_covariance(value: object) -> Tensor:
    """``prior_covariance`` as a dense, finite, float32 or float64 ``(*b, N, N)`` tensor."""
    if isinstance(value, LinearOperator):
        value = value.to_dense()
    if not isinstance(value, Tensor):
        raise TypeError(
            f"prior_covariance must be a tensor or LinearOperator, got {type(value).__name__}"
        )
    if value.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"prior_covariance must be float32 or float64, got dtype {value.dtype}")
    if value.dim() < 2 or value.shape[-1] != value.shape[-2] or value.shape[-1] == 0:
        raise ValueError(
            f"prior_covariance must have shape (*b, N, N) with N >= 1, got {tuple(value.shape)}"
        )
    return check_finite(value, "prior_covariance")


def _checked_vector(value: object, name: str, n: int, dtype: torch.dtype | None = None) -> Tensor:
    """``value`` as a finite ``(*b, n)`` tensor; with ``dtype``, it must be a tensor of it."""
    if dtype is not None:
        if not isinstance(value, Tensor):
            raise TypeError(
                f"{name} must be a tensor of shape (*b, {n}), got {type(value).__name__}"
            )
        if value.dtype != dtype:
            raise TypeError(
                f"{name} has dtype {value.dtype} but prior_covariance has {dtype}; pass both in "
                "one dtype"
            )
    if value.dim() < 1 or value.shape[-1] != n:
        raise ValueError(
            f"{name} must have shape (*b, {n}) (N = {n} from prior_covariance), got shape "
            f"{tuple(value.shape)}"
        )
    return check_finite(value, name)


def _check_batch(m: Tensor, K: Tensor, y: Tensor, init_f: Tensor | None) -> None:
    """Raise a ``ValueError`` unless the batch shapes of the arguments broadcast."""
    named = {"prior_mean": m.shape[:-1], "prior_covariance": K.shape[:-2], "train_y": y.shape[:-1]}
    if init_f is not None:
        named["init_f"] = init_f.shape[:-1]
    try:
        torch.broadcast_shapes(*named.values())
    except RuntimeError as err:
        shapes = ", ".join(f"{name} {tuple(shape)}" for name, shape in named.items())
        raise ValueError(f"the batch shapes do not broadcast: {shapes}") from err
