"""What the GPC self-distillers (and the Laplace classifier they build on) share: refits on new
training data, settings, likelihood parameters and loaded states; predictions differentiable in
the test inputs; kernels in another dtype than the data; empty training sets refused. Each case
is compared with a model built afresh, or with dense formulas."""

import importlib

import gpytorch
import pytest
import torch
from gpr_reference import rbf_kernel
from gpytorch.likelihoods.likelihood import _OneDimensionalLikelihood

import gpsd
from gpsd import (
    DataCentricGPC,
    DistributionCentricGPC,
    LaplaceGPClassifier,
)
from gpsd.data.toy import sine_classification
from gpsd.laplace import AutogradLikelihoodTerms

BUILDERS = {
    "laplace": lambda x, y, **kw: LaplaceGPClassifier(x, y, _kernel(), **kw),
    "data_centric": lambda x, y, **kw: DataCentricGPC(x, y, _kernel(), num_steps=2, **kw),
    "distribution_centric": lambda x, y, **kw: DistributionCentricGPC(
        x, y, _kernel(), num_steps=2, **kw
    ),
}


def _kernel():
    k = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).double()
    k.outputscale = 2.0
    return k


def _close(model, fresh, test_x):
    got, want = model.predict_proba(test_x), fresh.predict_proba(test_x)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_unbatched_labels_after_a_batched_fit(name):
    x, y, test_x = sine_classification(25, seed=4)
    build = BUILDERS[name]
    model = build(x, torch.stack([y, 1 - y])).fit()
    model.train_targets = y.clone()
    _close(model, build(x, y).fit(), test_x[::20])


@pytest.mark.parametrize("how", ["set_train_data", "buffers"])
@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_new_data_with_another_number_of_points(name, how):
    x, y, test_x = sine_classification(25, seed=4)
    x2, y2, _ = sine_classification(30, seed=5)  # 1-D inputs, read as (n, 1)
    build = BUILDERS[name]
    model = build(x, y).fit()
    if how == "set_train_data":
        with pytest.raises(ValueError, match="strict=True"):
            model.set_train_data(x2, y2)  # GPyTorch's default refuses a new shape
        model.set_train_data((x2,), y2, strict=False)
    else:
        model.train_inputs = x2.unsqueeze(-1).clone()
        model.train_targets = y2.clone()
    assert model.train_inputs.shape == (30, 1)
    _close(model, build(x2, y2).fit(), test_x[::20])


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_set_train_data_checks_as_the_constructor_does(name):
    x, y, _ = sine_classification(25, seed=4)
    model = BUILDERS[name](x, y)
    with pytest.raises(ValueError, match="train_y must have 25 entries"):
        model.set_train_data(targets=y[:-1], strict=False)
    with pytest.raises(ValueError, match="train_y must hold binary labels"):
        model.set_train_data(targets=2 * y - 1)
    with pytest.raises(ValueError, match="train_x must hold at least one input"):
        model.set_train_data(x[:0], y[:0], strict=False)
    with pytest.raises(ValueError, match="targets must have the current shape, dtype"):
        model.set_train_data(targets=(1 - y).float())
    model.set_train_data(x, targets=(1 - y).float(), strict=False)  # converted to float64
    assert model.train_targets.dtype == torch.float64
    torch.testing.assert_close(model.train_targets, 1 - y)


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_a_state_dict_of_another_n_loads(name):
    x, y, test_x = sine_classification(25, seed=4)
    x2, y2, _ = sine_classification(30, seed=5)
    build = BUILDERS[name]
    saved = build(x2, y2).fit()
    model = build(x, y).fit()
    model.load_state_dict(saved.state_dict())
    assert model.train_inputs.shape == (30, 1)
    _close(model, build(x2, y2).fit(), test_x[::20])
    model.set_train_data(x, y, strict=False)
    model.load_state_dict(build(x, y).fit().state_dict())  # and back
    _close(model, build(x, y).fit(), test_x[::20])


class _ScaledLogit(_OneDimensionalLikelihood):
    """Bernoulli(sigmoid(a f)) with a learnable slope a."""

    def __init__(self):
        super().__init__()
        self.register_parameter("raw_a", torch.nn.Parameter(torch.tensor(0.5).double()))

    def forward(self, f, *args, **kwargs):
        slope = torch.nn.functional.softplus(self.raw_a)
        return torch.distributions.Bernoulli(logits=slope * f, validate_args=False)


