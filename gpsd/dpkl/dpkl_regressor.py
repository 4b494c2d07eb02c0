"""DPKL: GP regression on probabilistic embeddings (Mallick et al., 2021)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import gpytorch
import torch
from torch import Tensor, nn

from gpsd._internal.negligible import drop_negligible
from gpsd._internal.validation import check_int
from gpsd.dpkl._regressor_base import EmbeddingGPRegressorBase, check_inputs
from gpsd.dpkl.embedding_kernel import ProbabilisticEmbeddingKernel
from gpsd.dpkl.expected_embedding_kernel import ExpectedEmbeddingKernel
from gpsd.dpkl.particle_ensemble import ParticleEnsemble
from gpsd.dpkl.random_feature_kernel import RandomFeatureKernel

__all__ = ["DPKLRegressor"]


class DPKLRegressor(EmbeddingGPRegressorBase):
    r"""Deep Probabilistic Kernel Learning regressor (Mallick et al., 2021, §3, Algorithm 1).

    An :class:`~gpytorch.models.ExactGP` whose inputs are the latent distributions
    :math:`p(\mathbf{Z}\mid\mathbf{x})` given by ``m`` particles of a feature extractor
    :math:`g_{\mathbf{w}}: \mathbb{R}^D \to \mathbb{R}^d`, with the kernel between distributions

    .. math::

        \hat{K}(\mathbf{x}, \mathbf{x}') = \frac{1}{m^2}\sum_{l,l'}
        k\big(g_{\mathbf{w}_l}(\mathbf{x}), g_{\mathbf{w}_{l'}}(\mathbf{x}')\big)
        \approx \bar{\boldsymbol\phi}(\mathbf{x})^\top \bar{\boldsymbol\phi}(\mathbf{x}'),

    (``embedding_kernel="rff"``: random Fourier features, or orthogonal ones with ``orthogonal=True``, as a
    low-rank operator solved by Woodbury in :math:`O(nR^2)`; ``embedding_kernel="exact"``: the exact
    expected kernel, :math:`O(n^2m^2)`). The likelihood is Gaussian with a learned noise; the mean
    is a learned constant; the base kernel's lengthscale and outputscale are learned. The particles
    are trained by the functional gradient of the negative log marginal likelihood
    :math:`\hat{L}` (see :meth:`fit`): ``update="paper"`` is Prop. 1
    (:math:`\sum_l \kappa(\mathbf{w}, \mathbf{w}_l)\nabla_{\mathbf{w}_l}\hat{L}`), ``update="svgd"``
    adds SVGD's repulsive term :math:`-\tfrac{1}{m}\sum_l \nabla_{\mathbf{w}_l}\kappa(\mathbf{w}_l,
    \mathbf{w})` (:class:`~gpsd.dpkl.SteinVariationalGradient` with ``loss_type="joint"``).

    Train it with :meth:`fit` (which returns the model); :meth:`predict` gives the latent
    posterior (``include_noise=True``: of the observations) as a :class:`~gpsd.Prediction`, and
    ``model(test_x)`` in evaluation mode the latent ``MultivariateNormal``; both raise
    :class:`~gpsd.NotFittedError` before :meth:`fit`. A feature extractor that produces NaN or
    inf embeddings raises a ``ValueError`` that names it (in :meth:`fit`, with the iteration).

    :param train_x: ``(n, D)`` training inputs, or ``(n,)`` for one input feature.
    :param train_y: ``(n,)`` training targets (standardise them).
    :param feature_extractor: a network mapping ``(n, D)`` to ``(n, latent_dim)`` (copied and
        re-initialised per particle) or a callable returning a fresh one.
    :param num_particles: :math:`m \ge 1`.
    :param latent_dim: :math:`d`, checked against the network's output width.
    :param num_random_features: :math:`R \ge 1` (``2R`` features).
    :param embedding_kernel: ``"rff"`` (random Fourier features) or ``"exact"``, the kernel
        between the embeddings.
    :param orthogonal: orthogonal random features (Yu et al., 2016).
    :param nu: ``None`` (RBF base kernel) or a Matérn smoothness in {0.5, 1.5, 2.5}.
    :param update: ``"paper"`` or ``"svgd"``.
    :param repulsion: weight of the repulsive term (default ``None``: 0 for ``"paper"``, 1 for
        ``"svgd"``, following :attr:`update` if it is changed later).
    :param bandwidth: ``"median"`` (:math:`h = \mathrm{med}^2/\log m`) or a fixed :math:`h`.
    :param likelihood: a :class:`~gpytorch.likelihoods.GaussianLikelihood` (default: a new one).
    :param mean_module: the prior mean, a GPyTorch ``Mean`` (default: a learned constant).
    """

    def __init__(
        self,
        train_x: Tensor,
        train_y: Tensor,
        feature_extractor: nn.Module | Callable[[], nn.Module],
        *,
        num_particles: int = 10,
        latent_dim: int = 2,
        num_random_features: int = 100,
        embedding_kernel: Literal["rff", "exact"] = "rff",
        orthogonal: bool = False,
        nu: float | None = None,
        update: Literal["paper", "svgd"] = "paper",
        repulsion: float | None = None,
        bandwidth: float | Literal["median"] = "median",
        likelihood: gpytorch.likelihoods.GaussianLikelihood | None = None,
        mean_module: gpytorch.means.Mean | None = None,
    ) -> None:
        train_x = check_inputs(train_x, "train_x")
        super().__init__(train_x, train_y, likelihood, mean_module)
        latent_dim = check_int(latent_dim, "latent_dim")
        if embedding_kernel not in ("rff", "exact"):
            raise ValueError(f"embedding_kernel must be 'rff' or 'exact', got {embedding_kernel!r}")
        # checked by the setters, before the ensemble is built
        self.update, self.repulsion, self.bandwidth = update, repulsion, bandwidth
        if nu is not None and nu not in (0.5, 1.5, 2.5):  # before either kernel is built
            raise ValueError(f"nu must be None (RBF) or one of 0.5, 1.5, 2.5, got {nu!r}")
        ensemble = ParticleEnsemble(feature_extractor, num_particles).to(train_x)
        try:
            # in evaluation mode: BatchNorm in training mode refuses one row, and would fold
            # it into its running statistics
            with torch.no_grad():
                width = ensemble.eval()(train_x[:1]).shape[-1]
        except (RuntimeError, ValueError) as err:
            raise ValueError(
                f"train_x with {train_x.shape[-1]} features does not fit the feature extractor: "
                f"{err}"
            ) from err
        finally:
            ensemble.train()
        if width != latent_dim:
            raise ValueError(
                f"the feature extractor maps to {width} dimensions but latent_dim is {latent_dim}"
            )
        if embedding_kernel == "rff":
            random_features = RandomFeatureKernel(
                num_random_features, latent_dim, nu=nu, orthogonal=orthogonal
            )
            self.covar_module = ProbabilisticEmbeddingKernel(ensemble, random_features)
        else:
            base = (
                gpytorch.kernels.RBFKernel() if nu is None else gpytorch.kernels.MaternKernel(nu=nu)
            )
            self.covar_module = ExpectedEmbeddingKernel(
                ensemble, gpytorch.kernels.ScaleKernel(base), latent_dim=latent_dim
            )
        self.to(train_x)
        self.kernel_type = embedding_kernel

    @property
    def num_particles(self) -> int:
        """The number :math:`m` of particles."""
        return self.covar_module.feature_extractor.num_particles

    @torch.no_grad()
    def embed(self, x: Tensor) -> Tensor:
        """Latent embeddings of ``x`` (``(n, D)`` or ``(n,)``) by every particle:
        ``(m, n, latent_dim)``.

        The networks run in evaluation mode (no dropout, BatchNorm's running statistics used
        and left alone), whatever mode the model is in, as in :meth:`predict`.
        """
        x = check_inputs(x, "x", self.train_inputs[0].shape[-1], like=self.train_inputs[0])
        extractor = self.covar_module.feature_extractor
        was_training = extractor.training
        extractor.eval()
        try:
            return self.covar_module.latent_embeddings(x)
        finally:
            extractor.train(was_training)

    def latent_posterior_variance(self, x: Tensor) -> Tensor:
        r"""Posterior variance of the latent :math:`f` at ``x`` given the training data, with grad.

        .. math::

            \sigma^2(\mathbf{x}) = k_{\star\star} - \mathbf{k}_\star^\top(\hat{\mathbf K} +
            \sigma_\eta^2\mathbf I)^{-1}\mathbf{k}_\star,
            \qquad k_{\star\star} = \hat K(\mathbf{x}, \mathbf{x}),

        for ``embedding_kernel="rff"`` (where :math:`k_{\star\star} = \lVert\bar{\boldsymbol\phi}(\mathbf{x})
        \rVert^2`) in the Woodbury form :math:`\sigma_\eta^2\, \bar{\boldsymbol\phi}^\top
        (\bar{\boldsymbol\Phi}^\top \bar{\boldsymbol\Phi} + \sigma_\eta^2 \mathbf I)^{-1}
        \bar{\boldsymbol\phi}`, :math:`O(nR^2)`.

        It runs in the model's current mode, with one pass of the feature extractor over the
        training inputs and ``x`` together, so that :math:`k_{\star\star}`,
        :math:`\mathbf{k}_\star` and :math:`\hat{\mathbf K}` are blocks of one kernel matrix and
        :math:`\sigma^2 \ge 0`. In training mode each row's embeddings are drawn once (one
        dropout draw, used in every block) and BatchNorm normalises all the rows as one batch
        (and updates its running statistics once); in evaluation mode the result is
        deterministic.
        """
        train_x = self.train_inputs[0]
        x = check_inputs(x, "x", train_x.shape[-1], like=train_x)
        return self._posterior_variance(
            self.covar_module.features(torch.cat([train_x, x])), train_x.shape[0]
        )

    def _posterior_variance(self, features: Tensor, n: int) -> Tensor:
        """:meth:`latent_posterior_variance` at the rows after the first ``n`` of ``features``
        (an output of the kernel's ``features``), given the first ``n`` as the training rows."""
        noise = self.likelihood.noise.squeeze(-1)
        train, query = features[..., :n, :], features[..., n:, :]
        if self.kernel_type == "rff":  # train, query: (n, 2R), (n_x, 2R)
            a = train.mT @ train + noise * torch.eye(
                train.shape[-1], dtype=train.dtype, device=train.device
            )
            chol = torch.linalg.cholesky(a)
            v = torch.linalg.solve_triangular(chol, query.mT, upper=False)  # shape: (2R, n_x)
            return noise * v.pow(2).sum(0)
        covariance = self.covar_module.feature_covariance
        k_xx = covariance(query, diag=True)
        k_xt = drop_negligible(covariance(query, train))  # shape: (n_x, n)
        k_tt = drop_negligible(covariance(train))
        k_tt = k_tt + noise * torch.eye(n, dtype=k_tt.dtype, device=k_tt.device)
        chol = torch.linalg.cholesky(k_tt)
        v = torch.linalg.solve_triangular(chol, k_xt.mT, upper=False)
        return k_xx - v.pow(2).sum(0)
