"""Tests of KernelDistillation: the least-squares start, the objective, its gradient and the
line search against dense references, the descent with fit, progress and callbacks, the
teachers it accepts, the arguments it checks, and its state_dict and .to() round trips."""

import copy
import warnings

import gpytorch
import numpy as np
import pytest
import torch
from conftest import requires_cuda
from kd_reference import (
    DT,
    LINE_X,
    Teacher,
    ard_kernel,
    dense_unit_rbf,
    iso_kernel,
    line_distiller,
    mean_and_variance,
    offset_data,
    reference_data,
    reference_distiller,
    scaled_rbf,
    sine_data,
    teacher_predictions,
    unit_rbf,
)

import gpsd
from gpsd.kernel_distillation import (
    KernelDistillation,
    SparseLowRankStudent,
    kmeans,
)


def _dense_objective(kd, values):
    x = kd.train_x
    k_xx = kd.covar_module(x, x).to_dense().detach()
    w = torch.zeros(x.shape[0], kd.num_inducing, dtype=DT).scatter(-1, kd.neighbour_indices, values)
    return (k_xx - w @ kd.inducing_covariance @ w.T).pow(2).sum()


def test_least_squares_init_equals_per_row_lstsq():
    kd = reference_distiller()
    kd.prepare()
    k_xu = kd.covar_module(kd.train_x, kd.inducing_points).to_dense().detach().numpy()
    kuu = kd.inducing_covariance.numpy()
    for i in range(kd.train_x.shape[0]):
        j = kd.neighbour_indices[i].numpy()
        ref = np.linalg.lstsq(kuu[j].T, k_xu[i], rcond=None)[0]
        np.testing.assert_allclose(kd.initial_weight_values[i].numpy(), ref, rtol=1e-6, atol=1e-8)


def test_float32_least_squares_init_is_the_exact_solution_of_an_ill_conditioned_problem():
    # lengthscale 1 on [0, 10]^2 with 300 inducing points: K_UU(J_i, :) has condition 1e4 to 1e6,
    # whose normal equations float32 cannot factorise; the reference is numpy's float64 lstsq of
    # the same (float32-rounded) problem, row by row: RBF entries exp(log s - r^2 / 2) with the
    # exponent formed in float64 and rounded to float32 (the distiller's documented evaluation)
    gen = torch.Generator().manual_seed(3)
    x = 10 * torch.rand(400, 2, generator=gen)
    y = torch.sin(x).sum(-1)
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())
    kernel.base_kernel.lengthscale = 1.0
    kd = KernelDistillation.from_data(
        x, y, kernel, noise=0.1, num_inducing=300, sparsity=30, max_iter=0
    )
    kd.prepare()
    assert kd.initial_weight_values.dtype == torch.float32
    r2 = torch.cdist(x.double(), kd.inducing_points.double()).square()
    log_scale = kernel.outputscale.detach().log().double()
    k_xu = torch.exp((log_scale - 0.5 * r2).float()).double().numpy()
    kuu = kd.inducing_covariance.double().numpy()
    conditions, errors = [], []
    for i in range(0, 400, 7):
        design = kuu[kd.neighbour_indices[i].numpy()].T  # shape: (m, b)
        conditions.append(np.linalg.cond(design))
        ref = np.linalg.lstsq(design, k_xu[i], rcond=None)[0]
        got = kd.initial_weight_values[i].double().numpy()
        errors.append(np.abs(got - ref).max() / np.abs(ref).max())
    assert np.median(conditions) > 1e4  # float32 normal equations would fail on these rows
    assert max(errors) < 1e-5  # float32 rounding of the result (a float32 SVD solve: up to 1)


def test_least_squares_init_handles_rank_deficient_rows_like_lstsq():
    x, y = reference_data(40)
    u = torch.cat([x[:6], x[:2]])  # two duplicated inducing points: K_UU(J, :) can be singular
    kd = KernelDistillation.from_data(
        x, y, ard_kernel(), noise=0.05, num_inducing=8, sparsity=4, max_iter=0, inducing_points=u
    )
    kd.prepare()
    k_xu = kd.covar_module(x, u).to_dense().detach().numpy()
    kuu = kd.inducing_covariance.numpy()
    for i in range(40):
        j = kd.neighbour_indices[i].numpy()
        ref = np.linalg.lstsq(kuu[j].T, k_xu[i], rcond=None)[0]  # minimum-norm solution
        np.testing.assert_allclose(kd.initial_weight_values[i].numpy(), ref, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize(
    ("n", "span", "lengthscale", "m", "b", "seed"),
    [(200, 5, 0.8, 40, 8, 0), (1000, 20, 1.0, 100, 10, 3)],
)
def test_least_squares_start_matches_lstsq_on_ill_conditioned_rows(
    n, span, lengthscale, m, b, seed
):
    # lengthscales several times the spacing of the inducing points: rows with cond(K_UU(J, :))
    # about 2e8, which pass a Cholesky-diagonal test while their normal-equation solutions have
    # residuals up to 4.1e-4 against 2.7e-11 from lstsq (max |w| 7503 against 5.0); such a
    # start errs by 1.2e-2 against 4.6e-7 from the lstsq start (1000 inputs, m = 100: 55 rows,
    # 2.0e-4 against 1.7e-6)
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 1, generator=gen, dtype=DT) * span
    kernel = unit_rbf(lengthscale)
    kd = KernelDistillation.from_data(
        x, torch.sin(x[:, 0]), kernel, noise=1e-2, num_inducing=m, sparsity=b
    )
    kd.prepare()
    kuu = dense_unit_rbf(kd.inducing_points, kd.inducing_points, lengthscale).numpy()
    rhs = dense_unit_rbf(x, kd.inducing_points, lengthscale).numpy()
    idx = kd.neighbour_indices.numpy()
    ref = np.stack(
        [np.linalg.lstsq(kuu[j].T, r, rcond=None)[0] for j, r in zip(idx, rhs, strict=True)]
    )
    ref_resid = np.linalg.norm(np.einsum("nb,nbm->nm", ref, kuu[idx]) - rhs, axis=1)
    got = kd.initial_weight_values.numpy()
    got_resid = np.linalg.norm(np.einsum("nb,nbm->nm", got, kuu[idx]) - rhs, axis=1)
    assert np.all(got_resid <= 2 * ref_resid + 1e-14)
    assert kd.frobenius_error() <= 1.01 * kd.frobenius_error(torch.from_numpy(ref))


def test_inspection_before_fit_prepares_the_least_squares_start():
    kd = reference_distiller(n=60, m=10, b=3)
    w = kd.dense_weights()  # prepares on first use
    assert w.shape == (60, 10) and int((w != 0).sum(-1).max()) <= 3
    kd2 = reference_distiller(n=60, m=10, b=3)
    error = kd2.frobenius_error()  # prepares on first use, too
    # independent: the dense residual of the row-wise least-squares start
    x = kd2.train_x
    k_xx = kd2.covar_module(x, x).to_dense().detach()
    kuu = kd2.covar_module(kd2.inducing_points, kd2.inducing_points).to_dense().detach()
    w2 = torch.zeros(60, 10, dtype=DT)
    for i in range(60):
        j = kd2.neighbour_indices[i]
        k_iu = kd2.covar_module(x[i : i + 1], kd2.inducing_points).to_dense().detach().squeeze(0)
        w2[i, j] = torch.linalg.lstsq(kuu[j].T, k_iu.unsqueeze(-1)).solution.squeeze(-1)
    torch.testing.assert_close(w, w2, rtol=1e-7, atol=1e-9)
    want = float(torch.linalg.matrix_norm(k_xx - w2 @ kuu @ w2.T))
    assert error == pytest.approx(want, rel=1e-8)


