"""Which linear-algebra backend to use for a spectral-filter problem."""

from __future__ import annotations

import gc
import math
import os

import torch

from gpsd._internal.validation import check_int

__all__ = ["BACKENDS", "choose_backend", "free_memory_bytes"]

#: The backends of :class:`~gpsd.distillation.DataCentricGPR` and
#: :class:`~gpsd.distillation.DistributionCentricGPR`.
BACKENDS = ("auto", "dense", "cholesky", "lanczos", "cg")

# Most Cholesky factorisations for which the chain is chosen over the dense eigendecomposition.
# CPU: measured end to end (fit, then every step's means and variances at 1000 test points) in
# benchmarks/results/backend_choice_cpu.md: at T = 3 the chain is even with the dense path at
# N = 1024 and 1.6 to 2 times as fast at N = 2048 and 4096; from T = 5 on the dense path, or
# auto's Lanczos attempt inside it, is as fast or faster. The bare float64 eigh costs 4 to 11
# Cholesky factorisations there, but each step of the chain also solves with the test points.
# CUDA (an H200, float64 factorisations, 10,000 test points; backend_choice_cuda.md): the chain
# is fastest at T = 1 (N = 4096 to 16,384) and at T = 3 up to N = 8192 (0.12 s against Lanczos'
# 0.13 s there, 0.39 against 0.20 s at 16,384); from T = 10 on Lanczos is 1.4 to 33 times
# faster than the chain.
_MAX_CHAIN_FACTORISATIONS = {"cpu": 3, "cuda": 3}
# Largest N for which a dense N x N eigendecomposition is attempted automatically (the chain is
# considered up to twice that). CUDA: float64 eigh is slow on GPUs (0.56 s at N = 8192 and 3.2 s
# at 16,384 on the H200 against 0.15 and 0.20 s for Lanczos with 100 steps); it is the fastest
# only at N = 4096 with T >= 30, by 1 % to 34 %.
_DENSE_MAX_N = {"cpu": 12_000, "cuda": 4096}
# Peak memory of the dense eigendecomposition in N x N matrices of the factorisation dtype: the
# kernel matrix, its eigenvectors and about two more for the solver's workspace.
_EIGH_MATRICES = 4
# Fraction of the free memory that an automatically chosen dense backend may plan to fill.
_MEMORY_FRACTION = 0.8


def free_memory_bytes(device: torch.device | str, wanted: int | None = None) -> int:
    """Memory that new tensors on ``device`` can take, in bytes.

    On CUDA: the driver's free memory plus what PyTorch's caching allocator holds but does not
    use. On the CPU: the host's available memory (``MemAvailable``), or less where the process's
    control group (a container's memory limit) leaves less: its limit less its usage, reclaimable
    file cache not counted as used.

    Where ``wanted`` bytes are not free, the cycle collector runs first and the memory is measured
    again: a model that is no longer referenced holds its memory until it runs (every GPyTorch
    module sits in a reference cycle, through its ``load_state_dict`` hook). On an H200 at
    N = 100,000 a second model kept half the kernel rows of the first that way, and both together
    peaked at 114 GiB. Without ``wanted`` (or with enough free) nothing is collected.
    """
    free = _measured_free_bytes(device)
    if wanted is not None and free < wanted:
        gc.collect()
        free = _measured_free_bytes(device)
    return free


def _measured_free_bytes(device: torch.device | str) -> int:
    """:func:`free_memory_bytes` as the device reports it now."""
    device = torch.device(device)
    if device.type == "cuda":
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return torch.cuda.mem_get_info(device)[0] + cached
    host = _host_available_bytes()
    headroom = _cgroup_headroom_bytes()
    return host if headroom is None else min(host, headroom)


def _host_available_bytes() -> int:
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


def _cgroup_headroom_bytes(root: str = "/sys/fs/cgroup") -> int | None:
    """What the memory limit of this process's control group leaves, in bytes; ``None`` where
    there is no limit (or no cgroup file system under ``root``).

    cgroup v2 (``memory.max``, ``memory.current``) or v1 (``memory/memory.limit_in_bytes``,
    ``memory/memory.usage_in_bytes``); the inactive file cache of ``memory.stat``, which the
    kernel reclaims before it kills, is not counted as used.
    """
    for limit_file, usage_file, stat_file, cache_key in (
        ("memory.max", "memory.current", "memory.stat", "inactive_file"),
        (
            "memory/memory.limit_in_bytes",
            "memory/memory.usage_in_bytes",
            "memory/memory.stat",
            "total_inactive_file",
        ),
    ):
        limit = _read_int(os.path.join(root, limit_file))
        usage = _read_int(os.path.join(root, usage_file))
        if limit is None or usage is None:
            continue
        if limit >= 2**60:  # v1 writes "no limit" as a page-rounded 2**63 - 1
            return None
        cache = _stat_value(os.path.join(root, stat_file), cache_key) or 0
        return max(0, limit - max(0, usage - cache))
    return None


