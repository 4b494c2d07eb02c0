"""Spectral filters ``f(K)`` of a kernel matrix used by self-distillation."""

from __future__ import annotations

import contextlib
import math
import numbers
from collections.abc import Callable

import torch
from torch import Tensor

from gpsd.linalg._algebra import EigenvalueAlgebra, PowerSeriesAlgebra

__all__ = ["SpectralFilter"]


class SpectralFilter:
    r"""A stack of scalar functions :math:`f_1, \dots, f_F` applied to a symmetric kernel matrix.

    For :math:`\mathbf K = \mathbf V \operatorname{diag}(\mathbf d) \mathbf V^\top` the filter acts as

    .. math::
        f(\mathbf K) = \mathbf V \operatorname{diag}\big(f(d_1), \dots, f(d_N)\big) \mathbf V^\top .

    A filter knows two things about each :math:`f`: its values at given eigenvalues
    (:meth:`values`) and its Taylor coefficients at :math:`d = 0` (:meth:`series`), which the
    low-rank backends of :class:`~gpsd.linalg.KernelSpectrum` apply to the part of the spectrum they
    did not resolve.

    The filters of self-distillation are built by the class methods:

    * :meth:`data_centric_targets`: the targets :math:`\mathbf y_t = F_t(\mathbf K)\mathbf y` after
      :math:`t` data-centric steps (Borup & Andersen, Prop. 3.1, eq. 4), with the optional
      :math:`\alpha`-mixing of the original targets,

      .. math::
          F_0 = 1, \qquad F_t(d) = \alpha + (1 - \alpha) \frac{d}{d + \gamma_t} F_{t-1}(d);

    * :meth:`data_centric_weights`: :math:`G_t(d) = F_{t-1}(d) / (d + \gamma_t)`, so that the mean at
      test inputs after step :math:`t` (eq. 5) is :math:`\mathbf K_{*X} G_t(\mathbf K) \mathbf y`;
    * :meth:`resolvent`: :math:`R_t(d) = 1 / (d + \gamma_t)`, giving posterior variances.

    The stack has shape ``(*s, T)``: a batch of schedules ``*s`` with ``T`` steps each. The class
    methods check their arguments: ``noise`` a floating-point tensor of shape ``(*s, T)`` with
    ``T >= 1`` finite positive shifts, ``alpha`` in :math:`[0, 1]`. Eigenvalues below zero,
    rounding errors of a positive semi-definite kernel, are evaluated as 0 (see
    :class:`~gpsd.linalg._algebra.EigenvalueAlgebra`).

    :param evaluate: maps an :class:`~gpsd.linalg._algebra.EigenvalueAlgebra` or
        :class:`~gpsd.linalg._algebra.PowerSeriesAlgebra` to the stacked filter, shape ``(*s, T, k)``
        or ``(*s, T, J + 1)``.
    :param noise: the schedule the filter was built from, shape ``(*s, T)``.
    :param is_resolvent: whether the filter is :meth:`resolvent` (shifted-solve backends apply it
        specially).
    :param rebuild: builds the same filter from another schedule, for :meth:`to` (``None``: the
        filter keeps its schedule's dtype and device).
    """

    def __init__(
        self,
        evaluate: Callable[[object], Tensor],
        noise: Tensor,
        is_resolvent: bool = False,
        rebuild: Callable[[Tensor], SpectralFilter] | None = None,
    ) -> None:
        self._evaluate = evaluate
        self.noise = noise
        #: ``True`` for :meth:`resolvent` filters, which shifted-solve backends apply specially.
        self.is_resolvent = is_resolvent
        self._rebuild = rebuild

    @property
    def batch_shape(self) -> torch.Size:
        return self.noise.shape[:-1]

    @property
    def num_filters(self) -> int:
        return self.noise.shape[-1]

    def to(self, dtype: torch.dtype, device: torch.device | None = None) -> SpectralFilter:
        """The same filter with its schedule in ``dtype`` (and on ``device``), so that its values
        and series are computed there.

        A backend evaluates every filter in its own dtype: a float32 schedule (as
        ``torch.tensor([0.1])`` makes) must not cost a float64 spectrum its precision, nor a
        float64 schedule fail on a float32 one.
        """
        device = self.noise.device if device is None else torch.device(device)
        if self._rebuild is None or (self.noise.dtype == dtype and self.noise.device == device):
            return self
        return self._rebuild(self.noise.to(dtype=dtype, device=device))

    def evaluate(self, algebra: object) -> Tensor:
        """Evaluate the stacked filter in ``algebra`` (values, power series or applied vectors)."""
        return self._evaluate(algebra)

    def values(self, eigenvalues: Tensor) -> Tensor:
        """Filter values at ``eigenvalues`` of shape ``(*b, k)``; returns ``(*broadcast(s, b), T, k)``.

        Negative eigenvalues (rounding errors of a positive semi-definite kernel) count as 0.
        """
        return self._evaluate(EigenvalueAlgebra(eigenvalues))

    def series(self, order: int) -> Tensor:
        """Taylor coefficients at 0 up to ``order``; returns ``(*s, T, order + 1)``."""
        return self._evaluate(PowerSeriesAlgebra(order, self.noise.dtype, self.noise.device))

    # ----------------------------------------------------------------------------------------
    @classmethod
    def data_centric_targets(cls, noise: Tensor, alpha: float = 0.0) -> SpectralFilter:
        """:math:`F_t` for ``t = 1..T``: the training targets after each data-centric step."""
        noise, alpha = _check_schedule(noise), _check_alpha(alpha)
        return cls(
            lambda alg: _data_centric(alg, noise, alpha)[0],
            noise,
            rebuild=lambda g: cls.data_centric_targets(g, alpha),
        )

    @classmethod
    def data_centric_weights(cls, noise: Tensor, alpha: float = 0.0) -> SpectralFilter:
        """:math:`G_t = F_{t-1} / (d + \\gamma_t)` for ``t = 1..T``: weights of the test mean."""
        noise, alpha = _check_schedule(noise), _check_alpha(alpha)
        return cls(
            lambda alg: _data_centric(alg, noise, alpha)[1],
            noise,
            rebuild=lambda g: cls.data_centric_weights(g, alpha),
        )

    @classmethod
    def data_centric_residuals(cls, noise: Tensor, alpha: float = 0.0) -> SpectralFilter:
        r""":math:`E_t = 1 - d\,G_t(d)` for ``t = 1..T``: the residuals :math:`\mathbf y -
        \boldsymbol\mu_t` of each step's fit at the training inputs (for centred targets) and,
        by its trace, the degrees of freedom left (generalised cross-validation), evaluated
        without cancellation: :math:`E_t = (1 - F_{t-1}) + F_{t-1}\, \gamma_t / (d + \gamma_t)`,
        :math:`1 - F_t = (1 - \alpha) E_t`."""
        noise, alpha = _check_schedule(noise), _check_alpha(alpha)
        return cls(
            lambda alg: _data_centric(alg, noise, alpha, residuals=True)[2],
            noise,
            rebuild=lambda g: cls.data_centric_residuals(g, alpha),
        )

    @classmethod
    def resolvent(cls, noise: Tensor) -> SpectralFilter:
        """:math:`R_t = 1 / (d + \\gamma_t)` for ``t = 1..T``."""
        noise = _check_schedule(noise)

        def evaluate(alg):
            one = alg.one(noise[..., 0])
            steps = [alg.mul(one, alg.reciprocal(noise[..., t])) for t in range(noise.shape[-1])]
            return alg.stack(steps)

        return cls(evaluate, noise, is_resolvent=True, rebuild=cls.resolvent)

    @classmethod
    def combined_targets(
        cls, noise: Tensor, inner_steps: int, alpha: float = 0.0
    ) -> SpectralFilter:
        r""":math:`F_{o,i}`, the training targets after each step of the combined chain, for the
        schedule ``noise`` ``(*s, O * I)`` of ``O`` outer steps of ``inner_steps`` inner steps
        (flat index :math:`(o - 1) I + i`; see :class:`~gpsd.CombinedGPR`)."""
        return cls._combined(noise, inner_steps, alpha, "targets")

    @classmethod
    def combined_weights(
        cls, noise: Tensor, inner_steps: int, alpha: float = 0.0
    ) -> SpectralFilter:
        r""":math:`G_{o,i} = S_{o,i} / (d + h_{o,i})`: the weights of the test mean of each step
        of the combined chain."""
        return cls._combined(noise, inner_steps, alpha, "weights")

    @classmethod
    def combined_student_targets(
        cls, noise: Tensor, inner_steps: int, alpha: float = 0.0
    ) -> SpectralFilter:
        r""":math:`S_{o,i}`: the targets of the ordinary GP with noise :math:`h_{o,i}` that
        equals each step of the combined chain."""
        return cls._combined(noise, inner_steps, alpha, "students")

    @classmethod
    def combined_residuals(
        cls, noise: Tensor, inner_steps: int, alpha: float = 0.0
    ) -> SpectralFilter:
        r""":math:`E_{o,i} = 1 - d\,G_{o,i}`: the residuals of each step's fit at the training
        inputs, as a sum of non-negative terms,
        :math:`E_{o,i} = S_{o,i}\,h_{o,i}/(d + h_{o,i}) + (1 - S_{o,i})`."""
        return cls._combined(noise, inner_steps, alpha, "residuals")

    @classmethod
    def _combined(cls, noise: Tensor, inner_steps: int, alpha: float, kind: str) -> SpectralFilter:
        """One output of :func:`_combined_chain` as a filter whose :attr:`noise` is the
        effective noise :math:`h_{o,i}` (the shift of its solves)."""
        noise, alpha = _check_schedule(noise), _check_alpha(alpha)
        inner_steps = _check_inner_steps(inner_steps, noise)
        effective = combined_effective_noise(noise, inner_steps)
        return cls(
            lambda alg: _combined_chain(alg, noise, effective, inner_steps, alpha, kind),
            effective,
            rebuild=lambda g: cls._combined(noise.to(g), inner_steps, alpha, kind),
        )


