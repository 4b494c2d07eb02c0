"""DPKL: deep kernels on probabilistic embeddings trained by functional gradient descent.

Building blocks (each usable alone in a PyTorch loop): :class:`ParticleEnsemble`,
:class:`SteinVariationalGradient`, :class:`RandomFeatureKernel`,
:class:`ProbabilisticEmbeddingKernel`, :class:`ExpectedEmbeddingKernel`,
:class:`InputPlusEmbeddingKernel`. Models:
:class:`DPKLRegressor`, :class:`SSDPKLRegressor`, :class:`DKLRegressor`, :class:`ARDGPRegressor`,
:class:`DPKLClassifier`.
"""

from gpsd.dpkl.ard_gp_regressor import ARDGPRegressor
from gpsd.dpkl.dkl_regressor import DKLRegressor
from gpsd.dpkl.dpkl_classifier import DPKLClassifier
from gpsd.dpkl.dpkl_regressor import DPKLRegressor
from gpsd.dpkl.embedding_kernel import ProbabilisticEmbeddingKernel
from gpsd.dpkl.expected_embedding_kernel import ExpectedEmbeddingKernel
from gpsd.dpkl.input_embedding_kernel import InputPlusEmbeddingKernel
from gpsd.dpkl.particle_ensemble import ParticleEnsemble
from gpsd.dpkl.random_feature_kernel import RandomFeatureKernel, sample_spectral_frequencies
from gpsd.dpkl.ssdpkl_regressor import SSDPKLRegressor
from gpsd.dpkl.svgd import SteinVariationalGradient

__all__ = [
    "ARDGPRegressor",
    "DKLRegressor",
    "DPKLClassifier",
    "DPKLRegressor",
    "ExpectedEmbeddingKernel",
    "InputPlusEmbeddingKernel",
    "ParticleEnsemble",
    "ProbabilisticEmbeddingKernel",
    "RandomFeatureKernel",
    "SSDPKLRegressor",
    "SteinVariationalGradient",
    "sample_spectral_frequencies",
]