def test_gradient_equals_autograd_on_the_pattern():
    kd = reference_distiller()
    kd.prepare()
    values = kd.weight_values + 0.01 * torch.randn_like(kd.weight_values)
    obj, grad = kd.objective_and_gradient(values)
    ref_obj = _dense_objective(kd, values)
    # autograd of the dense objective w.r.t. a dense W, restricted to the sparsity pattern
    w_dense = kd.dense_weights(values).requires_grad_(True)
    k_xx = kd.covar_module(kd.train_x, kd.train_x).to_dense().detach()
    loss = (k_xx - w_dense @ kd.inducing_covariance @ w_dense.T).pow(2).sum()
    (g_dense,) = torch.autograd.grad(loss, w_dense)
    torch.testing.assert_close(obj, ref_obj, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(
        grad, g_dense.gather(-1, kd.neighbour_indices), rtol=1e-8, atol=1e-10
    )


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_short_lengthscale_objective_and_gradient_match_a_float64_reference(dtype):
    # lengthscale 0.1 on [0, 10]^2: most kernel entries lie below the smallest normal number,
    # and the distiller drops those below eps^2 * max before its products
    gen = torch.Generator().manual_seed(3)
    x = 10 * torch.rand(300, 2, generator=gen, dtype=DT)
    y = torch.randn(300, generator=gen, dtype=DT)
    kernel = gpytorch.kernels.RBFKernel().to(dtype)
    kernel.lengthscale = torch.tensor(0.1, dtype=dtype)
    kd = KernelDistillation.from_data(
        x.to(dtype), y.to(dtype), kernel, noise=0.05, num_inducing=60, sparsity=6, chunk_size=64
    )
    kd.prepare()
    values = kd.weight_values + 0.01 * torch.randn(kd.weight_values.shape, generator=gen).to(dtype)
    obj, grad = kd.objective_and_gradient(values)
    # reference: float64 kernel from squared distances, dense W, autograd
    k_xx = torch.exp(-0.5 * torch.cdist(x, x).square() / 0.01)
    tiny = torch.finfo(dtype).tiny
    assert bool(((k_xx > 0) & (k_xx < tiny)).any())  # the case this test is about
    u = kd.inducing_points.to(DT)
    k_uu = torch.exp(-0.5 * torch.cdist(u, u).square() / 0.01)
    w = kd.dense_weights(values).to(DT).requires_grad_(True)
    ref = (k_xx - w @ k_uu @ w.T).pow(2).sum()
    (ref_grad,) = torch.autograd.grad(ref, w)
    rtol = 1e-9 if dtype == torch.float64 else 5e-5  # float32: inputs rounded, about 5e-6
    assert float(obj) == pytest.approx(float(ref.detach()), rel=rtol)
    scale = ref_grad.abs().max()
    torch.testing.assert_close(
        grad.to(DT), ref_grad.gather(-1, kd.neighbour_indices), rtol=0, atol=rtol * float(scale)
    )


@pytest.mark.parametrize("nu", [None, 0.5, 1.5, 2.5])
def test_float32_objective_and_gradient_carry_float32_rounding_only(nu):
    # short ARD lengthscales on [0, 10]^2: GPyTorch's float32 blocks K(X, X_cols), with r^2 from
    # ||x||^2 + ||z||^2 - 2 x^T z, put errors of 1e-4 (RBF) to 1e-2 (Matern-1/2, through the
    # square root near r = 0) into this gradient; the reference is float64 throughout, on the
    # same float32 inputs, inducing points and weights
    base = (
        gpytorch.kernels.RBFKernel(ard_num_dims=2)
        if nu is None
        else gpytorch.kernels.MaternKernel(nu=nu, ard_num_dims=2)
    )
    kernel = gpytorch.kernels.ScaleKernel(base)
    kernel.base_kernel.lengthscale = torch.tensor([0.15, 0.25])
    kernel.outputscale = 2.0
    gen = torch.Generator().manual_seed(5)
    x = 10 * torch.rand(400, 2, generator=gen)
    y = torch.randn(400, generator=gen)
    kd = KernelDistillation.from_data(
        x, y, kernel, noise=0.05, num_inducing=80, sparsity=8, chunk_size=50
    )
    kd.prepare()
    values = kd.weight_values + 0.01 * torch.randn(kd.weight_values.shape, generator=gen)
    obj, grad = kd.objective_and_gradient(values)
    kernel64 = kernel.double()
    with torch.no_grad():
        k_xx = kernel64(x.double()).to_dense()
        k_uu = kernel64(kd.inducing_points.double()).to_dense()
    w = kd.dense_weights(values).double().requires_grad_(True)
    ref = (k_xx - w @ k_uu @ w.T).pow(2).sum()
    (ref_grad,) = torch.autograd.grad(ref, w)
    assert float(obj) == pytest.approx(float(ref.detach()), rel=1e-6)
    ref_grad = ref_grad.gather(-1, kd.neighbour_indices)
    scale = float(ref_grad.abs().max())
    torch.testing.assert_close(grad.double(), ref_grad, rtol=0, atol=5e-6 * scale)


@pytest.mark.parametrize("chunk_size", [1, 7, 1000])
def test_chunked_and_unchunked_paths_agree(chunk_size):
    ref = reference_distiller(chunk_size=10_000)
    ref.prepare()
    kd = reference_distiller(chunk_size=chunk_size)
    kd.prepare()
    torch.testing.assert_close(kd.initial_weight_values, ref.initial_weight_values)
    values = ref.weight_values + 0.01 * torch.randn_like(ref.weight_values)
    o1, g1 = ref.objective_and_gradient(values)
    o2, g2 = kd.objective_and_gradient(values)
    torch.testing.assert_close(o1, o2, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(g1, g2, rtol=1e-10, atol=1e-12)
    d = torch.randn_like(values)
    t1, f1 = ref._objective().line_search(values, d)
    t2, f2 = kd._objective().line_search(values, d)
    assert t1 == pytest.approx(t2, rel=1e-8) and f1 == pytest.approx(f2, rel=1e-8)
    assert ref.frobenius_error(values) == pytest.approx(
        float(_dense_objective(ref, values).sqrt()), rel=1e-10
    )


def test_line_search_minimises_the_quartic():
    kd = reference_distiller()
    kd.prepare()
    _, grad = kd.objective_and_gradient(kd.weight_values)
    t, f_t = kd._objective().line_search(kd.weight_values, grad)
    f = lambda s: float(_dense_objective(kd, kd.weight_values - s * grad))  # noqa: E731
    assert t > 0
    assert f_t == pytest.approx(f(t), rel=1e-8)
    assert f(t) <= min(f(0.5 * t), f(1.5 * t), f(0.0))


def test_block_direction_is_the_per_row_least_squares_step_with_the_right_factor_fixed():
    # independent: for each row i, numpy's lstsq of min_beta ||K(i,:) - beta A(J_i,:)|| with
    # A = K_UU W^T formed densely; one alternating step is W - D
    kd = reference_distiller(max_iter=0)
    kd.prepare()
    values = kd.initial_weight_values + 0.01 * torch.randn(
        kd.initial_weight_values.shape, generator=torch.Generator().manual_seed(1), dtype=DT
    )
    _, grad = kd.objective_and_gradient(values)
    direction = kd.block_direction(values, grad)
    k_xx = kd.covar_module(kd.train_x).to_dense().detach().numpy()
    right = (kd.inducing_covariance @ kd.dense_weights(values).T).numpy()  # shape: (m, n)
    for i in range(kd.train_x.shape[0]):
        j = kd.neighbour_indices[i].numpy()
        ref = np.linalg.lstsq(right[j].T, k_xx[i], rcond=None)[0]
        np.testing.assert_allclose((values - direction)[i].numpy(), ref, rtol=1e-6, atol=1e-9)


def test_block_direction_names_a_badly_shaped_argument():
    kd = reference_distiller()
    kd.prepare()
    good = kd.initial_weight_values
    with pytest.raises(ValueError, match=r"gradient must be a tensor of shape \(120, 5\)"):
        kd.block_direction(good, good[:3])
    with pytest.raises(ValueError, match="values must be a tensor"):
        kd.block_direction(good.tolist(), good)


def test_block_descent_is_monotone_and_lowers_the_error_more_than_the_gradient():
    block = reference_distiller(max_iter=5).fit()
    gradient = reference_distiller(max_iter=5, descent="gradient").fit()
    assert block.descent == "block" and gradient.descent == "gradient"
    errs = block.frobenius_errors
    assert all(b <= a * (1 + 1e-12) for a, b in zip(errs, errs[1:], strict=False))
    assert errs[0] == pytest.approx(gradient.frobenius_errors[0], rel=1e-12)
    # the same start; independently, the final errors from dense residuals
    for kd in (block, gradient):
        assert kd.frobenius_errors[-1] ** 2 == pytest.approx(
            float(_dense_objective(kd, kd.weight_values)), rel=1e-9
        )
    assert errs[-1] < gradient.frobenius_errors[-1]


def test_by_default_fit_keeps_the_least_squares_start_and_reports_its_error():
    kd = reference_distiller().fit()
    assert kd.max_iter == 0
    torch.testing.assert_close(kd.weight_values, kd.initial_weight_values, rtol=0, atol=0)
    assert len(kd.frobenius_errors) == 1
    assert kd.frobenius_errors[0] ** 2 == pytest.approx(
        float(_dense_objective(kd, kd.initial_weight_values)), rel=1e-9
    )


def test_fixed_steps_and_optimizers_descend_along_the_gradient():
    assert reference_distiller(lr=1e-4).descent == "gradient"
    assert reference_distiller(optimizer=lambda p: torch.optim.SGD(p, lr=1e-4)).descent == (
        "gradient"
    )
    with pytest.raises(ValueError, match="descent='block' takes the exact line search"):
        reference_distiller(lr=1e-4, descent="block")


def test_line_search_does_not_jump_to_the_mirror_image_of_w():
    # ten copies of one input: K_XX = W K_UU W^T holds exactly and the exact line search went on
    # to the global minimum of the quartic at -W (the objective is even in W, the student is
    # not): the student predicted a mean of -4.436 where the exact GP gives +4.436
    x = torch.tensor([[0.3, -0.2]], dtype=DT).repeat(10, 1)
    y = torch.arange(10, dtype=DT)
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).to(DT)
    kd = KernelDistillation.from_data(
        x, y, kernel, noise=0.1, num_inducing=3, sparsity=2, max_iter=5
    )
    student = kd.fit().student
    test_x = torch.tensor([[0.3, -0.2], [0.8, 0.4]], dtype=DT)
    with torch.no_grad():
        system = kernel(x).to_dense() + 0.1 * torch.eye(10, dtype=DT)
        cross = kernel(test_x, x).to_dense()
        mean = cross @ torch.linalg.solve(system, y)
        explained = (cross * torch.linalg.solve(system, cross.T).T).sum(-1)
        variance = kernel(test_x, diag=True) - explained
    prediction = student.predict(test_x)
    got_mean, got_variance = prediction.mean, prediction.variance
    torch.testing.assert_close(got_mean, mean, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_variance, variance, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"lr": 1e-4}, {"optimizer": lambda p: torch.optim.Adam(p, lr=1e-3)}],
    ids=["line-search", "fixed-step", "adam"],
)
def test_objective_decreases(kwargs):
    seen = []
    kd = reference_distiller(max_iter=6, **kwargs)
    assert kd.fit(callback=seen.append) is kd
    errs = kd.frobenius_errors
    descent = [r for r in seen if r.phase == "descent"]
    assert len(errs) == 7 and [r.iteration for r in descent] == list(range(1, 7))
    assert errs[-1] < errs[0]
    if not kwargs:  # exact line search is monotone
        assert all(b <= a * (1 + 1e-12) for a, b in zip(errs, errs[1:], strict=False))


