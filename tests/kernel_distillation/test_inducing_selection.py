"""Tests of the inducing-point selection of kernel distillation: K-means centroids and the
nearest ones of every input, both in the scaled metric, against a brute-force search, with
its phases reported and a callback's stop honoured."""

import torch
from kd_reference import DT, reference_data

from gpsd.kernel_distillation import kmeans
from gpsd.kernel_distillation._inducing_selection import select_inducing_points

SCALE = torch.tensor([0.3, 2.0], dtype=DT)


def _brute_force_neighbours(x, u, b):
    """The ``b`` nearest rows of ``u`` to every row of ``x`` on ``x / SCALE``, by a loop."""
    rows = []
    for xi in x:
        d2 = (((u - xi) / SCALE) ** 2).sum(-1)
        rows.append(torch.argsort(d2)[:b].sort().values)
    return torch.stack(rows)


def test_given_inducing_points_are_kept_and_searched_in_the_scaled_metric():
    x, _ = reference_data(50)
    u = torch.randn(9, 2, generator=torch.Generator().manual_seed(4), dtype=DT)
    records = []
    selection = select_inducing_points(
        x, 9, 4, scale=SCALE, inducing_points=u, task="T", callback=records.append
    )
    assert selection.inducing_points is u and not selection.stopped
    assert torch.equal(selection.neighbour_indices, _brute_force_neighbours(x, u, 4))
    assert [(r.task, r.phase, r.iteration, r.total) for r in records] == [("T", "neighbours", 1, 1)]


def test_kmeans_runs_on_the_scaled_inputs_and_reports_each_lloyd_iteration():
    x, _ = reference_data(60)
    records = []
    selection = select_inducing_points(
        x, 10, 3, scale=SCALE, kmeans_max_iter=4, seed=2, task="T", callback=records.append
    )
    direct = []
    centres = kmeans(x / SCALE, 10, max_iter=4, seed=2, callback=direct.append)
    torch.testing.assert_close(selection.inducing_points, centres * SCALE, rtol=0, atol=0)
    # every input's neighbours are the brute-force nearest centroids in the scaled metric
    u = selection.inducing_points
    assert torch.equal(selection.neighbour_indices, _brute_force_neighbours(x, u, 3))
    phases = [(r.phase, r.iteration) for r in records]
    assert phases == [("k-means", r.iteration) for r in direct] + [("neighbours", 1)]
    assert [r.loss for r in records[:-1]] == [r.loss for r in direct]
    assert selection.kmeans_seconds >= 0


def test_a_callback_stopping_kmeans_keeps_its_centroids_and_silences_the_neighbours():
    x, _ = reference_data(60)
    records = []
    selection = select_inducing_points(
        x,
        10,
        3,
        scale=SCALE,
        kmeans_max_iter=20,
        task="T",
        callback=lambda r: records.append(r) or True,
    )
    assert selection.stopped
    assert [(r.phase, r.iteration) for r in records] == [("k-means", 1)]
    one = kmeans(x / SCALE, 10, max_iter=1, seed=0) * SCALE
    torch.testing.assert_close(selection.inducing_points, one, rtol=0, atol=0)
    u = selection.inducing_points
    assert torch.equal(selection.neighbour_indices, _brute_force_neighbours(x, u, 3))
