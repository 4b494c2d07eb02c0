import copy

import gpytorch
import numpy as np
import pytest
import torch
from conftest import requires_cuda

from gpsd.kernel_distillation import KernelDistillation, SparseLowRankStudent

DT = torch.float64


def _data(n=120, d=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=gen, dtype=DT)
    y = torch.sin(2 * x).sum(-1) + 0.1 * torch.randn(n, generator=gen, dtype=DT)
    return x, y


def _kernel(d=2):
    k = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=d)).to(DT)
    k.base_kernel.lengthscale = torch.linspace(0.7, 1.3, d, dtype=DT)
    k.outputscale = 1.5
    return k


def _distiller(n=120, m=20, b=5, **kw):
    x, y = _data(n)
    return KernelDistillation.from_kernel(_kernel(), x, y, 0.05, m, b, **kw)


class _Teacher(gpytorch.models.ExactGP):
    def __init__(self, x, y, likelihood, mean=None):
        super().__init__(x, y, likelihood)
        self.mean_module = mean if mean is not None else gpytorch.means.ZeroMean()
        self.covar_module = _kernel(x.shape[-1] if x is not None else 2)

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def _dense_objective(kd, values):
    x = kd.train_x
    k_xx = kd.kernel(x, x).to_dense().detach()
    w = torch.zeros(x.shape[0], kd.num_inducing, dtype=DT).scatter(-1, kd.neighbour_indices, values)
    return (k_xx - w @ kd.inducing_covariance @ w.T).pow(2).sum()


def test_least_squares_init_equals_per_row_lstsq():
    kd = _distiller()
    kd.prepare()
    k_xu = kd.kernel(kd.train_x, kd.inducing_points).to_dense().detach().numpy()
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
    kd = KernelDistillation.from_kernel(kernel, x, y, 0.1, 300, 30, num_steps=0)
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


def test_gradient_equals_autograd_on_the_pattern():
    kd = _distiller()
    kd.prepare()
    values = kd.weight_values + 0.01 * torch.randn_like(kd.weight_values)
    obj, grad = kd.objective_and_gradient(values)
    ref_obj = _dense_objective(kd, values)
    # autograd of the dense objective w.r.t. a dense W, restricted to the sparsity pattern
    w_dense = kd.dense_weights(values).requires_grad_(True)
    k_xx = kd.kernel(kd.train_x, kd.train_x).to_dense().detach()
    loss = (k_xx - w_dense @ kd.inducing_covariance @ w_dense.T).pow(2).sum()
    (g_dense,) = torch.autograd.grad(loss, w_dense)
    torch.testing.assert_close(obj, ref_obj, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(
        grad, g_dense.gather(-1, kd.neighbour_indices), rtol=1e-8, atol=1e-10
    )


def test_sparse_pattern_products_match_dense_scatter():
    # column 3 of W has no non-zero and column 0 several: the CSR row pointers of W^T must say so
    from gpsd.kernel_distillation.kernel_distillation import _SparseRows

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


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_short_lengthscale_objective_and_gradient_match_a_float64_reference(dtype):
    # lengthscale 0.1 on [0, 10]^2: most kernel entries lie below the smallest normal number,
    # and the distiller drops those below eps^2 * max before its products
    gen = torch.Generator().manual_seed(3)
    x = 10 * torch.rand(300, 2, generator=gen, dtype=DT)
    y = torch.randn(300, generator=gen, dtype=DT)
    kernel = gpytorch.kernels.RBFKernel().to(dtype)
    kernel.lengthscale = torch.tensor(0.1, dtype=dtype)
    kd = KernelDistillation.from_kernel(
        kernel, x.to(dtype), y.to(dtype), 0.05, 60, 6, chunk_size=64
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
    kd = KernelDistillation.from_kernel(kernel, x, y, 0.05, 80, 8, chunk_size=50)
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
    ref = _distiller(chunk_size=10_000)
    ref.prepare()
    kd = _distiller(chunk_size=chunk_size)
    kd.prepare()
    torch.testing.assert_close(kd.initial_weight_values, ref.initial_weight_values)
    values = ref.weight_values + 0.01 * torch.randn_like(ref.weight_values)
    o1, g1 = ref.objective_and_gradient(values)
    o2, g2 = kd.objective_and_gradient(values)
    torch.testing.assert_close(o1, o2, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(g1, g2, rtol=1e-10, atol=1e-12)
    d = torch.randn_like(values)
    t1, f1 = ref._line_search(values, d)
    t2, f2 = kd._line_search(values, d)
    assert t1 == pytest.approx(t2, rel=1e-8) and f1 == pytest.approx(f2, rel=1e-8)
    assert ref.frobenius_error(values) == pytest.approx(
        float(_dense_objective(ref, values).sqrt()), rel=1e-10
    )


def test_line_search_minimises_the_quartic():
    kd = _distiller()
    kd.prepare()
    _, grad = kd.objective_and_gradient(kd.weight_values)
    t, f_t = kd._line_search(kd.weight_values, grad)
    f = lambda s: float(_dense_objective(kd, kd.weight_values - s * grad))  # noqa: E731
    assert t > 0
    assert f_t == pytest.approx(f(t), rel=1e-8)
    assert f(t) <= min(f(0.5 * t), f(1.5 * t), f(0.0))


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"step_size": 1e-4}, {"optimizer": lambda p: torch.optim.Adam(p, lr=1e-3)}],
    ids=["line-search", "fixed-step", "adam"],
)
def test_objective_decreases(kwargs):
    seen = []
    kd = _distiller(num_steps=6, callback=lambda step, err: seen.append((step, err)), **kwargs)
    kd.fit()
    errs = kd.frobenius_errors
    assert len(errs) == 7 and [s for s, _ in seen] == list(range(6))
    assert errs[-1] < errs[0]
    if not kwargs:  # exact line search is monotone
        assert all(b <= a * (1 + 1e-12) for a, b in zip(errs, errs[1:], strict=False))