@pytest.mark.parametrize("kwargs", [{}, {"lr": 1e-3}])
def test_callback_reports_the_error_after_each_iteration(kwargs):
    x, y = sine_data()
    seen = []
    kd = KernelDistillation.from_data(
        x, y, iso_kernel(), noise=0.05, num_inducing=10, sparsity=3, max_iter=3, **kwargs
    )
    kd.fit(callback=seen.append)
    seen = [r for r in seen if r.phase == "descent"]
    assert [r.iteration for r in seen] == [1, 2, 3]
    assert all(r.task == "KernelDistillation.fit" and r.total == 3 for r in seen)
    assert [r.loss for r in seen] == kd.frobenius_errors[1:]
    # independently: the error of the final W from a dense residual
    k = iso_kernel()
    w = kd.dense_weights()
    with torch.no_grad():
        dense = torch.linalg.matrix_norm(
            k(x).to_dense() - w @ k(kd.inducing_points).to_dense() @ w.T
        )
    assert seen[-1].loss == pytest.approx(float(dense), rel=1e-10)


@pytest.mark.parametrize("kwargs", [{}, {"lr": 1e-4}])
def test_a_callback_returning_true_stops_after_that_iteration_and_keeps_its_w(kwargs):
    seen = []
    kd = reference_distiller(max_iter=10, **kwargs)
    kd.prepare()
    kd.fit(callback=lambda record: seen.append(record) or record.iteration == 2)
    assert [r.iteration for r in seen] == [1, 2]
    assert len(kd.frobenius_errors) == 3  # the start and iterations 1 and 2
    # the W kept is the one after two iterations: two iterations without a callback reach it
    two = reference_distiller(max_iter=2, **kwargs).fit()
    torch.testing.assert_close(kd.weight_values, two.weight_values, rtol=0, atol=0)
    assert kd.frobenius_errors == two.frobenius_errors
    assert kd.frobenius_error() == pytest.approx(kd.frobenius_errors[-1], rel=1e-12)
    test_x = torch.randn(5, 2, dtype=DT)
    torch.testing.assert_close(
        kd.student.predict(test_x).mean, two.student.predict(test_x).mean, rtol=0, atol=0
    )


def test_fit_reports_every_phase_of_the_preparation_and_then_the_descent(monkeypatch):
    from gpsd.kernel_distillation import _objective

    # 120 rows of 20 x 5 in blocks of 50 rows: three blocks of least squares (50, 50, 20)
    monkeypatch.setattr(_objective, "_CHUNK_ELEMENTS", 50 * 20 * 5)
    records = []
    kd = reference_distiller(max_iter=2, kmeans_max_iter=3).fit(callback=records.append)
    assert {r.task for r in records} == {"KernelDistillation.fit"}
    phases = [(r.phase, r.iteration, r.total) for r in records]
    kmeans_records = [r for r in records if r.phase == "k-means"]
    assert phases == [
        *[("k-means", i, 3) for i in range(1, len(kmeans_records) + 1)],
        ("neighbours", 1, 1),
        ("least squares", 1, 3),
        ("least squares", 2, 3),
        ("least squares", 3, 3),
        ("descent", 1, 2),
        ("descent", 2, 2),
    ]
    # the K-means phase reports the iterations K-means itself runs on the scaled inputs
    direct = []
    kmeans(kd.train_x / kd.neighbour_scale, 20, max_iter=3, seed=kd.seed, callback=direct.append)
    assert [r.loss for r in kmeans_records] == [r.loss for r in direct]
    assert [r.info["rows"] for r in records if r.phase == "least squares"] == [50, 50, 20]
    # the blocks change no row's solution: the start of a distiller solved in one block
    monkeypatch.setattr(_objective, "_CHUNK_ELEMENTS", 2**22)
    whole = reference_distiller(max_iter=2, kmeans_max_iter=3)
    whole.prepare()
    torch.testing.assert_close(kd.initial_weight_values, whole.initial_weight_values)


