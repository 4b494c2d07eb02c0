r"""The log-normaliser of the continuous categorical distribution and its gradient, the mean.

The continuous categorical (Gordon-Rodriguez, Loaiza-Ganem & Cunningham, 2020) with natural
parameters :math:`\boldsymbol\eta \in \mathbb R^K` has the density
:math:`p(\mathbf x \mid \boldsymbol\eta) = \exp(\boldsymbol\eta^\top \mathbf x - A(\boldsymbol\eta))`
on the simplex :math:`\{\mathbf x \ge 0, \sum_k x_k = 1\}`, with respect to Lebesgue measure on
its first :math:`K - 1` coordinates. The normaliser is the divided difference of :math:`\exp` at
the nodes :math:`\eta_1, \dots, \eta_K` (Hermite-Genocchi):

.. math::

    e^{A(\boldsymbol\eta)} = \int_{\Delta} e^{\boldsymbol\eta^\top \mathbf x}\, d\mathbf x
    = \exp[\eta_1, \dots, \eta_K]
    = \sum_{k=1}^K \frac{e^{\eta_k}}{\prod_{i \ne k} (\eta_k - \eta_i)},

where the closed form on the right holds for distinct parameters and cancels catastrophically
when they are close (Gordon-Rodriguez et al., 2022). :math:`A(\boldsymbol\eta + c\mathbf 1)
= A(\boldsymbol\eta) + c`, and the gradient is the mean,
:math:`\partial A / \partial \eta_k = \mathbb E[x_k] = \exp[\boldsymbol\eta, \eta_k] /
\exp[\boldsymbol\eta]` (the divided difference with :math:`\eta_k` repeated).

**Algorithm.** The parameters are sorted, :math:`d_1 \ge \dots \ge d_K`, and shifted by the
maximum (so :math:`A = d_1 + \log \exp[\mathbf d - d_1]` and nothing overflows). The table
:math:`D_{ij} = \exp[d_i, \dots, d_j]` is filled by increasing :math:`j - i`:

* where the nodes are far apart, :math:`d_i - d_j > 3 (j - i)`, by Newton's recurrence
  :math:`D_{ij} = (D_{i,j-1} - D_{i+1,j}) / (d_i - d_j)`: moving one node from :math:`d_i`
  down to :math:`d_j` then shrinks the divided difference enough that the subtraction cancels
  little (the measured errors below include it);
* elsewhere by the Taylor series about the smallest node, every term positive (the
  complete homogeneous symmetric polynomials :math:`h_m` of non-negative arguments):

  .. math::

      D_{ij} = e^{d_j} \sum_{m \ge 0} \frac{h_m(d_i - d_j, \dots, d_{j-1} - d_j, 0)}{(m + j - i)!},

  summed for all such entries at once as the Taylor series of the exponential of the bidiagonal
  matrix of Opitz's formula (diagonal :math:`\mathbf d - d_j \ge 0`, superdiagonal 1), to
  ten standard deviations of the Poisson weights :math:`\tau^m e^{-\tau} / m!` beyond the
  largest spread :math:`\tau` of a Taylor entry, plus :math:`K + 15` terms.

:math:`K = 2` is :math:`A = \max(\boldsymbol\eta) + A_{\mathrm{CB}}(-|\eta_1 - \eta_2|)` with the
continuous-Bernoulli log-normaliser (:func:`~gpsd.likelihoods.cb_log_normalizer`), whose
logarithm near 1 needs its series. The computation runs in float64 whatever the input dtype, and
the result is rounded to it.

**Accuracy.** Against mpmath at 50 digits, over 26,000 random configurations of
:math:`3 \le K \le 20` parameters in up to 8 clusters (spread within a cluster from 0, a tie, to
6; gaps between clusters from 0.01 to :math:`6 \times 10^3`; parameters up to :math:`10^4` in
magnitude) and the configurations at the Taylor/Newton boundary, the absolute error of
:math:`A` stays below :math:`3\,\epsilon \max(|A|, |A - \max_k \eta_k|)` in float64 (largest
seen: :math:`2.45\,\epsilon`, at :math:`K = 3`; the
second term matters only where :math:`A` itself is near 0, where :math:`\max_k \eta_k` and
:math:`\log \exp[\mathbf d - d_1]` cancel in the final addition) and below one
:math:`\epsilon` of the same scale in float32. The gradient, the mean, is the derivative of
this computation by autograd (in float64); it agrees with mpmath's to a relative
:math:`10^{-13}` in every entry (largest seen: :math:`1.7 \times 10^{-14}`, over about 1,600 of
those configurations with :math:`K \le 10`).

The cost is :math:`O(K^2)` operations per parameter vector and Taylor term, with
:math:`\tau + 10\sqrt\tau + K + 15` terms for the largest spread :math:`\tau \le 3(K - 1)`
of a Taylor entry in the batch, for :math:`A` and again for its gradient. Where
:math:`\exp[\mathbf d - d_1]`, about :math:`(\max \boldsymbol\eta - \min \boldsymbol\eta)^{1-K}`,
underflows float64 (a spread beyond about :math:`10^{14}` at :math:`K = 20`), a ``ValueError``
says so.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from gpsd.likelihoods.log_normalizer import cb_log_normalizer

__all__ = ["cc_log_normalizer", "cc_mean"]

#: Newton's recurrence is used for D_ij where d_i - d_j > _NEWTON_RATIO * (j - i)
_NEWTON_RATIO = 3.0
#: rows of parameter vectors processed at once, so that the (rows, K, K) tables stay small
_CHUNK_ELEMENTS = 1 << 22


def _check_eta(eta: Tensor, name: str = "eta") -> Tensor:
    if not isinstance(eta, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(eta)}")
    if not eta.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {eta.dtype}")
    if eta.dim() == 0 or eta.shape[-1] < 2:
        raise ValueError(
            f"{name} must have shape (*batch, K) with K >= 2 categories, got shape "
            f"{tuple(eta.shape)}"
        )
    if not bool(torch.isfinite(eta).all()):
        raise ValueError(f"{name} must be finite, but it holds NaN or infinite values")
    return eta


def _divided_difference(d: Tensor) -> Tensor:
    r""":math:`\exp[d_1, \dots, d_K]` for rows ``d`` of shape ``(B, K)``, float64, sorted in
    decreasing order with :math:`d_1 = 0`."""
    K = d.shape[-1]
    # the largest spread a Taylor entry has: at most 3 (K - 1), and at most the widest row's
    spread = float(-d[..., -1].detach().min()) if d.shape[0] else 0.0
    tau = min(_NEWTON_RATIO * (K - 1), spread)
    num_terms = math.ceil(tau + 10.0 * math.sqrt(tau)) + K + 15
    # column j of the Taylor table: exp(Z_j) e_j / e^{d_j}, Z_j = diag(d - d_j) + superdiagonal,
    # summed as sum_n Z_j^n e_j / n!; rows i with d_i - d_j > tau are not used (clamped to
    # stay finite)
    shifted = (d.unsqueeze(-2) - d.unsqueeze(-1)).clamp(0.0, tau)  # (B, j, k): d_k - d_j
    term = torch.eye(K, dtype=d.dtype, device=d.device).expand(shifted.shape)
    total = term.clone()
    zero_column = torch.zeros_like(shifted[..., :1])
    for n in range(1, num_terms):
        term = (shifted * term + torch.cat([term[..., 1:], zero_column], dim=-1)) / n
        total = total + term
    table = total.transpose(-1, -2) * torch.exp(d).unsqueeze(-2)  # (B, i, j): exp[d_i..d_j]
    for offset in range(1, K):
        i = torch.arange(0, K - offset, device=d.device)
        j = i + offset
        spread = d[..., i] - d[..., j]
        far = spread > _NEWTON_RATIO * offset
        newton = (table[..., i, j - 1] - table[..., i + 1, j]) / torch.where(
            far, spread, torch.ones_like(spread)
        )
        table[..., i, j] = torch.where(far, newton, table[..., i, j])
    return table[..., 0, K - 1]


def _chunked(function: Callable[[Tensor], Tensor], rows: Tensor) -> Tensor:
    """``function`` applied to row chunks of ``rows`` (shape ``(B, K)``), concatenated."""
    K = rows.shape[-1]
    size = max(1, _CHUNK_ELEMENTS // (K * K))
    if rows.shape[0] <= size:
        return function(rows)
    return torch.cat([function(chunk) for chunk in rows.split(size)])


def _check_positive(values: Tensor, eta: Tensor) -> None:
    if not bool((values > 0).all()):
        spread = float((eta.amax(-1) - eta.amin(-1)).max().detach())
        raise ValueError(
            f"eta spans {spread:.3g} within one parameter vector, where exp[eta - max(eta)], "
            f"about spread^(1 - K) / (K - 1)!, underflows float64; use parameters of a smaller "
            f"spread"
        )


def _log_normalizer(eta: Tensor) -> Tensor:
    """A(eta) in float64 for ``eta`` of shape ``(B, K)``, float64."""
    d, _ = torch.sort(eta, dim=-1, descending=True)
    top = d[..., 0]
    d = d - top.unsqueeze(-1)
    if d.shape[-1] == 2:
        return top + cb_log_normalizer(d[..., 1])
    values = _chunked(_divided_difference, d)
    _check_positive(values, eta)
    return top + torch.log(values)


def cc_log_normalizer(eta: Tensor) -> Tensor:
    r"""The log-normaliser :math:`A(\boldsymbol\eta) = \log \exp[\eta_1, \dots, \eta_K]` of the
    continuous categorical, accurate for every finite :math:`\boldsymbol\eta`.

    .. math::

        A(\boldsymbol\eta) = \log \int_\Delta e^{\boldsymbol\eta^\top \mathbf x}\, d\mathbf x
        = \log \sum_{k=1}^K \frac{e^{\eta_k}}{\prod_{i \ne k} (\eta_k - \eta_i)}.

    Differentiable by autograd through the float64 computation; its gradient is the mean
    (:func:`cc_mean`). See the module description for the method and its accuracy.

    :param eta: Natural parameters, shape ``(*batch, K)`` with :math:`K \ge 2`, finite.
    :return: :math:`A(\boldsymbol\eta)`, shape ``(*batch,)``, in the dtype of ``eta``.
    """
    _check_eta(eta)
    rows = eta.to(torch.float64).reshape(-1, eta.shape[-1])
    return _log_normalizer(rows).reshape(eta.shape[:-1]).to(eta.dtype)


def cc_mean(eta: Tensor) -> Tensor:
    r"""The mean :math:`\mathbb E[\mathbf x] = \nabla A(\boldsymbol\eta)` of the continuous
    categorical, a point inside the simplex.

    .. math::

        \mathbb E[x_k] = \frac{\partial A}{\partial \eta_k}
        = \frac{\exp[\eta_1, \dots, \eta_K, \eta_k]}{\exp[\eta_1, \dots, \eta_K]},

    computed as the gradient of :func:`cc_log_normalizer` by autograd in float64 (the derivative
    of each Taylor term and each Newton step). Not differentiable (the result is detached).

    :param eta: Natural parameters, shape ``(*batch, K)`` with :math:`K \ge 2`, finite.
    :return: :math:`\mathbb E[\mathbf x]`, shape ``(*batch, K)``, in the dtype of ``eta``.
    """
    _check_eta(eta)
    with torch.enable_grad():
        rows = eta.detach().to(torch.float64).reshape(-1, eta.shape[-1]).requires_grad_(True)
        (grad,) = torch.autograd.grad(_log_normalizer(rows).sum(), rows)
    return grad.reshape(eta.shape).to(eta.dtype)
