"""Tests of KernelDistillation started from a trained sparse GP or from given inducing points:
the inducing points and hyperparameters used are the SGPR's (or the user's), a user's tensor
gives the student K-means would give with that tensor, and bad models and tensors are named."""

import gpytorch
import pytest
import torch
from kd_reference import DT, dense_unit_rbf, reference_data

from gpsd.kernel_distillation import KernelDistillation, _inducing_selection, kmeans


class SGPR(gpytorch.models.ExactGP):
    """GPyTorch's SGPR: an ``InducingPointKernel`` over a scaled ARD RBF, a constant mean."""

    def __init__(self, x, y, inducing_points, scale_inputs=1.0):
        likelihood = gpytorch.likelihoods.GaussianLikelihood()
        super().__init__(x, y, likelihood)
        self.mean_module = gpytorch.means.ConstantMean()
        base = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=x.shape[-1]))
        self.covar_module = gpytorch.kernels.InducingPointKernel(
            base, inducing_points=inducing_points, likelihood=likelihood
        )
        self.scale_inputs = scale_inputs

    def forward(self, x):
        x = x * self.scale_inputs
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def trained_sgpr(n=80, m=12, steps=25, **kwargs):
    """An SGPR on :func:`reference_data` trained by Titsias' bound (Adam), inducing points
    started from a random subset and moved by the training."""
    torch.manual_seed(0)
    x, y = reference_data(n)
    u0 = x[torch.randperm(n, generator=torch.Generator().manual_seed(1))[:m]].clone()
    model = SGPR(x, y, u0, **kwargs).to(DT)
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(model.likelihood, model)
    for _ in range(steps):
        opt.zero_grad()
        (-mll(model(x), y)).backward()
        opt.step()
    model.eval()
    return model


def test_from_sgpr_distils_at_the_sgprs_inducing_points_with_its_hyperparameters():
    model = trained_sgpr()
    u = model.covar_module.inducing_points.detach()
    base = model.covar_module.base_kernel
    kd = KernelDistillation.from_sgpr(model, sparsity=4).fit()
    # exactly the SGPR's inducing points (moved by training), not K-means centroids
    assert kd.num_inducing == 12
    torch.testing.assert_close(kd.inducing_points, u, rtol=0, atol=0)
    x = model.train_inputs[0]
    centroids = kmeans(x / kd.neighbour_scale, 12, seed=0) * kd.neighbour_scale
    assert (kd.inducing_points - centroids).abs().max() > 0.1
    # the base kernel's hyperparameters, the likelihood's noise and the mean constant
    lengthscale = base.base_kernel.lengthscale.detach().reshape(-1)
    assert (lengthscale - 1.0).abs().min() > 0.01  # trained away from the initial values
    kd_lengthscale = kd.covar_module.base_kernel.lengthscale.reshape(-1)
    torch.testing.assert_close(kd_lengthscale, lengthscale, rtol=0, atol=0)
    torch.testing.assert_close(kd.noise, model.likelihood.noise.detach().reshape(()))
    assert kd.mean_constant == float(model.mean_module.constant.detach())
    torch.testing.assert_close(kd.train_x, x, rtol=0, atol=0)
    torch.testing.assert_close(kd.train_y, model.train_targets, rtol=0, atol=0)
    # K_UU of the base kernel (not the InducingPointKernel), from a direct formula
    expected = base.outputscale.detach() * dense_unit_rbf(u, u, lengthscale)
    torch.testing.assert_close(kd.inducing_covariance, expected, rtol=1e-10, atol=1e-12)
    student = kd.student
    torch.testing.assert_close(student.inducing_points, u, rtol=0, atol=0)
    torch.testing.assert_close(student.noise, kd.noise)


def test_from_sgpr_copies_the_model():
    model = trained_sgpr()
    kd = KernelDistillation.from_sgpr(model, sparsity=4)
    before = kd.inducing_points.clone()
    with torch.no_grad():
        model.covar_module.inducing_points.add_(1.0)
        model.covar_module.base_kernel.base_kernel.raw_lengthscale.add_(1.0)
    torch.testing.assert_close(kd.inducing_points, before, rtol=0, atol=0)
    ls = kd.covar_module.base_kernel.lengthscale
    assert not torch.equal(ls, model.covar_module.base_kernel.base_kernel.lengthscale.detach())


@pytest.mark.parametrize("metric", ["euclidean", "lengthscale"])
def test_a_users_inducing_points_give_the_student_kmeans_would_give_with_them(monkeypatch, metric):
    x, y = reference_data(100)
    gen = torch.Generator().manual_seed(3)
    given = 1.5 * torch.randn(15, 2, generator=gen, dtype=DT)
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=2)).to(DT)
    kernel.base_kernel.lengthscale = torch.tensor([0.6, 1.4], dtype=DT)
    settings = dict(noise=0.05, num_inducing=15, sparsity=5, neighbour_metric=metric)

    def no_kmeans(*args, **kwargs):
        raise AssertionError("K-means ran although inducing points were given")

    monkeypatch.setattr(_inducing_selection, "kmeans", no_kmeans)
    user = KernelDistillation.from_data(x, y, kernel, inducing_points=given, **settings).fit()
    torch.testing.assert_close(user.inducing_points, given, rtol=0, atol=0)

    calls = []

    def fixed_kmeans(points, num_clusters, **kwargs):  # the centroids in the search's metric
        calls.append(num_clusters)
        return given / user.neighbour_scale

    monkeypatch.setattr(_inducing_selection, "kmeans", fixed_kmeans)
    clustered = KernelDistillation.from_data(x, y, kernel, **settings).fit()
    assert calls == [15]
    exact = dict(rtol=0, atol=0) if metric == "euclidean" else dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(clustered.inducing_points, given, **exact)
    assert torch.equal(clustered.neighbour_indices, user.neighbour_indices)
    torch.testing.assert_close(clustered.weight_values, user.weight_values, **exact)
    test_x = torch.randn(30, 2, generator=gen, dtype=DT)
    p_user, p_clustered = user.student.predict(test_x), clustered.student.predict(test_x)
    torch.testing.assert_close(p_clustered.mean, p_user.mean, **exact)
    torch.testing.assert_close(p_clustered.variance, p_user.variance, **exact)