def test_a_callback_stopping_the_preparation_leaves_the_least_squares_student():
    records = []
    kd = reference_distiller(max_iter=5, kmeans_max_iter=10).fit(
        callback=lambda r: records.append(r) or r.phase == "k-means"
    )
    assert [(r.phase, r.iteration) for r in records] == [("k-means", 1)]
    # one K-means iteration, no descent: the least-squares W of those centroids
    reference = reference_distiller(max_iter=0, kmeans_max_iter=1).fit()
    torch.testing.assert_close(kd.inducing_points, reference.inducing_points, rtol=0, atol=0)
    torch.testing.assert_close(kd.weight_values, reference.weight_values, rtol=0, atol=0)
    assert kd.frobenius_errors == reference.frobenius_errors
    assert kd.student is not None


def test_prepare_reports_its_phases_under_its_own_name():
    records = []
    kd = reference_distiller(max_iter=0, kmeans_max_iter=2)
    kd.prepare(callback=records.append)
    assert {r.task for r in records} == {"KernelDistillation.prepare"}
    assert [r.phase for r in records][-2:] == ["neighbours", "least squares"]
    given = reference_distiller(inducing_points=kd.inducing_points)
    records.clear()
    given.prepare(callback=records.append)  # no K-means for inducing points given
    assert [r.phase for r in records] == ["neighbours", "least squares"]


def test_progress_true_and_a_bar_of_ones_own_run_and_change_nothing():
    import io

    from tqdm import tqdm

    quiet = reference_distiller(max_iter=3).fit()
    with_bar = reference_distiller(max_iter=3).fit(progress=True)
    assert with_bar.frobenius_errors == quiet.frobenius_errors
    bar = tqdm(total=3, file=io.StringIO())
    records = []
    reference_distiller(max_iter=3).fit(progress=bar, callback=records.append)
    assert bar.n == len(records)  # every phase's iterations, the descent's 3 last
    assert [r.phase for r in records[-3:]] == ["descent"] * 3
    bar.close()
    with pytest.raises(TypeError, match="progress must be True, False or a tqdm"):
        reference_distiller(max_iter=1).fit(progress="yes")
    with pytest.raises(TypeError, match="callback must be callable"):
        reference_distiller(max_iter=1).fit(callback=3)


def test_fit_returns_the_distiller_whose_student_is_the_sparse_low_rank_student():
    kd = reference_distiller(max_iter=1)
    assert kd.fit() is kd
    assert isinstance(kd.student, SparseLowRankStudent)
    assert isinstance(kd.student, gpsd.SparseLowRankStudent)


def test_the_student_before_fit_raises_not_fitted_error():
    kd = reference_distiller(max_iter=1)
    kd.prepare()  # preparing is no fit
    with pytest.raises(gpsd.NotFittedError, match=r"call fit\(\)"):
        _ = kd.student
    with pytest.raises(RuntimeError):  # NotFittedError is a RuntimeError
        _ = kd.student


def test_from_data_matches_the_distiller_built_from_the_teacher():
    x, y = reference_data(80)
    lik = gpytorch.likelihoods.GaussianLikelihood().to(DT)
    lik.noise = 0.05
    mean = gpytorch.means.ConstantMean().to(DT)
    mean.constant.data.fill_(0.4)
    teacher = Teacher(x, y, lik, mean).to(DT)
    from_teacher = KernelDistillation(teacher, num_inducing=12, sparsity=4, max_iter=3).fit()
    from_data = KernelDistillation.from_data(
        x, y, teacher.covar_module, noise=lik.noise.detach(), mean_module=mean,
        num_inducing=12, sparsity=4, max_iter=3,
    ).fit()  # fmt: skip
    assert from_data.frobenius_errors == from_teacher.frobenius_errors
    assert from_data.mean_constant == from_teacher.mean_constant == pytest.approx(0.4)
    test_x = torch.randn(9, 2, dtype=DT)
    got, want = from_data.student.predict(test_x), from_teacher.student.predict(test_x)
    torch.testing.assert_close(got.mean, want.mean, rtol=0, atol=0)
    torch.testing.assert_close(got.variance, want.variance, rtol=0, atol=0)
    # the data come first, everything after the kernel is keyword-only
    with pytest.raises(TypeError):
        KernelDistillation.from_data(x, y, teacher.covar_module, 0.05, 12, 4)
    with pytest.raises(TypeError):
        KernelDistillation(teacher, 12, 4)


def test_a_fixed_step_that_raises_the_error_warns_and_names_it():
    kd = line_distiller(lr=0.1)
    with pytest.warns(RuntimeWarning, match=r"larger error .* lr=0.1 is too large"):
        kd.fit()
    errors = kd.frobenius_errors
    # the warning reports what the recorded errors show: the step made the fit worse
    assert errors[-1] > 10 * errors[0]
    dense_w = kd.dense_weights()
    k_xx = kd.covar_module(LINE_X, LINE_X).to_dense().detach()
    direct = torch.linalg.matrix_norm(k_xx - dense_w @ kd.inducing_covariance @ dense_w.T)
    torch.testing.assert_close(torch.tensor(errors[-1], dtype=DT), direct, rtol=1e-8, atol=0)


