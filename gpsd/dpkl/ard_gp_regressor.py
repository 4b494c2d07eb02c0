"""Plain GP baseline with an ARD squared-exponential kernel on the raw inputs."""

from __future__ import annotations

import math
from typing import Literal

import gpytorch
import torch
from torch import Tensor

from gpsd._internal.validation import check_positive_float
from gpsd.dpkl._regressor_base import EmbeddingGPRegressorBase, check_inputs
from gpsd.progress import Callback

__all__ = ["ARDGPRegressor"]

#: The hyperpriors :class:`ARDGPRegressor` knows (``None``: none, maximum likelihood).
_HYPERPRIORS = ("dim_scaled", None)
#: The training objectives :class:`ARDGPRegressor` knows.
_OBJECTIVES = ("mll", "loo")


def _tensor(value: float, like: Tensor) -> Tensor:
    """``value`` in ``like``'s dtype and device (a prior built from a Python float is float32)."""
    return torch.tensor(value, dtype=like.dtype, device=like.device)


def _dim_scaled_lengthscale_prior(num_dims: int, like: Tensor) -> gpytorch.priors.LogNormalPrior:
    r"""The dimension-scaled prior of every ARD lengthscale (Hvarfner, Hellsten & Nardi, 2024):
    :math:`\log h_j \sim \mathcal N(\sqrt2 + \tfrac12 \log D,\ 3)`."""
    return gpytorch.priors.LogNormalPrior(
        loc=_tensor(math.sqrt(2.0) + 0.5 * math.log(num_dims), like),
        scale=_tensor(math.sqrt(3.0), like),
    )


def _noise_prior(like: Tensor) -> gpytorch.priors.LogNormalPrior:
    r"""The prior of the noise variance :math:`\sigma^2` (BoTorch's ``SingleTaskGP`` default):
    :math:`\log \sigma^2 \sim \mathcal N(-4,\ 1)`."""
    return gpytorch.priors.LogNormalPrior(loc=_tensor(-4.0, like), scale=_tensor(1.0, like))


