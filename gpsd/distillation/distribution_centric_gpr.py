"""Distribution-centric self-distillation of GP regression (Borup & Andersen, §3.2)."""

from __future__ import annotations

import copy
import itertools

import gpytorch
import torch
from gpytorch.kernels import Kernel
from gpytorch.means import Mean
from gpytorch.models import ExactGP
from torch import Tensor

from gpsd._internal.module_state import choice_setting
from gpsd._internal.validation import check_int
from gpsd.distillation._common import (
    ExactGPFromModules,
    RegressionPath,
    batched_gp_data,
    pair_batches,
    schedule_index,
    student_batch,
    student_gp,
    student_likelihood,
    validate_test_x,
)
from gpsd.distillation._spectral_gpr import SpectralGPR
from gpsd.kernels import PosteriorKernel
from gpsd.linalg import SpectralFilter
from gpsd.means import PosteriorMean

__all__ = ["DistributionCentricGPR"]

METHODS = ("collapsed", "iterated")


class DistributionCentricGPR(SpectralGPR):
    r"""Distribution-centric self-distillation of a GP regressor: the posterior becomes the prior.

    Starting from :math:`\mathcal{GP}(m_0, k_0) = \mathcal{GP}(m, k)`, step :math:`t` conditions
    the current GP on the same data with noise :math:`\gamma_t` (eqs. 6–7):

    .. math::
        m_{t+1}(x) &= m_t(x) + k_t(x, \mathbf x)[\mathbf K_t + \gamma_t\mathbf I]^{-1}
        (\mathbf y - m_t(\mathbf x)), \\
        k_{t+1}(x, x') &= k_t(x, x') - k_t(x, \mathbf x)[\mathbf K_t + \gamma_t\mathbf I]^{-1}
        k_t(\mathbf x, x').

    By Theorem 3.3, :math:`t` steps with :math:`\gamma_0, \dots, \gamma_{t-1}` equal one ordinary GP
    with noise

    .. math::
        \tilde\gamma_t = \Big(\sum_{s=0}^{t-1} 1/\gamma_s\Big)^{-1},

    which for a constant :math:`\gamma` is :math:`\gamma / t`: fitting :math:`t` copies of the data
    (Corollary 3.4). ``method="collapsed"`` (default) uses this closed form for every
    :math:`t = 1..T` from one factorisation (see :class:`~gpsd.distillation.DataCentricGPR` for
    the backends); ``method="iterated"`` runs the recursion literally through
    :class:`~gpsd.means.PosteriorMean` and :class:`~gpsd.kernels.PosteriorKernel`, one exact GP
    per step (:math:`\mathcal O(t N^3)`; a reference implementation).

    :param kernel: the prior covariance :math:`k`.
    :param train_x: training inputs, shape ``(*b, N, d)``.
    :param train_y: training targets, shape ``(*b, N)``.
    :param gamma: the schedule :math:`\gamma_0..\gamma_{T-1}`, scalar, list or ``(*s, T)`` tensor.
    :param mean_module: the prior mean :math:`m` (default zero).
    :param method: ``"collapsed"`` or ``"iterated"``.
    :param backend, linalg_dtype, rank, rtol, kernel_cache_bytes: as in :class:`~gpsd.distillation.DataCentricGPR`.
    """

    def __init__(
        self,
        kernel: Kernel,
        train_x: Tensor,
        train_y: Tensor,
        gamma: object,
        *,
        mean_module: Mean | None = None,
        method: str = "collapsed",
        backend: str = "auto",
        linalg_dtype: torch.dtype | None = torch.float64,
        rank: int | None = None,
        rtol: float = 1e-6,
        kernel_cache_bytes: int | None = None,
    ) -> None:
        self.method = method  # checked before the base class does any work
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

    method = choice_setting(
        "method", METHODS, '``"collapsed"`` or ``"iterated"``; may be changed between predictions.'
    )

    @property
    def effective_noise(self) -> Tensor:
        r""":math:`\tilde\gamma_t = 1 / \sum_{s<t} 1/\gamma_s` for ``t = 1..T``, shape ``(*s, T)``."""
        return 1.0 / torch.cumsum(1.0 / self.gamma, dim=-1)

    def _smallest_shift(self) -> float:
        return float(self.effective_noise.min())

    def _mean_filter(self) -> SpectralFilter:
        return SpectralFilter.resolvent(self._schedule(self.effective_noise))

    def _variance_filter(self) -> SpectralFilter:
        return self._mean_filter()

    def predict(self, test_x: Tensor, full_cov: bool = False) -> RegressionPath:
        """Means and variances of :math:`\\mathcal{GP}(m_t, k_t)`, ``t = 1..T``, at ``test_x``.

        Shapes ``(*batch, T, M)`` (covariances ``(*batch, T, M, M)`` with ``full_cov=True``).
        """
        if self.method == "iterated":
            return self._predict_iterated(validate_test_x(test_x, self.train_x), full_cov)
        return super().predict(test_x, full_cov)

    def predict_mean(self, test_x: Tensor) -> Tensor:
        """Means of :math:`\\mathcal{GP}(m_t, k_t)`, ``t = 1..T``, at ``test_x``: ``(*batch, T, M)``."""
        if self.method == "iterated":
            return self.predict(test_x).mean
        return super().predict_mean(test_x)

    # ------------------------------------------------------------------ the literal recursion
    def iterated_models(self, schedule: tuple[int, ...] = ()) -> list[ExactGP]:
        """The chain of exact GPs of eqs. 6–7: model ``t`` has prior :math:`(m_{t-1}, k_{t-1})`.

        The posterior of model ``t`` is :math:`\\mathcal{GP}(m_t, k_t)`. ``schedule`` picks one
        schedule of a batch.
        """
        gamma = self.gamma[schedule_index(self.gamma, schedule)]
        mean_module = copy.deepcopy(self.mean_module)
        covar_module = copy.deepcopy(self.kernel)
        # shapes: (*b, N, d), (*b, N), with b the batch of the inputs, targets and prior mean
        train_x, train_y = batched_gp_data(self.train_x, self.train_y, mean_module)
        models = []
        for g in gamma:
            likelihood = student_likelihood(g, self.train_x)
            model = ExactGPFromModules(train_x, train_y, likelihood, mean_module, covar_module)
            model.eval()
            models.append(model)
            mean_module, covar_module = PosteriorMean(model), PosteriorKernel(model)
        return models

    def _predict_iterated(self, test_x: Tensor, full_cov: bool) -> RegressionPath:
        batch = self.gamma.shape[:-1]
        means, variances, covs = [], [], []
        for index in itertools.product(*(range(n) for n in batch)):
            step_means, step_vars, step_covs = [], [], []
            for model in self.iterated_models(index):
                with torch.no_grad(), gpytorch.settings.fast_pred_var(False):
                    post = model(test_x)
                step_means.append(post.mean)
                step_vars.append(post.variance)
                if full_cov:
                    step_covs.append(post.covariance_matrix)
            means.append(torch.stack(step_means, dim=-2))
            variances.append(torch.stack(step_vars, dim=-2))
            if full_cov:
                covs.append(torch.stack(step_covs, dim=-3))

        def gather(items):
            # shape: (*schedules, *data batch, T, M[, M]) -> broadcast as the closed form does
            out = torch.stack(items)
            out = out.reshape(*batch, *out.shape[1:])
            return pair_batches(out, batch, means[0].shape[:-2])

        return RegressionPath(gather(means), gather(variances), gather(covs) if full_cov else None)

    def student(self, t: int, schedule: tuple[int, ...] = ()) -> ExactGP:
        r"""A plain ``ExactGP`` equal to step ``t`` by Theorem 3.3: noise :math:`\tilde\gamma_t`.

        When ``gamma`` holds a batch of schedules, ``schedule`` indexes one of them (with
        unbatched data, kernel and prior mean); the default ``()`` gives the student of the whole
        batch, one member per entry of :meth:`predict`'s batch with its own noise. With a batch
        of targets, kernels or prior means, its training inputs are expanded to that batch
        (shape ``(*b, N, d)``).
        """
        t = check_int(t, "t")
        if t > self.num_steps:
            raise ValueError(f"t must lie in 1..{self.num_steps}, got {t}")
        batch = student_batch(self.train_x, self.train_y, self.mean_module, self.kernel)
        schedule = schedule_index(self.gamma, schedule, batch)
        noise = self.effective_noise[schedule][..., t - 1]
        return student_gp(self.train_x, self.train_y, noise, self.mean_module, self.kernel)
