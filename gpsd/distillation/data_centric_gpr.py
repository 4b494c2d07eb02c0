"""Data-centric self-distillation of GP regression (Borup & Andersen, §3.1)."""

from __future__ import annotations

import torch
from gpytorch.kernels import Kernel
from gpytorch.means import Mean
from gpytorch.models import ExactGP
from torch import Tensor

from gpsd._internal.validation import as_float_tensor, check_finite, check_int
from gpsd.distillation._common import (
    schedule_index,
    student_batch,
    student_gp,
    validate_test_x,
)
from gpsd.distillation._spectral_gpr import SpectralGPR, autograd_context
from gpsd.linalg import SpectralFilter

__all__ = ["DataCentricGPR"]


class DataCentricGPR(SpectralGPR):
    r"""Every step of data-centric self-distillation of a GP regressor, from one factorisation.

    Step :math:`t` fits a GP with prior :math:`\mathcal{GP}(m, k)` and noise :math:`\gamma_t` to the
    previous step's targets and keeps its mean at the training inputs as the next targets:

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
      ``rtol`` whatever the spectrum, at the price of iterations per step. No :meth:`gcv`.
    * ``backend="auto"``: chosen by :func:`~gpsd.linalg.choose_backend` from N, the number of steps
      and the device's free memory; beyond a dense matrix that fits, Lanczos, or deflated CG
      where Lanczos cannot reach ``rtol``.

    The factorisation is cached and recomputed when the kernel's or the mean's parameters change.
    Gradients flow to the kernel's and the mean's hyperparameters through the dense and Cholesky
    backends; the matrix-free backends return predictions without an autograd graph.
    ``train_x``, ``train_y`` and ``gamma`` are stored detached: constants to the model.

    :param kernel: the prior covariance :math:`k` (a GPyTorch kernel, trained or not).
    :param train_x: training inputs, shape ``(*b, N, d)`` (or ``(N,)``).
    :param train_y: training targets :math:`\mathbf y`, shape ``(*b, N)``.
    :param gamma: the noise schedule :math:`\gamma_1..\gamma_T`: a scalar (one step), a list, or a
        tensor of shape ``(*s, T)`` holding a batch of schedules.
    :param alpha: weight :math:`\alpha \in [0, 1)` of the original targets in every step.
    :param mean_module: the prior mean :math:`m` (default: zero).
    :param backend: ``"auto"``, ``"dense"``, ``"cholesky"``, ``"lanczos"`` or ``"cg"``.
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

    Example:
        >>> kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())
        >>> model = DataCentricGPR(kernel, train_x, train_y, gamma=[0.1, 0.2, 0.3])
        >>> path = model.predict(test_x)  # path.mean, path.variance: (3, M)
        >>> step = int(model.gcv().argmin()) + 1
        >>> student = model.student(step)  # a plain ExactGP equal to that step
    """

    def __init__(
        self,
        kernel: Kernel,
        train_x: Tensor,
        train_y: Tensor,
        gamma: object,
        *,
        alpha: float = 0.0,
        mean_module: Mean | None = None,
        backend: str = "auto",
        linalg_dtype: torch.dtype | None = torch.float64,
        rank: int | None = None,
        rtol: float = 1e-6,
        kernel_cache_bytes: int | None = None,
    ) -> None:
        super().__init__(
            kernel,
            train_x,
            train_y,
            gamma,
            mean_module=mean_module,
            backend=backend,
            linalg_dtype=linalg_dtype,
            rank=rank,
            rtol=rtol,
            kernel_cache_bytes=kernel_cache_bytes,
        )
        self.alpha = alpha

    @property
    def alpha(self) -> float:
        r"""The weight :math:`\alpha \in [0, 1)` of the original targets, checked when set."""
        return self._alpha

    @alpha.setter
    def alpha(self, value: float) -> None:
        value = float(value)
        if not 0.0 <= value < 1.0:
            raise ValueError(f"alpha must lie in [0, 1), got {value}")
        self._alpha = value

    def _config(self) -> tuple:
        return (*super()._config(), self.alpha)

    def _smallest_shift(self) -> float:
        return float(self.gamma.min())

    def _targets_filter(self) -> SpectralFilter:
        return SpectralFilter.data_centric_targets(self._schedule(self.gamma), self.alpha)

    def _mean_filter(self) -> SpectralFilter:
        return SpectralFilter.data_centric_weights(self._schedule(self.gamma), self.alpha)

    def _variance_filter(self) -> SpectralFilter:
        return SpectralFilter.resolvent(self._schedule(self.gamma))

    def train_targets_path(self) -> Tensor:
        r"""The targets :math:`\mathbf y_1, \dots, \mathbf y_T`, shape ``(*batch, T, N)``."""
        state = self._state()
        with autograd_context(state):
            targets = state["engine"].apply(self._targets_filter(), state["coords"]).squeeze(-1)
            out = targets + state["prior_mean"].unsqueeze(-2)
        return out.to(self.train_y.dtype)

    # ------------------------------------------------------------------ choosing t
    def gcv(self) -> Tensor:
        r"""Generalised cross-validation score of every step, shape ``(*batch, T)``.

        Step :math:`t`'s fit at the training inputs is a linear smoother of the targets,
        :math:`\boldsymbol\mu_t - m = \mathbf S_t(\mathbf y - m)` with
        :math:`\mathbf S_t = \mathbf K G_t(\mathbf K) = (F_t(\mathbf K) - \alpha\mathbf I)/(1 -
        \alpha)`, and

        .. math::
            \operatorname{GCV}(t) = \frac{N \lVert \mathbf y - \boldsymbol\mu_t \rVert^2}
            {\big(N - \operatorname{tr}\mathbf S_t\big)^2},

        with :math:`\operatorname{tr}\mathbf S_t` read off the eigenvalues (smaller is better).
        :math:`\mathbf I - \mathbf S_t = E_t(\mathbf K)` is evaluated by its own recurrence
        (:meth:`~gpsd.linalg.SpectralFilter.data_centric_residuals`), not as differences:
        :math:`\mathbf y - \boldsymbol\mu_t` and :math:`N - \operatorname{tr}\mathbf S_t`
        cancel to rounding where the noise is tiny, which made the score NaN, infinite or wrong.
        """
        state = self._state()
        residuals = SpectralFilter.data_centric_residuals(self._schedule(self.gamma), self.alpha)
        n = self.train_x.shape[-2]
        with autograd_context(state):
            dof = state["engine"].trace(residuals)  # N - tr S_t
            resid = state["engine"].apply(residuals, state["coords"]).squeeze(-1)
            rss = resid.square().sum(-1)  # ||y - mu_t||^2
            return (n * rss / dof.square()).to(self.train_y.dtype)

    def validation_mse(self, val_x: Tensor, val_y: Tensor) -> Tensor:
        """Mean squared error of every step's predictive mean on a validation set, ``(*batch, T)``."""
        val_x = validate_test_x(val_x, self.train_x)
        val_y = check_finite(
            as_float_tensor(val_y, "val_y", dtype=val_x.dtype, device=val_x.device), "val_y"
        )
        if val_y.shape[-1] != val_x.shape[-2]:
            raise ValueError(
                f"val_y must have {val_x.shape[-2]} entries (one per row of val_x), "
                f"got shape {tuple(val_y.shape)}"
            )
        mean = self.predict_mean(val_x)
        return (mean - val_y.unsqueeze(-2)).square().mean(-1)

    # ------------------------------------------------------------------ students
    def student(self, t: int, schedule: tuple[int, ...] = ()) -> ExactGP:
        r"""A plain GPyTorch ``ExactGP`` equal to step ``t`` (1-based) of the distillation.

        Its training targets are :math:`\mathbf y_{t-1}` and its ``GaussianLikelihood`` noise is
        :math:`\gamma_t`; kernel and mean are copies of this model's. When ``gamma`` holds a
        batch of schedules, ``schedule`` indexes one of them (with unbatched data, kernel and
        prior mean); the default ``()`` gives the student of the whole batch, one member per
        entry of :meth:`predict`'s batch with its own noise (a teacher batch from
        :meth:`from_teacher`, say). With a batch of targets, kernels or prior means, its
        training inputs are expanded to that batch (shape ``(*b, N, d)``).
        """
        t = check_int(t, "t")
        if t > self.num_steps:
            raise ValueError(f"t must lie in 1..{self.num_steps}, got {t}")
        batch = student_batch(self.train_x, self.train_y, self.mean_module, self.kernel)
        schedule = schedule_index(self.gamma, schedule, batch)
        with torch.no_grad():
            if t == 1:
                targets = self.train_y
            else:
                targets = self.train_targets_path()[..., t - 2, :]
                targets = targets[schedule] if schedule else targets
        noise = self.gamma[schedule][..., t - 1]
        return student_gp(
            self.train_x, targets.detach().clone(), noise, self.mean_module, self.kernel
        )
