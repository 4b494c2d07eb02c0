"""Chains of posterior modules stay cheap, and the teacher's frozen copies stay in eval mode."""

import gpytorch
import torch
from gpr_reference import PlainGP as GP

from gpsd import DistributionCentricGPR, PosteriorKernel, PosteriorMean
from gpsd.data import xsinx_regression

D = torch.float64


def _count_batch_shape_reads(monkeypatch):
    """Count every read of a kernel's batch_shape (GPyTorch's property and gpsd's override)."""
    reads = [0]
    for cls in (gpytorch.kernels.Kernel, PosteriorKernel):
        prop = cls.__dict__["batch_shape"]

        def counted(self, fget=prop.fget):
            reads[0] += 1
            return fget(self)

        monkeypatch.setattr(cls, "batch_shape", property(counted, prop.fset))
    return reads


def test_a_chain_reads_each_batch_shape_once_per_level(monkeypatch):
    """GPyTorch asks every kernel below for its batch shape, and each of those asks all below it
    again: 2^depth reads for a chain of posterior kernels (an iterated distribution-centric
    predict at T = 16 took 27 s for 20 points). Now one read per level."""
    x, y = xsinx_regression(n=10)
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).double()
    model = DistributionCentricGPR(x, y, kernel, noise=[0.5] * 16, method="iterated")
    chain = model.iterated_models()[-1].covar_module  # 16 posterior kernels deep
    reads = _count_batch_shape_reads(monkeypatch)
    assert chain.batch_shape == torch.Size()
    assert reads[0] < 3 * 16  # was 2^16 and more
    # the same answer as GPyTorch's walk over every kernel below (on a batched teacher)
    batched = gpytorch.kernels.RBFKernel(batch_shape=torch.Size([3])).double()
    teacher = GP(
        x.unsqueeze(-1),
        y,
        gpytorch.likelihoods.GaussianLikelihood(),
        gpytorch.means.ZeroMean(),
        batched,
    )
    teacher = teacher.double().eval()
    outer = PosteriorKernel(teacher)
    walked = torch.broadcast_shapes(
        outer._batch_shape, *[k.batch_shape for k in outer.sub_kernels()]
    )
    assert outer.batch_shape == walked == torch.Size([3])


def test_student_of_an_sgpr_teacher_trains(monkeypatch):
    """A student in training mode put the teacher's frozen InducingPointKernel in training mode,
    where it refuses k(X, x) ("x1 should equal x2 in training mode"). Its marginal likelihood is
    checked against the teacher's own posterior (GPyTorch's SGPR prediction) and a dense formula."""
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(40, 1, generator=gen, dtype=D) * 4
    y = torch.sin(2 * x).sum(-1)
    likelihood = gpytorch.likelihoods.GaussianLikelihood().to(D)
    likelihood.noise = 0.05
    base = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).to(D)
    sgpr = gpytorch.kernels.InducingPointKernel(base, x[:6].clone(), likelihood).to(D)
    teacher = GP(x, y, likelihood, gpytorch.means.ZeroMean(), sgpr).eval()
    new_x = torch.rand(10, 1, generator=gen, dtype=D) * 4
    new_y = torch.cos(new_x).sum(-1)
    student_likelihood = gpytorch.likelihoods.GaussianLikelihood().to(D)
    student_likelihood.noise = 0.1
    student = GP(new_x, new_y, student_likelihood, PosteriorMean(teacher), PosteriorKernel(teacher))
    student.train()
    assert not student.covar_module.prior_covar.training
    assert not student.mean_module.prior_covar.training and student.covar_module.training
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(student_likelihood, student)
    got = mll(student(new_x), new_y)
    with torch.no_grad(), gpytorch.settings.fast_pred_var(False):
        prior = teacher(new_x)  # the teacher's posterior at the new inputs
    cov = prior.covariance_matrix + 0.1 * torch.eye(10, dtype=D)
    want = torch.distributions.MultivariateNormal(prior.mean, cov).log_prob(new_y) / 10
    torch.testing.assert_close(got.detach(), want, rtol=1e-8, atol=1e-10)
    student.eval()
    assert not student.covar_module.training and not student.covar_module.prior_covar.training
