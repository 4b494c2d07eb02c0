"""GPyTorch means provided by gpsd."""

from gpsd.means.posterior_mean import PosteriorMean

__all__ = ["PosteriorMean"]
