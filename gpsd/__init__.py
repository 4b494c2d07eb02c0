"""gpsd: distilling Gaussian processes with PyTorch and GPyTorch.

Self-distillation of GP regression and classification (Borup & Andersen), kernel distillation into
a sparse low-rank student (Song & Sun) and deep kernels on probabilistic embeddings (DPKL, Mallick
et al.), as ordinary GPyTorch modules that run on CPU and CUDA.
"""

from gpsd import data, distillation, kernels, linalg, means

__version__ = "0.1.0.dev0"

__all__ = ["data", "distillation", "kernels", "linalg", "means"]

# --- self-distillation for regression (issue 2) ---
from gpsd.distillation import DataCentricGPR, DistributionCentricGPR  # noqa: E402
from gpsd.kernels import PosteriorKernel  # noqa: E402
from gpsd.means import PosteriorMean  # noqa: E402

__all__ += ["DataCentricGPR", "DistributionCentricGPR", "PosteriorKernel", "PosteriorMean"]
# --- classification: likelihood, Laplace, GPC distillation (issue 3) ---  (import here, silencing E402, and extend: __all__ += [...])
from gpsd import laplace, likelihoods  # noqa: E402
from gpsd.distillation import DataCentricGPC, DistributionCentricGPC  # noqa: E402
from gpsd.laplace import LaplaceGPClassifier  # noqa: E402
from gpsd.likelihoods import ContinuousBernoulliLikelihood  # noqa: E402

__all__ += [
    "ContinuousBernoulliLikelihood",
    "DataCentricGPC",
    "DistributionCentricGPC",
    "LaplaceGPClassifier",
    "laplace",
    "likelihoods",
]
# --- kernel distillation (issue 4) ---  (import here, silencing E402, and extend: __all__ += [...])
from gpsd import kernel_distillation  # noqa: E402
from gpsd.kernel_distillation import KernelDistillation, SparseLowRankStudent  # noqa: E402

__all__ += ["KernelDistillation", "SparseLowRankStudent", "kernel_distillation"]
# --- DPKL (issue 5) ---  (import here, silencing E402, and extend: __all__ += [...])
from gpsd import dpkl  # noqa: E402
from gpsd.dpkl import (  # noqa: E402
    ARDGPRegressor,
    DKLRegressor,
    DPKLClassifier,
    DPKLRegressor,
    SSDPKLRegressor,
)

__all__ += [
    "ARDGPRegressor",
    "DKLRegressor",
    "DPKLClassifier",
    "DPKLRegressor",
    "SSDPKLRegressor",
    "dpkl",
]