def _read_int(path: str) -> int | None:
    """The integer in a one-line file; ``None`` if missing, unreadable or ``max``."""
    try:
        with open(path) as fh:
            return int(fh.read().strip())
    except (OSError, ValueError):
        return None


def _stat_value(path: str, key: str) -> int | None:
    try:
        with open(path) as fh:
            for line in fh:
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
    except (OSError, ValueError):
        pass
    return None


def choose_backend(
    n: int,
    num_factorisations: int,
    device: torch.device | str,
    dtype: torch.dtype = torch.float64,
    batch_size: int = 1,
    num_schedules: int = 1,
    free_bytes: int | None = None,
    factor_batch_size: int | None = None,
) -> str:
    r"""Pick ``"cholesky"``, ``"dense"`` or ``"lanczos"`` for an ``n``-point problem.

    ``num_factorisations`` is the number of distinct shifted Cholesky factorisations the chain
    would need (steps times schedules). The chain is chosen while it is measured to be cheaper
    than one eigendecomposition (up to 3 factorisations, on the CPU and on CUDA); beyond the
    size where an ``n x n`` eigendecomposition is practical, the matrix-free Lanczos backend is
    used (the regressors switch to deflated CG, ``"cg"``, when Lanczos does not reach their
    accuracy).

    Memory decides too (``free_bytes``, default: :func:`free_memory_bytes` of ``device``). Let
    :math:`s` be the size of the kernel matrices (``batch_size`` of them, ``n x n`` in ``dtype``)
    and :math:`f` that of one Cholesky factor, which covers every schedule:
    ``factor_batch_size`` matrices. The eigendecomposition is chosen only if :math:`4s`
    (matrix, eigenvectors, workspace) fits in 80 % of the free memory. The chain is chosen only if
    all its :math:`T` factors fit in the cache of :class:`~gpsd.linalg.ShiftedCholesky`, half the
    memory left beside the matrix and one more factor:
    :math:`T f \le (\text{free} - s - f)/2`; otherwise the variances would factor every shift
    again (for every chunk of test points), and the chain would lose its edge.

    :param n: number of training points :math:`N`.
    :param num_factorisations: Cholesky factorisations the chain needs.
    :param device: where the factorisation runs.
    :param dtype: dtype of the factorisation.
    :param batch_size: number of independent ``n x n`` kernel matrices.
    :param num_schedules: number of noise schedules (each Cholesky factor covers all of them).
    :param free_bytes: memory available; measured on ``device`` when not given.
    :param factor_batch_size: ``n x n`` matrices in one factor: the broadcast of the schedules'
        batch shape with the kernel matrices' (default ``max(batch_size, num_schedules)``, right
        where the two batches pair; a schedule batch ``(3, 1)`` against a kernel batch ``(2,)``
        makes 6).
    """
    n = check_int(n, "n")
    num_factorisations = check_int(num_factorisations, "num_factorisations")
    batch_size = check_int(batch_size, "batch_size")
    num_schedules = check_int(num_schedules, "num_schedules")
    if factor_batch_size is None:
        factor_batch_size = max(batch_size, num_schedules)
    factor_batch_size = check_int(factor_batch_size, "factor_batch_size")
    kind = torch.device(device).type
    kind = kind if kind in _MAX_CHAIN_FACTORISATIONS else "cpu"
    one_matrix = n * n * (torch.finfo(dtype).bits // 8)
    matrix_bytes = batch_size * one_matrix
    factor_bytes = factor_batch_size * one_matrix
    num_factors = math.ceil(num_factorisations / num_schedules)
    # T f <= (free - s - f) / 2, and 4 s <= 80 % of free (the docstring's rules)
    chain_needs = 2 * num_factors * factor_bytes + matrix_bytes + factor_bytes
    eigh_needs = math.ceil(_EIGH_MATRICES * matrix_bytes / _MEMORY_FRACTION)
    chain_by_size = (
        num_factorisations <= _MAX_CHAIN_FACTORISATIONS[kind] and n <= 2 * _DENSE_MAX_N[kind]
    )
    eigh_by_size = n <= _DENSE_MAX_N[kind]
    if free_bytes is None:
        # what the candidates that N and T allow need: collect garbage where it is not free
        needs = [chain_needs] * chain_by_size + [eigh_needs] * eigh_by_size
        free_bytes = free_memory_bytes(device, wanted=max(needs, default=None))
    if chain_by_size and chain_needs <= free_bytes:
        return "cholesky"
    if eigh_by_size and _EIGH_MATRICES * matrix_bytes <= _MEMORY_FRACTION * free_bytes:
        return "dense"
    return "lanczos"
