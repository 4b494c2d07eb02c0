"""PosteriorKernel: the teacher's posterior covariance as a prior kernel; students on new data, chains, modes and gradients."""

import gpytorch
import pytest
import torch
from gpr_reference import PlainGP, exact_settings, matern_teacher

from gpsd import DistributionCentricGPR, PosteriorKernel, PosteriorMean
from gpsd.data import xsinx_regression

DTYPE = torch.float64


@pytest.fixture
def teacher():
    return matern_teacher()


def test_student_on_new_data_equals_fantasy_model(teacher):
    gen = torch.Generator().manual_seed(2)
    new_x = torch.rand(9, 2, generator=gen, dtype=DTYPE) * 4
    new_y = torch.cos(new_x).sum(-1)
    test_x = torch.rand(13, 2, generator=gen, dtype=DTYPE) * 4
    likelihood = gpytorch.likelihoods.GaussianLikelihood().to(DTYPE)
    likelihood.noise = teacher.likelihood.noise
    student = PlainGP(
        new_x, new_y, likelihood, PosteriorMean(teacher), PosteriorKernel(teacher)
    ).eval()
    with torch.no_grad(), exact_settings(), gpytorch.settings.fast_pred_var(False):
        teacher(test_x)  # populate the prediction cache that get_fantasy_model needs
        fantasy = teacher.get_fantasy_model(new_x, new_y)
        expected = fantasy(test_x)
        got = student(test_x)
    torch.testing.assert_close(got.mean, expected.mean, rtol=1e-8, atol=1e-8)
    torch.testing.assert_close(
        got.covariance_matrix, expected.covariance_matrix, rtol=1e-8, atol=1e-8
    )


def test_student_with_an_extra_kernel_trains_in_an_ordinary_loop(teacher):
    gen = torch.Generator().manual_seed(3)
    new_x = torch.rand(20, 2, generator=gen, dtype=DTYPE) * 4
    new_y = torch.sin(new_x).sum(-1) + 0.5 * new_x[:, 0]
    extra = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).to(DTYPE)
    likelihood = gpytorch.likelihoods.GaussianLikelihood().to(DTYPE)
    student = PlainGP(
        new_x, new_y, likelihood, PosteriorMean(teacher), PosteriorKernel(teacher) + extra
    )
    frozen = [p.clone() for p in student.mean_module.parameters()]
    assert all(not p.requires_grad for p in student.mean_module.parameters())
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(likelihood, student)
    optimizer = torch.optim.Adam([p for p in student.parameters() if p.requires_grad], lr=0.05)
    student.train()
    losses = []
    for _ in range(30):
        optimizer.zero_grad()
        loss = -mll(student(new_x), new_y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    # The teacher's copies stay frozen, and train()/eval() of the student leaves the teacher alone.
    for p, q in zip(frozen, student.mean_module.parameters(), strict=True):
        torch.testing.assert_close(p, q)
    assert not teacher.training


def test_gradients_with_respect_to_equal_but_distinct_inputs_match_finite_differences(teacher):
    # x2 an equal copy of x1 shared x1's solve: d/dx2 was None and d/dx1 off by 0.32 (5.4x)
    gen = torch.Generator().manual_seed(4)
    pk = PosteriorKernel(teacher)
    x1 = (torch.rand(4, 2, generator=gen, dtype=DTYPE) * 4).requires_grad_(True)
    x2 = x1.detach().clone().requires_grad_(True)
    weights = torch.randn(4, 4, generator=gen, dtype=DTYPE)

    def loss(a, b):
        return (pk(a, b).to_dense() * weights).sum()

    loss(x1, x2).backward()
    eps = 1e-6
    for x, grad, first in ((x1, x1.grad, True), (x2, x2.grad, False)):
        assert grad is not None
        fd = torch.zeros_like(x)
        for i in range(4):
            for j in range(2):
                step = torch.zeros_like(x)
                step[i, j] = eps
                with torch.no_grad():
                    xp, xm = (x + step).detach(), (x - step).detach()
                    other = (x2 if first else x1).detach()
                    up = loss(xp, other) if first else loss(other, xp)
                    down = loss(xm, other) if first else loss(other, xm)
                fd[i, j] = (up - down) / (2 * eps)
        torch.testing.assert_close(grad, fd, rtol=1e-6, atol=1e-7)


def test_inputs_of_higher_precision_than_the_factorisation_are_refused_by_name(teacher):
    # a float32 module given float64 inputs failed inside a matmul with "expected m1 and m2 to
    # have the same dtype, but got: double != float"
    pk32 = PosteriorKernel(teacher).to(torch.float32)
    pm32 = PosteriorMean(teacher).to(torch.float32)
    x = torch.rand(4, 2, dtype=DTYPE)
    with pytest.raises(ValueError, match=r"^x has dtype torch.float64.*float32"):
        pm32(x)
    with pytest.raises(ValueError, match=r"^x2 has dtype torch.float64"):
        pk32(x.float(), x).to_dense()
    # float32 inputs to a float64 module are promoted: the float64 answer at the rounded inputs
    pk, pm = PosteriorKernel(teacher), PosteriorMean(teacher)
    rounded = x.float().double()
    torch.testing.assert_close(pm(x.float()), pm(rounded), rtol=0, atol=0)
    torch.testing.assert_close(pk(x.float()).to_dense(), pk(rounded).to_dense(), rtol=0, atol=0)


# ------------ Chains of posterior modules stay cheap; the teacher's copies stay in evaluation mode

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
    assert reads[0] < 3 * 16  # GPyTorch's walk would read 2^16 and more
    # the same answer as GPyTorch's walk over every kernel below (on a batched teacher)
    batched = gpytorch.kernels.RBFKernel(batch_shape=torch.Size([3])).double()
    teacher = PlainGP(
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
    teacher = PlainGP(x, y, likelihood, gpytorch.means.ZeroMean(), sgpr).eval()
    new_x = torch.rand(10, 1, generator=gen, dtype=D) * 4
    new_y = torch.cos(new_x).sum(-1)
    student_likelihood = gpytorch.likelihoods.GaussianLikelihood().to(D)
    student_likelihood.noise = 0.1
    student = PlainGP(
        new_x, new_y, student_likelihood, PosteriorMean(teacher), PosteriorKernel(teacher)
    )
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


def test_a_student_kernel_of_its_own_beside_the_posterior_kernel_is_all_it_trains(teacher):
    x, y = teacher.train_inputs[0], teacher.train_targets
    likelihood = gpytorch.likelihoods.GaussianLikelihood().to(DTYPE)
    own = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).to(DTYPE)
    kernel = PosteriorKernel(teacher) + own
    student = PlainGP(x, y, likelihood, gpytorch.means.ZeroMean(), kernel)
    names = {name for name, _ in student.named_parameters()}
    assert names == {
        "likelihood.noise_covar.raw_noise",
        "covar_module.kernels.1.raw_outputscale",
        "covar_module.kernels.1.base_kernel.raw_lengthscale",
    }
