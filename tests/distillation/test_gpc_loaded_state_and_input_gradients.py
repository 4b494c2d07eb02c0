"""Review s23: the GPC distillers' saved states, settings and input gradients."""

import gpytorch
import pytest
import torch

from gpsd.distillation import DataCentricGPC, DistributionCentricGPC

N = 15


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.rand(N, 1, generator=g, dtype=torch.float64) * 5
    y = (torch.rand(N, generator=g, dtype=torch.float64) < 0.5).double()
    return x, y, torch.linspace(0, 5, 4, dtype=torch.float64)[:, None]


def _kernel(lengthscale=0.8):
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
    # before: a tempered model loading a scaled_kernel state predicted variances
    # [0.127 0 0 0] against its own fit's [1.532 0.243 0.251 0.570]; a store_all_steps
    # mismatch raised IndexError; a probit model predicted a logit model's means
    x, y, test_x = _data()
    saved, loading = MISMATCHES[which]
    source = DistributionCentricGPC(x, y, _kernel(), num_steps=4, **saved).fit()
    model = DistributionCentricGPC(x, y, _kernel(), num_steps=4, **loading)
    model.load_state_dict(source.state_dict())
    own = DistributionCentricGPC(x, y, _kernel(), num_steps=4, **loading).fit()
    got, expected = model.predict_latent(test_x), own.predict_latent(test_x)
    for got, expected in ((got.mean, expected.mean), (got.variance, expected.variance)):
        torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-12)


def test_state_saved_after_a_hyperparameter_change_is_refitted():
    # before: the steps fitted at lengthscale 0.8 were adopted for the saved lengthscale 2
    x, y, test_x = _data()
    source = DistributionCentricGPC(x, y, _kernel(), num_steps=3, method="tempered").fit()
    source.covar_module.base_kernel.lengthscale = 2.0
    model = DistributionCentricGPC(x, y, _kernel(), num_steps=3, method="tempered")
    model.load_state_dict(source.state_dict())
    own = DistributionCentricGPC(x, y, _kernel(2.0), num_steps=3, method="tempered").fit()
    torch.testing.assert_close(model.predict_proba(test_x), own.predict_proba(test_x))


def test_state_fitted_with_the_same_settings_is_adopted_without_refitting():
    x, y, test_x = _data()
    source = DistributionCentricGPC(x, y, _kernel(), num_steps=3, method="tempered").fit()
    model = DistributionCentricGPC(x, y, _kernel(), num_steps=3, method="tempered")
    model.load_state_dict(source.state_dict())
    last = {"step": 3}
    torch.testing.assert_close(model.predict_proba(test_x, **last), source.predict_proba(test_x, **last))
    assert model.newton_iterations == {}  # no Newton run: the loaded steps were used


@pytest.mark.parametrize("cls", [DataCentricGPC, DistributionCentricGPC])
@pytest.mark.parametrize(("saved_steps", "steps"), [(2, 3), (3, 2)])
def test_state_of_another_num_steps_is_refused_naming_it(cls, saved_steps, steps):
    # before (DataCentricGPC): IndexError at predict for 2 -> 3, silently accepted for 3 -> 2
    x, y, _ = _data()
    source = cls(x, y, _kernel(), num_steps=saved_steps).fit()
    model = cls(x, y, _kernel(), num_steps=steps)
    with pytest.raises(ValueError, match=f"num_steps={saved_steps}.*num_steps={steps}"):
        model.load_state_dict(source.state_dict())


SETTINGS = [
    ("soft_target_likelihood", "Bernoulli", "bernoulli"),
    ("target_method", "Probit", "probit"),
    ("threshold_targets", "yes", True),
]


@pytest.mark.parametrize(("name", "bad", "good"), SETTINGS)
def test_data_centric_settings_are_checked_on_assignment_and_refit(name, bad, good):
    # before: "Bernoulli" silently ran the continuous Bernoulli, "Probit" quadrature
    x, y, test_x = _data()
    model = DataCentricGPC(x, y, _kernel(), num_steps=2).fit()
    with pytest.raises(ValueError, match=name):
        setattr(model, name, bad)
    with pytest.raises(ValueError, match=name):
        DataCentricGPC(x, y, _kernel(), num_steps=2, **{name: bad})
    setattr(model, name, good)
    expected = DataCentricGPC(x, y, _kernel(), num_steps=2, **{name: good}).fit()
    torch.testing.assert_close(model.predict_proba(test_x), expected.predict_proba(test_x))


@pytest.mark.parametrize(
    "model",
    [
        lambda x, y: DataCentricGPC(x, y, _kernel(), num_steps=2),
        lambda x, y: DistributionCentricGPC(x, y, _kernel(), num_steps=2, method="iterated"),
    ],
    ids=["DataCentricGPC", "DistributionCentricGPC"],
)
def test_predictions_are_differentiable_in_the_test_inputs_only(model):
    # before: computed under torch.no_grad(), without any gradient
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
