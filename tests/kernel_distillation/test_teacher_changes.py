import copy

import gpytorch
import pytest
import torch

from gpsd.kernel_distillation import KernelDistillation

DT = torch.float64


class _Teacher(gpytorch.models.ExactGP):
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
    # the distiller kept the teacher's live kernel next to a copied noise and (after prepare) a
    # cached K_UU: hyperparameters changed before fit() moved the student's mean by 0.89 (0.61
    # without prepare) from the distillation of the teacher as given; now they agree to 1e-10
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(80, 2, generator=gen, dtype=DT)
    y = torch.sin(2 * x).sum(-1)
    likelihood = gpytorch.likelihoods.GaussianLikelihood().to(DT)
    likelihood.noise = torch.tensor(0.05, dtype=DT)
    teacher = _Teacher(x, y, likelihood)
    original = copy.deepcopy(teacher)
    kd = KernelDistillation(teacher, 15, 4, num_steps=3)
    if prepare_first:
        kd.prepare()
    teacher.covar_module.base_kernel.lengthscale = torch.tensor([0.3, 0.4], dtype=DT)
    teacher.covar_module.outputscale = 0.5
    student = kd.fit()
    reference = KernelDistillation(original, 15, 4, num_steps=3)
    expected = reference.fit()
    test_x = torch.randn(10, 2, generator=gen, dtype=DT)
    mean, variance = student.predict(test_x)
    ref_mean, ref_variance = expected.predict(test_x)
    torch.testing.assert_close(mean, ref_mean, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(variance, ref_variance, rtol=1e-10, atol=1e-10)
    assert kd.frobenius_errors == pytest.approx(reference.frobenius_errors, rel=1e-10)


def test_line_search_does_not_jump_to_the_mirror_image_of_w():
    # ten copies of one input: K_XX = W K_UU W^T holds exactly and the exact line search went on
    # to the global minimum of the quartic at -W (the objective is even in W, the student is
    # not): the student predicted a mean of -4.436 where the exact GP gives +4.436
    x = torch.tensor([[0.3, -0.2]], dtype=DT).repeat(10, 1)
    y = torch.arange(10, dtype=DT)
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).to(DT)
    kd = KernelDistillation.from_kernel(kernel, x, y, 0.1, 3, 2, num_steps=5)
    student = kd.fit()
    test_x = torch.tensor([[0.3, -0.2], [0.8, 0.4]], dtype=DT)
    with torch.no_grad():
        system = kernel(x).to_dense() + 0.1 * torch.eye(10, dtype=DT)
        cross = kernel(test_x, x).to_dense()
        mean = cross @ torch.linalg.solve(system, y)
        explained = (cross * torch.linalg.solve(system, cross.T).T).sum(-1)
        variance = kernel(test_x, diag=True) - explained
    got_mean, got_variance = student.predict(test_x)
    torch.testing.assert_close(got_mean, mean, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_variance, variance, rtol=1e-6, atol=1e-6)