@pytest.mark.parametrize("name", ["laplace", "distribution_centric"])
def test_a_likelihood_given_as_autograd_terms_is_followed(name):
    x, y, test_x = sine_classification(25, seed=4)
    likelihood = _ScaledLogit()
    model = BUILDERS[name](x, y, likelihood=AutogradLikelihoodTerms(likelihood)).fit()
    before = model.predict_proba(test_x[::20])
    with torch.no_grad():
        likelihood.raw_a.fill_(3.0)
    fresh_likelihood = _ScaledLogit()
    with torch.no_grad():
        fresh_likelihood.raw_a.fill_(3.0)
    fresh = BUILDERS[name](x, y, likelihood=AutogradLikelihoodTerms(fresh_likelihood)).fit()
    _close(model, fresh, test_x[::20])
    assert (model.predict_proba(test_x[::20]) - before).abs().max() > 1e-2


def _kernel_gpc_settings_after_fit():
    k = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).double()
    k.outputscale = 3.0
    return k


@pytest.fixture
def toy():
    x, y, test_x = sine_classification(25, seed=2)
    return x, y, test_x[::10]


def _close_gpc_settings_after_fit(model, fresh, x):
    a, b = model.predict_latent(x), fresh.predict_latent(x)
    for got, want in ((a.mean, b.mean), (a.variance, b.variance)):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("cls", [DataCentricGPC, DistributionCentricGPC])
@pytest.mark.parametrize("assign", ["in_place", "new_tensor"])
def test_new_labels_refit(cls, assign, toy):
    x, y, test_x = toy
    model = cls(x, y, _kernel_gpc_settings_after_fit(), num_steps=3).fit()
    before = model.predict_latent(test_x).mean
    flipped = 1.0 - y
    if assign == "in_place":
        model.train_targets.copy_(flipped)
    else:
        model.train_targets = flipped.clone()
    fresh = cls(x, flipped, _kernel_gpc_settings_after_fit(), num_steps=3).fit()
    _close_gpc_settings_after_fit(model, fresh, test_x)
    assert (model.predict_latent(test_x).mean - before).abs().max() > 1.0


@pytest.mark.parametrize("store_all_steps", [True, False])
def test_distribution_centric_new_method_refits(store_all_steps, toy):
    x, y, test_x = toy

    def fitted(method):
        kernel = _kernel_gpc_settings_after_fit()
        return DistributionCentricGPC(
            x, y, kernel, num_steps=4, method=method, store_all_steps=store_all_steps
        ).fit()

    model = fitted("tempered")
    model.predict_latent(test_x)
    model.method = "scaled_kernel"
    fresh = fitted("scaled_kernel")
    _close_gpc_settings_after_fit(model, fresh, test_x)
    with pytest.raises(ValueError, match="method must be one of"):
        model.method = "scaled"


def test_data_centric_new_noise_schedule_refits(toy):
    x, y, test_x = toy
    model = DataCentricGPC(x, y, _kernel_gpc_settings_after_fit(), num_steps=3).fit()
    model.predict_latent(test_x)
    model.noise = [0.0, 0.3, 0.1]
    fresh = DataCentricGPC(
        x, y, _kernel_gpc_settings_after_fit(), num_steps=3, noise=[0.0, 0.3, 0.1]
    ).fit()
    _close_gpc_settings_after_fit(model, fresh, test_x)
    assert model.noise.tolist() == [0.0, 0.3, 0.1]
    with pytest.raises(ValueError, match="num_steps=3 does not match the 2 steps of the noise"):
        model.noise = [0.1, 0.2]
    model.noise[1] = 0.5  # a write into the buffer refits too
    fresh = DataCentricGPC(
        x, y, _kernel_gpc_settings_after_fit(), num_steps=3, noise=[0.0, 0.5, 0.1]
    ).fit()
    _close_gpc_settings_after_fit(model, fresh, test_x)


@pytest.mark.parametrize("cls", [DataCentricGPC, DistributionCentricGPC])
def test_num_steps_is_fixed(cls, toy):
    x, y, test_x = toy
    model = cls(x, y, _kernel_gpc_settings_after_fit(), num_steps=2).fit()
    with pytest.raises(AttributeError, match="num_steps is fixed at construction"):
        model.num_steps = 5
    assert model.num_steps == 2
    assert model.predict_latent(test_x, step=2).mean.shape == test_x.shape
    if cls is DistributionCentricGPC:
        with pytest.raises(AttributeError, match="store_all_steps is fixed"):
            model.store_all_steps = False


N_LOADED = 15


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.rand(N_LOADED, 1, generator=g, dtype=torch.float64) * 5
    y = (torch.rand(N_LOADED, generator=g, dtype=torch.float64) < 0.5).double()
    return x, y, torch.linspace(0, 5, 4, dtype=torch.float64)[:, None]