def test_a_diverging_fixed_step_names_lr_not_the_precision():
    # the error grows about 1e5-fold a step from 4e-4: beyond float64's range within 10 steps,
    # whatever the rounding of the start
    # (overflow on the way may also warn, depending on where it happens)
    kd = line_distiller(max_iter=10, lr=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with pytest.raises(RuntimeError, match="lr=1 is too large"):
            kd.fit()


@pytest.mark.parametrize("kwargs", [{}, {"lr": 1e-4}])
def test_steps_that_lower_the_error_do_not_warn(kwargs):
    kd = line_distiller(**kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        kd.fit()
    assert kd.frobenius_errors[-1] <= kd.frobenius_errors[0]


def test_near_coincident_inducing_points_are_named_not_the_precision():
    # float64 and a noise of 1e-2: the message names the inducing points, not the precision
    gen = torch.Generator().manual_seed(0)
    x = 10 * torch.rand(60, 1, generator=gen, dtype=DT)
    u = torch.cat([x[:10], x[:10] + 1e-9])
    kd = KernelDistillation.from_data(
        x,
        torch.sin(x.squeeze(-1)),
        scaled_rbf(),
        noise=1e-2,
        num_inducing=20,
        sparsity=10,
        max_iter=10,
        inducing_points=u,
    )
    with pytest.raises(RuntimeError, match="near-coincident or duplicated inducing points") as err:
        kd.fit()
    assert "float64" not in str(err.value)


@pytest.mark.parametrize("mean", ["zero", "constant"])
def test_u_equals_x_and_b_equals_m_reproduces_the_teacher(mean):
    # well-separated inputs so that K_XX is well conditioned
    x = torch.linspace(-4, 4, 15, dtype=DT).unsqueeze(-1)
    y = torch.sin(x.squeeze(-1))
    lik = gpytorch.likelihoods.GaussianLikelihood().to(DT)
    lik.noise = 0.1
    mean_module = gpytorch.means.ConstantMean().to(DT) if mean == "constant" else None
    teacher = Teacher(x, y, lik, mean_module).to(DT)
    teacher.covar_module.base_kernel.lengthscale = 0.9
    if mean_module is not None:
        mean_module.constant.data.fill_(0.3)
    kd = KernelDistillation(
        teacher, num_inducing=15, sparsity=15, max_iter=3, inducing_points=x.clone()
    )
    student = kd.fit().student
    assert max(kd.frobenius_errors) < 1e-8
    test_x = torch.linspace(-5, 5, 23, dtype=DT).unsqueeze(-1)
    tm, tv = teacher_predictions(teacher, test_x)
    prediction = student.predict(test_x)
    sm, sv = prediction.mean, prediction.variance
    torch.testing.assert_close(sm, tm, rtol=0, atol=1e-6)
    torch.testing.assert_close(sv, tv, rtol=0, atol=1e-6)
    mvn = student(test_x)
    assert isinstance(mvn, gpytorch.distributions.MultivariateNormal)
    torch.testing.assert_close(mvn.variance, sv)
    sv_y = student.predict(test_x, include_noise=True).variance
    torch.testing.assert_close(sv_y, sv + 0.1, rtol=0, atol=1e-6)


def test_float32_distillation_tracks_float64():
    kd64 = reference_distiller(max_iter=3)
    s64 = kd64.fit().student
    x, y = reference_data(120)
    k32 = ard_kernel().float()
    kd32 = KernelDistillation.from_data(
        x.float(),
        y.float(),
        k32,
        noise=0.05,
        num_inducing=20,
        sparsity=5,
        max_iter=3,
        inducing_points=kd64.inducing_points.float(),
    )
    s32 = kd32.fit().student
    assert kd32.frobenius_errors[0] == pytest.approx(kd64.frobenius_errors[0], rel=1e-3)
    test_x = torch.randn(13, 2, dtype=DT)
    torch.testing.assert_close(
        s32.predict(test_x.float()).mean.double(), s64.predict(test_x).mean, rtol=0, atol=1e-3
    )


@requires_cuda
def test_cuda_matches_cpu():
    kd = reference_distiller(max_iter=2)
    s_cpu = kd.fit().student
    x, y = reference_data(120)
    kd_gpu = KernelDistillation.from_data(x.cuda(), y.cuda(), ard_kernel().cuda(), noise=0.05, num_inducing=20, sparsity=5, max_iter=2, inducing_points=kd.inducing_points.cuda())  # fmt: skip
    s_gpu = kd_gpu.fit().student
    test_x = torch.randn(13, 2, dtype=DT)
    torch.testing.assert_close(s_gpu.predict(test_x.cuda()).mean.cpu(), s_cpu.predict(test_x).mean)
    # a copy: Module.cuda() moves the student in place (the reference would move with it)
    s_moved = copy.deepcopy(s_cpu).cuda()
    torch.testing.assert_close(
        s_moved.predict(test_x.cuda()).variance.cpu(), s_cpu.predict(test_x).variance
    )


@requires_cuda
def test_to_cuda_moves_the_distiller_and_its_student():
    kd = reference_distiller(n=80, m=12, b=4, max_iter=2).fit()
    test_x = torch.randn(7, 2, dtype=DT)
    want = kd.student.predict(test_x)
    moved = copy.deepcopy(kd).to("cuda")
    assert moved.weight_values.is_cuda and moved.neighbour_indices.is_cuda
    assert moved.student.inducing_points.is_cuda
    got = moved.student.predict(test_x.cuda())
    torch.testing.assert_close(got.mean.cpu(), want.mean)
    torch.testing.assert_close(got.variance.cpu(), want.variance)
    assert moved.fit().weight_values.is_cuda  # a further fit descends on the GPU


@pytest.mark.parametrize("metric", ["lengthscale", "euclidean"])
def test_neighbour_metric(metric):
    x, y = reference_data(80)
    k = ard_kernel()
    k.base_kernel.lengthscale = torch.tensor([0.2, 5.0], dtype=DT)
    kd = KernelDistillation.from_data(
        x, y, k, noise=0.05, num_inducing=15, sparsity=4, max_iter=0, neighbour_metric=metric
    )
    student = kd.fit().student
    scale = (
        torch.tensor([0.2, 5.0], dtype=DT) if metric == "lengthscale" else torch.ones(2, dtype=DT)
    )
    u = kd.inducing_points
    for i in range(80):
        ref = torch.argsort((((u - x[i]) / scale) ** 2).sum(-1))[:4].sort().values
        assert torch.equal(kd.neighbour_indices[i], ref)
    test_x = torch.randn(6, 2, dtype=DT)
    _, idx = student.interpolation_weights(test_x)
    for p in range(6):
        ref = torch.argsort((((u - test_x[p]) / scale) ** 2).sum(-1))[:4]
        assert set(idx[p].tolist()) == set(ref.tolist())


def test_one_dimensional_inputs_equal_a_column_of_inputs():
    # a teacher trained on x of shape (n,) and a student queried with (p,) equal the (n, 1) forms
    x = torch.linspace(-3, 3, 40, dtype=DT)
    y = torch.sin(2 * x)
    k = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).to(DT)
    k.base_kernel.lengthscale = 0.6
    lik = gpytorch.likelihoods.GaussianLikelihood().to(DT)
    lik.noise = 0.05
    teacher = Teacher(x, y, lik).to(DT)
    teacher.covar_module = k
    flat = KernelDistillation(teacher, num_inducing=8, sparsity=3, max_iter=2).fit().student
    # the teacher's own noise: GPyTorch's setter rounded 0.05 through float32
    noise = lik.noise.detach()
    column = (
        KernelDistillation.from_data(
            x.unsqueeze(-1), y, k, noise=noise, num_inducing=8, sparsity=3, max_iter=2
        )
        .fit()
        .student
    )
    test_x = torch.linspace(-3.5, 3.5, 17, dtype=DT)
    for got, want in zip(
        mean_and_variance(flat.predict(test_x)),
        mean_and_variance(column.predict(test_x.unsqueeze(-1))),
        strict=True,
    ):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert flat.predict(test_x).mean.shape == (17,)


def test_float32_student_of_inputs_far_from_the_origin_is_as_good_as_at_the_origin():
    # A stationary kernel cannot tell x from x + 2000; in float32 the uncentred distance
    # expansion picks wrong neighbours for most rows there (mean errors of 0.4 on a
    # unit-amplitude sine).
    gen = torch.Generator().manual_seed(0)
    x = 10 * torch.rand(600, 1, generator=gen, dtype=DT)
    y = torch.sin(2 * x).squeeze(-1)
    test_x = torch.linspace(0.5, 9.5, 100, dtype=DT).unsqueeze(-1)
    k = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).to(DT)
    k.base_kernel.lengthscale = 0.2
    with torch.no_grad():
        gram = k(x).to_dense() + 0.01 * torch.eye(600, dtype=DT)
        exact = k(test_x, x).to_dense() @ torch.linalg.solve(gram, y)
    for offset in (0.0, 2000.0):
        k32 = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).float()
        k32.base_kernel.lengthscale = 0.2
        kd = KernelDistillation.from_data(
            (x + offset).float(),
            y.float(),
            k32,
            noise=0.01,
            num_inducing=50,
            sparsity=6,
            max_iter=3,
        )
        mean = kd.fit().student.predict((test_x + offset).float()).mean.double()
        assert float((mean - exact).abs().max()) < 0.05  # 0.037 in float64 at the origin


