"""Classifiers refit on training data of another shape assigned after a fit: the last mode is a
warm start only for data of its own shape. Before, LaplaceGPClassifier kept the old batch shape
(predictions of shape (2, m) for unbatched labels) and LaplaceGPClassifier and DataCentricGPC
failed inside torch for a new number of training points. DistributionCentricGPC now follows the
parameters of a likelihood passed as AutogradLikelihoodTerms (it kept the old fit). Each case is
compared with a model built afresh on the new data."""

import gpytorch
import pytest
import torch
from gpytorch.likelihoods.likelihood import _OneDimensionalLikelihood

from gpsd import LaplaceGPClassifier
from gpsd.data.toy import sine_classification
from gpsd.distillation import DataCentricGPC, DistributionCentricGPC
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