def _check_schedule(noise: object) -> Tensor:
    """``noise`` if it is a floating-point tensor of shape ``(*s, T)``, ``T >= 1``, of finite
    positive shifts; otherwise a ``TypeError`` or ``ValueError`` naming it (a zero, negative or
    NaN shift made infinite or NaN filter values, an integer schedule truncated series
    coefficients such as ``2 ** -1`` to 0)."""
    if not isinstance(noise, Tensor) or not noise.is_floating_point():
        kind = f"dtype {noise.dtype}" if isinstance(noise, Tensor) else type(noise).__name__
        raise TypeError(f"noise must be a floating-point tensor of shape (*s, T), got {kind}")
    if noise.dim() == 0 or noise.shape[-1] == 0:
        raise ValueError(
            f"noise must have shape (*s, T) with T >= 1 steps, got shape {tuple(noise.shape)}"
        )
    bad = ~((noise.detach() > 0) & noise.detach().isfinite())
    if bool(bad.any()):
        raise ValueError(
            f"noise must hold finite positive shifts; {int(bad.sum())} of them are not, "
            f"such as {float(noise.detach()[bad][0])}"
        )
    return noise


def _check_alpha(alpha: object) -> float:
    """``alpha`` as a float in :math:`[0, 1]`, or a ``ValueError`` naming it (NaN would give NaN)."""
    value = math.nan
    if isinstance(alpha, (numbers.Real, Tensor)) and not isinstance(alpha, bool):
        with contextlib.suppress(TypeError, ValueError, RuntimeError):  # a tensor of several
            value = float(alpha)
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"alpha must be a number in [0, 1], got {alpha!r}")
    return value


