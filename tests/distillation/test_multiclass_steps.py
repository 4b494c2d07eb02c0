"""DataCentricGPC and DistributionCentricGPC for K > 2 classes against a dense chain written out in
the tests (multiclass_reference: Newton over all n K latents, Algorithm 3.4, the same Monte Carlo
draws), and their K-class conventions and errors."""

import gpytorch
import pytest
import torch
from conftest import requires_cuda
from multiclass_reference import (
    SOFTMAX,
    data_centric_chain,
    laplace_mode,
    monte_carlo,
    predictive,
    softmax,
    tempered,
)

import gpsd
from gpsd.distillation.data_centric_gpc import DataCentricGPC
from gpsd.distillation.distribution_centric_gpc import DistributionCentricGPC
from gpsd.laplace import MulticlassLaplacePosterior, SoftmaxTerms, TemperedSoftmaxTerms

S = 256  # Monte Carlo draws: one chunk of the engine's


def _data(n, K, seed, dtype=torch.float64, m=7):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 2, generator=g, dtype=dtype) * 4 - 2
    angle = torch.atan2(x[:, 1], x[:, 0])
    labels = ((angle + torch.pi) / (2 * torch.pi) * K).long().clamp(max=K - 1)
    flip = torch.rand(n, generator=g) < 0.15
    labels = torch.where(flip, (labels + 1) % K, labels)
    test_x = torch.rand(m, 2, generator=g, dtype=dtype) * 4 - 2
    return x, labels, test_x


def _rbf(x1, x2, lengthscale, outputscale):
    d2 = ((x1[:, None, :] - x2[None, :, :]) ** 2).sum(-1)
    return outputscale * torch.exp(-0.5 * d2 / lengthscale**2)


def _modules(K, per_class, dtype=torch.float64):
    """The model's kernel and mean, and per class the (lengthscale, outputscale, constant); the
    hyperparameters set as tensors of ``dtype`` (a Python number would pass through float32)."""
    if per_class:
        params = [(0.6 + 0.3 * c, 2.0 + 0.5 * c, 0.2 * c - 0.3) for c in range(K)]
        batch = torch.Size([K])
        kernel = gpytorch.kernels.ScaleKernel(
            gpytorch.kernels.RBFKernel(batch_shape=batch), batch_shape=batch
        ).to(dtype)
        mean = gpytorch.means.ConstantMean(batch_shape=batch).to(dtype)
        mean.constant = torch.tensor([p[2] for p in params], dtype=dtype)
    else:
        params = [(0.8, 3.0, 0.0)] * K
        kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).to(dtype)
        mean = None
    lengthscales = torch.tensor([p[0] for p in params], dtype=dtype)
    outputscales = torch.tensor([p[1] for p in params], dtype=dtype)
    shape = kernel.base_kernel.lengthscale.shape
    kernel.base_kernel.lengthscale = lengthscales[: shape.numel()].reshape(shape)
    kernel.outputscale = outputscales[: kernel.outputscale.numel()].reshape(
        kernel.outputscale.shape
    )
    return kernel, mean, params


def _dense_prior(params, x, test_x):
    """Class covariances (K, n, n), means (n, K), cross (K, M, n), test variances (K, M), test
    means (M, K) from the written-out RBF kernel."""
    x, test_x = x.double(), test_x.double()
    Ks = torch.stack([_rbf(x, x, ls, s) for ls, s, _ in params])
    cross = torch.stack([_rbf(test_x, x, ls, s) for ls, s, _ in params])
    test_var = torch.stack(
        [torch.full((len(test_x),), s, dtype=torch.float64) for _, s, _ in params]
    )
    consts = torch.tensor([c for *_, c in params], dtype=torch.float64)
    return Ks, consts.expand(len(x), -1), cross, test_var, consts.expand(len(test_x), -1)


