"""The classification distillers follow changed hyperparameters and settings."""

import pytest
import torch
from gpr_reference import rbf_kernel

from gpsd.data.toy import sine_classification
from gpsd.distillation.data_centric_gpc import DataCentricGPC
from gpsd.distillation.distribution_centric_gpc import DistributionCentricGPC


@pytest.fixture
def toy():
    return sine_classification(25, seed=4)


def test_data_centric_gpc_follows_hyperparameters_and_settings(toy):
    x, y, test_x = toy
    model = DataCentricGPC(x, y, rbf_kernel(3.0, 1.0), num_steps=3).fit()
    model.predict_proba(test_x)
    model.covar_module.outputscale = 8.0
    model.covar_module.base_kernel.lengthscale = 0.6
    model.threshold_targets = True
    # the modes of the first kernel were combined with the new one: probabilities far off
    fresh = DataCentricGPC(x, y, rbf_kernel(8.0, 0.6), num_steps=3, threshold_targets=True).fit()
    for step in (1, 3):
        torch.testing.assert_close(
            model.predict_proba(test_x, step=step), fresh.predict_proba(test_x, step=step)
        )
        torch.testing.assert_close(
            model.predict_latent(test_x, step=step), fresh.predict_latent(test_x, step=step)
        )


@pytest.mark.parametrize("method", ["iterated", "tempered", "scaled_kernel"])
def test_distribution_centric_gpc_follows_hyperparameters(toy, method):
    x, y, test_x = toy
    model = DistributionCentricGPC(x, y, rbf_kernel(3.0, 1.0), num_steps=3, method=method).fit()
    model.predict_proba(test_x)
    model.covar_module.outputscale = 8.0
    model.covar_module.base_kernel.lengthscale = 0.6
    fresh = DistributionCentricGPC(x, y, rbf_kernel(8.0, 0.6), num_steps=3, method=method).fit()
    torch.testing.assert_close(model.predict_proba(test_x), fresh.predict_proba(test_x))
    torch.testing.assert_close(model.predict_latent(test_x), fresh.predict_latent(test_x))


def test_distribution_centric_gpc_keeps_a_loaded_fit_and_a_fit_moved_to_float32(toy):
    x, y, test_x = toy
    model = DistributionCentricGPC(x, y, rbf_kernel(3.0, 1.0), num_steps=3, method="iterated").fit()
    loaded = DistributionCentricGPC(x, y, rbf_kernel(1.0, 3.0), num_steps=3, method="iterated")
    loaded.load_state_dict(model.state_dict())
    torch.testing.assert_close(loaded.predict_proba(test_x), model.predict_proba(test_x))
    assert loaded.newton_iterations == {}  # the loaded steps were used, not refitted
    # a change before .to() is still a change: the converted model refits
    loaded.covar_module.outputscale = 8.0
    loaded.float()
    loaded.predict_proba(test_x.float())
    assert sorted(loaded.newton_iterations) == [1, 2, 3]
    # a conversion alone is no change: the converted steps are used as they are
    loaded.newton_iterations = {}
    loaded.double()
    loaded.predict_proba(test_x)
    assert loaded.newton_iterations == {}