def _data_centric(
    alg, noise: Tensor, alpha: float, residuals: bool = False
) -> tuple[Tensor, Tensor, Tensor | None]:
    r"""Run the data-centric recurrence in ``alg``; returns ``(F_1..F_T, G_1..G_T, E_1..E_T)``
    stacked on -2 (``E`` only with ``residuals``, else ``None``).

    :math:`E_t = 1 - d\,G_t = (1 - F_{t-1}) + F_{t-1}\, g_t / (d + g_t)` is the residual of step
    :math:`t`'s fit, a sum of non-negative terms with :math:`1 - F_t = (1 - \alpha) E_t` carried
    by the same recurrence (``1 - F_t`` itself cancels where :math:`F_t \approx 1`: tiny shifts).
    """
    f_prev = alg.one(noise[..., 0])
    r_prev = 0.0 * f_prev  # 1 - F_0
    targets, weights, errors = [], [], []
    for t in range(noise.shape[-1]):
        g = noise[..., t]
        weights.append(alg.mul(f_prev, alg.reciprocal(g)))
        if residuals:
            errors.append(r_prev + alg.mul(f_prev, alg.complement(g)))
            r_prev = (1.0 - alpha) * errors[-1]
        f_next = alg.mul(f_prev, alg.ratio(g))
        if alpha != 0.0:
            f_next = alg.add_constant((1.0 - alpha) * f_next, alpha)
        targets.append(f_next)
        f_prev = f_next
    return alg.stack(targets), alg.stack(weights), alg.stack(errors) if residuals else None


def _check_inner_steps(inner_steps: object, noise: Tensor) -> int:
    """``inner_steps`` as a positive int that divides the number of steps of ``noise``."""
    if isinstance(inner_steps, bool) or not isinstance(inner_steps, numbers.Integral):
        raise ValueError(f"inner_steps must be a positive integer, got {inner_steps!r}")
    if inner_steps < 1 or noise.shape[-1] % inner_steps:
        raise ValueError(
            f"inner_steps must be a positive integer dividing the {noise.shape[-1]} steps of "
            f"noise, got {inner_steps}"
        )
    return int(inner_steps)


