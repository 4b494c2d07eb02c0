"""Start ``tests/distributed_worker.py`` once per rank and collect what every rank saved.

Shared by the multi-process tests (tests/linalg/test_distributed_kernel_operator.py,
tests/linalg/test_shared_rows.py, tests/linalg/test_row_split.py,
tests/kernel_distillation/test_kernel_distillation_process_group.py): subprocesses on the
loopback interface, joined through a file store in a temporary folder.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch

WORKER = pathlib.Path(__file__).parent / "distributed_worker.py"
ROOT = pathlib.Path(__file__).parents[1]


def launch(
    scenario: str, world: int, folder: pathlib.Path, limit: float = 120.0, exits: tuple = ()
) -> list:
    """Run ``scenario`` on ``world`` gloo processes; what each rank saved, in rank order
    (``None`` for the ranks in ``exits``, which leave without saving)."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    if sys.platform.startswith("linux") and pathlib.Path("/sys/class/net/lo").exists():
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the loopback interface
    init, outs = folder / "store", [folder / f"rank{r}.pt" for r in range(world)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), scenario, str(r), str(world), str(init), str(out)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for r, out in enumerate(outs)
    ]
    logs = []
    try:
        for proc in procs:
            logs.append(proc.communicate(timeout=limit)[0].decode(errors="replace"))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    results = []
    for rank, out in enumerate(outs):
        if rank in exits:
            assert not out.exists() and procs[rank].returncode == 3
            results.append(None)
            continue
        if not out.exists():
            pytest.fail(f"rank {rank} saved nothing; its output:\n{logs[rank][-3000:]}")
        result = torch.load(out, weights_only=False)
        assert "crashed" not in result, result.get("crashed")
        results.append(result)
    return results
