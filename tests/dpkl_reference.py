"""Dense references for the DPKL models, written from the formulas (tests only): the particles
evaluated one at a time as stand-alone networks, the kernel matrices and posterior variances
formed and solved densely."""

import torch
from torch.func import functional_call


def loop_mean_features(model, x):
    """phi-bar of a random-feature DPKL model, by an explicit loop over the particles."""
    ens = model.covar_module.feature_extractor
    rf = model.covar_module.random_features
    arch = ens.particle_module(0)
    stacked = ens.stacked_parameters()
    feats = [
        rf.featurize(functional_call(arch, {k: v[i] for k, v in stacked.items()}, (x,)))
        for i in range(ens.num_particles)
    ]
    return torch.stack(feats).mean(0)


def loop_embeddings(model, x, training):
    """``(m, n, d)`` by stand-alone copies of the particles in the given mode."""
    ensemble = model.covar_module.feature_extractor
    with torch.no_grad():
        return torch.stack(
            [ensemble.particle_module(i).train(training)(x) for i in range(ensemble.num_particles)]
        )


def dense_kernel(model, z):
    """The prior kernel matrix of the rows of embeddings ``z`` (``(m, N, d)``), written out."""
    m, num_rows, _ = z.shape
    if model.kernel_type == "rff":
        rf = model.covar_module.random_features
        proj = (z / rf.lengthscale) @ rf.base_frequencies.mT  # shape: (m, N, R)
        f = torch.cat([proj.cos(), proj.sin()], -1) * (rf.outputscale / rf.num_features).sqrt()
        phi = f.mean(0)
        return phi @ phi.mT
    scaled = model.covar_module.base_kernel
    s, ell = scaled.outputscale, scaled.base_kernel.lengthscale
    flat = z.reshape(m * num_rows, -1)
    k = s * torch.exp(-torch.cdist(flat, flat).pow(2) / (2 * ell**2))
    return k.reshape(m, num_rows, m, num_rows).mean((0, 2))


def dense_variance(k, n, noise):
    """diag(K_qq) - diag(K_qt (K_tt + noise I)^-1 K_tq) for the first n rows as training rows."""
    k_tt = k[:n, :n] + noise * torch.eye(n, dtype=k.dtype)
    k_qt = k[n:, :n]
    return k[n:, n:].diagonal() - (k_qt * torch.linalg.solve(k_tt, k_qt.mT).mT).sum(-1)
