"""RandomFeatureKernel.resample: reproducible draws, and what an ExactGP in eval mode sees."""

import gpytorch
import pytest
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


def _strict_randn(monkeypatch):
    """torch.randn refusing a generator on another device than the draw, as CUDA does ("Expected
    a 'cuda' device type for generator but found 'cpu'"); the CPU does not check."""
    plain = torch.randn

    def randn(*args, generator=None, device=None, **kwargs):
        want = torch.device("cpu" if device is None else device)
        if generator is not None and generator.device.type != want.type:
            raise RuntimeError(f"Expected a '{want.type}' device type for generator")
        return plain(*args, generator=generator, device=device, **kwargs)

    monkeypatch.setattr(torch, "randn", randn)


def test_a_cpu_generator_draws_for_a_kernel_on_another_device(monkeypatch):
    """Before, resample(cpu_generator) on a CUDA kernel raised: the draw was asked for on the
    kernel's device with the CPU generator. The 'meta' device stands in for CUDA here."""
    _strict_randn(monkeypatch)
    for nu in (None, 1.5):
        kernel = RandomFeatureKernel(8, 2, nu=nu).double().to("meta")
        kernel.resample(torch.Generator().manual_seed(0))
        assert kernel.base_frequencies.device.type == "meta"
        on_cpu = sample_spectral_frequencies(
            8, 2, nu=nu, generator=torch.Generator().manual_seed(0), dtype=torch.float64
        )
        moved = sample_spectral_frequencies(
            8, 2, nu=nu, generator=torch.Generator().manual_seed(0), dtype=torch.float64,
            device="meta",
        )  # fmt: skip
        assert moved.device.type == "meta" and moved.shape == on_cpu.shape


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_kernel_resampled_with_a_cpu_generator_equals_the_cpu_draw():
    kernel = RandomFeatureKernel(8, 3, nu=2.5).double().cuda()
    kernel.resample(torch.Generator().manual_seed(4))
    expected = sample_spectral_frequencies(
        8, 3, nu=2.5, generator=torch.Generator().manual_seed(4), dtype=torch.float64
    )
    torch.testing.assert_close(kernel.base_frequencies.cpu(), expected, rtol=0, atol=0)
