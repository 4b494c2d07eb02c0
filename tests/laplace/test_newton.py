"""find_laplace_mode (Newton's method, stable B-form) and the checks of the public Laplace
functions: against dense formulas, mpmath modes and generic optimisers; a stop short of the mode
raises."""

from __future__ import annotations

import math

import gpytorch
import pytest
import torch
from cb_reference import cb_laplace_problem
from gpr_reference import rbf_kernel
from linear_operator.operators import DenseLinearOperator

from gpsd import LaplaceGPClassifier
from gpsd.data.toy import sine_classification
from gpsd.laplace import (
    BernoulliLogitTerms,
    BernoulliProbitTerms,
    ContinuousBernoulliTerms,
    LaplaceConvergenceError,
    find_laplace_mode,
    laplace_latent_predictive,
    laplace_log_marginal_likelihood,
    resolve_likelihood_terms,
)
from gpsd.laplace.newton import _newton_step_gain

DT = torch.float64


def _kernel(outputscale=2.0, lengthscale=1.3, dtype=torch.float64):
    return rbf_kernel(outputscale, lengthscale, dtype)


def _problem(n=40, outputscale=4.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = 5 * torch.rand(n, 1, generator=gen, dtype=DT)
    y = (x[:, 0] > 2.5).to(DT)
    y[[3, 17]] = 1 - y[[3, 17]]
    K = outputscale * torch.exp(-0.5 * torch.cdist(x, x) ** 2)
    return K, y


class _DerivativesOfAnotherLikelihood(BernoulliLogitTerms):
    """log_prob of the logistic likelihood, derivatives of a steeper probit: a custom-terms bug."""

    def derivatives(self, y, f):
        return BernoulliProbitTerms().derivatives(y, 3 * f)


def test_derivatives_that_disagree_with_log_prob_raise():
    # a shortened step that moves f by round-off must not count as convergence: such terms would
    # stop in 2 iterations 1.5 away from the logistic mode
    K, y = _problem()
    with pytest.raises(LaplaceConvergenceError, match="stopped short of the mode.*derivatives"):
        find_laplace_mode(K, y, _DerivativesOfAnotherLikelihood())


def test_consistent_terms_still_converge_to_the_mode():
    # the mode is the fixed point f = K grad log p(y | f) (K is too ill-conditioned to solve with)
    K, y = _problem()
    for terms in (BernoulliLogitTerms(), BernoulliProbitTerms()):
        mode = find_laplace_mode(K, y, terms)
        d1, _ = terms.derivatives(y, mode.f)
        torch.testing.assert_close(K @ d1, mode.f, rtol=0, atol=1e-9)


def test_newton_step_gain_against_the_dense_formula():
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(2, 7, 7, generator=gen, dtype=DT)
    K = a @ a.mT + 0.5 * torch.eye(7, dtype=DT)
    W = torch.rand(2, 7, generator=gen, dtype=DT)
    d = torch.randn(2, 7, generator=gen, dtype=DT)
    step_f = K @ d.unsqueeze(-1)  # shape: (2, 7, 1)
    H = torch.linalg.inv(K) + torch.diag_embed(W)
    want = 0.5 * (step_f.mT @ H @ step_f).squeeze(-1).squeeze(-1)
    torch.testing.assert_close(_newton_step_gain(K, W, d), want, rtol=1e-12, atol=0)


def test_an_indefinite_float32_kernel_names_its_precision():
    # outputscale 1e8 in float32: rounding leaves eigenvalues of about -1e2, and B is indefinite
    K, y = _problem(n=60, outputscale=1e8)
    with pytest.raises(LaplaceConvergenceError, match="float32 precision.*fit in float64"):
        find_laplace_mode(K.float(), y.float(), BernoulliLogitTerms())
    bad = K.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(LaplaceConvergenceError, match="holds NaN"):
        find_laplace_mode(bad, y, BernoulliLogitTerms())


K = torch.eye(4, dtype=DT) + 0.5


Y = torch.tensor([0.0, 1.0, 1.0, 0.0], dtype=DT)


@pytest.mark.parametrize(
    "y, terms, message",
    [
        (2 * Y - 1, BernoulliLogitTerms(), r"y must hold binary labels in \{0, 1\}"),
        (1.5 * Y, ContinuousBernoulliTerms(), r"y must hold soft targets in \[0, 1\]"),
        (Y.unsqueeze(-1), BernoulliLogitTerms(), r"y must have 4 entries .* \(4, 1\)"),
        (Y[:3], BernoulliLogitTerms(), "y must have 4 entries"),
    ],
)
def test_targets_outside_the_support_or_of_another_shape_are_refused(y, terms, message):
    with pytest.raises(ValueError, match=message):
        find_laplace_mode(K, y, terms)


def test_soft_targets_under_a_bernoulli_likelihood_need_check_targets_false():
    soft = torch.tensor([0.1, 0.8, 0.6, 0.3], dtype=DT)
    with pytest.raises(ValueError, match="binary labels"):
        find_laplace_mode(K, soft, BernoulliLogitTerms())
    mode = find_laplace_mode(K, soft, BernoulliLogitTerms(), check_targets=False)
    # at the mode, K^{-1} f = d/df log p(y|f) = y - sigmoid(f) (the cross-entropy's gradient)
    torch.testing.assert_close(
        torch.linalg.solve(K, mode.f), soft - torch.sigmoid(mode.f), rtol=1e-10, atol=1e-12
    )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(K=K[:3]), r"K must be a tensor of shape \(\*batch, n, n\), got \(3, 4\)"),
        (dict(init_f=torch.zeros(5, dtype=DT)), r"init_f must have shape \(\*batch, 4\)"),
        (dict(prior_mean=torch.zeros(3, dtype=DT)), r"prior_mean must have shape \(\*batch, 4\)"),
        (dict(prior_mean=torch.full((4,), math.nan, dtype=DT)), "prior_mean must be finite"),
    ],
)
def test_mismatched_arguments_are_named(kwargs, message):
    args = dict(K=K, y=Y, terms=BernoulliLogitTerms()) | kwargs
    with pytest.raises(ValueError, match=message):
        find_laplace_mode(**args)


