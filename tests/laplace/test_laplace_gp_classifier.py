"""LaplaceGPClassifier against scikit-learn's GaussianProcessClassifier, a generic optimiser,
quadrature and finite differences; its refits, state, hyperparameter training, gradients
through the mode, and the estimator convention (fit, predict_proba, predict, predict_latent)."""

import contextlib
import copy
import functools
import math
import pickle

import gpytorch
import numpy as np
import pytest
import torch
from conftest import requires_cuda
from fit_triggers import COMMON_TRIGGERS, apply_common_trigger, predictions_equal
from gpr_reference import rbf_kernel
from gpytorch.likelihoods.likelihood import _OneDimensionalLikelihood
from scipy import integrate, optimize
from sklearn.gaussian_process import GaussianProcessClassifier
from sklearn.gaussian_process.kernels import RBF, ConstantKernel

import gpsd
from gpsd import (
    DataCentricGPC,
    DistributionCentricGPC,
    LaplaceGPClassifier,
)
from gpsd.data.toy import sine_classification
from gpsd.laplace import (
    AutogradLikelihoodTerms,
    BernoulliLogitTerms,
    BernoulliProbitTerms,
    LaplaceConvergenceError,
    find_laplace_mode,
    gauss_hermite_expectation,
)
from gpsd.likelihoods import ContinuousBernoulliLikelihood

sk_gpc = pytest.importorskip("sklearn.gaussian_process")


def _kernel(outputscale=2.0, lengthscale=1.3, dtype=torch.float64):
    k = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).to(dtype)
    k.outputscale = outputscale
    k.base_kernel.lengthscale = lengthscale
    return k


@pytest.fixture
def toy():
    x, y, test_x = sine_classification(40, seed=3)
    return x, y, test_x


def test_matches_sklearn_gaussian_process_classifier(toy):
    from sklearn.gaussian_process.kernels import RBF, ConstantKernel

    x, y, test_x = toy
    model = LaplaceGPClassifier(x, y, _kernel(2.0, 1.3)).fit()
    gpc = sk_gpc.GaussianProcessClassifier(
        ConstantKernel(2.0) * RBF(1.3), optimizer=None, max_iter_predict=200
    ).fit(x.numpy()[:, None], y.numpy())
    base = gpc.base_estimator_
    np.testing.assert_allclose(model.mode.f.numpy(), base.f_cached, atol=1e-6, rtol=0)
    # sklearn's predictive latent moments (R&W Alg. 3.2) recomputed from its attributes
    K_star = base.kernel_(base.X_train_, test_x.numpy()[:, None])
    sk_mean = K_star.T @ (base.y_train_ - base.pi_)
    v = np.linalg.solve(base.L_, base.W_sr_[:, None] * K_star)
    sk_var = base.kernel_.diag(test_x.numpy()[:, None]) - (v * v).sum(0)
    latent = model.predict_latent(test_x)
    mean, var = latent.mean, latent.variance
    np.testing.assert_allclose(mean.detach().numpy(), sk_mean, atol=1e-6, rtol=0)
    np.testing.assert_allclose(var.detach().numpy(), sk_var, atol=1e-6, rtol=0)
    assert model.mode.log_marginal_likelihood.item() == pytest.approx(
        base.log_marginal_likelihood_value_, abs=1e-6
    )
    # sklearn's probabilities use an erf-mixture approximation of the same integral
    probs = model.predict_proba(test_x)[..., 1].detach().numpy()
    np.testing.assert_allclose(probs, gpc.predict_proba(test_x.numpy()[:, None])[:, 1], atol=5e-4)


@pytest.mark.parametrize(
    "likelihood", ["bernoulli_logit", "bernoulli_probit", "continuous_bernoulli"]
)
def test_newton_reaches_mode_of_generic_bfgs(toy, likelihood):
    x, y, _ = toy
    if likelihood == "continuous_bernoulli":
        y = torch.sigmoid(2.0 * torch.sin(x * math.pi / 2.0))
    model = LaplaceGPClassifier(x, y, _kernel(), likelihood=likelihood, noise=0.05).fit()
    K = (model.prior_train()[1]).detach().numpy()
    L = np.linalg.cholesky(K)
    terms = model.terms
    yt = y

    # log posterior in whitened coordinates f = L u (well conditioned), by BFGS with exact
    # gradient; BFGS may stop on precision loss near 1e-8, so two generic Newton steps on the
    # autograd Hessian polish its point
    def objective(u_t):
        f = torch.as_tensor(L) @ u_t
        return 0.5 * (u_t * u_t).sum() - terms.log_prob(yt, f).sum()

    def negative_log_posterior(u):
        u_t = torch.tensor(u, dtype=torch.float64, requires_grad=True)
        val = objective(u_t)
        (g,) = torch.autograd.grad(val, u_t)
        return val.item(), g.numpy()

    res = optimize.minimize(
        negative_log_posterior,
        np.zeros(len(y)),
        jac=True,
        method="BFGS",
        options={"gtol": 1e-12, "maxiter": 10000},
    )
    assert np.abs(res.jac).max() < 1e-6
    u = torch.tensor(res.x, dtype=torch.float64)
    for _ in range(2):
        grad = torch.func.grad(objective)(u)
        u = u - torch.linalg.solve(torch.autograd.functional.hessian(objective, u), grad)
    assert float(torch.func.grad(objective)(u).abs().max()) < 1e-11
    np.testing.assert_allclose(model.mode.f.numpy(), L @ u.numpy(), atol=1e-8, rtol=0)


