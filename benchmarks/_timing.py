"""Wall-clock timing shared by the benchmark scripts."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def sync(device: torch.device) -> None:
    """Wait for queued CUDA work, so that a host clock measures it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_time(
    fn: Callable[[], object], repeats: int, device: torch.device, warmup: int = 1
) -> float:
    """Median seconds of ``repeats`` calls of ``fn`` after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)
