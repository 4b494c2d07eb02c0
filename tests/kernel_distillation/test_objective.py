"""Tests of the objective of kernel distillation on its own, on tiny problems built by hand
(random inducing points and sparsity pattern, no K-means): its value and gradient against a
dense formula and autograd, the least-squares start and the block direction against numpy's
lstsq row by row, the line search against the dense objective along the direction, and the
descent against steps written out densely."""

import numpy as np
import pytest
import torch
from kd_reference import DT, ard_kernel

from gpsd.kernel_distillation._objective import SparseKernelObjective, _SparseRows

N, M, B, D = 30, 8, 3, 2


def _problem(chunk_size=None, seed=0):
    """A kernel, inputs, inducing points and a random sorted pattern, and the objective."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=gen, dtype=DT)
    u = torch.randn(M, D, generator=gen, dtype=DT)
    idx = torch.stack([torch.randperm(M, generator=gen)[:B] for _ in range(N)]).sort(-1).values
    kernel = ard_kernel(D)
    objective = SparseKernelObjective(kernel, x, u, idx, chunk_size=chunk_size)
    values = torch.randn(N, B, generator=gen, dtype=DT) / B
    return objective, kernel, x, u, idx, values


def _dense(kernel, x, u, idx, values):
    """K_XX, K_UU and W formed densely (W by a loop over its non-zeros)."""
    with torch.no_grad():
        k_xx, k_uu = kernel(x).to_dense(), kernel(u).to_dense()
    w = torch.zeros(N, M, dtype=DT)
    for i in range(N):
        for j in range(B):
            w[i, idx[i, j]] = values[i, j]
    return k_xx, k_uu, w


def test_sparse_pattern_products_match_dense_scatter():
    # column 3 of W has no non-zero and column 0 several: the CSR row pointers of W^T must say so
    indices = torch.tensor([[0, 2], [0, 4], [1, 4], [0, 5], [2, 5]])
    values = torch.arange(1.0, 11.0, dtype=DT).reshape(5, 2)
    pattern = _SparseRows(indices, 6)
    dense = torch.zeros(5, 6, dtype=DT)
    for i in range(5):
        for j in range(2):
            dense[i, indices[i, j]] = values[i, j]
    rhs = torch.randn(6, 3, dtype=DT)
    torch.testing.assert_close(pattern.matrix(values) @ rhs, dense @ rhs, rtol=0, atol=0)
    rhs_t = torch.randn(5, 4, dtype=DT)
    torch.testing.assert_close(pattern.transpose(values) @ rhs_t, dense.T @ rhs_t)
    torch.testing.assert_close(pattern.dense(values), dense, rtol=0, atol=0)


@pytest.mark.parametrize("chunk_size", [None, 1, 7])
def test_objective_and_gradient_equal_the_dense_formula_and_autograd(chunk_size):
    objective, kernel, x, u, idx, values = _problem(chunk_size)
    value, grad = objective.objective_and_gradient(values)
    k_xx, k_uu, w = _dense(kernel, x, u, idx, values)
    w.requires_grad_(True)
    dense = (k_xx - w @ k_uu @ w.T).pow(2).sum()
    (dense_grad,) = torch.autograd.grad(dense, w)
    torch.testing.assert_close(value, dense.detach(), rtol=1e-12, atol=0)
    torch.testing.assert_close(grad, dense_grad.gather(-1, idx), rtol=1e-10, atol=1e-12)
    alone, none = objective.objective_and_gradient(values, gradient=False)
    assert none is None
    torch.testing.assert_close(alone, value, rtol=1e-14, atol=0)
    assert objective.frobenius_error(values) == pytest.approx(float(dense.detach()) ** 0.5)
    torch.testing.assert_close(objective.dense_weights(values), w.detach(), rtol=0, atol=0)


def test_gradient_matches_central_finite_differences():
    objective, _, _, _, _, values = _problem(chunk_size=4)
    _, grad = objective.objective_and_gradient(values)
    h = 1e-6
    for i, j in [(0, 0), (7, 2), (29, 1)]:
        up, down = values.clone(), values.clone()
        up[i, j] += h
        down[i, j] -= h
        f_up = objective.objective_and_gradient(up, gradient=False)[0]
        f_down = objective.objective_and_gradient(down, gradient=False)[0]
        assert float(grad[i, j]) == pytest.approx(float(f_up - f_down) / (2 * h), rel=1e-6)


def test_least_squares_start_equals_lstsq_row_by_row():
    objective, kernel, x, u, idx, _ = _problem()
    start = objective.least_squares_weights()
    with torch.no_grad():
        k_xu, k_uu = kernel(x, u).to_dense().numpy(), kernel(u).to_dense().numpy()
    for i in range(N):
        j = idx[i].numpy()
        ref = np.linalg.lstsq(k_uu[j].T, k_xu[i], rcond=None)[0]
        np.testing.assert_allclose(start[i].numpy(), ref, rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(objective.inducing_covariance, torch.from_numpy(k_uu))


def test_least_squares_reports_every_block_of_rows(monkeypatch):
    from gpsd.kernel_distillation import _objective

    monkeypatch.setattr(_objective, "_CHUNK_ELEMENTS", 12 * M * B)  # blocks of 12 rows

    class Report:
        def __init__(self):
            self.seen = []

        def update(self, number, **info):
            self.seen.append((number, info["rows"]))

    objective = _problem()[0]
    report = Report()
    blocked = objective.least_squares_weights(report)
    assert report.seen == [(1, 12), (2, 12), (3, 6)]
    monkeypatch.setattr(_objective, "_CHUNK_ELEMENTS", 2**22)
    torch.testing.assert_close(blocked, _problem()[0].least_squares_weights())


def test_block_direction_is_the_row_wise_least_squares_step_with_the_right_factor_fixed():
    objective, kernel, x, u, idx, values = _problem()
    _, grad = objective.objective_and_gradient(values)
    direction = objective.block_direction(values, grad)
    k_xx, k_uu, w = _dense(kernel, x, u, idx, values)
    right = (k_uu @ w.T).numpy()  # shape: (m, n)
    for i in range(N):
        j = idx[i].numpy()
        ref = np.linalg.lstsq(right[j].T, k_xx[i].numpy(), rcond=None)[0]
        np.testing.assert_allclose((values - direction)[i].numpy(), ref, rtol=1e-7, atol=1e-9)
    with pytest.raises(ValueError, match=r"gradient must be a tensor of shape \(30, 3\)"):
        objective.block_direction(values, grad[:2])


def test_line_search_finds_the_first_minimum_of_the_dense_objective_along_the_direction():
    objective, kernel, x, u, idx, values = _problem(chunk_size=5)
    _, grad = objective.objective_and_gradient(values)
    t, f_t = objective.line_search(values, grad)
    k_xx, k_uu, _ = _dense(kernel, x, u, idx, values)

    def f(s):
        w = _dense(kernel, x, u, idx, values - s * grad)[2]
        return float((k_xx - w @ k_uu @ w.T).pow(2).sum())

    assert t > 0
    assert f_t == pytest.approx(f(t), rel=1e-9)
    # a minimum: the dense objective's central difference vanishes there, and it decreases
    # all the way from 0 to t
    h = 1e-6 * t
    assert abs(f(t + h) - f(t - h)) / (2 * h) <= 1e-5 * f(0.0) / t
    grid = [f(s) for s in np.linspace(0.0, t, 9)]
    assert all(b <= a for a, b in zip(grid, grid[1:], strict=False))
    # an ascent direction takes no step
    zero, f_zero = objective.line_search(values, -grad)
    assert zero == 0.0 and f_zero == pytest.approx(f(0.0), rel=1e-9)


def test_fixed_steps_of_the_descent_are_the_dense_gradient_steps():
    objective, kernel, x, u, idx, values = _problem()
    reached, errors = objective.descend(values, 2, lr=1e-3, descent="gradient")
    k_xx, k_uu, _ = _dense(kernel, x, u, idx, values)
    w = _dense(kernel, x, u, idx, values)[2]
    mask = w != 0
    expected_errors = []
    for _ in range(2):
        w = w.detach().requires_grad_(True)
        loss = (k_xx - w @ k_uu @ w.T).pow(2).sum()
        (g,) = torch.autograd.grad(loss, w)
        expected_errors.append(float(loss.detach()) ** 0.5)
        w = w.detach() - 1e-3 * g * mask
    expected_errors.append(float((k_xx - w @ k_uu @ w.T).pow(2).sum()) ** 0.5)
    torch.testing.assert_close(reached, w.gather(-1, idx), rtol=1e-10, atol=1e-12)
    assert errors == pytest.approx(expected_errors, rel=1e-10)


def test_a_report_asking_to_stop_ends_the_descent_after_that_iteration():
    objective, _, _, _, _, values = _problem()

    class StopAt:
        def __init__(self, iteration):
            self.iteration, self.seen = iteration, []

        def update(self, iteration, loss):
            self.seen.append((iteration, loss))
            return iteration == self.iteration

    report = StopAt(2)
    reached, errors = objective.descend(values, 5, report=report)
    assert [i for i, _ in report.seen] == [1, 2] and len(errors) == 3
    two, two_errors = objective.descend(values, 2)
    torch.testing.assert_close(reached, two, rtol=0, atol=0)
    assert errors == two_errors
    assert [loss for _, loss in report.seen] == errors[1:]


def test_a_diverging_fixed_step_is_named():
    objective, _, _, _, _, values = _problem()
    with pytest.raises(RuntimeError, match="diverged at iteration .*lr=1e\\+150 is too large"):
        objective.descend(values, 3, lr=1e150, descent="gradient")