@pytest.mark.parametrize(
    "likelihood", ["bernoulli_logit", "bernoulli_probit", "continuous_bernoulli"]
)
def test_log_marginal_likelihood_gradient_matches_finite_differences(toy, likelihood):
    x, y, _ = toy
    if likelihood == "continuous_bernoulli":
        y = torch.sigmoid(2.0 * torch.sin(x * math.pi / 2.0))
    mean = gpytorch.means.ConstantMean().double()
    mean.constant.data.fill_(0.3)
    model = LaplaceGPClassifier(x, y, _kernel(), likelihood=likelihood, mean_module=mean, noise=0.1)
    names, params = zip(*model.named_parameters(), strict=True)
    grads = torch.autograd.grad(model.log_marginal_likelihood(), params)
    h = 1e-4
    for name, p, g in zip(names, params, grads, strict=True):
        with torch.no_grad():
            p.add_(h)
            up = model.fit(warm_start=False).mode.log_marginal_likelihood.item()
            p.sub_(2 * h)
            down = model.fit(warm_start=False).mode.log_marginal_likelihood.item()
            p.add_(h)
        assert g.item() == pytest.approx((up - down) / (2 * h), rel=1e-6, abs=1e-8), name


def test_hyperparameters_train_in_a_torch_loop(toy):
    x, y, _ = toy
    model = LaplaceGPClassifier(x, y, _kernel(1.0, 0.3))
    start = model.log_marginal_likelihood().item()
    history = model.optimize_hyperparameters(max_iter=25, lr=0.1).history
    assert -history[-1] > start + 1.0
    assert model.log_marginal_likelihood().item() > start


def test_gauss_hermite_is_exact_to_order():
    mean = torch.tensor([-1.0, 0.3, 2.0], dtype=torch.float64)
    var = torch.tensor([0.5, 2.0, 4.0], dtype=torch.float64)
    # exact for a polynomial of degree 2J - 1 = 7 (J = 4): E[f^7] of a Gaussian
    moments = gauss_hermite_expectation(lambda f: f**7, mean, var, num_points=4)
    m, s2 = mean, var
    exact = m**7 + 21 * m**5 * s2 + 105 * m**3 * s2**2 + 105 * m * s2**3
    torch.testing.assert_close(moments, exact, rtol=1e-12, atol=1e-12)
    probs = gauss_hermite_expectation(torch.sigmoid, mean, var, num_points=64)
    for i in range(3):
        mu, v = m[i].item(), s2[i].item()
        ref = integrate.quad(
            lambda f, mu=mu, v=v: (
                1
                / (1 + math.exp(-f))
                * math.exp(-0.5 * (f - mu) ** 2 / v)
                / math.sqrt(2 * math.pi * v)
            ),
            -50,
            50,
            epsabs=1e-13,
        )[0]
        assert probs[i].item() == pytest.approx(ref, abs=1e-9)


def test_probit_link_quadrature_matches_closed_form(toy):
    x, y, test_x = toy
    model = LaplaceGPClassifier(x, y, _kernel(), likelihood="probit").fit()
    latent = model.predict_latent(test_x)
    mean, var = latent.mean, latent.variance
    exact = torch.special.ndtr(mean / torch.sqrt(1 + var))
    torch.testing.assert_close(
        model.predict_proba(test_x)[..., 1].detach(), exact.detach(), rtol=1e-8, atol=1e-10
    )


def test_latent_predictive_matches_dense_formula(toy):
    x, y, test_x = toy
    k = _kernel()
    model = LaplaceGPClassifier(
        x, y, k, likelihood="continuous_bernoulli" if False else "logit", noise=0.2
    ).fit()
    with torch.no_grad():
        K = k(x[:, None]).to_dense() + 0.2 * torch.eye(len(x), dtype=x.dtype)
        Ks = k(test_x[:, None], x[:, None]).to_dense()
        Kss = k(test_x[:, None]).to_dense()
        f = model.mode.f
        W = torch.sigmoid(f) * torch.sigmoid(-f)
        mean = Ks @ torch.linalg.solve(K, f)
        cov = Kss - Ks @ torch.linalg.solve(K + torch.diag(1 / W), Ks.T)
        dist = model(test_x)
    torch.testing.assert_close(dist.mean, mean, rtol=1e-7, atol=1e-7)
    torch.testing.assert_close(dist.covariance_matrix, cov, rtol=1e-6, atol=1e-7)


