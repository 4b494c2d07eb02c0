"""Data-centric self-distillation of GP regression (Borup & Andersen, §3.1)."""

from __future__ import annotations

import copy

import gpytorch
import torch
from gpytorch.distributions import MultivariateNormal
from gpytorch.kernels import Kernel
from gpytorch.likelihoods import GaussianLikelihood
from gpytorch.means import Mean, ZeroMean
from gpytorch.models import ExactGP
from linear_operator.operators import DiagLinearOperator
from torch import Tensor

from gpsd.distillation._common import (
    ExactGPFromModules,
    RegressionPath,
    StateSnapshot,
    make_engine,
    nonnegative_variance,
    unpack_teacher,
    validate_gamma,
    validate_test_x,
    validate_training_data,
)
from gpsd.linalg import SpectralFilter

__all__ = ["DataCentricGPR"]


class DataCentricGPR(gpytorch.Module):
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
    * ``backend="auto"``: chosen by :func:`~gpsd.linalg.choose_backend` from N, the number of steps
      and the device.

    The factorisation is cached and recomputed when the kernel's or the mean's parameters change.
    Gradients flow to the hyperparameters through the dense and Cholesky backends.

    :param kernel: the prior covariance :math:`k` (a GPyTorch kernel, trained or not).
    :param train_x: training inputs, shape ``(*b, N, d)`` (or ``(N,)``).
    :param train_y: training targets :math:`\mathbf y`, shape ``(*b, N)``.
    :param gamma: the noise schedule :math:`\gamma_1..\gamma_T`: a scalar (one step), a list, or a
        tensor of shape ``(*s, T)`` holding a batch of schedules.
    :param alpha: weight :math:`\alpha \in [0, 1)` of the original targets in every step.
    :param mean_module: the prior mean :math:`m` (default: zero).
    :param backend: ``"auto"``, ``"dense"``, ``"cholesky"`` or ``"lanczos"``.
    :param linalg_dtype: dtype of the factorisation (default float64; ``None`` keeps the data's).
    :param rank: Krylov basis size of the Lanczos backend (default: grown from 64 until the
        error estimate meets ``rtol``).
    :param rtol: accuracy target; the Lanczos backend warns when its estimate exceeds it.

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
    ) -> None:
        super().__init__()
        if not isinstance(kernel, Kernel):
            raise TypeError(
                f"kernel must be a gpytorch.kernels.Kernel, got {type(kernel).__name__}"
            )
        if mean_module is not None and not isinstance(mean_module, Mean):
            raise TypeError(
                f"mean_module must be a gpytorch.means.Mean, got {type(mean_module).__name__}"
            )
        alpha = float(alpha)
        if not 0.0 <= alpha < 1.0:
            raise ValueError(f"alpha must lie in [0, 1), got {alpha}")
        train_x, train_y = validate_training_data(train_x, train_y)
        self.kernel = kernel
        self.mean_module = mean_module if mean_module is not None else ZeroMean()
        self.register_buffer("train_x", train_x)
        self.register_buffer("train_y", train_y)
        self.register_buffer("gamma", validate_gamma(gamma, train_x))
        self.alpha = alpha
        self.backend = backend
        self.linalg_dtype = linalg_dtype
        self.rank = rank
        self.rtol = rtol
        self._cache: dict = {}

    @classmethod
    def from_teacher(
        cls, teacher: ExactGP, gamma: object = None, num_steps: int | None = None, **kwargs
    ) -> DataCentricGPR:
        """Distil a trained ``ExactGP`` teacher with a ``GaussianLikelihood``.

        The teacher's mean and kernel modules are shared, not copied. ``gamma`` defaults to the
        teacher's noise repeated ``num_steps`` times (the teacher itself is step 1).
        """
        train_x, train_y, noise = unpack_teacher(teacher)
        if gamma is None:
            if num_steps is None or num_steps < 1:
                raise ValueError("give gamma, or num_steps >= 1 to repeat the teacher's noise")
            gamma = noise.reshape(-1)[:1].repeat(num_steps) if noise.dim() <= 1 else noise
        return cls(
            teacher.covar_module, train_x, train_y, gamma, mean_module=teacher.mean_module, **kwargs
        )

    # ------------------------------------------------------------------ shapes
    @property
    def num_steps(self) -> int:
        """:math:`T`, the number of steps of every schedule."""
        return self.gamma.shape[-1]

    def _filters(self) -> tuple[SpectralFilter, SpectralFilter, SpectralFilter]:
        gamma = self.gamma.to(self.linalg_dtype or self.gamma.dtype)
        return (
            SpectralFilter.data_centric_targets(gamma, self.alpha),
            SpectralFilter.data_centric_weights(gamma, self.alpha),
            SpectralFilter.resolvent(gamma),
        )

    # ------------------------------------------------------------------ cached factorisation
    def _state(self) -> dict:
        """The backend engine and the targets' coordinates, recomputed when parameters change."""
        snapshot = self._cache.get("snapshot")
        if snapshot is None or not snapshot.matches(self):
            self._cache = {"snapshot": StateSnapshot(self)}
            x = self.train_x
            kernel_matrix = self.kernel(x)
            prior_mean = self.mean_module(x)
            engine = make_engine(
                kernel_matrix,
                self.backend,
                self.gamma[..., 0].numel() * self.num_steps,
                self.linalg_dtype,
                self.rank,
                generator_seed=0,
                gamma_min=float(self.gamma.min()),
                rtol=self.rtol,
            )
            engine.check_accuracy(float(self.gamma.min()), self.rtol)
            centred = (self.train_y - prior_mean).unsqueeze(-1)  # shape: (*b, N, 1)
            self._cache["engine"] = engine
            self._cache["prior_mean"] = prior_mean
            self._cache["centred"] = centred
            self._cache["coords"] = (
                engine.project(centred) if hasattr(engine, "project") else centred
            )
        return self._cache

    @property
    def error_estimate(self) -> float:
        """Estimated relative error of the backend (0 for the exact dense and Cholesky ones)."""
        return self._state()["engine"].error_estimate(float(self.gamma.min()))

    # ------------------------------------------------------------------ results
    def train_targets_path(self) -> Tensor:
        r"""The targets :math:`\mathbf y_1, \dots, \mathbf y_T`, shape ``(*batch, T, N)``."""
        state = self._state()
        targets = state["engine"].apply(self._filters()[0], state["coords"]).squeeze(-1)
        out = targets + state["prior_mean"].unsqueeze(-2)
        return out.to(self.train_y.dtype)

    def predict(self, test_x: Tensor, full_cov: bool = False) -> RegressionPath:
        r"""Predictive means and variances of every step at ``test_x`` (shape ``(*b, M, d)``).

        Returns a :class:`RegressionPath` with ``mean`` and ``variance`` of shape
        ``(*batch, T, M)``; with ``full_cov=True`` also the ``(*batch, T, M, M)`` covariances.
        """
        test_x = validate_test_x(test_x, self.train_x)
        state = self._state()
        engine = state["engine"]
        _, weights, resolvent = self._filters()
        cross = self.kernel(self.train_x, test_x).to_dense()  # shape: (*b, N, M)
        mean = engine.cross(weights, cross, state["coords"]).squeeze(-1)  # shape: (*, T, M)
        mean = mean.to(test_x.dtype) + self.mean_module(test_x).unsqueeze(-2)
        prior_var = self.kernel(test_x, diag=True)  # shape: (*b, M)
        reduction = engine.quad_diag(resolvent, cross).to(test_x.dtype)
        variance = nonnegative_variance(
            prior_var.unsqueeze(-2) - reduction, prior_var.unsqueeze(-2)
        )
        covariance = None
        if full_cov:
            prior_cov = self.kernel(test_x).to_dense()
            covariance = prior_cov.unsqueeze(-3) - engine.cross(resolvent, cross, cross).to(
                test_x.dtype
            )
        return RegressionPath(mean, variance, covariance)

    def forward(self, test_x: Tensor, full_cov: bool = False) -> MultivariateNormal:
        """The latent predictive distributions of all steps: batch shape ``(*batch, T)``."""
        path = self.predict(test_x, full_cov=full_cov)
        if full_cov:
            return MultivariateNormal(path.mean, path.covariance)
        return MultivariateNormal(path.mean, DiagLinearOperator(path.variance))

    # ------------------------------------------------------------------ choosing t
    def gcv(self) -> Tensor:
        r"""Generalised cross-validation score of every step, shape ``(*batch, T)``.

        Step :math:`t`'s fit at the training inputs is a linear smoother of the targets,
        :math:`\boldsymbol\mu_t - m = \mathbf S_t(\mathbf y - m)` with
        :math:`\mathbf S_t = (F_t(\mathbf K) - \alpha\mathbf I)/(1 - \alpha)`, and

        .. math::
            \operatorname{GCV}(t) = \frac{N \lVert \mathbf y - \boldsymbol\mu_t \rVert^2}
            {\big(N - \operatorname{tr}\mathbf S_t\big)^2},

        with :math:`\operatorname{tr}\mathbf S_t` read off the eigenvalues (smaller is better).
        """
        state = self._state()
        targets_filter = self._filters()[0]
        n = self.train_x.shape[-2]
        centred = state["centred"].squeeze(-1)
        targets = state["engine"].apply(targets_filter, state["coords"]).squeeze(-1)
        fitted = (targets - self.alpha * centred.unsqueeze(-2).to(targets)) / (1.0 - self.alpha)
        rss = (centred.unsqueeze(-2).to(fitted) - fitted).square().sum(-1)
        trace = (state["engine"].trace(targets_filter) - self.alpha * n) / (1.0 - self.alpha)
        return (n * rss / (n - trace).square()).to(self.train_y.dtype)

    def validation_mse(self, val_x: Tensor, val_y: Tensor) -> Tensor:
        """Mean squared error of every step's predictive mean on a validation set, ``(*batch, T)``."""
        val_x = validate_test_x(val_x, self.train_x)
        val_y = torch.as_tensor(val_y, dtype=val_x.dtype, device=val_x.device)
        if val_y.shape[-1] != val_x.shape[-2]:
            raise ValueError(
                f"val_y must have {val_x.shape[-2]} entries (one per row of val_x), "
                f"got shape {tuple(val_y.shape)}"
            )
        mean = self.predict(val_x).mean
        return (mean - val_y.unsqueeze(-2)).square().mean(-1)

    # ------------------------------------------------------------------ students
    def student(self, t: int, schedule: tuple[int, ...] = ()) -> ExactGP:
        r"""A plain GPyTorch ``ExactGP`` equal to step ``t`` (1-based) of the distillation.

        Its training targets are :math:`\mathbf y_{t-1}` and its ``GaussianLikelihood`` noise is
        :math:`\gamma_t`; kernel and mean are copies of this model's. ``schedule`` indexes the
        batch of schedules when ``gamma`` holds several.
        """
        if not 1 <= t <= self.num_steps:
            raise ValueError(f"t must lie in 1..{self.num_steps}, got {t}")
        with torch.no_grad():
            if t == 1:
                targets = self.train_y.expand(*self.gamma.shape[:-1], *self.train_y.shape)
            else:
                targets = self.train_targets_path()[..., t - 2, :]
            if targets.dim() > self.train_y.dim():
                targets = targets[schedule]
            noise = self.gamma[schedule + (t - 1,)] if self.gamma.dim() > 1 else self.gamma[t - 1]
        likelihood = GaussianLikelihood().to(self.train_x)
        likelihood.noise = noise.to(self.train_x)
        return ExactGPFromModules(
            self.train_x,
            targets.detach().clone(),
            likelihood,
            copy.deepcopy(self.mean_module),
            copy.deepcopy(self.kernel),
        ).eval()