def _teacher_predictions(teacher, test_x):
    teacher.eval()
    teacher.likelihood.eval()
    with torch.no_grad():
        post = teacher(test_x)
    return post.mean, post.variance


@pytest.mark.parametrize("mean", ["zero", "constant"])
def test_u_equals_x_and_b_equals_m_reproduces_the_teacher(mean):
    # well-separated inputs so that K_XX is well conditioned
    x = torch.linspace(-4, 4, 15, dtype=DT).unsqueeze(-1)
    y = torch.sin(x.squeeze(-1))
    lik = gpytorch.likelihoods.GaussianLikelihood().to(DT)
    lik.noise = 0.1
    mean_module = gpytorch.means.ConstantMean().to(DT) if mean == "constant" else None
    teacher = _Teacher(x, y, lik, mean_module).to(DT)
    teacher.covar_module.base_kernel.lengthscale = 0.9
    if mean_module is not None:
        mean_module.constant.data.fill_(0.3)
    kd = KernelDistillation(teacher, 15, 15, num_steps=3, inducing_points=x.clone())
    student = kd.fit()
    assert max(kd.frobenius_errors) < 1e-8
    test_x = torch.linspace(-5, 5, 23, dtype=DT).unsqueeze(-1)
    tm, tv = _teacher_predictions(teacher, test_x)
    sm, sv = student.predict(test_x)
    torch.testing.assert_close(sm, tm, rtol=0, atol=1e-6)
    torch.testing.assert_close(sv, tv, rtol=0, atol=1e-6)
    mvn = student(test_x)
    assert isinstance(mvn, gpytorch.distributions.MultivariateNormal)
    torch.testing.assert_close(mvn.variance, sv)
    _, sv_y = student.predict(test_x, include_noise=True)
    torch.testing.assert_close(sv_y, sv + 0.1, rtol=0, atol=1e-6)


