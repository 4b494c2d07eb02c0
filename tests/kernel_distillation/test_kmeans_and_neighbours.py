import numpy as np
import pytest
import torch

from gpsd.kernel_distillation import kmeans, kmeans_plus_plus, nearest_inducing_points


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
    c = kmeans(x, 4, num_iters=100, seed=0)
    # naive loop: every centroid is the mean of the points nearest to it
    assign = [int(torch.argmin(((c - xi) ** 2).sum(-1))) for xi in x]
    for j in range(4):
        members = x[[i for i, a in enumerate(assign) if a == j]]
        torch.testing.assert_close(c[j], members.mean(0))
    inertia = sum(float(((x[i] - c[a]) ** 2).sum()) for i, a in enumerate(assign))
    ref = sklearn_cluster.KMeans(4, n_init=10, random_state=0).fit(x.numpy()).inertia_
    assert inertia <= 1.001 * ref


@pytest.mark.parametrize("chunk_size", [None, 7])
def test_nearest_inducing_points_matches_argsort(chunk_size):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(53, 3, generator=gen, dtype=torch.float64)
    u = torch.randn(17, 3, generator=gen, dtype=torch.float64)
    d2, idx = nearest_inducing_points(x, u, 5, chunk_size=chunk_size)
    dist = np.linalg.norm(x.numpy()[:, None, :] - u.numpy()[None], axis=-1)
    ref = np.argsort(dist, axis=1)[:, :5]
    np.testing.assert_array_equal(idx.numpy(), ref)
    np.testing.assert_allclose(
        d2.numpy(), np.take_along_axis(dist, ref, 1) ** 2, rtol=1e-10, atol=1e-12
    )


def test_bad_arguments():
    x = torch.randn(10, 2)
    with pytest.raises(ValueError, match="num_clusters"):
        kmeans_plus_plus(x, 11)
    with pytest.raises(ValueError, match="k must"):
        nearest_inducing_points(x, x[:3], 4)
    with pytest.raises(ValueError, match="share d"):
        nearest_inducing_points(x, torch.randn(3, 3), 1)


def test_keops_neighbours_equal_the_dense_search():
    pytest.importorskip("pykeops", reason="the KeOps search needs pykeops (gpsd[keops])")
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(300, 3, generator=gen, dtype=torch.float64)
    u = torch.randn(40, 3, generator=gen, dtype=torch.float64)
    d_dense, i_dense = nearest_inducing_points(x, u, 6, backend="dense")
    d_keops, i_keops = nearest_inducing_points(x, u, 6, backend="keops")
    torch.testing.assert_close(d_keops, d_dense)
    assert torch.equal(i_keops, i_dense)


def test_neighbour_backend_is_validated():
    with pytest.raises(ValueError, match="backend"):
        nearest_inducing_points(torch.zeros(3, 2), torch.zeros(4, 2), 2, backend="kdtree")


@pytest.mark.parametrize("n", [300, 5000])  # 5000 x 300 products go in row blocks on a CPU
def test_affine_squared_distances_round_once_to_float32(n):
    from gpsd.kernel_distillation._stationary_kernel import affine_squared_distances

    gen = torch.Generator().manual_seed(0)
    x = 100.0 + 10.0 * torch.rand(n, 3, generator=gen)  # far from the origin: hard for ||x||^2
    z = x[:300]
    lengthscale = torch.tensor([0.2, 0.5, 1.0])
    exact = torch.cdist(x.double() / lengthscale.double(), z.double() / lengthscale.double())
    exact = exact.square()  # shape: (n, 300); cdist's differences are exact here in float64
    r2 = affine_squared_distances(x, z, lengthscale)
    assert r2.dtype == torch.float32
    assert float(r2.diagonal().max()) < 1e-12  # the points themselves: float64 rounding only
    off = exact > 0
    rel = ((r2.double() - exact).abs() / exact)[off]
    assert float(rel.max()) < 4 * torch.finfo(torch.float32).eps
    offset = torch.tensor(0.3)
    e = affine_squared_distances(x, z, lengthscale, -0.5, offset)
    torch.testing.assert_close(e.double(), (0.3 - 0.5 * exact), rtol=2e-7, atol=2e-7)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda x: kmeans(x, 3, num_iters=-1), "num_iters must be a non-negative int"),
        (lambda x: kmeans(x, 3, tol=-1.0), "tol must be a finite float >= 0"),
        (lambda x: kmeans(x, 3, chunk_size=0), "chunk_size must be a positive integer or None"),
        (lambda x: kmeans_plus_plus(x, 2.5), "num_clusters must be a positive int"),
        (lambda x: kmeans_plus_plus(x, 0), "num_clusters"),
        (lambda x: nearest_inducing_points(x, x[:3], 1.5), "k must be a positive int"),
        (lambda x: nearest_inducing_points(x, x[:3], 2, chunk_size=-4), "chunk_size"),
    ],
)
def test_integer_arguments_are_checked(call, match):
    # a non-positive chunk size used to return no neighbours at all, silently
    x = torch.randn(10, 2, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    with pytest.raises(ValueError, match=match):
        call(x)


def test_kmeans_with_zero_iterations_is_the_kmeans_plus_plus_start():
    x = _blobs()
    torch.testing.assert_close(kmeans(x, 6, num_iters=0, seed=2), kmeans_plus_plus(x, 6, seed=2))


def test_numpy_and_tensor_integers_count_as_ints():
    x = _blobs()
    want = kmeans_plus_plus(x, 5, seed=1)
    torch.testing.assert_close(kmeans_plus_plus(x, np.int64(5), seed=1), want)
    torch.testing.assert_close(kmeans_plus_plus(x, torch.tensor(5), seed=1), want)
    d2, idx = nearest_inducing_points(x, want, np.int32(2))
    assert idx.shape == (300, 2)


def test_float32_neighbours_of_inputs_far_from_the_origin():
    # Years, say: the uncentred expansion |x|^2 + |z|^2 - 2 x.z loses every digit in float32.
    gen = torch.Generator().manual_seed(0)
    x64 = 2000 + torch.rand(500, 1, generator=gen, dtype=torch.float64)
    u64 = 2000 + torch.linspace(0, 1, 50, dtype=torch.float64).unsqueeze(-1)
    _, idx = nearest_inducing_points(x64.float(), u64.float(), 3)
    # brute force on the float32-rounded values, in float64 with direct differences
    x, u = x64.float().double(), u64.float().double()
    ref = (x.unsqueeze(1) - u.unsqueeze(0)).abs().squeeze(-1)  # shape: (500, 50)
    chosen = ref.gather(-1, idx).max(-1).values
    third = ref.sort(-1).values[:, 2]
    # the chosen 3 are the 3 nearest up to float32 rounding of the distances themselves
    assert torch.all(chosen <= third + 1e-4)