def _kernel_gpc_loaded_state_and_input_gradients(lengthscale=0.8):
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).double()
    kernel.outputscale = 2.0
    kernel.base_kernel.lengthscale = lengthscale
    return kernel


# (settings of the saved model, settings of the loading model)
MISMATCHES = {
    "method": ({"method": "scaled_kernel"}, {"method": "tempered"}),
    "store_all_steps": (
        {"method": "scaled_kernel", "store_all_steps": False},
        {"method": "scaled_kernel", "store_all_steps": True},
    ),
    "likelihood": ({"likelihood": "bernoulli_logit"}, {"likelihood": "bernoulli_probit"}),
}


@pytest.mark.parametrize("which", MISMATCHES)
def test_state_fitted_with_other_settings_is_refitted_not_adopted(which):
    # adopted, a scaled_kernel state would give a tempered model variances [0.127 0 0 0]
    # against its own fit's [1.532 0.243 0.251 0.570], and a probit model a logit model's means
    x, y, test_x = _data()
    saved, loading = MISMATCHES[which]
    source = DistributionCentricGPC(
        x, y, _kernel_gpc_loaded_state_and_input_gradients(), num_steps=4, **saved
    ).fit()
    model = DistributionCentricGPC(
        x, y, _kernel_gpc_loaded_state_and_input_gradients(), num_steps=4, **loading
    )
    model.load_state_dict(source.state_dict())
    own = DistributionCentricGPC(
        x, y, _kernel_gpc_loaded_state_and_input_gradients(), num_steps=4, **loading
    ).fit()
    a, b = model.predict_latent(test_x), own.predict_latent(test_x)
    for got, expected in ((a.mean, b.mean), (a.variance, b.variance)):
        torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-12)


def test_state_saved_after_a_hyperparameter_change_is_refitted():
    # steps fitted at lengthscale 0.8 must not be adopted for the saved lengthscale 2
    x, y, test_x = _data()
    source = DistributionCentricGPC(
        x, y, _kernel_gpc_loaded_state_and_input_gradients(), num_steps=3, method="tempered"
    ).fit()
    source.covar_module.base_kernel.lengthscale = 2.0
    model = DistributionCentricGPC(
        x, y, _kernel_gpc_loaded_state_and_input_gradients(), num_steps=3, method="tempered"
    )
    model.load_state_dict(source.state_dict())
    own = DistributionCentricGPC(
        x, y, _kernel_gpc_loaded_state_and_input_gradients(2.0), num_steps=3, method="tempered"
    ).fit()
    torch.testing.assert_close(model.predict_proba(test_x), own.predict_proba(test_x))


def test_a_loaded_state_is_refitted_on_first_use_and_predicts_as_the_saved_model():
    x, y, test_x = _data()
    source = DistributionCentricGPC(
        x, y, _kernel_gpc_loaded_state_and_input_gradients(), num_steps=3, method="tempered"
    ).fit()
    model = DistributionCentricGPC(
        x, y, _kernel_gpc_loaded_state_and_input_gradients(), num_steps=3, method="tempered"
    )
    model.load_state_dict(source.state_dict())
    last = {"step": 3}
    torch.testing.assert_close(
        model.predict_proba(test_x, **last),
        source.predict_proba(test_x, **last),
        rtol=0,
        atol=1e-12,
    )
    assert list(model.newton_iterations) == [3]  # refitted, one Laplace fit of step 3


@pytest.mark.parametrize("cls", [DataCentricGPC, DistributionCentricGPC])
@pytest.mark.parametrize(("saved_steps", "steps"), [(2, 3), (3, 2)])
def test_state_of_another_num_steps_is_refused_naming_it(cls, saved_steps, steps):
    x, y, _ = _data()
    source = cls(x, y, _kernel_gpc_loaded_state_and_input_gradients(), num_steps=saved_steps).fit()
    model = cls(x, y, _kernel_gpc_loaded_state_and_input_gradients(), num_steps=steps)
    with pytest.raises(ValueError, match=f"num_steps={saved_steps}.*num_steps={steps}"):
        model.load_state_dict(source.state_dict())


SETTINGS = [
    ("soft_target_likelihood", "Bernoulli", "bernoulli"),
    ("target_method", "Probit", "probit"),
    ("threshold_targets", "yes", True),
]