def test_from_sgpr_equals_from_data_with_the_sgprs_parts():
    # the same distillation given by hand: base kernel, noise, mean and inducing points
    model = trained_sgpr()
    kd = KernelDistillation.from_sgpr(model, sparsity=4, max_iter=2).fit()
    by_hand = KernelDistillation.from_data(
        model.train_inputs[0], model.train_targets, model.covar_module.base_kernel,
        noise=model.likelihood.noise.detach(), mean_module=model.mean_module, num_inducing=12,
        sparsity=4, max_iter=2, inducing_points=model.covar_module.inducing_points.detach(),
    ).fit()  # fmt: skip
    assert kd.frobenius_errors == by_hand.frobenius_errors
    test_x = reference_data(20, seed=5)[0]
    torch.testing.assert_close(
        kd.student.predict(test_x).mean, by_hand.student.predict(test_x).mean
    )


class _ExactGP(gpytorch.models.ExactGP):
    def __init__(self, x, y):
        super().__init__(x, y, gpytorch.likelihoods.GaussianLikelihood())
        self.mean_module = gpytorch.means.ZeroMean()
        self.covar_module = gpytorch.kernels.RBFKernel()

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def test_from_sgpr_names_the_bad_model():
    model = trained_sgpr()
    with pytest.raises(TypeError, match="model must be a trained GPyTorch SGPR"):
        KernelDistillation.from_sgpr(model.covar_module, sparsity=4)
    x, y = reference_data(30)
    with pytest.raises(TypeError, match="covar_module must be a gpytorch.kernels.InducingPoint"):
        KernelDistillation.from_sgpr(_ExactGP(x, y).to(DT), sparsity=4)
    with pytest.raises(ValueError, match=r"sparsity \(b=13\) must not exceed num_inducing \(m=12"):
        KernelDistillation.from_sgpr(model, sparsity=13)
    with pytest.raises(ValueError, match="sparsity must be a positive int"):
        KernelDistillation.from_sgpr(model, sparsity=0)
    wrong_d = SGPR(x, y, torch.zeros(5, 3, dtype=DT)).to(DT)
    wrong_d.covar_module.base_kernel.outputscale = 2.0
    with pytest.raises(ValueError, match=r"inducing_points must have shape \(m, d=2\).*\(5, 3\)"):
        KernelDistillation.from_sgpr(wrong_d, sparsity=2)
    untrained = SGPR(x, y, x[:5].clone()).to(DT)
    with pytest.raises(ValueError, match="untrained"):
        KernelDistillation.from_sgpr(untrained, sparsity=2)
    KernelDistillation.from_sgpr(untrained, sparsity=2, require_trained=False)
    with pytest.raises(TypeError, match="process_group must be a torch.distributed"):
        KernelDistillation.from_sgpr(model, sparsity=4, process_group="world")
    bernoulli = trained_sgpr()
    bernoulli.likelihood = gpytorch.likelihoods.BernoulliLikelihood()
    with pytest.raises(TypeError, match="GaussianLikelihood"):
        KernelDistillation.from_sgpr(bernoulli, sparsity=4)


def test_from_sgpr_warns_when_forward_transforms_the_inputs():
    with pytest.warns(UserWarning, match="model.forward differs"):
        KernelDistillation.from_sgpr(trained_sgpr(scale_inputs=2.0), sparsity=4)


@pytest.mark.parametrize(
    "inducing_points, match",
    [
        (torch.zeros(14, 2, dtype=DT), r"shape \(num_inducing=15, d=2\), got \(14, 2\)"),
        (torch.zeros(15, dtype=DT), "inducing_points"),
        (torch.full((15, 2), float("nan"), dtype=DT), "inducing_points"),
    ],
)
def test_a_users_inducing_points_of_the_wrong_shape_are_named(inducing_points, match):
    x, y = reference_data(40)
    kernel = gpytorch.kernels.RBFKernel().to(DT)
    with pytest.raises(ValueError, match=match):
        KernelDistillation.from_data(
            x, y, kernel, noise=0.1, num_inducing=15, sparsity=3, inducing_points=inducing_points
        )


@pytest.mark.parametrize(
    "setting", [{"num_inducing": 5}, {"inducing_points": None}, {"kmeans_max_iter": 3}, {"seed": 1}]
)
def test_from_sgpr_refuses_the_settings_the_sgpr_fixes(setting):
    model = trained_sgpr(steps=2)
    with pytest.raises(TypeError, match=f"from_sgpr.*{next(iter(setting))}"):
        KernelDistillation.from_sgpr(model, sparsity=4, **setting)
