"""laplace_log_marginal_likelihood and differentiable_mode: the value and total derivative
against dense formulas and Newton's mode found afresh (finite differences), and the checks of
the mode, temperature and dtypes they are given."""

import gpytorch
import pytest
import torch
from cb_reference import cb_laplace_problem

from gpsd.data.toy import sine_classification
from gpsd.laplace import (
    ContinuousBernoulliTerms,
    find_laplace_mode,
    laplace_log_marginal_likelihood,
    resolve_likelihood_terms,
)

DT = torch.float64


def _kernel_matrix(x: torch.Tensor, log_scale: torch.Tensor) -> torch.Tensor:
    k = gpytorch.kernels.RBFKernel().to(DT)
    k.lengthscale = torch.tensor(0.7, dtype=DT)
    return log_scale.exp() * k(x).to_dense() + 1e-8 * torch.eye(x.shape[0], dtype=DT)


@pytest.mark.parametrize("likelihood", ["logit", "probit"])
def test_tempered_value_and_gradient_against_finite_differences(likelihood):
    x, y, _ = sine_classification(30, seed=4)
    terms = resolve_likelihood_terms(likelihood)
    tau = 2.5
    log_scale = torch.tensor(0.4, dtype=DT, requires_grad=True)
    K = _kernel_matrix(x, log_scale)
    mode = find_laplace_mode(K.detach(), y, terms, temperature=tau)
    value = laplace_log_marginal_likelihood(K, y, terms, mode, temperature=tau)
    (grad,) = torch.autograd.grad(value, log_scale)

    def refit(s: float) -> float:
        with torch.no_grad():
            K_s = _kernel_matrix(x, torch.tensor(s, dtype=DT))
        return find_laplace_mode(K_s, y, terms, temperature=tau).log_marginal_likelihood.item()

    h = 1e-5
    fd = (refit(0.4 + h) - refit(0.4 - h)) / (2 * h)
    assert value.item() == pytest.approx(mode.log_marginal_likelihood.item(), rel=1e-12)
    assert grad.item() == pytest.approx(fd, rel=1e-6, abs=1e-8)


def test_temperature_must_be_the_modes_and_positive():
    # a mode found at tau = 2 with the default temperature 1 here would give a surrogate whose
    # value is not the mode's log marginal likelihood and whose gradient is wrong
    x, y, _ = sine_classification(20, seed=5)
    terms = resolve_likelihood_terms("logit")
    K = _kernel_matrix(x, torch.tensor(0.0, dtype=DT))
    mode = find_laplace_mode(K, y, terms, temperature=2.0)
    with pytest.raises(ValueError, match=r"temperature=1.0 differs from the temperature 2.0"):
        laplace_log_marginal_likelihood(K, y, terms, mode)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="temperature must be a positive float"):
            laplace_log_marginal_likelihood(K, y, terms, mode, temperature=bad)


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
    K, y, m = cb_laplace_problem(dtype=dtype, outputscale=outputscale, batch=batch)
    terms = ContinuousBernoulliTerms()
    mode = find_laplace_mode(K, y, terms, prior_mean=m)
    value = laplace_log_marginal_likelihood(K, y, terms, mode, prior_mean=m)
    assert value.shape == batch
    expected = _dense_log_marginal_likelihood(K, y, m, mode)
    torch.testing.assert_close(value.double(), expected, rtol=rtol, atol=rtol)


def test_log_marginal_likelihood_refuses_a_mode_of_another_prior_mean_or_kernel_matrix():
    # a mode of another prior mean or kernel matrix would give 0.493 or -1.292 instead of -1.387
    K, y, m = cb_laplace_problem()
    terms = ContinuousBernoulliTerms()
    mode = find_laplace_mode(K, y, terms, prior_mean=m)
    with pytest.raises(ValueError, match="not the mode for this K and prior_mean"):
        laplace_log_marginal_likelihood(K, y, terms, mode)
    with pytest.raises(ValueError, match="not the mode for this K and prior_mean"):
        laplace_log_marginal_likelihood(2 * K, y, terms, mode, prior_mean=m)
