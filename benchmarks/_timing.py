"""Timing shared by the benchmark scripts: medians after warm-up, wall and process (CPU) time, and
the machine's load average at the start and end of a run, written into every report's header."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import os
import platform
import resource
import statistics
import sys
import time
from collections.abc import Callable

import torch

#: The 1-, 5- and 15-minute load averages when this module was imported (the run's start).
START_LOAD: tuple[float, float, float] = os.getloadavg()


def load_line() -> str:
    """One Markdown line with the load averages at the run's start and now, and the core count:
    a load near or above the core count means the machine was shared and wall times are noisy."""
    now = os.getloadavg()
    fmt = ", ".join
    return (
        f"_Machine load (1, 5, 15-minute averages) at start: {fmt(f'{v:.2f}' for v in START_LOAD)}; "
        f"at end: {fmt(f'{v:.2f}' for v in now)}; {os.cpu_count()} cores._"
    )


@functools.cache
def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux), else what ``platform`` knows: results
    from two machines of the same architecture can differ in timing and in float32 rounding."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()} ({platform.machine()})"
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name(device: torch.device) -> str:
    """The GPU's name and memory, or :func:`cpu_name`: what a report's header names."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return f"{props.name}, {props.total_memory / 2**30:.1f} GiB"
    return cpu_name()


def cuda_missing(device: torch.device) -> bool:
    """True (after saying so) where ``device`` is CUDA but none is here: the caller skips."""
    if device.type == "cuda" and not torch.cuda.is_available():
        script = os.path.basename(sys.argv[0])
        print(f"{script}: no CUDA device here; nothing to measure (skipped).")
        return True
    return False


def sync(device: torch.device) -> None:
    """Wait for queued CUDA work, so that a host clock measures it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _status_kib(key: str) -> int | None:
    """A ``kB`` field of ``/proc/self/status`` (``None`` where there is none)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def peak_rss_kib() -> int:
    """This process's peak resident set in KiB (``VmHWM``: unlike ``ru_maxrss``, which Linux
    carries over from the parent across ``fork``/``exec``, it starts afresh in a new process)."""
    peak = _status_kib("VmHWM")
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


@functools.cache
def _libc() -> ctypes.CDLL:
    """The C library (looked up once: ``find_library`` may run ``ldconfig``)."""
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


def start_peak_rss() -> int | None:
    """Start measuring this process's peak resident set afresh; returns the baseline in KiB, or
    ``None`` where the platform cannot (Linux 4.0 or later is needed).

    Memory that the C allocator holds free is first handed back to the system (glibc's
    ``malloc_trim``), so that a later call that reuses it still counts it; then the peak
    (``VmHWM``) is restarted at the current resident set by writing "5" to
    ``/proc/self/clear_refs``. The peak growth of a call is then :func:`peak_rss_kib` minus the
    baseline.
    """
    try:
        _libc().malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        return None
    return _status_kib("VmHWM")


def reset_peak(device: torch.device) -> None:
    """Collect garbage and start counting the peak memory afresh: CUDA's allocator statistics,
    or this process's resident set on the CPU (:func:`start_peak_rss`)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    else:
        start_peak_rss()


def peak_gib(device: torch.device) -> float:
    """GiB at the peak since :func:`reset_peak`: allocated on CUDA, resident on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return peak_rss_kib() / 2**20


def median_time(
    fn: Callable[[], object], repeats: int, device: torch.device, warmup: int = 1
) -> float:
    """Median seconds of ``repeats`` calls of ``fn`` after ``warmup`` untimed calls."""
    return median_time_and_output(fn, repeats, device, warmup)[0]


def median_time_and_output(
    fn: Callable[[], object], repeats: int, device: torch.device, warmup: int = 1
) -> tuple[float, object]:
    """:func:`median_time` and the output of the last timed call (``None`` if ``repeats`` is 0)."""
    wall, _, out = median_wall_cpu_and_output(fn, repeats, device, warmup)
    return wall, out


def median_wall_cpu(
    fn: Callable[[], object], repeats: int, device: torch.device, warmup: int = 1
) -> tuple[float, float]:
    """Median wall-clock and median process (CPU, all threads) seconds of ``repeats`` calls of
    ``fn`` after ``warmup`` untimed calls. On a shared machine the wall clock includes the time
    other processes held the cores; the process time does not."""
    wall, cpu, _ = median_wall_cpu_and_output(fn, repeats, device, warmup)
    return wall, cpu


def median_wall_cpu_and_output(
    fn: Callable[[], object], repeats: int, device: torch.device, warmup: int = 1
) -> tuple[float, float, object]:
    """:func:`median_wall_cpu` and the output of the last timed call."""
    for _ in range(warmup):
        fn()
    walls, cpus, out = [], [], None
    for _ in range(repeats):
        sync(device)
        start, start_cpu = time.perf_counter(), time.process_time()
        out = fn()
        sync(device)
        walls.append(time.perf_counter() - start)
        cpus.append(time.process_time() - start_cpu)
    if not walls:
        return float("nan"), float("nan"), None
    return statistics.median(walls), statistics.median(cpus), out


class Report:
    """Markdown lines printed as they come and, given a path ``out``, rewritten there after each
    addition: a run cut short by a time limit leaves every row it measured.


    The written file begins with :func:`load_line` (the load at the start and at the last row),
    so that a results file says whether its machine was busy; :meth:`close` prints it."""

    def __init__(self, out: str | None) -> None:
        self.out = out
        self.lines: list[str] = []

    def add(self, *lines: str) -> None:
        for line in lines:
            print(line, flush=True)
        self.lines.extend(lines)
        if self.out:
            with open(self.out, "w") as fh:
                fh.write(load_line() + "\n\n" + "\n".join(self.lines) + "\n")

    def close(self) -> None:
        """Print the closing load line (the file already holds it)."""
        print("\n" + load_line(), flush=True)


def write_report(text: str, out: str | None) -> None:
    """Print a Markdown report under a header of :func:`load_line` and, given a path ``out``, also
    write it there."""
    text = load_line() + "\n\n" + text
    print(text)
    if out:
        with open(out, "w") as fh:
            fh.write(text + "\n")
