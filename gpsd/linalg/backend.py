"""Which linear-algebra backend to use for a spectral-filter problem."""

from __future__ import annotations

import torch

__all__ = ["BACKENDS", "choose_backend"]

#: The backends of :class:`~gpsd.distillation.DataCentricGPR` and
#: :class:`~gpsd.distillation.DistributionCentricGPR`.
BACKENDS = ("auto", "dense", "cholesky", "lanczos", "cg")

# Measured cost of one float64 ``eigh`` in units of one Cholesky factorisation of the same N
# (benchmarks/results/regression.md: about 13 on the 2-core CPU of this project at N = 2000).
# On CUDA, eigh is comparatively slower still (see the design notes); 30 is conservative.
_EIGH_OVER_CHOLESKY = {"cpu": 12.0, "cuda": 30.0}
# Largest N for which a dense N x N eigendecomposition is attempted automatically.
_DENSE_MAX_N = {"cpu": 12_000, "cuda": 30_000}


def choose_backend(n: int, num_factorisations: int, device: torch.device | str) -> str:
    """Pick ``"cholesky"``, ``"dense"`` or ``"lanczos"`` for an ``n``-point problem.

    ``num_factorisations`` is the number of distinct shifted Cholesky factorisations the chain
    would need (steps times schedules). The chain wins while it is cheaper than one
    eigendecomposition; beyond the size where an ``n x n`` eigendecomposition is practical, the
    matrix-free Lanczos backend is used (the regressors switch to deflated CG, ``"cg"``, when
    Lanczos does not reach their accuracy).
    """
    kind = torch.device(device).type
    kind = kind if kind in _EIGH_OVER_CHOLESKY else "cpu"
    if num_factorisations <= _EIGH_OVER_CHOLESKY[kind] and n <= 2 * _DENSE_MAX_N[kind]:
        return "cholesky"
    if n <= _DENSE_MAX_N[kind]:
        return "dense"
    return "lanczos"
