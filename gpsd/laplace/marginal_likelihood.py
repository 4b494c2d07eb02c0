r"""The Laplace log marginal likelihood, differentiable in the kernel and mean hyperparameters."""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from gpsd._internal.validation import check_positive_float
from gpsd.laplace.likelihood_terms import LaplaceLikelihoodTerms
from gpsd.laplace.newton import LaplaceMode

__all__ = ["differentiable_mode", "laplace_log_marginal_likelihood"]


def differentiable_mode(
    K: Tensor, y: Tensor, terms: LaplaceLikelihoodTerms, mode: LaplaceMode, prior_mean: Tensor
) -> LaplaceMode:
    r"""``mode`` with the derivatives of the mode in the hyperparameters attached.

    The mode :math:`\hat{\mathbf f}(\theta)` is found by iteration, without autograd. Its total
    derivative :math:`\partial \hat{\mathbf f} = (\mathbf I + \mathbf K \mathbf W)^{-1}
    (\partial \mathbf m + \partial \mathbf K\, \mathbf a + \mathbf K \partial_\theta
    \mathbf g)`, :math:`\mathbf g = \tau \nabla \log p(\mathbf y \mid \hat{\mathbf f})`
    (R&W eqs. 5.22-5.24; the last term for likelihood parameters), is carried by the surrogate
    :math:`\tilde{\mathbf f}(\theta) = \hat{\mathbf f} + (\mathbf I + \mathbf K
    \mathbf W)^{-1}[(\mathbf m + \mathbf K \mathbf g) - \operatorname{sg}(\mathbf m +
    \mathbf K \mathbf g)]` (value :math:`\hat{\mathbf f}`). The returned mode holds
    :math:`\tilde{\mathbf f}`, :math:`\mathbf a` with the derivative of
    :math:`\tau\nabla\log p(\mathbf y \mid \tilde{\mathbf f})` (equal to :math:`\mathbf a`
    at the mode), and :math:`\mathbf W`, :math:`\mathbf W^{1/2}` and the Cholesky factor of
    :math:`\mathbf B` recomputed at :math:`\tilde{\mathbf f}` with ``K`` (values those of
    ``mode`` up to rounding): whatever is computed from it (the marginal likelihood, predictive
    means and variances) has the total derivative.

    :param K: Prior covariance of the training latents with autograd history, ``(*batch, n, n)``.
    :param y: Targets, ``(*batch, n)``.
    :param terms: The likelihood terms used to find ``mode``.
    :param mode: The converged mode at the current value of ``K`` and ``prior_mean``.
    :param prior_mean: Prior mean with autograd history, ``(*batch, n)``.
    """
    tau = mode.temperature
    a = mode.alpha.detach()
    f_hat = mode.f.detach()
    sqrt_W = mode.sqrt_W.detach()
    chol_B = mode.chol_B.detach()
    # g = tau d/df log p(y | f_hat) equals a at the mode; it carries the dependence on likelihood
    # parameters (autograd terms)
    g = tau * terms.derivatives(y, f_hat)[0]
    if not g.requires_grad:
        g = a
    fitted = prior_mean + (K @ g.unsqueeze(-1)).squeeze(-1)  # value f_hat, carries its derivative
    delta = fitted - fitted.detach()  # value 0
    # (I + K W)^{-1} delta = delta - K W^1/2 B^{-1} W^1/2 delta
    inner = torch.cholesky_solve((sqrt_W * delta).unsqueeze(-1), chol_B).squeeze(-1)
    f_tilde = f_hat + delta - (K.detach() @ (sqrt_W * inner).unsqueeze(-1)).squeeze(-1)
    d1, d2 = terms.derivatives(y, f_tilde)
    gradient = tau * d1
    W = (-tau * d2).clamp_min(torch.finfo(K.dtype).tiny)
    s = W.sqrt()
    B = s.unsqueeze(-1) * K * s.unsqueeze(-2)
    B = B + torch.eye(K.shape[-1], dtype=K.dtype, device=K.device)
    return dataclasses.replace(
        mode,
        f=f_tilde,
        alpha=a + (gradient - gradient.detach()),
        W=W,
        sqrt_W=s,
        chol_B=torch.linalg.cholesky(B),
    )


def _check_stationary(K: Tensor, prior_mean: Tensor, mode: LaplaceMode) -> None:
    r"""Raise a ``ValueError`` unless ``mode`` is the mode for ``K`` and ``prior_mean``.

    At the mode :math:`\hat{\mathbf f} = \mathbf m + \mathbf K \mathbf a`, with
    :math:`\mathbf a = \tau \nabla \log p(\mathbf y \mid \hat{\mathbf f})` (which involves
    neither :math:`\mathbf K` nor :math:`\mathbf m`), so a mode found for another kernel matrix
    or prior mean (a forgotten ``prior_mean``, say) leaves a residual. The check is

    .. math::

        |\hat{\mathbf f} - \mathbf m - \mathbf K \mathbf a|_i \le \sqrt{\epsilon}\,
        \bigl(1 + |\hat f_i| + (|\mathbf K|\,|\mathbf a|)_i\bigr) \quad \text{for every } i.

    :math:`(|\mathbf K|\,|\mathbf a|)_i` bounds the round-off of :math:`(\mathbf K
    \mathbf a)_i`, measured at about :math:`\epsilon` times it (:math:`n` up to 1500, output
    scales up to :math:`10^8`); :math:`\sqrt{\epsilon}` also admits a ``K`` recomputed in
    float32 (:math:`10^{-4}` at worst). A forgotten prior mean or a doubled ``K`` gave
    :math:`10^{-2}` to 0.4 at moderate output scales, but as little as :math:`10^{-8}` for very
    smooth kernels at output scales of :math:`10^6` and more, where :math:`|\mathbf K|\,
    |\mathbf a|` dwarfs :math:`|\hat{\mathbf f}|`: the check may miss those.
    """
    with torch.no_grad():
        f, a = mode.f, mode.alpha
        K_a = (K.detach() @ a.unsqueeze(-1)).squeeze(-1)
        size = (K.detach().abs() @ a.abs().unsqueeze(-1)).squeeze(-1)
        residual = (f - prior_mean.detach() - K_a).abs() / (1.0 + f.abs() + size)
        worst = residual.max().item()
    if not worst <= torch.finfo(f.dtype).eps ** 0.5:  # NaN counts as a mismatch
        raise ValueError(
            "mode is not the mode for this K and prior_mean: f - prior_mean - K a is "
            f"{worst:.3g} relative to 1 + |f| + |K||a| (round-off allows "
            f"{torch.finfo(f.dtype).eps ** 0.5:.1g}); pass the K and prior_mean that "
            "find_laplace_mode was given"
        )


