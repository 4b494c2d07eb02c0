import math

import pytest
import torch
from torch import nn

from gpsd.dpkl import DPKLClassifier


def _net(d_in=4, d_out=2):
    return nn.Sequential(nn.Linear(d_in, 8), nn.Tanh(), nn.Linear(8, d_out))


def _blobs(n=60):
    torch.set_default_dtype(torch.float64)
    y = torch.arange(n) % 3
    centres = torch.tensor([[2.0, 0, 0, 0], [0, 2.0, 0, 0], [0, 0, 2.0, 0]])
    return centres[y] + 0.5 * torch.randn(n, 4), y


def test_probabilities_equal_loop():
    x, y = _blobs(10)
    clf = DPKLClassifier(_net, 3, num_particles=3, num_weight_particles=2)
    clf.lengthscale = 0.7
    got = clf.log_class_probabilities(x).exp()
    mods = [clf.feature_extractor.particle_module(i) for i in range(3)]
    ref = torch.zeros(2, 10, 3)
    for j in range(2):
        for i in range(10):
            ks = torch.zeros(3)
            for c in range(3):
                for mod in mods:
                    z = mod(x[i])
                    theta = clf.class_weights[j, c]
                    ks[c] += torch.exp(-((z - theta) ** 2).sum() / (2 * 0.49)).detach() / 3
            ref[j, i] = ks / ks.sum()
    torch.testing.assert_close(got.detach(), ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(clf.predict_proba(x), ref.mean(0))
    nll = -torch.log(ref.mean(0)[torch.arange(10), y]).mean()
    assert math.isclose(clf.nll(x, y), float(nll), rel_tol=1e-10)


def test_far_points_do_not_give_nan():
    clf = DPKLClassifier(_net, 3, num_particles=2)
    clf.lengthscale = 1e-3  # every kernel value underflows in linear space
    p = clf.predict_proba(torch.randn(5, 4) * 10)
    assert torch.isfinite(p).all()
    torch.testing.assert_close(p.sum(-1), torch.ones(5))


def test_fit_learns_blobs_with_early_stopping():
    x, y = _blobs(90)
    xv, yv = _blobs(30)
    clf = DPKLClassifier(_net, 3, num_particles=3, num_weight_particles=3, update="svgd")
    hist = clf.fit(x, y, num_epochs=20, batch_size=16, lr=0.03, val_x=xv, val_y=yv, check_every=5)
    assert len(hist["loss"]) == 20 and len(hist["val_accuracy"]) == 5
    assert hist["loss"][-1] < hist["loss"][0]
    assert clf.accuracy(xv, yv) == max(hist["val_accuracy"])
    assert clf.accuracy(xv, yv) > 0.8


def test_state_dict_roundtrip():
    x, _ = _blobs(8)
    a = DPKLClassifier(_net, 3, num_particles=2)
    b = DPKLClassifier(_net, 3, num_particles=2)
    b.load_state_dict(a.state_dict())
    torch.testing.assert_close(a.predict_proba(x), b.predict_proba(x))


def test_errors():
    x, y = _blobs(12)
    with pytest.raises(ValueError, match="num_particles"):
        DPKLClassifier(_net, 3, num_particles=0)
    with pytest.raises(ValueError, match="num_classes"):
        DPKLClassifier(_net, 1)
    clf = DPKLClassifier(lambda: _net(4, 3), 3, latent_dim=2)
    with pytest.raises(ValueError, match="latent_dim"):
        clf.predict_proba(x)
    clf = DPKLClassifier(_net, 3)
    with pytest.raises(ValueError, match="labels in 0..2"):
        clf.fit(x, y + 1, num_epochs=1)
    bad = x.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="x must be finite"):
        clf.fit(bad, y, num_epochs=1)
    with pytest.raises(ValueError, match="features"):
        clf.fit(torch.randn(12, 5), y, num_epochs=1)
    for call in (clf.predict_proba, lambda x: clf.nll(x, y), lambda x: clf.accuracy(x, y)):
        with pytest.raises(ValueError, match="x with 5 features"):
            call(torch.randn(12, 5))
    with pytest.raises(ValueError, match="x must hold at least 1 row"):
        clf.nll(x[:0], y[:0])
    with pytest.raises(ValueError, match="x must hold at least 1 row"):
        clf.accuracy(x[:0], y[:0])
    assert clf.predict_proba(x[:0]).shape == (0, 3)
    for bandwidth in (-2.0, 0.0, float("nan"), "mean", True):
        with pytest.raises(ValueError, match="bandwidth"):
            DPKLClassifier(_net, 3, bandwidth=bandwidth)
    for prior_std in (True, 0.0, "1"):  # True was taken as 1.0
        with pytest.raises(ValueError, match="prior_std must be a positive float"):
            DPKLClassifier(_net, 3, prior_std=prior_std)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_epochs=-1), "num_epochs must be a non-negative int"),
        (dict(batch_size=0), "batch_size must be a positive int"),
        (dict(batch_size=-4), "batch_size"),
        (dict(batch_size=8.0), "batch_size"),
        (dict(check_every=0), "check_every must be a positive int"),
        (dict(lr=0.0), "lr must be a positive float"),
        (dict(lr=float("inf")), "lr"),
        (dict(lr=True), "lr must be a positive float"),  # was taken as 1.0
        (dict(lr="0.01"), "lr must be a positive float"),
    ],
)
def test_fit_names_the_bad_argument(kwargs, match):
    # a negative batch_size used to skip every minibatch: "training" that changed nothing
    x, y = _blobs(12)
    clf = DPKLClassifier(_net, 3, num_particles=2, num_weight_particles=2)
    with pytest.raises(ValueError, match=match):
        clf.fit(x, y, **kwargs)
