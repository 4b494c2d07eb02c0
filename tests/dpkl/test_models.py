import copy
import math

import gpytorch
import pytest
import torch
from conftest import requires_cuda
from torch import nn
from torch.func import functional_call

from gpsd.dpkl import (
    ARDGPRegressor,
    DKLRegressor,
    DPKLRegressor,
    ExpectedEmbeddingKernel,
    ParticleEnsemble,
    ProbabilisticEmbeddingKernel,
    RandomFeatureKernel,
    SSDPKLRegressor,
    SteinVariationalGradient,
)


def _net(d_in=4, d_out=2):
    return nn.Sequential(nn.Linear(d_in, 8), nn.Tanh(), nn.Linear(8, d_out))


def _data(n=30, d=4):
    torch.set_default_dtype(torch.float64)
    x = torch.randn(n, d)
    y = torch.sin(x[:, 0]) + 0.1 * torch.randn(n)
    return x, y


def _loop_mean_features(model, x):
    """phi-bar by an explicit loop over the particles (stand-alone modules)."""
    ens = model.covar_module.feature_extractor
    rf = model.covar_module.random_features
    arch = ens.particle_module(0)
    stacked = ens.stacked_parameters()
    feats = [
        rf.featurize(functional_call(arch, {k: v[i] for k, v in stacked.items()}, (x,)))
        for i in range(ens.num_particles)
    ]
    return torch.stack(feats).mean(0)


def test_mean_features_equal_particle_loop():
    x, y = _data()
    model = DPKLRegressor(x, y, _net, num_particles=4, num_random_features=6)
    torch.testing.assert_close(model.covar_module.mean_features(x), _loop_mean_features(model, x))


def test_expected_kernel_equals_quadruple_loop_and_rff_converges_to_it():
    torch.set_default_dtype(torch.float64)
    ens = ParticleEnsemble(lambda: _net(3, 2), 3)
    base = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())
    base.base_kernel.lengthscale = 0.9
    base.outputscale = 1.3
    ek = ExpectedEmbeddingKernel(ens, base, latent_dim=2)
    x1, x2 = torch.randn(5, 3), torch.randn(4, 3)
    got = ek(x1, x2).to_dense().detach()
    mods = [ens.particle_module(i) for i in range(3)]
    ref = torch.zeros(5, 4)
    for i in range(5):
        for j in range(4):
            for a in range(3):
                for b in range(3):
                    za, zb = mods[a](x1[i]), mods[b](x2[j])
                    ref[i, j] += 1.3 * torch.exp(-((za - zb) ** 2).sum() / (2 * 0.81)).detach() / 9
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(
        ek(x1, diag=True).detach(), torch.diagonal(ek(x1).to_dense().detach())
    )
    # the random-feature embedding kernel approaches it as R grows
    errs = []
    for R in (100, 10000):
        torch.manual_seed(1)
        rf = RandomFeatureKernel(R, 2)
        rf.lengthscale = 0.9
        rf.outputscale = 1.3
        pk = ProbabilisticEmbeddingKernel(ens, rf)
        errs.append(float((pk(x1, x2).to_dense().detach() - got).abs().max()))
    assert errs[1] < 0.05 and errs[1] < errs[0]


def _dense_loss(model, x, y):
    phi = _loop_mean_features(model, x)
    cov = phi @ phi.mT + model.likelihood.noise * torch.eye(x.shape[0])
    mean = model.mean_module.constant.expand(x.shape[0])
    return -torch.distributions.MultivariateNormal(mean, covariance_matrix=cov).log_prob(y)


def test_dpkl_loss_and_particle_gradients_equal_dense():
    x, y = _data(n=40)
    model = DPKLRegressor(x, y, _net, num_particles=3, num_random_features=5)
    model.likelihood.noise = 0.2
    loss = model.training_loss() * x.shape[0]
    params = model.particle_parameters()
    g = torch.autograd.grad(loss, params)
    dense = _dense_loss(model, x, y)
    h = torch.autograd.grad(dense, params)
    assert abs(loss.item() - dense.item()) < 1e-8
    for a, b in zip(g, h, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-10)


