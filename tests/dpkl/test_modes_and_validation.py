"""Train/eval modes of the particle ensemble and the input checks of the DPKL models."""

import numpy as np
import pytest
import torch
from torch import nn

from gpsd.dpkl import (
    DKLRegressor,
    DPKLClassifier,
    DPKLRegressor,
    ParticleEnsemble,
    SSDPKLRegressor,
    sample_spectral_frequencies,
)


def _dropout_net(d_in=3, d_out=2):
    return nn.Sequential(nn.Linear(d_in, 16), nn.Tanh(), nn.Dropout(0.5), nn.Linear(16, d_out))


def _net(d_in=3, d_out=2):
    return nn.Sequential(nn.Linear(d_in, 8), nn.Tanh(), nn.Linear(8, d_out))


class _NetWithSpareHead(nn.Module):
    """A network whose ``head`` takes no part in the forward pass (a pretrained head, say)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(3, 2)
        self.head = nn.Linear(2, 5)

    def forward(self, x):
        return self.body(x)


def _data(n=24):
    torch.set_default_dtype(torch.float64)
    x = torch.randn(n, 3)
    return x, torch.sin(x[:, 0])


def test_ensemble_eval_mode_reaches_dropout_and_batchnorm():
    # the architecture that evaluates the particles lives outside the module tree: eval() used
    # to leave its dropout on and its BatchNorm on batch statistics
    torch.set_default_dtype(torch.float64)
    x = torch.randn(6, 3)
    ens = ParticleEnsemble(_dropout_net, 3)
    assert not torch.equal(ens(x), ens(x))  # training mode: random masks
    ens.eval()
    loop = torch.stack([ens.particle_module(i).eval()(x) for i in range(3)])
    torch.testing.assert_close(ens(x), loop)
    ens.train()
    assert not torch.equal(ens(x), ens(x))

    def bn():
        return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))

    ens = ParticleEnsemble(bn, 2)
    with torch.no_grad():
        for name, buf in ens.stacked_buffers().items():
            if name.endswith("running_mean"):
                buf.fill_(3.0)
            elif name.endswith("running_var"):
                buf.fill_(4.0)
    ens.eval()
    loop = torch.stack([ens.particle_module(i).eval()(x) for i in range(2)])
    torch.testing.assert_close(ens(x), loop)


def test_regressor_predictions_with_dropout_are_deterministic():
    x, y = _data()
    model = DPKLRegressor(x, y, _dropout_net, num_particles=3, num_random_features=5)
    model.fit(2)
    mean1, var1 = model.predict(x[:7])
    mean2, var2 = model.predict(x[:7])
    torch.testing.assert_close(mean1, mean2, rtol=0, atol=0)
    torch.testing.assert_close(var1, var2, rtol=0, atol=0)


def test_classifier_evaluates_in_eval_mode_and_keeps_the_callers_mode():
    x, _ = _data(30)
    y = (x[:, 0] > 0).long()
    clf = DPKLClassifier(_dropout_net, 2, num_particles=3, num_weight_particles=2)
    clf.fit(x, y, num_epochs=2, val_x=x, val_y=y, check_every=1)
    assert clf.training
    p1, p2 = clf.predict_proba(x), clf.predict_proba(x)
    torch.testing.assert_close(p1, p2, rtol=0, atol=0)
    assert clf.nll(x, y) == clf.nll(x, y)
    assert clf.training
    clf.eval()
    with torch.no_grad():
        torch.testing.assert_close(p1, clf(x))
    clf.fit(x, y, num_epochs=1)
    assert not clf.training


def test_classifier_fit_with_a_parameter_the_forward_pass_does_not_use():
    # autograd.grad used to raise "appears to not have been used in the graph"
    x, _ = _data(20)
    y = (x[:, 0] > 0).long()
    clf = DPKLClassifier(_NetWithSpareHead, 2, num_particles=3, num_weight_particles=2)
    head = clf.feature_extractor.stacked_parameters()["head.weight"].detach().clone()
    body = clf.feature_extractor.stacked_parameters()["body.weight"].detach().clone()
    clf.fit(x, y, num_epochs=1, batch_size=10, lr=1e-2)
    # the paper's update of a zero gradient is zero: the spare head does not move
    torch.testing.assert_close(clf.feature_extractor.stacked_parameters()["head.weight"], head)
    assert not torch.equal(clf.feature_extractor.stacked_parameters()["body.weight"], body)


def test_classifier_fit_rejects_empty_data_and_names_val_x():
    x, _ = _data(12)
    y = (x[:, 0] > 0).long()
    clf = DPKLClassifier(_net, 2, num_particles=2, num_weight_particles=2)
    with pytest.raises(ValueError, match="x must hold at least 1 row"):  # was ZeroDivisionError
        clf.fit(x[:0], y[:0], num_epochs=1)
    with pytest.raises(ValueError, match="val_x must hold at least 1 row"):
        clf.fit(x, y, num_epochs=1, val_x=x[:0], val_y=y[:0])
    with pytest.raises(ValueError, match="val_x with 5 features"):
        clf.fit(x, y, num_epochs=1, val_x=torch.randn(4, 5), val_y=y[:4])


def test_integer_types_are_accepted():
    x, y = _data(10)
    clf = DPKLClassifier(
        _net,
        np.int64(3),
        num_particles=np.int64(2),
        num_weight_particles=torch.tensor(2),
        latent_dim=np.int32(2),
    )
    assert (clf.num_classes, clf.feature_extractor.num_particles) == (3, 2)
    assert clf.class_weights.shape == (2, 3, 2)
    model = DPKLRegressor(x, y, _net, num_particles=np.int64(2), num_random_features=3)
    assert model.num_particles == 2
    with pytest.raises(TypeError, match="num_particles"):
        ParticleEnsemble(_net, torch.tensor(2.0))
    with pytest.raises(ValueError, match="num_classes"):
        DPKLClassifier(_net, np.int64(1))


def test_regressors_name_a_feature_extractor_of_the_wrong_input_width():
    x, y = _data(10)
    wide = torch.randn(10, 4)
    for make in (
        lambda: DPKLRegressor(wide, y, _net),
        lambda: DKLRegressor(wide, y, _net),
        lambda: SSDPKLRegressor(wide, y, _net, torch.randn(5, 4)),
    ):
        with pytest.raises(ValueError, match="train_x with 4 features does not fit"):
            make()


def test_bad_nu_is_a_value_error():
    x, y = _data(10)
    for kernel in ("rff", "exact"):
        with pytest.raises(ValueError, match="nu must be"):
            DPKLRegressor(x, y, _net, kernel=kernel, nu=0.7)
    # nu = 0 or inf used to return NaN frequencies silently; a negative nu a shape error
    for nu in (0.0, -1.0, float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match="nu must be"):
            sample_spectral_frequencies(5, 2, nu=nu)
    for bad in (2.5, True, 0):
        with pytest.raises(ValueError, match="num_features"):
            sample_spectral_frequencies(bad, 2)
    freq = sample_spectral_frequencies(5, 2, nu=0.75, generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(freq).all()


def test_ssdpkl_rejects_infinite_alpha():
    # alpha = inf used to be accepted and made fit() fail with "the training loss became inf"
    x, y = _data(10)
    for alpha in (float("inf"), float("nan"), -1.0, True):
        with pytest.raises(ValueError, match="alpha must be a finite float"):
            SSDPKLRegressor(x, y, _net, torch.randn(5, 3), alpha=alpha)


def _pretrained_frozen_body():
    net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2))
    net[0].requires_grad_(False)  # a pretrained layer the user froze
    return net


def test_frozen_parameters_stay_frozen_and_shared():
    # the ensemble used to make every stacked parameter trainable and re-initialise frozen layers
    torch.set_default_dtype(torch.float64)
    net = _pretrained_frozen_body()
    ens = ParticleEnsemble(net, 3)
    body, head = ens.stacked_parameters()["0.weight"], ens.stacked_parameters()["2.weight"]
    assert not body.requires_grad and head.requires_grad
    for i in range(3):  # every particle keeps the pretrained body; the heads differ
        torch.testing.assert_close(body[i], net[0].weight, rtol=0, atol=0)
    assert not torch.equal(head[0], head[1])


def test_dpkl_fits_leave_frozen_parameters_alone():
    x, y = _data(24)
    net = _pretrained_frozen_body()
    model = DPKLRegressor(x, y, net, num_particles=3, num_random_features=5)
    params = model.covar_module.feature_extractor.stacked_parameters()
    body, head = params["0.weight"].detach().clone(), params["2.weight"].detach().clone()
    model.fit(3, lr=1e-2)
    torch.testing.assert_close(params["0.weight"], body, rtol=0, atol=0)
    assert not torch.equal(params["2.weight"], head)

    labels = (x[:, 0] > 0).long()
    clf = DPKLClassifier(net, 2, num_particles=3, num_weight_particles=2)
    params = clf.feature_extractor.stacked_parameters()
    body, head = params["0.weight"].detach().clone(), params["2.weight"].detach().clone()
    clf.fit(x, labels, num_epochs=1, batch_size=12, lr=1e-2)
    torch.testing.assert_close(params["0.weight"], body, rtol=0, atol=0)
    assert not torch.equal(params["2.weight"], head)
    net.requires_grad_(False)  # nothing trainable in the extractor: the classifier still fits
    clf = DPKLClassifier(net, 2, num_particles=2, num_weight_particles=2)
    weights = clf.class_weights.detach().clone()
    clf.fit(x, labels, num_epochs=1, batch_size=12, lr=1e-2)
    assert not torch.equal(clf.class_weights, weights)


def test_ssdpkl_state_dict_holds_no_data():
    # unlabelled_x was saved in state_dict, so a model rebuilt with another unlabelled set (of
    # another size) could not load a saved one ("size mismatch for unlabelled_x")
    x, y = _data(12)
    model = SSDPKLRegressor(x, y, _net, torch.randn(9, 3), num_particles=2)
    model.fit(2)
    assert "unlabelled_x" not in model.state_dict()
    fresh = SSDPKLRegressor(x, y, _net, torch.randn(4, 3), num_particles=2)
    fresh.load_state_dict(model.state_dict())
    for got, want in zip(fresh.predict(x[:5]), model.predict(x[:5]), strict=True):
        torch.testing.assert_close(got, want)
    assert fresh.unlabelled_x.shape == (4, 3)
