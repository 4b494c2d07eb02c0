"""Which linear-algebra backend to use for a spectral-filter problem."""

from __future__ import annotations

import os

import torch

__all__ = ["BACKENDS", "choose_backend", "free_memory_bytes"]

#: The backends of :class:`~gpsd.distillation.DataCentricGPR` and
#: :class:`~gpsd.distillation.DistributionCentricGPR`.
BACKENDS = ("auto", "dense", "cholesky", "lanczos", "cg")

# Measured cost of one float64 ``eigh`` in units of one Cholesky factorisation of the same N
# (benchmarks/results/regression.md: about 13 on the 2-core CPU of this project at N = 2000).
# On CUDA, eigh is comparatively slower still (see the design notes); 30 is conservative.
_EIGH_OVER_CHOLESKY = {"cpu": 12.0, "cuda": 30.0}
# Largest N for which a dense N x N eigendecomposition is attempted automatically.
_DENSE_MAX_N = {"cpu": 12_000, "cuda": 30_000}
# Peak memory of the dense eigendecomposition in N x N matrices of the factorisation dtype: the
# kernel matrix, its eigenvectors and about two more for the solver's workspace.
_EIGH_MATRICES = 4
# Fraction of the free memory that an automatically chosen dense backend may plan to fill.
_MEMORY_FRACTION = 0.8


def free_memory_bytes(device: torch.device | str) -> int:
    """Memory that new tensors on ``device`` can take, in bytes.

    On CUDA: the driver's free memory plus what PyTorch's caching allocator holds but does not
    use. On the CPU: the host's available memory (``MemAvailable``).
    """
    device = torch.device(device)
    if device.type == "cuda":
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return torch.cuda.mem_get_info(device)[0] + cached
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 2**32  # 4 GiB where the platform does not say


def choose_backend(
    n: int,
    num_factorisations: int,
    device: torch.device | str,
    dtype: torch.dtype = torch.float64,
    batch_size: int = 1,
    num_schedules: int = 1,
    free_bytes: int | None = None,
) -> str:
    r"""Pick ``"cholesky"``, ``"dense"`` or ``"lanczos"`` for an ``n``-point problem.

    ``num_factorisations`` is the number of distinct shifted Cholesky factorisations the chain
    would need (steps times schedules). The chain wins while it is cheaper than one
    eigendecomposition; beyond the size where an ``n x n`` eigendecomposition is practical, the
    matrix-free Lanczos backend is used (the regressors switch to deflated CG, ``"cg"``, when
    Lanczos does not reach their accuracy).

    A dense backend is chosen only if its peak memory fits in 80 % of ``free_bytes`` (default:
    :func:`free_memory_bytes` of ``device``). With :math:`s` the size of one ``n x n`` matrix of
    ``dtype`` times ``batch_size``, the eigendecomposition is taken to need :math:`4s` (matrix,
    eigenvectors, workspace) and the Cholesky chain :math:`s + 3ps` with
    :math:`p = \max(1, \texttt{num\_schedules} / \texttt{batch\_size})` (matrix, a cached factor,
    the shifted copy and the new factor, each for every schedule).

    :param n: number of training points :math:`N`.
    :param num_factorisations: Cholesky factorisations the chain needs.
    :param device: where the factorisation runs.
    :param dtype: dtype of the factorisation.
    :param batch_size: number of independent ``n x n`` kernel matrices.
    :param num_schedules: number of noise schedules (each Cholesky factor covers all of them).
    :param free_bytes: memory available; measured on ``device`` when not given.
    """
    kind = torch.device(device).type
    kind = kind if kind in _EIGH_OVER_CHOLESKY else "cpu"
    if free_bytes is None:
        free_bytes = free_memory_bytes(device)
    budget = _MEMORY_FRACTION * free_bytes
    matrix_bytes = batch_size * n * n * (torch.finfo(dtype).bits // 8)
    per_factor = max(1.0, num_schedules / batch_size)
    chain_fits = (1 + 3 * per_factor) * matrix_bytes <= budget
    eigh_fits = _EIGH_MATRICES * matrix_bytes <= budget
    if (
        num_factorisations <= _EIGH_OVER_CHOLESKY[kind]
        and n <= 2 * _DENSE_MAX_N[kind]
        and chain_fits
    ):
        return "cholesky"
    if n <= _DENSE_MAX_N[kind] and eigh_fits:
        return "dense"
    return "lanczos"
