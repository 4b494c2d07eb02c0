"""TemperedSoftmaxTerms: log-likelihood, gradient and Hessian blocks against a written-out log
softmax and autograd; the softmax at temperature 1; the check of the temperature."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpsd.laplace import MulticlassLaplacePosterior, SoftmaxTerms, TemperedSoftmaxTerms

DT = torch.float64


def _latents(n, num_classes, seed, scale=2.0):
    gen = torch.Generator().manual_seed(seed)
    return scale * torch.randn(n, num_classes, generator=gen, dtype=DT)


def _written_out_log_prob(label, f, temperature):
    """tau (f_y - log sum_k exp f_k) of one point, with torch operations written out."""
    return temperature * (f[label] - torch.log(torch.exp(f).sum()))


@pytest.mark.parametrize("temperature", [0.5, 1.0, 3.0])
def test_log_prob_gradient_and_hessian_match_a_written_out_tempered_softmax(temperature):
    F = _latents(5, 4, seed=0)
    labels = [3, 0, 2, 1, 3]
    terms = TemperedSoftmaxTerms(temperature)
    Y = terms.targets(torch.tensor(labels, dtype=DT), num_classes=4)
    gradient, hessian = terms.derivatives(Y, F)
    f = F.numpy()
    expected = [temperature * (f[i, k] - np.log(np.exp(f[i]).sum())) for i, k in enumerate(labels)]
    np.testing.assert_allclose(terms.log_prob(Y, F).numpy(), expected, rtol=1e-14)
    for i, label in enumerate(labels):

        def log_prob(point, label=label):
            return _written_out_log_prob(label, point, temperature)

        auto_gradient = torch.autograd.functional.jacobian(log_prob, F[i])
        auto_hessian = torch.autograd.functional.hessian(log_prob, F[i])
        torch.testing.assert_close(gradient[i], auto_gradient, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(hessian[i], auto_hessian, rtol=1e-12, atol=1e-14)


def test_the_response_is_the_softmax_at_every_temperature():
    F = _latents(4, 3, seed=1)
    probabilities = torch.exp(F) / torch.exp(F).sum(-1, keepdim=True)
    torch.testing.assert_close(TemperedSoftmaxTerms(2.5).response(F), probabilities)


def test_the_tempered_mode_solves_its_stationarity_equation():
    # at the mode, f - m = tau K (y - pi) for each class's prior covariance K
    gen = torch.Generator().manual_seed(2)
    n, num_classes, tau = 8, 3, 2.0
    x = torch.rand(n, 1, generator=gen, dtype=DT)
    K = 2.0 * torch.exp(-0.5 * (x - x.T) ** 2 / 0.3**2) + 1e-8 * torch.eye(n, dtype=DT)
    labels = torch.tensor([0, 1, 2, 0, 1, 2, 2, 0], dtype=DT)
    m = torch.zeros(n, num_classes, dtype=DT)
    Ks = K.expand(num_classes, n, n)
    posterior = MulticlassLaplacePosterior(
        m, Ks, TemperedSoftmaxTerms(tau), labels, num_classes=num_classes
    )
    f = posterior.mode  # shape: (n, K)
    y = torch.nn.functional.one_hot(labels.long(), num_classes).to(DT)
    pi = torch.softmax(f, -1)
    torch.testing.assert_close(f, tau * K @ (y - pi), rtol=0, atol=1e-8)
    softmax_mode = MulticlassLaplacePosterior(
        m, Ks, SoftmaxTerms(), labels, num_classes=num_classes
    ).mode
    assert float((f - softmax_mode).abs().max()) > 1e-3  # the temperature matters


def test_at_temperature_one_it_equals_the_softmax():
    F = _latents(6, 5, seed=3)
    labels = torch.tensor([4.0, 0, 1, 3, 2, 4], dtype=DT)
    tempered, softmax = TemperedSoftmaxTerms(1.0), SoftmaxTerms()
    Y = tempered.targets(labels, num_classes=5)
    torch.testing.assert_close(Y, softmax.targets(labels, num_classes=5), rtol=0, atol=0)
    torch.testing.assert_close(tempered.log_prob(Y, F), softmax.log_prob(Y, F), rtol=0, atol=0)


@pytest.mark.parametrize("temperature", [0.0, -1.0, float("nan"), float("inf"), "2", True])
def test_a_temperature_that_is_no_positive_number_is_refused(temperature):
    with pytest.raises(ValueError, match="temperature"):
        TemperedSoftmaxTerms(temperature)


def test_bad_labels_are_refused_naming_the_argument():
    with pytest.raises(ValueError, match="labels.*0 ... 2"):
        TemperedSoftmaxTerms(2.0).targets(torch.tensor([0.0, 3.0]), num_classes=3, name="labels")
