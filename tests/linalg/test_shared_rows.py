"""Tests of gpsd.linalg.shared_rows on 2 gloo processes (``tests/distributed_launch.py``):
each rank computes its contiguous share of the rows, and every rank gathers the whole."""

import pytest
import torch
import torch.distributed as dist
from distributed_launch import launch

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="needs torch.distributed with the gloo backend",
)


def _whole(rows):
    """What the scenario's compute gives on all the rows at once, in one process."""
    return torch.stack([rows.sum(-1), rows.prod(-1), rows[..., 0], rows[..., 2] ** 2], dim=-2)


def test_each_rank_computes_its_share_and_every_rank_gathers_the_whole(tmp_path):
    results = launch("rows", 2, tmp_path, limit=120.0)
    rows = torch.arange(2 * 5 * 3, dtype=torch.float64).reshape(2, 5, 3).sin()
    for rank, result in enumerate(results):
        assert result["rank"] == rank
        torch.testing.assert_close(result["five"], _whole(rows), rtol=0, atol=0)
        torch.testing.assert_close(result["one"], _whole(rows[:, :1]), rtol=0, atol=0)
        five, one = result["seen"]
        # 5 rows: 3 on rank 0, 2 on rank 1, in order; 1 row: rank 1 computes on it for the
        # shapes alone
        expected = rows[:, :3] if rank == 0 else rows[:, 3:]
        assert torch.equal(five, expected)
        assert torch.equal(one, rows[:, :1])
        differ = result["differ"]
        assert differ["type"] == "ValueError"
        assert "values of val_x (rank(s) [1] differ from rank 0)" in differ["message"]
        assert "every rank must pass the same val_x" in differ["message"]
