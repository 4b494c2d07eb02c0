"""Self-distillation of GP regression and classification (Borup & Andersen)."""

from gpsd.distillation._common import ExactGPFromModules

# --- regression (issue 2) ---
from gpsd.distillation.data_centric_gpr import DataCentricGPR
from gpsd.distillation.distribution_centric_gpr import DistributionCentricGPR

__all__ = ["DataCentricGPR", "DistributionCentricGPR", "ExactGPFromModules"]

# --- classification (issue 3) ---  (import here and extend with: __all__ += [...])
from gpsd.distillation.data_centric_gpc import DataCentricGPC  # noqa: E402
from gpsd.distillation.distribution_centric_gpc import DistributionCentricGPC  # noqa: E402

__all__ += ["DataCentricGPC", "DistributionCentricGPC"]
