"""The GPC distillers after a fit: new labels, a new method or noise schedule refit on use, and
the step count (the size of their buffers) cannot change.

Before, DistributionCentricGPC went on predicting the old labels' posterior after the labels
changed (latent means off by 3.5) and mixed a new ``method``'s scale with the old method's
corrections; setting ``num_steps`` gave a bare IndexError on prediction. Each case is compared
with a model built afresh with the new setting.
"""

import gpytorch
import pytest
import torch

from gpsd.data.toy import sine_classification
from gpsd.distillation import DataCentricGPC, DistributionCentricGPC


def _kernel():
    k = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).double()
    k.outputscale = 3.0
    return k


@pytest.fixture
def toy():
    x, y, test_x = sine_classification(25, seed=2)
    return x, y, test_x[::10]


def _close(model, fresh, x):
    got, want = model.predict_latent(x), fresh.predict_latent(x)
    for got, want in ((got.mean, want.mean), (got.variance, want.variance)):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("cls", [DataCentricGPC, DistributionCentricGPC])
@pytest.mark.parametrize("assign", ["in_place", "new_tensor"])
def test_new_labels_refit(cls, assign, toy):
    x, y, test_x = toy
    model = cls(x, y, _kernel(), num_steps=3).fit()
    before = model.predict_latent(test_x).mean
    flipped = 1.0 - y
    if assign == "in_place":
        model.train_targets.copy_(flipped)
    else:
        model.train_targets = flipped.clone()
    fresh = cls(x, flipped, _kernel(), num_steps=3).fit()
    _close(model, fresh, test_x)
    assert (model.predict_latent(test_x).mean - before).abs().max() > 1.0


@pytest.mark.parametrize("store_all_steps", [True, False])
def test_distribution_centric_new_method_refits(store_all_steps, toy):
    x, y, test_x = toy
    model = DistributionCentricGPC(
        x, y, _kernel(), num_steps=4, method="tempered", store_all_steps=store_all_steps
    ).fit()
    model.predict_latent(test_x)
    model.method = "scaled_kernel"
    fresh = DistributionCentricGPC(
        x, y, _kernel(), num_steps=4, method="scaled_kernel", store_all_steps=store_all_steps
    ).fit()
    _close(model, fresh, test_x)
    with pytest.raises(ValueError, match="method must be one of"):
        model.method = "scaled"


def test_data_centric_new_noise_schedule_refits(toy):
    x, y, test_x = toy
    model = DataCentricGPC(x, y, _kernel(), num_steps=3).fit()
    model.predict_latent(test_x)
    model.noise = [0.0, 0.3, 0.1]
    fresh = DataCentricGPC(x, y, _kernel(), num_steps=3, noise=[0.0, 0.3, 0.1]).fit()
    _close(model, fresh, test_x)
    assert model.noise.tolist() == [0.0, 0.3, 0.1]
    with pytest.raises(ValueError, match="noise must have num_steps=3 entries"):
        model.noise = [0.1, 0.2]
    model.noise[1] = 0.5  # a write into the buffer refits too
    fresh = DataCentricGPC(x, y, _kernel(), num_steps=3, noise=[0.0, 0.5, 0.1]).fit()
    _close(model, fresh, test_x)


@pytest.mark.parametrize("cls", [DataCentricGPC, DistributionCentricGPC])
def test_num_steps_is_fixed(cls, toy):
    x, y, test_x = toy
    model = cls(x, y, _kernel(), num_steps=2).fit()
    with pytest.raises(AttributeError, match="num_steps is fixed at construction"):
        model.num_steps = 5
    assert model.num_steps == 2
    assert model.predict_latent(test_x, step=2).mean.shape == test_x.shape
    if cls is DistributionCentricGPC:
        with pytest.raises(AttributeError, match="store_all_steps is fixed"):
            model.store_all_steps = False
