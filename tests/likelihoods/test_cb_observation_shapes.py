"""ContinuousBernoulliLikelihood needs one target per latent function value: ``(n, 1)`` targets
against ``n`` latents used to broadcast to an ``(n, n)`` term (an ELBO five times too large here,
silently), and targets of another length failed inside torch."""

import math

import gpytorch
import pytest
import torch
from scipy import integrate

from gpsd import ContinuousBernoulliLikelihood
from gpsd.likelihoods import cb_log_density

DT = torch.float64
MEAN = torch.tensor([0.3, -1.2, 2.0, 0.0, 4.5], dtype=DT)
VAR = torch.tensor([0.5, 2.0, 0.1, 3.0, 1.0], dtype=DT)
LATENT = gpytorch.distributions.MultivariateNormal(MEAN, torch.diag(VAR))
TARGETS = torch.tensor([0.1, 0.9, 0.3, 0.6, 0.5], dtype=DT)


@pytest.mark.parametrize("method", ["expected_log_prob", "log_marginal"])
@pytest.mark.parametrize(
    "targets, message",
    [
        (TARGETS.unsqueeze(-1), r"observations must have shape \(\*batch, 5\).*\(5, 1\)"),
        (TARGETS[:3], r"observations must have shape \(\*batch, 5\).*\(3,\)"),
        (TARGETS.expand(3, 2, 5), r"batch shape of observations \(3, 2, 5\) does not broadcast"),
    ],
)
def test_targets_of_another_shape_are_refused(method, targets, message):
    latent = gpytorch.distributions.MultivariateNormal(
        MEAN.expand(2, 2, 5), torch.diag_embed(VAR.expand(2, 2, 5))
    )
    with pytest.raises(ValueError, match=message):
        getattr(ContinuousBernoulliLikelihood(), method)(targets, latent)


def _expected_log_density(y, mean, var):
    """E[log p(y|f)], f ~ N(mean, var), by adaptive quadrature."""

    def integrand(f):
        density = math.exp(-0.5 * (f - mean) ** 2 / var) / (2 * math.pi * var) ** 0.5
        return float(cb_log_density(torch.tensor(y, dtype=DT), torch.tensor(f, dtype=DT)) * density)

    sd = var**0.5
    return integrate.quad(integrand, mean - 12 * sd, mean + 12 * sd, epsabs=1e-13)[0]


def test_a_batch_of_targets_against_one_latent_is_the_loop_over_targets():
    batch = torch.stack([TARGETS, 1 - TARGETS])  # shape: (2, 5)
    got = ContinuousBernoulliLikelihood().expected_log_prob(batch, LATENT)
    assert got.shape == (2, 5)
    expected = torch.tensor(
        [
            [
                _expected_log_density(float(y), float(m), float(v))
                for y, m, v in zip(row, MEAN, VAR, strict=True)
            ]
            for row in batch
        ],
        dtype=DT,
    )
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-10)


def test_one_latent_value_against_several_targets_broadcasts():
    latent = torch.distributions.Normal(torch.tensor(0.7, dtype=DT), torch.tensor(1.3, dtype=DT))
    got = ContinuousBernoulliLikelihood().expected_log_prob(TARGETS, latent)
    expected = torch.tensor(
        [_expected_log_density(float(y), 0.7, 1.3**2) for y in TARGETS], dtype=DT
    )
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-10)