@pytest.mark.parametrize(("name", "bad", "good"), SETTINGS)
def test_data_centric_settings_are_checked_on_assignment_and_refit(name, bad, good):
    # a misspelt setting is refused, naming it
    x, y, test_x = _data()
    model = DataCentricGPC(x, y, _kernel_gpc_loaded_state_and_input_gradients(), num_steps=2).fit()
    with pytest.raises(ValueError, match=name):
        setattr(model, name, bad)
    with pytest.raises(ValueError, match=name):
        DataCentricGPC(
            x, y, _kernel_gpc_loaded_state_and_input_gradients(), num_steps=2, **{name: bad}
        )
    setattr(model, name, good)
    expected = DataCentricGPC(
        x, y, _kernel_gpc_loaded_state_and_input_gradients(), num_steps=2, **{name: good}
    ).fit()
    torch.testing.assert_close(model.predict_proba(test_x), expected.predict_proba(test_x))


@pytest.mark.parametrize(
    "model",
    [
        lambda x, y: DataCentricGPC(
            x, y, _kernel_gpc_loaded_state_and_input_gradients(), num_steps=2
        ),
        lambda x, y: DistributionCentricGPC(
            x, y, _kernel_gpc_loaded_state_and_input_gradients(), num_steps=2, method="iterated"
        ),
    ],
    ids=["DataCentricGPC", "DistributionCentricGPC"],
)
def test_predictions_are_differentiable_in_the_test_inputs_only(model):
    x, y, _ = _data()
    model = model(x, y).fit()
    test_x = torch.tensor([[1.3], [2.2], [4.1]], dtype=torch.float64, requires_grad=True)
    latent = model.predict_latent(test_x)
    mean, var = latent.mean, latent.variance
    objective = (mean + var.sqrt() + model.predict_proba(test_x)[..., 1]).sum()
    (grad,) = torch.autograd.grad(objective, test_x)
    h = 1e-6
    for i in range(3):
        step = torch.zeros_like(test_x).index_fill_(0, torch.tensor(i), h)
        values = []
        for shifted in (test_x.detach() + step, test_x.detach() - step):
            latent = model.predict_latent(shifted)
            mean, var = latent.mean, latent.variance
            values.append((mean + var.sqrt() + model.predict_proba(shifted)[..., 1]).sum().item())
        torch.testing.assert_close(
            grad[i, 0].item(), (values[0] - values[1]) / (2 * h), rtol=1e-6, atol=1e-9
        )
    # the hyperparameters are constants to the predictions, and still trainable
    assert all(p.grad is None and p.requires_grad for p in model.parameters())


N_DTYPE = 12


def _problem():
    gen = torch.Generator().manual_seed(5)
    x = 4 * torch.rand(N_DTYPE, 1, generator=gen)  # float32 data
    y = (torch.sin(2 * x[:, 0]) > 0).float()
    test_x = 4 * torch.rand(5, 1, generator=gen)
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).double()
    kernel.base_kernel.lengthscale = 0.7
    kernel.outputscale = 2.0
    return x, y, test_x, kernel


def _laplace_reference(kernel, x, y, test_x):
    """Step 1 (an ordinary logistic Laplace GPC) by Rasmussen & Williams, Algorithm 3.1/3.2, in
    float64 at the float32 inputs."""
    x, y, test_x = x.double(), y.double(), test_x.double()
    with torch.no_grad():
        K, Ks = kernel(x).to_dense(), kernel(test_x, x).to_dense()
        kss = kernel(test_x, diag=True)
    f = torch.zeros(N_DTYPE, dtype=torch.float64)
    for _ in range(100):
        pi = torch.sigmoid(f)
        sw = (pi * (1 - pi)).sqrt()
        L = torch.linalg.cholesky(torch.eye(N_DTYPE, dtype=torch.float64) + sw[:, None] * K * sw)
        b = sw**2 * f + (y - pi)
        a = b - sw * torch.cholesky_solve((sw * (K @ b))[:, None], L)[:, 0]
        f = K @ a
    pi = torch.sigmoid(f)
    sw = (pi * (1 - pi)).sqrt()
    L = torch.linalg.cholesky(torch.eye(N_DTYPE, dtype=torch.float64) + sw[:, None] * K * sw)
    v = torch.linalg.solve_triangular(L, sw[:, None] * Ks.T, upper=False)
    return Ks @ (y - pi), kss - v.square().sum(0)