@pytest.mark.parametrize(("K", "per_class"), [(3, False), (4, True)])
def test_data_centric_chain_matches_the_dense_chain(K, per_class):
    n = 24 if K == 3 else 18
    x, labels, test_x = _data(n, K, seed=K)
    kernel, mean, params = _modules(K, per_class)
    noise = [0.0, 0.1, 0.3]
    model = DataCentricGPC(x, labels, kernel, mean_module=mean, noise=noise, num_samples=S).fit()
    Ks, m, cross, test_var, test_mean = _dense_prior(params, x, test_x)
    modes, targets, fits = data_centric_chain(Ks, m, labels, noise, S)

    assert model.num_classes == K
    torch.testing.assert_close(model.latent_modes(), modes, rtol=0, atol=1e-8)
    torch.testing.assert_close(model.step_targets(), targets, rtol=0, atol=1e-8)
    latent = model.predict_latent(test_x)
    proba = model.predict_proba(test_x)
    assert proba.shape == (3, len(test_x), K)
    for t, (F, W, Kt) in enumerate(fits):
        mu, cov = predictive(Kt, m, F, W, cross, test_var, test_mean)
        torch.testing.assert_close(latent.mean[t], mu, rtol=0, atol=1e-8)
        torch.testing.assert_close(latent.covariance[t], cov, rtol=0, atol=1e-8)
        torch.testing.assert_close(latent.variance[t], cov.diagonal(dim1=-2, dim2=-1))
        expected = monte_carlo(mu, cov, softmax, S)
        torch.testing.assert_close(proba[t], expected, rtol=0, atol=1e-8)
    torch.testing.assert_close(model.predict_proba(test_x, step=2), proba[1], rtol=0, atol=0)
    torch.testing.assert_close(proba.sum(-1), torch.ones(3, len(test_x), dtype=torch.float64))
    assert torch.equal(model.predict(test_x), proba.argmax(-1))


def test_warm_starts_reach_the_dense_chains_modes_in_fewer_newton_iterations():
    K, n = 3, 24
    x, labels, test_x = _data(n, K, seed=3)
    noise = [0.0, 0.05, 0.1, 0.2]
    _, _, params = _modules(K, per_class=False)
    models = {
        warm: DataCentricGPC(
            x, labels, _modules(K, False)[0], noise=noise, num_samples=S, warm_start=warm
        ).fit()
        for warm in (False, True)
    }
    Ks, m, *_ = _dense_prior(params, x, test_x)
    modes, _, _ = data_centric_chain(Ks, m, labels, noise, S)
    for model in models.values():
        torch.testing.assert_close(model.latent_modes(), modes, rtol=0, atol=1e-8)
    cold, warm = models[False].newton_iterations, models[True].newton_iterations
    assert warm[0] == cold[0]  # step 1 starts from the prior mean either way
    assert sum(warm[1:]) < sum(cold[1:])
    models[True].fit(use_stored_modes=True)  # every step starts at its own mode
    assert max(models[True].newton_iterations) == 1
    torch.testing.assert_close(models[True].latent_modes(), modes, rtol=0, atol=1e-8)


def test_a_batch_of_labels_and_schedules_matches_the_dense_chain_of_each():
    K, n = 3, 16
    x, labels, test_x = _data(n, K, seed=5)
    other = torch.roll(labels, 3)
    noise = torch.tensor([[0.0, 0.2], [0.1, 0.0]], dtype=torch.float64)
    kernel, _, params = _modules(K, per_class=False)
    model = DataCentricGPC(x, torch.stack([labels, other]), kernel, noise=noise, num_samples=S)
    Ks, m, *_ = _dense_prior(params, x, test_x)
    modes = model.latent_modes()
    assert modes.shape == (2, 2, n, K)
    for b, y in enumerate((labels, other)):
        expected, targets, _ = data_centric_chain(Ks, m, y, noise[b].tolist(), S)
        torch.testing.assert_close(modes[b], expected, rtol=0, atol=1e-8)
        torch.testing.assert_close(model.step_targets()[b], targets, rtol=0, atol=1e-8)


def test_float32_chain_agrees_with_the_float64_dense_chain():
    K, n = 3, 16
    x, labels, test_x = _data(n, K, seed=2, dtype=torch.float32)
    kernel, _, params = _modules(K, per_class=False, dtype=torch.float32)
    noise = [0.05, 0.1]
    model = DataCentricGPC(x, labels, kernel, noise=noise, num_samples=S)
    Ks, m, *_ = _dense_prior(params, x, test_x)
    modes, targets, _ = data_centric_chain(Ks, m, labels, noise, S)
    assert model.latent_modes().dtype == torch.float32
    torch.testing.assert_close(model.latent_modes().double(), modes, rtol=0, atol=1e-5)
    torch.testing.assert_close(model.step_targets().double(), targets, rtol=0, atol=1e-5)


