"""Tests of free_memory_bytes: the host's and the control group's memory, and the CUDA
allocator's unused cache."""

import pytest
import torch

from gpsd.linalg import (
    free_memory_bytes,
)


def test_free_memory_bytes_is_positive_on_the_cpu():
    free = free_memory_bytes("cpu")
    assert isinstance(free, int) and free > 0


def _write(root, files):
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_cgroup_headroom_reads_v2_and_v1_limits(tmp_path):
    """A container's memory limit bounds the CPU's free memory: the host's MemAvailable alone
    would let backend='auto' plan a dense matrix that the limit kills."""
    from gpsd.linalg.memory import _cgroup_headroom_bytes

    gib = 2**30
    v2 = tmp_path / "v2"
    stat = "anon 1\ninactive_file 1073741824\nactive_file 5\n"
    _write(
        v2, {"memory.max": f"{8 * gib}\n", "memory.current": f"{3 * gib}\n", "memory.stat": stat}
    )
    assert _cgroup_headroom_bytes(str(v2)) == 8 * gib - (3 * gib - gib)  # the cache is reclaimable
    _write(v2, {"memory.max": "max\n"})
    assert _cgroup_headroom_bytes(str(v2)) is None
    v1 = tmp_path / "v1"
    _write(
        v1,
        {
            "memory/memory.limit_in_bytes": f"{4 * gib}\n",
            "memory/memory.usage_in_bytes": f"{5 * gib}\n",  # over the limit: nothing left
            "memory/memory.stat": "cache 9\ntotal_inactive_file 0\n",
        },
    )
    assert _cgroup_headroom_bytes(str(v1)) == 0
    _write(v1, {"memory/memory.limit_in_bytes": "9223372036854771712\n"})
    assert _cgroup_headroom_bytes(str(v1)) is None
    assert _cgroup_headroom_bytes(str(tmp_path / "absent")) is None


def test_free_memory_bytes_takes_the_smaller_of_host_and_cgroup(monkeypatch):
    import gpsd.linalg.memory as memory

    monkeypatch.setattr(memory, "_host_available_bytes", lambda: 2**30)
    monkeypatch.setattr(memory, "_cgroup_headroom_bytes", lambda: 2**20)
    assert free_memory_bytes("cpu") == 2**20
    monkeypatch.setattr(memory, "_cgroup_headroom_bytes", lambda: 2**40)
    assert free_memory_bytes("cpu") == 2**30
    monkeypatch.setattr(memory, "_cgroup_headroom_bytes", lambda: None)
    assert free_memory_bytes("cpu") == 2**30


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_free_memory_bytes_counts_the_allocators_unused_cache():
    device = torch.device("cuda")
    block = torch.empty(2**28, dtype=torch.uint8, device=device)  # 256 MiB
    before = free_memory_bytes(device)
    del block  # returns to PyTorch's cache, not to the driver
    after = free_memory_bytes(device)
    assert after - before >= 2**28 - 2**21
