"""Distribution-centric self-distillation of GP regression (Borup & Andersen, §3.2)."""

from __future__ import annotations

import copy
import itertools

import torch
from gpytorch.kernels import Kernel
from gpytorch.means import Mean
from gpytorch.models import ExactGP
from linear_operator import to_dense
from linear_operator.utils.cholesky import psd_safe_cholesky
from torch import Tensor

from gpsd._internal.kernel_dtype import kernel_in_dtype
from gpsd._internal.module_state import choice_setting
from gpsd._internal.variance import nonnegative_variance
from gpsd.distillation._common import (
    ExactGPFromModules,
    batched_gp_data,
    pair_batches,
    schedule_index,
    student_batch,
    student_gp,
    student_likelihood,
)
from gpsd.distillation._spectral_gpr import SpectralGPR
from gpsd.kernels import PosteriorKernel
from gpsd.linalg import SpectralFilter
from gpsd.means import PosteriorMean
from gpsd.prediction import Prediction

__all__ = ["DistributionCentricGPR"]

METHODS = ("collapsed", "iterated")


class DistributionCentricGPR(SpectralGPR):
    r"""Distribution-centric self-distillation of a GP regressor: the posterior becomes the prior.

    Starting from :math:`\mathcal{GP}(m_0, k_0) = \mathcal{GP}(m, k)`, step :math:`t = 1, \dots, T`
    conditions the current GP on the same data with noise :math:`\gamma_t` (eqs. 6–7):

    .. math::
        m_t(x) &= m_{t-1}(x) + k_{t-1}(x, \mathbf x)[\mathbf K_{t-1} + \gamma_t\mathbf I]^{-1}
        (\mathbf y - m_{t-1}(\mathbf x)), \\
        k_t(x, x') &= k_{t-1}(x, x') - k_{t-1}(x, \mathbf x)[\mathbf K_{t-1} +
        \gamma_t\mathbf I]^{-1} k_{t-1}(\mathbf x, x').

    Step :math:`t`'s prediction is :math:`\mathcal{GP}(m_t, k_t)`. By Theorem 3.3, :math:`t`
    steps with :math:`\gamma_1, \dots, \gamma_t` equal one ordinary GP with noise

    .. math::
        \tilde\gamma_t = \Big(\sum_{s=1}^{t} 1/\gamma_s\Big)^{-1},

    which for a constant :math:`\gamma` is :math:`\gamma / t`: fitting :math:`t` copies of the data
    (Corollary 3.4). ``method="collapsed"`` (default) uses this closed form for every
    :math:`t = 1..T` from one factorisation (see :class:`~gpsd.DataCentricGPR` for the backends,
    the caching and the gradients); ``method="iterated"`` runs the recursion of eqs. 6–7 literally, one
    conditioning per step on the joint test and training inputs (:math:`\mathcal O(T(N^3 + (M +
    N)^2 N))`, linear in :math:`T`; a reference implementation, without gradients), and
    :meth:`iterated_models` gives the same chain as GPyTorch models through
    :class:`~gpsd.means.PosteriorMean` and :class:`~gpsd.kernels.PosteriorKernel`.
    Changing :attr:`method` of a fitted model reuses its factorisation.

    :param train_x: training inputs, shape ``(*b, N, d)`` (or ``(N,)``).
    :param train_y: training targets, shape ``(*b, N)``.
    :param covar_module: the prior covariance :math:`k`.
    :param noise: the schedule :math:`\gamma_1, \dots, \gamma_T`: one value (repeated
        ``num_steps`` times, or one step), a list, or a ``(*s, T)`` tensor; each value > 0.
        Assigning ``model.noise`` later is checked the same way and keeps :math:`T`.
    :param num_steps: the number of steps :math:`T` (default: the length of ``noise``).
    :param mean_module: the prior mean :math:`m` (default zero).
    :param method: ``"collapsed"`` or ``"iterated"``.
    :param backend, linalg_dtype, rank, rtol, kernel_cache_bytes, process_group: as in
        :class:`~gpsd.DataCentricGPR`.

    Example:
        >>> model = DistributionCentricGPR(train_x, train_y, covar_module, noise=0.1, num_steps=5)
        >>> model.predict(test_x, step=5, include_noise=True).variance  # noise 0.1 / 5 added
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
        method: str = "collapsed",
        backend: str = "auto",
        linalg_dtype: torch.dtype | None = torch.float64,
        rank: int | None = None,
        rtol: float = 1e-6,
        kernel_cache_bytes: int | None = None,
        process_group: object = None,
    ) -> None:
        self.method = method  # checked before the base class does any work
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

    method = choice_setting(
        "method", METHODS, '``"collapsed"`` or ``"iterated"``; may be changed between predictions.'
    )

    def _targets_config(self) -> tuple:
        return (self.method,)

    @property
    def effective_noise(self) -> Tensor:
        r""":math:`\tilde\gamma_t = 1 / \sum_{s \le t} 1/\gamma_s` for ``t = 1..T``, shape ``(*s, T)``."""
        return 1.0 / torch.cumsum(1.0 / self.noise, dim=-1)

    def _smallest_shift(self) -> float:
        return float(self.effective_noise.min())

    def _step_noise(self) -> Tensor:
        return self.effective_noise

    def _mean_filter(self) -> SpectralFilter:
        return SpectralFilter.resolvent(self._schedule(self.effective_noise))

    def _variance_filter(self) -> SpectralFilter:
        return self._mean_filter()

    def _residual_filter(self) -> SpectralFilter:
        # I - S_t = noise_t (K + noise_t I)^{-1}: the resolvent, a multiple of it per step
        return self._mean_filter()

    def step_targets(self, step: int | None = None) -> Tensor:
        """The targets each step is fitted to: ``train_y`` at every step, expanded (a view) to
        shape ``(*batch, T, N)`` (or ``(*batch, N)`` for ``step=t``), as
        :meth:`DataCentricGPR.step_targets <gpsd.DataCentricGPR.step_targets>` lays them out.

        :param step: a step ``t`` in ``1..T`` (default: every step).
        """
        step = self._check_step(step)
        with torch.no_grad():
            mean_batch = self.mean_module(self.train_x).shape[:-1]
        batch = torch.broadcast_shapes(self.noise.shape[:-1], self.train_y.shape[:-1], mean_batch)
        targets = self.train_y.unsqueeze(-2).expand(*batch, self.num_steps, self.train_y.shape[-1])
        return targets if step is None else targets[..., step - 1, :]

    def predict(
        self,
        test_x: Tensor,
        *,
        step: int | None = None,
        include_noise: bool = False,
        full_cov: bool = False,
    ) -> Prediction:
        """Means and variances of :math:`\\mathcal{GP}(m_t, k_t)`, ``t = 1..T``, at ``test_x``.

        As :meth:`DataCentricGPR.predict <gpsd.DataCentricGPR.predict>`: shapes
        ``(*batch, T, M)`` (covariances ``(*batch, T, M, M)`` with ``full_cov=True``), or
        ``(*batch, M)`` for ``step=t``; ``include_noise`` adds the effective noise
        :math:`\\tilde\\gamma_t` of each step.
        """
        return super().predict(test_x, step=step, include_noise=include_noise, full_cov=full_cov)

    def _predict_all(self, test_x: Tensor, full_cov: bool) -> Prediction:
        if self.method == "iterated":
            return self._predict_iterated(test_x, full_cov)
        return super()._predict_all(test_x, full_cov)

    def predict_mean(self, test_x: Tensor, *, step: int | None = None) -> Tensor:
        """Means of :math:`\\mathcal{GP}(m_t, k_t)`, ``t = 1..T``, at ``test_x``: ``(*batch, T, M)``
        (or ``(*batch, M)`` for ``step=t``)."""
        if self.method == "iterated":
            return self.predict(test_x, step=step).mean
        return super().predict_mean(test_x, step=step)

    # ------------------------------------------------------------------ the literal recursion
    def iterated_models(self, schedule: tuple[int, ...] = ()) -> list[ExactGP]:
        """The chain of exact GPs of eqs. 6–7: the model of step ``t`` (list index ``t - 1``) has
        prior :math:`(m_{t-1}, k_{t-1})` and noise :math:`\\gamma_t`.

        Its posterior is :math:`\\mathcal{GP}(m_t, k_t)`. ``schedule`` picks one schedule of a
        batch.
        """
        noise = self.noise[schedule_index(self.noise, schedule)]
        mean_module = copy.deepcopy(self.mean_module)
        covar_module = copy.deepcopy(self.covar_module)
        # shapes: (*b, N, d), (*b, N), with b the batch of the inputs, targets and prior mean
        train_x, train_y = batched_gp_data(self.train_x, self.train_y, mean_module)
        models = []
        for value in noise:
            likelihood = student_likelihood(value, self.train_x)
            model = ExactGPFromModules(train_x, train_y, likelihood, mean_module, covar_module)
            model.eval()
            models.append(model)
            mean_module, covar_module = PosteriorMean(model), PosteriorKernel(model)
        return models

    def _predict_iterated(self, test_x: Tensor, full_cov: bool) -> Prediction:
        r"""The recursion of eqs. 6–7, step by step, on the joint inputs
        :math:`\mathbf Z = [\mathbf x_*; \mathbf X]`.

        Every step conditions on the same training inputs :math:`\mathbf X \subset \mathbf Z`,
        so :math:`m_t(\mathbf Z)` and :math:`k_t(\mathbf Z, \mathbf Z)` follow from step
        :math:`t - 1`'s alone:

        .. math::
            k_t(\mathbf Z, \mathbf Z) = k_{t-1}(\mathbf Z, \mathbf Z)
            - k_{t-1}(\mathbf Z, \mathbf X)[\mathbf K_{t-1} + \gamma_t\mathbf I]^{-1}
            k_{t-1}(\mathbf X, \mathbf Z),

        one Cholesky factorisation of :math:`\mathbf K_{t-1} + \gamma_t\mathbf I` per step:
        :math:`\mathcal O(T (N^3 + (M + N)^2 N))`, linear in :math:`T`. Computed in
        ``linalg_dtype`` without an autograd graph.
        """
        schedules = self.noise.shape[:-1]
        dtype = self.linalg_dtype or self.train_x.dtype
        x, y = batched_gp_data(self.train_x, self.train_y, self.mean_module)  # (*b, N, d), (*b, N)
        batch = torch.broadcast_shapes(test_x.shape[:-2], x.shape[:-2])
        m = test_x.shape[-2]
        z = torch.cat(
            [test_x.expand(*batch, *test_x.shape[-2:]), x.expand(*batch, *x.shape[-2:])], dim=-2
        )  # shape: (*batch, M + N, d)
        with torch.no_grad():
            kernel, z_in = kernel_in_dtype(self.covar_module, z, self.linalg_dtype)
            prior_cov = to_dense(kernel(z_in)).to(dtype)  # shape: (*, M + N, M + N)
            prior_mean = self.mean_module(z).to(dtype)  # shape: (*, M + N)
            y = y.to(dtype)
            prior_var = prior_cov[..., :m, :m].diagonal(dim1=-2, dim2=-1)
            eye = torch.eye(x.shape[-2], dtype=dtype, device=x.device)
            means, variances, covs = [], [], []
            for index in itertools.product(*(range(n) for n in schedules)):
                cov, mean = prior_cov, prior_mean
                step_means, step_vars, step_covs = [], [], []
                for g in self.noise[index].to(dtype):
                    cov_zx = cov[..., :, m:]  # shape: (*, M + N, N)
                    chol = psd_safe_cholesky(cov[..., m:, m:] + g * eye)
                    a = torch.linalg.solve_triangular(chol, cov_zx.mT, upper=False)
                    weights = torch.cholesky_solve((y - mean[..., m:]).unsqueeze(-1), chol)
                    mean = mean + (cov_zx @ weights).squeeze(-1)
                    cov = cov - a.mT @ a
                    cov = 0.5 * (cov + cov.mT)  # keep K_t symmetric for the next factor
                    variance = cov[..., :m, :m].diagonal(dim1=-2, dim2=-1)
                    step_means.append(mean[..., :m])
                    step_vars.append(nonnegative_variance(variance, prior_var))
                    if full_cov:
                        step_covs.append(cov[..., :m, :m])
                means.append(torch.stack(step_means, dim=-2).to(test_x.dtype))
                variances.append(torch.stack(step_vars, dim=-2).to(test_x.dtype))
                if full_cov:
                    covs.append(torch.stack(step_covs, dim=-3).to(test_x.dtype))

        def gather(items):
            # shape: (*schedules, *data batch, T, M[, M]) -> broadcast as the closed form does
            out = torch.stack(items)
            out = out.reshape(*schedules, *out.shape[1:])
            return pair_batches(out, schedules, means[0].shape[:-2])

        return Prediction(gather(means), gather(variances), gather(covs) if full_cov else None)

    def student(self, step: int, schedule: tuple[int, ...] = ()) -> ExactGP:
        r"""A plain ``ExactGP`` equal to step ``step`` (counted from 1) by Theorem 3.3: noise
        :math:`\tilde\gamma_t`.

        When ``noise`` holds a batch of schedules, ``schedule`` indexes one of them (with
        unbatched data, kernel and prior mean); the default ``()`` gives the student of the whole
        batch, one member per entry of :meth:`predict`'s batch with its own noise. With a batch
        of targets, kernels or prior means, its training inputs are expanded to that batch
        (shape ``(*b, N, d)``).
        """
        step = self._check_step(step)
        batch = student_batch(self.train_x, self.train_y, self.mean_module, self.covar_module)
        schedule = schedule_index(self.noise, schedule, batch)
        noise = self.effective_noise[schedule][..., step - 1]
        return student_gp(self.train_x, self.train_y, noise, self.mean_module, self.covar_module)
