"""RandomFeatureKernel.resample: reproducible draws, and what an ExactGP in eval mode sees."""

import gpytorch
import torch

from gpsd.dpkl import RandomFeatureKernel, sample_spectral_frequencies


class _GP(gpytorch.models.ExactGP):
    def __init__(self, x, y, kernel):
        super().__init__(x, y, gpytorch.likelihoods.GaussianLikelihood())
        self.covar_module = kernel

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(
            torch.zeros_like(x[:, 0]), self.covar_module(x)
        )


def _posterior_mean_from_features(kernel, x, y, xs, noise):
    """Weight-space posterior mean  phi_* (Phi^T Phi + noise I)^{-1} Phi^T y  (dense, float64)."""
    with torch.no_grad():
        phi, phi_s = kernel.featurize(x), kernel.featurize(xs)
        a = phi.mT @ phi + noise * torch.eye(phi.shape[-1], dtype=x.dtype)
        return phi_s @ torch.linalg.solve(a, phi.mT @ y)


def test_resample_with_a_generator_draws_the_spectral_frequencies_of_that_generator():
    kernel = RandomFeatureKernel(7, 3, nu=1.5).double()
    kernel.resample(torch.Generator().manual_seed(5))
    expected = sample_spectral_frequencies(
        7, 3, nu=1.5, generator=torch.Generator().manual_seed(5), dtype=torch.float64
    )
    torch.testing.assert_close(kernel.base_frequencies, expected, rtol=0, atol=0)
    before = kernel.base_frequencies.clone()
    kernel.resample(torch.Generator().manual_seed(6))
    assert not torch.equal(kernel.base_frequencies, before)


def test_eval_mode_model_sees_new_frequencies_after_train_eval():
    torch.manual_seed(0)
    x = torch.randn(40, 2, dtype=torch.float64)
    y = torch.sin(x.sum(-1))
    xs = torch.randn(9, 2, dtype=torch.float64)
    kernel = RandomFeatureKernel(10, 2).double()
    model = _GP(x, y, kernel).double()
    model.likelihood.noise = 0.05
    model.eval()
    with torch.no_grad():
        old = model(xs).mean
    torch.testing.assert_close(old, _posterior_mean_from_features(kernel, x, y, xs, 0.05))

    kernel.resample(torch.Generator().manual_seed(1))
    model.train()
    model.eval()
    with torch.no_grad():
        new = model(xs).mean
    reference = _posterior_mean_from_features(kernel, x, y, xs, 0.05)
    torch.testing.assert_close(new, reference)
    assert (new - old).abs().max() > 1e-3  # the draw changed the predictor
