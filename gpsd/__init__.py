"""gpsd: distilling Gaussian processes with PyTorch and GPyTorch.

Self-distillation of GP regression and classification (Borup & Andersen), kernel distillation into
a sparse low-rank student (Song & Sun) and deep kernels on probabilistic embeddings (DPKL, Mallick
et al.), as ordinary GPyTorch modules that run on CPU and CUDA. Every estimator follows one
convention (``docs/convention.rst``).
"""

from gpsd import (
    data,
    distillation,
    dpkl,
    exceptions,
    kernel_distillation,
    kernels,
    laplace,
    likelihoods,
    linalg,
    means,
    settings,
)
from gpsd.distillation import (
    CombinedGPC,
    CombinedGPR,
    DataCentricGPC,
    DataCentricGPR,
    DistributionCentricGPC,
    DistributionCentricGPR,
)
from gpsd.dpkl import (
    ARDGPRegressor,
    DKLRegressor,
    DPKLClassifier,
    DPKLRegressor,
    SSDPKLRegressor,
)
from gpsd.exceptions import (
    BackendError,
    DistributedError,
    GpsdError,
    InsufficientMemoryError,
    LaplaceConvergenceError,
    NonFiniteEmbeddingsError,
    NotFittedError,
    TeacherError,
)
from gpsd.kernel_distillation import KernelDistillation, SparseLowRankStudent
from gpsd.kernels import ChunkedKernel, PosteriorKernel
from gpsd.laplace import LaplaceGPClassifier
from gpsd.likelihoods import ContinuousBernoulliLikelihood, ContinuousCategoricalLikelihood
from gpsd.means import PosteriorMean
from gpsd.prediction import Prediction
from gpsd.progress import IterationRecord

__version__ = "0.1.0"

__all__ = [
    "ARDGPRegressor",
    "BackendError",
    "ChunkedKernel",
    "CombinedGPC",
    "CombinedGPR",
    "DistributedError",
    "ContinuousBernoulliLikelihood",
    "ContinuousCategoricalLikelihood",
    "DKLRegressor",
    "DPKLClassifier",
    "DPKLRegressor",
    "DataCentricGPC",
    "DataCentricGPR",
    "DistributionCentricGPC",
    "DistributionCentricGPR",
    "GpsdError",
    "InsufficientMemoryError",
    "IterationRecord",
    "KernelDistillation",
    "LaplaceConvergenceError",
    "LaplaceGPClassifier",
    "NonFiniteEmbeddingsError",
    "NotFittedError",
    "PosteriorKernel",
    "PosteriorMean",
    "Prediction",
    "SSDPKLRegressor",
    "SparseLowRankStudent",
    "TeacherError",
    "data",
    "distillation",
    "dpkl",
    "exceptions",
    "kernel_distillation",
    "kernels",
    "laplace",
    "likelihoods",
    "linalg",
    "means",
    "settings",
]
