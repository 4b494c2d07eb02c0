import warnings

import gpytorch
import numpy as np
import pytest
import torch

from gpsd.kernel_distillation import KernelDistillation, SparseLowRankStudent

DT = torch.float64


def _rbf(lengthscale, dtype=DT, ard_num_dims=None):
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=ard_num_dims))
    kernel = kernel.to(dtype)
    kernel.base_kernel.lengthscale = lengthscale
    kernel.outputscale = 1.0
    return kernel


def _dense_rbf(x1, x2, lengthscale):
    """The float64 RBF kernel of :func:`_rbf` from direct differences."""
    diff = (x1.to(DT).unsqueeze(-2) - x2.to(DT).unsqueeze(-3)) / lengthscale
    return torch.exp(-0.5 * diff.pow(2).sum(-1))


@pytest.mark.parametrize(
    ("n", "span", "lengthscale", "m", "b", "seed"),
    [(200, 5, 0.8, 40, 8, 0), (1000, 20, 1.0, 100, 10, 3)],
)
def test_least_squares_start_matches_lstsq_on_ill_conditioned_rows(
    n, span, lengthscale, m, b, seed
):
    # lengthscales several times the spacing of the inducing points: rows with cond(K_UU(J, :))
    # about 2e8 passed the old Cholesky-diagonal test; their normal-equation solutions had
    # residuals up to 4.1e-4 against 2.7e-11 from lstsq (max |w| 7503 against 5.0), and the
    # start's error was 1.2e-2 against 4.6e-7 from the lstsq start (1000 inputs, m = 100:
    # 55 rows, 2.0e-4 against 1.7e-6)
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 1, generator=gen, dtype=DT) * span
    kernel = _rbf(lengthscale)
    kd = KernelDistillation.from_kernel(kernel, x, torch.sin(x[:, 0]), 1e-2, m, b)
    kd.prepare()
    kuu = _dense_rbf(kd.inducing_points, kd.inducing_points, lengthscale).numpy()
    rhs = _dense_rbf(x, kd.inducing_points, lengthscale).numpy()
    idx = kd.neighbour_indices.numpy()
    ref = np.stack(
        [np.linalg.lstsq(kuu[j].T, r, rcond=None)[0] for j, r in zip(idx, rhs, strict=True)]
    )
    ref_resid = np.linalg.norm(np.einsum("nb,nbm->nm", ref, kuu[idx]) - rhs, axis=1)
    got = kd.initial_weight_values.numpy()
    got_resid = np.linalg.norm(np.einsum("nb,nbm->nm", got, kuu[idx]) - rhs, axis=1)
    assert np.all(got_resid <= 2 * ref_resid + 1e-14)
    assert kd.frobenius_error() <= 1.01 * kd.frobenius_error(torch.from_numpy(ref))


def test_loading_a_state_into_the_student_leaves_the_callers_and_the_distillations_tensors():
    # the student's buffers were the caller's inducing points and noise and the distillation's
    # K_UU and neighbour scale: loading another student's state moved the caller's points by up
    # to 3.1, set the caller's noise to 0.05 and the distillation's error from 2.40 to 35.7
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(100, 1, generator=gen, dtype=DT) * 5
    y = torch.sin(x[:, 0])
    u = torch.linspace(0, 5, 10, dtype=DT).unsqueeze(-1)
    noise = torch.tensor(0.01, dtype=DT)
    kd = KernelDistillation.from_kernel(
        _rbf(0.5), x, y, noise, 10, 3, num_steps=2, inducing_points=u
    )
    student = kd.fit()
    names = ("inducing_points", "inducing_covariance", "noise", "neighbour_scale")
    before = {name: getattr(kd, name).clone() for name in names}
    u_before, noise_before = u.clone(), noise.clone()
    other = KernelDistillation.from_kernel(_rbf(0.7), x, y, 0.05, 10, 3, num_steps=2)
    student.load_state_dict(other.fit().state_dict())
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
    built = SparseLowRankStudent(_rbf(0.5), *args, sparsity=3, noise=0.01)
    built.load_state_dict(student.state_dict())
    for arg, copy in zip(args, copies, strict=True):
        assert torch.equal(arg, copy)


def test_from_sparse_weights_evaluates_k_uu_as_the_distillation_does():
    # float32 inducing points on [0, 10]^2, lengthscale 0.1: the default K_UU, GPyTorch's in
    # float32, erred by 1.9e-4 from the float64 formula; the distillation's evaluation by 4.6e-8
    gen = torch.Generator().manual_seed(0)
    u = (torch.rand(300, 2, generator=gen, dtype=DT) * 10).float()
    n, b = 50, 4
    values = torch.rand(n, b, generator=gen)
    indices = torch.stack([torch.randperm(300, generator=gen)[:b] for _ in range(n)])
    kernel = _rbf(0.1, torch.float32)
    student = SparseLowRankStudent.from_sparse_weights(
        kernel, u, values, indices, torch.zeros(n), 1e-2
    )
    reference = _dense_rbf(u, u, 0.1)
    assert student.inducing_covariance.dtype == torch.float32
    torch.testing.assert_close(student.inducing_covariance.double(), reference, rtol=0, atol=2e-7)


@pytest.mark.parametrize("metric", ["lengthscale", "euclidean"])
def test_distillation_names_an_ard_kernel_of_another_dimension(metric):
    x = torch.rand(50, 2, dtype=DT)
    kernel = _rbf(torch.tensor([0.5, 0.6, 0.7]), ard_num_dims=3)
    with pytest.raises(ValueError, match="kernel has 3 lengthscales .* d=2"):
        KernelDistillation.from_kernel(kernel, x, x.sum(-1), 0.01, 10, 3, neighbour_metric=metric)


class _Teacher(gpytorch.models.ExactGP):
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
    # a teacher whose forward scaled the inputs was distilled as if covar_module acted on the
    # raw inputs, silently (an RBF teacher's student missed its mean by 0.5 on [0, 100]); a
    # standard teacher (1-d inputs spanning 145 lengthscales) must not warn; modes are kept
    gen = torch.Generator().manual_seed(0)
    x = (torch.rand(60, generator=gen, dtype=DT) * 100).to(dtype)
    for scale, warns in ((1.0, False), (0.1, True)):
        teacher = _Teacher(x, torch.sin(x / 10), scale).to(dtype)
        teacher.mean_module.constant.data.fill_(0.3)
        teacher.train(training)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            KernelDistillation(teacher, 10, 3)
        messages = [str(w.message) for w in caught]
        assert any("teacher.forward differs" in m for m in messages) == warns, messages
        assert all(module.training == training for module in teacher.modules())
