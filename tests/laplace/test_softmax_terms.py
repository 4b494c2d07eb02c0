"""SoftmaxTerms: log-likelihood, gradient and Hessian blocks against numpy, autograd and the
Bernoulli-logit terms at K = 2; the checks of the labels."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpsd.laplace import BernoulliLogitTerms, SoftmaxTerms

DT = torch.float64


def _latents(n, num_classes, seed, scale=2.0):
    gen = torch.Generator().manual_seed(seed)
    return scale * torch.randn(n, num_classes, generator=gen, dtype=DT)


def test_log_prob_is_the_log_softmax_of_the_label():
    F = _latents(6, 4, seed=0)
    labels = torch.tensor([0, 3, 1, 2, 3, 0])
    terms = SoftmaxTerms()
    Y = terms.targets(labels.to(DT), num_classes=4)
    f = F.numpy()
    expected = [f[i, k] - np.log(np.exp(f[i]).sum()) for i, k in enumerate(labels.tolist())]
    np.testing.assert_allclose(terms.log_prob(Y, F).numpy(), expected, rtol=1e-14)


def test_gradient_and_hessian_blocks_match_autograd():
    F = _latents(5, 3, seed=1)
    terms = SoftmaxTerms()
    Y = terms.targets(torch.tensor([2.0, 0, 1, 1, 2], dtype=DT), num_classes=3)
    gradient, hessian = terms.derivatives(Y, F)
    for i in range(5):

        def log_prob(f, i=i):
            return terms.log_prob(Y[i], f)

        auto_gradient = torch.autograd.functional.jacobian(log_prob, F[i])
        auto_hessian = torch.autograd.functional.hessian(log_prob, F[i])
        torch.testing.assert_close(gradient[i], auto_gradient, rtol=0, atol=1e-14)
        torch.testing.assert_close(hessian[i], auto_hessian, rtol=0, atol=1e-14)
    # singular along the all-ones direction
    torch.testing.assert_close(hessian.sum(-1), torch.zeros(5, 3, dtype=DT), rtol=0, atol=1e-15)


def test_two_classes_reduce_to_bernoulli_logit_on_the_difference():
    F = _latents(8, 2, seed=2, scale=5.0)
    labels = torch.tensor([0.0, 1, 1, 0, 1, 0, 0, 1], dtype=DT)
    terms, binary = SoftmaxTerms(), BernoulliLogitTerms()
    Y = terms.targets(labels, num_classes=2)
    difference = F[:, 1] - F[:, 0]
    torch.testing.assert_close(terms.log_prob(Y, F), binary.log_prob(labels, difference))
    gradient, hessian = terms.derivatives(Y, F)
    d1, d2 = binary.derivatives(labels, difference)
    torch.testing.assert_close(gradient, torch.stack([-d1, d1], -1), rtol=0, atol=1e-15)
    sign = torch.tensor([[1.0, -1.0], [-1.0, 1.0]], dtype=DT)
    torch.testing.assert_close(hessian, d2[:, None, None] * sign, rtol=0, atol=1e-15)
    torch.testing.assert_close(terms.response(F)[:, 1], binary.response(difference))


def test_large_latents_stay_finite():
    F = torch.tensor([[800.0, -800.0, 0.0]], dtype=torch.float32)
    terms = SoftmaxTerms()
    Y = terms.targets(torch.tensor([1.0]), num_classes=3)
    assert terms.log_prob(Y, F).item() == pytest.approx(-1600.0)
    gradient, hessian = terms.derivatives(Y, F)
    assert torch.isfinite(gradient).all() and torch.isfinite(hessian).all()


def test_labels_are_checked():
    terms = SoftmaxTerms()
    with pytest.raises(ValueError, match=r"y must hold integer class labels in 0 \.\.\. 2"):
        terms.targets(torch.tensor([0.0, 3.0]), num_classes=3, name="y")
    with pytest.raises(ValueError, match="integer class labels"):
        terms.targets(torch.tensor([0.5, 1.0]), num_classes=3)
    with pytest.raises(ValueError, match="integer class labels"):
        terms.targets(torch.tensor([-1.0, 1.0]), num_classes=3)
    with pytest.raises(ValueError, match="must be finite"):
        terms.targets(torch.tensor([float("nan"), 1.0]), num_classes=3)
    with pytest.raises(ValueError, match="pass num_classes"):
        terms.targets(torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="num_classes must be an integer >= 2"):
        terms.targets(torch.tensor([0.0, 0.0]), num_classes=1)
    one_hot = terms.targets(torch.tensor([2.0, 0.0], dtype=DT), num_classes=3)
    assert torch.equal(one_hot, torch.tensor([[0.0, 0, 1], [1, 0, 0]], dtype=DT))
