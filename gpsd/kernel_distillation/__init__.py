"""Kernel distillation (Song & Sun): a trained exact GP compressed into a sparse low-rank model."""

from gpsd.kernel_distillation.kernel_distillation import KernelDistillation
from gpsd.kernel_distillation.kmeans import kmeans, kmeans_plus_plus
from gpsd.kernel_distillation.nearest_inducing import nearest_inducing_points
from gpsd.kernel_distillation.sparse_low_rank_student import SparseLowRankStudent

__all__ = [
    "KernelDistillation",
    "SparseLowRankStudent",
    "kmeans",
    "kmeans_plus_plus",
    "nearest_inducing_points",
]
