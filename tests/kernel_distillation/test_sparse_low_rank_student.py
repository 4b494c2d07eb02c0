"""Tests of SparseLowRankStudent: predictions against dense formulas and loops, export,
saved state, and the checks of its constructor and of from_sparse_weights."""

import gpytorch
import pytest
import torch
from conftest import requires_cuda
from kd_reference import (
    DT,
    LINE_Y,
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
    unit_rbf,
)

import gpsd
from gpsd.kernel_distillation import (
    KernelDistillation,
    SparseLowRankStudent,
)


def test_fast_prediction_equals_the_dense_formula():
    kd = reference_distiller(n=90, m=15, b=4, max_iter=2)
    student = kd.fit().student
    y, sigma2 = kd.train_y, kd.noise
    w = kd.dense_weights()
    kuu = kd.inducing_covariance
    k_tilde = w @ kuu @ w.T
    test_x = torch.randn(11, 2, dtype=DT)
    # W_* by a naive loop: b nearest inducing points, b x b solve
    u = kd.inducing_points
    w_star = torch.zeros(11, 15, dtype=DT)
    for p in range(11):
        ell = kd.covar_module.base_kernel.lengthscale.detach()  # neighbours in the kernel's metric
        j = torch.argsort((((u - test_x[p]) / ell) ** 2).sum(-1))[:4]
        k_j = kd.covar_module(test_x[p : p + 1], u[j]).to_dense().detach().squeeze(0)
        local = kuu[j][:, j] + student._relative_jitter() * kuu.diagonal().mean() * torch.eye(
            4, dtype=DT
        )
        w_star[p, j] = torch.linalg.solve(local, k_j)
    k_star_x = w_star @ kuu @ w.T
    system = k_tilde + sigma2 * torch.eye(90, dtype=DT)
    mean = k_star_x @ torch.linalg.solve(system, y)
    var = kd.covar_module(test_x, diag=True).detach() - (
        k_star_x * torch.linalg.solve(system, k_star_x.T).T
    ).sum(-1)
    prediction = student.predict(test_x)
    sm, sv = prediction.mean, prediction.variance
    torch.testing.assert_close(sm, mean, rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(sv, var, rtol=1e-8, atol=1e-10)
    values, idx = student.interpolation_weights(test_x)
    torch.testing.assert_close(torch.zeros(11, 15, dtype=DT).scatter(-1, idx, values), w_star)


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
    prediction = student.predict(test_x)
    got_mean, got_var = prediction.mean, prediction.variance
    torch.testing.assert_close(got_mean, mean, rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(got_var, var, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("nu", [0.5, 1.5, 2.5])
def test_plain_matern_evaluation_matches_gpytorch(nu):
    x, y = reference_data(60)
    k = gpytorch.kernels.MaternKernel(nu=nu, ard_num_dims=2).to(DT)
    k.lengthscale = torch.tensor([0.6, 1.1], dtype=DT)
    student = (
        KernelDistillation.from_data(x, y, k, noise=0.05, num_inducing=12, sparsity=4, max_iter=1)
        .fit()
        .student
    )
    assert student.kernel_type != "generic"
    test_x = torch.randn(7, 2, dtype=DT)
    _, idx = student.interpolation_weights(test_x)
    cross, diag = student._cross_covariance(test_x, idx)
    ref = k(test_x.unsqueeze(-2), student.inducing_points[idx]).to_dense().detach().squeeze(-2)
    torch.testing.assert_close(cross, ref)
    torch.testing.assert_close(diag, torch.ones(7, dtype=DT))


def test_prediction_in_blocks_of_rows_equals_one_row_at_a_time(monkeypatch):
    # blocks of rows whose temporaries hold gpsd.settings.max_chunk_elements numbers: 3 rows of
    # (m + 2 b^2 + b d) = 15 + 32 + 8 each here
    x, y = offset_data()
    student = (
        KernelDistillation.from_data(
            x, y, scaled_rbf(), noise=0.05, num_inducing=15, sparsity=4, max_iter=1
        )
        .fit()
        .student
    )
    test_x = torch.randn(50, 2, generator=torch.Generator().manual_seed(2), dtype=DT)
    rows = [student.prediction_module()(test_x[i : i + 1]) for i in range(50)]
    blocks = []
    monkeypatch.setattr(
        student,
        "_predict",
        lambda rows_x, f=student._predict: blocks.append(len(rows_x)) or f(rows_x),
    )
    with gpsd.settings.max_chunk_elements(3 * (15 + 2 * 16 + 4 * 2)):
        prediction = student.predict(test_x)
        assert blocks == [3] * 16 + [2]
        values, indices = student.interpolation_weights(test_x)
        assert values.shape == indices.shape == (50, 4)
        assert student.predict(test_x[:0]).mean.shape == (0,)
    mean, var = prediction.mean, prediction.variance
    torch.testing.assert_close(mean, torch.cat([m for m, _ in rows]), rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(var, torch.cat([v for _, v in rows]), rtol=1e-13, atol=1e-13)
    blocks.clear()
    student.predict(test_x)  # the default block holds every row here
    assert blocks == [50]


def test_coincident_inducing_points_without_jitter_name_the_jitter():
    # five distinct inputs, ten inducing points: k-means returns coincident centroids
    x = torch.arange(5, dtype=DT).repeat(20).unsqueeze(-1)
    kd = KernelDistillation.from_data(
        x,
        torch.sin(x[:, 0]),
        ard_kernel(1),
        noise=0.01,
        num_inducing=10,
        sparsity=3,
        max_iter=1,
        jitter=0.0,
    )
    student = kd.fit().student
    assert torch.unique(student.inducing_points).numel() < 10
    # a message that names the jitter, not torch.linalg.solve's "the input matrix is singular"
    with pytest.raises(RuntimeError, match="positive jitter"):
        student.predict(torch.tensor([[0.5]], dtype=DT))
    student.jitter = None  # the default jitter predicts
    assert torch.isfinite(
        torch.stack(mean_and_variance(student.predict(torch.tensor([[0.5]], dtype=DT))))
    ).all()


def test_export_of_the_prediction_path():
    student = reference_distiller(max_iter=1).fit().student
    assert student.exportable
    test_x = torch.randn(9, 2, dtype=DT)
    ref = student.predict(test_x)
    program = torch.export.export(student.prediction_module(), (test_x,))
    out = program.module()(test_x)
    torch.testing.assert_close(out[0], ref.mean)
    torch.testing.assert_close(out[1], ref.variance)


def test_export_with_a_dynamic_number_of_test_points():
    student = reference_distiller(max_iter=1).fit().student
    batch = torch.export.Dim("batch", min=2, max=4096)
    program = torch.export.export(
        student.prediction_module(), (torch.randn(9, 2, dtype=DT),), dynamic_shapes=({0: batch},)
    )
    test_x = torch.randn(31, 2, dtype=DT)
    out = program.module()(test_x)
    ref = student.predict(test_x)
    torch.testing.assert_close(out[0], ref.mean)
    torch.testing.assert_close(out[1], ref.variance)


def test_generic_kernel_predicts_but_is_not_exportable():
    x, y = reference_data(60)
    k = (gpytorch.kernels.RBFKernel() + gpytorch.kernels.LinearKernel()).to(DT)
    student = (
        KernelDistillation.from_data(x, y, k, noise=0.05, num_inducing=12, sparsity=4, max_iter=2)
        .fit()
        .student
    )
    assert not student.exportable
    assert all(p.requires_grad for p in k.parameters())  # the teacher's kernel is left alone
    test_x = torch.randn(5, 2, dtype=DT)
    prediction = student.predict(test_x)
    mean, var = prediction.mean, prediction.variance
    assert mean.shape == var.shape == (5,) and bool(torch.isfinite(mean).all())
    eager = student.prediction_module()(test_x)  # the bare path still runs eagerly
    torch.testing.assert_close(eager[0], mean)
    # tracing it names the reason, not an opaque data-dependent error
    with pytest.raises(Exception, match="kernel is not exportable"):
        torch.export.export(student.prediction_module(), (test_x,))


def test_prediction_module_of_a_generic_kernel_is_differentiable_in_x():
    # as the RBF and Matérn students are: a kernel kept as a GPyTorch module gives a gradient too
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


def test_generic_kernel_of_another_dtype_than_the_inputs():
    # a float64 kernel with float32 inputs: the float32 student must predict (not fail in
    # linalg.solve with "Expected A and B to have the same dtype")
    x, y = offset_data()
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.PeriodicKernel()).to(DT)
    s64 = (
        KernelDistillation.from_data(
            x, y, kernel, noise=0.05, num_inducing=15, sparsity=4, max_iter=1
        )
        .fit()
        .student
    )
    s32 = (
        KernelDistillation.from_data(
            x.float(), y.float(), kernel, noise=0.05, num_inducing=15, sparsity=4, max_iter=1
        )
        .fit()
        .student
    )
    test_x = torch.randn(7, 2, generator=torch.Generator().manual_seed(1), dtype=DT)
    prediction = s32.predict(test_x.float())
    m32, v32 = prediction.mean, prediction.variance
    assert m32.dtype == v32.dtype == torch.float32
    assert next(kernel.parameters()).dtype == DT  # the teacher's kernel is left alone
    prediction = s64.predict(test_x)
    m64, v64 = prediction.mean, prediction.variance
    torch.testing.assert_close(m32.double(), m64, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(v32.double(), v64, rtol=1e-3, atol=1e-3)


def _blank(kernel, m, d=2, sparsity=4, **kwargs):
    """A student with m zero inducing points and zero weights, to load a state into."""
    return SparseLowRankStudent(
        kernel, torch.zeros(m, d, dtype=DT), torch.eye(m, dtype=DT), torch.zeros(m, dtype=DT),
        torch.zeros(m, m, dtype=DT), sparsity=sparsity, noise=1.0, **kwargs,
    )  # fmt: skip


def test_state_dict_round_trip_and_dtype_move():
    student = reference_distiller(max_iter=1).fit().student
    test_x = torch.randn(9, 2, dtype=DT)
    prediction = student.predict(test_x)
    m0, v0 = prediction.mean, prediction.variance
    m = student.num_inducing
    blank = _blank(ard_kernel(), m, sparsity=5)
    blank.load_state_dict(student.state_dict())
    prediction = blank.predict(test_x)
    m1, v1 = prediction.mean, prediction.variance
    torch.testing.assert_close(m1, m0)
    torch.testing.assert_close(v1, v0)
    s32 = student.to(torch.float32)
    prediction = s32.predict(test_x.float())
    m2, v2 = prediction.mean, prediction.variance
    assert m2.dtype == torch.float32
    torch.testing.assert_close(m2.double(), m0, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(v2.double(), v0, rtol=1e-3, atol=1e-3)
    assert student.storage_bytes() == 4 * (2 * m * m + m * 2 + 2 + m + 2 + 2 + 1)


def test_state_dict_carries_sparsity_and_jitter():
    student = reference_distiller(max_iter=1).fit().student  # sparsity 5
    test_x = torch.randn(9, 2, dtype=DT)
    prediction = student.predict(test_x)
    m0, v0 = prediction.mean, prediction.variance
    m = student.num_inducing
    blank = _blank(ard_kernel(), m, sparsity=2, jitter=1e-3)
    blank.load_state_dict(student.state_dict())  # built with sparsity 2, jitter 1e-3
    assert (blank.sparsity, blank.jitter) == (student.sparsity, student.jitter)
    prediction = blank.predict(test_x)
    m1, v1 = prediction.mean, prediction.variance
    torch.testing.assert_close(m1, m0)
    torch.testing.assert_close(v1, v0)
    state = student.state_dict()
    state["_extra_state"] = {"sparsity": m + 1, "jitter": None}
    with pytest.raises(ValueError, match="saved sparsity"):
        blank.load_state_dict(state)


def test_state_dict_carries_the_kernel_type():
    # RBF and Matérn students hold the same buffers: a Matérn-1/2 student loaded into one built
    # with an RBF kernel must predict with the Matérn kernel (the RBF's means are off by 0.9)
    x, y = offset_data()
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=0.5)).to(DT)
    student = (
        KernelDistillation.from_data(
            x, y, kernel, noise=0.05, num_inducing=15, sparsity=4, max_iter=1
        )
        .fit()
        .student
    )
    test_x = torch.randn(7, 2, generator=torch.Generator().manual_seed(1), dtype=DT)
    prediction = student.predict(test_x)
    m0, v0 = prediction.mean, prediction.variance
    blank = _blank(scaled_rbf(), 15)
    blank.load_state_dict(student.state_dict())
    assert blank.kernel_type == "matern12"
    prediction = blank.predict(test_x)
    m1, v1 = prediction.mean, prediction.variance
    torch.testing.assert_close(m1, m0)
    torch.testing.assert_close(v1, v0)


def test_state_dict_of_another_kernel_kind_is_refused_by_name():
    x, y = offset_data()
    periodic = gpytorch.kernels.PeriodicKernel().to(DT)
    student = (
        KernelDistillation.from_data(
            x, y, periodic, noise=0.05, num_inducing=15, sparsity=4, max_iter=1
        )
        .fit()
        .student
    )
    state = student.state_dict()
    state["_extra_state"] = dict(state["_extra_state"], kernel_type="rbf")
    with pytest.raises(ValueError, match="kernel is 'rbf'"):
        _blank(gpytorch.kernels.PeriodicKernel().to(DT), 15).load_state_dict(state)
    state["_extra_state"] = dict(state["_extra_state"], kernel_type="spline")
    with pytest.raises(ValueError, match="known kernel type"):
        _blank(scaled_rbf(), 15).load_state_dict(state, strict=False)


def test_jitter_must_be_finite_and_non_negative_also_when_loaded():
    for bad in (float("inf"), float("nan"), -1e-6, "1e-6", True):
        with pytest.raises(ValueError, match="jitter must be a finite float"):
            _blank(scaled_rbf(), 6, jitter=bad)
    student = _blank(scaled_rbf(), 6, jitter=1e-6)
    state = student.state_dict()
    state["_extra_state"] = dict(state["_extra_state"], jitter=float("inf"))
    with pytest.raises(ValueError, match="jitter must be a finite float"):
        _blank(scaled_rbf(), 6).load_state_dict(state)
    assert _blank(scaled_rbf(), 6, jitter=0).jitter == 0.0


def test_loading_a_state_into_the_student_leaves_the_callers_and_the_distillations_tensors():
    # the student's buffers are copies: were they the caller's inducing points and noise and
    # the distillation's K_UU and neighbour scale, loading another student's state would move
    # the caller's points by up to 3.1, set the caller's noise to 0.05 and the distillation's
    # error from 2.40 to 35.7
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(100, 1, generator=gen, dtype=DT) * 5
    y = torch.sin(x[:, 0])
    u = torch.linspace(0, 5, 10, dtype=DT).unsqueeze(-1)
    noise = torch.tensor(0.01, dtype=DT)
    kd = KernelDistillation.from_data(
        x, y, unit_rbf(0.5), noise=noise, num_inducing=10, sparsity=3, max_iter=2, inducing_points=u
    )
    student = kd.fit().student
    names = ("inducing_points", "inducing_covariance", "noise", "neighbour_scale")
    before = {name: getattr(kd, name).clone() for name in names}
    u_before, noise_before = u.clone(), noise.clone()
    other = KernelDistillation.from_data(
        x, y, unit_rbf(0.7), noise=0.05, num_inducing=10, sparsity=3, max_iter=2
    )
    student.load_state_dict(other.fit().student.state_dict())
    assert torch.equal(u, u_before) and torch.equal(noise, noise_before)
    for name, value in before.items():
        assert torch.equal(getattr(kd, name), value), name
    assert kd.frobenius_error() == pytest.approx(kd.frobenius_errors[-1], rel=1e-12)

    m = 10
    args = [
        torch.rand(m, 1, generator=gen, dtype=DT),
        torch.eye(m, dtype=DT),
        torch.zeros(m, dtype=DT),
        torch.zeros(m, m, dtype=DT),
    ]
    copies = [a.clone() for a in args]
    built = SparseLowRankStudent(unit_rbf(0.5), *args, sparsity=3, noise=0.01)
    built.load_state_dict(student.state_dict())
    for arg, copy in zip(args, copies, strict=True):
        assert torch.equal(arg, copy)


def test_from_sparse_weights_evaluates_k_uu_as_the_distillation_does():
    # float32 inducing points on [0, 10]^2, lengthscale 0.1: GPyTorch's K_UU in float32 errs by
    # 1.9e-4 from the float64 formula, the distillation's evaluation (the default) by 4.6e-8
    gen = torch.Generator().manual_seed(0)
    u = (torch.rand(300, 2, generator=gen, dtype=DT) * 10).float()
    n, b = 50, 4
    values = torch.rand(n, b, generator=gen)
    indices = torch.stack([torch.randperm(300, generator=gen)[:b] for _ in range(n)])
    kernel = unit_rbf(0.1, torch.float32)
    student = SparseLowRankStudent.from_sparse_weights(
        kernel, u, values, indices, torch.zeros(n), 1e-2
    )
    reference = dense_unit_rbf(u, u, 0.1)
    assert student.inducing_covariance.dtype == torch.float32
    torch.testing.assert_close(student.inducing_covariance.double(), reference, rtol=0, atol=2e-7)


def test_from_sparse_weights_takes_array_indices_and_refuses_a_kernel_name():
    kd = line_distiller()
    student = kd.fit().student
    test_x = torch.linspace(0, 1, 15, dtype=DT).unsqueeze(-1)
    args = (kd.inducing_points, kd.weight_values)
    rebuilt = SparseLowRankStudent.from_sparse_weights(
        scaled_rbf(), *args, kd.neighbour_indices.numpy(), LINE_Y, 0.01
    )
    for got, expected in zip(
        mean_and_variance(rebuilt.predict(test_x)),
        mean_and_variance(student.predict(test_x)),
        strict=True,
    ):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    with pytest.raises(TypeError, match="covar_module must be a gpytorch.kernels.Kernel"):
        SparseLowRankStudent.from_sparse_weights("rbf", *args, kd.neighbour_indices, LINE_Y, 0.01)
    with pytest.raises(TypeError, match="weight_indices must hold integer indices"):
        SparseLowRankStudent.from_sparse_weights(
            scaled_rbf(), *args, kd.weight_values, LINE_Y, 0.01
        )


@requires_cuda
def test_from_sparse_weights_takes_cpu_weights_and_targets_for_cuda_inducing_points():
    kd = reference_distiller(n=40, m=8, b=3)
    kd.prepare()
    args = (kd.weight_values, kd.neighbour_indices, kd.train_y, 0.1)
    s_cpu = SparseLowRankStudent.from_sparse_weights(kd.covar_module, kd.inducing_points, *args)
    # the kernel, weight_values and train_y follow the inducing points to the GPU
    s_gpu = SparseLowRankStudent.from_sparse_weights(
        kd.covar_module, kd.inducing_points.cuda(), *args
    )
    test_x = torch.randn(9, 2, dtype=DT)
    for got, want in zip(
        mean_and_variance(s_gpu.predict(test_x.cuda())),
        mean_and_variance(s_cpu.predict(test_x)),
        strict=True,
    ):
        torch.testing.assert_close(got.cpu(), want)


def test_from_sparse_weights_checks_the_indices():
    x, y = sine_data(n=20)
    u = x[:5].clone()
    values = torch.rand(20, 2, generator=torch.Generator().manual_seed(1), dtype=DT)
    idx = torch.randint(5, (20, 2), generator=torch.Generator().manual_seed(2))
    SparseLowRankStudent.from_sparse_weights(iso_kernel(), u, values, idx, y, 0.1)  # valid
    # float indices are refused, not truncated
    with pytest.raises(TypeError, match="weight_indices must hold integer indices"):
        SparseLowRankStudent.from_sparse_weights(iso_kernel(), u, values, idx + 0.7, y, 0.1)
    for bad in (-1, 5):
        wrong = idx.clone()
        wrong[3, 1] = bad
        with pytest.raises(ValueError, match=r"weight_indices must lie in \[0, m=5\)"):
            SparseLowRankStudent.from_sparse_weights(iso_kernel(), u, values, wrong, y, 0.1)
    with pytest.raises(ValueError, match=r"train_y must have shape \(n=20,\)"):
        SparseLowRankStudent.from_sparse_weights(iso_kernel(), u, values, idx, y.expand(1, 20), 0.1)


def test_student_from_sparse_weights_checks_the_pattern_and_the_noise():
    kd = reference_distiller(n=40, m=8, b=3)
    kd.prepare()
    args = (kd.covar_module, kd.inducing_points, kd.weight_values, kd.neighbour_indices, kd.train_y)
    with pytest.raises(ValueError, match="weight_indices must have the shape of weight_values"):
        SparseLowRankStudent.from_sparse_weights(*args[:3], args[3][:, :2], args[4], 0.1)
    with pytest.raises(ValueError, match="noise must be one positive variance"):
        SparseLowRankStudent.from_sparse_weights(*args, -0.1)
    with pytest.raises(ValueError, match="train_y"):
        SparseLowRankStudent.from_sparse_weights(*args[:4], args[4][:-1], 0.1)


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(covar_module="rbf"), "covar_module must be a gpytorch.kernels.Kernel"),
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
        covar_module=ard_kernel(),
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


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(inducing_covariance=torch.full((5, 5), float("nan"), dtype=DT)), "inducing_cov"),
        (
            dict(predictive_covariance_correction=torch.full((5, 5), float("inf"), dtype=DT)),
            "predictive_covariance_correction must be finite",
        ),
        (dict(noise=float("inf")), "noise must be one positive variance"),
        (dict(mean_constant=float("nan")), "mean_constant must be one finite number"),
        (dict(neighbour_scale=torch.tensor([1.0, float("inf")], dtype=DT)), "neighbour_scale"),
    ],
)
def test_student_constructor_rejects_non_finite_values(changes, match):
    # each of these would predict NaN (or, for the scale, pick arbitrary neighbours)
    args = dict(
        covar_module=iso_kernel(),
        inducing_points=torch.randn(5, 2, generator=torch.Generator().manual_seed(0), dtype=DT),
        inducing_covariance=torch.eye(5, dtype=DT),
        predictive_mean_weights=torch.zeros(5, dtype=DT),
        predictive_covariance_correction=torch.eye(5, dtype=DT),
        sparsity=2,
        noise=0.1,
    )
    SparseLowRankStudent(**args)
    args.update(changes)
    with pytest.raises(ValueError, match=match):
        SparseLowRankStudent(**args)


