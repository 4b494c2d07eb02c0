"""The sum of a kernel on the raw inputs and a DPKL embedding kernel."""

from __future__ import annotations

import torch
from gpytorch.kernels import Kernel
from linear_operator import to_dense
from torch import Tensor

from gpsd.dpkl._feature_kernel import FeatureKernel

__all__ = ["InputPlusEmbeddingKernel"]


class InputPlusEmbeddingKernel(FeatureKernel):
    r"""A kernel on the raw inputs plus a kernel between latent distributions:

    .. math::

        K(\mathbf{x}, \mathbf{x}') = k_{\text{in}}(\mathbf{x}, \mathbf{x}')
            + \hat{K}_{\text{emb}}(\mathbf{x}, \mathbf{x}'),

    with :math:`k_{\text{in}}` a GPyTorch kernel on the inputs (an ARD RBF kernel in
    :class:`~gpsd.DPKLRegressor`) and :math:`\hat{K}_{\text{emb}}` a
    :class:`~gpsd.dpkl.ProbabilisticEmbeddingKernel` or :class:`~gpsd.dpkl.ExpectedEmbeddingKernel`.
    With the embedding kernel's outputscale at zero it is :math:`k_{\text{in}}`: the network only
    has to model what the input kernel misses.

    The matrix is dense, :math:`O(n^2)` memory (the sum of a low-rank and a full-rank matrix
    has no cheaper exact solve); that suits the small data sets DPKL is for.

    ``features(x)`` is the inputs followed by the embedding kernel's features, flattened per row
    (``(*batch, n, D + F)``), so that rows may be sliced as for every DPKL kernel.

    :param input_kernel: the kernel :math:`k_{\text{in}}` on the ``(n, D)`` inputs.
    :param embedding_kernel: the kernel between the latent distributions (it holds the
        particle ensemble).
    """

    def __init__(self, input_kernel: Kernel, embedding_kernel: FeatureKernel, **kwargs) -> None:
        if not isinstance(input_kernel, Kernel):
            raise TypeError(
                f"input_kernel must be a gpytorch Kernel, got {type(input_kernel).__name__}"
            )
        if not isinstance(embedding_kernel, FeatureKernel) or not hasattr(
            embedding_kernel, "latent_embeddings"
        ):
            raise TypeError(
                "embedding_kernel must be a ProbabilisticEmbeddingKernel or an "
                f"ExpectedEmbeddingKernel, got {type(embedding_kernel).__name__}"
            )
        super().__init__(**kwargs)
        self.input_kernel = input_kernel
        self.embedding_kernel = embedding_kernel

    @property
    def feature_extractor(self):
        """The particle ensemble of the embedding kernel."""
        return self.embedding_kernel.feature_extractor

    def latent_embeddings(self, x: Tensor) -> Tensor:
        """The particles' embeddings of ``x``: shape ``(m, *batch, n, d)``."""
        return self.embedding_kernel.latent_embeddings(x)

    def features(self, x: Tensor) -> Tensor:
        """``x`` followed by the embedding kernel's features of ``x`` (flattened per row):
        shape ``(*batch, n, D + F)``."""
        emb = self.embedding_kernel.features(x)
        if emb.dim() > x.dim():  # the exact kernel's embeddings: (m, *batch, n, d)
            emb = emb.movedim(0, -2).flatten(-2)  # shape: (*batch, n, m * d)
        return torch.cat([x, emb], -1)

    def _split(self, f: Tensor, num_inputs: int) -> tuple[Tensor, Tensor]:
        x, emb = f[..., :num_inputs], f[..., num_inputs:]
        if not hasattr(self.embedding_kernel, "random_features"):  # exact kernel: back to (m, ...)
            m = self.feature_extractor.num_particles
            emb = emb.unflatten(-1, (m, -1)).movedim(-2, 0)
        return x, emb

    def feature_covariance(self, f1: Tensor, f2: Tensor | None = None, diag: bool = False):
        r""":math:`K` (dense, ``(*batch, n1, n2)``) or its diagonal (``diag=True``) between two
        outputs of :meth:`features`; ``f2=None`` means ``f1``."""
        num_inputs = f1.shape[-1] - self._emb_width(f1)
        x1, e1 = self._split(f1, num_inputs)
        x2, e2 = (x1, None) if f2 is None else self._split(f2, num_inputs)
        k_in = to_dense(self.input_kernel(x1, x2, diag=diag))
        k_emb = to_dense(self.embedding_kernel.feature_covariance(e1, e2, diag=diag))
        return k_in + k_emb

    def _emb_width(self, f: Tensor) -> int:
        random_features = getattr(self.embedding_kernel, "random_features", None)
        if random_features is not None:
            return 2 * random_features.num_features
        latent_dim = self.embedding_kernel.latent_dim
        return self.feature_extractor.num_particles * latent_dim