def test_fast_prediction_equals_the_dense_formula():
    kd = _distiller(n=90, m=15, b=4, num_steps=2)
    student = kd.fit()
    y, sigma2 = kd.train_y, kd.noise
    w = kd.dense_weights()
    kuu = kd.inducing_covariance
    k_tilde = w @ kuu @ w.T
    test_x = torch.randn(11, 2, dtype=DT)
    # W_* by a naive loop: b nearest inducing points, b x b solve
    u = kd.inducing_points
    w_star = torch.zeros(11, 15, dtype=DT)
    for p in range(11):
        ell = kd.kernel.base_kernel.lengthscale.detach()  # neighbours in the kernel's metric
        j = torch.argsort((((u - test_x[p]) / ell) ** 2).sum(-1))[:4]
        k_j = kd.kernel(test_x[p : p + 1], u[j]).to_dense().detach().squeeze(0)
        local = kuu[j][:, j] + student._relative_jitter() * kuu.diagonal().mean() * torch.eye(
            4, dtype=DT
        )
        w_star[p, j] = torch.linalg.solve(local, k_j)
    k_star_x = w_star @ kuu @ w.T
    system = k_tilde + sigma2 * torch.eye(90, dtype=DT)
    mean = k_star_x @ torch.linalg.solve(system, y)
    var = kd.kernel(test_x, diag=True).detach() - (
        k_star_x * torch.linalg.solve(system, k_star_x.T).T
    ).sum(-1)
    sm, sv = student.predict(test_x)
    torch.testing.assert_close(sm, mean, rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(sv, var, rtol=1e-8, atol=1e-10)
    values, idx = student.interpolation_weights(test_x)
    torch.testing.assert_close(torch.zeros(11, 15, dtype=DT).scatter(-1, idx, values), w_star)


def test_state_dict_round_trip_and_dtype_move():
    student = _distiller(num_steps=1).fit()
    test_x = torch.randn(9, 2, dtype=DT)
    m0, v0 = student.predict(test_x)
    m = student.num_inducing
    blank = SparseLowRankStudent(
        _kernel(), torch.zeros(m, 2, dtype=DT), torch.eye(m, dtype=DT), torch.zeros(m, dtype=DT),
        torch.zeros(m, m, dtype=DT), sparsity=5, noise=1.0,
    )  # fmt: skip
    blank.load_state_dict(student.state_dict())
    m1, v1 = blank.predict(test_x)
    torch.testing.assert_close(m1, m0)
    torch.testing.assert_close(v1, v0)
    s32 = student.to(torch.float32)
    m2, v2 = s32.predict(test_x.float())
    assert m2.dtype == torch.float32
    torch.testing.assert_close(m2.double(), m0, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(v2.double(), v0, rtol=1e-3, atol=1e-3)
    assert student.storage_bytes() == 4 * (2 * m * m + m * 2 + 2 + m + 2 + 2 + 1)


def test_state_dict_carries_sparsity_and_jitter():
    student = _distiller(num_steps=1).fit()  # sparsity 5
    test_x = torch.randn(9, 2, dtype=DT)
    m0, v0 = student.predict(test_x)
    m = student.num_inducing
    blank = SparseLowRankStudent(
        _kernel(), torch.zeros(m, 2, dtype=DT), torch.eye(m, dtype=DT), torch.zeros(m, dtype=DT),
        torch.zeros(m, m, dtype=DT), sparsity=2, noise=1.0, jitter=1e-3,
    )  # fmt: skip
    blank.load_state_dict(student.state_dict())  # predicted with sparsity 2, jitter 1e-3 before
    assert (blank.sparsity, blank.jitter) == (student.sparsity, student.jitter)
    m1, v1 = blank.predict(test_x)
    torch.testing.assert_close(m1, m0)
    torch.testing.assert_close(v1, v0)
    state = student.state_dict()
    state["_extra_state"] = {"sparsity": m + 1, "jitter": None}
    with pytest.raises(ValueError, match="saved sparsity"):
        blank.load_state_dict(state)


def test_export_of_the_prediction_path():
    student = _distiller(num_steps=1).fit()
    assert student.exportable
    test_x = torch.randn(9, 2, dtype=DT)
    ref = student.predict(test_x)
    program = torch.export.export(student.prediction_module(), (test_x,))
    out = program.module()(test_x)
    torch.testing.assert_close(out[0], ref[0])
    torch.testing.assert_close(out[1], ref[1])


@pytest.mark.parametrize("nu", [0.5, 1.5, 2.5])
def test_plain_matern_evaluation_matches_gpytorch(nu):
    x, y = _data(60)
    k = gpytorch.kernels.MaternKernel(nu=nu, ard_num_dims=2).to(DT)
    k.lengthscale = torch.tensor([0.6, 1.1], dtype=DT)
    student = KernelDistillation.from_kernel(k, x, y, 0.05, 12, 4, num_steps=1).fit()
    assert student.kernel_type != "generic"
    test_x = torch.randn(7, 2, dtype=DT)
    _, idx = student.interpolation_weights(test_x)
    cross, diag = student._cross_covariance(test_x, idx)
    ref = k(test_x.unsqueeze(-2), student.inducing_points[idx]).to_dense().detach().squeeze(-2)
    torch.testing.assert_close(cross, ref)
    torch.testing.assert_close(diag, torch.ones(7, dtype=DT))


def test_generic_kernel_predicts_but_is_not_exportable():
    x, y = _data(60)
    k = (gpytorch.kernels.RBFKernel() + gpytorch.kernels.LinearKernel()).to(DT)
    student = KernelDistillation.from_kernel(k, x, y, 0.05, 12, 4, num_steps=2).fit()
    assert not student.exportable
    assert all(p.requires_grad for p in k.parameters())  # the teacher's kernel is left alone
    test_x = torch.randn(5, 2, dtype=DT)
    mean, var = student.predict(test_x)
    assert mean.shape == var.shape == (5,) and bool(torch.isfinite(mean).all())
    eager = student.prediction_module()(test_x)  # the bare path still runs eagerly
    torch.testing.assert_close(eager[0], mean)
    # tracing it names the reason (it used to fail with an opaque data-dependent error)
    with pytest.raises(Exception, match="kernel is not exportable"):
        torch.export.export(student.prediction_module(), (test_x,))


def test_clear_errors():
    x, y = _data(30)
    k = _kernel()
    with pytest.raises(ValueError, match="sparsity"):
        KernelDistillation.from_kernel(k, x, y, 0.1, 5, 6)
    with pytest.raises(ValueError, match="num_inducing"):
        KernelDistillation.from_kernel(k, x, y, 0.1, 31, 2)
    bad = x.clone()
    bad[3, 1] = float("nan")
    with pytest.raises(ValueError, match="train_x must be finite"):
        KernelDistillation.from_kernel(k, bad, y, 0.1, 5, 2)
    with pytest.raises(ValueError, match="train_y"):
        KernelDistillation.from_kernel(k, x, y[:-1], 0.1, 5, 2)
    with pytest.raises(ValueError, match="noise"):
        KernelDistillation.from_kernel(k, x, y, -1.0, 5, 2)
    # untrained teachers: no data, or hyperparameters never moved from their initial values
    lik = gpytorch.likelihoods.GaussianLikelihood().to(DT)
    no_data = _Teacher(None, None, lik)
    with pytest.raises(ValueError, match="no training data"):
        KernelDistillation(no_data, 5, 2)
    fresh = _Teacher(x, y, gpytorch.likelihoods.GaussianLikelihood().to(DT))
    fresh.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).to(DT)
    with pytest.raises(ValueError, match="untrained"):
        KernelDistillation(fresh, 5, 2)
    KernelDistillation(fresh, 5, 2, require_trained=False)
    non_gaussian = _Teacher(x, y, gpytorch.likelihoods.GaussianLikelihood().to(DT))
    non_gaussian.likelihood = gpytorch.likelihoods.BernoulliLikelihood()
    with pytest.raises(TypeError, match="GaussianLikelihood"):
        KernelDistillation(non_gaussian, 5, 2)
    fixed = gpytorch.likelihoods.FixedNoiseGaussianLikelihood(torch.full((30,), 0.1, dtype=DT))
    with pytest.raises(TypeError, match="GaussianLikelihood"):
        KernelDistillation(_Teacher(x, y, fixed), 5, 2)
    with pytest.raises(TypeError, match="ExactGP"):
        KernelDistillation(k, 5, 2)
    student = KernelDistillation.from_kernel(k, x, y, 0.1, 5, 2, num_steps=0).fit()
    with pytest.raises(ValueError, match="d=2"):
        student.predict(torch.randn(4, 3, dtype=DT))
    with pytest.raises(ValueError, match="finite"):
        student.predict(torch.full((4, 2), float("inf"), dtype=DT))


def test_export_with_a_dynamic_number_of_test_points():
    student = _distiller(num_steps=1).fit()
    batch = torch.export.Dim("batch", min=2, max=4096)
    program = torch.export.export(
        student.prediction_module(), (torch.randn(9, 2, dtype=DT),), dynamic_shapes=({0: batch},)
    )
    test_x = torch.randn(31, 2, dtype=DT)
    out = program.module()(test_x)
    ref = student.predict(test_x)
    torch.testing.assert_close(out[0], ref[0])
    torch.testing.assert_close(out[1], ref[1])


def test_float32_distillation_tracks_float64():
    kd64 = _distiller(num_steps=3)
    s64 = kd64.fit()
    x, y = _data(120)
    k32 = _kernel().float()
    kd32 = KernelDistillation.from_kernel(
        k32,
        x.float(),
        y.float(),
        0.05,
        20,
        5,
        num_steps=3,
        inducing_points=kd64.inducing_points.float(),
    )
    s32 = kd32.fit()
    assert kd32.frobenius_errors[0] == pytest.approx(kd64.frobenius_errors[0], rel=1e-3)
    test_x = torch.randn(13, 2, dtype=DT)
    torch.testing.assert_close(
        s32.predict(test_x.float())[0].double(), s64.predict(test_x)[0], rtol=0, atol=1e-3
    )


@requires_cuda
def test_cuda_matches_cpu():
    kd = _distiller(num_steps=2)
    s_cpu = kd.fit()
    x, y = _data(120)
    kd_gpu = KernelDistillation.from_kernel(
        _kernel().cuda(), x.cuda(), y.cuda(), 0.05, 20, 5, num_steps=2,
        inducing_points=kd.inducing_points.cuda(),
    )  # fmt: skip
    s_gpu = kd_gpu.fit()
    test_x = torch.randn(13, 2, dtype=DT)
    torch.testing.assert_close(s_gpu.predict(test_x.cuda())[0].cpu(), s_cpu.predict(test_x)[0])
    # a copy: Module.cuda() moves the student in place (the reference would move with it)
    s_moved = copy.deepcopy(s_cpu).cuda()
    torch.testing.assert_close(s_moved.predict(test_x.cuda())[1].cpu(), s_cpu.predict(test_x)[1])


@requires_cuda
def test_from_sparse_weights_takes_cpu_weights_and_targets_for_cuda_inducing_points():
    kd = _distiller(n=40, m=8, b=3)
    kd.prepare()
    args = (kd.weight_values, kd.neighbour_indices, kd.train_y, 0.1)
    s_cpu = SparseLowRankStudent.from_sparse_weights(kd.kernel, kd.inducing_points, *args)
    # before: the kernel, weight_values and train_y stayed on the CPU and the precomputation
    # failed
    s_gpu = SparseLowRankStudent.from_sparse_weights(kd.kernel, kd.inducing_points.cuda(), *args)
    test_x = torch.randn(9, 2, dtype=DT)
    for got, want in zip(s_gpu.predict(test_x.cuda()), s_cpu.predict(test_x), strict=True):
        torch.testing.assert_close(got.cpu(), want)


@pytest.mark.parametrize("metric", ["lengthscale", "euclidean"])
def test_neighbour_metric(metric):
    x, y = _data(80)
    k = _kernel()
    k.base_kernel.lengthscale = torch.tensor([0.2, 5.0], dtype=DT)
    kd = KernelDistillation.from_kernel(k, x, y, 0.05, 15, 4, num_steps=0, neighbour_metric=metric)
    student = kd.fit()
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


def test_least_squares_init_handles_rank_deficient_rows_like_lstsq():
    x, y = _data(40)
    u = torch.cat([x[:6], x[:2]])  # two duplicated inducing points: K_UU(J, :) can be singular
    kd = KernelDistillation.from_kernel(_kernel(), x, y, 0.05, 8, 4, num_steps=0, inducing_points=u)
    kd.prepare()
    k_xu = kd.kernel(x, u).to_dense().detach().numpy()
    kuu = kd.inducing_covariance.numpy()
    for i in range(40):
        j = kd.neighbour_indices[i].numpy()
        ref = np.linalg.lstsq(kuu[j].T, k_xu[i], rcond=None)[0]  # minimum-norm solution
        np.testing.assert_allclose(kd.initial_weight_values[i].numpy(), ref, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(num_inducing=0), ValueError, "num_inducing must be a positive int"),
        (dict(num_inducing=True), ValueError, "num_inducing must be a positive int"),
        (dict(sparsity=2.5), ValueError, "sparsity must be a positive int"),
        (dict(num_steps=-1), ValueError, "num_steps must be a non-negative int"),
        (dict(kmeans_iters=-2), ValueError, "kmeans_iters"),
        (dict(chunk_size=-5), ValueError, "chunk_size must be a positive integer or None"),
        (dict(chunk_size=0), ValueError, "chunk_size"),
        (dict(chunk_size=2.5), ValueError, "chunk_size"),
        (dict(seed=-1), ValueError, "seed"),
        (dict(step_size=0.0), ValueError, "step_size"),
        (dict(step_size=float("nan")), ValueError, "step_size"),
        (
            dict(step_size=0.1, optimizer=lambda p: torch.optim.SGD(p, lr=0.1)),
            ValueError,
            "either step_size or optimizer",
        ),
        (dict(optimizer="adam"), TypeError, "optimizer must be callable"),
        (dict(callback=3), TypeError, "callback must be callable"),
        (dict(jitter=-1e-6), ValueError, "jitter"),
        (dict(jitter=float("nan")), ValueError, "jitter"),
        (dict(inducing_points=torch.zeros(5, 3, dtype=DT)), ValueError, "inducing_points"),
        (dict(neighbour_metric="cosine"), ValueError, "neighbour_metric"),
        (dict(learning_rate=0.1), TypeError, "learning_rate"),
        (dict(kernel="rbf"), TypeError, "kernel must be a gpytorch.kernels.Kernel"),
        (
            dict(kernel=gpytorch.kernels.RBFKernel(batch_shape=torch.Size([2])).to(DT)),
            ValueError,
            r"kernel must have no batch shape.*\(2,\)",
        ),
        (dict(train_x=torch.zeros(2, 30, 2, dtype=DT)), ValueError, "train_x must have shape"),
        (dict(train_x=[["a", "b"]]), TypeError, "train_x"),
        (dict(noise=float("inf")), ValueError, "noise"),
        (dict(noise=[0.1, 0.2]), ValueError, "noise"),
    ],
)
def test_from_kernel_names_the_bad_argument(kwargs, error, match):
    x, y = _data(30)
    args = dict(kernel=_kernel(), train_x=x, train_y=y, noise=0.1, num_inducing=5, sparsity=2)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        KernelDistillation.from_kernel(**args)


