"""Predictions of LaplaceGPClassifier differentiate through the mode.

The mode is found without autograd; predictions used to treat it as a constant, so their
gradients in the hyperparameters were wrong (the variance's even had the wrong sign). Checked
against central differences of refitted predictions."""

import gpytorch
import pytest
import torch
from gpytorch.likelihoods.likelihood import _OneDimensionalLikelihood

from gpsd.laplace import AutogradLikelihoodTerms, LaplaceGPClassifier

DT = torch.float64


class _ScaledLogit(_OneDimensionalLikelihood):
    """Bernoulli(sigmoid(a f)) with a learnable slope a: log-concave, one likelihood parameter."""

    def __init__(self):
        super().__init__()
        self.register_parameter("raw_a", torch.nn.Parameter(torch.tensor(0.3, dtype=DT)))

    def forward(self, f, *args, **kwargs):
        slope = torch.nn.functional.softplus(self.raw_a)
        return torch.distributions.Bernoulli(logits=slope * f, validate_args=False)


def _model(likelihood="bernoulli_logit"):
    gen = torch.Generator().manual_seed(3)
    x = 6 * torch.rand(30, 1, generator=gen, dtype=DT) - 3
    y = (torch.rand(30, generator=gen, dtype=DT) < torch.sigmoid(2 * torch.sin(x[:, 0]))).to(DT)
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).to(DT)
    kernel.outputscale = 2.0
    kernel.base_kernel.lengthscale = 0.8
    mean = gpytorch.means.ConstantMean().to(DT)
    mean.constant.data.fill_(0.2)
    return LaplaceGPClassifier(x, y, kernel, mean_module=mean, likelihood=likelihood)


TEST_X = torch.tensor([[-2.0], [0.3], [2.5]], dtype=DT)


def _outputs(model):
    latent = model.predict_latent(TEST_X)
    mean, var = latent.mean, latent.variance
    cov = model(TEST_X).covariance_matrix
    return [mean.sum(), var.sum(), model.predict_proba(TEST_X)[..., 1].sum(), cov[0, 1]]


def _central_differences(model, param, h=1e-5):
    with torch.no_grad():
        param += h
        up = [float(t) for t in _outputs(model)]
        param -= 2 * h
        down = [float(t) for t in _outputs(model)]
        param += h
    return torch.tensor([(u - d) / (2 * h) for u, d in zip(up, down, strict=True)], dtype=DT)


@pytest.mark.parametrize(
    "name",
    [
        "covar_module.raw_outputscale",
        "covar_module.base_kernel.raw_lengthscale",
        "mean_module.raw_constant",
    ],
)
def test_prediction_gradients_in_kernel_and_mean_parameters(name):
    model = _model()
    param = dict(model.named_parameters())[name]
    outputs = _outputs(model)
    grads = torch.stack(
        [torch.autograd.grad(t, param, retain_graph=True)[0].sum() for t in outputs]
    )
    expected = _central_differences(model, param)
    assert grads.abs().max() > 1e-3  # the outputs do depend on the parameter
    torch.testing.assert_close(grads, expected, rtol=1e-6, atol=1e-8)


def test_prediction_gradients_in_a_likelihood_parameter():
    likelihood = _ScaledLogit()
    model = _model(AutogradLikelihoodTerms(likelihood))
    outputs = _outputs(model)
    grads = torch.stack(
        [torch.autograd.grad(t, likelihood.raw_a, retain_graph=True)[0] for t in outputs]
    )
    expected = _central_differences(model, likelihood.raw_a)
    assert grads.abs().max() > 1e-3
    torch.testing.assert_close(grads, expected, rtol=1e-6, atol=1e-8)


def test_values_are_those_of_the_mode_found_without_autograd():
    model = _model()
    with torch.no_grad():
        plain = [t.clone() for t in _outputs(model)]
    for got, expected in zip(_outputs(model), plain, strict=True):
        torch.testing.assert_close(got.detach(), expected, rtol=1e-12, atol=1e-12)
