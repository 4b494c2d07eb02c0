"""Tests of RandomFeatureKernel and sample_spectral_frequencies."""

import math

import gpytorch
import numpy as np
import pytest
import torch
from linear_operator.operators import LowRankRootAddedDiagLinearOperator, LowRankRootLinearOperator

from gpsd.dpkl import RandomFeatureKernel, sample_spectral_frequencies


def test_random_feature_outputscale_setter_keeps_float64_precision():
    torch.set_default_dtype(torch.float32)
    kernel = RandomFeatureKernel(4, 2).double()
    kernel.outputscale = 0.7
    assert kernel.outputscale.dtype == torch.float64
    assert abs(kernel.outputscale.item() - 0.7) < 1e-15  # 0.7 read as float32 is 0.69999998807


def _exact(z, lengthscale, outputscale, nu=None):
    base = gpytorch.kernels.RBFKernel() if nu is None else gpytorch.kernels.MaternKernel(nu=nu)
    k = gpytorch.kernels.ScaleKernel(base).to(z)
    k.base_kernel.lengthscale = lengthscale
    k.outputscale = outputscale
    return k(z).to_dense().detach()


def _rff_error(R, z, seeds, orthogonal=False, nu=None):
    errs = []
    exact = _exact(z, 0.8, 1.7, nu)
    for s in seeds:
        torch.manual_seed(s)
        k = RandomFeatureKernel(R, z.shape[-1], orthogonal=orthogonal, nu=nu).to(z)
        k.lengthscale = 0.8
        k.outputscale = 1.7
        approx = k(z).to_dense().detach()
        errs.append(float((approx - exact).pow(2).mean().sqrt()))
    return float(np.mean(errs))


def _woodbury_setup(n=40, R=8, d=3):
    torch.set_default_dtype(torch.float64)
    train_x = torch.randn(n, d)
    train_y = torch.randn(n)

    class GP(gpytorch.models.ExactGP):
        def __init__(self):
            lik = gpytorch.likelihoods.GaussianLikelihood()
            super().__init__(train_x, train_y, lik)
            self.mean_module = gpytorch.means.ConstantMean()
            self.covar_module = RandomFeatureKernel(R, d, ard_num_dims=d)

        def forward(self, x):
            return gpytorch.distributions.MultivariateNormal(
                self.mean_module(x), self.covar_module(x)
            )

    model = GP()
    model.covar_module.lengthscale = torch.tensor([0.7, 1.3, 2.0])
    model.covar_module.outputscale = 1.9
    model.likelihood.noise = 0.3
    model.mean_module.constant.data.fill_(0.2)
    return model, train_x, train_y


def test_rff_converges_to_rbf_at_rate_one_over_sqrt_r():
    torch.set_default_dtype(torch.float64)
    z = torch.randn(30, 2)
    rs = [50, 200, 800, 3200]
    errors = [_rff_error(R, z, seeds=range(5)) for R in rs]
    slope = np.polyfit(np.log(rs), np.log(errors), 1)[0]
    assert -0.65 < slope < -0.35, (errors, slope)
    assert errors[-1] < 0.05


@pytest.mark.parametrize("nu", [0.5, 1.5, 2.5])
def test_rff_converges_to_matern(nu):
    torch.set_default_dtype(torch.float64)
    z = torch.randn(20, 3)
    err_small = _rff_error(100, z, seeds=range(4), nu=nu)
    err_big = _rff_error(6400, z, seeds=range(4), nu=nu)
    assert err_big < 0.04
    assert err_big < err_small / 4


def test_orthogonal_features_have_lower_error():
    torch.set_default_dtype(torch.float64)
    z = torch.randn(40, 8) * 0.5
    iid = _rff_error(16, z, seeds=range(30))
    orf = _rff_error(16, z, seeds=range(30), orthogonal=True)
    assert orf < iid


def test_orthogonal_frequency_blocks():
    torch.set_default_dtype(torch.float64)
    d = 6
    v = sample_spectral_frequencies(2000 * d, d, orthogonal=True)
    block = v[:d]
    gram = block @ block.mT
    off = gram - torch.diag(torch.diagonal(gram))
    assert float(off.abs().max()) < 1e-10  # rows of a block are orthogonal
    # row norms follow chi_d: E||v||^2 = d, and every coordinate is N(0, 1)
    assert abs(float(v.pow(2).sum(-1).mean()) - d) < 0.1
    assert abs(float(v[:, 0].std()) - 1.0) < 0.02
    assert v.shape == (2000 * d, d)
    assert sample_spectral_frequencies(7, 3, orthogonal=True).shape == (7, 3)