def test_autograd_terms_match_closed_form(toy):
    x, y, _ = toy

    class LogitLikelihood(gpytorch.likelihoods.likelihood._OneDimensionalLikelihood):
        def forward(self, f, *args, **kwargs):
            return torch.distributions.Bernoulli(logits=f, validate_args=False)

    auto = LaplaceGPClassifier(
        x, y, _kernel(), likelihood=AutogradLikelihoodTerms(LogitLikelihood())
    )
    closed = LaplaceGPClassifier(x, y, _kernel(), likelihood=BernoulliLogitTerms())
    torch.testing.assert_close(auto.fit().mode.f, closed.fit().mode.f, rtol=1e-10, atol=1e-10)
    g_auto = torch.autograd.grad(auto.log_marginal_likelihood(), list(auto.parameters()))
    g_closed = torch.autograd.grad(closed.log_marginal_likelihood(), list(closed.parameters()))
    for a, b in zip(g_auto, g_closed, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)


def test_gpytorch_likelihood_objects_are_accepted(toy):
    x, y, _ = toy
    soft = torch.sigmoid(torch.sin(x))
    by_object = LaplaceGPClassifier(x, soft, _kernel(), likelihood=ContinuousBernoulliLikelihood())
    by_name = LaplaceGPClassifier(x, soft, _kernel(), likelihood="continuous_bernoulli")
    torch.testing.assert_close(by_object.fit().mode.f, by_name.fit().mode.f)
    probit = LaplaceGPClassifier(
        x, y, _kernel(), likelihood=gpytorch.likelihoods.BernoulliLikelihood()
    )
    assert probit.terms.name == "Bernoulli-probit"


def test_warm_start_uses_fewer_iterations(toy):
    x, y, _ = toy
    model = LaplaceGPClassifier(x, y, _kernel()).fit()
    cold = model.mode.iterations
    model.covar_module.outputscale = 2.05
    warm = model.fit().mode.iterations
    assert warm < cold


