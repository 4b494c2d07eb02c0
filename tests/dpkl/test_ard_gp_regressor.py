"""Tests of ARDGPRegressor: predictions against scikit-learn, its kernel and its checks."""

import math

import gpytorch
import pytest
import torch
from dpkl_reference import noisy_sine_data

from gpsd.dpkl import (
    ARDGPRegressor,
)


def _data(n=12):
    torch.set_default_dtype(torch.float64)
    x = torch.randn(n, 3)
    return x, torch.sin(x[:, 0])


@pytest.mark.parametrize("value", ["1.0", True, torch.tensor([1.0, 2.0, 3.0])])
def test_ard_gp_names_a_bad_initial_lengthscale(value):
    # a string, a bool (not a lengthscale of 1.0) and a tensor of three lengthscales
    x, y = _data()
    with pytest.raises(ValueError, match="initial_lengthscale"):
        ARDGPRegressor(x, y, initial_lengthscale=value)


def test_numpy_and_tensor_scalars_are_still_accepted():
    np = pytest.importorskip("numpy")
    x, y = _data()
    ARDGPRegressor(x, y, initial_lengthscale=np.float32(1.5)).fit(max_iter=1, lr=np.float64(0.01))
    ARDGPRegressor(x, y, initial_lengthscale=torch.tensor(1.5)).fit(
        max_iter=1, lr=torch.tensor(0.01)
    )


