"""GPyTorch kernels provided by gpsd."""

from gpsd.kernels.chunked_kernel import ChunkedKernel
from gpsd.kernels.posterior_kernel import PosteriorKernel

__all__ = ["ChunkedKernel", "PosteriorKernel"]
