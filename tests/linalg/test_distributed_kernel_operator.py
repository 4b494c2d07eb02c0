"""DistributedKernelOperator and the regressors' process_group, on 2 and 3 gloo processes.

Each multi-process run starts ``tests/distributed_worker.py`` once per rank
(``tests/distributed_launch.py``: subprocesses on the loopback interface, joined through a file
store in a temporary folder); the workers compute the plain single-process answers too, and
return everything for the checks here.
"""

from __future__ import annotations

import itertools

import gpytorch
import pytest
import torch
import torch.distributed as dist
from distributed_launch import launch
from distributed_worker import NOISE, SPECTRUM_N, TINY_N, problem

import gpsd

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="needs torch.distributed with the gloo backend",
)

DT = torch.float64
SHORT_TIMEOUT = 3.0  # distributed_worker.SHORT_TIMEOUT
MODELS = [
    "data_lanczos",
    "data_lanczos_schedules",
    "data_cg",
    "data_auto",
    "distribution_lanczos",
    "distribution_cg",
    "combined_lanczos",
    "combined_cg",
]


@pytest.fixture(scope="module", params=[2, 3], ids=["2 ranks", "3 ranks (uneven)"])
def main_run(request, tmp_path_factory):
    world = request.param
    return world, launch("main", world, tmp_path_factory.mktemp(f"main{world}"), limit=300.0)


def test_each_rank_holds_a_contiguous_block_of_rows(main_run):
    world, results = main_run
    n = 300 if world == 2 else 301
    blocks = [r["rows"] for r in results]
    assert blocks[0][0] == 0 and blocks[-1][1] == n
    assert all(a[1] == b[0] for a, b in itertools.pairwise(blocks))
    sizes = [stop - start for start, stop in blocks]
    assert max(sizes) - min(sizes) == (0 if n % world == 0 else 1)


