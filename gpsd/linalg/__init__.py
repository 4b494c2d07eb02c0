"""Spectral filters of kernel operators: eigendecomposition, Cholesky chains, block Lanczos, deflated CG."""

from gpsd.linalg.backend import BACKENDS, choose_backend, make_engine
from gpsd.linalg.chunked_kernel_operator import ChunkedKernelOperator
from gpsd.linalg.distributed_kernel_operator import DistributedKernelOperator
from gpsd.linalg.engine_request import EngineRequest
from gpsd.linalg.kernel_spectrum import KernelSpectrum, SpectralCoordinates
from gpsd.linalg.memory import free_memory_bytes
from gpsd.linalg.shifted_cg import ShiftedCG
from gpsd.linalg.shifted_cholesky import ShiftedCholesky
from gpsd.linalg.spectral_engine import SpectralEngine
from gpsd.linalg.spectral_filter import SpectralFilter

__all__ = [
    "BACKENDS",
    "ChunkedKernelOperator",
    "DistributedKernelOperator",
    "EngineRequest",
    "KernelSpectrum",
    "ShiftedCG",
    "ShiftedCholesky",
    "SpectralCoordinates",
    "SpectralEngine",
    "SpectralFilter",
    "choose_backend",
    "free_memory_bytes",
    "make_engine",
]