MU = 1000.123456789  # not a float32 number


class _ConstantMeanTeacher(gpytorch.models.ExactGP):
    def __init__(self, x, y, likelihood):
        super().__init__(x, y, likelihood)
        self.mean_module = gpytorch.means.ConstantMean()
        self.covar_module = scaled_rbf()

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def test_python_float_noise_and_a_float64_mean_constant_keep_float64_precision():
    # through a float32 tensor 0.05 and MU would become 0.05000000074505806 and
    # 1000.1234741210938, and a prediction far from the data would be off by 1.7e-5
    x, y = offset_data(offset=MU)
    mean_module = gpytorch.means.ConstantMean().to(DT)
    mean_module.constant.data.fill_(MU)
    kd = KernelDistillation.from_data(
        x, y, scaled_rbf(), noise=0.05, mean_module=mean_module, num_inducing=15, sparsity=4,
        max_iter=1,
    )  # fmt: skip
    student = kd.fit().student
    assert kd.noise.item() == 0.05 and student.noise.item() == 0.05
    assert kd.mean_constant == MU and student.mean_constant.item() == MU
    far = torch.full((1, 2), 30.0, dtype=DT)  # k(far, U) = 0: the mean is the prior mean
    mean = student.predict(far).mean
    torch.testing.assert_close(mean, torch.tensor([MU], dtype=DT), rtol=0, atol=1e-10)
    direct = SparseLowRankStudent.from_sparse_weights(
        kd.covar_module, kd.inducing_points, kd.weight_values, kd.neighbour_indices, y.tolist(),
        0.05, mean_constant=MU,
    )  # fmt: skip
    assert direct.noise.item() == 0.05 and direct.mean_constant.item() == MU
    torch.testing.assert_close(direct.predictive_mean_weights, student.predictive_mean_weights)


def test_teacher_constant_mean_keeps_float64_precision():
    x, y = offset_data(offset=MU)
    likelihood = gpytorch.likelihoods.GaussianLikelihood().to(DT)
    likelihood.noise = 0.05
    teacher = _ConstantMeanTeacher(x, y, likelihood).to(DT)
    teacher.mean_module.constant = torch.tensor(MU, dtype=DT)
    student = KernelDistillation(teacher, num_inducing=15, sparsity=4, max_iter=1).fit().student
    assert student.mean_constant.item() == MU


class _ArdTeacher(gpytorch.models.ExactGP):
    def __init__(self, x, y, likelihood):
        super().__init__(x, y, likelihood)
        self.mean_module = gpytorch.means.ZeroMean()
        kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=2))
        self.covar_module = kernel.to(DT)
        self.covar_module.base_kernel.lengthscale = torch.tensor([0.7, 1.1], dtype=DT)
        self.covar_module.outputscale = 1.5

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


@pytest.mark.parametrize("prepare_first", [True, False])
def test_teacher_trained_further_after_construction_does_not_leak_in(prepare_first):
    # the distiller copies the teacher's kernel with its noise and mean: with the live kernel
    # (and, after prepare, a cached K_UU) hyperparameters changed before fit() would move the
    # student's mean by 0.89 (0.61 without prepare) from the distillation of the teacher as
    # given; the two agree to 1e-10
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(80, 2, generator=gen, dtype=DT)
    y = torch.sin(2 * x).sum(-1)
    likelihood = gpytorch.likelihoods.GaussianLikelihood().to(DT)
    likelihood.noise = torch.tensor(0.05, dtype=DT)
    teacher = _ArdTeacher(x, y, likelihood)
    original = copy.deepcopy(teacher)
    kd = KernelDistillation(teacher, num_inducing=15, sparsity=4, max_iter=3)
    if prepare_first:
        kd.prepare()
    teacher.covar_module.base_kernel.lengthscale = torch.tensor([0.3, 0.4], dtype=DT)
    teacher.covar_module.outputscale = 0.5
    student = kd.fit().student
    reference = KernelDistillation(original, num_inducing=15, sparsity=4, max_iter=3)
    expected = reference.fit().student
    test_x = torch.randn(10, 2, generator=gen, dtype=DT)
    prediction = student.predict(test_x)
    mean, variance = prediction.mean, prediction.variance
    prediction = expected.predict(test_x)
    ref_mean, ref_variance = prediction.mean, prediction.variance
    torch.testing.assert_close(mean, ref_mean, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(variance, ref_variance, rtol=1e-10, atol=1e-10)
    assert kd.frobenius_errors == pytest.approx(reference.frobenius_errors, rel=1e-10)


def test_student_of_a_noise_that_requires_grad_holds_no_graph():
    # likelihood.noise is a function of raw_noise: its graph reached the student's buffers
    # (predictive_mean_weights, predictive_covariance_correction, noise), and deepcopy raised
    # "Only Tensors created explicitly by the user (graph leaves) support the deepcopy protocol".
    x, y = sine_data()
    likelihood = gpytorch.likelihoods.GaussianLikelihood().to(DT)
    likelihood.noise = 0.05
    assert likelihood.noise.requires_grad
    kd = KernelDistillation.from_data(
        x, y, iso_kernel(), noise=likelihood.noise, num_inducing=10, sparsity=3, max_iter=2
    )
    student = kd.fit().student
    assert not kd.noise.requires_grad
    assert not any(b.requires_grad for b in student.buffers())
    clone = copy.deepcopy(student)
    test_x = torch.randn(7, 2, dtype=DT)
    ref = (
        KernelDistillation.from_data(
            x, y, iso_kernel(), noise=0.05, num_inducing=10, sparsity=3, max_iter=2
        )
        .fit()
        .student
    )
    for got, want in zip(
        mean_and_variance(clone.predict(test_x)),
        mean_and_variance(ref.predict(test_x)),
        strict=True,
    ):
        torch.testing.assert_close(got, want)
    # from_sparse_weights and the constructor detach, too
    direct = SparseLowRankStudent.from_sparse_weights(
        kd.covar_module, kd.inducing_points, kd.weight_values, kd.neighbour_indices,
        y.clone().requires_grad_(), likelihood.noise,
    )  # fmt: skip
    assert not any(b.requires_grad for b in direct.buffers())
    copy.deepcopy(direct)


class _ScalingTeacher(gpytorch.models.ExactGP):
    def __init__(self, x, y, input_scale):
        super().__init__(x, y, gpytorch.likelihoods.GaussianLikelihood())
        self.input_scale = input_scale
        self.mean_module = gpytorch.means.ConstantMean()
        self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(0.5))

    def forward(self, x):
        z = x * self.input_scale
        return gpytorch.distributions.MultivariateNormal(self.mean_module(z), self.covar_module(z))


@pytest.mark.parametrize("dtype", [torch.float32, DT])
@pytest.mark.parametrize("training", [True, False])
def test_a_teacher_whose_forward_transforms_the_inputs_warns(dtype, training):
    # a teacher whose forward scales the inputs is distilled as if covar_module acted on the
    # raw inputs (an RBF teacher's student misses its mean by 0.5 on [0, 100]): it warns; a
    # standard teacher (1-d inputs spanning 145 lengthscales) must not warn; modes are kept
    gen = torch.Generator().manual_seed(0)
    x = (torch.rand(60, generator=gen, dtype=DT) * 100).to(dtype)
    for scale, warns in ((1.0, False), (0.1, True)):
        teacher = _ScalingTeacher(x, torch.sin(x / 10), scale).to(dtype)
        teacher.mean_module.constant.data.fill_(0.3)
        teacher.train(training)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            KernelDistillation(teacher, num_inducing=10, sparsity=3)
        messages = [str(w.message) for w in caught]
        assert any("teacher.forward differs" in m for m in messages) == warns, messages
        assert all(module.training == training for module in teacher.modules())


