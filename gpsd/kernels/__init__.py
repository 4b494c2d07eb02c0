"""GPyTorch kernels provided by gpsd."""

from gpsd.kernels.posterior_kernel import PosteriorKernel

__all__ = ["PosteriorKernel"]
