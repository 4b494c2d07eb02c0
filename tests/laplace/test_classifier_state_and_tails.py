"""Classifier state across load_state_dict/.to(), float32 Newton, and the probit tails."""

import numpy as np
import pytest
import torch
from gpr_reference import rbf_kernel

from gpsd import DataCentricGPC, DistributionCentricGPC, LaplaceGPClassifier
from gpsd.data.toy import sine_classification
from gpsd.laplace import (
    BernoulliLogitTerms,
    BernoulliProbitTerms,
    find_laplace_mode,
    gauss_hermite_expectation,
)


def _kernel(outputscale=2.0, lengthscale=1.3, dtype=torch.float64, batch_shape=()):
    return rbf_kernel(outputscale, lengthscale, dtype, batch_shape=torch.Size(batch_shape))


@pytest.fixture
def toy():
    return sine_classification(30, seed=3)


def test_distribution_centric_unkept_step_follows_load_state_dict_and_to(toy):
    x, y, test_x = toy
    kw = dict(num_steps=3, method="tempered", store_all_steps=False)
    a = DistributionCentricGPC(x, y, _kernel(lengthscale=0.9), **kw).fit()
    b = DistributionCentricGPC(x, 1 - y, _kernel(lengthscale=2.0), **kw).fit()
    a.predict_proba(test_x, step=1)[..., 1]  # fills the cache of the unkept step 1
    a.load_state_dict(b.state_dict())
    torch.testing.assert_close(
        a.predict_proba(test_x, step=1)[..., 1], b.predict_proba(test_x, step=1)[..., 1]
    )
    a32 = DistributionCentricGPC(x, y, _kernel(), **kw).fit()
    ref = a32.predict_proba(test_x, step=1)[..., 1]
    a32.float()
    got = a32.predict_proba(test_x.float(), step=1)[..., 1]
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), ref, rtol=1e-3, atol=2e-4)


@pytest.mark.parametrize(
    "build",
    [
        lambda x, y, k: LaplaceGPClassifier(x, y, k),
        lambda x, y, k: DataCentricGPC(x, y, k, num_steps=2, noise=0.1),
        lambda x, y, k: DistributionCentricGPC(x, y, k, num_steps=2, method="iterated"),
    ],
)
def test_fitted_state_of_a_batched_kernel_loads_into_a_fresh_model(toy, build):
    x, y, test_x = toy
    batch = torch.Size([2])
    fitted = build(x, y, _kernel(batch_shape=batch)).fit()
    fresh = build(x, y, _kernel(batch_shape=batch))
    fresh.load_state_dict(fitted.state_dict())  # the buffers took the batch shape at fit()
    torch.testing.assert_close(
        fresh.predict_proba(test_x)[..., 1], fitted.predict_proba(test_x)[..., 1]
    )


@pytest.mark.parametrize("likelihood", ["bernoulli_logit", "bernoulli_probit"])
def test_float32_newton_converges_with_a_large_kernel_scale(likelihood):
    gen = torch.Generator().manual_seed(1)
    x = 6 * torch.rand(100, 1, generator=gen, dtype=torch.float64)
    y = (x[:, 0] > 3).double()
    y[[10, 20, 30]] = 1 - y[[10, 20, 30]]  # label noise: a mode with finite latents
    lml = []
    for dtype in (torch.float64, torch.float32):
        k = _kernel(outputscale=1e3, lengthscale=2.0, dtype=dtype)
        model = LaplaceGPClassifier(x.to(dtype), y.to(dtype), k, likelihood=likelihood).fit()
        with torch.no_grad():
            lml.append(float(model.log_marginal_likelihood()))
    # float32 used to raise LaplaceConvergenceError here; K's scale leaves ~1e-5 of accuracy
    assert lml[1] == pytest.approx(lml[0], rel=2e-4)