def test_ard_gp_matches_sklearn():
    sklearn_gp = pytest.importorskip("sklearn.gaussian_process")
    kernels = pytest.importorskip("sklearn.gaussian_process.kernels")
    x, y = noisy_sine_data(n=25, d=3)
    model = ARDGPRegressor(x, y)
    ls = torch.tensor([0.8, 1.5, 2.2])
    model.covar_module.base_kernel.lengthscale = ls
    model.covar_module.outputscale = 1.4
    model.likelihood.noise = 0.05
    model.mean_module.constant.data.fill_(0.0)
    model.fit(max_iter=0)  # the hyperparameters set above
    xs = torch.randn(6, 3)
    pred = model.predict(xs)  # latent, as scikit-learn's std with alpha
    k = kernels.ConstantKernel(1.4, "fixed") * kernels.RBF(ls.numpy(), "fixed")
    sk = sklearn_gp.GaussianProcessRegressor(k, alpha=0.05, optimizer=None).fit(
        x.numpy(), y.numpy()
    )
    m_ref, s_ref = sk.predict(xs.numpy(), return_std=True)
    torch.testing.assert_close(pred.mean, torch.as_tensor(m_ref), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(pred.variance, torch.as_tensor(s_ref) ** 2, rtol=1e-5, atol=1e-6)
    model.fit(max_iter=10, lr=0.05)
    assert model.history["loss"][-1] < model.history["loss"][0]


def test_ard_regressor_without_input_columns_names_the_inputs():
    # the inputs are named, not the default lengthscale sqrt(0) derived from them
    with pytest.raises(ValueError, match="train_x must have at least one feature"):
        ARDGPRegressor(torch.randn(5, 0), torch.randn(5))


def test_ard_initial_lengthscale_is_not_rounded_to_float32():
    torch.set_default_dtype(torch.float32)
    x = torch.randn(10, 3, dtype=torch.float64)
    model = ARDGPRegressor(x, x[:, 0])
    lengthscale = model.covar_module.base_kernel.lengthscale
    assert lengthscale.dtype == torch.float64
    # sqrt(3) read as float32 would be 1.732050784259756
    assert (lengthscale - math.sqrt(3)).abs().max() < 1e-15


def test_a_covar_module_replaces_the_ard_kernel():
    x, y = _data()
    kernel = gpytorch.kernels.MaternKernel(nu=1.5)
    model = ARDGPRegressor(x, y, covar_module=kernel).fit(max_iter=2)
    assert model.covar_module is kernel
    with pytest.raises(ValueError, match="initial_lengthscale"):
        ARDGPRegressor(x, y, covar_module=kernel, initial_lengthscale=1.0)
    with pytest.raises(TypeError, match="covar_module"):
        ARDGPRegressor(x, y, covar_module=torch.nn.Linear(3, 1))
    default = ARDGPRegressor(x, y)
    assert default.covar_module.base_kernel.lengthscale.shape == (1, 3)  # one per input


def _set_hyperparameters(model):
    """Hyperparameters away from their initial values, so that every term of a loss matters."""
    model.covar_module.base_kernel.lengthscale = torch.tensor([0.7, 1.9, 3.1])
    model.covar_module.outputscale = 1.3
    model.likelihood.noise = 0.08
    model.mean_module.constant.data.fill_(0.2)


def _dense_log_marginal(x, y, lengthscale, outputscale, noise, constant):
    """log N(y | c, s exp(-|x - x'|^2_h / 2) + noise I), by a Cholesky factor of the dense K."""
    z = x / lengthscale
    k = outputscale * torch.exp(-0.5 * torch.cdist(z, z).pow(2)) + noise * torch.eye(len(y))
    chol = torch.linalg.cholesky(k)
    r = torch.linalg.solve_triangular(chol, (y - constant).unsqueeze(-1), upper=False)
    logdet = 2 * chol.diagonal().log().sum()
    return float(-0.5 * r.pow(2).sum() - 0.5 * logdet - 0.5 * len(y) * math.log(2 * math.pi))


def _log_normal_density(value, loc, variance):
    """log density of a log-normal variable: log N(log v | loc, variance) - log v."""
    log_v = math.log(value)
    return -0.5 * (log_v - loc) ** 2 / variance - 0.5 * math.log(2 * math.pi * variance) - log_v


def _log_prior(lengthscales, noise, d):
    loc = math.sqrt(2) + 0.5 * math.log(d)
    return sum(_log_normal_density(h, loc, 3.0) for h in lengthscales) + _log_normal_density(
        noise, -4.0, 1.0
    )


def test_dim_scaled_priors_have_the_log_normal_density():
    x, y = _data()
    model = ARDGPRegressor(x, y, hyperprior="dim_scaled")
    _set_hyperparameters(model)
    total = sum(
        float(prior.log_prob(closure(module)).sum().detach())
        for _, module, prior, closure, _ in model.named_priors()
    )
    assert total == pytest.approx(_log_prior([0.7, 1.9, 3.1], 0.08, 3), rel=1e-12)


def test_map_loss_is_the_marginal_likelihood_plus_the_log_prior():
    x, y = _data(15)
    model = ARDGPRegressor(x, y, hyperprior="dim_scaled")
    _set_hyperparameters(model)
    log_marginal = _dense_log_marginal(x, y, torch.tensor([0.7, 1.9, 3.1]), 1.3, 0.08, 0.2)
    expected = -(log_marginal + _log_prior([0.7, 1.9, 3.1], 0.08, 3)) / 15
    assert float(model.training_loss().detach()) == pytest.approx(expected, rel=1e-10)
    plain = ARDGPRegressor(x, y)  # maximum likelihood: no prior term
    _set_hyperparameters(plain)
    assert float(plain.training_loss().detach()) == pytest.approx(-log_marginal / 15, rel=1e-10)


def test_loo_loss_is_the_mean_log_density_of_each_left_out_target():
    x, y = _data(13)
    model = ARDGPRegressor(x, y, objective="loo")
    _set_hyperparameters(model)
    z = x / torch.tensor([0.7, 1.9, 3.1])
    k = 1.3 * torch.exp(-0.5 * torch.cdist(z, z).pow(2)) + 0.08 * torch.eye(13)
    total = 0.0
    for i in range(13):  # condition y_i on the other rows by a dense solve
        rest = [j for j in range(13) if j != i]
        weights = torch.linalg.solve(k[rest][:, rest], k[rest, i])
        mean = 0.2 + weights @ (y[rest] - 0.2)
        var = k[i, i] - weights @ k[rest, i]
        total += float(-0.5 * (y[i] - mean) ** 2 / var - 0.5 * torch.log(2 * math.pi * var))
    assert float(model.training_loss().detach()) == pytest.approx(-total / 13, rel=1e-10)
    model.fit(max_iter=5, lr=0.05)
    assert model.history["loss"][-1] < model.history["loss"][0]


def test_hyperprior_and_objective_switch():
    x, y = _data()
    default = ARDGPRegressor(x, y)  # maximises the marginal likelihood alone
    assert default.hyperprior is None and default.objective == "mll"
    assert not list(default.named_priors())
    assert not list(ARDGPRegressor(x, y, hyperprior=None).named_priors())
    names = {name for name, *_ in ARDGPRegressor(x, y, hyperprior="dim_scaled").named_priors()}
    assert names == {
        "likelihood.noise_covar.noise_prior",
        "covar_module.base_kernel.lengthscale_prior",
    }
    # a kernel and a likelihood of your own keep their own priors (here: none)
    own = ARDGPRegressor(
        x,
        y,
        covar_module=gpytorch.kernels.RBFKernel(),
        likelihood=gpytorch.likelihoods.GaussianLikelihood(),
        hyperprior="dim_scaled",
    )
    assert not list(own.named_priors())
    with pytest.raises(ValueError, match="hyperprior"):
        ARDGPRegressor(x, y, hyperprior="botorch")
    with pytest.raises(ValueError, match="objective"):
        ARDGPRegressor(x, y, objective="elbo")
