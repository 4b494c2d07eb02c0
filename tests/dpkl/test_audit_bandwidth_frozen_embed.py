"""DPKL fixes from an audit against independent loops: the classifier's class weights use the
documented fixed bandwidth (they always took the median heuristic), a frozen lengthscale or
frozen class weights train (a bare autograd error before), ``embed`` runs the networks in
evaluation mode (dropout and BatchNorm's running statistics changed with the model's mode),
and an ensemble whose particles start identical says so."""

import copy
import math
import warnings

import pytest
import torch
from torch import nn

from gpsd.dpkl import DPKLClassifier, DPKLRegressor, ParticleEnsemble

DT = torch.float64


def _net(d_in=4):
    return lambda: nn.Sequential(nn.Linear(d_in, 8), nn.Tanh(), nn.Linear(8, 2)).to(DT)


def _svgd_direction(theta, grad, h):
    """(1/q) sum_l [k(l, i) g_l - d/dtheta_l k(l, i)], k = exp(-|theta_l - theta_i|^2 / h)."""
    q = theta.shape[0]
    out = torch.zeros_like(grad)
    for i in range(q):
        for j in range(q):
            k = math.exp(-float((theta[j] - theta[i]).square().sum()) / h)
            out[i] += k * grad[j] + (2.0 / h) * (theta[j] - theta[i]) * k
    return out / q


def test_the_class_weights_use_a_fixed_bandwidth():
    torch.manual_seed(0)
    x, y = torch.randn(30, 4, dtype=DT), torch.randint(0, 3, (30,))
    clf = DPKLClassifier(_net(), 3, num_particles=3, num_weight_particles=4, bandwidth=0.05)
    ref = copy.deepcopy(clf)
    clf.fit(x, y, num_epochs=1, batch_size=30, lr=1e-3)
    _, potential = ref.losses(x, y, 30)
    (grad,) = torch.autograd.grad(potential, [ref.class_weights])
    theta = ref.class_weights.detach().reshape(4, -1)
    direction = _svgd_direction(theta, grad.reshape(4, -1), 0.05)
    # Adam's first step is lr * g / (|g| + eps) for the transformed gradient g
    expected = theta - 1e-3 * direction / (direction.abs() + 1e-8)
    torch.testing.assert_close(
        clf.class_weights.detach().reshape(4, -1), expected, rtol=0, atol=1e-10
    )


@pytest.mark.parametrize("frozen", ["raw_lengthscale", "class_weights"])
def test_frozen_lengthscale_or_class_weights_are_kept(frozen):
    torch.manual_seed(0)
    x, y = torch.randn(30, 3, dtype=DT), (torch.randn(30) > 0).long()
    clf = DPKLClassifier(_net(3), 2, num_particles=2, num_weight_particles=2)
    getattr(clf, frozen).requires_grad_(False)
    before = {k: v.clone() for k, v in clf.state_dict().items()}
    clf.fit(x, y, num_epochs=2, batch_size=10)
    after = clf.state_dict()
    assert torch.equal(after[frozen], before[frozen])
    others = [k for k in ("raw_lengthscale", "class_weights") if k != frozen]
    assert not torch.equal(after[others[0]], before[others[0]])  # the rest trains


def test_embed_runs_the_networks_in_evaluation_mode():
    torch.manual_seed(0)
    x, y = torch.randn(40, 5, dtype=DT), torch.randn(40, dtype=DT)

    def net():
        return nn.Sequential(
            nn.Linear(5, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 2)
        ).to(DT)

    model = DPKLRegressor(x, y, net, num_particles=3, num_random_features=20)
    model.train()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    first, second = model.embed(x), model.embed(x)
    assert torch.equal(first, second)  # no dropout
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
    assert model.training and model.covar_module.feature_extractor.training
    # an independent evaluation: each particle's network on its own, in evaluation mode
    ensemble = model.covar_module.feature_extractor
    for i in range(3):
        particle = ensemble.particle_module(i).eval()
        with torch.no_grad():
            torch.testing.assert_close(first[i], particle(x), rtol=1e-12, atol=1e-12)


class _Projection(nn.Module):
    """A network with a plain parameter and no reset_parameters()."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(3, 2, dtype=DT))

    def forward(self, x):
        return x @ self.weight


def test_identical_particles_are_reported():
    with pytest.warns(UserWarning, match="all 4 particles start with identical"):
        ParticleEnsemble(_Projection(), 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        ParticleEnsemble(_Projection(), 4, reinitialise=False)  # asked for copies
        ParticleEnsemble(_net(3), 4)  # a factory of fresh networks
        ParticleEnsemble(_Projection(), 1)