def test_products_and_diagonal_equal_the_dense_kernel_on_every_rank(main_run):
    world, results = main_run
    n = 300 if world == 2 else 301
    x, _, _, kernel = problem(n)
    scale, lengthscale = (
        float(kernel.outputscale.detach()),
        float(kernel.base_kernel.lengthscale.detach()),
    )
    # the dense kernel written out: s exp(-|x - x'|^2 / (2 l^2))
    dense = scale * torch.exp(-torch.cdist(x, x).square() / (2 * lengthscale**2))
    rhs = torch.randn(n, 5, generator=torch.Generator().manual_seed(1), dtype=DT)
    for result in results:
        torch.testing.assert_close(result["product"], dense @ rhs, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(result["diagonal"], dense.diagonal(), rtol=1e-14, atol=0)
        assert torch.equal(result["product"], results[0]["product"])


@pytest.mark.parametrize("model", MODELS)
def test_regressors_on_every_rank_equal_one_process(main_run, model):
    _, results = main_run
    plain = results[0]["plain"][model]
    keys = [k for k in plain if isinstance(plain[k], torch.Tensor)]
    assert {"mean", "variance", "predict_mean"} <= set(keys)
    for result in results:
        got = result["models"][model]
        assert got["engine"] == plain["engine"]
        for key in keys:
            torch.testing.assert_close(got[key], plain[key], rtol=0, atol=1e-10, msg=key)
            # the ranks return one answer, not several close ones
            assert torch.equal(got[key], results[0]["models"][model][key]), key


def test_lanczos_keeps_its_rows_of_the_basis_and_cg_gathers_the_ritz_vectors(main_run):
    world, results = main_run
    n = 300 if world == 2 else 301
    for result in results:
        models, rows = result["models"], result["rows"]
        lanczos = ("data_lanczos", "data_lanczos_schedules", "data_auto", "distribution_lanczos")
        for name in (*lanczos, "combined_lanczos"):
            got = models[name]
            assert got["engine"] == "KernelSpectrum", name  # auto: matrix-free, through the group
            assert got["local_rows"] == rows and not got["split"], name
            assert got["eigenvector_rows"] == got["ritz_rows"] == rows[1] - rows[0], name
        cg = models["data_cg"]
        assert cg["engine"] == "ShiftedCG" and cg["local_rows"] is None and cg["ritz_rows"] == n


def test_each_rank_keeps_its_rows_of_the_krylov_basis_only_for_uneven_n(main_run):
    world, results = main_run
    sizes = [SPECTRUM_N // world + (r < SPECTRUM_N % world) for r in range(world)]
    assert SPECTRUM_N % world != 0 and max(sizes) == -(-SPECTRUM_N // world)
    for result, size in zip(results, sizes, strict=True):
        got = result["spectrum"]["truncated"]
        assert got["eigenvector_rows"] == got["ritz_rows"] == size
        assert got["basis_size"] == SPECTRUM_N
        plain = result["plain_spectrum"]["truncated"]
        assert plain["eigenvector_rows"] == plain["ritz_rows"] == SPECTRUM_N


@pytest.mark.parametrize("case", ["truncated", "whole"])
def test_a_lanczos_spectrum_split_by_rows_equals_one_process(main_run, case):
    """Eigenvalues, the bounds, coordinates, filters, forms and traces (with the power
    iterations and the probes' series) of a spectrum whose basis each rank holds its rows of:
    those of one process to 1e-8, the same bits on every rank."""
    _, results = main_run
    plain = results[0]["plain_spectrum"][case]
    assert plain["num_resolved"] < plain["eigenvalues"].shape[-1] or case == "whole"
    for result in results:
        got = result["spectrum"][case]
        for key, value in plain.items():
            if isinstance(value, torch.Tensor):
                torch.testing.assert_close(got[key], value, rtol=1e-8, atol=1e-10, msg=key)
                assert torch.equal(got[key], results[0]["spectrum"][case][key]), key


def test_a_split_spectrum_given_all_rows_names_the_rows_it_holds(main_run):
    world, results = main_run
    for result in results:
        caught = result["spectrum"]["truncated"]["full_rows"]
        assert caught["type"] == "ValueError", caught
        assert "rhs must hold this rank's" in caught["message"]
        assert f"N = {SPECTRUM_N}" in caught["message"]


def test_a_whole_basis_split_by_rows_has_the_dense_eigenvalues_and_filters(main_run):
    """N = 10 on 2 and 3 ranks, blocks of 8 columns: ranks holding fewer rows than a block
    has columns. The eigenvalues are those of the dense matrix, the filter its dense form."""
    _, results = main_run
    x, _, _, kernel = problem(TINY_N)
    scale = float(kernel.outputscale.detach())
    lengthscale = float(kernel.base_kernel.lengthscale.detach())
    dense = scale * torch.exp(-torch.cdist(x, x).square() / (2 * lengthscale**2))
    evals, evecs = torch.linalg.eigh(dense)
    gen = torch.Generator().manual_seed(4)  # the worker's right-hand side
    rhs = torch.randn(TINY_N, 2, generator=gen, dtype=DT)
    gammas = torch.tensor(NOISE, dtype=DT)
    # the data-centric weights G_t(d) = d^(t-1) / prod_{s <= t} (d + gamma_s), written out
    values = torch.stack(
        [evals ** (t - 1) / torch.prod(evals[None] + gammas[:t, None], 0) for t in (1, 2, 3)]
    )
    expected = torch.stack([evecs @ (v[:, None] * (evecs.mT @ rhs)) for v in values])
    for result in results:
        got = result["spectrum"]["whole"]
        torch.testing.assert_close(got["eigenvalues"], evals.flip(-1), rtol=0, atol=1e-12)
        torch.testing.assert_close(got["apply"], expected, rtol=1e-8, atol=1e-10)


def test_gcv_and_covariances_through_the_group_equal_one_process(main_run):
    _, results = main_run
    plain = results[0]["plain"]["data_lanczos"]
    for result in results:
        got = result["models"]["data_lanczos"]
        torch.testing.assert_close(got["gcv"], plain["gcv"], rtol=1e-10, atol=0)
        torch.testing.assert_close(got["covariance"], plain["covariance"], rtol=0, atol=1e-10)
    plain = results[0]["plain"]["data_cg"]
    for result in results:  # estimated from the same probes on every rank
        got = result["models"]["data_cg"]
        torch.testing.assert_close(got["gcv"], plain["gcv"], rtol=1e-8, atol=0)
        torch.testing.assert_close(
            got["gcv_standard_error"], plain["gcv_standard_error"], rtol=0, atol=1e-10
        )


def test_ranks_whose_automatic_choices_differ_agree_on_the_matrix_free_one(main_run):
    _, results = main_run
    plain = results[0]["plain"]["data_auto"]
    assert plain["engine"] == "KernelSpectrum"
    for result in results:
        got = result["disagreeing_auto"]
        assert got["engine"] == plain["engine"]
        torch.testing.assert_close(got["mean"], plain["mean"], rtol=0, atol=1e-10)


def test_a_group_of_one_rank_is_the_plain_path(main_run):
    world, results = main_run
    if world != 2:
        pytest.skip("the 2-rank run checks groups of one")
    for result, model in itertools.product(results, MODELS):
        plain, alone = result["plain"][model], result["alone"][model]
        for key, value in plain.items():
            if isinstance(value, torch.Tensor):
                torch.testing.assert_close(alone[key], value, rtol=0, atol=1e-12, msg=key)


@pytest.mark.parametrize(
    ("case", "names"),
    [
        ("different_x", "values of x"),
        ("different_kernel", "kernel hyperparameter values"),
        ("different_test_x", "values of test_x"),
        ("different_rhs", "multiplied the distributed kernel operator by another"),
    ],
)
def test_ranks_that_hold_different_data_raise_a_value_error_on_every_rank(main_run, case, names):
    world, results = main_run
    for rank, result in enumerate(results):
        caught = result[case]
        assert caught["type"] == "ValueError", caught
        assert names in caught["message"] and f"rank {rank} of {world}" in caught["message"]


@pytest.mark.parametrize("backend", ["lanczos", "cg", "auto"])
@pytest.mark.parametrize(
    ("case", "names"),
    [
        ("y", "values of train_y"),
        ("noise", "values of noise"),
        ("mean", "mean_module hyperparameter values"),
    ],
)
def test_ranks_with_different_targets_noise_or_means_raise_on_every_rank(
    main_run, backend, case, names
):
    world, results = main_run
    for rank, result in enumerate(results):
        caught = result[f"different_{case}_{backend}"]
        assert caught["type"] == "ValueError", caught
        assert names in caught["message"] and f"rank {rank} of {world}" in caught["message"]


@pytest.mark.parametrize("backend", ["dense", "cholesky"])
def test_a_direct_backend_with_a_process_group_is_refused_naming_the_matrix_free_ones(
    main_run, backend
):
    _, results = main_run
    for result in results:
        caught = result[f"group_with_{backend}"]
        assert caught["type"] == "ValueError", caught
        assert f"backend={backend!r}" in caught["message"]
        assert "'lanczos' or 'cg'" in caught["message"]


@pytest.mark.parametrize("how", ["raise", "exit"])
def test_a_rank_that_fails_mid_run_ends_the_run_on_every_rank_within_the_timeout(how, tmp_path):
    results = launch(f"fail_{how}", 2, tmp_path, limit=60.0, exits=(1,) if how == "exit" else ())
    caught = results[0]["fit"]
    assert caught["type"] == "DistributedError", caught
    assert "rank 0 of 2" in caught["message"] and "all_gather" in caught["message"]
    assert caught["seconds"] < SHORT_TIMEOUT + 10.0
    if how == "raise":  # the failing rank keeps its own error
        assert results[1]["fit"]["type"] == "RuntimeError"
        assert "on purpose" in results[1]["fit"]["message"]


def test_a_process_group_that_is_not_one_is_refused():
    x = torch.rand(10, 2, dtype=DT)
    kernel = gpytorch.kernels.RBFKernel().to(DT)
    with pytest.raises(TypeError, match="process_group must be a torch.distributed.ProcessGroup"):
        gpsd.DataCentricGPR(x, x.sum(-1), kernel, noise=0.1, process_group="world")
    with pytest.raises(TypeError, match="process_group"):
        gpsd.linalg.DistributedKernelOperator(x, covar_module=kernel, process_group=0)


def test_a_keops_kernel_multiplies_each_ranks_rows_by_keops_reductions(tmp_path):
    """With a GPyTorch KeOps kernel, each rank's block is KeOps reductions over its rows (no
    dense row chunks): products, diagonal and the regressor through the group equal the dense
    kernel and one process with the plain kernel."""
    pytest.importorskip("pykeops", reason="the KeOps path needs pykeops (gpsd[keops])")
    results = launch("keops", 2, tmp_path, limit=600.0)
    x, _, _, kernel = problem(300)
    scale = float(kernel.outputscale.detach())
    lengthscale = float(kernel.base_kernel.lengthscale.detach())
    dense = scale * torch.exp(-torch.cdist(x, x).square() / (2 * lengthscale**2))
    rhs = torch.randn(300, 5, generator=torch.Generator().manual_seed(1), dtype=DT)
    for result in results:
        assert result["local"] == "_KeOpsRows"
        torch.testing.assert_close(result["product"], dense @ rhs, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(result["diagonal"], dense.diagonal(), rtol=1e-14, atol=0)
        torch.testing.assert_close(result["mean"], result["plain_mean"], rtol=0, atol=1e-10)
        torch.testing.assert_close(result["variance"], result["plain_variance"], rtol=0, atol=1e-10)
        assert torch.equal(result["mean"], results[0]["mean"])


def _close(got, expected):
    if isinstance(got, list):
        assert len(got) == len(expected)
        for g, e in zip(got, expected, strict=True):
            _close(g, e)
        return
    torch.testing.assert_close(
        torch.as_tensor(got), torch.as_tensor(expected), rtol=1e-8, atol=1e-10
    )


@pytest.mark.parametrize(
    "what",
    [
        "form_grads",
        "mll",
        "mll_grads",
        "exactgp_loss",
        "exactgp_grads",
        "trained",
        "trained_noise",
        "history",
    ],
)
def test_gradients_and_training_through_the_group_equal_one_process(main_run, what):
    """The bilinear derivative (summed over the ranks), GPyTorch's marginal likelihood and its
    gradient, an ExactGP with ChunkedKernel(process_group=...) and optimize_hyperparameters on
    the CG backend: on every rank, what one process computes, to 1e-8."""
    world, results = main_run
    results = [r["mll"] for r in results]
    assert [r["rank"] for r in results] == list(range(world))
    for result in results:
        _close(result["group"][what], results[0]["single"][what])


def test_the_backward_pass_frees_each_ranks_kept_rows(main_run):
    """Each rank keeps the rows of its block for the products of one marginal likelihood and
    frees them in the bilinear derivative, as one process does."""
    world, results = main_run
    for result in [r["mll"] for r in results]:
        for side in ("group", "single") if "single" in result else ("group",):
            assert result[side]["kept_before_backward"] > 0
            assert result[side]["kept_after_backward"] == 0