@pytest.mark.parametrize(("K", "per_class"), [(3, False), (4, True)])
def test_tempered_steps_match_a_written_out_tempered_newton(K, per_class):
    n = 20 if K == 3 else 14
    x, labels, test_x = _data(n, K, seed=10 + K)
    kernel, mean, params = _modules(K, per_class)
    model = DistributionCentricGPC(
        x, labels, kernel, mean_module=mean, num_steps=3, method="tempered", num_samples=S
    )
    Ks, m, cross, test_var, test_mean = _dense_prior(params, x, test_x)
    Y = torch.nn.functional.one_hot(labels, K).double()
    latent = model.predict_latent(test_x)
    proba = model.predict_proba(test_x)
    assert proba.shape == (3, len(test_x), K)
    for t in (1, 2, 3):
        F, W = laplace_mode(Ks, m, Y, tempered(SOFTMAX, t))
        torch.testing.assert_close(model.latent_modes(t), F, rtol=0, atol=1e-8)
        mu, cov = predictive(Ks, m, F, W, cross, test_var, test_mean)
        torch.testing.assert_close(latent.mean[t - 1], mu, rtol=0, atol=1e-8)
        torch.testing.assert_close(latent.covariance[t - 1], cov, rtol=0, atol=1e-8)
        torch.testing.assert_close(
            proba[t - 1], monte_carlo(mu, cov, softmax, S), atol=1e-8, rtol=0
        )
    assert model.step_targets().shape == (3, n, K)
    torch.testing.assert_close(model.step_targets(2), Y)


def test_a_batch_of_labels_gives_the_tempered_steps_of_each():
    x, labels, test_x = _data(15, 3, seed=8)
    batch = torch.stack([labels, torch.roll(labels, 2)])
    model = DistributionCentricGPC(
        x, batch, _modules(3, False)[0], num_steps=2, method="tempered", num_samples=S
    )
    proba = model.predict_proba(test_x)
    assert proba.shape == (2, 2, len(test_x), 3)
    assert model.step_targets().shape == (2, 2, 15, 3)
    for b in range(2):
        single = DistributionCentricGPC(
            x, batch[b], _modules(3, False)[0], num_steps=2, method="tempered", num_samples=S
        )
        torch.testing.assert_close(proba[b], single.predict_proba(test_x), rtol=0, atol=1e-12)
        torch.testing.assert_close(
            model.latent_modes()[b], single.latent_modes(), rtol=0, atol=1e-12
        )


def test_tempered_steps_kept_or_recomputed_agree():
    x, labels, test_x = _data(15, 3, seed=1)
    kept = DistributionCentricGPC(
        x, labels, _modules(3, False)[0], num_steps=3, method="tempered", num_samples=S
    )
    recomputed = DistributionCentricGPC(
        x,
        labels,
        _modules(3, False)[0],
        num_steps=3,
        method="tempered",
        num_samples=S,
        store_all_steps=False,
    )
    # a recomputed step starts Newton from another step's mode: the same mode to rounding
    torch.testing.assert_close(
        recomputed.predict_proba(test_x), kept.predict_proba(test_x), rtol=0, atol=1e-12
    )
    torch.testing.assert_close(recomputed.latent_modes(), kept.latent_modes(), rtol=0, atol=1e-12)


def test_tempered_steps_start_from_a_fitted_steps_mode_in_fewer_newton_iterations():
    K, n, T = 3, 20, 5
    x, labels, test_x = _data(n, K, seed=12)
    kernel, _, params = _modules(K, per_class=False)
    model = DistributionCentricGPC(x, labels, kernel, num_steps=T, method="tempered", num_samples=S)
    model.predict_proba(test_x)  # step T at the fit, then steps 1..T-1 from the nearest
    Ks, m, *_ = _dense_prior(params, x, test_x)
    Y = torch.nn.functional.one_hot(labels, K).double()
    cold = 0
    for t in range(1, T):
        F, _ = laplace_mode(Ks, m, Y, tempered(SOFTMAX, t))
        torch.testing.assert_close(model.latent_modes(t), F, rtol=0, atol=1e-8)
        terms = SoftmaxTerms() if t == 1 else TemperedSoftmaxTerms(float(t))
        cold += MulticlassLaplacePosterior(0.0, Ks, terms, labels, num_classes=K).iterations
    assert sum(model.newton_iterations[t] for t in range(1, T)) < cold


def test_a_loaded_state_refits_the_tempered_steps():
    x, labels, test_x = _data(15, 3, seed=1)
    model = DistributionCentricGPC(
        x, labels, _modules(3, False)[0], num_steps=2, method="tempered", num_samples=S
    )
    expected = model.predict_proba(test_x)
    other = DistributionCentricGPC(
        x, labels, _modules(3, False)[0], num_steps=2, method="tempered", num_samples=S
    )
    other.covar_module.outputscale = 0.5
    other.load_state_dict(model.state_dict())
    torch.testing.assert_close(other.predict_proba(test_x), expected, rtol=0, atol=0)


