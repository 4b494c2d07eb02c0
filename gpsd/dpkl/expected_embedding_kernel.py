"""The exact expected kernel between latent distributions (eq. 2), O(n^2 m^2)."""

from __future__ import annotations

from gpytorch.kernels import Kernel
from torch import Tensor

from gpsd.dpkl._feature_kernel import FeatureKernel, check_embeddings
from gpsd.dpkl.particle_ensemble import ParticleEnsemble

__all__ = ["ExpectedEmbeddingKernel"]


class ExpectedEmbeddingKernel(FeatureKernel):
    r"""Exact expected kernel over all particle pairs (eq. 2 of Mallick et al.):

    .. math::

        K(\mathbf{x}, \mathbf{x}') = \frac{1}{m^2} \sum_{a, b = 1}^m
            k\big(g_{\mathbf{w}_a}(\mathbf{x}), g_{\mathbf{w}_b}(\mathbf{x}')\big).

    It costs :math:`O(n^2 m^2)` time and memory and returns a dense matrix: use it for validation
    of :class:`~gpsd.dpkl.ProbabilisticEmbeddingKernel` and for small :math:`n`. With :math:`m = 1`
    it is the deep kernel of DKL (Wilson et al., 2016), :math:`k(g_{\mathbf{w}}(\mathbf{x}),
    g_{\mathbf{w}}(\mathbf{x}'))`.

    :param feature_extractor: the particles.
    :param base_kernel: a GPyTorch kernel :math:`k` on the latent space (e.g.
        ``ScaleKernel(RBFKernel())``) that broadcasts over batch dimensions.
    :param latent_dim: the expected output width of the feature extractor (checked), or ``None``.
    """

    def __init__(
        self,
        feature_extractor: ParticleEnsemble,
        base_kernel: Kernel,
        latent_dim: int | None = None,
        **kwargs,
    ) -> None:
        if not isinstance(feature_extractor, ParticleEnsemble):
            raise TypeError(
                "feature_extractor must be a ParticleEnsemble, got "
                f"{type(feature_extractor).__name__}"
            )
        if not isinstance(base_kernel, Kernel):
            raise TypeError(
                f"base_kernel must be a gpytorch Kernel, got {type(base_kernel).__name__}"
            )
        super().__init__(**kwargs)
        self.feature_extractor = feature_extractor
        self.base_kernel = base_kernel
        self.latent_dim = latent_dim

    def latent_embeddings(self, x: Tensor) -> Tensor:
        """The particles' embeddings of ``x``: shape ``(m, *batch, n, d)``; a ``ValueError``
        naming the feature extractor if they hold NaN or inf."""
        z = self.feature_extractor(x)
        if self.latent_dim is not None and z.shape[-1] != self.latent_dim:
            raise ValueError(
                f"the feature extractor maps to {z.shape[-1]} dimensions but latent_dim is "
                f"{self.latent_dim}"
            )
        return check_embeddings(z)

    def features(self, x: Tensor) -> Tensor:
        """What the kernel needs of ``x`` from one pass of the feature extractor: the embeddings
        of shape ``(m, *batch, n, d)`` (rows may be sliced, and passed to
        :meth:`feature_covariance`)."""
        return self.latent_embeddings(x)

    def feature_covariance(
        self, z1: Tensor, z2: Tensor | None = None, diag: bool = False
    ) -> Tensor:
        """The dense kernel matrix ``(*batch, n1, n2)`` (or its diagonal ``(*batch, n1)``) between
        two outputs of :meth:`features`; ``z2=None`` means ``z1``."""
        z2 = z1 if z2 is None else z2
        m = z1.shape[0]
        a = z1.unsqueeze(1).expand(m, m, *z1.shape[1:])  # shape: (m, m, *batch, n1, d)
        b = z2.unsqueeze(0).expand(m, m, *z2.shape[1:])  # shape: (m, m, *batch, n2, d)
        k = self.base_kernel(a, b, diag=diag)
        k = k if isinstance(k, Tensor) else k.to_dense()
        return k.mean(dim=(0, 1))
