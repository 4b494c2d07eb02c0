"""The distillers follow changed hyperparameters and settings; their training data carry no graph."""

import copy

import gpytorch
import pytest
import torch
from gpr_reference import PlainGP, rbf_kernel

from gpsd import DataCentricGPR, DistributionCentricGPR
from gpsd.data.toy import sine_classification
from gpsd.distillation.data_centric_gpc import DataCentricGPC
from gpsd.distillation.distribution_centric_gpc import DistributionCentricGPC

DT = torch.float64


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
            model.predict_latent(test_x, step=step).mean, fresh.predict_latent(test_x, step=step).mean
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
    got, want = model.predict_latent(test_x), fresh.predict_latent(test_x)
    torch.testing.assert_close((got.mean, got.variance), (want.mean, want.variance))


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


def _regression_data(n=30, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = 10 * torch.rand(n, 1, generator=gen, dtype=DT)
    return x, torch.sin(x[:, 0]), torch.linspace(0, 10, 7, dtype=DT).unsqueeze(-1)


@pytest.mark.parametrize("cls", [DataCentricGPR, DistributionCentricGPR])
def test_inputs_and_targets_with_a_graph_are_stored_detached(cls):
    x, y, test_x = _regression_data()
    scale = torch.tensor(1.0, dtype=DT, requires_grad=True)  # a feature extractor, say
    model = cls(rbf_kernel(), x * scale, y * scale, [0.1, 0.2], backend="dense")
    reference = cls(rbf_kernel(), x, y, [0.1, 0.2], backend="dense")
    assert not model.train_x.requires_grad and not model.train_y.requires_grad
    for _ in range(2):  # the second backward pass ran into the first one's freed graph
        model.predict(test_x).mean.sum().backward()
        reference.predict(test_x).mean.sum().backward()
    for p, q in zip(model.kernel.parameters(), reference.kernel.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)
    assert scale.grad is None
    copied = copy.deepcopy(model)  # a non-leaf buffer cannot be deep-copied
    torch.testing.assert_close(copied.predict(test_x).mean, model.predict(test_x).mean)


def test_from_teacher_refuses_num_steps_that_contradict_gamma():
    x, y, _ = _regression_data()
    likelihood = gpytorch.likelihoods.GaussianLikelihood().to(DT)
    teacher = PlainGP(x, y, likelihood, gpytorch.means.ZeroMean(), rbf_kernel()).eval()
    with pytest.raises(ValueError, match="num_steps=3 does not match the 2 steps of gamma"):
        DataCentricGPR.from_teacher(teacher, gamma=[0.1, 0.2], num_steps=3)
    model = DataCentricGPR.from_teacher(teacher, gamma=[0.1, 0.2], num_steps=2)
    assert model.num_steps == 2
    with pytest.raises(ValueError, match="num_steps must be a positive integer"):
        DataCentricGPR.from_teacher(teacher, num_steps=0)
