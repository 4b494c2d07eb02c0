import gpytorch
import pytest
import torch
from gpr_reference import PlainGP as GP

from gpsd import PosteriorKernel, PosteriorMean

DTYPE = torch.float64


def exact():
    return gpytorch.settings.fast_computations(False, False, False)


@pytest.fixture
def teacher():
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(30, 2, generator=gen, dtype=DTYPE) * 4
    y = torch.sin(x).sum(-1) + 0.1 * torch.randn(30, generator=gen, dtype=DTYPE)
    likelihood = gpytorch.likelihoods.GaussianLikelihood().to(DTYPE)
    likelihood.noise = 0.05
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(ard_num_dims=2)).to(DTYPE)
    kernel.base_kernel.lengthscale = torch.tensor([[0.7, 1.3]], dtype=DTYPE)
    kernel.outputscale = 1.5
    mean = gpytorch.means.LinearMean(2).to(DTYPE)
    mean.weights.data = torch.tensor([[0.3], [-0.2]], dtype=DTYPE)
    return GP(x, y, likelihood, mean, kernel).eval()


def test_equal_the_teachers_posterior(teacher):
    gen = torch.Generator().manual_seed(1)
    x1 = torch.rand(11, 2, generator=gen, dtype=DTYPE) * 4
    x2 = torch.rand(7, 2, generator=gen, dtype=DTYPE) * 4
    pm, pk = PosteriorMean(teacher), PosteriorKernel(teacher)
    with torch.no_grad(), exact(), gpytorch.settings.fast_pred_var(False):
        joint = teacher(torch.cat([x1, x2]))
        post = teacher(x1)
        mean = pm(x1)
        cov = pk(x1).to_dense()
        cross = pk(x1, x2).to_dense()
        diag = pk(x1, diag=True)
    torch.testing.assert_close(mean, post.mean, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(cov, post.covariance_matrix, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(cross, joint.covariance_matrix[:11, 11:], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(diag, post.variance, rtol=1e-10, atol=1e-10)


def test_student_on_new_data_equals_fantasy_model(teacher):
    gen = torch.Generator().manual_seed(2)
    new_x = torch.rand(9, 2, generator=gen, dtype=DTYPE) * 4
    new_y = torch.cos(new_x).sum(-1)
    test_x = torch.rand(13, 2, generator=gen, dtype=DTYPE) * 4
    likelihood = gpytorch.likelihoods.GaussianLikelihood().to(DTYPE)
    likelihood.noise = teacher.likelihood.noise
    student = GP(new_x, new_y, likelihood, PosteriorMean(teacher), PosteriorKernel(teacher)).eval()
    with torch.no_grad(), exact(), gpytorch.settings.fast_pred_var(False):
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
    student = GP(new_x, new_y, likelihood, PosteriorMean(teacher), PosteriorKernel(teacher) + extra)
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


def test_state_dict_round_trip_and_dtype(teacher):
    pk, pm = PosteriorKernel(teacher), PosteriorMean(teacher)
    state = pk.state_dict()
    assert "cholesky" in state and "train_inputs" in state
    other = PosteriorKernel(teacher)
    other.load_state_dict(state)
    x = torch.rand(5, 2, dtype=DTYPE)
    torch.testing.assert_close(other(x).to_dense(), pk(x).to_dense())
    pk32 = pk.to(torch.float32)
    assert pk32(x.float()).to_dense().dtype == torch.float32
    assert pm.to(torch.float32)(x.float()).dtype == torch.float32


def test_errors(teacher):
    pk, pm = PosteriorKernel(teacher), PosteriorMean(teacher)
    with pytest.raises(ValueError, match="features"):
        pm(torch.zeros(3, 5, dtype=DTYPE))
    with pytest.raises(ValueError, match="device"):
        pk(torch.zeros(3, 2, device="meta")).to_dense()  # kernels evaluate lazily
    bad = GP(
        teacher.train_inputs[0],
        teacher.train_targets,
        teacher.likelihood,
        teacher.mean_module,
        teacher.covar_module,
    )
    bad.likelihood = gpytorch.likelihoods.BernoulliLikelihood()
    with pytest.raises(ValueError, match="Gaussian"):
        PosteriorMean(bad)
    with pytest.raises(TypeError, match="ExactGP"):
        PosteriorKernel(teacher.covar_module)


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