def test_float32_targets_a_terms_name_and_a_scalar_prior_mean_are_taken():
    reference = find_laplace_mode(
        K, Y, BernoulliLogitTerms(), prior_mean=torch.full((4,), 0.5, dtype=DT)
    )
    for y, terms, mean in [
        (Y.float(), BernoulliLogitTerms(), torch.tensor(0.5, dtype=DT)),
        (Y, "bernoulli_logit", torch.full((4,), 0.5, dtype=DT)),
    ]:
        mode = find_laplace_mode(K, y, terms, prior_mean=mean)
        assert mode.f.dtype == DT
        torch.testing.assert_close(mode.f, reference.f, rtol=1e-12, atol=1e-12)


def test_tensors_in_another_dtype_than_the_mode_are_refused_naming_them():
    K, y, m = cb_laplace_problem(dtype=torch.float32)
    terms = ContinuousBernoulliTerms()
    mode = find_laplace_mode(K, y, terms, prior_mean=m)
    with pytest.raises(ValueError, match="K has dtype torch.float64"):
        laplace_log_marginal_likelihood(K.double(), y, terms, mode, prior_mean=m)
    with pytest.raises(ValueError, match="prior_mean has dtype torch.float64"):
        laplace_log_marginal_likelihood(K, y, terms, mode, prior_mean=m.double())
    with pytest.raises(ValueError, match="K_cross has dtype torch.float64"):
        laplace_latent_predictive(mode, K[:2].double(), K.diagonal()[:2], diag=True)


@pytest.mark.parametrize(
    ("argument", "value"),
    [("max_halvings", -3), ("max_halvings", 1.5), ("objective_tol", float("nan"))]
    + [("objective_tol", -1.0), ("f_tol", -1.0), ("f_tol", float("inf"))],
)
def test_newton_settings_are_checked_naming_them(argument, value):
    K, y, _ = cb_laplace_problem()
    with pytest.raises(ValueError, match=argument):
        find_laplace_mode(K, y.round(), "logit", **{argument: value})


def test_newton_with_full_steps_only_finds_the_mode():
    # max_halvings=0 tries the full Newton step only (it raised UnboundLocalError)
    K, y, _ = cb_laplace_problem()
    y = y.round()
    mode = find_laplace_mode(K, y, "logit", max_halvings=0)
    # stationarity, independently of the engine: a = K^{-1} f = grad log p = y - sigmoid(f)
    torch.testing.assert_close(mode.alpha, y - torch.sigmoid(mode.f), rtol=0, atol=1e-9)
    torch.testing.assert_close(mode.f, find_laplace_mode(K, y, "logit").f)


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
    # float32 converges here; K's scale leaves ~1e-5 of accuracy
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
    mode = find_laplace_mode(K, y, BernoulliLogitTerms())
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


def _kernel_matrix(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y, _ = sine_classification(40, seed=seed)
    k = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).double()
    k.outputscale = 10.0
    k.base_kernel.lengthscale = 0.8
    K = k(x).to_dense().detach() + 0.01 * torch.eye(40, dtype=torch.float64)
    return K, y


@pytest.mark.parametrize(
    ("seed", "likelihood", "temperature"), [(0, "logit", 1.0), (3, "probit", 3.0)]
)
def test_float32_mode_is_not_stopped_a_newton_step_early(seed, likelihood, temperature):
    # a full Newton step that changed psi by less than the line search's slack (1e-3 |psi| in
    # float32) counted as converged: the float32 modes were 1.5e-2 (logit) and 3.9e-2 (probit, tau=3)
    # off the float64 ones; one more Newton step brings them to ~3e-5
    K, y = _kernel_matrix(seed)
    terms = resolve_likelihood_terms(likelihood)
    ref = find_laplace_mode(K, y, terms, temperature=temperature)
    got = find_laplace_mode(K.float(), y.float(), terms, temperature=temperature)
    torch.testing.assert_close(got.f.double(), ref.f, rtol=0, atol=2e-4)
    assert got.log_marginal_likelihood.item() == pytest.approx(
        ref.log_marginal_likelihood.item(), abs=1e-4
    )


def test_prior_means_that_broadcast_and_a_kernel_operator_are_taken():
    y2 = torch.stack([Y, 1 - Y])  # shape: (2, 4)
    reference = find_laplace_mode(
        K, y2, BernoulliLogitTerms(), prior_mean=torch.tensor([[0.5] * 4, [-0.3] * 4], dtype=DT)
    )
    mode = find_laplace_mode(
        K, y2, BernoulliLogitTerms(), prior_mean=torch.tensor([[0.5], [-0.3]], dtype=DT)
    )
    torch.testing.assert_close(mode.f, reference.f, rtol=1e-12, atol=1e-12)
    single = find_laplace_mode(
        K, Y, BernoulliLogitTerms(), prior_mean=torch.tensor([0.5], dtype=DT)
    )
    torch.testing.assert_close(single.f, reference.f[0], rtol=1e-12, atol=1e-12)
    as_operator = find_laplace_mode(DenseLinearOperator(K), Y, BernoulliLogitTerms())
    torch.testing.assert_close(
        as_operator.f, find_laplace_mode(K, Y, BernoulliLogitTerms()).f, rtol=0, atol=0
    )
