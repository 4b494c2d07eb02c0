"""DKL baseline: one deterministic network and an exact RBF kernel (Wilson et al., 2016)."""

from __future__ import annotations

from collections.abc import Callable

import gpytorch
from torch import Tensor, nn

from gpsd.dpkl.dpkl_regressor import DPKLRegressor

__all__ = ["DKLRegressor"]


class DKLRegressor(DPKLRegressor):
    r"""Deep Kernel Learning: :math:`K_{ij} = s\,\exp(-\lVert g_{\mathbf{w}}(\mathbf{x}_i) -
    g_{\mathbf{w}}(\mathbf{x}_j)\rVert^2 / 2\ell^2)` with one deterministic network.

    It is :class:`DPKLRegressor` with ``num_particles=1`` and ``embedding_kernel="exact"``: with one particle
    :math:`\kappa(\mathbf{w}, \mathbf{w}) = 1` and the repulsive term vanishes, so the functional
    gradient is the ordinary gradient of the negative log marginal likelihood. Same API
    (``fit``, ``predict``, ``nll``, ``rmse``, ``embed``).

    :param train_x: ``(n, D)`` training inputs, or ``(n,)`` for one input feature.
    :param train_y: ``(n,)`` training targets (standardise them).
    :param feature_extractor: a network mapping ``(n, D)`` to ``(n, latent_dim)`` or a callable
        returning one.
    :param latent_dim: :math:`d`, checked against the network's output width.
    :param nu: ``None`` (RBF kernel) or a Matérn smoothness in {0.5, 1.5, 2.5}.
    :param likelihood: a ``GaussianLikelihood`` (default: a new one).
    :param mean_module: the prior mean, a GPyTorch ``Mean`` (default: a learned constant).
    """

    def __init__(
        self,
        train_x: Tensor,
        train_y: Tensor,
        feature_extractor: nn.Module | Callable[[], nn.Module],
        *,
        latent_dim: int = 2,
        nu: float | None = None,
        likelihood: gpytorch.likelihoods.GaussianLikelihood | None = None,
        mean_module: gpytorch.means.Mean | None = None,
    ) -> None:
        super().__init__(
            train_x,
            train_y,
            feature_extractor,
            num_particles=1,
            latent_dim=latent_dim,
            embedding_kernel="exact",
            nu=nu,
            update="paper",
            input_kernel=None,
            likelihood=likelihood,
            mean_module=mean_module,
        )