def test_woodbury_mll_equals_dense_cholesky_with_equal_gradients(monkeypatch):
    model, x, y = _woodbury_setup()
    calls = []
    original = LowRankRootAddedDiagLinearOperator.inv_quad_logdet

    def spy(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(LowRankRootAddedDiagLinearOperator, "inv_quad_logdet", spy)
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(model.likelihood, model)
    with gpytorch.settings.max_cholesky_size(0):  # would force CG if Woodbury were not used
        loss = -mll(model(x), y) * x.shape[0]
    assert calls, "the Woodbury path of LowRankRootAddedDiagLinearOperator was not used"
    params = [p for p in model.parameters()]
    grads = torch.autograd.grad(loss, params, allow_unused=True)

    # independent dense computation with torch.distributions
    phi = model.covar_module.featurize(x)
    assert isinstance(model.covar_module(x).evaluate_kernel(), LowRankRootLinearOperator)
    cov = phi @ phi.mT + model.likelihood.noise * torch.eye(x.shape[0])
    mean = model.mean_module.constant.expand(x.shape[0])
    dense = -torch.distributions.MultivariateNormal(mean, covariance_matrix=cov).log_prob(y)
    dense_grads = torch.autograd.grad(dense, params, allow_unused=True)
    assert abs(float(loss.detach()) - float(dense.detach())) < 1e-8
    for g, h in zip(grads, dense_grads, strict=True):
        if g is None or h is None:
            assert g is None and h is None
            continue
        torch.testing.assert_close(g, h, rtol=1e-8, atol=1e-10)


def test_woodbury_predictions_equal_dense():
    model, x, y = _woodbury_setup()
    xs = torch.randn(9, 3)
    model.eval()
    with torch.no_grad():
        pred = model(xs)
        mean, var = pred.mean, pred.variance
        phi = model.covar_module.featurize(x)
        phis = model.covar_module.featurize(xs)
        noise = model.likelihood.noise
        c = model.mean_module.constant
        kxx = phi @ phi.mT + noise * torch.eye(x.shape[0])
        ks = phis @ phi.mT
        ref_mean = c + ks @ torch.linalg.solve(kxx, y - c)
        ref_var = (phis * phis).sum(-1) - (ks * torch.linalg.solve(kxx, ks.mT).mT).sum(-1)
    torch.testing.assert_close(mean, ref_mean, rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(var, ref_var, rtol=1e-7, atol=1e-10)


def test_features_float32_and_errors():
    k = RandomFeatureKernel(5, 2)
    z = torch.randn(4, 2, dtype=torch.float32)
    assert k.featurize(z).shape == (4, 10)
    torch.testing.assert_close(
        k(z, diag=True), torch.full((4,), float(k.outputscale.detach())), rtol=1e-5, atol=1e-5
    )
    with pytest.raises(ValueError, match="num_dims"):
        k.featurize(torch.randn(4, 3))
    with pytest.raises(ValueError, match="num_features"):
        RandomFeatureKernel(0, 2)
    with pytest.raises(ValueError, match="nu"):
        RandomFeatureKernel(5, 2, nu=1.0)
    state = k.state_dict()
    k2 = RandomFeatureKernel(5, 2)
    k2.load_state_dict(state)
    torch.testing.assert_close(k2.featurize(z), k.featurize(z))
    assert math.isclose(float(k2.outputscale.detach()), float(k.outputscale.detach()))


@pytest.mark.parametrize("nu", [0.5, 1.5, 2.5, 1.75])
def test_matern_frequencies_come_from_the_generator_alone(nu):
    state = torch.random.get_rng_state()
    a = sample_spectral_frequencies(6, 2, nu=nu, generator=torch.Generator().manual_seed(4))
    b = sample_spectral_frequencies(6, 2, nu=nu, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert torch.equal(torch.random.get_rng_state(), state)  # the global RNG did not move


def test_matern_frequencies_leave_the_cuda_generators_alone(monkeypatch):
    # a non-integer dof must not seed a forked CPU RNG with torch.manual_seed, which also
    # reseeds every CUDA generator (queued until CUDA starts) and resets the caller's GPU
    # randomness
    calls = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda seed: calls.append(seed))
    monkeypatch.setattr(torch.cuda, "manual_seed", lambda seed: calls.append(seed))
    sample_spectral_frequencies(6, 2, nu=1.75, generator=torch.Generator().manual_seed(4))
    assert calls == []


@pytest.mark.parametrize("nu", [1.5, 1.75])
def test_matern_frequencies_are_student_t(nu):
    # Each coordinate of g sqrt(2 nu / u), u ~ chi^2_{2 nu}, is Student-t with 2 nu dof.
    stats = pytest.importorskip("scipy.stats")
    gen = torch.Generator().manual_seed(0)
    v = sample_spectral_frequencies(20000, 1, nu=nu, generator=gen, dtype=torch.float64)
    ks = stats.kstest(v.squeeze(-1).numpy(), stats.t(df=2 * nu).cdf)
    assert ks.pvalue > 1e-3


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


def test_a_cpu_generator_draws_for_a_kernel_on_another_device(monkeypatch):
    """resample(cpu_generator) on a CUDA kernel draws on the CPU and moves the draw (asking for
    it on the kernel's device with the CPU generator would raise). The 'meta' device stands in
    for CUDA here."""
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
