"""How much memory new tensors on a device can take."""

from __future__ import annotations

import gc
import os

import torch

from gpsd import settings

__all__ = ["free_memory_bytes"]


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

    Within :class:`gpsd.settings.memory_limit`, at most its limit for ``device``'s type.
    """
    free = _measured_free_bytes(device)
    if wanted is not None and free < wanted:
        gc.collect()
        free = _measured_free_bytes(device)
    limit = settings.memory_limit.value(device)
    return free if limit is None else min(free, limit)


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