def test_float64_newton_converges_at_outputscale_1e6_to_the_mpmath_mode():
    mpmath = pytest.importorskip("mpmath")
    mpmath.mp.dps = 40
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(20, 1, generator=gen, dtype=torch.float64)
    y = (x[:, 0] > 0.5).double()
    flip = torch.randperm(20, generator=gen)[:2]
    y[flip] = 1 - y[flip]
    K = rbf_kernel(outputscale=1e6, lengthscale=0.2)(x).to_dense().detach()  # condition ~1e17
    mode = find_laplace_mode(K, y, BernoulliLogitTerms())  # raised LaplaceConvergenceError before
    # the same Newton iteration, f <- K (I + W K)^-1 (W f + y - sigmoid(f)), in 40 digits
    Km, f = mpmath.matrix(K.tolist()), mpmath.matrix(20, 1)
    for _ in range(60):
        s = [1 / (1 + mpmath.exp(-f[i])) for i in range(20)]
        W = [s[i] * (1 - s[i]) for i in range(20)]
        b = mpmath.matrix([W[i] * f[i] + y[i].item() - s[i] for i in range(20)])
        f = Km * mpmath.lu_solve(mpmath.eye(20) + mpmath.diag(W) * Km, b)
    ref = torch.tensor([float(v) for v in f], dtype=torch.float64)
    assert ref.abs().max() > 100  # latents far from zero: a large-scale problem
    torch.testing.assert_close(mode.f, ref, rtol=0, atol=1e-9 * ref.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_probit_curvature_in_the_far_tail_against_mpmath(dtype):
    mpmath = pytest.importorskip("mpmath")
    mpmath.mp.dps = 50
    z = [-1e4, -300.0, -50.0, -10.0, -5.01, -4.99, -1.0, 0.0, 3.0]
    if dtype == torch.float32:
        z = z[1:]  # -1e4 squared overflows float32's exponent range in the density
    d1, d2 = BernoulliProbitTerms().derivatives(
        torch.ones(len(z), dtype=dtype), torch.tensor(z, dtype=dtype)
    )
    ref1, ref2 = [], []
    for v in z:
        r = mpmath.npdf(v) / mpmath.ncdf(v)
        ref1.append(float(r))
        ref2.append(float(-r * (r + v)))
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(
        d1.double(), torch.tensor(ref1, dtype=torch.float64), rtol=400 * eps, atol=0
    )
    # 61 % off at z = -1e4 in float64, wrong sign at z = -300 in float32 before
    torch.testing.assert_close(
        d2.double(), torch.tensor(ref2, dtype=torch.float64), rtol=1e4 * eps, atol=0
    )


def test_probit_method_is_exact_for_a_probit_likelihood(toy):
    x, y, test_x = toy
    model = LaplaceGPClassifier(x, y, _kernel(), likelihood="bernoulli_probit").fit()
    latent = model.predict_latent(test_x)
    mean, var = latent.mean, latent.variance
    exact = gauss_hermite_expectation(torch.special.ndtr, mean, var, 200)
    torch.testing.assert_close(model.predict_proba(test_x, method="probit")[..., 1], exact)
    ds = DistributionCentricGPC(x, y, _kernel(), num_steps=2, likelihood="bernoulli_probit").fit()
    latent = ds.predict_latent(test_x)
    mean, var = latent.mean, latent.variance
    exact = gauss_hermite_expectation(torch.special.ndtr, mean, var, 200)
    torch.testing.assert_close(ds.predict_proba(test_x, method="probit")[..., 1], exact)


def test_classifier_arguments_are_named(toy):
    x, y, _ = toy
    K = _kernel()(x).to_dense().detach()
    with pytest.raises(ValueError, match="max_iter"):
        find_laplace_mode(K, y, BernoulliProbitTerms(), max_iter=0)
    for cls, kw in ((DataCentricGPC, dict(noise=0.1)), (DistributionCentricGPC, {})):
        with pytest.raises(ValueError, match="max_iter"):
            cls(x, y, _kernel(), num_steps=2, max_iter=0, **kw)
        with pytest.raises(ValueError, match="max_iter"):
            cls(x, y, _kernel(), num_steps=2, max_iter=2.5, **kw)
    with pytest.raises(ValueError, match="temperature"):
        LaplaceGPClassifier(x, y, _kernel(), temperature=float("inf"))
    with pytest.raises(TypeError, match="noise must be a number or a sequence"):
        DataCentricGPC(x, y, _kernel(), num_steps=2, noise="0.1")
    reference = DataCentricGPC(x, y, _kernel(), num_steps=2, noise=0.1).fit()
    for noise in (torch.tensor(0.1, dtype=torch.float64), np.float64(0.1)):
        model = DataCentricGPC(x, y, _kernel(), num_steps=2, noise=noise).fit()
        torch.testing.assert_close(model.latent_modes, reference.latent_modes)
