"""The distillers follow changed hyperparameters and settings; their training data carry no graph."""

import copy

import gpytorch
import pytest
import torch
from gpr_reference import PlainGP, rbf_kernel

from gpsd import DataCentricGPR, DistributionCentricGPR

DT = torch.float64


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
