"""The ``forward`` shared by the DPKL kernels: a kernel computed from per-row features."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from gpytorch.kernels import Kernel
from torch import Tensor

from gpsd._internal.distances import same_inputs
from gpsd.exceptions import NonFiniteEmbeddingsError


def check_embeddings(z: Tensor) -> Tensor:
    """Raise a :class:`~gpsd.NonFiniteEmbeddingsError` naming the feature extractor if the embeddings
    ``z`` (``(m, *batch, n, d)``: one row per particle and input) hold NaN or inf; else ``z``."""
    finite = torch.isfinite(z).all(-1)  # shape: (m, *batch, n)
    if not bool(finite.all()):
        rows = int((~finite).reshape(-1, finite.shape[-1]).any(0).sum())
        raise NonFiniteEmbeddingsError(
            f"the feature_extractor produced NaN or inf embeddings for {rows} of "
            f"{finite.shape[-1]} input rows; check the network (its outputs on these inputs, "
            "and its parameters)"
        )
    return z


class FeatureKernel(Kernel, ABC):
    """A kernel :math:`k(\\mathbf x_1, \\mathbf x_2)` computed from :meth:`features` of each
    input set by :meth:`feature_covariance`, so that one pass of the feature extractor over
    several sets can be sliced by rows and give every block of one kernel matrix."""

    @abstractmethod
    def features(self, x: Tensor) -> Tensor:
        """Per-row features of the inputs ``x`` (``(*batch, n, d)``), of shape
        ``(*batch, n, ...)``: row ``i`` depends on ``x[..., i, :]`` alone."""

    @abstractmethod
    def feature_covariance(self, f1: Tensor, f2: Tensor | None = None, diag: bool = False):
        """The kernel matrix (or its diagonal, ``diag=True``) between the rows of ``f1`` and
        ``f2`` (``None``: ``f1`` with itself)."""

    def forward(
        self, x1: Tensor, x2: Tensor, diag: bool = False, last_dim_is_batch: bool = False, **params
    ):
        if last_dim_is_batch:
            raise ValueError("last_dim_is_batch is not supported")
        f2 = None if same_inputs(x1, x2) else self.features(x2)
        return self.feature_covariance(self.features(x1), f2, diag)