@pytest.mark.parametrize(
    "build",
    [
        lambda x, y, k: DataCentricGPC(x, y, k, num_steps=2, noise=[0.0, 0.05]),
        lambda x, y, k: DistributionCentricGPC(x, y, k, num_steps=2),
        lambda x, y, k: DistributionCentricGPC(x, y, k, num_steps=2, method="scaled_kernel"),
    ],
)
def test_a_float64_kernel_on_float32_data(build):
    # the steps are computed in the data's dtype, and step 1 matches the float64 reference
    x, y, test_x, kernel = _problem()
    model = build(x, y, kernel).fit()
    latent = model.predict_latent(test_x, step=1)
    mean, var = latent.mean, latent.variance
    assert mean.dtype == var.dtype == torch.float32
    ref_mean, ref_var = _laplace_reference(kernel, x, y, test_x)
    torch.testing.assert_close(mean.double(), ref_mean, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(var.double(), ref_var, rtol=1e-4, atol=1e-4)
    proba = model.predict_proba(test_x)  # the last step, in float32 as well
    assert proba.dtype == torch.float32 and torch.isfinite(proba).all()


def _kernel_classifier_state_and_tails(
    outputscale=2.0, lengthscale=1.3, dtype=torch.float64, batch_shape=()
):
    return rbf_kernel(outputscale, lengthscale, dtype, batch_shape=torch.Size(batch_shape))


@pytest.fixture
def toy_classifier_state_and_tails():
    return sine_classification(30, seed=3)


def test_distribution_centric_unkept_step_follows_load_state_dict_and_to(
    toy_classifier_state_and_tails,
):
    x, y, test_x = toy_classifier_state_and_tails
    kw = dict(num_steps=3, method="tempered", store_all_steps=False)
    a = DistributionCentricGPC(
        x, y, _kernel_classifier_state_and_tails(lengthscale=0.9), **kw
    ).fit()
    b = DistributionCentricGPC(
        x, 1 - y, _kernel_classifier_state_and_tails(lengthscale=2.0), **kw
    ).fit()
    a.predict_proba(test_x, step=1)[..., 1]  # fills the cache of the unkept step 1
    a.load_state_dict(b.state_dict())
    torch.testing.assert_close(
        a.predict_proba(test_x, step=1)[..., 1], b.predict_proba(test_x, step=1)[..., 1]
    )
    a32 = DistributionCentricGPC(x, y, _kernel_classifier_state_and_tails(), **kw).fit()
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
def test_fitted_state_of_a_batched_kernel_loads_into_a_fresh_model(
    toy_classifier_state_and_tails, build
):
    x, y, test_x = toy_classifier_state_and_tails
    batch = torch.Size([2])
    fitted = build(x, y, _kernel_classifier_state_and_tails(batch_shape=batch)).fit()
    fresh = build(x, y, _kernel_classifier_state_and_tails(batch_shape=batch))
    fresh.load_state_dict(fitted.state_dict())  # the buffers took the batch shape at fit()
    torch.testing.assert_close(
        fresh.predict_proba(test_x)[..., 1], fitted.predict_proba(test_x)[..., 1]
    )


EMPTY_X = torch.empty(0, 1, dtype=torch.float64)


EMPTY_Y = torch.empty(0, dtype=torch.float64)


@pytest.mark.parametrize(
    "build",
    [
        lambda: LaplaceGPClassifier(EMPTY_X, EMPTY_Y, _kernel()),
        lambda: DataCentricGPC(EMPTY_X, EMPTY_Y, _kernel(), num_steps=2),
        lambda: DistributionCentricGPC(EMPTY_X, EMPTY_Y, _kernel(), num_steps=2),
    ],
)
def test_classifiers_refuse_an_empty_training_set(build):
    with pytest.raises(ValueError, match="train_x must hold at least one input"):
        build()


@pytest.mark.parametrize(
    "cls, n, seed", [(DataCentricGPC, 30, 1), (DistributionCentricGPC, 25, 2)], ids=["data", "dist"]
)
def test_a_prediction_under_a_result_changing_setting_refits_every_step_and_memory_does_not(
    cls, n, seed, monkeypatch
):
    module = importlib.import_module("gpsd.laplace.laplace_posterior")  # every step's Newton
    x, y, test_x = sine_classification(n, seed=seed)
    model = cls(x, y, rbf_kernel(3.0, 1.0), num_steps=2).fit()
    calls = []
    original = module.find_laplace_mode
    monkeypatch.setattr(
        module, "find_laplace_mode", lambda *a, **k: calls.append(1) or original(*a, **k)
    )
    model.predict_proba(test_x)
    assert calls == []
    with gpsd.settings.test_chunk_size(7):  # memory and time alone: the fit is reused
        model.predict_proba(test_x)
    assert calls == []
    with gpsd.settings.max_lanczos_rank(7):
        model.predict_proba(test_x)
    assert len(calls) == 2  # both steps refitted
    model.covar_module.outputscale = 2.0
    model.predict_proba(test_x)
    assert len(calls) == 4