def test_validation_log_loss_and_best_step_follow_the_probabilities():
    x, labels, test_x = _data(18, 3, seed=4, m=12)
    val_y = _data(18, 3, seed=4, m=12)[1][:12]
    model = DataCentricGPC(x, labels, _modules(3, False)[0], num_steps=3, num_samples=S)
    proba = model.predict_proba(test_x).numpy()
    expected = [
        -sum(float(torch.tensor(proba[t, i, int(y)]).log()) for i, y in enumerate(val_y)) / 12
        for t in range(3)
    ]
    loss = model.validation_log_loss(test_x, val_y)
    torch.testing.assert_close(loss, torch.tensor(expected, dtype=torch.float64))
    assert model.best_step(val_x=test_x, val_y=val_y) == int(loss.argmin()) + 1
    with pytest.raises(ValueError, match="val_y must hold integer class labels in 0 ... 2"):
        model.validation_log_loss(test_x, torch.full((12,), 3.0))


def test_a_callback_stops_the_chain_after_its_step():
    x, labels, _ = _data(15, 3, seed=3)
    model = DataCentricGPC(x, labels, _modules(3, False)[0], num_steps=3, num_samples=S)
    records = []
    model.fit(callback=lambda record: records.append(record) or record.iteration == 2)
    assert len(records) == 2
    assert model.latent_modes().shape == (2, 15, 3)
    with pytest.raises(ValueError, match="step 3 was not fitted"):
        model.predict_proba(x, step=3)


def test_labels_give_the_number_of_classes_and_two_classes_stay_binary():
    x, labels, test_x = _data(15, 3, seed=3)
    kernel = _modules(3, False)[0]
    assert DataCentricGPC(x, labels, kernel, num_samples=S).num_classes == 3
    five = DataCentricGPC(x, labels, kernel, num_classes=5, num_samples=S)
    assert five.predict_proba(test_x, step=1).shape == (len(test_x), 5)
    binary = (labels > 0).double()
    model = DataCentricGPC(x, binary, kernel, num_classes=2)
    assert model.num_classes == 2
    torch.testing.assert_close(
        model.predict_proba(test_x), DataCentricGPC(x, binary, kernel).predict_proba(test_x)
    )
    assert model.latent_modes().shape == (2, 15)


def test_bad_labels_and_settings_raise_clear_errors():
    x, labels, test_x = _data(15, 3, seed=3)
    kernel = _modules(3, False)[0]
    fractional = labels.double()
    fractional[0] = 1.5  # with the labels 2: three classes, one label not an integer
    assert bool((labels == 2).any())
    with pytest.raises(ValueError, match=r"integer class labels in 0 \.\.\. 2.*\[1\.5\]"):
        DataCentricGPC(x, fractional, kernel)
    with pytest.raises(ValueError, match=r"integer class labels in 0 \.\.\. 2"):
        DataCentricGPC(x, torch.where(labels == 0, 3, labels), kernel, num_classes=3)
    infinite = labels.double()
    infinite[0] = float("inf")
    with pytest.raises(ValueError, match="train_y must be finite"):
        DataCentricGPC(x, infinite, kernel)
    with pytest.raises(ValueError, match="train_y must be finite"):
        DataCentricGPC(x, infinite, kernel, num_classes=3)
    with pytest.raises(ValueError, match="num_classes must be an integer >= 2, got 1"):
        DataCentricGPC(x, labels * 0, kernel, num_classes=1)
    with pytest.raises(ValueError, match="integer class labels"):
        DataCentricGPC(x, labels.double() - 1.0, kernel, num_classes=3)
    for method in ("iterated", "scaled_kernel"):
        with pytest.raises(ValueError, match=f"method='{method}' is for two classes.*'tempered'"):
            DistributionCentricGPC(x, labels, kernel, method=method)
    with pytest.raises(ValueError, match="likelihood='bernoulli_probit' is for two classes"):
        DistributionCentricGPC(x, labels, kernel, method="tempered", likelihood="bernoulli_probit")
    with pytest.raises(ValueError, match="refit_hyperparameters=True is for two classes"):
        DataCentricGPC(x, labels, kernel, refit_hyperparameters=True)
    with pytest.raises(ValueError, match="threshold_targets=True is for two classes"):
        DataCentricGPC(x, labels, kernel, threshold_targets=True)
    with pytest.raises(ValueError, match="soft_target_likelihood='bernoulli' is for two classes"):
        DataCentricGPC(x, labels, kernel, soft_target_likelihood="bernoulli")
    batched = gpytorch.kernels.RBFKernel(batch_shape=torch.Size([2])).double()
    with pytest.raises(ValueError, match=r"covar_module must have batch shape \(\) .* or \(3,\)"):
        DataCentricGPC(x, labels, batched)
    model = DataCentricGPC(x, labels, kernel, num_samples=S)
    with pytest.raises(ValueError, match="method='probit' is for two classes"):
        model.predict_proba(test_x, method="probit")
    with pytest.raises(ValueError, match=r"integer class labels in 0 \.\.\. 2"):
        model.set_train_data(targets=torch.where(labels == 0, 4, labels).double())
    tempered = DistributionCentricGPC(x, labels, kernel, method="tempered", num_samples=S)
    tempered.method = "iterated"
    with pytest.raises(ValueError, match="method='iterated' is for two classes"):
        tempered.predict_proba(test_x)


