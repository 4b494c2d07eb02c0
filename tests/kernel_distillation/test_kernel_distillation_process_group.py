"""KernelDistillation with a process group: its passes over K_XX split across 2 and 3 gloo
processes (n = 301, uneven on both) against one process and a dense formula.

One launch per group size (``tests/distributed_launch.py`` starts ``tests/distributed_worker.py``
once per rank, scenario ``kd``); every rank runs the distillations through the group and alone,
and returns both for the checks here.
"""

from __future__ import annotations

import itertools

import gpytorch
import pytest
import torch
import torch.distributed as dist
from distributed_launch import launch
from distributed_worker import KD_COMMON, KD_N, KD_RUNS, problem
from kd_reference import Teacher

import gpsd

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="needs torch.distributed with the gloo backend",
)

DT = torch.float64
RUNS = [*KD_RUNS, "teacher"]
COMPARED = ["weights", "initial_weights", "errors", "mean", "variance"]


@pytest.fixture(scope="module", params=[2, 3], ids=["2 ranks", "3 ranks"])
def kd_run(request, tmp_path_factory):
    world = request.param
    return world, launch("kd", world, tmp_path_factory.mktemp(f"kd{world}"))


def _assert_relative(got: torch.Tensor, want: torch.Tensor, tol: float, what: str) -> None:
    """``got`` equals ``want`` to ``tol`` relative to ``want``'s largest entry."""
    assert got.shape == want.shape, what
    error = float((got - want).abs().max())
    assert error <= tol * float(want.abs().max()), f"{what}: {error:.3e}"


def test_each_rank_evaluates_only_its_own_contiguous_block_of_columns(kd_run):
    world, results = kd_run
    blocks = [r["distributed"]["block"]["block"] for r in results]
    assert blocks[0][0] == 0 and blocks[-1][1] == KD_N
    assert all(a[1] == b[0] for a, b in itertools.pairwise(blocks))
    sizes = [stop - start for start, stop in blocks]
    assert max(sizes) - min(sizes) == 1  # 301 columns do not split evenly
    for run in KD_RUNS:
        plain = results[0]["plain"][run]["columns"]
        assert plain[0] == (0, KD_COMMON["chunk_size"])
        passes, rest = divmod(sum(b - a for a, b in plain), KD_N)
        assert rest == 0 and passes >= 3  # the objective, the line searches, the last error
        for result, (start, stop) in zip(results, blocks, strict=True):
            columns = result["distributed"][run]["columns"]
            assert result["distributed"][run]["block"] == (start, stop)
            assert all(start <= a < b <= stop for a, b in columns), run
            assert sum(b - a for a, b in columns) == passes * (stop - start), run


@pytest.mark.parametrize("run", RUNS)
def test_weights_errors_and_student_on_every_rank_equal_one_process(kd_run, run):
    _, results = kd_run
    plain = results[0]["plain"][run]
    assert len(plain["errors"]) == (2 if run == "teacher" else 3)
    for result in results:
        got = result["distributed"][run]
        for key in COMPARED:
            _assert_relative(got[key], plain[key], 1e-10, f"{run} {key}")
        # K-means and the neighbours are replicated: the same as one process, exactly
        for key in ("inducing_points", "neighbour_indices", "inducing_covariance"):
            assert torch.equal(got[key], plain[key]), key


@pytest.mark.parametrize("run", RUNS)
def test_every_rank_holds_bit_identical_results(kd_run, run):
    _, results = kd_run
    first = results[0]["distributed"][run]
    for result, key in itertools.product(results[1:], COMPARED):
        assert torch.equal(result["distributed"][run][key], first[key]), key


@pytest.mark.parametrize("run", list(KD_RUNS))
def test_the_errors_through_the_group_equal_the_dense_frobenius_norm(kd_run, run):
    _, results = kd_run
    got = results[-1]["distributed"][run]
    x, _, _, kernel = problem(KD_N)
    scale = float(kernel.outputscale.detach())
    lengthscale = float(kernel.base_kernel.lengthscale.detach())
    # the kernel written out, s exp(-|x - x'|^2 / (2 l^2)), and W dense on its pattern
    k_xx = scale * torch.exp(-torch.cdist(x, x).square() / (2 * lengthscale**2))
    n, m = KD_N, KD_COMMON["num_inducing"]
    w = torch.zeros(n, m, dtype=DT).scatter_(-1, got["neighbour_indices"], got["weights"])
    w0 = torch.zeros(n, m, dtype=DT)
    w0.scatter_(-1, got["neighbour_indices"], got["initial_weights"])
    kuu = got["inducing_covariance"]
    last = torch.linalg.matrix_norm(k_xx - w @ kuu @ w.mT)
    first = torch.linalg.matrix_norm(k_xx - w0 @ kuu @ w0.mT)
    torch.testing.assert_close(got["errors"][-1], last, rtol=1e-10, atol=0)
    torch.testing.assert_close(got["errors"][0], first, rtol=1e-10, atol=0)
    assert got["errors"][-1] < got["errors"][0]  # the descent steps were taken


@pytest.mark.parametrize(
    ("case", "names"),
    [
        ("different_train_x", "values of train_x"),
        ("different_kernel", "kernel hyperparameter values"),
        ("different_settings", "settings"),
    ],
)
def test_ranks_with_different_problems_raise_a_value_error_on_every_rank(kd_run, case, names):
    world, results = kd_run
    for rank, result in enumerate(results):
        caught = result[case]
        assert caught["type"] == "ValueError", caught
        assert names in caught["message"] and f"rank {rank} of {world}" in caught["message"]
        assert "KernelDistillation" in caught["message"]


def test_a_process_group_that_is_not_one_is_refused():
    x, y, _, kernel = problem(20)
    with pytest.raises(TypeError, match="process_group must be a torch.distributed.ProcessGroup"):
        gpsd.KernelDistillation.from_data(
            x, y, kernel, noise=0.1, num_inducing=5, sparsity=2, process_group="world"
        )
    likelihood = gpytorch.likelihoods.GaussianLikelihood().to(DT)
    teacher = Teacher(x, y, likelihood)
    with pytest.raises(TypeError, match="process_group"):
        gpsd.KernelDistillation(teacher, num_inducing=5, sparsity=2, process_group=0)