def _teacher_with(x, y, **changes):
    lik = gpytorch.likelihoods.GaussianLikelihood().to(DT)
    lik.noise = 0.1
    teacher = _Teacher(x, y, lik).to(DT)
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
    x, y = _data(30)
    teacher = build(x, y)
    with pytest.raises(error, match=match):
        KernelDistillation(teacher, 5, 2)


def test_one_dimensional_inputs_equal_a_column_of_inputs():
    # a teacher trained on x of shape (n,) and a student queried with (p,) equal the (n, 1) forms
    x = torch.linspace(-3, 3, 40, dtype=DT)
    y = torch.sin(2 * x)
    k = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).to(DT)
    k.base_kernel.lengthscale = 0.6
    lik = gpytorch.likelihoods.GaussianLikelihood().to(DT)
    lik.noise = 0.05
    teacher = _Teacher(x, y, lik).to(DT)
    teacher.covar_module = k
    flat = KernelDistillation(teacher, 8, 3, num_steps=2).fit()
    # the teacher's own noise: GPyTorch's setter rounded 0.05 through float32
    noise = lik.noise.detach()
    column = KernelDistillation.from_kernel(k, x.unsqueeze(-1), y, noise, 8, 3, num_steps=2).fit()
    test_x = torch.linspace(-3.5, 3.5, 17, dtype=DT)
    for got, want in zip(flat.predict(test_x), column.predict(test_x.unsqueeze(-1)), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert flat.predict(test_x)[0].shape == (17,)


def test_inspection_before_fit_prepares_the_least_squares_start():
    kd = _distiller(n=60, m=10, b=3)
    w = kd.dense_weights()  # prepares on first use
    assert w.shape == (60, 10) and int((w != 0).sum(-1).max()) <= 3
    kd2 = _distiller(n=60, m=10, b=3)
    error = kd2.frobenius_error()  # prepares on first use, too
    # independent: the dense residual of the row-wise least-squares start
    x = kd2.train_x
    k_xx = kd2.kernel(x, x).to_dense().detach()
    kuu = kd2.kernel(kd2.inducing_points, kd2.inducing_points).to_dense().detach()
    w2 = torch.zeros(60, 10, dtype=DT)
    for i in range(60):
        j = kd2.neighbour_indices[i]
        k_iu = kd2.kernel(x[i : i + 1], kd2.inducing_points).to_dense().detach().squeeze(0)
        w2[i, j] = torch.linalg.lstsq(kuu[j].T, k_iu.unsqueeze(-1)).solution.squeeze(-1)
    torch.testing.assert_close(w, w2, rtol=1e-7, atol=1e-9)
    want = float(torch.linalg.matrix_norm(k_xx - w2 @ kuu @ w2.T))
    assert error == pytest.approx(want, rel=1e-8)


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(kernel="rbf"), "kernel must be a gpytorch.kernels.Kernel"),
        (
            dict(inducing_points=torch.zeros(2, 5, 2, dtype=DT)),
            r"inducing_points must have shape \(m, d\)",
        ),
        (
            dict(inducing_covariance=torch.eye(4, dtype=DT)),
            r"inducing_covariance must have shape \(5, 5\)",
        ),
        (
            dict(predictive_covariance_correction=torch.eye(6, dtype=DT)),
            "predictive_covariance_correction must have shape",
        ),
        (dict(predictive_mean_weights=torch.zeros(4, dtype=DT)), "predictive_mean_weights"),
        (dict(sparsity=6), r"sparsity must be an int in \[1, m=5\]"),
        (dict(sparsity=True), "sparsity"),
        (dict(noise=0.0), "noise must be one positive variance"),
        (dict(noise=[0.1, 0.1]), "noise"),
        (dict(jitter=-1.0), "jitter"),
        (dict(jitter=float("nan")), "jitter"),
        (dict(neighbour_scale=torch.ones(3, dtype=DT)), "neighbour_scale must hold d=2"),
        (dict(neighbour_scale=torch.tensor([1.0, 0.0], dtype=DT)), "neighbour_scale"),
    ],
)
def test_student_constructor_names_the_bad_argument(changes, match):
    u = torch.randn(5, 2, generator=torch.Generator().manual_seed(0), dtype=DT)
    args = dict(
        kernel=_kernel(),
        inducing_points=u,
        inducing_covariance=torch.eye(5, dtype=DT),
        predictive_mean_weights=torch.zeros(5, dtype=DT),
        predictive_covariance_correction=torch.eye(5, dtype=DT),
        sparsity=2,
        noise=0.1,
    )
    SparseLowRankStudent(**args)  # the unchanged arguments are valid
    args.update(changes)
    with pytest.raises((TypeError, ValueError), match=match):
        SparseLowRankStudent(**args)


