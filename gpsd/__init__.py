"""gpsd: distilling Gaussian processes with PyTorch and GPyTorch.

Self-distillation of GP regression and classification (Borup & Andersen), kernel distillation into
a sparse low-rank student (Song & Sun) and deep kernels on probabilistic embeddings (DPKL, Mallick
et al.), as ordinary GPyTorch modules that run on CPU and CUDA.
"""

from gpsd import data

__version__ = "0.1.0.dev0"

__all__ = ["data"]

# --- self-distillation for regression (issue 2) ---
# --- classification: likelihood, Laplace, GPC distillation (issue 3) ---
# --- kernel distillation (issue 4) ---
# --- DPKL (issue 5) ---