def test_predictions_equal_dense_gp_formula():
    x, y = _data(n=25)
    model = DPKLRegressor(x, y, _net, num_particles=3, num_random_features=20)
    xs = torch.randn(7, 4)
    mean, var = model.predict(xs)
    with torch.no_grad():
        phi, phis = _loop_mean_features(model, x), _loop_mean_features(model, xs)
        noise, c = model.likelihood.noise, model.mean_module.constant
        kxx = phi @ phi.mT + noise * torch.eye(25)
        ks = phis @ phi.mT
        ref_mean = c + ks @ torch.linalg.solve(kxx, y - c)
        ref_var = (phis**2).sum(-1) - (ks * torch.linalg.solve(kxx, ks.mT).mT).sum(-1) + noise
    torch.testing.assert_close(mean, ref_mean, rtol=1e-7, atol=1e-9)
    torch.testing.assert_close(var, ref_var, rtol=1e-7, atol=1e-9)


def test_ssdpkl_regulariser_equals_dense_posterior_variance():
    x, y = _data(n=30)
    xu = torch.randn(12, 4)
    model = SSDPKLRegressor(x, y, _net, xu, num_particles=3, num_random_features=10, alpha=0.5)
    model.likelihood.noise = 0.15
    got = model.latent_posterior_variance(xu)
    phi, phiu = _loop_mean_features(model, x), _loop_mean_features(model, xu)
    kxx = phi @ phi.mT + 0.15 * torch.eye(30)
    ks = phiu @ phi.mT  # k_star^T
    kss = (phiu**2).sum(-1)  # the true prior variance ||phi-bar(x)||^2
    ref = kss - (ks * torch.linalg.solve(kxx, ks.mT).mT).sum(-1)
    torch.testing.assert_close(got, ref, rtol=1e-7, atol=1e-10)
    torch.testing.assert_close(model.regulariser(xu), ref.mean())
    # the training loss adds alpha times the regulariser (all 12 rows fit in one batch)
    dpkl_part = DPKLRegressor.training_loss(model)
    torch.testing.assert_close(model.training_loss(), dpkl_part + 0.5 * ref.mean())
    # the exact-kernel path agrees with its own dense formula too
    model_exact = SSDPKLRegressor(x, y, _net, xu, num_particles=2, kernel="exact")
    ke = model_exact.covar_module
    kxx = ke(x).to_dense() + model_exact.likelihood.noise * torch.eye(30)
    ks = ke(xu, x).to_dense()
    ref = ke(xu, diag=True) - (ks * torch.linalg.solve(kxx, ks.mT).mT).sum(-1)
    torch.testing.assert_close(model_exact.latent_posterior_variance(xu), ref)


class _HandDKL(gpytorch.models.ExactGP):
    def __init__(self, x, y, net):
        super().__init__(x, y, gpytorch.likelihoods.GaussianLikelihood())
        self.net = net
        self.mean_module = gpytorch.means.ConstantMean()
        self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())

    def forward(self, x):
        z = self.net(x)
        return gpytorch.distributions.MultivariateNormal(self.mean_module(z), self.covar_module(z))


