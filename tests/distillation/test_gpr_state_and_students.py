"""The regression distillers' cache, students and batch handling, against dense formulas."""

import gpytorch
import pytest
import torch
from gpr_reference import PlainGP, dense_data_centric_means, rbf_kernel

from gpsd import DataCentricGPR, DistributionCentricGPR, PosteriorKernel

DT = torch.float64


def _data(n=30, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = 10 * torch.rand(n, 1, generator=gen, dtype=DT)
    return x, torch.sin(x[:, 0]), torch.linspace(0, 10, 7, dtype=DT).unsqueeze(-1)


@pytest.mark.parametrize("backend", ["dense", "cholesky"])
def test_gradients_accumulate_over_two_backward_passes(backend):
    x, y, test_x = _data()
    gammas = [0.1, 0.2]
    kernel = rbf_kernel()
    model = DataCentricGPR(x, y, kernel, noise=gammas, backend=backend)
    model.predict(test_x[:3]).mean.sum().backward()
    model.predict(test_x[3:]).mean.sum().backward()  # used to fail: the graph was freed
    got = [p.grad.clone() for p in kernel.parameters()]
    reference = rbf_kernel()
    dense_data_centric_means(reference, x, y, gammas, test_x).sum().backward()
    for g, r in zip(got, reference.parameters(), strict=True):
        torch.testing.assert_close(g, r.grad, rtol=1e-6, atol=1e-8)


def test_distribution_centric_gradients_after_a_backward_pass():
    x, y, test_x = _data()
    kernel = rbf_kernel()
    model = DistributionCentricGPR(x, y, kernel, noise=[0.2, 0.2], backend="dense")
    model.predict(test_x).variance.sum().backward()
    first = [p.grad.clone() for p in kernel.parameters()]
    kernel.zero_grad()
    model.predict(test_x).variance.sum().backward()
    for a, p in zip(first, kernel.parameters(), strict=True):
        torch.testing.assert_close(p.grad, a, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("noise", [1e-5, 3e-6])
def test_students_of_noise_below_gpytorchs_default_bound(noise):
    x, y, test_x = _data()
    kernel = rbf_kernel()
    student = DataCentricGPR(x, y, kernel, noise=[noise]).student(1)
    with torch.no_grad(), gpytorch.settings.fast_pred_var(False):
        got = student(test_x).mean
        k = kernel(x).to_dense() + noise * torch.eye(30, dtype=DT)
        ref = kernel(test_x, x).to_dense() @ torch.linalg.solve(k, y)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    assert float(student.likelihood.noise.detach()) == pytest.approx(noise, rel=1e-6)


def test_distribution_centric_student_and_iterated_chain_with_small_effective_noise():
    x, y, test_x = _data()
    model = DistributionCentricGPR(x, y, rbf_kernel(), noise=[1e-3] * 20)
    student = model.student(20)  # effective noise 5e-5
    assert float(student.likelihood.noise.detach()) == pytest.approx(5e-5, rel=1e-6)
    with torch.no_grad(), gpytorch.settings.fast_pred_var(False):
        got = student(test_x)
    path = model.predict(test_x)
    torch.testing.assert_close(got.mean, path.mean[-1], rtol=1e-6, atol=1e-7)
    iterated = DistributionCentricGPR(x, y, rbf_kernel(), noise=[5e-5], method="iterated")
    collapsed = DistributionCentricGPR(x, y, rbf_kernel(), noise=[5e-5])
    torch.testing.assert_close(
        iterated.predict(test_x).mean, collapsed.predict(test_x).mean, rtol=1e-6, atol=1e-7
    )


@pytest.mark.parametrize("cls", [DataCentricGPR, DistributionCentricGPR])
def test_students_of_a_batch_of_schedules(cls):
    x, y, test_x = _data()
    gamma = torch.tensor([[0.1, 0.2, 0.3], [0.5, 0.5, 0.5]], dtype=DT)
    model = cls(x, y, rbf_kernel(), noise=gamma)
    with pytest.raises(ValueError, match="schedule must index one schedule"):
        model.student(2, schedule=(0, 1))
    with pytest.raises(TypeError, match="schedule must be an int or a tuple"):
        model.student(2, schedule=1.0)
    path = model.predict(test_x)
    for schedule in (1, (0,)):
        student = model.student(3, schedule=schedule)
        with torch.no_grad(), gpytorch.settings.fast_pred_var(False):
            post = student(test_x)
        index = schedule if isinstance(schedule, int) else schedule[0]
        torch.testing.assert_close(post.mean, path.mean[index, 2], rtol=1e-7, atol=1e-9)
        torch.testing.assert_close(post.variance, path.variance[index, 2], rtol=1e-6, atol=1e-9)
    batched = cls(x.expand(2, -1, -1), y.expand(2, -1), rbf_kernel(), noise=gamma)
    with pytest.raises(ValueError, match="needs unbatched training data"):
        batched.student(1, schedule=0)
    kernels = gpytorch.kernels.RBFKernel(batch_shape=torch.Size([2])).to(DT)
    with pytest.raises(ValueError, match="needs unbatched training data, kernel"):
        cls(x, y, kernels, noise=gamma).student(1, schedule=0)


def _student_posterior(student, test_x):
    with torch.no_grad(), gpytorch.settings.fast_pred_var(False):
        post = student(test_x)
    return post.mean, post.variance


@pytest.mark.parametrize("cls", [DataCentricGPR, DistributionCentricGPR])
def test_student_of_the_whole_batch_equals_each_member(cls):
    """Before, a batched model had no student of its own: ``student(t)`` refused a batch of
    schedules, and one schedule of a batch paired with batched targets or kernels was refused
    or (with a batched kernel) came with every kernel but one schedule's noise."""
    x, y, test_x = _data()
    gamma = torch.tensor([[0.1, 0.2, 0.3], [0.5, 0.05, 0.4]], dtype=DT)
    kernels = gpytorch.kernels.RBFKernel(batch_shape=torch.Size([2])).to(DT)
    kernels.lengthscale = torch.tensor([[[0.7]], [[1.5]]], dtype=DT)
    targets = torch.stack([y, 2 * y.cos()])
    cases = {
        "schedules": (rbf_kernel(), y),
        "schedules with targets": (rbf_kernel(), targets),
        "schedules with kernels": (kernels, y),
    }
    for name, (kernel, train_y) in cases.items():
        model = cls(x, train_y, kernel, noise=gamma)
        path = model.predict(test_x)
        for t in (1, 3):
            student = model.student(t)
            mean, var = _student_posterior(student, test_x)
            torch.testing.assert_close(mean, path.mean[:, t - 1], rtol=1e-7, atol=1e-9, msg=name)
            torch.testing.assert_close(var, path.variance[:, t - 1], rtol=1e-6, atol=1e-9)
            # each member against an exact GP of its own, from dense solves
            for i in range(2):
                k_i = kernel if kernel is not kernels else _member(kernels, i)
                if cls is DataCentricGPR:
                    noise = gamma[i, t - 1]
                else:  # Theorem 3.3: one GP with noise 1 / sum_s 1 / gamma_s
                    noise = 1.0 / (1.0 / gamma[i, :t]).sum()
                y_i = train_y if train_y.dim() == 1 else train_y[i]
                if cls is DataCentricGPR and t > 1:
                    y_i = model.step_targets(t)[i].detach()
                k = k_i(x).to_dense() + noise * torch.eye(x.shape[0], dtype=DT)
                ks = k_i(test_x, x).to_dense()
                want = ks @ torch.linalg.solve(k, y_i)
                torch.testing.assert_close(mean[i], want.detach(), rtol=1e-7, atol=1e-9)


def _member(kernels, i):
    member = gpytorch.kernels.RBFKernel().to(DT)
    member.lengthscale = kernels.lengthscale[i]
    return member


@pytest.mark.parametrize("cls", [DataCentricGPR, DistributionCentricGPR])
def test_student_of_a_batched_teacher(cls):
    """``from_teacher`` of a batched ExactGP: noise of shape (2, T) paired with (2, N) targets;
    before, every ``student`` call was refused with advice about a batch of schedules."""
    x, y, test_x = _data()
    batch = torch.Size([2])
    teacher = PlainGP(
        x.expand(2, -1, -1),
        torch.stack([y, -y]),
        gpytorch.likelihoods.GaussianLikelihood(batch_shape=batch),
        gpytorch.means.ZeroMean(),
        gpytorch.kernels.RBFKernel(batch_shape=batch),
    ).to(DT)
    teacher.likelihood.noise = torch.tensor([[0.05], [0.2]], dtype=DT)
    teacher.eval()
    model = cls.from_teacher(teacher, num_steps=3)
    path = model.predict(test_x)
    with torch.no_grad(), gpytorch.settings.fast_pred_var(False):
        taught = teacher(test_x.expand(2, -1, -1))
    torch.testing.assert_close(path.mean[:, 0], taught.mean, rtol=1e-7, atol=1e-9)
    for t in (1, 2, 3):
        mean, var = _student_posterior(model.student(t), test_x)
        torch.testing.assert_close(mean, path.mean[:, t - 1], rtol=1e-7, atol=1e-9)
        torch.testing.assert_close(var, path.variance[:, t - 1], rtol=1e-6, atol=1e-9)


def test_auto_backend_on_three_points():
    x, y, test_x = _data(n=3)
    with torch.no_grad():
        got = DataCentricGPR(x, y, rbf_kernel(), noise=[0.1] * 5).predict(test_x)
        ref = DataCentricGPR(x, y, rbf_kernel(), noise=[0.1] * 5, backend="dense").predict(test_x)
    torch.testing.assert_close(got.mean, ref.mean, rtol=1e-10, atol=1e-12)


def test_changing_alpha_or_backend_after_a_prediction_takes_effect():
    x, y, test_x = _data()
    model = DataCentricGPR(x, y, rbf_kernel(), noise=[0.1, 0.2])
    with torch.no_grad():
        model.predict(test_x)
        model.alpha = 0.5
        got = model.predict(test_x).mean
        ref = DataCentricGPR(x, y, rbf_kernel(), noise=[0.1, 0.2], alpha=0.5).predict(test_x).mean
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)
        model.backend = "cg"
        cg = model.predict(test_x).mean
    assert type(model._state()["engine"]).__name__ == "ShiftedCG"
    torch.testing.assert_close(cg, ref, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="alpha must lie in"):
        model.alpha = 1.0


def _batched_teacher(x, y, noises):
    batch = torch.Size([len(noises)])
    likelihood = gpytorch.likelihoods.GaussianLikelihood(batch_shape=batch).to(DT)
    likelihood.noise = torch.tensor(noises, dtype=DT).unsqueeze(-1)
    kernel = rbf_kernel(batch_shape=batch)
    teacher = PlainGP(
        x.expand(len(noises), -1, -1),
        y.expand(len(noises), -1),
        likelihood,
        gpytorch.means.ZeroMean(batch_shape=batch),
        kernel,
    )
    return teacher.eval()


def test_from_a_batched_teacher_keeps_every_members_noise():
    x, y, test_x = _data()
    teacher = _batched_teacher(x, y, [0.05, 0.8])
    model = DataCentricGPR.from_teacher(teacher, num_steps=2)
    assert model.noise.shape == (2, 2)
    path = model.predict(test_x)
    with torch.no_grad(), gpytorch.settings.fast_pred_var(False):
        post = teacher(test_x.expand(2, -1, -1))
    torch.testing.assert_close(path.mean[:, 0], post.mean, rtol=1e-7, atol=1e-9)
    torch.testing.assert_close(path.variance[:, 0], post.variance, rtol=1e-6, atol=1e-9)


def test_posterior_kernel_of_a_batched_teacher_on_unbatched_inputs():
    x, y, test_x = _data()
    teacher = _batched_teacher(x, y, [0.05, 0.8])
    with torch.no_grad(), gpytorch.settings.fast_pred_var(False):
        got = PosteriorKernel(teacher)(test_x).to_dense()
        ref = teacher(test_x.expand(2, -1, -1)).covariance_matrix
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("gamma_shape", [(2, 2), (2, 1, 2)])
def test_iterated_and_collapsed_agree_in_shape_with_batched_data_and_schedules(gamma_shape):
    x, y, test_x = _data()
    scales = torch.tensor([1.0, 0.5], dtype=DT).reshape(2, 1, 1)
    xb, yb = x.expand(2, -1, -1) * scales, y.expand(2, -1)
    gamma = torch.tensor([[0.1, 0.2], [0.5, 0.5]], dtype=DT).reshape(gamma_shape)
    collapsed = DistributionCentricGPR(xb, yb, rbf_kernel(), noise=gamma).predict(test_x)
    iterated = DistributionCentricGPR(xb, yb, rbf_kernel(), noise=gamma, method="iterated")
    got = iterated.predict(test_x)
    assert got.mean.shape == collapsed.mean.shape
    torch.testing.assert_close(got.mean, collapsed.mean, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(got.variance, collapsed.variance, rtol=1e-6, atol=1e-8)


def test_batch_mismatches_and_bad_validation_targets_are_named():
    x, y, test_x = _data()
    gamma = torch.full((3, 2), 0.1, dtype=DT)
    with pytest.raises(ValueError, match="noise of shape \\(3, 2\\).*train_x of shape"):
        DataCentricGPR(x.expand(2, -1, -1), y.expand(2, -1), rbf_kernel(), noise=gamma)
    with pytest.raises(ValueError, match="train_x .* and train_y .* must broadcast"):
        DataCentricGPR(x.expand(2, -1, -1), y.expand(3, -1), rbf_kernel(), noise=[0.1])
    model = DataCentricGPR(x, y, rbf_kernel(), noise=[0.1])
    with pytest.raises(ValueError, match="val_y"):
        model.validation_mse(test_x, torch.full((7,), float("nan"), dtype=DT))