def laplace_log_marginal_likelihood(
    K: Tensor,
    y: Tensor,
    terms: LaplaceLikelihoodTerms,
    mode: LaplaceMode,
    prior_mean: Tensor | None = None,
    temperature: float = 1.0,
) -> Tensor:
    r"""The Laplace approximation of :math:`\log p(\mathbf y \mid \theta)` with its total derivative.

    .. math::

        \log q(\mathbf y \mid \theta) = -\tfrac12 \mathbf a^\top(\hat{\mathbf f} - \mathbf m)
        + \tau \log p(\mathbf y \mid \hat{\mathbf f}) - \tfrac12 \log |\mathbf B|,
        \qquad \mathbf B = \mathbf I + \mathbf W^{1/2}\mathbf K\mathbf W^{1/2}

    (Rasmussen & Williams eq. 3.32; Borup & Andersen A.2 for the continuous Bernoulli). The mode
    :math:`\hat{\mathbf f}` depends on :math:`\theta`; its derivative
    :math:`\partial \hat{\mathbf f} = (\mathbf I + \mathbf K \mathbf W)^{-1}(\partial \mathbf m +
    \partial \mathbf K\, \mathbf a + \mathbf K \partial_\theta \nabla \log p)` (the last term for
    likelihood parameters) enters through :math:`\mathbf W(\hat{\mathbf f})` in
    :math:`\log|\mathbf B|` (R&W eqs. 5.22-5.24; the other terms are stationary at the mode). This
    function builds a surrogate whose value is :math:`\log q` and whose autograd gradient is the
    total derivative: :math:`\tilde{\mathbf f}(\theta) = \hat{\mathbf f} + (\mathbf I + \mathbf K
    \mathbf W)^{-1}[(\mathbf m + \mathbf K \mathbf a) - \operatorname{sg}(\mathbf m + \mathbf K
    \mathbf a)]` (value :math:`\hat{\mathbf f}`, derivative :math:`\partial\hat{\mathbf f}`), and
    :math:`-\tfrac12 \mathbf a^\top \mathbf K^{-1}\mathbf a`-type terms are written without
    :math:`\mathbf K^{-1}`. The third derivative of the log-likelihood comes from autograd through
    ``terms.derivatives``.

    :param K: Prior covariance of the training latents with autograd history, ``(*batch, n, n)``.
    :param y: Targets, ``(*batch, n)``.
    :param terms: The likelihood terms used to find ``mode``.
    :param mode: The converged mode at the current value of ``K`` and ``prior_mean``.
    :param prior_mean: Prior mean with autograd history, ``(*batch, n)`` (default 0).
    :param temperature: :math:`\tau`, as used to find ``mode``.
    :return: :math:`\log q(\mathbf y \mid \theta)`, shape ``batch``.
    :raises ValueError: if ``temperature`` is not positive and finite, or is not the one ``mode``
        was found at, if ``K`` or ``prior_mean`` is in another dtype than ``mode``, or if
        ``mode`` is not the mode for ``K`` and ``prior_mean`` (:func:`_check_stationary`): the
        surrogate's value and gradient hold only at that mode.
    """
    tau = check_positive_float(temperature, "temperature")
    if tau != mode.temperature:
        raise ValueError(
            f"temperature={tau} differs from the temperature {mode.temperature} that mode was "
            "found at; pass the same temperature to find_laplace_mode and here"
        )
    mode.check_dtype(K, "K")
    mode.check_dtype(prior_mean, "prior_mean")
    a = mode.alpha.detach()
    like = {"dtype": mode.f.dtype, "device": mode.f.device}
    m = torch.zeros_like(mode.f) if prior_mean is None else torch.as_tensor(prior_mean, **like)
    _check_stationary(K, m, mode)
    surrogate = differentiable_mode(K, y, terms, mode, m)
    # -1/2 (f - m)^T K^{-1} (f - m) to first order around the mode, without K^{-1}
    quad = -(a * (surrogate.f - m)).sum(-1)
    quad = quad + 0.5 * (a * (K @ a.unsqueeze(-1)).squeeze(-1)).sum(-1)
    data_fit = tau * terms.log_prob(y, surrogate.f).sum(-1)
    half_logdet = torch.diagonal(surrogate.chol_B, dim1=-2, dim2=-1).log().sum(-1)
    return quad + data_fit - half_logdet