@pytest.mark.parametrize("update", ["paper", "svgd"])
def test_single_particle_dpkl_is_dkl(update):
    """m = 1: same loss and same Adam trajectory as a hand-written GPyTorch deep-kernel GP."""
    x, y = _data(n=20)
    net = _net()
    model = DPKLRegressor(x, y, copy.deepcopy(net), num_particles=1, kernel="exact", update=update)
    hand = _HandDKL(x, y, copy.deepcopy(net))
    assert (
        abs(
            model.training_loss().item()
            - (-gpytorch.mlls.ExactMarginalLogLikelihood(hand.likelihood, hand)(hand(x), y)).item()
        )
        < 1e-10
    )
    model.fit(num_steps=5, lr=0.01)
    opt = torch.optim.Adam(hand.parameters(), lr=0.01)
    hand.train()
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(hand.likelihood, hand)
    for _ in range(5):
        opt.zero_grad()
        (-mll(hand(x), y)).backward()
        opt.step()
    stacked = model.covar_module.feature_extractor.stacked_parameters()
    for name, p in hand.net.named_parameters():
        torch.testing.assert_close(stacked[name][0], p, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(model.likelihood.noise, hand.likelihood.noise)
    dkl = DKLRegressor(x, y, copy.deepcopy(net))
    assert dkl.num_particles == 1 and dkl.kernel_type == "exact"


def test_single_particle_functional_gradient_is_plain_gradient():
    x, y = _data(n=20)
    model = DPKLRegressor(x, y, _net, num_particles=1, num_random_features=10, update="svgd")
    model.training_loss().backward()
    params = model.particle_parameters()
    before = [p.grad.clone() for p in params]
    SteinVariationalGradient(params, repulsion=1.0).transform_()
    for a, b in zip(before, params, strict=True):
        torch.testing.assert_close(a, b.grad)


def test_fit_early_stopping_and_roundtrip():
    x, y = _data(n=40)
    xv, yv = _data(n=15)
    model = DPKLRegressor(x, y, _net, num_particles=4, num_random_features=20, update="svgd")
    first = model.training_loss().item()
    hist = model.fit(num_steps=40, lr=0.02, val_x=xv, val_y=yv, check_every=10)
    assert len(hist["loss"]) == 40 and len(hist["val_nll"]) == 5
    assert hist["loss"][-1] < first
    # the restored state is the best checked one
    assert math.isclose(model.nll(xv, yv), min(hist["val_nll"]), rel_tol=1e-9)
    mean, var = model.predict(xv)
    assert mean.shape == (15,) and (var > 0).all()
    other = DPKLRegressor(x, y, _net, num_particles=4, num_random_features=20)
    other.load_state_dict(model.state_dict())
    torch.testing.assert_close(other.predict(xv)[0], mean)
    assert model.embed(xv).shape == (4, 15, 2)


def test_ard_gp_matches_sklearn():
    sklearn_gp = pytest.importorskip("sklearn.gaussian_process")
    kernels = pytest.importorskip("sklearn.gaussian_process.kernels")
    x, y = _data(n=25, d=3)
    model = ARDGPRegressor(x, y)
    ls = torch.tensor([0.8, 1.5, 2.2])
    model.covar_module.base_kernel.lengthscale = ls
    model.covar_module.outputscale = 1.4
    model.likelihood.noise = 0.05
    model.mean_module.constant.data.fill_(0.0)
    xs = torch.randn(6, 3)
    mean, var = model.predict(xs, include_noise=False)
    k = kernels.ConstantKernel(1.4, "fixed") * kernels.RBF(ls.numpy(), "fixed")
    sk = sklearn_gp.GaussianProcessRegressor(k, alpha=0.05, optimizer=None).fit(
        x.numpy(), y.numpy()
    )
    m_ref, s_ref = sk.predict(xs.numpy(), return_std=True)
    torch.testing.assert_close(mean, torch.as_tensor(m_ref), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(var, torch.as_tensor(s_ref) ** 2, rtol=1e-5, atol=1e-6)
    hist = model.fit(num_steps=10, lr=0.05)
    assert hist["loss"][-1] < hist["loss"][0]


def test_float32_and_orthogonal_matern_variant():
    torch.set_default_dtype(torch.float32)
    x = torch.randn(30, 4)
    y = torch.randn(30)
    model = DPKLRegressor(
        x, y, _net, num_particles=3, num_random_features=8, orthogonal=True, nu=1.5
    )
    model.fit(num_steps=3)
    mean, var = model.predict(x[:5])
    assert mean.dtype == torch.float32 and torch.isfinite(var).all()


def test_clear_errors():
    x, y = _data(n=20)
    with pytest.raises(ValueError, match="num_particles"):
        DPKLRegressor(x, y, _net, num_particles=0)
    with pytest.raises(ValueError, match="R"):
        DPKLRegressor(x, y, _net, num_random_features=0)
    with pytest.raises(ValueError, match="latent_dim"):
        DPKLRegressor(x, y, lambda: _net(4, 3), latent_dim=2)
    with pytest.raises(ValueError, match="bandwidth"):
        DPKLRegressor(x, y, _net, bandwidth=-2.0)
    with pytest.raises(ValueError, match="repulsion"):
        DPKLRegressor(x, y, _net, update="svgd", repulsion=-1.0)
    bad = x.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="train_x"):
        DPKLRegressor(bad, y, _net)
    bad_y = y.clone()
    bad_y[3] = float("inf")
    with pytest.raises(ValueError, match="train_y"):
        DPKLRegressor(x, bad_y, _net)
    with pytest.raises(ValueError, match="train_y"):
        DPKLRegressor(x, y[:-1], _net)
    with pytest.raises(ValueError, match="unlabelled_x"):
        SSDPKLRegressor(x, y, _net, torch.randn(5, 3))
    with pytest.raises(ValueError, match="alpha"):
        SSDPKLRegressor(x, y, _net, torch.randn(5, 4), alpha=-1.0)
    model = DPKLRegressor(x, y, _net, num_particles=2, num_random_features=5)
    with pytest.raises(ValueError, match="x must have 4 features"):
        model.predict(torch.randn(3, 5))
    with pytest.raises(ValueError, match="update"):
        DPKLRegressor(x, y, _net, update="adam")


@requires_cuda
def test_cuda_dpkl():
    x, y = _data(n=30)
    model = DPKLRegressor(x.cuda(), y.cuda(), _net, num_particles=3, num_random_features=8)
    model.fit(num_steps=3)
    mean, var = model.predict(x[:4].cuda())
    assert mean.device.type == "cuda"
    cpu = DPKLRegressor(x, y, _net, num_particles=3, num_random_features=8)
    cpu.load_state_dict({k: v.cpu() for k, v in model.state_dict().items()})
    torch.testing.assert_close(cpu.predict(x[:4])[0], mean.cpu(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_steps=-1), "num_steps must be a non-negative int"),
        (dict(num_steps=2.0), "num_steps"),
        (dict(num_steps=True), "num_steps"),
        (dict(lr=0.0), "lr must be a positive float"),
        (dict(lr=float("nan")), "lr"),
        (dict(val_x=torch.zeros(3, 4, dtype=torch.float64)), "val_x and val_y"),
        (dict(check_every=0), "check_every must be a positive int"),
        (dict(check_every=2.5), "check_every"),
        (
            dict(val_x=torch.zeros(3, 5, dtype=torch.float64), val_y=torch.zeros(3)),
            "val_x must have 4 features",
        ),
        (
            dict(val_x=torch.zeros(3, 4, dtype=torch.float64), val_y=torch.zeros(2)),
            "val_y",
        ),
    ],
)
def test_fit_names_the_bad_argument(kwargs, match):
    x, y = _data(n=20)
    model = DPKLRegressor(x, y, _net, num_particles=2, num_random_features=5)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=match):
        model.fit(**kwargs)
    for name, value in model.state_dict().items():  # nothing was trained
        torch.testing.assert_close(value, before[name], rtol=0, atol=0)


def test_rmse_and_nll_equal_their_formulas():
    x, y = _data(n=25)
    model = DPKLRegressor(x, y, _net, num_particles=3, num_random_features=10)
    model.fit(num_steps=3)
    test_x, test_y = x[:7] + 0.1, y[:7]
    mean, var = model.predict(test_x)
    rmse = math.sqrt(sum((float(a) - float(b)) ** 2 for a, b in zip(test_y, mean, strict=True)) / 7)
    nll = (
        sum(
            0.5 * (float(a) - float(m)) ** 2 / float(v) + 0.5 * math.log(2 * math.pi * float(v))
            for a, m, v in zip(test_y, mean, var, strict=True)
        )
        / 7
    )
    assert model.rmse(test_x, test_y) == pytest.approx(rmse, rel=1e-12)
    assert model.nll(test_x, test_y) == pytest.approx(nll, rel=1e-12)