def test_clear_errors():
    x, y = reference_data(30)
    k = ard_kernel()
    with pytest.raises(ValueError, match="sparsity"):
        KernelDistillation.from_data(x, y, k, noise=0.1, num_inducing=5, sparsity=6)
    with pytest.raises(ValueError, match="num_inducing"):
        KernelDistillation.from_data(x, y, k, noise=0.1, num_inducing=31, sparsity=2)
    bad = x.clone()
    bad[3, 1] = float("nan")
    with pytest.raises(ValueError, match="train_x must be finite"):
        KernelDistillation.from_data(bad, y, k, noise=0.1, num_inducing=5, sparsity=2)
    with pytest.raises(ValueError, match="train_y"):
        KernelDistillation.from_data(x, y[:-1], k, noise=0.1, num_inducing=5, sparsity=2)
    with pytest.raises(ValueError, match="noise"):
        KernelDistillation.from_data(x, y, k, noise=-1.0, num_inducing=5, sparsity=2)
    # untrained teachers: no data, or hyperparameters never moved from their initial values
    lik = gpytorch.likelihoods.GaussianLikelihood().to(DT)
    no_data = Teacher(None, None, lik)
    with pytest.raises(ValueError, match="no training data"):
        KernelDistillation(no_data, num_inducing=5, sparsity=2)
    fresh = Teacher(x, y, gpytorch.likelihoods.GaussianLikelihood().to(DT))
    fresh.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).to(DT)
    with pytest.raises(ValueError, match="untrained"):
        KernelDistillation(fresh, num_inducing=5, sparsity=2)
    KernelDistillation(fresh, num_inducing=5, sparsity=2, require_trained=False)
    non_gaussian = Teacher(x, y, gpytorch.likelihoods.GaussianLikelihood().to(DT))
    non_gaussian.likelihood = gpytorch.likelihoods.BernoulliLikelihood()
    with pytest.raises(TypeError, match="GaussianLikelihood"):
        KernelDistillation(non_gaussian, num_inducing=5, sparsity=2)
    fixed = gpytorch.likelihoods.FixedNoiseGaussianLikelihood(torch.full((30,), 0.1, dtype=DT))
    with pytest.raises(TypeError, match="GaussianLikelihood"):
        KernelDistillation(Teacher(x, y, fixed), num_inducing=5, sparsity=2)
    with pytest.raises(TypeError, match="ExactGP"):
        KernelDistillation(k, num_inducing=5, sparsity=2)
    student = (
        KernelDistillation.from_data(x, y, k, noise=0.1, num_inducing=5, sparsity=2, max_iter=0)
        .fit()
        .student
    )
    with pytest.raises(ValueError, match="d=2"):
        student.predict(torch.randn(4, 3, dtype=DT))
    with pytest.raises(ValueError, match="finite"):
        student.predict(torch.full((4, 2), float("inf"), dtype=DT))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(num_inducing=0), ValueError, "num_inducing must be a positive int"),
        (dict(num_inducing=True), ValueError, "num_inducing must be a positive int"),
        (dict(sparsity=2.5), ValueError, "sparsity must be a positive int"),
        (dict(max_iter=-1), ValueError, "max_iter must be a non-negative int"),
        (dict(kmeans_max_iter=-2), ValueError, "kmeans_max_iter"),
        (dict(chunk_size=-5), ValueError, "chunk_size must be a positive integer or None"),
        (dict(chunk_size=0), ValueError, "chunk_size"),
        (dict(chunk_size=2.5), ValueError, "chunk_size"),
        (dict(seed=-1), ValueError, "seed"),
        (dict(lr=0.0), ValueError, "lr"),
        (dict(lr=float("nan")), ValueError, "lr"),
        (
            dict(lr=0.1, optimizer=lambda p: torch.optim.SGD(p, lr=0.1)),
            ValueError,
            "either lr or optimizer",
        ),
        (dict(optimizer="adam"), TypeError, "optimizer must be callable"),
        (dict(callback=print), TypeError, "callback"),  # an argument of fit
        (dict(num_steps=5), TypeError, "num_steps"),  # iterations are max_iter
        (dict(jitter=-1e-6), ValueError, "jitter"),
        (dict(jitter=float("nan")), ValueError, "jitter"),
        (dict(inducing_points=torch.zeros(5, 3, dtype=DT)), ValueError, "inducing_points"),
        (dict(neighbour_metric="cosine"), ValueError, "neighbour_metric"),
        (dict(descent="newton"), ValueError, "descent must be None, 'block' or 'gradient'"),
        (dict(learning_rate=0.1), TypeError, "learning_rate"),
        (dict(covar_module="rbf"), TypeError, "covar_module must be a gpytorch.kernels.Kernel"),
        (
            dict(covar_module=gpytorch.kernels.RBFKernel(batch_shape=torch.Size([2])).to(DT)),
            ValueError,
            r"covar_module must have no batch shape.*\(2,\)",
        ),
        (dict(train_x=torch.zeros(2, 30, 2, dtype=DT)), ValueError, "train_x must have shape"),
        (dict(train_x=[["a", "b"]]), TypeError, "train_x"),
        (dict(noise=float("inf")), ValueError, "noise"),
        (dict(noise=[0.1, 0.2]), ValueError, "noise"),
    ],
)
def test_from_data_names_the_bad_argument(kwargs, error, match):
    x, y = reference_data(30)
    args = dict(
        train_x=x, train_y=y, covar_module=ard_kernel(), noise=0.1, num_inducing=5, sparsity=2
    )
    args.update(kwargs)
    with pytest.raises(error, match=match):
        KernelDistillation.from_data(**args)


@pytest.mark.parametrize("name, value", [("lr", "0.1"), ("jitter", "1e-6")])
def test_string_settings_are_refused_by_name(name, value):
    with pytest.raises(ValueError, match=f"{name} must be"):
        line_distiller(**{name: value})


@pytest.mark.parametrize("shape", [(2, 60), (1, 60)])
def test_from_data_needs_a_one_dimensional_train_y(shape):
    # (2, n) targets passed every check, ran the whole distillation and then failed inside the
    # student with "index_add_(): Number of indices (180) should be equal to source.size(dim)"
    x, y = sine_data()
    with pytest.raises(ValueError, match=r"train_y must have shape \(n=60,\)"):
        KernelDistillation.from_data(
            x, y.expand(*shape), iso_kernel(), noise=0.05, num_inducing=10, sparsity=3
        )


def test_from_data_names_a_non_finite_or_unsupported_mean_module():
    x, y = sine_data()
    mean_module = gpytorch.means.ConstantMean().to(DT)
    mean_module.constant.data.fill_(float("nan"))
    with pytest.raises(ValueError, match="mean_module's constant must be finite"):
        KernelDistillation.from_data(
            x, y, iso_kernel(), noise=0.05, mean_module=mean_module, num_inducing=10, sparsity=3
        )
    with pytest.raises(TypeError, match="mean_module must be None, a ZeroMean or a ConstantMean"):
        KernelDistillation.from_data(
            x, y, iso_kernel(), noise=0.05, mean_module=gpytorch.means.LinearMean(2).to(DT),
            num_inducing=10, sparsity=3,
        )  # fmt: skip


