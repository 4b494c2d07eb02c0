"""Self-distillation of GP regression and classification (Borup & Andersen)."""

from gpsd.distillation._common import ExactGPFromModules
from gpsd.distillation.combined_gpc import CombinedGPC
from gpsd.distillation.combined_gpr import CombinedGPR
from gpsd.distillation.data_centric_gpc import DataCentricGPC
from gpsd.distillation.data_centric_gpr import DataCentricGPR
from gpsd.distillation.distribution_centric_gpc import DistributionCentricGPC
from gpsd.distillation.distribution_centric_gpr import DistributionCentricGPR

__all__ = [
    "CombinedGPC",
    "CombinedGPR",
    "DataCentricGPC",
    "DataCentricGPR",
    "DistributionCentricGPC",
    "DistributionCentricGPR",
    "ExactGPFromModules",
]
