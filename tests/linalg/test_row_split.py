"""The sums over rows and the TSQR of vectors split by rows across 3 gloo processes
(``gpsd.linalg._row_split``), against the same computations on the whole matrices."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from distributed_launch import launch
from distributed_worker import problem

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="needs torch.distributed with the gloo backend",
)

DT = torch.float64
SHAPES = [(7, 3), (40, 5)]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return launch("row_split", 3, tmp_path_factory.mktemp("row_split"), limit=120.0)


def _whole(n: int, c: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(6)  # the worker's draws
    return torch.randn(2, n, c, generator=gen, dtype=DT), torch.randn(
        2, n, 2, generator=gen, dtype=DT
    )


@pytest.mark.parametrize("shape", SHAPES, ids=["7x3 (ranks with 2 rows)", "40x5"])
def test_tsqr_of_the_ranks_rows_is_a_qr_factorisation_of_the_whole(results, shape):
    z, _ = _whole(*shape)
    eye = torch.eye(shape[1], dtype=DT)
    for result in results:
        got = result[shape]
        q, r = got["q"], got["r"]
        torch.testing.assert_close(q @ r, z, rtol=0, atol=1e-12)
        torch.testing.assert_close(q.mT @ q, eye.expand(2, -1, -1), rtol=0, atol=1e-12)
        assert torch.equal(r, r.triu())
        # |R| is unique: the diagonal of the whole matrix's own QR, up to signs
        torch.testing.assert_close(
            r.diagonal(dim1=-2, dim2=-1).abs(),
            torch.linalg.qr(z)[1].diagonal(dim1=-2, dim2=-1).abs(),
            rtol=1e-12,
            atol=0,
        )
        assert torch.equal(r, results[0][shape]["r"])  # the same bits on every rank
    assert [result[shape]["mine"] for result in results] == [
        shape[0] // 3 + (p < shape[0] % 3) for p in range(3)
    ]


@pytest.mark.parametrize("shape", SHAPES, ids=["7x3", "40x5"])
def test_sums_over_the_ranks_rows_equal_those_over_the_whole(results, shape):
    z, w = _whole(*shape)
    x, _, _, kernel = problem(shape[0])
    scale = float(kernel.outputscale.detach())
    lengthscale = float(kernel.base_kernel.lengthscale.detach())
    dense = scale * torch.exp(-torch.cdist(x, x).square() / (2 * lengthscale**2))
    for result in results:
        got = result[shape]
        torch.testing.assert_close(got["gram"], z.mT @ w, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got["norm"], z.norm(dim=-2), rtol=1e-12, atol=0)
        torch.testing.assert_close(got["product"], dense @ z, rtol=1e-12, atol=1e-12)
        assert torch.equal(got["gram"], results[0][shape]["gram"])
