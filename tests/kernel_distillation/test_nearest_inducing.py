"""Tests of nearest_inducing_points against brute-force searches."""

import numpy as np
import pytest
import torch
from kd_reference import (
    DT,
)

from gpsd.kernel_distillation import (
    nearest_inducing_points,
)


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


def test_nearest_inducing_points_returns_the_float32_distances_themselves():
    # Inducing points spread over [0, 1000]: the expansion |x|^2 - 2 x.u + |u|^2 errs by about
    # eps * 500^2 = 0.015, and gives 0 for a squared distance of 1e-4 (0.0156 for 4e-4).
    u = torch.arange(0.0, 1001.0).unsqueeze(-1)
    x = torch.tensor([[999.01], [0.02], [500.03]])
    d2, idx = nearest_inducing_points(x, u, 3)
    assert d2.dtype == torch.float32
    exact = torch.zeros(3, 1001, dtype=DT)
    for i in range(3):
        for j in range(1001):
            exact[i, j] = (float(x[i, 0]) - float(u[j, 0])) ** 2
    want, order = exact.sort(-1)
    torch.testing.assert_close(idx, order[:, :3])
    torch.testing.assert_close(d2.double(), want[:, :3], rtol=2.5e-7, atol=0.0)


def test_nearest_inducing_points_distances_and_order_match_a_loop_at_random():
    gen = torch.Generator().manual_seed(2)
    u = (1000 * torch.rand(300, 1, generator=gen, dtype=DT)).float()
    x = (1000 * torch.rand(200, 1, generator=gen, dtype=DT)).float()
    d2, idx = nearest_inducing_points(x, u, 5, chunk_size=64)
    chosen = (x.double() - u.double()[idx].squeeze(-1)) ** 2  # shape: (200, 5)
    torch.testing.assert_close(d2.double(), chosen, rtol=2.5e-7, atol=0.0)
    assert bool((d2[:, 1:] >= d2[:, :-1]).all())  # nearest first


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


def test_nearest_inducing_points_takes_arrays():
    gen = np.random.default_rng(0)
    x, u = gen.normal(size=(30, 2)), gen.normal(size=(6, 2))
    distances, indices = nearest_inducing_points(x, u, 2)
    # an independent brute-force search
    brute = ((x[:, None, :] - u[None, :, :]) ** 2).sum(-1)
    expected = np.argsort(brute, axis=1)[:, :2]
    np.testing.assert_array_equal(indices.numpy(), expected)
    np.testing.assert_allclose(
        distances.numpy(), np.take_along_axis(brute, expected, 1), rtol=1e-12
    )


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


@pytest.mark.parametrize("where", ["inducing_points", "x"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nearest_inducing_points_rejects_non_finite_inputs(where, bad):
    # One NaN inducing point made every distance NaN (through the centring), so every query got
    # the same arbitrary neighbours; a NaN query got arbitrary neighbours. Both passed silently.
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(10, 2, generator=gen, dtype=DT)
    u = torch.randn(5, 2, generator=gen, dtype=DT)
    if where == "x":
        x[3, 1] = bad
    else:
        u[2, 0] = bad
    with pytest.raises(ValueError, match=f"{where} must be finite"):
        nearest_inducing_points(x, u, 2)


def test_nearest_inducing_points_names_a_dtype_mismatch():
    x = torch.randn(10, 2, dtype=DT)
    with pytest.raises(ValueError, match="x and inducing_points must share a floating-point dtype"):
        nearest_inducing_points(x, x[:4].float(), 2)


def test_bad_arguments_are_named():
    x = torch.randn(10, 2)
    with pytest.raises(ValueError, match="k must"):
        nearest_inducing_points(x, x[:3], 4)
    with pytest.raises(ValueError, match="share d"):
        nearest_inducing_points(x, torch.randn(3, 3), 1)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda x: nearest_inducing_points(x, x[:3], 1.5), "k must be a positive int"),
        (lambda x: nearest_inducing_points(x, x[:3], 2, chunk_size=-4), "chunk_size"),
    ],
)
def test_integer_arguments_are_checked(call, match):
    # a non-positive chunk size must not return no neighbours at all, silently
    x = torch.randn(10, 2, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    with pytest.raises(ValueError, match=match):
        call(x)


def test_numpy_integers_count_as_ints():
    x = torch.randn(30, 2, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    d2, idx = nearest_inducing_points(x, x[:5], np.int32(2))
    assert idx.shape == d2.shape == (30, 2)
    torch.testing.assert_close(idx, nearest_inducing_points(x, x[:5], 2)[1])