def test_a_points_probabilities_do_not_depend_on_the_other_points_predicted():
    x, labels, test_x = _data(15, 3, seed=6, m=9)
    model = DataCentricGPC(x, labels, _modules(3, False)[0], num_steps=2, num_samples=S)
    proba = model.predict_proba(test_x)
    order = torch.tensor([4, 0, 8, 2])
    torch.testing.assert_close(model.predict_proba(test_x[order]), proba[:, order])
    torch.testing.assert_close(model.predict_proba(test_x[:1], step=2), proba[1, :1])


@requires_cuda
def test_on_cuda_both_distillers_predict_as_on_the_cpu():
    x, labels, test_x = _data(15, 3, seed=8)
    for build in (
        lambda x, y, k: DataCentricGPC(x, y, k, num_steps=2, noise=0.1, num_samples=S),
        lambda x, y, k: DistributionCentricGPC(
            x, y, k, num_steps=2, method="tempered", num_samples=S
        ),
    ):
        cpu = build(x, labels, _modules(3, False)[0])
        cuda = build(x.cuda(), labels.cuda(), _modules(3, False)[0].cuda())
        torch.testing.assert_close(
            cuda.predict_proba(test_x.cuda()).cpu(), cpu.predict_proba(test_x), rtol=0, atol=1e-9
        )
        torch.testing.assert_close(cuda.latent_modes().cpu(), cpu.latent_modes(), rtol=0, atol=1e-9)


def test_a_loaded_state_and_a_new_dtype_refit_the_data_centric_chain():
    x, labels, test_x = _data(15, 3, seed=9)
    model = DataCentricGPC(x, labels, _modules(3, False)[0], num_steps=2, num_samples=S)
    expected = model.predict_proba(test_x)
    other = DataCentricGPC(x, labels, _modules(3, False)[0], num_steps=2, num_samples=S)
    other.covar_module.outputscale = torch.tensor(0.5, dtype=torch.float64)
    other.load_state_dict(model.state_dict())
    torch.testing.assert_close(other.predict_proba(test_x), expected, rtol=0, atol=1e-12)
    other.num_samples = 2 * S  # other draws: other soft targets
    assert not torch.equal(other.step_targets(2), model.step_targets(2))
    single = model.float().predict_proba(test_x.float())
    assert single.dtype == torch.float32
    torch.testing.assert_close(single.double(), expected, rtol=0, atol=1e-5)


def test_a_chain_beyond_the_free_memory_is_refused_before_fitting(use_setting):
    x, labels, _ = _data(15, 3, seed=9)
    # the 3 class covariances, and per step kept 3 more and a dense factor of 3 x 3 blocks
    needed = (3 + 2 * (3 + 9)) * 15 * 15 * 8
    tempered = DistributionCentricGPC(x, labels, _modules(3, False)[0], method="tempered")
    use_setting(gpsd.settings.memory_limit(cpu=needed - 1))
    model = DataCentricGPC(x, labels, _modules(3, False)[0], num_steps=2, num_samples=S)
    with pytest.raises(gpsd.InsufficientMemoryError, match=f"fit needs about {needed} bytes"):
        model.fit()
    with pytest.raises(gpsd.InsufficientMemoryError, match="fewer steps"):
        tempered.predict_proba(x)
