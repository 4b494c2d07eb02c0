"""Review s23: checks of the Laplace engine's arguments and the hyperpriors in training."""

import gpytorch
import pytest
import torch

from gpsd.laplace import (
    ContinuousBernoulliTerms,
    LaplaceGPClassifier,
    find_laplace_mode,
    laplace_latent_predictive,
    laplace_log_marginal_likelihood,
)


def _problem(n=10, dtype=torch.float64, outputscale=1.0, batch=()):
    g = torch.Generator().manual_seed(0)
    x = torch.rand(n, 1, generator=g, dtype=torch.float64) * 3
    y = torch.rand(*batch, n, generator=g, dtype=torch.float64)
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).double()
    kernel.outputscale = outputscale
    K = kernel(x).to_dense().detach() + 1e-6 * outputscale * torch.eye(n, dtype=torch.float64)
    m = torch.full((n,), 1.5, dtype=torch.float64)
    return K.to(dtype), y.to(dtype), m.to(dtype)


def _dense_log_marginal_likelihood(K, y, m, mode):
    r"""R&W eq. 3.32 with :math:`\mathbf K^{-1}` and :math:`\log|\mathbf I + \mathbf K\mathbf W|`
    formed densely in float64."""
    K, y, m, f = (t.double() for t in (K, y, m, mode.f))
    r = f - m
    quad = -0.5 * (r * torch.linalg.solve(K, r.unsqueeze(-1)).squeeze(-1)).sum(-1)
    eye = torch.eye(K.shape[-1], dtype=torch.float64)
    logdet = torch.linalg.slogdet(eye + K * mode.W.double().unsqueeze(-2)).logabsdet
    return quad + ContinuousBernoulliTerms().log_prob(y, f).sum(-1) - 0.5 * logdet


@pytest.mark.parametrize(
    ("dtype", "outputscale", "batch", "rtol"),
    [
        (torch.float64, 1.0, (), 1e-8),
        (torch.float32, 1.0, (), 1e-4),
        (torch.float64, 1e4, (), 1e-8),
        (torch.float32, 1e2, (), 1e-3),
        (torch.float64, 1.0, (3,), 1e-8),
    ],
)
def test_log_marginal_likelihood_accepts_the_mode_of_its_own_problem(
    dtype, outputscale, batch, rtol
):
    K, y, m = _problem(dtype=dtype, outputscale=outputscale, batch=batch)
    terms = ContinuousBernoulliTerms()
    mode = find_laplace_mode(K, y, terms, prior_mean=m)
    value = laplace_log_marginal_likelihood(K, y, terms, mode, prior_mean=m)
    assert value.shape == batch
    expected = _dense_log_marginal_likelihood(K, y, m, mode)
    torch.testing.assert_close(value.double(), expected, rtol=rtol, atol=rtol)


def test_log_marginal_likelihood_refuses_a_mode_of_another_prior_mean_or_kernel_matrix():
    # before: 0.493 without the prior mean and -1.292 with 2K, instead of -1.387, silently
    K, y, m = _problem()
    terms = ContinuousBernoulliTerms()
    mode = find_laplace_mode(K, y, terms, prior_mean=m)
    with pytest.raises(ValueError, match="not the mode for this K and prior_mean"):
        laplace_log_marginal_likelihood(K, y, terms, mode)
    with pytest.raises(ValueError, match="not the mode for this K and prior_mean"):
        laplace_log_marginal_likelihood(2 * K, y, terms, mode, prior_mean=m)


def test_tensors_in_another_dtype_than_the_mode_are_refused_naming_them():
    # before: torch's "expected m1 and m2 to have the same dtype"
    K, y, m = _problem(dtype=torch.float32)
    terms = ContinuousBernoulliTerms()
    mode = find_laplace_mode(K, y, terms, prior_mean=m)
    with pytest.raises(ValueError, match="K has dtype torch.float64"):
        laplace_log_marginal_likelihood(K.double(), y, terms, mode, prior_mean=m)
    with pytest.raises(ValueError, match="prior_mean has dtype torch.float64"):
        laplace_log_marginal_likelihood(K, y, terms, mode, prior_mean=m.double())
    with pytest.raises(ValueError, match="K_cross has dtype torch.float64"):
        laplace_latent_predictive(mode, K[:2].double(), K.diagonal()[:2], diag=True)