@pytest.mark.parametrize("metric", ["lengthscale", "euclidean"])
def test_distillation_names_an_ard_kernel_of_another_dimension(metric):
    x = torch.rand(50, 2, dtype=DT)
    kernel = unit_rbf(torch.tensor([0.5, 0.6, 0.7]), ard_num_dims=3)
    with pytest.raises(ValueError, match="kernel has 3 lengthscales .* d=2"):
        KernelDistillation.from_data(
            x, x.sum(-1), kernel, noise=0.01, num_inducing=10, sparsity=3, neighbour_metric=metric
        )


def _teacher_with(x, y, **changes):
    lik = gpytorch.likelihoods.GaussianLikelihood().to(DT)
    lik.noise = 0.1
    teacher = Teacher(x, y, lik).to(DT)
    for name, value in changes.items():
        setattr(teacher, name, value)
    return teacher


@pytest.mark.parametrize(
    "build, error, match",
    [
        (
            lambda x, y: _teacher_with(x, y, train_inputs=(x, x)),
            ValueError,
            "exactly one training input tensor",
        ),
        (
            lambda x, y: _teacher_with(x.expand(2, -1, -1), y.expand(2, -1)),
            ValueError,
            "no batch shape",
        ),
        (
            lambda x, y: _teacher_with(x, y, mean_module=gpytorch.means.LinearMean(2).to(DT)),
            TypeError,
            "ZeroMean or a ConstantMean",
        ),
        (
            lambda x, y: _teacher_with(x, y, covar_module=torch.nn.Identity()),
            TypeError,
            "covar_module",
        ),
    ],
)
def test_unsupported_teachers_are_named(build, error, match):
    x, y = reference_data(30)
    teacher = build(x, y)
    with pytest.raises(error, match=match):
        KernelDistillation(teacher, num_inducing=5, sparsity=2)


def _saved_and_reloaded(state):
    """``state`` through ``torch.save`` and ``torch.load``."""
    import io

    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer)


def test_the_distiller_is_a_gpytorch_module_whose_state_holds_what_it_learns():
    kd = reference_distiller(n=60, m=10, b=3, max_iter=2).fit()
    assert isinstance(kd, gpytorch.Module)
    state = kd.state_dict()
    for name in (
        "train_x", "train_y", "noise", "neighbour_scale", "inducing_points", "neighbour_indices",
        "inducing_covariance", "initial_weight_values", "weight_values",
        "covar_module.base_kernel.raw_lengthscale",
    ):  # fmt: skip
        assert name in state, name
    torch.testing.assert_close(state["weight_values"], kd.weight_values, rtol=0, atol=0)
    assert state["_extra_state"]["frobenius_errors"] == kd.frobenius_errors
    assert not any(t.requires_grad for t in kd.parameters())


@pytest.mark.parametrize("max_iter", [0, 3])
def test_a_state_dict_loaded_into_a_new_distiller_predicts_as_the_saved_one(max_iter):
    kd = reference_distiller(n=80, m=12, b=4, max_iter=max_iter).fit()
    state = _saved_and_reloaded(kd.state_dict())
    # built alike but with another K-means seed: everything learnt comes from the state
    fresh = reference_distiller(n=80, m=12, b=4, max_iter=max_iter, seed=7)
    with pytest.raises(gpsd.NotFittedError):
        _ = fresh.student
    fresh.load_state_dict(state)
    test_x = torch.randn(11, 2, generator=torch.Generator().manual_seed(2), dtype=DT)
    for got, want in zip(
        mean_and_variance(fresh.student.predict(test_x)),
        mean_and_variance(kd.student.predict(test_x)),
        strict=True,
    ):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert fresh.frobenius_errors == kd.frobenius_errors
    assert fresh.mean_constant == kd.mean_constant
    torch.testing.assert_close(fresh.inducing_points, kd.inducing_points, rtol=0, atol=0)
    assert torch.equal(fresh.neighbour_indices, kd.neighbour_indices)
    # independently: the loaded W's error from a dense residual
    assert fresh.frobenius_error() ** 2 == pytest.approx(
        float(_dense_objective(fresh, fresh.weight_values)), rel=1e-10
    )


def test_a_prepared_state_loads_unfitted_and_an_unprepared_one_clears_what_was_learnt():
    prepared = reference_distiller(n=60, m=10, b=3)
    prepared.prepare()
    fitted = reference_distiller(n=60, m=10, b=3, seed=5).fit()
    fitted.load_state_dict(prepared.state_dict())
    with pytest.raises(gpsd.NotFittedError):
        _ = fitted.student
    torch.testing.assert_close(fitted.weight_values, prepared.weight_values, rtol=0, atol=0)
    # fitting the loaded start gives the student of the prepared distiller's own fit
    test_x = torch.randn(5, 2, dtype=DT)
    torch.testing.assert_close(
        fitted.fit().student.predict(test_x).mean,
        prepared.fit().student.predict(test_x).mean,
        rtol=0,
        atol=1e-12,
    )
    fitted.load_state_dict(reference_distiller(n=60, m=10, b=3).state_dict())
    assert fitted.weight_values is None and fitted.inducing_points is None
    with pytest.raises(gpsd.NotFittedError):
        _ = fitted.student


def test_to_float32_and_back_moves_the_distiller_and_its_student():
    kd = reference_distiller(n=80, m=12, b=4, max_iter=2).fit()
    test_x = torch.randn(9, 2, generator=torch.Generator().manual_seed(3), dtype=DT)
    want = kd.student.predict(test_x)
    moved = copy.deepcopy(kd).to(torch.float32)
    floats = [moved.train_x, moved.weight_values, moved.inducing_covariance, moved.noise]
    assert all(t.dtype == torch.float32 for t in floats)
    assert moved.neighbour_indices.dtype == torch.long
    assert moved.covar_module.base_kernel.raw_lengthscale.dtype == torch.float32
    got = moved.student.predict(test_x)
    assert got.mean.dtype == got.variance.dtype == torch.float32
    # the float64 prediction rounded through float32 buffers: about 1e-6 relative
    torch.testing.assert_close(got.mean.double(), want.mean, rtol=0, atol=1e-5)
    torch.testing.assert_close(got.variance.double(), want.variance, rtol=0, atol=1e-5)
    back = moved.to(torch.float64)
    again = back.student.predict(test_x)
    assert again.mean.dtype == torch.float64
    torch.testing.assert_close(again.mean, want.mean, rtol=0, atol=1e-5)
    # a float64 distiller moved to float64 is unchanged, bit for bit
    same = kd.to(torch.float64).student.predict(test_x)
    torch.testing.assert_close(same.mean, want.mean, rtol=0, atol=0)


def test_a_distiller_moved_to_float32_descends_in_float32():
    kd = reference_distiller(n=80, m=12, b=4, max_iter=2)
    kd.prepare()
    moved = copy.deepcopy(kd).to(torch.float32).fit()
    assert moved.weight_values.dtype == torch.float32
    assert moved.student.predict(torch.zeros(2, 2)).mean.dtype == torch.float32
    reference = kd.fit()
    assert moved.frobenius_errors == pytest.approx(reference.frobenius_errors, rel=1e-4)


def test_from_data_and_from_sgpr_refuse_the_settings_they_fix():
    x, y = reference_data(30)
    with pytest.raises(TypeError, match="require_trained"):
        KernelDistillation.from_data(
            x, y, ard_kernel(), noise=0.1, num_inducing=5, sparsity=2, require_trained=False
        )
