"""Dense references for the DPKL models, written from the formulas (tests only): the particles
evaluated one at a time as stand-alone networks, the kernel matrices and posterior variances
formed and solved densely."""

import torch
from torch import nn
from torch.func import functional_call

from gpsd.dpkl import DPKLRegressor


def paper_dpkl(*args, **kwargs):
    """A :class:`~gpsd.DPKLRegressor` with the paper's kernel alone (``input_kernel=None``), the
    model the dense references of the particles' kernel are written for."""
    kwargs.setdefault("input_kernel", None)
    return DPKLRegressor(*args, **kwargs)


def tanh_net(d_in=4, d_out=2):
    """A particle network: d_in -> 8 -> d_out with a tanh between."""
    return nn.Sequential(nn.Linear(d_in, 8), nn.Tanh(), nn.Linear(8, d_out))


def noisy_sine_data(n=30, d=4):
    """n standard normal inputs in d dimensions and sin(x_0) plus noise of sd 0.1, in float64
    (set as the default dtype, which the autouse fixture of conftest.py restores)."""
    torch.set_default_dtype(torch.float64)
    x = torch.randn(n, d)
    y = torch.sin(x[:, 0]) + 0.1 * torch.randn(n)
    return x, y


def sum_sine_data(n=24, d=3):
    """n standard normal inputs in d dimensions and the noiseless sin(x_1 + ... + x_d), in
    float64 (set as the default dtype)."""
    torch.set_default_dtype(torch.float64)
    x = torch.randn(n, d)
    return x, torch.sin(x.sum(-1))


def _embedding_kernel(model):
    """The kernel between the latent distributions: the model's kernel, or its embedding part
    where an input kernel is added."""
    return getattr(model.covar_module, "embedding_kernel", model.covar_module)


def loop_mean_features(model, x):
    """phi-bar of a random-feature DPKL model, by an explicit loop over the particles."""
    ens = model.covar_module.feature_extractor
    rf = _embedding_kernel(model).random_features
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
        rf = _embedding_kernel(model).random_features
        proj = (z / rf.lengthscale) @ rf.base_frequencies.mT  # shape: (m, N, R)
        f = torch.cat([proj.cos(), proj.sin()], -1) * (rf.outputscale / rf.num_features).sqrt()
        phi = f.mean(0)
        return phi @ phi.mT
    scaled = _embedding_kernel(model).base_kernel
    s, ell = scaled.outputscale, scaled.base_kernel.lengthscale
    flat = z.reshape(m * num_rows, -1)
    k = s * torch.exp(-torch.cdist(flat, flat).pow(2) / (2 * ell**2))
    return k.reshape(m, num_rows, m, num_rows).mean((0, 2))


def dense_variance(k, n, noise):
    """diag(K_qq) - diag(K_qt (K_tt + noise I)^-1 K_tq) for the first n rows as training rows."""
    k_tt = k[:n, :n] + noise * torch.eye(n, dtype=k.dtype)
    k_qt = k[n:, :n]
    return k[n:, n:].diagonal() - (k_qt * torch.linalg.solve(k_tt, k_qt.mT).mT).sum(-1)