def test_batch_of_problems_matches_separate_fits(toy):
    x, y, test_x = toy
    y2 = torch.stack([y, 1 - y, y.flip(0)])
    batch = LaplaceGPClassifier(x, y2, _kernel()).fit()
    for i in range(3):
        single = LaplaceGPClassifier(x, y2[i], _kernel()).fit()
        torch.testing.assert_close(batch.mode.f[i], single.mode.f, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(
            batch.predict_proba(test_x)[..., 1][i],
            single.predict_proba(test_x)[..., 1],
            rtol=1e-9,
            atol=1e-9,
        )
    assert batch.log_marginal_likelihood().shape == (3,)


def test_a_batch_of_prior_means_or_start_points_broadcasts(toy):
    # a prior mean (or init_f) with a batch that K and y lack broadcasts
    x, y, _ = toy
    K = _kernel()(x).to_dense().detach()
    means = torch.tensor([-0.5, 0.0, 0.8], dtype=torch.float64).unsqueeze(-1).expand(3, 40)
    starts = torch.linspace(-1.0, 1.0, 2, dtype=torch.float64).view(2, 1, 1).expand(2, 3, 40)
    batch = find_laplace_mode(K, y, BernoulliLogitTerms(), prior_mean=means)
    warm = find_laplace_mode(K, y, BernoulliLogitTerms(), prior_mean=means, init_f=starts)
    assert batch.f.shape == (3, 40) and warm.f.shape == (2, 3, 40)
    for i in range(3):
        single = find_laplace_mode(K, y, BernoulliLogitTerms(), prior_mean=means[i])
        torch.testing.assert_close(batch.f[i], single.f, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(batch.log_marginal_likelihood[i], single.log_marginal_likelihood)
        for j in range(2):
            torch.testing.assert_close(warm.f[j, i], single.f, rtol=1e-9, atol=1e-9)
    with pytest.raises(ValueError, match="prior_mean and init_f"):
        find_laplace_mode(K, y, BernoulliLogitTerms(), prior_mean=means, init_f=starts[:, :2])


def test_state_dict_round_trip_and_dtype(toy):
    x, y, test_x = toy
    model = LaplaceGPClassifier(x, y, _kernel()).fit()
    probs = model.predict_proba(test_x)[..., 1]
    other = LaplaceGPClassifier(x, y, _kernel(0.5, 0.5))
    other.load_state_dict(model.state_dict())
    torch.testing.assert_close(other.predict_proba(test_x)[..., 1], probs)
    model32 = model.to(torch.float32)
    p32 = model32.predict_proba(test_x.float())[..., 1]
    assert p32.dtype == torch.float32
    torch.testing.assert_close(p32.double(), probs, rtol=1e-4, atol=1e-4)


def test_float32_fit():
    x, y, test_x = sine_classification(40, seed=3, dtype=torch.float32)
    model = LaplaceGPClassifier(x, y, _kernel(dtype=torch.float32)).fit()
    ref = LaplaceGPClassifier(x.double(), y.double(), _kernel()).fit()
    torch.testing.assert_close(model.mode.f.double(), ref.mode.f, rtol=1e-4, atol=1e-4)


def test_bad_input(toy):
    x, y, _ = toy
    with pytest.raises(ValueError, match=r"train_y must hold binary labels"):
        LaplaceGPClassifier(x, y * 0.5, _kernel())
    with pytest.raises(ValueError, match=r"train_y must hold soft targets in \[0, 1\]"):
        LaplaceGPClassifier(x, y * 1.5, _kernel(), likelihood="continuous_bernoulli")
    bad = y.clone()
    bad[0] = float("nan")
    with pytest.raises(ValueError, match="train_y must be finite"):
        LaplaceGPClassifier(x, bad, _kernel())
    with pytest.raises(ValueError, match="train_y must have 40 entries"):
        LaplaceGPClassifier(x, y[:-1], _kernel())
    with pytest.raises(ValueError, match="noise must be"):
        LaplaceGPClassifier(x, y, _kernel(), noise=-1.0)
    with pytest.raises(ValueError, match="likelihood must be one of"):
        LaplaceGPClassifier(x, y, _kernel(), likelihood="poisson")
    with pytest.raises(TypeError, match="covar_module"):
        LaplaceGPClassifier(x, y, "rbf")
    model = LaplaceGPClassifier(x, y, _kernel())
    with pytest.raises(ValueError, match="test_x must have 1 features"):
        model.predict_proba(torch.zeros(3, 2, dtype=torch.float64))[..., 1]
    for iterations in (2.7, -1):
        with pytest.raises(ValueError, match="max_iter must be a non-negative int"):
            model.optimize_hyperparameters(max_iter=iterations)
    with pytest.raises(ValueError, match="lr must be positive"):
        model.optimize_hyperparameters(max_iter=1, lr=float("nan"))


def test_non_convergence_raises(toy):
    x, y, _ = toy
    K = _kernel(50.0, 0.5)(x[:, None]).to_dense().detach()
    with pytest.raises(LaplaceConvergenceError, match="did not converge in max_iter=1"):
        find_laplace_mode(K, y, BernoulliLogitTerms(), max_iter=1)


@requires_cuda
def test_cuda_matches_cpu(toy):
    x, y, test_x = toy
    cpu = LaplaceGPClassifier(x, y, _kernel()).fit()
    gpu = LaplaceGPClassifier(x.cuda(), y.cuda(), _kernel().cuda()).fit()
    torch.testing.assert_close(
        gpu.predict_proba(test_x.cuda())[..., 1].cpu(), cpu.predict_proba(test_x)[..., 1]
    )


def test_gaussian_likelihood_laplace_is_exact_gp_marginal_likelihood(toy):
    """For a Gaussian likelihood the Laplace evidence is exact: compare with GPyTorch's ExactGP,
    and the gradient in the likelihood's noise (through the mode) with finite differences."""
    x, _, _ = toy
    y = torch.sin(x)
    gaussian = gpytorch.likelihoods.GaussianLikelihood().double()
    gaussian.noise = 0.2
    model = LaplaceGPClassifier(x, y, _kernel(), likelihood=AutogradLikelihoodTerms(gaussian))

    class _Exact(gpytorch.models.ExactGP):
        def __init__(self):
            super().__init__(x, y, gaussian)
            self.mean_module = gpytorch.means.ZeroMean()
            self.covar_module = model.covar_module

        def forward(self, z):
            return gpytorch.distributions.MultivariateNormal(
                self.mean_module(z), self.covar_module(z)
            )

    exact = _Exact()
    exact.train()
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(gaussian, exact)
    with gpytorch.settings.fast_computations(False, False, False):
        ref = mll(exact(x), y) * len(y)
    lml = model.log_marginal_likelihood()
    assert lml.item() == pytest.approx(ref.item(), abs=1e-8)
    params = dict(model.named_parameters())
    assert "likelihood.noise_covar.raw_noise" in params
    grads = torch.autograd.grad(lml, list(params.values()))
    ref_grads = torch.autograd.grad(ref, list(params.values()))
    for name, g, r in zip(params, grads, ref_grads, strict=True):
        assert g.item() == pytest.approx(r.item(), rel=1e-7, abs=1e-9), name


def test_fit_returns_self_and_the_settings_are_keyword_only(toy):
    x, y, _ = toy
    model = LaplaceGPClassifier(x, y, _kernel())
    assert model.fit() is model
    with pytest.raises(TypeError):
        LaplaceGPClassifier(x, y, _kernel(), gpytorch.means.ZeroMean())


def test_predictions_follow_scikit_learn_and_gpytorch(toy):
    x, y, test_x = toy
    model = LaplaceGPClassifier(x, y, _kernel())
    proba = model.predict_proba(test_x)
    assert proba.shape == (test_x.shape[0], 2)
    torch.testing.assert_close(proba.sum(-1), torch.ones_like(proba[:, 0]))
    labels = model.predict(test_x)
    assert labels.dtype == torch.long and labels.shape == test_x.shape
    torch.testing.assert_close(labels, (proba[:, 1] > 0.5).long())
    latent = model.predict_latent(test_x)
    assert isinstance(latent, gpsd.Prediction)
    assert latent.mean.shape == latent.variance.shape == test_x.shape
    dist = model(test_x)
    assert isinstance(dist, gpytorch.distributions.MultivariateNormal)
    torch.testing.assert_close(dist.mean, latent.mean)
    # the probit closed form in column 1, its complement in column 0
    probit = model.predict_proba(test_x, method="probit")
    torch.testing.assert_close(probit[:, 0], 1 - probit[:, 1])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_data_of_a_low_precision_dtype_are_refused_before_fitting(toy, dtype):
    x, y, _ = toy
    with pytest.raises(TypeError, match="train_x must be float32 or float64"):
        LaplaceGPClassifier(x.to(dtype), y.to(dtype), _kernel().to(dtype))


def test_a_prediction_under_a_result_changing_setting_refits_and_memory_does_not(toy, monkeypatch):
    import gpsd.laplace.laplace_posterior as module  # the classifier's Newton runs there

    x, y, test_x = toy
    model = LaplaceGPClassifier(x, y, _kernel()).fit()
    calls = []
    original = module.find_laplace_mode
    monkeypatch.setattr(
        module, "find_laplace_mode", lambda *a, **k: calls.append(1) or original(*a, **k)
    )
    model.predict_proba(test_x)
    assert calls == []  # the fit is reused
    with gpsd.settings.test_chunk_size(7):  # memory and time alone: reused too
        model.predict_proba(test_x)
    assert calls == []
    with gpsd.settings.max_lanczos_rank(7):
        model.predict_proba(test_x)
    assert calls == [1]
    model.covar_module.outputscale = 3.0  # a parameter changed: refits
    model.predict_proba(test_x)
    assert calls == [1, 1]


def test_optimize_hyperparameters_reports_progress_and_stops_on_the_callback(toy):
    x, y, _ = toy
    model = LaplaceGPClassifier(x, y, _kernel(1.0, 0.3))
    records = []
    out = model.optimize_hyperparameters(
        max_iter=10, lr=0.1, callback=lambda r: records.append(r) or r.iteration == 3
    )
    assert out is model
    assert [r.iteration for r in records] == [1, 2, 3]
    assert records[0].task == "LaplaceGPClassifier.optimize_hyperparameters"
    assert records[0].total == 10
    assert [r.loss for r in records] == model.history
    model.optimize_hyperparameters(max_iter=2, lr=0.1, progress=True)
    assert len(model.history) == 2


@pytest.fixture
def toy_classifier_refits_and_detaches():
    return sine_classification(30, seed=3)


def _model(x, y, outputscale=2.0, lengthscale=1.3, constant=0.0, **kw):
    mean = gpytorch.means.ConstantMean().double()
    mean.constant.data.fill_(constant)
    kernel = rbf_kernel(outputscale, lengthscale, torch.float64)
    return LaplaceGPClassifier(x, y, kernel, mean_module=mean, **kw)


def test_predictions_follow_changed_hyperparameters_and_temperature(
    toy_classifier_refits_and_detaches,
):
    x, y, test_x = toy_classifier_refits_and_detaches
    model = _model(x, y)
    model.predict_proba(test_x)[..., 1]  # fits the mode at the first hyperparameters
    model.covar_module.outputscale = 10.0
    model.covar_module.base_kernel.lengthscale = 0.5
    model.mean_module.constant.data.fill_(0.4)
    model.temperature = 2.0
    # the mode of the first hyperparameters with the new kernel would be off by up to 0.42
    fresh = _model(x, y, 10.0, 0.5, 0.4, temperature=2.0)
    torch.testing.assert_close(
        model.predict_proba(test_x)[..., 1], fresh.predict_proba(test_x)[..., 1]
    )
    latent = model.predict_latent(test_x)
    mean, var = latent.mean, latent.variance
    latent = fresh.predict_latent(test_x)
    fresh_mean, fresh_var = latent.mean, latent.variance
    torch.testing.assert_close(mean, fresh_mean)
    torch.testing.assert_close(var, fresh_var)


def test_an_optimiser_step_refits_before_predicting(toy_classifier_refits_and_detaches):
    x, y, test_x = toy_classifier_refits_and_detaches
    model = _model(x, y)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.2)
    for _ in range(3):
        optimizer.zero_grad()
        (-model.log_marginal_likelihood()).backward()
        optimizer.step()
    fresh = _model(x, y)
    fresh.load_state_dict(model.state_dict())
    fresh.fit(warm_start=False)
    torch.testing.assert_close(
        model.predict_proba(test_x)[..., 1], fresh.predict_proba(test_x)[..., 1]
    )


def test_soft_targets_with_a_graph_are_stored_detached(toy_classifier_refits_and_detaches):
    x, y, _ = toy_classifier_refits_and_detaches
    teacher = _model(x, y)
    soft = teacher.predict_proba(x)[..., 1]
    assert soft.requires_grad  # the teacher's predictions are differentiable
    student = _model(x, soft, likelihood="continuous_bernoulli")
    reference = _model(x, soft.detach(), likelihood="continuous_bernoulli")
    assert not student.train_targets.requires_grad
    optimizer = torch.optim.Adam(student.parameters(), lr=0.05)
    for _ in range(2):  # the second backward pass ran into the teacher's freed graph
        optimizer.zero_grad()
        loss = -student.log_marginal_likelihood()
        loss.backward()
        optimizer.step()
        ref_loss = -reference.log_marginal_likelihood()
        ref_grads = torch.autograd.grad(ref_loss, list(reference.parameters()))
        torch.testing.assert_close(loss, ref_loss)
        for p, g in zip(student.parameters(), ref_grads, strict=True):
            torch.testing.assert_close(p.grad, g)
        with torch.no_grad():
            for p, q in zip(student.parameters(), reference.parameters(), strict=True):
                q.copy_(p)
    assert all(p.grad is None for p in teacher.parameters())  # the loss reached the teacher


def test_a_float64_kernel_on_float32_data_matches_the_float64_fit():
    # the classifier works in the data's dtype, as DataCentricGPC and DistributionCentricGPC do
    x, y, test_x = sine_classification(30, seed=0)
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).double()
    model32 = LaplaceGPClassifier(x.float(), y.float(), kernel)
    latent = model32.predict_latent(test_x.float())
    mean, var = latent.mean, latent.variance
    proba = model32.predict_proba(test_x.float())[..., 1]
    assert mean.dtype == var.dtype == proba.dtype == torch.float32
    # the reference: everything in float64 at the same (float32-rounded) inputs
    x64, test64 = x.float().double(), test_x.float().double()
    model64 = LaplaceGPClassifier(x64, y.double(), copy.deepcopy(kernel))
    latent = model64.predict_latent(test64)
    ref_mean, ref_var = latent.mean, latent.variance
    torch.testing.assert_close(mean.double(), ref_mean, rtol=0, atol=1e-4)
    torch.testing.assert_close(var.double(), ref_var, rtol=0, atol=1e-4)
    torch.testing.assert_close(
        proba.double(), model64.predict_proba(test64)[..., 1], rtol=0, atol=1e-4
    )
    cov = model32(test_x.float()).covariance_matrix
    torch.testing.assert_close(torch.diagonal(cov).double(), ref_var, rtol=0, atol=1e-4)


