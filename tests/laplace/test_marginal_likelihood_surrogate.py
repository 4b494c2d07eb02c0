"""laplace_log_marginal_likelihood at a tempered likelihood: value and total derivative against
Newton's mode found afresh (finite differences), and the checks of its temperature."""

import gpytorch
import pytest
import torch

from gpsd.data.toy import sine_classification
from gpsd.laplace import laplace_log_marginal_likelihood, resolve_likelihood_terms
from gpsd.laplace.newton import find_laplace_mode

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
    # a mode found at tau = 2 with the default temperature 1 here gave a surrogate whose value
    # was not the mode's log marginal likelihood and whose gradient was silently wrong
    x, y, _ = sine_classification(20, seed=5)
    terms = resolve_likelihood_terms("logit")
    K = _kernel_matrix(x, torch.tensor(0.0, dtype=DT))
    mode = find_laplace_mode(K, y, terms, temperature=2.0)
    with pytest.raises(ValueError, match=r"temperature=1.0 differs from the temperature 2.0"):
        laplace_log_marginal_likelihood(K, y, terms, mode)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="temperature must be a positive float"):
            laplace_log_marginal_likelihood(K, y, terms, mode, temperature=bad)