@pytest.mark.parametrize("shape", [(5, 5), (1, 5)])
def test_student_refuses_predictive_mean_weights_with_a_batch_dimension(shape):
    # refused by name, not failing later inside an index or a broadcast
    u = torch.randn(5, 2, generator=torch.Generator().manual_seed(0), dtype=DT)
    kernel = gpytorch.kernels.RBFKernel().to(DT)
    with pytest.raises(ValueError, match=r"predictive_mean_weights must have shape \(5,\)"):
        SparseLowRankStudent(
            kernel, u, torch.eye(5, dtype=DT), torch.zeros(shape, dtype=DT),
            torch.eye(5, dtype=DT), sparsity=2, noise=0.1,
        )  # fmt: skip


def test_predict_returns_a_latent_prediction_and_include_noise_adds_the_teachers_noise():
    x, y = reference_data(80)
    lik = gpytorch.likelihoods.GaussianLikelihood().to(DT)
    lik.noise = 0.07
    teacher = Teacher(x, y, lik).to(DT)
    student = KernelDistillation(teacher, num_inducing=12, sparsity=4, max_iter=2).fit().student
    assert student.noise.item() == lik.noise.item()  # the student keeps the teacher's noise
    test_x = torch.randn(11, 2, generator=torch.Generator().manual_seed(3), dtype=DT)
    latent = student.predict(test_x)
    assert isinstance(latent, gpsd.Prediction) and latent.covariance is None
    assert latent.mean.shape == latent.variance.shape == (11,)
    torch.testing.assert_close(latent.stddev, latent.variance.sqrt())
    # the latent variance is the dense formula's, k(x, x) - w V w^T, from the interpolation rows
    values, indices = student.interpolation_weights(test_x)
    w = torch.zeros(11, 12, dtype=DT).scatter(-1, indices, values)
    with torch.no_grad():
        prior = teacher.covar_module(test_x, diag=True)
    latent_variance = prior - ((w @ student.predictive_covariance_correction) * w).sum(-1)
    torch.testing.assert_close(latent.variance, latent_variance, rtol=1e-10, atol=1e-12)
    noisy = student.predict(test_x, include_noise=True)
    torch.testing.assert_close(noisy.mean, latent.mean, rtol=0, atol=0)
    torch.testing.assert_close(noisy.variance, latent.variance + lik.noise.detach(), rtol=0, atol=0)
    mvn = student(test_x)
    assert isinstance(mvn, gpytorch.distributions.MultivariateNormal)
    torch.testing.assert_close(mvn.mean, latent.mean, rtol=0, atol=0)
    torch.testing.assert_close(mvn.variance, latent.variance, rtol=0, atol=0)
    torch.testing.assert_close(mvn.covariance_matrix, torch.diag(latent.variance), rtol=0, atol=0)
    with pytest.raises(TypeError):
        student.predict(test_x, True)  # include_noise is keyword-only