DT = torch.float64


class _ScaledLogit(_OneDimensionalLikelihood):
    """Bernoulli(sigmoid(a f)) with a learnable slope a: log-concave, one likelihood parameter."""

    def __init__(self):
        super().__init__()
        self.register_parameter("raw_a", torch.nn.Parameter(torch.tensor(0.3, dtype=DT)))

    def forward(self, f, *args, **kwargs):
        slope = torch.nn.functional.softplus(self.raw_a)
        return torch.distributions.Bernoulli(logits=slope * f, validate_args=False)


def _model_prediction_gradients(likelihood="bernoulli_logit"):
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
    model = _model_prediction_gradients()
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
    model = _model_prediction_gradients(AutogradLikelihoodTerms(likelihood))
    outputs = _outputs(model)
    grads = torch.stack(
        [torch.autograd.grad(t, likelihood.raw_a, retain_graph=True)[0] for t in outputs]
    )
    expected = _central_differences(model, likelihood.raw_a)
    assert grads.abs().max() > 1e-3
    torch.testing.assert_close(grads, expected, rtol=1e-6, atol=1e-8)


def test_values_are_those_of_the_mode_found_without_autograd():
    model = _model_prediction_gradients()
    with torch.no_grad():
        plain = [t.clone() for t in _outputs(model)]
    for got, expected in zip(_outputs(model), plain, strict=True):
        torch.testing.assert_close(got.detach(), expected, rtol=1e-12, atol=1e-12)


