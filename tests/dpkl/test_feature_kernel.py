"""Tests of the DPKL kernels computed from per-row features (FeatureKernel)."""

import gpytorch
import pytest
import torch
from torch import nn

from gpsd.dpkl import (
    ExpectedEmbeddingKernel,
    ParticleEnsemble,
    ProbabilisticEmbeddingKernel,
    RandomFeatureKernel,
)
from gpsd.dpkl._feature_kernel import FeatureKernel

DT = torch.float64


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).to(DT)


def _kernels():
    torch.manual_seed(0)
    rff = RandomFeatureKernel(20, 3).to(DT)
    ens = ParticleEnsemble(_net, 3).to(DT)
    base = gpytorch.kernels.RBFKernel().to(DT)
    embedded_rff = ProbabilisticEmbeddingKernel(ens, RandomFeatureKernel(20, 2).to(DT)).to(DT)
    return {
        "random features": rff,
        "probabilistic embedding": embedded_rff,
        "expected embedding": ExpectedEmbeddingKernel(ens, base, latent_dim=2).to(DT),
    }


@pytest.mark.parametrize(
    "name", ["random features", "probabilistic embedding", "expected embedding"]
)
def test_equal_but_distinct_inputs_each_get_their_gradient(name):
    # equal values must not take the x1 = x2 shortcut (one evaluation), which would leave
    # x2.grad None and give x1.grad both inputs' gradients
    kernel = _kernels()[name]
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 3, generator=gen, dtype=DT)
    weights = torch.randn(4, 4, generator=gen, dtype=DT)

    def objective(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (kernel(a, b).to_dense() * weights).sum()

    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    objective(x1, x2).backward()
    assert x2.grad is not None
    h = 1e-6
    for grad, which in ((x1.grad, 0), (x2.grad, 1)):
        fd = torch.zeros_like(x)
        for i in range(x.shape[0]):
            for j in range(x.shape[1]):
                step = torch.zeros_like(x)
                step[i, j] = h
                with torch.no_grad():
                    up = (x + step, x) if which == 0 else (x, x + step)
                    down = (x - step, x) if which == 0 else (x, x - step)
                    fd[i, j] = (objective(*up) - objective(*down)) / (2 * h)
        torch.testing.assert_close(grad, fd, rtol=1e-6, atol=1e-8)


def test_feature_kernel_needs_features_and_their_covariance():
    """The shared base is abstract: a subclass without the two methods cannot be built."""

    class Incomplete(FeatureKernel):
        def features(self, x):
            return x

    for cls in (FeatureKernel, Incomplete):
        with pytest.raises(TypeError, match="feature_covariance"):
            cls()
