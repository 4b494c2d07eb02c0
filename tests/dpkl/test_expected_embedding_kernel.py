"""Tests of ExpectedEmbeddingKernel."""

import gpytorch
import torch
from dpkl_reference import tanh_net

from gpsd.dpkl import (
    ExpectedEmbeddingKernel,
    ParticleEnsemble,
    ProbabilisticEmbeddingKernel,
    RandomFeatureKernel,
)


def test_expected_kernel_equals_quadruple_loop_and_rff_converges_to_it():
    torch.set_default_dtype(torch.float64)
    ens = ParticleEnsemble(lambda: tanh_net(3, 2), 3)
    base = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())
    base.base_kernel.lengthscale = 0.9
    base.outputscale = 1.3
    ek = ExpectedEmbeddingKernel(ens, base, latent_dim=2)
    x1, x2 = torch.randn(5, 3), torch.randn(4, 3)
    got = ek(x1, x2).to_dense().detach()
    mods = [ens.particle_module(i) for i in range(3)]
    ref = torch.zeros(5, 4)
    for i in range(5):
        for j in range(4):
            for a in range(3):
                for b in range(3):
                    za, zb = mods[a](x1[i]), mods[b](x2[j])
                    ref[i, j] += 1.3 * torch.exp(-((za - zb) ** 2).sum() / (2 * 0.81)).detach() / 9
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(
        ek(x1, diag=True).detach(), torch.diagonal(ek(x1).to_dense().detach())
    )
    # the random-feature embedding kernel approaches it as R grows
    errs = []
    for R in (100, 10000):
        torch.manual_seed(1)
        rf = RandomFeatureKernel(R, 2)
        rf.lengthscale = 0.9
        rf.outputscale = 1.3
        pk = ProbabilisticEmbeddingKernel(ens, rf)
        errs.append(float((pk(x1, x2).to_dense().detach() - got).abs().max()))
    assert errs[1] < 0.05 and errs[1] < errs[0]
