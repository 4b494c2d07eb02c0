"""The combined self-distillation chain of GP regression: data-centric steps inside
distribution-centric ones (Borup & Andersen, "Combined and extended directions")."""

from __future__ import annotations

from collections.abc import Callable

import torch
from gpytorch.kernels import Kernel
from gpytorch.means import Mean
from gpytorch.models import ExactGP
from torch import Tensor

from gpsd._internal.validation import check_int
from gpsd.distillation._common import (
    alpha_setting,
    schedule_index,
    student_batch,
    student_gp,
)
from gpsd.distillation._spectral_gpr import SpectralGPR
from gpsd.distillation._step_grid import StepGrid, noise_grid_schedule
from gpsd.linalg import SpectralFilter
from gpsd.linalg.spectral_filter import combined_effective_noise

__all__ = ["CombinedGPR"]


class CombinedGPR(StepGrid, SpectralGPR):
    r"""The combined self-distillation chain of a GP regressor, every step from one factorisation.

    An outer distribution-centric loop of :math:`O` steps whose prior is the previous outer
    step's posterior, around an inner data-centric loop of :math:`I` steps with that prior held
    fixed. Starting from :math:`\mathcal{GP}(m_0, k_0) = \mathcal{GP}(m, k)`, inner step
    :math:`i` of outer step :math:`o` fits :math:`\mathcal{GP}(m_{o-1}, k_{o-1})` with noise
    :math:`\gamma_{o,i}` to the targets :math:`\mathbf y_{o,i-1}`:

    .. math::
        \mathbf y_{o,0} = \mathbf y, \qquad
        \boldsymbol\mu_{o,i} = m_{o-1}(\mathbf x) + \mathbf K_{o-1}(\mathbf K_{o-1} +
        \gamma_{o,i}\mathbf I)^{-1}(\mathbf y_{o,i-1} - m_{o-1}(\mathbf x)), \qquad
        \mathbf y_{o,i} = \alpha\,\mathbf y + (1 - \alpha)\,\boldsymbol\mu_{o,i},

    and the posterior of its last inner step, :math:`\mathcal{GP}(m_o, k_o)`, is the prior of
    outer step :math:`o + 1`. Every inner loop starts again from the original targets
    :math:`\mathbf y`. ``outer_steps=1`` is :class:`~gpsd.DataCentricGPR`;
    ``inner_steps=1`` is :class:`~gpsd.DistributionCentricGPR`.

    **Steps.** The :math:`T = O \cdot I` steps run along one leading step dimension, outer step
    by outer step: step :math:`(o, i)` has the flat index

    .. math::
        t = (o - 1)\,I + i, \qquad o = 1..O, \quad i = 1..I,

    counted from 1 as everywhere in gpsd; :meth:`flat_step` and :meth:`grid_step` convert.
    ``predict(test_x).mean`` has shape ``(*batch, T, M)``, row ``t - 1`` for step ``t``;
    :meth:`best_step` returns a flat ``t``.

    **Closed form.** Conditioning :math:`\mathcal{GP}(m_{o-1}, k_{o-1})` on targets with noise
    :math:`\gamma` at the same inputs is conditioning :math:`\mathcal{GP}(m, k)` on the
    precision-weighted average of those targets and of the targets that made
    :math:`(m_{o-1}, k_{o-1})` (Theorem 3.3 of the paper for two sets of targets). By induction
    over the outer steps, step :math:`(o, i)` is one ordinary GP with prior
    :math:`\mathcal{GP}(m, k)`, the effective noise

    .. math::
        h_{o,i} = \Big(\sum_{p < o}\frac{1}{\gamma_{p,I}} + \frac{1}{\gamma_{o,i}}\Big)^{-1}

    (only the last inner step of each earlier outer step enters the prior) and the targets
    :math:`m(\mathbf x) + \mathbf t_{o,i}`,

    .. math::
        \mathbf t_{o,i} = \frac{h_{o,i}}{h_{o-1,I}}\,\mathbf t_{o-1,I}
        + \frac{h_{o,i}}{\gamma_{o,i}}\,(\mathbf y_{o,i-1} - m(\mathbf x)),
        \qquad \frac{h_{o,i}}{h_{o-1,I}} + \frac{h_{o,i}}{\gamma_{o,i}} = 1,

    with :math:`\mathbf t_{1,i} = \mathbf y_{1,i-1} - m(\mathbf x)`. Indeed, if
    :math:`k_{o-1}(x, \mathbf x) = k(x, \mathbf x)\,c(\mathbf K + c\mathbf I)^{-1}` for
    :math:`c = h_{o-1,I}` (true for :math:`o = 1` with :math:`c = \infty`), then
    :math:`k_{o-1}(x, \mathbf x)(\mathbf K_{o-1} + \gamma\mathbf I)^{-1} = \frac{h}{\gamma}\,
    k(x, \mathbf x)(\mathbf K + h\mathbf I)^{-1}` with :math:`1/h = 1/c + 1/\gamma`, and the
    posterior covariance is :math:`k - k(\cdot, \mathbf x)(\mathbf K + h\mathbf I)^{-1}
    k(\mathbf x, \cdot)`. So, with :math:`\mathbf t_{o,i} = S_{o,i}(\mathbf K)(\mathbf y - m)`,

    .. math::
        \mu_{o,i,*} &= m(\mathbf x_*) + \mathbf K_{*X}\,G_{o,i}(\mathbf K)(\mathbf y - m),
        \qquad G_{o,i}(d) = \frac{S_{o,i}(d)}{d + h_{o,i}}, \\
        \Sigma_{o,i,*} &= \mathbf K_{**} - \mathbf K_{*X}(\mathbf K + h_{o,i}\mathbf I)^{-1}
        \mathbf K_{X*}, \\
        S_{o,i} &= \Big(1 - \frac{h_{o,i}}{\gamma_{o,i}}\Big) S_{o-1,I}
        + \frac{h_{o,i}}{\gamma_{o,i}} F_{o,i-1}, \qquad
        F_{o,0} = 1, \quad F_{o,i}(d) = \alpha + (1 - \alpha)\,d\,G_{o,i}(d),

    where :math:`F_{o,i}(\mathbf K)(\mathbf y - m) = \mathbf y_{o,i} - m(\mathbf x)`: every
    step is a spectral filter of :math:`\mathbf K`, so one factorisation serves the whole
    :math:`O \times I` grid, and every schedule of a batch, on every backend (see
    :class:`~gpsd.DataCentricGPR` for the backends, the caching, the gradients and the process
    groups). The residuals for :meth:`gcv`, :math:`E_{o,i} = 1 - d\,G_{o,i} = S_{o,i}\,
    h_{o,i}/(d + h_{o,i}) + (1 - S_{o,i})`, are evaluated as sums of non-negative terms.
    :meth:`student` builds that ordinary GP, and ``predict(..., include_noise=True)`` adds
    its noise :math:`h_{o,i}` (:attr:`effective_noise`).

    :param train_x: training inputs, shape ``(*b, N, d)`` (or ``(N,)``).
    :param train_y: training targets :math:`\mathbf y`, shape ``(*b, N)``.
    :param covar_module: the prior covariance :math:`k`.
    :param noise: the noise :math:`\gamma_{o,i}` of every step: one value (every step), or a
        tensor or nested list of shape ``(*s, O, I)``, one value per outer and inner step (a
        batch of grids ``*s``); row ``o - 1``, column ``i - 1`` for step :math:`(o, i)`.
    :param inner_steps: :math:`I`, the data-centric steps per outer step (default: from the
        grid ``noise``; needed for one value).
    :param outer_steps: :math:`O`, the distribution-centric steps (default: from the grid
        ``noise``; needed for one value).
    :param mean_module: the prior mean :math:`m` (default zero).
    :param alpha: weight :math:`\alpha \in [0, 1)` of the original targets in every inner
        step's targets, as in :class:`~gpsd.DataCentricGPR`.
    :param backend, linalg_dtype, rank, rtol, kernel_cache_bytes, process_group: as in
        :class:`~gpsd.DataCentricGPR`.

    Example:
        >>> model = CombinedGPR(train_x, train_y, covar_module, noise=0.1, outer_steps=3,
        ...                     inner_steps=2).fit()
        >>> model.predict(test_x).mean.shape  # (6, M): steps (1,1), (1,2), (2,1), ..., (3,2)
        >>> model.grid_step(model.best_step("gcv"))  # (outer, inner)
        >>> model.predict(test_x, step=model.flat_step(2, 1))
    """

    def __init__(
        self,
        train_x: Tensor,
        train_y: Tensor,
        covar_module: Kernel,
        *,
        noise: object,
        inner_steps: int | None = None,
        outer_steps: int | None = None,
        alpha: float = 0.0,
        mean_module: Mean | None = None,
        backend: str = "auto",
        linalg_dtype: torch.dtype | None = torch.float64,
        rank: int | None = None,
        rtol: float = 1e-6,
        kernel_cache_bytes: int | None = None,
        process_group: object = None,
    ) -> None:
        like = train_x if isinstance(train_x, Tensor) else torch.as_tensor(train_x)
        noise, outer_steps, inner_steps = noise_grid_schedule(noise, like, outer_steps, inner_steps)
        self._outer_steps, self._inner_steps = outer_steps, inner_steps
        super().__init__(
            train_x,
            train_y,
            covar_module,
            noise=noise,
            num_steps=None,
            mean_module=mean_module,
            backend=backend,
            linalg_dtype=linalg_dtype,
            rank=rank,
            rtol=rtol,
            kernel_cache_bytes=kernel_cache_bytes,
            process_group=process_group,
        )
        self.alpha = alpha

    @classmethod
    def from_teacher(
        cls,
        teacher: ExactGP,
        *,
        inner_steps: int,
        outer_steps: int,
        noise: object = None,
        **kwargs,
    ) -> CombinedGPR:
        """Distil a trained ``ExactGP`` teacher with a ``GaussianLikelihood``; step (1, 1) is
        the teacher itself when ``noise`` is left out. The teacher is checked and its modules
        shared as by :meth:`DataCentricGPR.from_teacher <gpsd.DataCentricGPR.from_teacher>`
        (a :class:`~gpsd.ChunkedKernel` gives its ``base_kernel`` and process group).

        :param teacher: a trained ``gpytorch.models.ExactGP`` with a ``GaussianLikelihood``.
        :param inner_steps: :math:`I`.
        :param outer_steps: :math:`O`.
        :param noise: the noise grid (default: the teacher's noise at every step).
        :param kwargs: the other keyword arguments of the constructor.
        """
        inner_steps = check_int(inner_steps, "inner_steps")
        outer_steps = check_int(outer_steps, "outer_steps")
        steps = {"inner_steps": inner_steps, "outer_steps": outer_steps}
        return cls._from_teacher(teacher, noise, **steps, **kwargs)

    @classmethod
    def _repeated_teacher_noise(cls, teacher_noise: Tensor, options: dict) -> Tensor:
        # shape: (*b, O, I): a batched teacher's noise per member of its batch
        shape = (*teacher_noise.shape, options["outer_steps"], options["inner_steps"])
        return teacher_noise[..., None, None].expand(shape).clone()

    alpha = alpha_setting

    @property
    def effective_noise(self) -> Tensor:
        r""":math:`h_{o,i}` of every step, ``(*s, T)`` (flat steps): the noise of the ordinary GP
        equal to step :math:`(o, i)`."""
        return combined_effective_noise(self.noise, self.inner_steps)

    # ------------------------------------------------------------------ filters
    def _targets_config(self) -> tuple:
        return (self.alpha, self.inner_steps)

    def _smallest_shift(self) -> float:
        return float(self.effective_noise.min())

    def _step_noise(self) -> Tensor:
        return self.effective_noise

    def _filter(self, build: Callable[[Tensor, int, float], SpectralFilter]) -> SpectralFilter:
        """The filter ``build`` makes from this model's schedule, inner steps and ``alpha``."""
        return build(self._schedule(self.noise), self.inner_steps, self.alpha)

    def _mean_filter(self) -> SpectralFilter:
        return self._filter(SpectralFilter.combined_weights)

    def _variance_filter(self) -> SpectralFilter:
        return SpectralFilter.resolvent(self._schedule(self.effective_noise))

    def _residual_filter(self) -> SpectralFilter:
        return self._filter(SpectralFilter.combined_residuals)

    def _apply_to_targets(self, filt: SpectralFilter) -> Tensor:
        r""":math:`m(\mathbf x) + f_t(\mathbf K)(\mathbf y - m)` for every step, ``(*batch, T, N)``."""
        fit = self._current_fit()
        with fit.autograd_context():
            out = self._at_every_row(fit, filt).squeeze(-1)
            out = out + fit.prior_mean.unsqueeze(-2)
        return self._guard(fit, out.to(self.train_y.dtype))

    def step_targets(self, step: int | None = None) -> Tensor:
        r"""The targets :math:`\mathbf y_{o,i-1}` each step is fitted to (with the prior
        :math:`\mathcal{GP}(m_{o-1}, k_{o-1})`): shape ``(*batch, T, N)``, row ``t - 1`` for
        flat step ``t`` (or ``(*batch, N)`` for ``step=t``). The first inner step of every outer
        step is fitted to ``train_y``.

        :param step: a flat step ``t`` in ``1..T`` (default: every step).
        """
        step = self._check_step(step)
        fitted = self._apply_to_targets(self._filter(SpectralFilter.combined_targets))
        grid = fitted.unflatten(-2, (self.outer_steps, self.inner_steps))  # (*, O, I, N)
        first = self.train_y.to(fitted)[..., None, None, :]  # shape: (*b, 1, 1, N)
        first = first.expand(*grid.shape[:-2], 1, grid.shape[-1])  # shape: (*, O, 1, N)
        targets = torch.cat([first, grid[..., :-1, :]], dim=-2).flatten(-3, -2)
        return targets if step is None else targets[..., step - 1, :]

    def student(self, step: int, schedule: tuple[int, ...] = ()) -> ExactGP:
        r"""A plain GPyTorch ``ExactGP`` equal to flat step ``step``: prior
        :math:`\mathcal{GP}(m, k)` (copies of this model's modules), noise :math:`h_{o,i}`
        (:attr:`effective_noise`) and targets :math:`m(\mathbf x) + \mathbf t_{o,i}` (the closed
        form of the class docstring).

        ``schedule`` indexes one grid of a batch of noise grids (with unbatched data, kernel and
        prior mean); the default ``()`` gives the student of the whole batch.

        :param step: a flat step ``t`` in ``1..T`` (:meth:`flat_step` converts ``(o, i)``).
        :param schedule: the index of one schedule of a batch, or ``()``.
        """
        step = self._check_step(step)
        batch = student_batch(self.train_x, self.train_y, self.mean_module, self.covar_module)
        schedule = schedule_index(self.noise, schedule, batch)
        with torch.no_grad():
            filt = self._filter(SpectralFilter.combined_student_targets)
            targets = self._apply_to_targets(filt)[..., step - 1, :]
            targets = targets[schedule] if schedule else targets
        noise = self.effective_noise[schedule][..., step - 1]
        return student_gp(
            self.train_x, targets.detach().clone(), noise, self.mean_module, self.covar_module
        )
