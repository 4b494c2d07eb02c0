import gpytorch
import pytest
import torch

from gpsd.kernel_distillation import KernelDistillation, SparseLowRankStudent

DT = torch.float64
MU = 1000.123456789  # not a float32 number


def _data(n=90, d=2, seed=0, offset=0.0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=gen, dtype=DT)
    y = torch.sin(2 * x).sum(-1) + offset
    return x, y


def _rbf():
    return gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).to(DT)


class _Teacher(gpytorch.models.ExactGP):
    def __init__(self, x, y, likelihood):
        super().__init__(x, y, likelihood)
        self.mean_module = gpytorch.means.ConstantMean()
        self.covar_module = _rbf()

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def test_python_float_noise_and_mean_constant_keep_float64_precision():
    # 0.05 and MU used to pass through a float32 tensor: noise 0.05000000074505806, mean
    # constant 1000.1234741210938, and a prediction far from the data off by 1.7e-5
    x, y = _data(offset=MU)
    kd = KernelDistillation.from_kernel(_rbf(), x, y, 0.05, 15, 4, num_steps=1, mean_constant=MU)
    student = kd.fit()
    assert kd.noise.item() == 0.05 and student.noise.item() == 0.05
    assert student.mean_constant.item() == MU
    far = torch.full((1, 2), 30.0, dtype=DT)  # k(far, U) = 0: the mean is the prior mean
    mean, _ = student.predict(far)
    torch.testing.assert_close(mean, torch.tensor([MU], dtype=DT), rtol=0, atol=1e-10)
    direct = SparseLowRankStudent.from_sparse_weights(
        kd.kernel, kd.inducing_points, kd.weight_values, kd.neighbour_indices, y.tolist(), 0.05,
        mean_constant=MU,
    )  # fmt: skip
    assert direct.noise.item() == 0.05 and direct.mean_constant.item() == MU
    torch.testing.assert_close(direct.predictive_mean_weights, student.predictive_mean_weights)


def test_teacher_constant_mean_keeps_float64_precision():
    x, y = _data(offset=MU)
    likelihood = gpytorch.likelihoods.GaussianLikelihood().to(DT)
    likelihood.noise = 0.05
    teacher = _Teacher(x, y, likelihood).to(DT)
    teacher.mean_module.constant = torch.tensor(MU, dtype=DT)
    student = KernelDistillation(teacher, 15, 4, num_steps=1).fit()
    assert student.mean_constant.item() == MU


def _blank(kernel, m, d=2, **kwargs):
    return SparseLowRankStudent(
        kernel, torch.zeros(m, d, dtype=DT), torch.eye(m, dtype=DT), torch.zeros(m, dtype=DT),
        torch.zeros(m, m, dtype=DT), sparsity=4, noise=1.0, **kwargs,
    )  # fmt: skip


def test_state_dict_carries_the_kernel_type():
    # RBF and Matérn students hold the same buffers: a Matérn-1/2 student loaded into one built
    # with an RBF kernel used to predict with the RBF (means off by 0.9)
    x, y = _data()
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=0.5)).to(DT)
    student = KernelDistillation.from_kernel(kernel, x, y, 0.05, 15, 4, num_steps=1).fit()
    test_x = torch.randn(7, 2, generator=torch.Generator().manual_seed(1), dtype=DT)
    m0, v0 = student.predict(test_x)
    blank = _blank(_rbf(), 15)
    blank.load_state_dict(student.state_dict())
    assert blank.kernel_type == "matern12"
    m1, v1 = blank.predict(test_x)
    torch.testing.assert_close(m1, m0)
    torch.testing.assert_close(v1, v0)


def test_state_dict_of_another_kernel_kind_is_refused_by_name():
    x, y = _data()
    periodic = gpytorch.kernels.PeriodicKernel().to(DT)
    student = KernelDistillation.from_kernel(periodic, x, y, 0.05, 15, 4, num_steps=1).fit()
    state = student.state_dict()
    state["_extra_state"] = dict(state["_extra_state"], kernel_type="rbf")
    with pytest.raises(ValueError, match="kernel is 'rbf'"):
        _blank(gpytorch.kernels.PeriodicKernel().to(DT), 15).load_state_dict(state)
    state["_extra_state"] = dict(state["_extra_state"], kernel_type="spline")
    with pytest.raises(ValueError, match="known kernel type"):
        _blank(_rbf(), 15).load_state_dict(state, strict=False)


def test_generic_kernel_of_another_dtype_than_the_inputs():
    # a float64 kernel with float32 inputs: the float32 student used to fail in linalg.solve
    # ("Expected A and B to have the same dtype") at its first prediction
    x, y = _data()
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.PeriodicKernel()).to(DT)
    s64 = KernelDistillation.from_kernel(kernel, x, y, 0.05, 15, 4, num_steps=1).fit()
    s32 = KernelDistillation.from_kernel(
        kernel, x.float(), y.float(), 0.05, 15, 4, num_steps=1
    ).fit()
    test_x = torch.randn(7, 2, generator=torch.Generator().manual_seed(1), dtype=DT)
    m32, v32 = s32.predict(test_x.float())
    assert m32.dtype == v32.dtype == torch.float32
    assert next(kernel.parameters()).dtype == DT  # the teacher's kernel is left alone
    m64, v64 = s64.predict(test_x)
    torch.testing.assert_close(m32.double(), m64, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(v32.double(), v64, rtol=1e-3, atol=1e-3)


def test_jitter_must_be_finite_and_non_negative_also_when_loaded():
    for bad in (float("inf"), float("nan"), -1e-6, "1e-6", True):
        with pytest.raises(ValueError, match="jitter must be a finite float"):
            _blank(_rbf(), 6, jitter=bad)
    student = _blank(_rbf(), 6, jitter=1e-6)
    state = student.state_dict()
    state["_extra_state"] = dict(state["_extra_state"], jitter=float("inf"))
    with pytest.raises(ValueError, match="jitter must be a finite float"):
        _blank(_rbf(), 6).load_state_dict(state)
    assert _blank(_rbf(), 6, jitter=0).jitter == 0.0


def test_prediction_in_blocks_of_rows_equals_one_row_at_a_time(monkeypatch):
    # predict used to hold the (p, m) distances of all p rows at once
    import gpsd.kernel_distillation.sparse_low_rank_student as module

    x, y = _data()
    student = KernelDistillation.from_kernel(_rbf(), x, y, 0.05, 15, 4, num_steps=1).fit()
    test_x = torch.randn(50, 2, generator=torch.Generator().manual_seed(2), dtype=DT)
    rows = [student.prediction_module()(test_x[i : i + 1]) for i in range(50)]
    blocks = []
    monkeypatch.setattr(module, "_PREDICT_CHUNK_ELEMENTS", 3 * (15 + 2 * 16 + 4 * 2))
    monkeypatch.setattr(
        student,
        "_predict",
        lambda rows_x, f=student._predict: blocks.append(len(rows_x)) or f(rows_x),
    )
    mean, var = student.predict(test_x)
    assert blocks == [3] * 16 + [2]
    torch.testing.assert_close(mean, torch.cat([m for m, _ in rows]), rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(var, torch.cat([v for _, v in rows]), rtol=1e-13, atol=1e-13)
    values, indices = student.interpolation_weights(test_x)
    assert values.shape == indices.shape == (50, 4)
    assert student.predict(test_x[:0])[0].shape == (0,)