def test_student_from_sparse_weights_checks_the_pattern_and_the_noise():
    kd = _distiller(n=40, m=8, b=3)
    kd.prepare()
    args = (kd.kernel, kd.inducing_points, kd.weight_values, kd.neighbour_indices, kd.train_y)
    with pytest.raises(ValueError, match="weight_indices must have the shape of weight_values"):
        SparseLowRankStudent.from_sparse_weights(*args[:3], args[3][:, :2], args[4], 0.1)
    with pytest.raises(ValueError, match="noise must be one positive variance"):
        SparseLowRankStudent.from_sparse_weights(*args, -0.1)
    with pytest.raises(ValueError, match="train_y"):
        SparseLowRankStudent.from_sparse_weights(*args[:4], args[4][:-1], 0.1)


def test_float32_student_of_inputs_far_from_the_origin_is_as_good_as_at_the_origin():
    # A stationary kernel cannot tell x from x + 2000; in float32 the distance expansion used to
    # pick wrong neighbours for most rows there (mean errors of 0.4 on a unit-amplitude sine).
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
        kd = KernelDistillation.from_kernel(
            k32, (x + offset).float(), y.float(), 0.01, 50, 6, num_steps=3
        )
        mean = kd.fit().predict((test_x + offset).float())[0].double()
        assert float((mean - exact).abs().max()) < 0.05  # 0.037 in float64 at the origin


def test_coincident_inducing_points_without_jitter_name_the_jitter():
    # five distinct inputs, ten inducing points: k-means returns coincident centroids
    x = torch.arange(5, dtype=DT).repeat(20).unsqueeze(-1)
    kd = KernelDistillation.from_kernel(
        _kernel(1), x, torch.sin(x[:, 0]), 0.01, 10, 3, num_steps=1, jitter=0.0
    )
    student = kd.fit()
    assert torch.unique(student.inducing_points).numel() < 10
    # before: "torch.linalg.solve: ... The solver failed because the input matrix is singular"
    with pytest.raises(RuntimeError, match="positive jitter"):
        student.predict(torch.tensor([[0.5]], dtype=DT))
    student.jitter = None  # the default jitter predicts
    assert torch.isfinite(torch.stack(student.predict(torch.tensor([[0.5]], dtype=DT)))).all()