def _classifier(prior):
    g = torch.Generator().manual_seed(0)
    x = torch.rand(20, 1, generator=g, dtype=torch.float64) * 5
    y = torch.rand(20, generator=g, dtype=torch.float64) < torch.sigmoid(3 * torch.sin(x[:, 0]))
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(lengthscale_prior=prior))
    return LaplaceGPClassifier(x, y.double(), kernel.double())


def _adam_by_hand(model, log_prior, iterations=10, lr=0.2):
    """The hyperparameter posterior's maximisation written out, with the prior given here."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=lr)
    history = []
    for _ in range(iterations):
        optimizer.zero_grad()
        loss = -(model.log_marginal_likelihood().sum() + log_prior(model))
        loss.backward()
        optimizer.step()
        history.append(loss.item())
    return history


def test_optimize_hyperparameters_adds_the_registered_hyperpriors():
    # a N(5, 0.01^2) lengthscale prior pulls the lengthscale to 5 (1.374 without it)
    prior = gpytorch.priors.NormalPrior(torch.tensor(5.0).double(), torch.tensor(0.01).double())
    with_prior = _classifier(prior)
    history = with_prior.optimize_hyperparameters(max_iter=10, lr=0.2).history
    by_hand = _classifier(None)
    expected = _adam_by_hand(
        by_hand, lambda m: prior.log_prob(m.covar_module.base_kernel.lengthscale).sum()
    )
    torch.testing.assert_close(history, expected, rtol=1e-10, atol=0)
    lengthscale = with_prior.covar_module.base_kernel.lengthscale
    torch.testing.assert_close(lengthscale, by_hand.covar_module.base_kernel.lengthscale)
    without = _classifier(None)
    without.optimize_hyperparameters(max_iter=10, lr=0.2)
    assert lengthscale.item() > without.covar_module.base_kernel.lengthscale.item() + 0.5  # to 5
    # the evidence alone
    torch.testing.assert_close(
        with_prior.log_marginal_likelihood(), by_hand.log_marginal_likelihood(), rtol=1e-10, atol=0
    )


def test_optimize_hyperparameters_without_priors_maximises_the_evidence():
    model = _classifier(None)
    assert model.log_prior().item() == 0.0
    history = model.optimize_hyperparameters(max_iter=10, lr=0.2).history
    expected = _adam_by_hand(_classifier(None), lambda m: 0.0)
    torch.testing.assert_close(history, expected, rtol=1e-10, atol=0)


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
    with pytest.raises(TypeError, match="noise must be a tensor or array-like of numbers"):
        DataCentricGPC(x, y, _kernel(), num_steps=2, noise="0.1")
    reference = DataCentricGPC(x, y, _kernel(), num_steps=2, noise=0.1).fit()
    for noise in (torch.tensor(0.1, dtype=torch.float64), np.float64(0.1)):
        model = DataCentricGPC(x, y, _kernel(), num_steps=2, noise=noise).fit()
        torch.testing.assert_close(model.latent_modes(), reference.latent_modes())


# a short lengthscale, where most kernel entries are far below rounding: on a CPU they are set
# to zero below eps^2 * max before the matrix products (the x86 slow path for subnormal
# numbers); sklearn, in numpy float64 with every entry kept, is the reference
SHORT_LENGTHSCALE, SHORT_OUTPUTSCALE = 0.08, 3.0


@pytest.fixture(scope="module")
def problem():
    gen = np.random.default_rng(4)
    x = np.sort(gen.uniform(0, 12, 150))
    y = (np.sin(2 * x) + 0.3 * gen.standard_normal(150) > 0).astype(float)
    test_x = np.linspace(0, 12, 61)
    gpc = GaussianProcessClassifier(
        ConstantKernel(SHORT_OUTPUTSCALE) * RBF(SHORT_LENGTHSCALE),
        optimizer=None,
        max_iter_predict=500,
    ).fit(x[:, None], y)
    base = gpc.base_estimator_
    K = base.kernel_(x[:, None])
    # the case at hand: entries that are positive yet negligible, many of them subnormal
    assert ((K > 0) & (K < np.finfo(float).eps ** 2 * K.max())).mean() > 0.1
    assert ((K > 0) & (K < np.finfo(float).tiny)).any()
    mean, var = base.latent_mean_and_variance(test_x[:, None])
    return x, y, test_x, base, mean, var


def _kernel_short_lengthscale(dtype):
    k = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).to(dtype)
    k.outputscale = torch.tensor(SHORT_OUTPUTSCALE, dtype=dtype)
    k.base_kernel.lengthscale = torch.tensor(SHORT_LENGTHSCALE, dtype=dtype)
    return k


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_laplace_classifier_matches_sklearn(problem, dtype):
    x, y, test_x, base, mean, var = problem
    tol = 1e-7 if dtype == torch.float64 else 2e-3  # float32: 5e-4 with or without dropping
    t = lambda a: torch.as_tensor(a, dtype=dtype)  # noqa: E731
    model = LaplaceGPClassifier(t(x), t(y), _kernel_short_lengthscale(dtype)).fit()
    np.testing.assert_allclose(model.mode.f.double().numpy(), base.f_cached, atol=tol)
    latent = model.predict_latent(t(test_x))
    m, v = latent.mean, latent.variance
    np.testing.assert_allclose(m.detach().double().numpy(), mean, atol=tol)
    np.testing.assert_allclose(v.detach().double().numpy(), var, atol=tol)
    lml = model.log_marginal_likelihood()
    assert float(lml.detach()) == pytest.approx(base.log_marginal_likelihood_value_, rel=tol)
    lml.backward()  # the gradient passes through the kept entries
    grads = [p.grad for p in model.covar_module.parameters()]
    assert all(g is not None and bool(torch.isfinite(g).all()) for g in grads)


@pytest.mark.parametrize("cls", [DataCentricGPC, DistributionCentricGPC])
def test_distiller_first_step_matches_sklearn(problem, cls):
    # step 1 of either distiller is the Laplace classifier of the original targets
    x, y, test_x, base, mean, var = problem
    t = lambda a: torch.as_tensor(a, dtype=torch.float64)  # noqa: E731
    model = cls(t(x), t(y), _kernel_short_lengthscale(torch.float64), num_steps=2).fit()
    np.testing.assert_allclose(model.latent_modes(step=1).numpy(), base.f_cached, atol=1e-7)
    latent = model.predict_latent(t(test_x), step=1)
    m, v = latent.mean, latent.variance
    np.testing.assert_allclose(m.numpy(), mean, atol=1e-7)
    np.testing.assert_allclose(v.numpy(), var, atol=1e-7)


@pytest.mark.parametrize("noise", [torch.full((12,), 0.1), "0.1x", -1.0, float("nan")])
def test_the_classifier_noise_must_be_one_finite_non_negative_number(noise):
    x = torch.linspace(0, 1, 12, dtype=torch.float64).unsqueeze(-1)
    y = (torch.sin(6 * x).squeeze(-1) > 0).double()
    with pytest.raises(ValueError, match="noise must be a finite float >= 0"):
        LaplaceGPClassifier(x, y, _kernel(), noise=noise)


def test_a_fit_beyond_the_free_memory_is_refused_before_the_kernel_is_evaluated(
    use_setting, count_calls
):
    from gpsd.laplace import laplace_gp_classifier

    x, y, test_x = sine_classification(30, seed=3)
    needed = 4 * 30 * 30 * 8  # four 30 x 30 float64 matrices
    evaluations = count_calls(laplace_gp_classifier, "prior_at_training")
    use_setting(gpsd.settings.memory_limit(cpu=needed - 1))
    model = LaplaceGPClassifier(x, y, _kernel())
    for attempt in (model.fit, lambda: model.predict_proba(test_x)):
        with pytest.raises(gpsd.InsufficientMemoryError) as raised:
            attempt()
        message = str(raised.value)
        assert f"LaplaceGPClassifier.fit needs about {needed} bytes" in message
        assert "train on fewer points, or in float32" in message
    assert evaluations == [0]
    use_setting(gpsd.settings.memory_limit(cpu=needed))
    model.fit()


def test_posterior_is_the_fitted_one_and_carries_a_graph_only_where_gradients_are_needed(toy):
    x, y, _ = toy
    model = LaplaceGPClassifier(x, y, _kernel()).fit()
    with torch.no_grad():
        fitted = model.posterior()
    assert fitted.mode is model.mode  # the fit is reused, not refitted
    assert not fitted.prior_covariance.requires_grad
    differentiable = model.posterior()
    assert differentiable.mode is model.mode
    assert differentiable.prior_covariance.requires_grad
    # the prior it carries is the model's: K of the kernel at the training inputs
    with torch.no_grad():
        K = model.covar_module(model.train_inputs).to_dense()
    torch.testing.assert_close(differentiable.prior_covariance.detach(), K, rtol=1e-12, atol=0)


# ------------------------------------------------------------------ the fit lifecycle


@pytest.mark.parametrize(
    "trigger", [*COMMON_TRIGGERS, "parameter step", "model setting", "noise assignment", "labels"]
)
def test_each_refit_trigger_refits_and_nothing_else_does(toy, trigger, count_calls):
    x, y, test_x = toy
    model = LaplaceGPClassifier(x, y, _kernel()).fit()
    fits = count_calls(LaplaceGPClassifier, "_compute_fit")
    model.predict_proba(test_x)
    model.predict_latent(test_x)
    with torch.no_grad():
        model.predict(test_x)
    assert fits == [0]  # predictions read the fit
    setting = contextlib.nullcontext()
    if trigger in COMMON_TRIGGERS:
        rival = functools.partial(LaplaceGPClassifier, x, y, _kernel(0.5, 0.5))
        test_x, setting = apply_common_trigger(trigger, model, rival, test_x)
    elif trigger == "parameter step":
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        (-model.log_marginal_likelihood().sum()).backward()
        optimizer.step()
    elif trigger == "model setting":
        model.temperature = 2.0
    elif trigger == "noise assignment":
        model.noise = torch.tensor(0.3, dtype=x.dtype)
    else:
        model.train_targets[0] = 1 - model.train_targets[0]
    with setting:
        model.predict_proba(test_x)
    assert fits == [1]


def test_a_state_dict_round_trip_and_copies_predict_identically(toy, count_calls):
    x, y, test_x = toy
    model = LaplaceGPClassifier(x, y, _kernel()).fit()
    want = model.predict_latent(test_x)
    loaded = LaplaceGPClassifier(x, y, _kernel(0.5, 0.5))
    loaded.load_state_dict(model.state_dict())
    fits = count_calls(LaplaceGPClassifier, "_compute_fit")
    for other in (loaded, copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        predictions_equal(other.predict_latent(test_x), want)  # refitted from the saved mode
    assert fits == [3]
