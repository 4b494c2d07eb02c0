"""Data-centric self-distillation of GP regression (Borup & Andersen, §3.1)."""

from __future__ import annotations

import torch
from gpytorch.kernels import Kernel
from gpytorch.means import Mean
from gpytorch.models import ExactGP
from torch import Tensor

from gpsd.distillation._common import (
    alpha_setting,
    schedule_index,
    student_batch,
    student_gp,
)
from gpsd.distillation._spectral_gpr import SpectralGPR
from gpsd.linalg import SpectralFilter

__all__ = ["DataCentricGPR"]


class DataCentricGPR(SpectralGPR):
    r"""Every step of data-centric self-distillation of a GP regressor, from one factorisation.

    Step :math:`t = 1, \dots, T` fits a GP with prior :math:`\mathcal{GP}(m, k)` and noise
    :math:`\gamma_t` to the previous step's targets and keeps its mean at the training inputs as the next targets:

    .. math::
        \boldsymbol\mu_t = m(\mathbf x) + \mathbf K(\mathbf K + \gamma_t\mathbf I)^{-1}
        (\mathbf y_{t-1} - m(\mathbf x)), \qquad
        \mathbf y_t = \alpha\,\mathbf y + (1 - \alpha)\,\boldsymbol\mu_t, \qquad \mathbf y_0 = \mathbf y .

    With :math:`\alpha = 0` (the paper's setting, Prop. 3.1) this is
    :math:`\mathbf y_t - m = \prod_{s \le t}\mathbf K(\mathbf K + \gamma_s\mathbf I)^{-1}(\mathbf y - m)`;
    :math:`\alpha \in (0, 1)` mixes the original targets into every step (Borup & Andersen 2021).
    The predictive distribution of step :math:`t` at test inputs :math:`\mathbf x_*` (eq. 5) is

    .. math::
        \mu_{t,*} = m(\mathbf x_*) + \mathbf K_{*X}(\mathbf K + \gamma_t\mathbf I)^{-1}
        (\mathbf y_{t-1} - m(\mathbf x)), \qquad
        \Sigma_{t,*} = \mathbf K_{**} - \mathbf K_{*X}(\mathbf K + \gamma_t\mathbf I)^{-1}\mathbf K_{X*}.

    All of these are spectral filters of :math:`\mathbf K` (see :class:`~gpsd.linalg.SpectralFilter`),
    so one factorisation serves every step and every schedule of a batch:

    * ``backend="dense"``: one float64 eigendecomposition; each extra step costs
      :math:`\mathcal O(N)` per right-hand side.
    * ``backend="cholesky"``: one Cholesky factorisation per step and schedule; exact, cheapest for
      a few steps.
    * ``backend="lanczos"``: matrix-free block Lanczos on the kernel operator (KeOps kernels work)
      with a Taylor correction for the unresolved spectrum; :attr:`error_estimate` states its
      accuracy.
    * ``backend="cg"``: matrix-free conjugate gradients for every step's solve with
      :math:`\mathbf K + \gamma_t\mathbf I`, deflated by the Ritz pairs of a rank-``rank``
      Lanczos run (:class:`~gpsd.linalg.ShiftedCG`); each solve reaches relative residual
      ``rtol`` whatever the spectrum, at the price of iterations per step; :meth:`gcv`
      estimates the trace it needs from probe vectors (:meth:`gcv_standard_error`).
    * ``backend="auto"``: chosen by :func:`~gpsd.linalg.choose_backend` from N, the number of steps
      and the device's free memory; beyond a dense matrix that fits, Lanczos, or deflated CG
      where Lanczos cannot reach ``rtol``.

    The model fits lazily on first use (or when :meth:`fit` is called) and refits when the fit
    is stale (:meth:`fit` lists when); changing :attr:`alpha` alone reuses the factorisation of
    :math:`\mathbf K`. Gradients flow to the kernel's and the mean's hyperparameters through
    the ``"dense"`` and ``"cholesky"`` backends; the matrix-free ones build no autograd graph,
    and a backward pass that reaches their results (computed with grad enabled and a
    hyperparameter requiring grad) raises a :class:`~gpsd.BackendError`. ``train_x``,
    ``train_y`` and ``noise`` are stored detached: constants to the model.
    :meth:`~gpsd.DataCentricGPR.optimize_hyperparameters` learns the kernel, the prior mean and
    the teacher's noise by the teacher's marginal likelihood on every backend (matrix-free on
    ``"lanczos"`` and ``"cg"``).

    :param train_x: training inputs, shape ``(*b, N, d)`` (or ``(N,)``).
    :param train_y: training targets :math:`\mathbf y`, shape ``(*b, N)``.
    :param covar_module: the prior covariance :math:`k` (a GPyTorch kernel, trained or not).
    :param noise: the noise schedule :math:`\gamma_1, \dots, \gamma_T`: one value (repeated
        ``num_steps`` times, or one step), a list, or a tensor of shape ``(*s, T)`` holding a
        batch of schedules; each value > 0. Assigning ``model.noise`` later is checked the same
        way and keeps :math:`T` (one value is every step's).
    :param num_steps: the number of steps :math:`T` (default: the length of ``noise``; with a
        schedule, they must agree).
    :param mean_module: the prior mean :math:`m` (default: zero).
    :param alpha: weight :math:`\alpha \in [0, 1)` of the original targets in every step.
    :param backend: ``"auto"``, ``"dense"``, ``"cholesky"``, ``"lanczos"`` or ``"cg"``. An
        explicit ``"dense"`` or ``"cholesky"`` whose matrices would not fit in the device's free
        memory raises an :class:`~gpsd.InsufficientMemoryError` before allocating them.
    :param linalg_dtype: dtype of the factorisation (default float64; ``None`` keeps the data's).
    :param rank: Krylov basis size of the Lanczos backend (default: grown block by block, an
        eighth of ``min(N, 1024)`` columns per block, between 4 and 64, until the error estimate
        meets ``rtol``), or of the run that deflates CG (default 256).
    :param rtol: accuracy target; the Lanczos backend warns when its estimate exceeds it, the CG
        backend's solves stop at this relative residual.
    :param kernel_cache_bytes: memory in bytes that the matrix-free backends (without a KeOps
        kernel) may fill with the kernel rows they evaluate, kept for later products (see
        :class:`~gpsd.linalg.ChunkedKernelOperator`); default: half of the device's free memory
        when the factorisation is computed, less where the other half would not hold the working
        set of a prediction (about ``8 * 4096 + 4 * 2048`` vectors of length N); ``0``
        evaluates the kernel afresh at every product.
    :param process_group: a ``torch.distributed.ProcessGroup`` whose ranks share the work of
        the matrix-free backends (``torch.distributed.group.WORLD`` for the default group);
        ``None`` (the default) computes everything in this process, even where a default
        group is initialised. With a group, every rank builds the model from the same data and
        kernel and calls the same methods with the same arguments (as under ``torchrun``):
        each rank evaluates its block of kernel rows (a
        :class:`~gpsd.linalg.DistributedKernelOperator`), the Krylov iterations run on every
        rank, and every rank returns the same results as one process. The Lanczos backend
        splits its Krylov basis and eigenvectors by rows too: each rank holds the rows of the
        kernel it evaluates, and predictions sum each rank's part over the ranks. The CG
        backend's solves run on every rank, through the group. ``backend="auto"`` goes
        matrix-free with a group; ``"dense"`` and ``"cholesky"``, which would ignore it, raise
        a ``ValueError``. Ranks whose inputs, targets, noise schedules, kernels or prior means
        differ raise a ``ValueError`` on every rank; a failing rank makes the others raise a
        :class:`~gpsd.DistributedError` within the group's ``timeout``.

    Example:
        >>> covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())
        >>> model = DataCentricGPR(train_x, train_y, covar_module, noise=0.1, num_steps=3).fit()
        >>> prediction = model.predict(test_x)  # prediction.mean, .variance: (3, M)
        >>> step = model.best_step("gcv")  # counted from 1
        >>> student = model.student(step)  # a plain ExactGP equal to that step
    """

    def __init__(
        self,
        train_x: Tensor,
        train_y: Tensor,
        covar_module: Kernel,
        *,
        noise: object,
        num_steps: int | None = None,
        mean_module: Mean | None = None,
        alpha: float = 0.0,
        backend: str = "auto",
        linalg_dtype: torch.dtype | None = torch.float64,
        rank: int | None = None,
        rtol: float = 1e-6,
        kernel_cache_bytes: int | None = None,
        process_group: object = None,
    ) -> None:
        super().__init__(
            train_x,
            train_y,
            covar_module,
            noise=noise,
            num_steps=num_steps,
            mean_module=mean_module,
            backend=backend,
            linalg_dtype=linalg_dtype,
            rank=rank,
            rtol=rtol,
            kernel_cache_bytes=kernel_cache_bytes,
            process_group=process_group,
        )
        self.alpha = alpha

    alpha = alpha_setting

    def _targets_config(self) -> tuple:
        return (self.alpha,)

    def _smallest_shift(self) -> float:
        return float(self.noise.min())

    def _step_noise(self) -> Tensor:
        return self.noise

    def _targets_filter(self) -> SpectralFilter:
        return SpectralFilter.data_centric_targets(self._schedule(self.noise), self.alpha)

    def _mean_filter(self) -> SpectralFilter:
        return SpectralFilter.data_centric_weights(self._schedule(self.noise), self.alpha)

    def _variance_filter(self) -> SpectralFilter:
        return SpectralFilter.resolvent(self._schedule(self.noise))

    def _residual_filter(self) -> SpectralFilter:
        # E_t(K) = I - S_t by its own recurrence: y - mu_t and N - tr S_t cancel to rounding
        # where the noise is tiny, which made the score NaN, infinite or wrong
        return SpectralFilter.data_centric_residuals(self._schedule(self.noise), self.alpha)

    def step_targets(self, step: int | None = None) -> Tensor:
        r"""The targets each step is fitted to: shape ``(*batch, T, N)``, row ``t - 1`` for
        step ``t`` (or ``(*batch, N)`` for ``step=t``).

        Step 1 is fitted to :math:`\mathbf y_0 = \mathbf y` (``train_y``), step :math:`t` to
        :math:`\mathbf y_{t-1} = \alpha\,\mathbf y + (1 - \alpha)\,\boldsymbol\mu_{t-1}`,
        the previous step's fit at the training inputs.

        :param step: a step ``t`` in ``1..T`` (default: every step).
        """
        step = self._check_step(step)
        fit = self._current_fit()
        with fit.autograd_context():
            # y_1..y_T; the last is no step's target
            fitted = self._at_every_row(fit, self._targets_filter()).squeeze(-1)
            fitted = fitted + fit.prior_mean.unsqueeze(-2)
            first = self.train_y.unsqueeze(-2).to(fitted)
            batch = torch.broadcast_shapes(first.shape[:-2], fitted.shape[:-2])
            first = first.expand(*batch, *first.shape[-2:])
            fitted = fitted.expand(*batch, *fitted.shape[-2:])
            targets = torch.cat([first, fitted[..., :-1, :]], dim=-2)  # shape: (*batch, T, N)
        targets = self._guard(fit, targets.to(self.train_y.dtype))
        return targets if step is None else targets[..., step - 1, :]

    # ------------------------------------------------------------------ students
    def student(self, step: int, schedule: tuple[int, ...] = ()) -> ExactGP:
        r"""A plain GPyTorch ``ExactGP`` equal to step ``step`` (counted from 1).

        Its training targets are :math:`\mathbf y_{t-1}` (:meth:`step_targets`) and its
        ``GaussianLikelihood`` noise is :math:`\gamma_t`; kernel and mean are copies of this
        model's. When ``noise`` holds a batch of schedules, ``schedule`` indexes one of them (with
        unbatched data, kernel and prior mean); the default ``()`` gives the student of the whole
        batch, one member per entry of :meth:`predict`'s batch with its own noise (a teacher batch
        from :meth:`from_teacher`, say). With a batch of targets, kernels or prior means, its
        training inputs are expanded to that batch (shape ``(*b, N, d)``).

        :param step: a step ``t`` in ``1..T``.
        :param schedule: the index of one schedule of a batch, or ``()``.
        """
        step = self._check_step(step)
        batch = student_batch(self.train_x, self.train_y, self.mean_module, self.covar_module)
        schedule = schedule_index(self.noise, schedule, batch)
        with torch.no_grad():
            if step == 1:
                targets = self.train_y
            else:
                targets = self.step_targets(step)
                targets = targets[schedule] if schedule else targets
        noise = self.noise[schedule][..., step - 1]
        return student_gp(
            self.train_x, targets.detach().clone(), noise, self.mean_module, self.covar_module
        )
