"""Audit of the student, the neighbour search and K-means against independent computations."""

import gpytorch
import pytest
import torch

from gpsd.kernel_distillation import (
    SparseLowRankStudent,
    kmeans,
    kmeans_plus_plus,
    nearest_inducing_points,
)

DT = torch.float64


def test_float32_kmeans_step_far_from_the_origin_moves_centres_to_the_means():
    # One Lloyd step from the k-means++ start: every centre becomes the mean of the inputs
    # nearest to it. Summing float32 inputs near 2000 lost about 0.25 per addition (clusters of
    # 2000 inputs), which moved the centres by up to 0.018; a float32 ulp there is 1.2e-4.
    gen = torch.Generator().manual_seed(0)
    x = (2000 + torch.rand(20000, 2, generator=gen, dtype=DT)).float()
    start = kmeans_plus_plus(x, 10, seed=0)
    step = kmeans(x, 10, num_iters=1, seed=0)
    # reference: assignment by direct differences and means, in float64, by a loop
    x64, start64 = x.double(), start.double()
    assign = torch.cdist(x64, start64).argmin(-1)
    for j in range(10):
        mean = x64[assign == j].mean(0)
        torch.testing.assert_close(step[j].double(), mean, rtol=0, atol=2.5e-4)


def test_nearest_inducing_points_returns_the_float32_distances_themselves():
    # Inducing points spread over [0, 1000]: the expansion |x|^2 - 2 x.u + |u|^2 errs by about
    # eps * 500^2 = 0.015, and returned 0 for a squared distance of 1e-4 (0.0156 for 4e-4).
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


def test_prediction_module_of_a_generic_kernel_is_differentiable_in_x():
    # the RBF and Matérn students were; a kernel kept as a GPyTorch module gave no gradient
    gen = torch.Generator().manual_seed(1)
    n, m, b = 30, 9, 3
    u = torch.randn(m, 2, generator=gen, dtype=DT)
    idx = torch.stack([torch.randperm(m, generator=gen)[:b] for _ in range(n)])
    values = 0.3 * torch.randn(n, b, generator=gen, dtype=DT)
    y = torch.randn(n, generator=gen, dtype=DT)
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RQKernel()).to(DT)
    student = SparseLowRankStudent.from_sparse_weights(kernel, u, values, idx, y, 0.05)
    assert not student.exportable
    x = torch.randn(4, 2, generator=gen, dtype=DT, requires_grad=True)
    assert torch.autograd.gradcheck(student.prediction_module(), (x,))


@pytest.mark.parametrize("shape", [(5, 5), (1, 5)])
def test_student_refuses_predictive_mean_weights_with_a_batch_dimension(shape):
    # accepted before, and prediction then failed inside an index or a broadcast
    u = torch.randn(5, 2, generator=torch.Generator().manual_seed(0), dtype=DT)
    kernel = gpytorch.kernels.RBFKernel().to(DT)
    with pytest.raises(ValueError, match=r"predictive_mean_weights must have shape \(5,\)"):
        SparseLowRankStudent(
            kernel, u, torch.eye(5, dtype=DT), torch.zeros(shape, dtype=DT),
            torch.eye(5, dtype=DT), sparsity=2, noise=0.1,
        )  # fmt: skip


@pytest.mark.parametrize("tol", [None, "1e-3", True])
def test_kmeans_tol_must_be_a_non_negative_real_number(tol):
    x = torch.randn(20, 2, generator=torch.Generator().manual_seed(0), dtype=DT)
    with pytest.raises(ValueError, match="tol must be a finite float >= 0"):
        kmeans(x, 3, tol=tol)


def _kernels():
    for nu in (0.5, 1.5, 2.5):
        k = gpytorch.kernels.MaternKernel(nu=nu, ard_num_dims=2).to(DT)
        k.lengthscale = torch.tensor([0.7, 1.3], dtype=DT)
        yield k
    k = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RQKernel()).to(DT)
    k.outputscale = 0.7
    yield k


@pytest.mark.parametrize("kernel", list(_kernels()), ids=["m12", "m32", "m52", "rq"])
def test_student_predictions_equal_a_dense_loop(kernel):
    # W with a repeated column in one row, a neighbour metric, a mean constant, no jitter: the
    # mean and variance of the GP with kernel W K_UU W^T, W_* by a b x b solve per test point
    gen = torch.Generator().manual_seed(1)
    n, m, b = 40, 10, 4
    u = torch.randn(m, 2, generator=gen, dtype=DT)
    y = torch.randn(n, generator=gen, dtype=DT)
    idx = torch.stack([torch.randperm(m, generator=gen)[:b] for _ in range(n)])
    idx[0, 1] = idx[0, 0]
    values = 0.3 * torch.randn(n, b, generator=gen, dtype=DT)
    scale = torch.tensor([0.7, 1.3], dtype=DT)
    student = SparseLowRankStudent.from_sparse_weights(
        kernel, u, values, idx, y, 0.05, mean_constant=-0.4, jitter=0.0, neighbour_scale=scale
    )
    test_x = 1.5 * torch.randn(6, 2, generator=gen, dtype=DT)

    def k(a, c):
        with torch.no_grad():
            return float(kernel(a.unsqueeze(0), c.unsqueeze(0)).to_dense())

    kuu = torch.tensor([[k(u[i], u[j]) for j in range(m)] for i in range(m)], dtype=DT)
    w = torch.zeros(n, m, dtype=DT)
    for i in range(n):
        for j in range(b):
            w[i, idx[i, j]] += values[i, j]
    w_star = torch.zeros(6, m, dtype=DT)
    for p in range(6):
        dist = [float((((test_x[p] - u[q]) / scale) ** 2).sum()) for q in range(m)]
        near = sorted(range(m), key=dist.__getitem__)[:b]
        rhs = torch.tensor([k(test_x[p], u[q]) for q in near], dtype=DT)
        w_star[p, near] = torch.linalg.solve(kuu[near][:, near], rhs)
    system = w @ kuu @ w.T + 0.05 * torch.eye(n, dtype=DT)
    cross = w_star @ kuu @ w.T  # shape: (6, n)
    mean = -0.4 + cross @ torch.linalg.solve(system, y + 0.4)
    prior = torch.tensor([k(t, t) for t in test_x], dtype=DT)
    var = prior - (cross * torch.linalg.solve(system, cross.T).T).sum(-1)
    got_mean, got_var = student.predict(test_x)
    torch.testing.assert_close(got_mean, mean, rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(got_var, var, rtol=1e-9, atol=1e-11)
