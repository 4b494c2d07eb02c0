"""Tests of kmeans and kmeans_plus_plus against loops and scikit-learn."""

import warnings

import numpy as np
import pytest
import torch
from kd_reference import (
    DT,
)

from gpsd.kernel_distillation import (
    kmeans,
    kmeans_plus_plus,
)


def _blobs(n=300, seed=0):
    gen = torch.Generator().manual_seed(seed)
    centres = torch.tensor([[0.0, 0.0], [5.0, 5.0], [-5.0, 4.0], [4.0, -5.0]], dtype=torch.float64)
    labels = torch.randint(4, (n,), generator=gen)
    return centres[labels] + 0.5 * torch.randn(n, 2, generator=gen, dtype=torch.float64)


def test_kmeans_plus_plus_picks_distinct_rows_of_x():
    x = _blobs()
    c = kmeans_plus_plus(x, 10, seed=3)
    assert c.shape == (10, 2)
    # every centre is a row of x and no row is picked twice
    d = (c.unsqueeze(1) - x.unsqueeze(0)).abs().sum(-1)
    assert torch.all(d.min(dim=1).values == 0)
    assert len({int(i) for i in d.argmin(dim=1)}) == 10
    torch.testing.assert_close(c, kmeans_plus_plus(x, 10, seed=3))


def test_kmeans_is_a_lloyd_fixed_point_and_matches_sklearn_inertia():
    sklearn_cluster = pytest.importorskip("sklearn.cluster")
    x = _blobs()
    c = kmeans(x, 4, max_iter=100, seed=0)
    # naive loop: every centroid is the mean of the points nearest to it
    assign = [int(torch.argmin(((c - xi) ** 2).sum(-1))) for xi in x]
    for j in range(4):
        members = x[[i for i, a in enumerate(assign) if a == j]]
        torch.testing.assert_close(c[j], members.mean(0))
    inertia = sum(float(((x[i] - c[a]) ** 2).sum()) for i, a in enumerate(assign))
    ref = sklearn_cluster.KMeans(4, n_init=10, random_state=0).fit(x.numpy()).inertia_
    assert inertia <= 1.001 * ref


def test_float32_kmeans_step_far_from_the_origin_moves_centres_to_the_means():
    # One Lloyd step from the k-means++ start: every centre becomes the mean of the inputs
    # nearest to it. Summing float32 inputs near 2000 lost about 0.25 per addition (clusters of
    # 2000 inputs), which moved the centres by up to 0.018; a float32 ulp there is 1.2e-4.
    gen = torch.Generator().manual_seed(0)
    x = (2000 + torch.rand(20000, 2, generator=gen, dtype=DT)).float()
    start = kmeans_plus_plus(x, 10, seed=0)
    step = kmeans(x, 10, max_iter=1, seed=0)
    # reference: assignment by direct differences and means, in float64, by a loop
    x64, start64 = x.double(), start.double()
    assign = torch.cdist(x64, start64).argmin(-1)
    for j in range(10):
        mean = x64[assign == j].mean(0)
        torch.testing.assert_close(step[j].double(), mean, rtol=0, atol=2.5e-4)


def test_kmeans_with_zero_iterations_is_the_kmeans_plus_plus_start():
    x = _blobs()
    torch.testing.assert_close(kmeans(x, 6, max_iter=0, seed=2), kmeans_plus_plus(x, 6, seed=2))


def test_kmeans_of_a_single_input_does_not_warn():
    # an unbiased std as the stopping scale would warn ("degrees of freedom <= 0") and be NaN
    x = torch.tensor([[0.5, -1.0]], dtype=DT)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        centres = kmeans(x, 1)
    torch.testing.assert_close(centres, x)


def test_more_clusters_than_inputs_are_refused():
    x = torch.randn(10, 2)
    with pytest.raises(ValueError, match="num_clusters"):
        kmeans_plus_plus(x, 11)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda x: kmeans(x, 3, max_iter=-1), "max_iter must be a non-negative int"),
        (lambda x: kmeans(x, 3, tol=-1.0), "tol must be a finite float >= 0"),
        (lambda x: kmeans(x, 3, chunk_size=0), "chunk_size must be a positive integer or None"),
        (lambda x: kmeans_plus_plus(x, 2.5), "num_clusters must be a positive int"),
        (lambda x: kmeans_plus_plus(x, 0), "num_clusters"),
    ],
)
def test_integer_arguments_are_checked(call, match):
    x = torch.randn(10, 2, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    with pytest.raises(ValueError, match=match):
        call(x)


@pytest.mark.parametrize("tol", [None, "1e-3", True])
def test_kmeans_tol_must_be_a_non_negative_real_number(tol):
    x = torch.randn(20, 2, generator=torch.Generator().manual_seed(0), dtype=DT)
    with pytest.raises(ValueError, match="tol must be a finite float >= 0"):
        kmeans(x, 3, tol=tol)


@pytest.mark.parametrize("seed", [1.7, -1, "3", None])
def test_kmeans_seed_must_be_a_non_negative_int(seed):
    # seed=1.7 must not run as seed=1, nor "3" as 3
    x = torch.randn(20, 2, dtype=DT)
    with pytest.raises(ValueError, match="seed must be a non-negative integer"):
        kmeans_plus_plus(x, 3, seed=seed)
    with pytest.raises(ValueError, match="seed must be a non-negative integer"):
        kmeans(x, 3, seed=seed)


def test_numpy_and_tensor_integers_count_as_ints():
    x = _blobs()
    want = kmeans_plus_plus(x, 5, seed=1)
    torch.testing.assert_close(kmeans_plus_plus(x, np.int64(5), seed=1), want)
    torch.testing.assert_close(kmeans_plus_plus(x, torch.tensor(5), seed=1), want)


def test_the_callback_sees_each_lloyd_iteration_with_its_objective():
    x = _blobs(n=200, seed=2)
    records = []
    centres = kmeans(x, 6, max_iter=4, tol=0.0, seed=1, callback=records.append)
    assert [r.iteration for r in records] == [1, 2, 3, 4]
    assert all(r.task == "kmeans" and r.total == 4 for r in records)
    for record in records:
        # the centres the iteration started from, and the mean squared distance to the nearest
        before = kmeans(x, 6, max_iter=record.iteration - 1, tol=0.0, seed=1)
        nearest = torch.cdist(x, before).min(-1).values.square().mean()
        assert record.loss == pytest.approx(float(nearest), rel=1e-10)
    # Lloyd's iterations never raise the objective
    losses = [r.loss for r in records]
    assert all(b <= a * (1 + 1e-12) for a, b in zip(losses, losses[1:], strict=False))
    torch.testing.assert_close(centres, kmeans(x, 6, max_iter=4, tol=0.0, seed=1))


def test_a_callback_returning_true_keeps_the_centroids_reached():
    x = _blobs(n=200, seed=2)
    stopped = kmeans(x, 6, max_iter=10, tol=0.0, seed=1, callback=lambda r: r.iteration == 2)
    torch.testing.assert_close(stopped, kmeans(x, 6, max_iter=2, tol=0.0, seed=1), rtol=0, atol=0)