def combined_effective_noise(noise: Tensor, inner_steps: int) -> Tensor:
    r"""The effective noise :math:`h_{o,i}` of every step of the combined chain, ``(*s, O * I)``
    for a schedule ``noise`` ``(*s, O * I)`` laid out outer step by outer step:

    .. math::
        h_{o,i} = \Big(\sum_{p < o} \frac{1}{\gamma_{p,I}} + \frac{1}{\gamma_{o,i}}\Big)^{-1},

    the inverse of the precision that the prior of outer step :math:`o` carries (from the last
    inner step of every outer step before it) plus that of step :math:`(o, i)`'s own noise.
    """
    grid = noise.unflatten(-1, (-1, inner_steps))  # shape: (*s, O, I)
    prior = _prior_precision(grid).unsqueeze(-1)  # shape: (*s, O, 1)
    return (1.0 / (prior + 1.0 / grid)).flatten(-2)


def _prior_precision(grid: Tensor) -> Tensor:
    r""":math:`\sum_{p < o} 1/\gamma_{p,I}` for every outer step :math:`o`, ``(*s, O)``, from
    the schedule ``grid`` ``(*s, O, I)``: an exclusive cumulative sum, without cancellation."""
    last = 1.0 / grid[..., -1]  # shape: (*s, O)
    return torch.cat([torch.zeros_like(last[..., :1]), last.cumsum(-1)[..., :-1]], dim=-1)


def _combined_chain(
    alg, noise: Tensor, effective: Tensor, inner_steps: int, alpha: float, kind: str
) -> Tensor:
    r"""Run the combined chain in ``alg`` and stack one of its filters over the steps:
    ``"targets"`` :math:`F_{o,i}`, ``"weights"`` :math:`G_{o,i}`, ``"students"``
    :math:`S_{o,i}` or ``"residuals"`` :math:`E_{o,i}`.

    With :math:`\beta_{o,i} = h_{o,i}/\gamma_{o,i}` and :math:`1 - \beta_{o,i} = h_{o,i}
    \sum_{p<o} 1/\gamma_{p,I}` (each formed as a product, not a difference):
    :math:`F_{o,0} = 1`, :math:`S_{1,i} = F_{1,i-1}`,
    :math:`S_{o,i} = (1 - \beta_{o,i}) S_{o-1,I} + \beta_{o,i} F_{o,i-1}`,
    :math:`G_{o,i} = S_{o,i}/(d + h_{o,i})`,
    :math:`F_{o,i} = \alpha + (1 - \alpha)\, d\,G_{o,i}`. The residual
    :math:`E_{o,i} = S_{o,i}\, h_{o,i}/(d + h_{o,i}) + (1 - S_{o,i})` carries
    :math:`1 - S` and :math:`1 - F = (1 - \alpha) E` by the same recurrences, as sums of
    non-negative terms.
    """
    outer_steps = noise.shape[-1] // inner_steps
    beta = effective / noise  # shape: (*s, O * I)
    prior = _prior_precision(noise.unflatten(-1, (outer_steps, inner_steps)))  # shape: (*s, O)
    # shape: (*s, O * I): 1 - beta, the weight of the previous outer step's student targets
    keep = (effective.unflatten(-1, (outer_steps, inner_steps)) * prior.unsqueeze(-1)).flatten(-2)
    residuals = kind == "residuals"
    one = alg.one(noise[..., 0])
    out = []
    student_prev = residual_prev = None  # S_{o-1,I} and 1 - S_{o-1,I}
    for o in range(outer_steps):
        targets, targets_residual = one, 0.0 * one  # F_{o,0} = 1 and 1 - F_{o,0}
        for i in range(inner_steps):
            t = o * inner_steps + i
            h = effective[..., t]
            if o == 0:  # beta = 1: the prior is the original one
                student, student_residual = targets, targets_residual
            else:
                b, k = beta[..., t], keep[..., t]
                student = alg.scale(student_prev, k) + alg.scale(targets, b)
                if residuals:
                    student_residual = alg.scale(residual_prev, k) + alg.scale(targets_residual, b)
            if kind == "students":
                out.append(student)
            elif kind == "weights":
                out.append(alg.mul(student, alg.reciprocal(h)))
            if residuals:
                error = alg.mul(student, alg.complement(h)) + student_residual
                out.append(error)
                targets_residual = (1.0 - alpha) * error
            fitted = alg.mul(student, alg.ratio(h))
            targets = fitted if alpha == 0.0 else alg.add_constant((1.0 - alpha) * fitted, alpha)
            if kind == "targets":
                out.append(targets)
        student_prev = student
        if residuals:
            residual_prev = student_residual
    return alg.stack(out)