class ARDGPRegressor(EmbeddingGPRegressorBase):
    r"""Exact GP with :math:`k(\mathbf{x}, \mathbf{x}') = s \exp\big(-\tfrac12 \sum_j
    (x_j - x'_j)^2 / h_j^2\big)` on the inputs (the "GP" baseline of Mallick et al.).

    Same API as :class:`~gpsd.dpkl.DPKLRegressor` (``fit``, ``predict``, ``nll``, ``rmse``); all
    hyperparameters follow the ordinary gradient. With the default kernel the lengthscales
    start at ``initial_lengthscale`` (default :math:`\sqrt{D}`, the scale of the distances
    between standardised inputs; GPyTorch's default 0.69 makes every kernel entry vanish for
    large :math:`D`, and a short Adam run then never leaves the noise-only solution).

    :param train_x: ``(n, D)`` training inputs, or ``(n,)`` for one input feature.
    :param train_y: ``(n,)`` training targets (standardise them).
    :param covar_module: a GPyTorch kernel on the inputs (default: the ARD kernel above,
        ``ScaleKernel(RBFKernel(ard_num_dims=D))``).
    :param mean_module: the prior mean, a GPyTorch ``Mean`` (default: a learned constant).
    :param likelihood: a ``GaussianLikelihood`` (default: a new one).
    :param initial_lengthscale: the starting value of every lengthscale of the default kernel
        (default :math:`\sqrt{D}`); not with ``covar_module``.
    :param hyperprior: ``"dim_scaled"`` registers GPyTorch priors on the default modules, so that
        training maximises the posterior (MAP) instead of the likelihood: on each lengthscale of
        the default kernel the dimension-scaled prior of Hvarfner, Hellsten & Nardi (2024),
        :math:`\log h_j \sim \mathcal N(\sqrt2 + \tfrac12\log D,\ 3)` (on the inputs as
        given: standardise them; BoTorch scales them to the unit cube), and on the noise of the
        default likelihood :math:`\log \sigma^2 \sim \mathcal N(-4,\ 1)` (BoTorch's
        ``SingleTaskGP`` default; the noise keeps GPyTorch's lower bound :math:`10^{-4}`); no
        prior on the outputscale or the mean. A ``covar_module`` or ``likelihood`` of your own
        keeps its own priors. ``None``: no priors.
    :param objective: the training objective (:meth:`training_loss`): ``"mll"`` (the log
        marginal likelihood) or ``"loo"`` (the leave-one-out predictive log likelihood).
    """

    def __init__(
        self,
        train_x: Tensor,
        train_y: Tensor,
        *,
        covar_module: gpytorch.kernels.Kernel | None = None,
        mean_module: gpytorch.means.Mean | None = None,
        likelihood: gpytorch.likelihoods.GaussianLikelihood | None = None,
        initial_lengthscale: float | None = None,
        hyperprior: Literal["dim_scaled"] | None = None,
        objective: Literal["mll", "loo"] = "mll",
    ) -> None:
        train_x = check_inputs(train_x, "train_x")
        if not (hyperprior is None or (isinstance(hyperprior, str) and hyperprior in _HYPERPRIORS)):
            raise ValueError(f"hyperprior must be 'dim_scaled' or None, got {hyperprior!r}")
        if not (isinstance(objective, str) and objective in _OBJECTIVES):
            raise ValueError(f"objective must be 'mll' or 'loo', got {objective!r}")
        if covar_module is not None:
            if not isinstance(covar_module, gpytorch.kernels.Kernel):
                raise TypeError(
                    "covar_module must be a gpytorch.kernels.Kernel or None, got "
                    f"{type(covar_module).__name__}"
                )
            if initial_lengthscale is not None:
                raise ValueError(
                    "initial_lengthscale sets the default kernel's lengthscales; with a "
                    "covar_module of your own, set its lengthscale instead"
                )
        else:
            if initial_lengthscale is None:
                initial_lengthscale = math.sqrt(train_x.shape[-1])
            initial_lengthscale = check_positive_float(initial_lengthscale, "initial_lengthscale")
        num_dims = train_x.shape[-1]
        if likelihood is None and hyperprior is not None:
            likelihood = gpytorch.likelihoods.GaussianLikelihood(noise_prior=_noise_prior(train_x))
        super().__init__(train_x, train_y, likelihood, mean_module)
        self.hyperprior = hyperprior
        self.objective = objective
        if covar_module is None:
            lengthscale_prior = None
            if hyperprior is not None:
                lengthscale_prior = _dim_scaled_lengthscale_prior(num_dims, train_x)
            covar_module = gpytorch.kernels.ScaleKernel(
                gpytorch.kernels.RBFKernel(
                    ard_num_dims=num_dims, lengthscale_prior=lengthscale_prior
                )
            ).to(train_x)
            # a tensor in the data's dtype: a Python float passes through float32 in the setter
            covar_module.base_kernel.lengthscale = torch.tensor(
                initial_lengthscale, dtype=train_x.dtype, device=train_x.device
            )
        self.covar_module = covar_module
        self.to(train_x)

    def training_loss(self) -> Tensor:
        r"""The negative training objective per training point, in either mode (see
        :meth:`EmbeddingGPRegressorBase.training_loss
        <gpsd.dpkl.DPKLRegressor.training_loss>`): with ``objective="mll"`` the log
        marginal likelihood, with ``"loo"`` the leave-one-out predictive log likelihood
        (Rasmussen & Williams, 2006, eq. 5.10-5.12; GPyTorch's ``LeaveOneOutPseudoLikelihood``)

        .. math::

            \sum_{i=1}^n \log \mathcal N\big(y_i \mid \mu_{-i}, \sigma^2_{-i}\big), \qquad
            \mu_{-i} = y_i - \frac{[\mathbf K^{-1}(\mathbf y - \mathbf m)]_i}
                {[\mathbf K^{-1}]_{ii}}, \qquad \sigma^2_{-i} = \frac{1}{[\mathbf K^{-1}]_{ii}},

        with :math:`\mathbf K` the kernel matrix plus the noise; either plus the log density of
        every prior registered on the modules (``hyperprior``), all divided by :math:`n`.
        """
        if self.objective == "mll":
            return super().training_loss()
        loo = gpytorch.mlls.LeaveOneOutPseudoLikelihood(self.likelihood, self)
        return -loo(self.forward(self.train_inputs[0]), self.train_targets)

    def fit(
        self,
        *,
        max_iter: int = 300,
        lr: float = 0.1,
        val_x: Tensor | None = None,
        val_y: Tensor | None = None,
        check_every: int = 10,
        optimizer: torch.optim.Optimizer | None = None,
        progress: object = False,
        callback: Callback | None = None,
    ) -> ARDGPRegressor:
        """Maximise the marginal likelihood with Adam (see
        :meth:`EmbeddingGPRegressorBase.fit <gpsd.dpkl.DPKLRegressor.fit>` for every argument),
        by default to convergence: 300 steps at learning rate 0.1. On the small-data protocol
        (``benchmarks/results/dpkl_defaults.md``) that is more accurate than 200 steps at 0.01 in
        six of eight cells (test RMSE 3.29 against 3.94 on deliveries at n = 100, 2.68 against
        5.20 on meats at n = 150) and less accurate in two (concrete and Boston at n = 100, where
        the converged fit overfits 8 or 13 lengthscales). Against early stopping (60 steps),
        MAP (``hyperprior="dim_scaled"``), the leave-one-out objective (``objective="loo"``) and
        the leave-one-out choice among the first three, on deliveries, concrete, Boston and meats
        at two sizes each (``benchmarks/results/small_data_hyperparameters_cpu.md``), it is
        within 5 % of the best test RMSE in seven of eight cells (17.5 % above it on meats at
        n = 100) and within 0.21 nats of the best test NLL in all; the leave-one-out choice does
        as well at the cost of three fits, and every other option misses more cells.

        :returns: ``self``, fitted and in evaluation mode.
        """
        return super().fit(
            max_iter=max_iter,
            lr=lr,
            val_x=val_x,
            val_y=val_y,
            check_every=check_every,
            optimizer=optimizer,
            progress=progress,
            callback=callback,
        )