@pytest.mark.parametrize(
    ("argument", "value"),
    [("max_halvings", -3), ("max_halvings", 1.5), ("objective_tol", float("nan"))]
    + [("objective_tol", -1.0), ("f_tol", -1.0), ("f_tol", float("inf"))],
)
def test_newton_settings_are_checked_naming_them(argument, value):
    # before: max_halvings <= 0 gave UnboundLocalError; NaN or negative tolerances were accepted
    K, y, _ = _problem()
    with pytest.raises(ValueError, match=argument):
        find_laplace_mode(K, y.round(), "logit", **{argument: value})


def test_newton_with_full_steps_only_finds_the_mode():
    # max_halvings=0 tries the full Newton step only (it raised UnboundLocalError)
    K, y, _ = _problem()
    y = y.round()
    mode = find_laplace_mode(K, y, "logit", max_halvings=0)
    # stationarity, independently of the engine: a = K^{-1} f = grad log p = y - sigmoid(f)
    torch.testing.assert_close(mode.alpha, y - torch.sigmoid(mode.f), rtol=0, atol=1e-9)
    torch.testing.assert_close(mode.f, find_laplace_mode(K, y, "logit").f)


def _classifier(prior):
    g = torch.Generator().manual_seed(0)
    x = torch.rand(20, 1, generator=g, dtype=torch.float64) * 5
    y = torch.rand(20, generator=g, dtype=torch.float64) < torch.sigmoid(3 * torch.sin(x[:, 0]))
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(lengthscale_prior=prior))
    return LaplaceGPClassifier(x, y.double(), kernel.double())


def _adam_by_hand(model, log_prior, num_iter=10, lr=0.2):
    """The hyperparameter posterior's maximisation written out, with the prior given here."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=lr)
    history = []
    for _ in range(num_iter):
        optimizer.zero_grad()
        loss = -(model.log_marginal_likelihood().sum() + log_prior(model))
        loss.backward()
        optimizer.step()
        history.append(loss.item())
    return history


def test_optimize_hyperparameters_adds_the_registered_hyperpriors():
    # before: a N(5, 0.01^2) lengthscale prior was ignored (trained lengthscale 1.374 with or
    # without it)
    prior = gpytorch.priors.NormalPrior(torch.tensor(5.0).double(), torch.tensor(0.01).double())
    with_prior = _classifier(prior)
    history = with_prior.optimize_hyperparameters(max_iter=10, lr=0.2).history
    by_hand = _classifier(None)
    expected = _adam_by_hand(
        by_hand, lambda m: prior.log_prob(m.covar_module.base_kernel.lengthscale).sum()
    )
    torch.testing.assert_close(history, expected, rtol=1e-10, atol=0)
    lengthscale = with_prior.covar_module.base_kernel.lengthscale
    torch.testing.assert_close(lengthscale, by_hand.covar_module.base_kernel.lengthscale)
    without = _classifier(None)
    without.optimize_hyperparameters(max_iter=10, lr=0.2)
    assert lengthscale.item() > without.covar_module.base_kernel.lengthscale.item() + 0.5  # to 5
    # the evidence alone, as before
    torch.testing.assert_close(
        with_prior.log_marginal_likelihood(), by_hand.log_marginal_likelihood(), rtol=1e-10, atol=0
    )


def test_optimize_hyperparameters_without_priors_maximises_the_evidence():
    model = _classifier(None)
    assert model.log_prior().item() == 0.0
    history = model.optimize_hyperparameters(max_iter=10, lr=0.2).history
    expected = _adam_by_hand(_classifier(None), lambda m: 0.0)
    torch.testing.assert_close(history, expected, rtol=1e-10, atol=0)
