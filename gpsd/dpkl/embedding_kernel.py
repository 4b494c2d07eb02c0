"""The random-feature kernel between latent distributions of a particle ensemble (eq. 6)."""

from __future__ import annotations

from gpytorch.models.exact_prediction_strategies import LinearPredictionStrategy
from torch import Tensor

from gpsd.dpkl._feature_kernel import FeatureKernel, check_embeddings
from gpsd.dpkl.particle_ensemble import ParticleEnsemble
from gpsd.dpkl.random_feature_kernel import RandomFeatureKernel

__all__ = ["ProbabilisticEmbeddingKernel"]


class ProbabilisticEmbeddingKernel(FeatureKernel):
    r"""Kernel between the latent distributions :math:`p(\mathbf{Z}\mid\mathbf{x})` of an ensemble.

    Each input :math:`\mathbf{x}` is mapped by the particles to :math:`\mathbf{z}_l =
    g_{\mathbf{w}_l}(\mathbf{x})`, :math:`l = 1, \dots, m`, and the expected kernel (eq. 2 of
    Mallick et al.) is approximated with random features :math:`\mathbf{f}` (eq. 4-6):

    .. math::

        \hat{K}(\mathbf{x}, \mathbf{x}') = \frac{1}{m^2} \sum_{l, l'=1}^m
            \mathbf{f}(\mathbf{z}_l)^\top \mathbf{f}(\mathbf{z}'_{l'})
          = \bar{\boldsymbol{\phi}}(\mathbf{x})^\top \bar{\boldsymbol{\phi}}(\mathbf{x}'),
        \qquad
        \bar{\boldsymbol{\phi}}(\mathbf{x}) = \frac{1}{m} \sum_{l=1}^m
            \mathbf{f}(g_{\mathbf{w}_l}(\mathbf{x})) \in \mathbb{R}^{2R}.

    So :math:`\hat{\mathbf{K}} = \bar{\boldsymbol{\Phi}} \bar{\boldsymbol{\Phi}}^\top` has rank at
    most :math:`2R` and is returned as a
    :class:`~linear_operator.operators.LowRankRootLinearOperator` (when :math:`2R < n` or :math:`n`
    exceeds ``gpytorch.settings.max_cholesky_size``): with the
    Gaussian noise added, GPyTorch's exact marginal log likelihood and predictions cost
    :math:`O(n R^2)` through the Woodbury identity. The lengthscale and outputscale live in
    ``random_features``; the prior variance is :math:`\lVert\bar{\boldsymbol{\phi}}(\mathbf{x})
    \rVert^2 \le s`.

    :param feature_extractor: the particles :math:`g_{\mathbf{w}_1}, \dots, g_{\mathbf{w}_m}`.
    :param random_features: the feature map :math:`\mathbf{f}` on the latent space; its
        ``num_dims`` must equal the output width of the feature extractor.
    """

    def __init__(
        self, feature_extractor: ParticleEnsemble, random_features: RandomFeatureKernel, **kwargs
    ) -> None:
        if not isinstance(feature_extractor, ParticleEnsemble):
            raise TypeError(
                "feature_extractor must be a ParticleEnsemble, got "
                f"{type(feature_extractor).__name__}"
            )
        if not isinstance(random_features, RandomFeatureKernel):
            raise TypeError(
                "random_features must be a RandomFeatureKernel, got "
                f"{type(random_features).__name__}"
            )
        super().__init__(**kwargs)
        self.feature_extractor = feature_extractor
        self.random_features = random_features

    @property
    def latent_dim(self) -> int:
        return self.random_features.num_dims

    def latent_embeddings(self, x: Tensor) -> Tensor:
        """The particles' embeddings of ``x``: shape ``(m, *batch, n, latent_dim)``; a
        ``ValueError`` naming the feature extractor if they hold NaN or inf."""
        z = self.feature_extractor(x)
        if z.shape[-1] != self.latent_dim:
            raise ValueError(
                f"the feature extractor maps to {z.shape[-1]} dimensions but the latent dimension "
                f"(random_features.num_dims) is {self.latent_dim}"
            )
        return check_embeddings(z)

    def mean_features(self, x: Tensor) -> Tensor:
        r""":math:`\bar{\boldsymbol{\Phi}}(\mathbf{X})`: shape ``(*batch, n, 2R)``."""
        return self.random_features.featurize(self.latent_embeddings(x)).mean(0)

    def features(self, x: Tensor) -> Tensor:
        r"""What the kernel needs of ``x`` from one pass of the feature extractor: the mean
        features :math:`\bar{\boldsymbol{\Phi}}(\mathbf{X})` of shape ``(*batch, n, 2R)``
        (rows may be sliced, and passed to :meth:`feature_covariance`)."""
        return self.mean_features(x)

    @staticmethod
    def feature_covariance(phi1: Tensor, phi2: Tensor | None = None, diag: bool = False):
        r""":math:`\bar{\boldsymbol{\Phi}}_1 \bar{\boldsymbol{\Phi}}_2^\top` (a low-rank operator,
        or its diagonal) from two outputs of :meth:`features`; ``phi2=None`` means ``phi1``."""
        return RandomFeatureKernel.features_to_operator(phi1, phi2, diag)

    def prediction_strategy(self, train_inputs, train_prior_dist, train_labels, likelihood):
        return LinearPredictionStrategy(train_inputs, train_prior_dist, train_labels, likelihood)
